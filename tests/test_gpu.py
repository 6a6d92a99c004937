"""The checks of scripts/gpu_check.py, run by pytest where a CUDA GPU exists."""
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.cuda


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_checks_pass():
    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAIL" not in result.stdout


def test_gpu_check_skips_cleanly_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the real checks run instead")
    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    sys.path.insert(0, str(script.parent))
    try:
        from gpu_check import CHECKS
    finally:
        sys.path.remove(str(script.parent))
    for name, _ in CHECKS:                      # every check says it was skipped, none crashed
        assert f"SKIP  {name}: no CUDA GPU here" in result.stdout, result.stdout
    assert "torch " in result.stdout.splitlines()[0]   # the header names torch and the driver


def test_gpu_check_help_lists_the_checks():
    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for name in ("context", "gauge", "watch", "oom-cap", "oom-uncapped", "backward", "cudnn", "ring", "freecuda",
                 "processes", "oomguard-on", "retry"):
        assert f"  {name}: " in result.stdout, name
