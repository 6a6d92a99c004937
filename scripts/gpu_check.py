"""cuda_magic on a real GPU: a first-run script for one CUDA (or ROCm) GPU, in a real IPython shell.

    python3 scripts/gpu_check.py [--out docs/gpu-check-DATE.txt] [--only NAME[,NAME...]]

The checks run in order of truth per minute (the most telling and quickest first, the slowest last), so
a run cut short still leaves the most telling lines; each prints PASS, FAIL or SKIP with its figures, and
an exception inside one is that check's FAIL, not the end of the run. NVML is started inside the checks,
so a machine without it (ROCm) gets FAIL or SKIP lines, not a crash. Without a GPU every check is a SKIP
and the exit status is 0; otherwise it is 1 when any check failed. About 3.7 minutes on one H100
(each check's estimate: --help), within the 4 minutes it must fit in.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import textwrap
import time
import traceback

MiB = 1024**2
GiB = 1024**3
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHECKS = [
    ("replay", 25, "a small training step recorded with torch's defaults (_record_memory_history()), its snapshot "
                   "dumped and replayed through the allocator model (devices/caching_allocator.py): every "
                   "segment_alloc and segment_free equal, in order (in a subprocess, so that this one starts no "
                   "CUDA before 'context')"),
    ("context", 5, "before CUDA starts: %load_ext and %gpumem create no CUDA context (NVML lists no process for "
                   "this pid); the capacity from NVML's v2 memory against torch.cuda.mem_get_info once started "
                   "(within 2 MiB)"),
    ("gauge", 3, "the live gauge's reader before and after CUDA starts: its figures against torch's and NVML's"),
    ("watch", 3, "%gpumem --watch: a cell's peak equals torch.cuda.max_memory_allocated() read at its end"),
    ("oom-cap", 5, "a real OOM under -l: the black box's failing request and its line, the by-line row of the big "
                   "tensor at its size, allocated at the failure against the message's 'allocated by PyTorch'"),
    ("oom-uncapped", 3, "torch.empty far beyond the card: the parsed fields against mem_get_info, memory_allocated "
                        "and memory_reserved"),
    ("backward", 8, "an OOM in loss.backward() under -l (the forward pass fits; -l empties the cache first, so "
                    "the cap holds): the backward phase, the cell line of backward(), a training advice"),
    ("ring", 12, "tens of thousands of alloc/free pairs overflow the history's ring, then an OOM: allocated at the "
                 "failure and the by-line total against torch's figure"),
    ("freecuda", 5, "%freecuda gives the cache back (NVML's free figure); expandable_segments switched on at "
                    "runtime (a RuntimeError is a FAIL), then off again for the later checks"),
    ("processes", 35, "subprocesses: backend:cudaMallocAsync with a guarded cell and -l (the fraction restored "
                      "without error); CUDA_VISIBLE_DEVICES as a GPU-UUID prefix, 0 and empty; a second process "
                      "holding 2 GiB (the other-process figure, --processes, the message's 'Process N has ...'; "
                      "found by its memory where NVML lists host pids, in a container)"),
    ("oomguard-on", 20, "%oomguard on with a real OOM; a notebook through nbclient with a 2 s guarded cell (the "
                        "widget and the gauge's outputs present)"),
    ("retry", 35, "-r on a CNN training cell under -l: 2 runs, within 15% of the largest value that fits (found "
                  "to 3%), the model and optimizer close to one clean run at the value found (cuDNN's "
                  "convolutions and NLLLoss are not deterministic on CUDA: a tolerance, not equality)"),
    ("predict", 30, "%%oomguard --predict on the CNN training cell: torch's allocated and reserved figures do not "
                    "move during the prediction, the predicted peak against the real run's max_memory_allocated "
                    "(within 5% and the 64 MiB cuDNN may take for workspaces, which a fake run has not), and -r "
                    "under -l: the predicted value fits when run"),
    ("allocator", 20, "the simulated caching allocator against torch's: the same training cells' allocations "
                      "replayed on a simulated device, its peak reserved against torch.cuda.max_memory_reserved "
                      "(within 5% and cuDNN's 64 MiB)"),
    ("cudnn", 15, "a convolution under a tight cap with --timeline: the out-of-memory errors cuDNN caught itself "
                  "against the oom entries of torch's own _snapshot() (recorded with Python stacks only: "
                  "symbolising C++ frames takes minutes)"),
]


def parse_args(argv):
    listed = "\n".join(textwrap.fill(f"{name} (about {cost} s on one H100): {what}", 100, initial_indent="  ",
                                      subsequent_indent="      ") for name, cost, what in CHECKS)
    listed += f"\n  all of them: about {sum(c for _, c, _ in CHECKS)} s"
    parser = argparse.ArgumentParser(
        description="cuda_magic's checks on a real GPU, in order (each PASS, FAIL or SKIP with its figures)",
        epilog="the checks:\n" + listed, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, metavar="FILE", help="also write the report to this file")
    parser.add_argument("--only", default=None, metavar="NAMES",
                        help="run only these checks (comma-separated names from the list below)")
    args = parser.parse_args(argv)
    if args.only:
        unknown = set(args.only.split(",")) - {n for n, _, _ in CHECKS}
        if unknown:
            parser.error(f"no check named {', '.join(sorted(unknown))}")
    return args


class Report:
    def __init__(self, out):
        self.out = out
        self.lines: list[str] = []
        self.failed = 0

    def say(self, text: str) -> None:
        self.lines.append(text)
        print(text, flush=True)

    def check(self, ok, name: str, what: str) -> None:
        self.failed += ok is False
        self.say(f"{ {True: 'PASS', False: 'FAIL', None: 'SKIP'}[ok] }  {name}: {what}")

    def finish(self) -> int:
        if self.out:
            os.makedirs(os.path.dirname(self.out) or ".", exist_ok=True)
            with open(self.out, "w") as fh:
                fh.write("\n".join(self.lines) + "\n")
        return 1 if self.failed else 0


def main(argv=None) -> int:
    args = parse_args(argv)
    report = Report(args.out)
    from IPython.testing.globalipapp import get_ipython

    ip = get_ipython()
    ip.run_line_magic("load_ext", "cuda_magic")
    import torch

    report.say(f"date {time.strftime('%Y-%m-%d %H:%M:%S %Z')}  python {sys.version.split()[0]}  torch "
               f"{torch.__version__}  cuda {torch.version.cuda}  hip {torch.version.hip}  "
               f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}")
    count = torch.cuda.device_count()            # NVML-based before CUDA starts: no context made
    report.say(f"driver {_driver()}  GPUs torch sees: {count}  {_names()}")
    wanted = set(args.only.split(",")) if args.only else {n for n, _, _ in CHECKS}
    if count == 0:
        for name, _, _ in CHECKS:
            if name in wanted:
                report.check(None, name, "no CUDA GPU here: nothing to check")
        return report.finish()
    checks = Checks(ip, torch, report)
    for name, _, _ in CHECKS:
        if name not in wanted:
            continue
        started = time.perf_counter()
        try:
            getattr(checks, name.replace("-", "_"))()
        except Exception as exc:  # noqa: BLE001 - a crash is a finding: report it and go on
            report.check(False, name, f"raised {type(exc).__name__}: {exc}")
            report.say("      " + traceback.format_exc().strip().replace("\n", "\n      "))
        finally:
            ip.run_cell("%oomguard off", store_history=False)
            ip.run_line_magic("freecuda", "-q")
        report.say(f"      ({time.perf_counter() - started:.1f} s)")
    return report.finish()


def _driver() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception as exc:  # noqa: BLE001 - NVML missing (ROCm) or broken: said, not fatal
        return f"unknown (NVML: {type(exc).__name__}: {exc})"


def _names() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
            out.append(f"[{i}] {name.decode() if isinstance(name, bytes) else name} {total / GiB:.1f} GiB")
        return " ".join(out)
    except Exception as exc:  # noqa: BLE001
        return f"(NVML: {type(exc).__name__})"


def _within(a, b, slack=2 * MiB) -> bool:
    return a is not None and b is not None and abs(int(a) - int(b)) <= slack


class Checks:
    """One method per check, named as in CHECKS. Each reports PASS/FAIL/SKIP with the figures it compared."""

    def __init__(self, ip, torch, report):
        self.ip, self.torch, self.report = ip, torch, report
        self.state: dict = {}

    def ok(self, ok, name, what):
        self.report.check(ok, name, what)

    def run(self, cell: str):
        result = self.ip.run_cell(cell)
        return result

    # 0 ----------------------------------------------------------------------------------------------
    def replay(self):
        out = _python(REPLAY, timeout=120)
        line = next((ln for ln in out.splitlines() if ln.startswith("REPLAY")), out.strip()[-400:])
        self.ok(line.startswith("REPLAY") and " equal True" in line, "replay", line)

    # 1 ----------------------------------------------------------------------------------------------
    def context(self):
        torch, ip = self.torch, self.ip
        ip.run_cell("import torch")
        snap = ip.run_line_magic("gpumem", "-q -o --processes")
        before = {d.key: d.capacity for d in snap.device_list if d.kind == "cuda"}
        import pynvml

        pynvml.nvmlInit()
        me = os.getpid()
        listed = []
        for i in range(pynvml.nvmlDeviceGetCount()):         # every GPU NVML sees: none may list this pid
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            listed += [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle) if p.pid == me]
        self.ok(not torch.cuda.is_initialized() and not listed, "context",
                f"after %load_ext and %gpumem: torch.cuda.is_initialized()={torch.cuda.is_initialized()}, "
                f"NVML lists this pid on {len(listed)} GPU(s)")
        ip.run_cell("keep = torch.ones(64 * 2**20 // 4, device='cuda')")
        free, total = torch.cuda.mem_get_info(0)
        self.ok(_within(before.get("cuda:0"), total), "context",
                f"cuda:0 capacity before CUDA started {before.get('cuda:0')} against mem_get_info's total {total}")
        ip.run_cell("del keep")

    # 2 ----------------------------------------------------------------------------------------------
    def gauge(self):
        torch = self.torch
        from cuda_magic.devices.gauge_reader import GaugeReader
        from cuda_magic.devices.meter import CudaMeter

        reader = GaugeReader(CudaMeter(0), nvml_every=0.0)
        first = reader.read()
        x = torch.ones(256 * MiB // 4, device="cuda")
        torch.cuda.synchronize()
        second = reader.read()
        allocated = torch.cuda.memory_allocated(0)
        _, total = torch.cuda.mem_get_info(0)
        self.ok(first.allocated is not None and second.allocated == allocated and _within(second.capacity, total)
                and second.other_processes is not None, "gauge",
                f"readings {first.figures()} then {second.figures()}; torch allocated {allocated}, total {total}")
        del x

    # 3 ----------------------------------------------------------------------------------------------
    def watch(self):
        ip = self.ip
        ip.run_line_magic("gpumem", "--watch -q")
        ip.run_cell("a = torch.ones(512 * 2**20 // 4, device='cuda')\nb = torch.ones(256 * 2**20 // 4, device='cuda')\n"
                    "del a\npeak_in_cell = torch.cuda.max_memory_allocated()")
        try:
            ip.run_line_magic("gpumem", "--unwatch -q")
            rows = ip.run_line_magic("gpumem", "--history -o -q").to_dict("records")
            expected = ip.user_ns.get("peak_in_cell")
            # the history may hold one row (the watched cell) or more: the cell's is the one with the peak
            row = max(rows, key=lambda r: r.get("peak") or 0) if rows else {}
            self.ok(row.get("peak") == expected, "watch", f"--watch peak {row.get('peak')} against "
                    f"max_memory_allocated() {expected} ({len(rows)} row(s), {row})")
        finally:
            ip.run_cell("a = b = None")

    # 4 ----------------------------------------------------------------------------------------------
    def oom_cap(self):
        ip = self.ip
        result = ip.run_cell("%%oomguard -l 2GiB --no-raise -q -o\nx = torch.ones(512 * 2**20 // 4, device='cuda')\n"
                             "y = torch.empty(4 * 2**30, dtype=torch.uint8, device='cuda')\n")
        rep = result.result
        box = rep.blackbox
        failed = box.failure if box is not None else None
        rows = {u.where: u.bytes for u in (box.by_line if box else [])}
        self.ok(rep.outcome == "oom" and failed is not None and failed.site is not None
                and failed.site.where == "cell line 2", "oom-cap",
                f"failing request {failed.requested if failed else None} at "
                f"{failed.site.where if failed and failed.site else None}; notes {box.notes if box else None}")
        self.ok(_within(rows.get("cell line 1"), 512 * MiB, 4096), "oom-cap",
                f"by line at the failure: {rows} (cell line 1 made 512 MiB)")
        told = rep.oom.allocated_by_torch if rep.oom else None
        self.ok(failed is not None and _within(failed.allocated, told) and _within(box.total, told), "oom-cap",
                f"allocated at the failure: black box {failed.allocated if failed else None}, by-line total "
                f"{box.total if box else None}, the message's {told}")
        ip.run_cell("x = y = None")

    # 5 ----------------------------------------------------------------------------------------------
    def oom_uncapped(self):
        torch, ip = self.torch, self.ip
        _, total = torch.cuda.mem_get_info(0)
        ip.user_ns["far"] = int(total * 2)
        allocated, reserved = torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0)
        free, _ = torch.cuda.mem_get_info(0)
        rep = ip.run_cell("%%oomguard --no-raise -q -o\nz = torch.empty(far, dtype=torch.uint8, device='cuda')").result
        f = rep.oom
        self.ok(f is not None and _within(f.capacity, total, 64 * MiB) and _within(f.allocated_by_torch, allocated)
                and _within(f.reserved_total, reserved, 64 * MiB) and _within(f.free, free, 256 * MiB),
                "oom-uncapped",
                f"message: capacity {f.capacity if f else None} / free {f.free if f else None} / allocated "
                f"{f.allocated_by_torch if f else None} / reserved {f.reserved_total if f else None}; torch: total "
                f"{total} / free {free} / allocated {allocated} / reserved {reserved}; causes "
                f"{rep.diagnosis.causes if rep.diagnosis else None}")

    # 6 ----------------------------------------------------------------------------------------------
    def backward(self):
        ip, torch = self.ip, self.torch
        ip.run_cell("from torch import nn\ntorch.manual_seed(0)\n"
                    "net = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(4)]).cuda()\n"
                    "xb = torch.randn(8192, 4096, device='cuda')\n")
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ip.run_cell("out = net(xb).square().mean()")
        forward = torch.cuda.max_memory_allocated() - base
        ip.run_cell("out.backward()\nout = None\nfor p in net.parameters():\n    p.grad = None")
        step = torch.cuda.max_memory_allocated() - base
        cap = base + (forward + step) // 2
        rep = ip.run_cell(f"%%oomguard -l {cap}B --no-raise -q -o\nloss = net(xb).square().mean()\n"
                          "loss.backward()\n").result
        box = rep.blackbox
        f = box.failure if box else None
        advice = [a.code for a in (rep.diagnosis.advice if rep.diagnosis else [])]
        self.ok(rep.outcome == "oom" and f is not None and f.phase == "backward" and f.grad_enabled is True
                and f.site is not None and f.site.where == "cell line 2"
                and not any("generate" in (c or "") for c in advice), "backward",
                f"forward {forward} / step {step} bytes, cap {cap}: failed at "
                f"{f.site.where if f and f.site else None} phase {f.phase if f else None} grad "
                f"{f.grad_enabled if f else None}; advice {advice[:3]}")
        ip.run_cell("loss = None\nnet = xb = None")

    # 7 ----------------------------------------------------------------------------------------------
    def cudnn(self):
        ip, torch = self.ip, self.torch
        # the user's own, kept by the guard; Python stacks only (stacks="python", torch 2.1+): C++ frames
        # are symbolised at every _snapshot(), which takes minutes
        torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
        try:
            ip.run_cell("conv = torch.nn.Conv2d(64, 64, 7, padding=3).cuda()\n"
                        "img = torch.randn(64, 64, 128, 128, device='cuda')\ntorch.backends.cudnn.benchmark = True\n")
            start_us = time.time() * 1e6
            held = torch.cuda.memory_allocated()
            cap = held + 3 * 64 * 64 * 128 * 128 * 4          # room for the output and a little workspace
            rep = ip.run_cell(f"%%oomguard -l {cap}B --timeline --no-raise -q -o\nout = conv(img)\n").result
            entries = torch.cuda.memory._snapshot()["device_traces"][0]
            ooms = [e for e in entries if e.get("action") == "oom" and e.get("time_us", 0) >= start_us]
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        box = rep.blackbox
        caught = len(ooms) - (1 if rep.outcome == "oom" else 0)
        noted = any(f"caught {caught} out-of-memory" in n for n in (box.notes if box else []))
        if not ooms:
            self.ok(None, "cudnn", f"cuDNN needed no fallback under the cap ({rep.outcome}): nothing to compare")
        else:
            self.ok((caught == 0 or noted) and (rep.outcome != "oom" or box.failure is not None), "cudnn",
                    f"{len(ooms)} oom entries in torch's trace, {caught} caught; outcome {rep.outcome}; notes "
                    f"{box.notes if box else None}")
        ip.run_cell("out = conv = img = None\ntorch.backends.cudnn.benchmark = False")

    # 8 ----------------------------------------------------------------------------------------------
    def ring(self):
        ip = self.ip
        rep = ip.run_cell("%%oomguard -l 2GiB --no-raise -q -o\nw = torch.ones(256 * 2**20 // 4, device='cuda')\n"
                          "for _ in range(40000):\n    t = torch.empty(4096, device='cuda'); del t\n"
                          "acts = torch.ones(512 * 2**20 // 4, device='cuda')\n"
                          "boom = torch.empty(4 * 2**30, dtype=torch.uint8, device='cuda')\n").result
        box = rep.blackbox
        told = rep.oom.allocated_by_torch if rep.oom else None
        f = box.failure if box else None
        self.ok(f is not None and _within(f.allocated, told) and _within(box.total, told)
                and any("newest" in n for n in box.notes), "ring",
                f"allocated at the failure: black box {f.allocated if f else None}, by line {box.total if box else None}"
                f", the message's {told}; {len(box.points) if box else 0} points; notes {box.notes if box else None}")
        ip.run_cell("w = acts = None")

    # 9 ----------------------------------------------------------------------------------------------
    def freecuda(self):
        torch, ip = self.torch, self.ip
        import pynvml

        pynvml.nvmlInit()
        ip.run_cell("tmp = torch.empty(1024 * 2**20, dtype=torch.uint8, device='cuda'); del tmp")
        torch.cuda.synchronize()
        cached = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        handle = _handle_of(pynvml, torch, 0)
        free_before = pynvml.nvmlDeviceGetMemoryInfo(handle).free
        ip.run_line_magic("freecuda", "-q")
        free_after = pynvml.nvmlDeviceGetMemoryInfo(handle).free
        self.ok(free_after - free_before >= cached - 2 * MiB, "freecuda",
                f"%freecuda returned {free_after - free_before} bytes to NVML's free figure (cached {cached})")
        from cuda_magic.devices.allocator_conf import enable_expandable_segments

        said = enable_expandable_segments()                 # a RuntimeError is this check's FAIL
        try:
            ip.run_cell("seg = torch.empty(64 * 2**20, dtype=torch.uint8, device='cuda')")
            expandable = [s for s in torch.cuda.memory_snapshot() if s.get("is_expandable")]
            self.ok(bool(expandable), "freecuda", f"{said[:80]}...: {len(expandable)} expandable segment(s) after")
        finally:
            ip.run_cell("seg = None")
            _expandable_off(torch)          # the later checks measure the default allocator
            ip.run_line_magic("freecuda", "-q")

    # 10 ---------------------------------------------------------------------------------------------
    def processes(self):
        guarded = ("from IPython.testing.globalipapp import get_ipython\nip = get_ipython()\n"
                   "ip.run_line_magic('load_ext', 'cuda_magic')\nip.run_cell('import torch')\n"
                   "r = ip.run_cell('%%oomguard -l 1GiB --no-raise -q -o\\n"
                   "x = torch.empty(2 * 2**30, dtype=torch.uint8, device=\"cuda\")').result\n"
                   "f = getattr(torch.cuda, 'get_per_process_memory_fraction', lambda i=None: 1.0)(0)\n"
                   "print('OUTCOME', r.outcome, 'FRACTION', min(f, 1.0) if f > 1 else f, 'NOTES', "
                   "r.blackbox.notes if r.blackbox else None)\n")
        out = _python(guarded, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync")
        self.ok("OUTCOME oom" in out and "allocator backend keeps no history" in out and "FRACTION 1.0" in out,
                "processes", f"backend:cudaMallocAsync: {out.strip().splitlines()[-1] if out.strip() else out!r}")
        listing = ("from IPython.testing.globalipapp import get_ipython\nip = get_ipython()\n"
                   "ip.run_line_magic('load_ext', 'cuda_magic')\nimport torch\n"
                   "s = ip.run_line_magic('gpumem', '-q -o')\n"
                   "print('DEVICES', [(d.key, d.name, d.capacity) for d in s.device_list], 'STARTED', "
                   "torch.cuda.is_initialized(), 'NOTES', s.notes)\n")
        uuid = _uuid_of_cuda0()
        for value in (uuid[:12] if uuid else None, "0", ""):
            if value is None:
                self.ok(None, "processes", "no UUID from NVML: the GPU- prefix case is not checked")
                continue
            out = _python(listing, CUDA_VISIBLE_DEVICES=value)
            line = next((ln for ln in out.splitlines() if ln.startswith("DEVICES")), out.strip()[-300:])
            want_one = value != ""
            ok = ("STARTED False" in line and (("('cuda:0'" in line and "'cuda:1'" not in line) if want_one
                                                else "'cuda:" not in line))
            self.ok(ok, "processes", f"CUDA_VISIBLE_DEVICES={value!r}: {line}")
        holder = subprocess.Popen([sys.executable, "-c", "import torch, time\n"
                                   "x = torch.empty(2 * 2**30, dtype=torch.uint8, device='cuda')\n"
                                   "torch.cuda.synchronize(); print('READY', flush=True); time.sleep(120)"],
                                  stdout=subprocess.PIPE, text=True)
        try:
            holder.stdout.readline()
            time.sleep(1.0)
            snap = self.ip.run_line_magic("gpumem", "-q -o --processes")
            dev = next(d for d in snap.device_list if d.key == "cuda:0")
            pids = [p.pid for p in snap.processes if p.device == "cuda:0"]
            # in a container NVML lists host pids: the holder is then the entry not this process's with
            # its 2 GiB (devices/pids.py)
            from cuda_magic.devices.pids import in_pid_namespace

            holder_listed = holder.pid in pids or (in_pid_namespace() and any(
                not p.this_process and (p.used or 0) >= 2 * GiB for p in snap.processes if p.device == "cuda:0"))
            self.ok(dev.other_processes is not None and dev.other_processes >= 2 * GiB - 64 * MiB
                    and holder_listed, "processes",
                    f"a second process holding 2 GiB: other processes {dev.other_processes}, listed pids {pids} "
                    f"(the holder is {holder.pid})")
            _, total = self.torch.cuda.mem_get_info(0)
            self.ip.user_ns["far"] = int(total)
            rep = self.ip.run_cell("%%oomguard --no-raise -q -o\nz = torch.empty(far, dtype=torch.uint8, "
                                   "device='cuda')").result
            listed = dict(rep.oom.processes) if rep.oom else {}
            held = listed.get(holder.pid) if not in_pid_namespace() else max(
                (u for pid, u in listed.items() if u and u >= 2 * GiB - 64 * MiB), default=None)
            self.ok(held is not None and held >= 2 * GiB - 64 * MiB, "processes",
                    f"the message's processes: {listed}")
        finally:
            holder.kill()
            holder.wait()

    # 11 ---------------------------------------------------------------------------------------------
    def oomguard_on(self):
        ip = self.ip
        ip.run_line_magic("oomguard", "on")
        ip.run_cell("h = torch.ones(256 * 2**20 // 4, device='cuda')\n"
                    "def boom():\n    return torch.empty(4 * 2**30, dtype=torch.uint8, device='cuda')\n")
        ip.run_cell("torch.cuda.set_per_process_memory_fraction(0.02)")
        try:
            ip.run_cell("big = boom()")
        finally:
            ip.run_cell("torch.cuda.set_per_process_memory_fraction(1.0)")
        from cuda_magic.magics.state import get_state

        rep = get_state(ip).guard_all.last_report
        box = rep.blackbox if rep else None
        self.ok(rep is not None and rep.outcome == "oom" and box is not None and box.failure is not None
                and box.failure.site is not None, "oomguard-on",
                f"report {rep.outcome if rep else None}, failing site "
                f"{box.failure.site.where if box and box.failure and box.failure.site else None}; notes "
                f"{box.notes if box else None}")
        ip.run_line_magic("oomguard", "off")
        ip.run_cell("h = None")
        import nbformat
        from nbclient import NotebookClient

        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell("%load_ext cuda_magic\nimport torch, time"),
                    nbformat.v4.new_code_cell("%%oomguard\nfor _ in range(20):\n"
                                              "    t = torch.ones(16 * 2**20, device='cuda')\n    time.sleep(0.1)\n")]
        NotebookClient(nb, timeout=120, kernel_name="python3").execute()
        outputs = nb.cells[1].outputs
        kinds = {k for o in outputs for k in o.get("data", {})}
        self.ok("application/vnd.jupyter.widget-view+json" in kinds or "text/html" in kinds, "oomguard-on",
                f"a 2 s guarded cell in a real kernel: outputs {sorted(kinds)}")

    # 12 ---------------------------------------------------------------------------------------------
    def retry(self):
        ip = self.ip
        ip.run_cell(TRAIN_SETUP)
        cell = "%%oomguard -q -o --no-raise -l 2GiB{}\n" + TRAIN_CELL

        def fits(value: int) -> bool:
            ip.run_cell(f"reset()\nbs = {value}")
            return ip.run_cell(cell.format("")).result.outcome == "ok"

        lo, hi = 1, 4096
        while hi - lo > max(1, lo // 32):           # to 3%: each probe is a run of the cell
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        ip.run_cell(f"reset()\nbs = {2 * lo}")
        rep = ip.run_cell(cell.format(" -r bs")).result
        after = ip.run_cell("fingerprint()").result
        final = rep.final_value
        ip.run_cell(f"reset()\nbs = {final or 1}")
        ip.run_cell(cell.format(""))
        clean = ip.run_cell("fingerprint()").result
        # cuDNN's convolutions and NLLLoss's backward use atomics on CUDA: two runs of the same step differ
        # in the last bits, so the states are compared with a tolerance
        equal = after is not None and clean is not None and len(after) == len(clean) and all(
            a.shape == b.shape and (bool(self.torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-5))
                                    if a.is_floating_point() else bool((a == b).all())) for a, b in zip(after, clean))
        runs = len(rep.attempts)
        # lo fits and hi does not (to 3%): the value found fits, so it is below hi
        self.ok(runs == 2 and final is not None and 0.85 * lo <= final < hi and equal, "retry",
                f"-r from {2 * lo}: {runs} runs, bs={final} of the largest {lo} ({(final or 0) / lo:.1%}), "
                f"state equal to one clean run: {equal}; why: {rep.attempts[-1].reason if rep.attempts else ''}")
        ip.run_cell("model = opt = data = None")

    # 13 ---------------------------------------------------------------------------------------------
    def predict(self):
        ip, torch = self.ip, self.torch
        ip.run_cell(TRAIN_SETUP)
        ip.run_cell("reset()\nbs = 256")
        torch.cuda.synchronize()
        before = (torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0))
        p = ip.run_cell("%%oomguard --predict -q -o\n" + TRAIN_CELL).result
        torch.cuda.synchronize()
        after = (torch.cuda.memory_allocated(0), torch.cuda.memory_reserved(0))
        ip.run_cell("reset()")
        torch.cuda.reset_peak_memory_stats(0)
        real = ip.run_cell("%%oomguard -q -o --no-raise\n" + TRAIN_CELL).result
        peak = real.peaks.get("cuda:0")
        close = p is not None and peak and abs(p.peak - peak) <= 0.05 * peak + CUDNN_SLACK
        self.ok(before == after and close, "predict",
                f"allocated/reserved before the prediction {before}, after {after}; predicted peak "
                f"{getattr(p, 'peak', None)} against the real run's {peak} (complete: {getattr(p, 'complete', None)}, "
                f"{getattr(p, 'enough', None)})")
        ip.run_cell("reset()\nbs = 4096")
        q = ip.run_cell("%%oomguard --predict -q -o -l 2GiB -r bs\n" + TRAIN_CELL).result
        found = getattr(q, "largest", None)
        ok = False
        if found:
            ip.run_cell(f"reset()\nbs = {found}")
            ok = ip.run_cell("%%oomguard -q -o --no-raise -l 2GiB\n" + TRAIN_CELL).result.outcome == "ok"
        self.ok(ok, "predict", f"--predict -r bs under -l 2GiB: largest {found} ({len(getattr(q, 'runs', []))} fake "
                               f"runs, {getattr(q, 'seconds', 0):.2f} s), fits when run: {ok}")
        ip.run_cell("model = opt = data = None")

    # 14 ---------------------------------------------------------------------------------------------
    def allocator(self):
        ip, torch = self.ip, self.torch
        from cuda_magic.devices.simulated import SimulatedDevice

        ip.run_cell(TRAIN_SETUP)
        for bs in (64, 256):
            ip.run_cell(f"reset()\nbs = {bs}")
            ip.run_cell("%freecuda -q")
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(0)
            base = torch.cuda.memory_reserved(0)
            ip.run_cell(TRAIN_CELL)
            torch.cuda.synchronize()
            real = torch.cuda.max_memory_reserved(0) - base
            # the same cell on a simulated device (CPU tensors: .cuda() is made a no-op by a cpu model copy)
            ip.run_cell("import copy as _copy\nsim_model = _copy.deepcopy(model).cpu()")
            cpu_cell = (TRAIN_CELL.replace(".cuda()", "").replace("model(", "sim_model(")
                        .replace("opt.", "sim_opt."))
            dev = SimulatedDevice(torch.cuda.get_device_properties(0).total_memory)
            with dev:
                ip.run_cell("sim_opt = torch.optim.SGD(sim_model.parameters(), lr=0.05, momentum=0.9)\n" + cpu_cell)
            simulated = dev.peak_reserved
            self.ok(real > 0 and abs(simulated - real) <= 0.05 * real + CUDNN_SLACK, "allocator",
                    f"bs={bs}: torch.cuda.max_memory_reserved rose {real} during the cell, the simulated allocator "
                    f"reserved {simulated} at its peak ({(simulated - real) / max(real, 1):+.1%})")
            ip.run_cell("del sim_model, sim_opt")
        ip.run_cell("model = opt = data = None")


#: what cuDNN may hold for its convolutions' workspaces beyond what a fake run or the simulated device has
CUDNN_SLACK = 64 * MiB

REPLAY = f'''
SCRIPTS = {os.path.dirname(os.path.abspath(__file__))!r}
import os, tempfile
import torch
from cuda_magic.devices.caching_allocator import CachingAllocatorModel
torch.cuda.init()
torch.cuda.memory._record_memory_history()            # torch's defaults
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10)).cuda()
opt = torch.optim.AdamW(model.parameters())
for _ in range(2):
    x = torch.randn(512, 512, device="cuda")
    y = torch.randint(0, 10, (512,), device="cuda")
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad()
torch.cuda.synchronize()
path = os.path.join(tempfile.mkdtemp(), "step.pickle")
torch.cuda.memory._dump_snapshot(path)
torch.cuda.memory._record_memory_history(enabled=None)
import pickle, sys
with open(path, "rb") as fh:
    trace = pickle.load(fh)["device_traces"][0]
sys.path.insert(0, SCRIPTS)
from gpu_check import replay_segments
real, got = replay_segments(trace, CachingAllocatorModel.from_environment(
    torch.cuda.get_device_properties(0).total_memory))
first = next((i for i, (a, b) in enumerate(zip(real, got)) if a != b), None)
print("REPLAY", len(trace), "events,", len(real), "segment events real,", len(got), "replayed; equal",
      real == got, "; first difference", first, real[first] if first is not None else "",
      got[first] if first is not None else "")
'''


def replay_segments(trace, allocator) -> tuple[list, list]:
    """(the trace's segment events, the allocator model's) for a recording that started with an empty
    allocator: torch's snapshot trace (`device_traces[0]`: alloc with the block's size, free_completed when
    the block is back in the cache, segment_alloc / segment_free with the segment's size) replayed through
    `allocator` (a CachingAllocatorModel), each (action, size). A run of segment_free (empty_cache(), or the
    out-of-memory path's release) is compared as a sorted run: the order torch walks its pools in is not
    modelled."""
    blocks, got = {}, []

    def segments() -> dict:
        return {seg["address"]: seg["total_size"] for seg in allocator.snapshot()}

    def note(before: dict) -> None:
        after = segments()
        got.extend(("segment_free", size) for addr, size in sorted(before.items()) if addr not in after)
        got.extend(("segment_alloc", size) for addr, size in sorted(after.items()) if addr not in before)

    for e in trace:
        action = e["action"]
        if action == "alloc":
            reserved, before = allocator.reserved, segments() if allocator.reserved else {}
            blocks[e["addr"]] = allocator.malloc(e["size"])
            if allocator.reserved != reserved or allocator.segments != len(before):
                note(before)
        elif action == "free_completed" and e["addr"] in blocks:
            allocator.free(blocks.pop(e["addr"]))
        elif action == "segment_free":
            # torch.cuda.empty_cache() (or the out-of-memory path) in the recording: the model releases
            # every cached segment at the first of the run; the rest find nothing more to release
            before = segments()
            allocator.empty_cache()
            note(before)
    real = [(e["action"], e["size"]) for e in trace if e["action"] in ("segment_alloc", "segment_free")]
    return _sorted_runs(real), _sorted_runs(got)


def _sorted_runs(events: list) -> list:
    out, run = [], []
    for event in events + [("end", 0)]:
        if event[0] == "segment_free":
            run.append(event)
            continue
        out.extend(sorted(run, key=lambda ev: ev[1]))
        run = []
        if event[0] != "end":
            out.append(event)
    return out


def _expandable_off(torch) -> None:
    """expandable_segments back off for what follows, the other settings kept, with the setter
    enable_expandable_segments used (torch 2.10+ torch._C._accelerator_setAllocatorSettings, else
    torch.cuda.memory._set_allocator_settings); cuda_magic's record of what it set follows."""
    from cuda_magic.devices import allocator_conf

    new = allocator_conf.merge_conf(allocator_conf.current_allocator_conf(), expandable_segments=False)
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter(new)
    allocator_conf._set_here = new


def _python(code: str, timeout: int = 240, **env) -> str:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **env, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
    return result.stdout + result.stderr


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


def _uuid_of_cuda0() -> str | None:
    """The UUID of this process's cuda:0, as NVML writes it (GPU-...)."""
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        value = pynvml.nvmlDeviceGetUUID(_handle_of(pynvml, torch, 0))
        return value.decode() if isinstance(value, bytes) else str(value)
    except Exception:  # noqa: BLE001 - reported by the caller as a SKIP
        return None


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
start = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), torch.get_rng_state())

def reset():
    for name in ("x", "xb", "yb", "loss", "loader"):
        globals().pop(name, None)
    model.load_state_dict(start[0]); opt.load_state_dict(copy.deepcopy(start[1]))
    for p in model.parameters():
        p.grad = None
    torch.set_rng_state(start[2])

def fingerprint():
    return ([t.detach().clone() for t in model.state_dict().values()]
            + [t.clone() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)])
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


if __name__ == "__main__":
    sys.exit(main())
