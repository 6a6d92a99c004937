"""Checks that need a real CUDA GPU, in a real IPython shell. Skips cleanly (exit 0) without one.

    python scripts/gpu_check.py [--out docs/gpu-check-YYYY-MM-DD.txt]

Each line is PASS, FAIL or SKIP; exit status 1 if any check failed. What a GPU can show of issue 10:
 1. `%load_ext cuda_magic`, `%gpumem` and `%gpumem --processes` create no CUDA context (finding 8), and
    the process list does not crash on this driver / nvidia-ml-py pair (2).
 2. The capacity `%gpumem` shows before torch starts CUDA (NVML's v2 total less reserved memory) is the
    one torch reports once it has started (3).
 3. With CUDA started, `%gpumem` agrees with torch's own figures (`mem_get_info`, `memory_allocated`,
    `memory_reserved`) and its parts add up (4); each `cuda:N` is the NVML device of torch's UUID for N,
    also where CUDA_VISIBLE_DEVICES lists UUIDs or the order is fastest first (4, 5); this process is
    listed once per GPU (13).
 4. `%gpumem --watch` records the cell that starts CUDA as a CUDA cell with its exact peak (12).
 5. A real OOM under `%%oomguard -l` is recovered to the baseline, raises torch's OutOfMemoryError class
    (1), and the memory fraction in force before (the user's own) is put back (7).
 6. `%freecuda` returns cached memory to the device (NVML's free figure).
 7. Switching expandable_segments on is reported as it is in force (9).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

MiB = 1024**2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="cuda_magic checks on a real GPU")
    parser.add_argument("--out", default=None, help="also write the report to this file")
    args = parser.parse_args(argv)
    lines: list[str] = []
    failed = 0

    def say(text: str) -> None:
        lines.append(text)
        print(text, flush=True)

    def report(ok: bool | None, what: str) -> None:
        nonlocal failed
        failed += ok is False
        mark = {True: "PASS", False: "FAIL", None: "SKIP"}[ok]
        say(f"{mark}  {what}")

    def check(name: str, fn) -> None:
        """Run one numbered check; an exception is that check's FAIL, not the end of the script."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a crash is a finding to report, then go on
            report(False, f"{name}: raised {type(exc).__name__}: {exc}")
            say("      " + traceback.format_exc().strip().replace("\n", "\n      "))

    from IPython.testing.globalipapp import get_ipython

    ip = get_ipython()
    ip.run_line_magic("load_ext", "cuda_magic")
    import torch

    say(f"date {time.strftime('%Y-%m-%d %H:%M:%S %Z')}  torch {torch.__version__}  python "
        f"{sys.version.split()[0]}  CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}  "
        f"CUDA_DEVICE_ORDER={os.environ.get('CUDA_DEVICE_ORDER')!r}")
    if torch.cuda.device_count() == 0:      # NVML-based: no CUDA context, no driver initialisation
        report(None, "no CUDA GPU here: nothing to check")
        return _finish(lines, args.out, 0)
    import pynvml

    pynvml.nvmlInit()
    try:
        from importlib.metadata import version

        bindings = version("nvidia-ml-py")
    except Exception:
        bindings = "?"
    say(f"driver {_text(pynvml.nvmlSystemGetDriverVersion())}  nvidia-ml-py {bindings}  cuda "
        f"{torch.version.cuda}  hip {torch.version.hip}  GPUs torch sees: {torch.cuda.device_count()}")
    ip.run_cell("import torch")
    state: dict = {}

    def no_context():
        snap = ip.run_line_magic("gpumem", "-q -o --processes")
        state["before"] = {d.key: d.capacity for d in snap.device_list if d.kind == "cuda"}
        report(not torch.cuda.is_initialized(), "1. %load_ext, %gpumem and --processes create no CUDA context")
        report(bool(state["before"]), f"1. %gpumem lists the GPUs before CUDA starts: {state['before']}")

    def watch_first_cuda_cell():
        ip.run_line_magic("gpumem", "--watch -q")
        ip.run_cell("keep = torch.ones(256 * 2**20 // 4, device='cuda')")
        ip.run_line_magic("gpumem", "--unwatch -q")
        row = ip.run_line_magic("gpumem", "--history -o -q").to_dict("records")[-1]
        report(row["device"] == "cuda:0" and row["peak"] is not None and row["peak"] >= 256 * MiB,
               f"4. the cell that starts CUDA is recorded on cuda:0 with its peak: {row}")

    def capacity_unchanged():
        if "keep" not in ip.user_ns:
            ip.run_cell("keep = torch.ones(256 * 2**20 // 4, device='cuda')")
        torch.cuda.synchronize()
        snap = ip.run_line_magic("gpumem", "-q -o")
        for dev in (d for d in snap.device_list if d.kind == "cuda"):
            i = int(dev.key.split(":")[1])
            if not torch._C._cuda_hasPrimaryContext(i):
                continue
            before = state.get("before", {}).get(dev.key)
            _, total = torch.cuda.mem_get_info(i)
            report(before is not None and abs(before - total) <= 2 * MiB,
                   f"2. {dev.key} capacity before CUDA started {before} vs torch's total {total}")

    def figures_and_mapping():
        snap = ip.run_line_magic("gpumem", "-q -o --processes")
        me = os.getpid()
        for dev in (d for d in snap.device_list if d.kind == "cuda"):
            i = int(dev.key.split(":")[1])
            if torch._C._cuda_hasPrimaryContext(i):
                free, total = torch.cuda.mem_get_info(i)
                allocated, reserved = torch.cuda.memory_allocated(i), torch.cuda.memory_reserved(i)
                ok = (abs(dev.capacity - total) <= 2 * MiB and abs(dev.free - free) <= 2 * MiB
                      and dev.torch_allocated == allocated and dev.torch_cached == reserved - allocated)
                report(ok, f"3. {dev.key} vs torch: capacity {dev.capacity}/{total}, free {dev.free}/{free}, "
                           f"allocated {dev.torch_allocated}/{allocated}, cached {dev.torch_cached}/"
                           f"{reserved - allocated}")
                parts = sum(v for v in dev.parts().values() if v is not None)
                report(parts == dev.capacity, f"3. {dev.key} parts add up ({parts} of {dev.capacity})")
            uuid = getattr(torch.cuda.get_device_properties(i), "uuid", None)
            if uuid is None:
                report(None, f"3. {dev.key}: torch {torch.__version__} reports no UUID (2.4+): mapping unchecked")
                continue
            text = str(uuid)
            text = text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(text)
            except pynvml.NVMLError as exc:
                report(None, f"3. {dev.key}: NVML has no device {text} ({exc}; a MIG instance?)")
                continue
            report(_text(pynvml.nvmlDeviceGetName(handle)) == dev.name,
                   f"3. {dev.key} is NVML's {text}: {dev.name!r}")
        mine = [(p.device, p.pid) for p in snap.processes if p.pid == me]
        report((bool(mine) and len(mine) == len(set(mine))) or not snap.processes,
               f"3. this process listed once per GPU it uses: {mine}")

    def oom_under_cap():
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        torch.cuda.set_per_process_memory_fraction(0.9, 0)      # the user's own cap, to be put back
        baseline = torch.cuda.memory_allocated()
        ip.run_cell("import weakref\nrefs = []\n"
                    "def grow():\n    a = torch.ones(512 * 2**20 // 4, device='cuda')\n"
                    "    refs.append(weakref.ref(a))\n"
                    "    b = torch.empty(8 * 2**30, dtype=torch.uint8, device='cuda')\n")
        result = ip.run_cell("%%oomguard -l 2GiB -q\ngrow()")
        err = result.error_in_exec
        from cuda_magic.devices.errors import oom_error_class

        report(isinstance(err, oom_error_class(torch)),
               f"5. the short error is torch's OOM class: {type(err).__mro__[:3]}")
        del err, result
        ip.run_cell("pass")
        after = torch.cuda.memory_allocated()
        alive = ip.user_ns["refs"][0]() is not None
        report(after == baseline and not alive,
               f"5. real OOM under -l 2GiB recovered: allocated {after} vs baseline {baseline}, freed: {not alive}")
        if getter is None:
            report(None, f"5. torch {torch.__version__} has no get_per_process_memory_fraction (2.6+)")
        else:
            fraction = getter(0)
            report(abs(fraction - 0.9) < 1e-9, f"5. the fraction in force before -l is back: {fraction}")
        torch.cuda.set_per_process_memory_fraction(1.0, 0)

    def freecuda():
        ip.run_cell("tmp = torch.empty(1024 * 2**20, dtype=torch.uint8, device='cuda'); del tmp")
        torch.cuda.synchronize()
        cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        handle = _handle_of(pynvml, torch, 0)
        free_before = pynvml.nvmlDeviceGetMemoryInfo(handle).free
        ip.run_line_magic("freecuda", "-q")
        free_after = pynvml.nvmlDeviceGetMemoryInfo(handle).free
        report(free_after - free_before >= cached - 2 * MiB,
               f"6. %freecuda returned {free_after - free_before} bytes to NVML's free figure (cached {cached})")

    def expandable():
        from cuda_magic.devices.allocator_conf import current_allocator_conf, enable_expandable_segments

        try:
            said = enable_expandable_segments()
        except RuntimeError as exc:
            report(None, f"7. expandable_segments not switched on: {exc}")
            return
        ip.run_cell("seg = torch.empty(64 * 2**20, dtype=torch.uint8, device='cuda')")
        segments = [s for s in torch.cuda.memory_snapshot() if s.get("is_expandable")]
        report(bool(segments) == ("expandable_segments:True" in current_allocator_conf()),
               f"7. {said[:60]}...: {len(segments)} expandable segment(s) after, conf {current_allocator_conf()!r}")

    def retry_training():
        """-r on a training cell on the GPU under a 2 GiB cap: the first retry is predicted from the model
        measured on slices of the failing batch (its pass sampled through a dispatch mode, the backward
        pass on autograd's device thread): 2 runs, within 15% of the largest value that fits."""
        ip.run_cell(TRAIN_SETUP)
        cell = "%%oomguard -q -o --no-raise -l 2GiB{}\n" + TRAIN_CELL

        def fits(value: int) -> bool:
            ip.run_cell(f"reset()\nbs = {value}")
            return ip.run_cell(cell.format("")).result.outcome == "ok"

        lo, hi = 1, 8192
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        ip.run_cell(f"reset()\nbs = {2 * lo}")
        rep = ip.run_cell(cell.format(" -r bs")).result
        runs, final = len(rep.attempts), rep.final_value
        why = rep.attempts[-1].reason if rep.attempts else ""
        report(runs == 2 and final is not None and 0.85 * lo <= final <= lo,
               f"8. -r from {2 * lo} on a CNN training cell under -l 2GiB: {runs} runs, bs={final} of the largest "
               f"{lo} ({(final or 0) / lo:.1%}); why: {why}")
        ip.run_cell("del model, opt, data\nreset = None")
        torch.cuda.empty_cache()

    for name, fn in (("1", no_context), ("4", watch_first_cuda_cell), ("2", capacity_unchanged),
                     ("3", figures_and_mapping), ("5", oom_under_cap), ("6", freecuda), ("7", expandable),
                     ("8", retry_training)):
        check(name, fn)
    return _finish(lines, args.out, 1 if failed else 0)


