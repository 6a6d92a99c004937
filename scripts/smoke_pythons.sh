#!/usr/bin/env bash
# The magics' smoke test under Python 3.10 (the floor) and 3.13 (Colab's), each with Colab's pinned
# notebook stack (scripts/colab-pins.txt: IPython 7.34, ipywidgets 7.7.1, pandas 2.2.3, ...).
#
# Not in CI: torch has no CPU build for these Pythons that CI can install (CI's disk holds the CPU build
# for 3.11 only, download.pytorch.org is not reachable, and PyPI serves torch for Linux only as CUDA
# builds that pull several GB of NVIDIA libraries; for torch >= 2.8 those need cuDNN wheels PyPI's mirror
# here lacks). So this script installs torch 2.7.1's CUDA build (it runs on the CPU without a GPU) and
# writes what it saw to docs/smoke-pythons-<date>.txt, which is committed.
#
#   bash scripts/smoke_pythons.sh [PYTHON ...]     # default: python3.10 python3.13
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=${SMOKE_TORCH:-torch==2.7.1}
PINS=scripts/colab-pins.txt
OUT=docs/smoke-pythons-$(date -u +%F).txt
TESTS=(tests/test_import.py tests/test_extension.py tests/test_gpumem.py tests/test_guard_magic.py
       tests/test_oomguard_on.py tests/test_freecuda_magic.py tests/test_retry_magic.py)
find_python() {   # an interpreter for version $1: pyenv's, uv's, or one on PATH
    local found
    for found in "$(pyenv root 2>/dev/null)"/versions/"$1".*/bin/python"$1" \
                 "$(uv python find "$1" 2>/dev/null)" "$(command -v python"$1" 2>/dev/null)"; do
        [ -x "$found" ] && "$found" -c "" 2>/dev/null && { echo "$found"; return; }
    done
    echo "python$1"
}
pythons=("$@")
[ ${#pythons[@]} -gt 0 ] || pythons=("$(find_python 3.10)" "$(find_python 3.13)")
export PIP_DISABLE_PIP_VERSION_CHECK=1

run() {   # one Python: a venv, torch, the pins, the project (checked to change no pin), the tests
    local py=$1 venv t0=$SECONDS
    venv=.venv-smoke-$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])') || return
    [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
    local pip=("$venv/bin/python" -m pip)
    "${pip[@]}" install -q "$TORCH" 2>&1 | grep -v "^WARNING: Location" || true
    "${pip[@]}" install -q -r $PINS 2>&1 | grep -v "^WARNING: Location" || true
    "$venv/bin/python" scripts/check_pins.py $PINS --installed || return
    "${pip[@]}" install -q --dry-run --report "$venv/report.json" . 2>&1 | grep -v "^WARNING: Location" || true
    "$venv/bin/python" scripts/check_pins.py $PINS "$venv/report.json" || return
    "${pip[@]}" install -q -c $PINS -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
    echo "installed in $((SECONDS - t0)) s:"
    "$venv/bin/python" - <<'PY' || return
import sys, torch, IPython, ipywidgets, ipykernel, pandas
print(f"  Python {sys.version.split()[0]}, torch {torch.__version__} (CUDA available: {torch.cuda.is_available()}),"
      f" IPython {IPython.__version__}, ipywidgets {ipywidgets.__version__}, ipykernel {ipykernel.__version__},"
      f" pandas {pandas.__version__}")
PY
    # The summary (each failure and skip by name, the counts); the whole log goes to artifacts/.
    mkdir -p artifacts
    "$venv/bin/python" -m pytest -q -p no:cacheprovider -rfEs "${TESTS[@]}" > "artifacts/smoke-$venv.log" 2>&1
    local rc=$?
    grep -E "^(FAILED|ERROR|SKIPPED) |^E   |[0-9]+ (passed|failed)" "artifacts/smoke-$venv.log" | cut -c1-300
    return $rc
}

{
    echo "scripts/smoke_pythons.sh, $(date -u '+%F %H:%M UTC'), commit $(git rev-parse --short HEAD), $TORCH"
    status=0
    for py in "${pythons[@]}"; do
        echo
        echo "== $py"
        run "$py" || { status=$?; echo "FAILED under $py (exit $status)"; }
    done
    exit $status
} 2>&1 | tee "$OUT"
exit "${PIPESTATUS[0]}"
