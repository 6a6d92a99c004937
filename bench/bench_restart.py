"""From an out-of-memory error to a usable kernel: `%%oomguard` against a kernel restart.

    .venv/bin/python bench/bench_restart.py [--rounds 5]

One real Jupyter kernel (jupyter_client's KernelManager, the venv's python3 kernel). Each round, untimed:
`%load_ext cuda_magic`, `import torch`, `%gpumem --simulate 256MiB`, then some state (a model and a
batch). Then, timed:

- oomguard: a cell `%%oomguard --no-raise` that allocates 512 MiB on the simulated device (out of
  memory), then a trivial cell `x = 1`; the time from sending the first to the second's reply. The state
  is checked afterwards (still there), and the OOM cell's output (it said out of memory).
- restart: `restart_kernel()` + `wait_for_ready()` + `import torch` + `x = 1`; what the usual way out
  costs before any state is rebuilt (rebuilding it comes on top and is not counted).

The kernel shows the guard's report the way a notebook would (a widget where ipywidgets is installed).
Each figure is the median over rounds.
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
SETUP = ("%load_ext cuda_magic\nimport torch\n%gpumem --simulate 256MiB -q\n"
         "model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))\n"
         "batch = torch.randn(512, 1024)\nsteps = [1, 2, 3]")
OOM_CELL = "%%oomguard --no-raise\nhuge = torch.empty(512 * 2**20 // 4)  # 512 MiB on a 256 MiB device"
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)

    kernel = Kernel()
    guard_total, guard_oom_cell, guard_trivial, restart_total, restart_ready = [], [], [], [], []
    checks = []
    try:
        for _ in range(args.rounds):
            _, reply = kernel.execute(SETUP)
            ok(reply, "setup")
            kernel.drain_iopub()

            t0 = time.perf_counter()
            oom_id, reply = kernel.execute(OOM_CELL)
            t1 = time.perf_counter()
            _, reply2 = kernel.execute(TRIVIAL)
            t2 = time.perf_counter()
            ok(reply, "the guarded cell")
            ok(reply2, "the trivial cell after the OOM")
            guard_oom_cell.append(t1 - t0)
            guard_trivial.append(t2 - t1)
            guard_total.append(t2 - t0)
            said_oom = "out of memory" in kernel.output_of(oom_id).lower()
            check_id, reply = kernel.execute(CHECK)
            ok(reply, "the state check")
            checks.append((said_oom, kernel.output_of(check_id).strip()))

            t0 = time.perf_counter()
            kernel.restart()
            t1 = time.perf_counter()
            _, reply = kernel.execute("import torch")
            ok(reply, "import torch after the restart")
            _, reply = kernel.execute(TRIVIAL)
            ok(reply, "the trivial cell after the restart")
            t2 = time.perf_counter()
            restart_ready.append(t1 - t0)
            restart_total.append(t2 - t0)
            kernel.drain_iopub()
    finally:
        kernel.close()

    med = statistics.median
    guard, restart = med(guard_total), med(restart_total)
    print(f"Command: `{' '.join(['.venv/bin/python', *sys.argv])}`")
    print()
    print(f"A real kernel (jupyter_client KernelManager, python3 = {Path(sys.executable).name} "
          f"{platform.python_version()}), simulated 256 MiB device, a 512 MiB allocation; median of "
          f"{args.rounds} rounds, wall clock; {os.cpu_count()} CPUs.")
    print()
    print("| way back to a usable kernel | median s | ratio to restart | state kept |")
    print("|---|---:|---:|---|")
    print(f"| `%%oomguard --no-raise` OOM cell + next cell `x = 1` | {guard:.3f} | {guard / restart:.3f}x | "
          f"{'yes' if all('state kept: True False' in c for _, c in checks) else 'NO'} |")
    print(f"| &nbsp;&nbsp;of which the OOM cell (clean-up, diagnosis, report) | {med(guard_oom_cell):.3f} | | |")
    print(f"| &nbsp;&nbsp;of which the next cell | {med(guard_trivial):.3f} | | |")
    print(f"| `restart_kernel()` + `wait_for_ready()` + `import torch` + `x = 1` | {restart:.3f} | 1.000x | "
          f"no (model, batch and variables lost) |")
    print(f"| &nbsp;&nbsp;of which restart + wait_for_ready | {med(restart_ready):.3f} | | |")
    print()
    print(f"- `%%oomguard` gets back to a usable kernel {restart / guard:.0f}x faster than a restart, "
          f"before the restart's cost of rebuilding the state.")
    print(f"- the guarded cell reported out of memory in {sum(s for s, _ in checks)} of {len(checks)} rounds; "
          f"after it: {checks[-1][1] if checks else 'n/a'} (state names present, the failed `huge` absent)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
