#!/usr/bin/env bash
# Set up a virtual environment in .venv with the CPU build of torch and the project (with test extras).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
export PIP_DISABLE_PIP_VERSION_CHECK=1
# The CPU build first: a bare torch requirement would pull a CUDA build of several GB.
.venv/bin/python -m pip install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q torch==2.13.0 \
    --index-url https://download.pytorch.org/whl/cpu
.venv/bin/python -m pip install -q -e ".[test,lab]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import cuda_magic, torch, IPython, ipywidgets, pandas, nbclient" 


