#!/usr/bin/env bash
# Run the whole test suite (no GPU needed: the simulated device makes out-of-memory real on the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
