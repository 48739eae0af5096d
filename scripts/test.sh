#!/usr/bin/env bash
# Run the test suite (all of it, or whatever pytest args are given).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./scripts/bootstrap.sh
source scripts/env.sh
exec python -m pytest -q --durations=15 "$@"
