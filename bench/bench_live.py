"""What the live gauge costs: CPU of one core while it redraws 4 times a second, in a real Jupyter kernel.

    .venv/bin/python bench/bench_live.py [--seconds 10] [--rounds 3]

One kernel (nbclient), the simulated device on; the cell being measured allocates and frees a tensor every
0.1 s (so that the figures change before every reading and the gauge redraws at its full 4 a second, the
worst case) and otherwise sleeps. Variants, interleaved round by round in the same kernel: no gauge (the
baseline), `%gpumem --live` as an ipywidgets HTML (each redraw a comm message), and as a display handle
(CUDA_MAGIC_DISPLAY=html: each redraw an update_display_data message). Measured side by side: the
process's CPU time over the round (time.process_time: every thread, the kernel's IOPub thread that sends the
messages included) against the baseline's, and the gauge thread's own CPU time (time.thread_time inside the
thread). Goal: at most 1% of one core added.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOAL_PERCENT = 1.0

SETUP = """
%load_ext cuda_magic
import json, os, statistics, time, torch
%gpumem --simulate 1GiB -q
torch.zeros(1)
"""

MEASURE = """
def workload(seconds):
    x = None
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        x = torch.zeros(2**16 + (i % 7) * 1024)     # the allocated figure changes every 0.1 s
        i += 1
        time.sleep(0.1)

def measure(variant, seconds):
    state = get_ipython().magics_manager.registry["GpumemMagics"].cuda_magic_state
    if variant == "html":
        os.environ["CUDA_MAGIC_DISPLAY"] = "html"
    else:
        os.environ.pop("CUDA_MAGIC_DISPLAY", None)
    if variant != "baseline":
        get_ipython().run_line_magic("gpumem", "--live")
    gauge = state.live
    c0, w0 = time.process_time(), time.monotonic()
    workload(seconds)
    cpu, wall = time.process_time() - c0, time.monotonic() - w0
    row = {"variant": variant, "wall": wall, "cpu": cpu, "thread": None, "updates": None}
    if gauge is not None:
        get_ipython().run_line_magic("gpumem", "--live off -q")
        row["thread"], row["updates"] = gauge.cpu_seconds, gauge.updates
    return row

rows = []
for r in range(ROUNDS):
    for variant in ("baseline", "widget", "html"):
        rows.append(measure(variant, SECONDS))
print("RESULT " + json.dumps(rows))
"""


def run(seconds: float, rounds: int) -> list[dict]:
    import nbformat
    from nbclient import NotebookClient

    cells = [SETUP, f"ROUNDS, SECONDS = {rounds}, {seconds}\n" + MEASURE]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(textwrap.dedent(c)) for c in cells])
    timeout = int(rounds * 3 * (seconds + 5) + 120)
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.get("output_type") == "stream")
    line = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    if not line:
        raise SystemExit(f"the kernel printed no result:\n{text}")
    return json.loads(line[-1][len("RESULT "):])


def median(values):
    import statistics

    return statistics.median(values)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each measured round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    rows = run(args.seconds, args.rounds)
    import torch

    print(f"Command: `.venv/bin/python bench/bench_live.py --seconds {args.seconds:g} --rounds {args.rounds}`\n")
    print(f"Python {platform.python_version()}, torch {torch.__version__}, a real kernel (nbclient), the simulated "
          f"device; medians of {args.rounds} interleaved rounds of {args.seconds:g} s each.\n")
    base = median([r["cpu"] / r["wall"] for r in rows if r["variant"] == "baseline"]) * 100
    print("| variant | process CPU, % of one core | added vs no gauge | gauge thread's own CPU | redraws a second |")
    print("|---|---:|---:|---:|---:|")
    verdicts = []
    for variant, label in (("baseline", "no gauge (the cell alone)"), ("widget", "`%gpumem --live`, ipywidgets"),
                           ("html", "`%gpumem --live`, display handle (HTML)")):
        picked = [r for r in rows if r["variant"] == variant]
        share = median([r["cpu"] / r["wall"] for r in picked]) * 100
        if variant == "baseline":
            print(f"| {label} | {share:.2f}% | | | |")
            continue
        thread = median([r["thread"] / r["wall"] for r in picked]) * 100
        rate = median([r["updates"] / r["wall"] for r in picked])
        added = share - base
        verdicts.append(f"{label}: {added:+.2f}% of one core added ({'met' if added <= GOAL_PERCENT else 'NOT met'})")
        print(f"| {label} | {share:.2f}% | {added:+.2f}% | {thread:.2f}% | {rate:.1f} |")
    print()
    for v in verdicts:
        print(f"- {v}; goal at most {GOAL_PERCENT:g}%")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
