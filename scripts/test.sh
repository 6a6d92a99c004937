#!/usr/bin/env bash
# Run the whole test suite (no GPU needed: the simulated device makes out-of-memory real on the CPU).
# In .venv (scripts/setup.sh); CUDA_MAGIC_VENV=.venv-colab runs it in Colab's pinned stack instead
# (scripts/setup_colab.sh). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${CUDA_MAGIC_VENV:-.venv}
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
