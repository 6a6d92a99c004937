"""From an out-of-memory error to a usable kernel: `%%oomguard` against a kernel restart.

    .venv/bin/python bench/bench_restart.py [--rounds 5]

One real Jupyter kernel (jupyter_client's KernelManager, the venv's python3 kernel), holding what a
notebook holds when it runs out of memory: torch, a model of 50M parameters (three 4096 x 4096 linear
layers, 201 MB) and a batch. Each round, the variants in turn, timed from sending the first cell to the
last reply:

- guarded, session device: `%gpumem --simulate 1GiB` on; a cell `%%oomguard --no-raise` that asks for
  2 GiB (out of memory), then a trivial cell `x = 1`;
- guarded, `-l 64MiB`: no session device; a cell `%%oomguard --no-raise -l 64MiB` that asks for 128 MiB
  (the cap counts the model the notebook holds, as it would on a GPU), then `x = 1`;
- restart: `restart_kernel()` + `wait_for_ready()` + `import torch` + `x = 1` (what a restart costs
  before any state is rebuilt), and the same with the model built again (what it costs to get the
  model back, the least of what a restart loses).

After each guarded cell the state is checked (the model and batch still there, the failed allocation
gone) and the cell's output (it said out of memory). The kernel shows the guard's report the way a
notebook would (a widget where ipywidgets is installed). Each figure is the median over rounds.
"""
from __future__ import annotations

import argparse
import os
import platform
import queue
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(3)])"
STATE = f"{MODEL}\nbatch = torch.randn(512, 4096)\nsteps = [1, 2, 3]"
SETUP = f"%load_ext cuda_magic\nimport torch\n{STATE}"
GUARDED = {
    "session": ("%gpumem --simulate 1GiB -q",
                "%%oomguard --no-raise\nhuge = torch.empty(2 * 2**30 // 4)  # 2 GiB on a 1 GiB device",
                "%gpumem --simulate off -q"),
    "limit": ("", "%%oomguard --no-raise -l 64MiB\nhuge = torch.empty(128 * 2**20 // 4)  # 128 MiB under a 64 MiB cap", ""),
}
TRIVIAL = "x = 1"
CHECK = "print('state kept:', all(n in globals() for n in ('model', 'batch', 'steps')), 'huge' in globals())"


class Kernel:
    def __init__(self):
        from jupyter_client import KernelManager

        self.km = KernelManager(kernel_name="python3")
        # the kernel's own stderr (a warning about TCP without encryption) would mix with the table
        self.km.start_kernel(cwd=str(ROOT), stderr=subprocess.DEVNULL)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def execute(self, code: str, timeout: float = 120) -> tuple[str, dict]:
        """Run a cell and wait for its reply: (msg_id, reply content)."""
        msg_id = self.kc.execute(code)
        deadline = time.monotonic() + timeout
        while True:
            msg = self.kc.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
            if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "execute_reply":
                return msg_id, msg["content"]

    def output_of(self, msg_id: str, timeout: float = 30) -> str:
        """The text a cell printed or displayed (read from iopub after the fact)."""
        texts, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.kc.get_iopub_msg(timeout=1)
            except queue.Empty:
                break
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            content = msg["content"]
            if msg["msg_type"] == "stream":
                texts.append(content["text"])
            elif msg["msg_type"] in ("display_data", "update_display_data", "execute_result"):
                texts.append(content.get("data", {}).get("text/plain", ""))
            elif msg["msg_type"] == "status" and content["execution_state"] == "idle":
                break
        return "".join(texts)

    def drain_iopub(self) -> None:
        while True:
            try:
                self.kc.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                return

    def restart(self) -> None:
        self.km.restart_kernel()
        self.kc.wait_for_ready(timeout=120)

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def ok(reply: dict, what: str) -> None:
    if reply.get("status") != "ok":
        raise RuntimeError(f"{what} failed: {reply.get('ename')}: {reply.get('evalue')}")


