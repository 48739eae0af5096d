#!/usr/bin/env bash
# Run the exactly-once demo (examples/exactly_once_demo.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
./scripts/bootstrap.sh
source scripts/env.sh
exec python -m examples.exactly_once_demo "$@"