TRAIN_SETUP = """
import copy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
model = nn.Sequential(nn.Conv2d(3, 64, 3, padding=1, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                      nn.Conv2d(64, 128, 3, padding=1, bias=False), nn.BatchNorm2d(128), nn.ReLU(),
                      nn.MaxPool2d(2), nn.Conv2d(128, 128, 3, padding=1), nn.ReLU(),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
data = TensorDataset(torch.randint(0, 256, (8192, 3, 64, 64), dtype=torch.uint8), torch.randint(0, 10, (8192,)))
start = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))

def reset():
    for name in ("x", "xb", "yb", "loss", "loader"):
        globals().pop(name, None)
    model.load_state_dict(start[0]); opt.load_state_dict(copy.deepcopy(start[1]))
    for p in model.parameters():
        p.grad = None
"""

TRAIN_CELL = """model.train()
loader = DataLoader(data, batch_size=bs, shuffle=True)
for step, (xb, yb) in enumerate(loader):
    if step == 3:
        break
    x = xb.cuda().float().div_(255)
    loss = nn.functional.cross_entropy(model(x), yb.cuda())
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def _text(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _handle_of(pynvml, torch, index: int):
    """NVML's handle of torch's CUDA device `index`, by the UUID torch reports (2.4+); by the package's
    reading of CUDA_VISIBLE_DEVICES otherwise (never by parsing the variable as numbers here)."""
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is not None:
        text = str(uuid)
        return pynvml.nvmlDeviceGetHandleByUUID(text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}")
    from cuda_magic.devices.nvml import get_nvml, visible_nvml_devices

    devices, _ = visible_nvml_devices(get_nvml())
    return pynvml.nvmlDeviceGetHandleByIndex(devices[index].nvml_index)


def _finish(lines, out, status) -> int:
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as fh:
            fh.write("\n".join(lines) + "\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
