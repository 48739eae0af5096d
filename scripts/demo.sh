#!/usr/bin/env bash
# Run the main job, exactly once through chaos (examples/exactly_once_demo.py); --plain for CI logs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./scripts/bootstrap.sh
source scripts/env.sh
exec python -m examples.exactly_once_demo "$@"
