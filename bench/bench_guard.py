"""The fixed overhead of `%%oomguard` on a trivial cell, against the same body run bare.

    .venv/bin/python bench/bench_guard.py [--cells 300] [--rounds 7] [--names 10000] [--profile]

A real IPython shell runs `x = 1` with run_cell, bare and under `%%oomguard -q` (display off) and under
`%%oomguard` with CUDA_MAGIC_DISPLAY=text and stdout redirected to io.StringIO (display on, printing
costs nothing), on the CPU (also with --names user names in the namespace, a third of them lists: the
cost must not grow with the notebook) and with a simulated device on (`%gpumem --simulate 1GiB`). Blocks of --cells
cells, the variants interleaved round by round; each figure is the median over rounds of a block's time
per cell. Goal: under 0.4 ms added. --profile prints where the guarded cell's time goes (cProfile).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GOAL_MS = 0.4
BODY = "x = 1"
VARIANTS = {
    "bare": BODY,
    "magic": f"%%bench_plain_magic\n{BODY}",
    "quiet": f"%%oomguard -q\n{BODY}",
    "shown": f"%%oomguard\n{BODY}",
}


def run_block(shell, cell: str, cells: int) -> tuple[float, float]:
    """(wall, CPU) seconds per cell over one block."""
    with contextlib.redirect_stdout(io.StringIO()):
        shell.run_cell(cell)                  # one cell outside the timing
        w0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(cells):
            result = shell.run_cell(cell)
        wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
    if not result.success:
        raise RuntimeError(f"the benchmark cell failed: {result.error_in_exec or result.error_before_exec!r}")
    return wall / cells, cpu / cells


def measure(shell, cells: int, rounds: int) -> dict[str, tuple[float, float]]:
    wall = {k: [] for k in VARIANTS}
    cpu = {k: [] for k in VARIANTS}
    for _ in range(rounds):
        for key, cell in VARIANTS.items():
            w, c = run_block(shell, cell, cells)
            wall[key].append(w)
            cpu[key].append(c)
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in VARIANTS}


def profile(shell, cell: str, cells: int) -> str:
    prof = cProfile.Profile()
    with contextlib.redirect_stdout(io.StringIO()):
        prof.enable()
        for _ in range(cells):
            shell.run_cell(cell)
        prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("cumulative").print_stats(r"cuda_magic|run_cell_magic", 25)
    return out.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--names", type=int, default=10_000,
                        help="user names in the namespace for the rows that measure a grown notebook")
    args = parser.parse_args(argv)
    os.environ["CUDA_MAGIC_DISPLAY"] = "text"

    import torch
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "cuda_magic")

    def bench_plain_magic(line, cell):     # what any cell magic costs IPython (its line's $-expansion
        shell.ex(cell)                     # copies the namespace): the floor under %%oomguard's figure

    shell.register_magic_function(bench_plain_magic, "cell")
    results = {"CPU only": measure(shell, args.cells, args.rounds)}
    for i in range(args.names):          # a notebook that grew: a third of its names lists
        shell.user_ns[f"name_{i}"] = [i] if i % 3 == 0 else i
    results[f"CPU only, {args.names:,} user names"] = measure(shell, args.cells, args.rounds)
    for i in range(args.names):
        del shell.user_ns[f"name_{i}"]
    shell.run_line_magic("gpumem", "--simulate 1GiB -q")
    results["simulated device (`--simulate 1GiB`)"] = measure(shell, args.cells, args.rounds)
    profiles = {}
    if args.profile:
        profiles["simulated, -q"] = profile(shell, VARIANTS["quiet"], args.cells)
    shell.run_line_magic("gpumem", "--simulate off -q")
    if args.profile:
        profiles["CPU, -q"] = profile(shell, VARIANTS["quiet"], args.cells)
        profiles["CPU, display on"] = profile(shell, VARIANTS["shown"], args.cells)

    print(f"Command: `{' '.join(['.venv/bin/python', *sys.argv])}`")
    print()
    print(f"`{BODY}` through `shell.run_cell` in a real IPython shell, blocks of {args.cells} cells, median of "
          f"{args.rounds} interleaved rounds; stdout to io.StringIO. CPU = this thread's CPU time per cell, "
          f"wall = elapsed. Python {platform.python_version()}, torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs.")
    print()
    print("| mode | cell | CPU ms/cell | added CPU ms | CPU ratio | wall ms/cell | added wall ms | wall ratio | "
          f"goal (< {GOAL_MS:g} ms added) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    labels = {"bare": f"`{BODY}` (bare)", "magic": "a cell magic that only runs its body (IPython's floor)",
              "quiet": "`%%oomguard -q` (display off)",
              "shown": "`%%oomguard` (text display to a sink)"}
    for mode, res in results.items():
        base_wall, base_cpu = res["bare"]
        for key in VARIANTS:
            wall, cpu = res[key]
            if key == "bare":
                print(f"| {mode} | {labels[key]} | {cpu * 1e3:.3f} | - | 1.00x | {wall * 1e3:.3f} | - | 1.00x | |")
                continue
            added = (cpu - base_cpu) * 1e3
            print(f"| {mode} | {labels[key]} | {cpu * 1e3:.3f} | {added:+.3f} | {cpu / base_cpu:.1f}x | "
                  f"{wall * 1e3:.3f} | {(wall - base_wall) * 1e3:+.3f} | {wall / base_wall:.1f}x | "
                  f"{'met' if added < GOAL_MS else 'MISSED'} |")
    for name, text in profiles.items():
        print(f"\nProfile, {name} ({args.cells} cells, cumulative):\n```\n{text.strip()}\n```")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
