"""What `%gpumem --watch` adds to a trivial cell (`x = 1`), against the same cells without it.

    .venv/bin/python bench/bench_watch.py [--cells 1000] [--rounds 9] [--names 10000] [--against TREE]

A real IPython shell runs the cell with run_cell, in blocks of --cells cells, the variants interleaved
round by round: a block's time per cell (its mean), the median over rounds, and each cell timed alone, the
median over every cell of the variant (the goal's figure: it leaves out the cells another process
interrupted, which on a loaded machine move the blocks' means by more than the goal). Modes: CPU only (the
watcher reads /proc/self/statm and getrusage), the same among --names user names (a third of them lists:
the cost must not grow with the notebook), a simulated device on (`%gpumem --simulate 1GiB`), and CUDA
where torch can use it. Variants: without --watch (the baseline); --watch with its per-cell line printed to a sink
(stdout redirected to io.StringIO: the line is formatted, printing costs nothing); --watch printed to a
line-buffered /dev/null (one write per line, as on a terminal); and the hooks alone (the watcher's
on_record set to None, an internal switch, to show what the display costs). Goal: at most 50 us added.

--against TREE (another checkout of cuda_magic, e.g. main's) adds two rows per mode: that tree's watcher
(its memory/watch.py with its devices/proc.py, and its display/show.py's show_watch), hooks only and the
line printed to a sink, interleaved in the same rounds: a before/after pair under the same load.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GOAL_US = 50.0
CELL = "x = 1"


def run_block(shell, cells: int, each: list) -> tuple[float, float]:
    """(wall, CPU) seconds per cell over one block of trivial cells; each cell's wall seconds appended to
    `each` (perf_counter, read without a system call)."""
    clock = time.perf_counter
    w0, c0 = clock(), time.thread_time()
    for _ in range(cells):
        t0 = clock()
        shell.run_cell(CELL)
        each.append(clock() - t0)
    return (time.perf_counter() - w0) / cells, (time.thread_time() - c0) / cells


def set_watch(shell, variant: str) -> None:
    from cuda_magic.display.show import show_watch
    from cuda_magic.magics.state import get_state

    if variant == "off":
        shell.run_line_magic("gpumem", "--unwatch -q")
        return
    shell.run_line_magic("gpumem", "--watch -q")
    get_state(shell).watcher.on_record = None if variant == "hooks" else show_watch


@contextlib.contextmanager
def stdout_to(target: str):
    if target == "sink":
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    else:
        with open(os.devnull, "w", buffering=1) as devnull, contextlib.redirect_stdout(devnull):
            yield


VARIANTS = (   # (key, watch variant, stdout)
    ("off", "off", "sink"),
    ("sink", "display", "sink"),
    ("devnull", "display", "devnull"),
    ("hooks", "hooks", "sink"),
    ("off_devnull", "off", "devnull"),
)
OTHER_VARIANTS = (("other_hooks", "hooks", "sink"), ("other_sink", "display", "sink"))


def load_tree(tree: str):
    """(CellWatcher, show_watch) of another checkout: its memory/watch.py reading through its own
    devices/proc.py, and its display/show.py's show_watch; the rest is this tree's."""
    def load(rel: str, name: str):
        spec = importlib.util.spec_from_file_location(name, Path(tree) / "cuda_magic" / rel)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    proc = load("devices/proc.py", "bench_other_proc")
    watch = load("memory/watch.py", "bench_other_watch")
    watch.ProcReader = proc.ProcReader
    return watch.CellWatcher, load("display/show.py", "bench_other_show").show_watch


def measure_mode(shell, cells: int, rounds: int, other=None) -> dict[str, tuple[float, float, float]]:
    """{variant: (wall, CPU, one cell's median wall) seconds per cell}"""
    variants = VARIANTS + (OTHER_VARIANTS if other is not None else ())
    wall = {k: [] for k, _, _ in variants}
    cpu = {k: [] for k, _, _ in variants}
    each = {k: [] for k, _, _ in variants}
    for _ in range(rounds):
        for key, variant, target in variants:
            watcher = None
            if key.startswith("other_"):
                set_watch(shell, "off")
                watcher = other[0](shell, None if variant == "hooks" else other[1])
                watcher.start()
            else:
                set_watch(shell, variant)
            with stdout_to(target):
                shell.run_cell(CELL)          # a first cell outside the timing
                w, c = run_block(shell, cells, each[key])
            if watcher is not None:
                watcher.stop()
            wall[key].append(w)
            cpu[key].append(c)
    set_watch(shell, "off")
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k]), statistics.median(each[k])) for k in wall}