def guarded_round(kernel, variant: str):
    """(seconds from the OOM cell to the next cell's reply, the OOM cell's share, said OOM, state check)."""
    before, cell, after = GUARDED[variant]
    if before:
        ok(kernel.execute(before)[1], "switching the device on")
    kernel.drain_iopub()
    t0 = time.perf_counter()
    oom_id, reply = kernel.execute(cell)
    t1 = time.perf_counter()
    _, reply2 = kernel.execute(TRIVIAL)
    t2 = time.perf_counter()
    ok(reply, f"the guarded cell ({variant})")
    ok(reply2, "the trivial cell after the OOM")
    said_oom = "out of memory" in kernel.output_of(oom_id).lower()
    check_id, reply = kernel.execute(CHECK)
    ok(reply, "the state check")
    check = kernel.output_of(check_id).strip()
    if after:
        ok(kernel.execute(after)[1], "switching the device off")
    return t2 - t0, t1 - t0, said_oom, check


def restart_round(kernel, rebuild: bool) -> float:
    t0 = time.perf_counter()
    kernel.restart()
    ok(kernel.execute("import torch" + (f"\n{MODEL}" if rebuild else ""))[1], "import torch after the restart")
    ok(kernel.execute(TRIVIAL)[1], "the trivial cell after the restart")
    seconds = time.perf_counter() - t0
    ok(kernel.execute(SETUP)[1], "the state again")
    warm_up(kernel)
    return seconds


def warm_up(kernel) -> None:
    """What a kernel that has been working has done once: the display and the census imported, and the
    first op on a simulated device (whose meta kernels import torch._dynamo, 2-3 s once per process)."""
    for variant in GUARDED:
        guarded_round(kernel, variant)
    kernel.drain_iopub()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)

    kernel = Kernel()
    guarded = {v: [] for v in GUARDED}
    cells = {v: [] for v in GUARDED}
    checks = {v: [] for v in GUARDED}
    restart, rebuilt = [], []
    try:
        ok(kernel.execute(SETUP)[1], "setup")
        warm_up(kernel)
        for _ in range(args.rounds):
            for variant in GUARDED:
                total, cell, said, check = guarded_round(kernel, variant)
                guarded[variant].append(total)
                cells[variant].append(cell)
                checks[variant].append((said, check))
            restart.append(restart_round(kernel, rebuild=False))
            rebuilt.append(restart_round(kernel, rebuild=True))
    finally:
        kernel.close()

    med = statistics.median
    base, full = med(restart), med(rebuilt)
    print(f"Command: `{' '.join(['.venv/bin/python', *sys.argv])}`")
    print()
    print(f"A real kernel (jupyter_client KernelManager, python3 = {Path(sys.executable).name} "
          f"{platform.python_version()}) holding torch, a model of 50M parameters and a batch; median of "
          f"{args.rounds} rounds, wall clock; {os.cpu_count()} CPUs.")
    print()
    print("| way back to a usable kernel | median s | vs restart + model | vs bare restart | state kept |")
    print("|---|---:|---:|---:|---|")
    words = {"session": "`%%oomguard --no-raise` OOM cell (2 GiB on a 1 GiB session device) + `x = 1`",
             "limit": "`%%oomguard --no-raise -l 64MiB` OOM cell (128 MiB) + `x = 1`"}
    for variant in GUARDED:
        g = med(guarded[variant])
        kept = all(said and "state kept: True False" in c for said, c in checks[variant])
        print(f"| {words[variant]} | {g:.3f} | {full / g:.1f}x faster | {base / g:.1f}x faster | "
              f"{'yes' if kept else 'NO'} |")
        print(f"| &nbsp;&nbsp;of which the OOM cell (clean-up, diagnosis, report) | {med(cells[variant]):.3f} | | | |")
    print(f"| `restart_kernel()` + `wait_for_ready()` + `import torch` + the model built again + `x = 1` | "
          f"{full:.3f} | 1.0x | | no (the batch and every other variable lost) |")
    print(f"| `restart_kernel()` + `wait_for_ready()` + `import torch` + `x = 1` | {base:.3f} | | 1.0x | "
          f"no (model, batch and variables lost) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
