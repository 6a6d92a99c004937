#!/usr/bin/env bash
# Set up .venv-colab: Colab's pinned notebook stack (scripts/colab-pins.txt: IPython 7.34, ipywidgets 7.7,
# ipykernel 6.17, Notebook 6.5, pandas 2.2, ...) on this machine's Python with torch's CPU build, then check
# that installing the project changes none of the pinned packages, then install it with its test extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-colab
PINS=scripts/colab-pins.txt
[ -x $VENV/bin/python ] || "$PY" -m venv $VENV
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip() { $VENV/bin/python -m pip "$@" 2>&1 | grep -v "^WARNING: Location" || return "${PIPESTATUS[0]}"; }
# The CPU build first (Colab has torch 2.11.0+cu128; the CPU build 2.13.0 is what CI can install quickly).
pip install -q torch==2.13.0
$VENV/bin/python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0 \
    --index-url https://download.pytorch.org/whl/cpu
# Colab's environment as Colab has it, before the project is installed.
pip install -q -r $PINS
$VENV/bin/python scripts/check_pins.py $PINS --installed
# What `pip install cuda-magic` would do in it: nothing pinned may change.
mkdir -p artifacts
pip install -q --dry-run --report artifacts/colab-pip-report.json .
$VENV/bin/python scripts/check_pins.py $PINS artifacts/colab-pip-report.json
# The project and its test tools, the pins as constraints (pip fails rather than change one).
pip install -q -c $PINS -e ".[test]"
$VENV/bin/python scripts/check_pins.py $PINS --installed
$VENV/bin/python -c "import cuda_magic, torch, IPython, ipywidgets, pandas, nbclient, notebook"
