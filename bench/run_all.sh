#!/usr/bin/env bash
# Runs every benchmark under bench/ and prints their markdown tables, each with the command behind it.
#   bench/run_all.sh            (from the repository root or anywhere; uses .venv/bin/python)
#   PYTHON=python3 bench/run_all.sh
# bench_census.py compares with pytorch_memlab where it is installed (pip install pytorch_memlab); it is
# not a dependency of cuda_magic, and without it that row says so.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
for bench in bench_census bench_watch bench_guard bench_restart bench_retry bench_retry_training bench_live bench_blackbox bench_distributed bench_snapshot; do
    if [ -f "bench/$bench.py" ]; then
        echo "## $bench"
        echo
        "$PYTHON" "bench/$bench.py"
        echo
    fi
done
