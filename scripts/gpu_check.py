"""Checks that need a real CUDA GPU, in a real IPython shell. Skips cleanly (exit 0) without one.

    python scripts/gpu_check.py [--out docs/gpu-check.txt]

1. `%load_ext cuda_magic` and `%gpumem` create no CUDA context before torch uses CUDA.
2. `%gpumem` figures agree with NVML's within 2 MiB.
3. A real OOM under a memory cap (`%%oomguard -l`) is recovered to the baseline `memory_allocated()`.
4. `%freecuda` returns cached memory to NVML's free figure.
Prints one line per check and the torch / driver versions; exit status 1 if any check failed.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

MiB = 1024**2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="cuda_magic checks on a real GPU")
    parser.add_argument("--out", default=None, help="also write the report to this file")
    args = parser.parse_args(argv)
    lines: list[str] = []
    failed = 0

    def report(ok: bool | None, what: str) -> None:
        nonlocal failed
        mark = {True: "PASS", False: "FAIL", None: "SKIP"}[ok]
        failed += ok is False
        lines.append(f"{mark}  {what}")
        print(lines[-1], flush=True)

    from IPython.testing.globalipapp import get_ipython

    ip = get_ipython()
    ip.run_line_magic("load_ext", "cuda_magic")
    import torch

    lines.append(f"date {time.strftime('%Y-%m-%d %H:%M:%S')}  torch {torch.__version__}  python {sys.version.split()[0]}")
    if not torch.cuda.is_available():
        report(None, "no CUDA GPU here: nothing to check")
        return _finish(lines, args.out, 0)
    import pynvml

    pynvml.nvmlInit()
    driver = pynvml.nvmlSystemGetDriverVersion()
    handle = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0))
    lines.append(f"driver {driver}  cuda {torch.version.cuda}  gpu {torch.cuda.get_device_name(0)}")
    print(lines[-1])

    # 1. no context from loading and %gpumem
    ip.run_cell("import torch")
    ip.run_line_magic("gpumem", "-q")
    report(not torch.cuda.is_initialized(), "%load_ext and %gpumem create no CUDA context")

    # 2. figures against NVML
    ip.run_cell("keep = torch.ones(256 * 2**20 // 4, device='cuda')")
    torch.cuda.synchronize()
    snap = ip.run_line_magic("gpumem", "-q -o")
    dev = snap.device("cuda:0")
    mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
    ok = abs(dev.capacity - mem.total) <= 2 * MiB and abs(dev.free - mem.free) <= 2 * MiB
    report(ok, f"%gpumem vs NVML: capacity {dev.capacity} vs {mem.total}, free {dev.free} vs {mem.free}")
    parts = sum(v for v in dev.parts().values() if v is not None)
    report(parts == dev.capacity, f"device parts add up to the capacity ({parts} of {dev.capacity})")

    # 3. a real OOM under a cap, recovered to the baseline
    baseline = torch.cuda.memory_allocated()
    ip.run_cell("import weakref\nrefs = []\n"
                "def grow():\n    a = torch.ones(512 * 2**20 // 4, device='cuda')\n    refs.append(weakref.ref(a))\n"
                "    b = torch.empty(8 * 2**30, dtype=torch.uint8, device='cuda')\n")
    result = ip.run_cell("%%oomguard -l 2GiB --no-raise -o\ngrow()")
    guard = result.result
    after = torch.cuda.memory_allocated()
    alive = ip.user_ns["refs"][0]() is not None
    report(guard is not None and guard.outcome == "oom" and after == baseline and not alive,
           f"real OOM under -l 2GiB recovered: allocated {after} vs baseline {baseline}, tensor freed: {not alive}")
    fraction = torch.cuda.get_per_process_memory_fraction(0) if hasattr(torch.cuda, "get_per_process_memory_fraction") else None
    report(fraction in (None, 1.0), f"memory fraction restored after -l ({fraction})")

    # 4. %freecuda gives cached memory back to NVML's free figure
    ip.run_cell("tmp = torch.empty(1024 * 2**20, dtype=torch.uint8, device='cuda'); del tmp")
    torch.cuda.synchronize()
    cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    free_before = pynvml.nvmlDeviceGetMemoryInfo(handle).free
    ip.run_line_magic("freecuda", "-q")
    free_after = pynvml.nvmlDeviceGetMemoryInfo(handle).free
    report(free_after - free_before >= cached - 2 * MiB,
           f"%freecuda returned {free_after - free_before} bytes to NVML's free figure (cached was {cached})")
    return _finish(lines, args.out, 1 if failed else 0)


def _finish(lines, out, status) -> int:
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as fh:
            fh.write("\n".join(lines) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
