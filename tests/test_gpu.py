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
    for name, _, _ in CHECKS:                   # every check says it was skipped, none crashed
        assert f"SKIP  {name}: no CUDA GPU here" in result.stdout, result.stdout
    assert "torch " in result.stdout.splitlines()[0]   # the header names torch and the driver


def test_gpu_check_help_lists_the_checks():
    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
    result = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    sys.path.insert(0, str(script.parent))
    try:
        from gpu_check import CHECKS
    finally:
        sys.path.remove(str(script.parent))
    for name in ("replay", "context", "gauge", "watch", "oom-cap", "oom-uncapped", "backward", "cudnn", "ring",
                 "freecuda", "processes", "oomguard-on", "retry", "predict", "allocator"):
        cost = next(c for n, c, _ in CHECKS if n == name)
        assert f"  {name} (about {cost} s on one H100): " in result.stdout, name
    # issue 38: the whole run fits in 4 minutes on one H100; the new replay check first, the check that
    # records C++ stacks (cudnn) last
    total = sum(c for _, c, _ in CHECKS)
    assert total <= 240 and f"all of them: about {total} s" in result.stdout
    assert CHECKS[0][0] == "replay" and CHECKS[-1][0] == "cudnn"


def test_gpu_check_replays_a_trace_segment_for_segment():
    # torch's snapshot trace (torch/cuda/memory.py _snapshot, device_traces; c10/cuda/CUDACachingAllocator.cpp
    # records segment_alloc in alloc_block before the alloc entry, free_completed when the block is back
    # in its pool, segment_free per segment released by empty_cache), 2.2 to 2.13
    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
    sys.path.insert(0, str(script.parent))
    try:
        from gpu_check import replay_segments
    finally:
        sys.path.remove(str(script.parent))
    from cuda_magic.devices.caching_allocator import CachingAllocatorModel

    MiB = 2**20

    def trace(cached_reuse: bool):
        events = [("segment_alloc", 1, 2 * MiB), ("alloc", 1, 1024),
                  ("segment_alloc", 10, 20 * MiB), ("alloc", 10, 5 * MiB),
                  ("free_requested", 10, 5 * MiB), ("free_completed", 10, 5 * MiB)]
        if not cached_reuse:           # a recording where the 5 MiB came from a new segment: not torch's rule
            events.append(("segment_alloc", 30, 20 * MiB))
        events += [("alloc", 10, 5 * MiB), ("segment_alloc", 100, 30 * MiB), ("alloc", 100, 30 * MiB),
                   ("free_requested", 100, 30 * MiB), ("free_completed", 100, 30 * MiB),
                   ("segment_free", 100, 30 * MiB)]
        return [dict(action=a, addr=addr, size=size) for a, addr, size in events]

    real, got = replay_segments(trace(True), CachingAllocatorModel(80 * 2**30))
    assert real == got and len(real) == 4, (real, got)
    real, got = replay_segments(trace(False), CachingAllocatorModel(80 * 2**30))
    assert real != got
