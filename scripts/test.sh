#!/usr/bin/env bash
# Run the test suite (all of it, or whatever pytest args are given), in TWOPHASE_TEST_WORKERS processes
# (default 2; 0 runs it in this one). Each worker starts its own ZooKeeper, PostgreSQL and Spark session
# when a test needs one; a file's tests stay on one worker (--dist loadfile).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./scripts/bootstrap.sh
source scripts/env.sh
workers="${TWOPHASE_TEST_WORKERS:-2}"
exec python -m pytest -q --durations=15 -n "$workers" --dist loadfile "$@"