def cuda_ready() -> str | None:
    """None when CUDA can be measured, else why not."""
    import torch

    try:
        if not torch.cuda.is_available():
            return "no CUDA device here"
        torch.zeros(1, device="cuda")      # initialise CUDA: the watcher reads torch.cuda only then
        return None
    except Exception as exc:
        return f"CUDA unusable: {type(exc).__name__}: {exc}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--names", type=int, default=10_000,
                        help="user names in the namespace for the rows that measure a grown notebook")
    parser.add_argument("--against", metavar="TREE",
                        help="another checkout of cuda_magic whose watcher is measured in the same rounds")
    args = parser.parse_args(argv)
    os.environ["CUDA_MAGIC_DISPLAY"] = "text"

    import torch
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "cuda_magic")
    other = load_tree(args.against) if args.against else None
    results, skipped = {}, {}
    results["CPU only"] = measure_mode(shell, args.cells, args.rounds, other)
    for i in range(args.names):          # a notebook that grew: a third of its names lists
        shell.user_ns[f"name_{i}"] = [i] if i % 3 == 0 else i
    results[f"CPU only, {args.names:,} user names"] = measure_mode(shell, args.cells, args.rounds, other)
    for i in range(args.names):
        del shell.user_ns[f"name_{i}"]
    shell.run_line_magic("gpumem", "--simulate 1GiB -q")
    results["simulated device (`--simulate 1GiB`)"] = measure_mode(shell, args.cells, args.rounds, other)
    shell.run_line_magic("gpumem", "--simulate off -q")
    why = cuda_ready()
    if why is None:
        results["CUDA"] = measure_mode(shell, args.cells, args.rounds, other)
    else:
        skipped["CUDA"] = why

    print(f"Command: `{' '.join(['.venv/bin/python', *sys.argv])}`")
    print()
    print(f"A trivial cell `{CELL}` through `shell.run_cell` in a real IPython shell, blocks of {args.cells} "
          f"cells, median of {args.rounds} interleaved rounds. CPU = this thread's CPU time per cell, wall = "
          f"elapsed, one cell = the median of every cell's own elapsed time (the goal's figure). Python {platform.python_version()}, IPython {_ipython_version()}, torch "
          f"{torch.__version__}, {os.cpu_count()} CPUs.")
    print()
    print("| mode | variant | CPU us/cell | added CPU us | CPU ratio | wall us/cell | added wall us | wall ratio | "
          f"one cell, median us | added us | goal (<= {GOAL_US:.0f} us added to one cell) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    labels = {"off": "no --watch (baseline)", "sink": "--watch, line printed to a sink",
              "devnull": "--watch, line printed to /dev/null (line-buffered)",
              "hooks": "--watch hooks only (no display)",
              "other_hooks": f"{args.against}'s --watch, hooks only", "other_sink": f"{args.against}'s --watch, line printed to a sink"}
    for mode, res in results.items():
        for key in ("off", "hooks", "sink", "devnull", *(k for k, _, _ in OTHER_VARIANTS if k in res)):
            base = res["off_devnull" if key == "devnull" else "off"]
            wall, cpu, one = res[key]
            if key == "off":
                print(f"| {mode} | {labels[key]} | {cpu * 1e6:.1f} | - | 1.00x | {wall * 1e6:.1f} | - | 1.00x | "
                      f"{one * 1e6:.1f} | - | |")
                continue
            added_cpu, added_wall, added_one = (cpu - base[1]) * 1e6, (wall - base[0]) * 1e6, (one - base[2]) * 1e6
            verdict = "met" if added_one <= GOAL_US else "MISSED"
            print(f"| {mode} | {labels[key]} | {cpu * 1e6:.1f} | {added_cpu:+.1f} | {cpu / base[1]:.2f}x | "
                  f"{wall * 1e6:.1f} | {added_wall:+.1f} | {wall / base[0]:.2f}x | {one * 1e6:.1f} | "
                  f"{added_one:+.1f} | {verdict} |")
    for mode, why in skipped.items():
        print(f"| {mode} | not measured: {why} | | | | | | | | | |")
    print()
    print("The /dev/null rows are compared with a baseline that also writes to /dev/null.")
    return 0


def _ipython_version() -> str:
    import IPython

    return IPython.__version__


if __name__ == "__main__":
    raise SystemExit(main())
