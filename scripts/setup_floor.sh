#!/usr/bin/env bash
# Set up .venv-floor: the oldest torch that pyproject declares (torch==2.2.2), held there by a constraint so
# that installing the project cannot upgrade it, then the project with its test extras.
#
# torch < 2.13 has no CPU build that CI can install (download.pytorch.org is not reachable, the machine's
# disk holds CPU wheels of 2.13 only), so this pulls 2.2.2's CUDA build from PyPI (~2.5 GB of NVIDIA
# libraries, 5 GB installed); it runs on the CPU without a GPU. Measured: about 4 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-floor
FLOOR=${FLOOR_TORCH:-2.2.2}
[ -x $VENV/bin/python ] || "$PY" -m venv $VENV
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip() { $VENV/bin/python -m pip "$@" 2>&1 | grep -v "^WARNING: Location" || return "${PIPESTATUS[0]}"; }
mkdir -p artifacts
# numpy 2 came after torch 2.2, whose wheels were built against numpy 1; transformers 5 needs torch 2.6+
# (4.57 is the last line that runs on 2.2).
printf 'torch==%s\nnumpy<2\ntransformers<5\n' "$FLOOR" > artifacts/floor-constraints.txt
pip install -q -c artifacts/floor-constraints.txt torch numpy
pip install -q -c artifacts/floor-constraints.txt -e ".[test]"
$VENV/bin/python - "$FLOOR" <<'PY'
import sys, torch, cuda_magic, IPython, ipywidgets, pandas, nbclient
assert torch.__version__.split("+")[0] == sys.argv[1], (torch.__version__, sys.argv[1])
print("floor env: torch", torch.__version__, "IPython", IPython.__version__, "ipywidgets", ipywidgets.__version__)
PY
