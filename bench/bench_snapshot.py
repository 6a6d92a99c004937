"""What does reading a memory snapshot cost (`%gpumem --snapshot`, `cuda_magic.read_snapshot`)?

On real recordings (../shared/gpu_traces beside the repository, or --traces DIR; gzip'd
`_dump_snapshot` pickles): loading and explaining it, one replay on another capacity, the smallest
capacity at the recorded settings and with expandable_segments:True, against the bare `pickle.load` of
the same file (the floor) and torch's own viewer, `torch.cuda._memory_viz.trace_plot` (which only
draws). Each figure is the median of --rounds, the variants interleaved round by round; CPU is this
thread's CPU time, wall the elapsed time. Goals: reading+explaining a 20,000-entry recording and one
replay each at most 2 s; the smallest capacity at most 5 s.
"""
from __future__ import annotations

import argparse
import gzip
import pickle
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
FILES = ("cs336_ctx256_step.pickle.gz", "cs336_ctx512_fwd_mixed.pickle.gz", "ftcourse.pickle.gz")


def traces_default() -> Path:
    here = REPO.parent / "shared" / "gpu_traces"
    if here.is_dir():
        return here
    git = REPO / ".git"
    if git.is_file():                      # a worktree: beside the main checkout
        main = Path(git.read_text().split(":", 1)[1].strip()).parent.parent.parent
        return main.parent / "shared" / "gpu_traces"
    return here


def timed(fn):
    c, w = time.thread_time(), time.perf_counter()
    value = fn()
    return time.thread_time() - c, time.perf_counter() - w, value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=None, help="folder of the recordings")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--capacity", default="48GiB", help="the replay's capacity")
    args = ap.parse_args()
    folder = args.traces or traces_default()
    if not folder.is_dir():
        sys.exit(f"no recordings at {folder}: pass --traces DIR")
    from cuda_magic import read_snapshot
    from cuda_magic.units import parse_size

    try:
        from torch.cuda import _memory_viz
    except ImportError:
        _memory_viz = None
    capacity = parse_size(args.capacity, allow_fraction=False)
    print(f"`{Path(sys.executable).name} bench/bench_snapshot.py --rounds {args.rounds} --capacity {args.capacity}`\n")
    print("| recording | entries | variant | CPU s | wall s | x pickle.load |")
    print("|---|---|---|---|---|---|")
    for name in FILES:
        path = folder / name
        if not path.exists():
            print(f"| {name} | | not found | | | |")
            continue
        figures: dict[str, list[tuple[float, float]]] = {}
        entries = 0
        for _ in range(args.rounds):
            cpu, wall, data = timed(lambda: pickle.load(gzip.open(path)))
            figures.setdefault("pickle.load (the floor)", []).append((cpu, wall))
            entries = sum(len(t) for t in data["device_traces"])
            if _memory_viz is not None:
                cpu, wall, _ = timed(lambda: _memory_viz.trace_plot(data))
                figures.setdefault("torch _memory_viz.trace_plot (draws only)", []).append((cpu, wall))
            cpu, wall, reading = timed(lambda: read_snapshot(str(path)))
            figures.setdefault("read_snapshot: read and explain", []).append((cpu, wall))
            cpu, wall, _ = timed(lambda: reading.replay(capacity))
            figures.setdefault(f"one replay on {args.capacity}", []).append((cpu, wall))
            cpu, wall, _ = timed(lambda: reading.smallest_capacity)
            figures.setdefault("smallest capacity, recorded settings", []).append((cpu, wall))
            cpu, wall, _ = timed(lambda: reading.replay(None, "expandable_segments:True").smallest_capacity)
            figures.setdefault("smallest capacity, expandable_segments:True", []).append((cpu, wall))
        floor = statistics.median(w for _, w in figures["pickle.load (the floor)"])
        for variant, runs in figures.items():
            cpu = statistics.median(c for c, _ in runs)
            wall = statistics.median(w for _, w in runs)
            print(f"| {name} | {entries:,} | {variant} | {cpu:.2f} | {wall:.2f} | {wall / floor:.1f} |")


if __name__ == "__main__":
    main()
