"""The GPU paths against torch's and NVML's own APIs, faked at their public surface (torch.cuda, torch.mps,
torch.xpu and pynvml functions replaced), each in a fresh interpreter where a cached answer would hide the
fault. One test per finding of issue 10; none needs a GPU."""
from __future__ import annotations

import pytest

from fresh import run_fresh

pytest.importorskip("torch")


def test_oom_class_falls_back_to_torch_cuda_before_torch_2_4():
    # torch 2.1 to 2.3 have torch.cuda.OutOfMemoryError only
    out = run_fresh('''
        import torch
        del torch.OutOfMemoryError
        from IPython.testing.globalipapp import get_ipython
        ip = get_ipython()
        ip.run_line_magic("load_ext", "cuda_magic")
        ip.run_line_magic("gpumem", "--simulate 64MiB -q")
        ip.run_cell("import torch\\ndef grow():\\n    return torch.empty(256 * 2**20, dtype=torch.uint8)")
        result = ip.run_cell("%%oomguard -q\\ngrow()")
        err = result.error_in_exec
        assert isinstance(err, torch.cuda.OutOfMemoryError), repr(err)
        assert type(err).__module__ == "cuda_magic", type(err)
        from cuda_magic.devices.simulated import SimulatedDevice
        with SimulatedDevice(1024):
            try:
                torch.empty(4096, dtype=torch.uint8)
            except torch.cuda.OutOfMemoryError as exc:
                print("simulated", type(exc).__name__)
        print("ok")
    ''')
    assert "simulated OutOfMemoryError" in out and out.rstrip().endswith("ok")
