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
    assert "SKIP  no CUDA GPU here" in result.stdout
