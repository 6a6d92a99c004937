#!/usr/bin/env bash
# The test suite on the oldest torch pyproject declares (.venv-floor, from scripts/setup_floor.sh): all of it
# but the browser and demo tests (tests/browser, tests/test_demo.py, tests/test_binder.py), which drive
# JupyterLab and a kernel and depend on no torch API beyond what the rest covers.
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv-floor/bin/python -m pytest -q -p no:cacheprovider --ignore=tests/browser \
    --deselect tests/test_demo.py --deselect tests/test_binder.py "$@"
