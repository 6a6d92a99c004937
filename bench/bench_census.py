"""The census cost of `%gpumem`: 10,000 tensors and a model among 1,000,000 other objects.

    .venv/bin/python bench/bench_census.py [--tensors 10000] [--objects 1000000] [--runs 7]

Side by side, in one process and interleaved run by run (each figure is a median): a bare scan
`[o for o in gc.get_objects() if isinstance(o, torch.Tensor)]` (finds, names nothing), the census
`cuda_magic.memory.capture.snapshot(shell)` of a real IPython shell whose user_ns holds the heap, the whole
`%gpumem -q` magic, and pytorch_memlab's `MemReporter` (a peer; skipped with a note where it is not
installed: it is not a dependency of cuda_magic). Goals: the census at most 1.5x the bare scan, and at most
1.0x MemReporter's report() (issue 40), while naming the tensors.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GOAL_VS_BARE = 1.5


def build_heap(ns: dict, tensors: int, objects: int) -> dict:
    """A notebook-like heap in `ns`: a list of small tensors, a model with its optimizer state, and
    `objects` other objects, a quarter each strings, tuples, dicts (rows) and the lists inside them."""
    import torch

    torch.manual_seed(0)
    ns["batches"] = [torch.randn(16) for _ in range(tensors)]
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(8)])
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 128)).sum().backward()
    opt.step()
    ns["model"], ns["opt"] = model, opt
    q = objects // 4
    ns["words"] = [f"word{i}" for i in range(q)]                                 # q strings
    ns["pairs"] = [(f"key{i}", i) for i in range(q)]                             # q tuples
    ns["rows"] = [{"id": i, "label": f"row{i}", "tags": [i % 7]} for i in range(q)]  # q dicts + q lists
    gc.collect()
    return {"gc_objects": len(gc.get_objects())}


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this thread) of one call."""
    gc.collect()   # untimed: a full collection owed to an earlier method must not land in this one
    w0, c0 = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - w0, time.thread_time() - c0


def sunk(fn, *args):
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args)


def memlab_methods(ns):
    """(methods, note): MemReporter's census (collect + stats) and its report() with output sunk."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):   # it prints a CUDA notice on import
            from pytorch_memlab import MemReporter
    except Exception as exc:   # not installed, or fails to import on this build
        return {}, f"pytorch_memlab not measured: {type(exc).__name__}: {exc}"

    def census():
        reporter = MemReporter(ns["model"])
        reporter.collect_tensor()
        reporter.get_stats()

    def report():
        sunk(MemReporter(ns["model"]).report)

    try:
        census()
        report()
    except Exception as exc:
        return {}, f"pytorch_memlab MemReporter failed here: {type(exc).__name__}: {exc}"
    return {"memlab_census": census, "memlab_report": report}, None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=10_000)
    parser.add_argument("--objects", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args(argv)
    # isinstance() reads __class__ of every object; a few torch objects warn when read that way
    warnings.simplefilter("ignore", FutureWarning)

    os.environ["CUDA_MAGIC_DISPLAY"] = "text"
    import torch
    from IPython.core.interactiveshell import InteractiveShell

    from cuda_magic.memory.capture import snapshot

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "cuda_magic")
    ns = shell.user_ns
    heap = build_heap(ns, args.tensors, args.objects)

    methods = {
        "bare": lambda: [o for o in gc.get_objects() if isinstance(o, torch.Tensor)],
        "snapshot": lambda: snapshot(shell),
        "gpumem": lambda: shell.run_line_magic("gpumem", "-q"),
        "gpumem_text": lambda: sunk(shell.run_line_magic, "gpumem", ""),
    }
    peer, note = memlab_methods(ns)
    methods.update(peer)

    found = len(methods["bare"]())
    snap = snapshot(shell)
    named = sum(1 for r in snap.tensor_list if r.names)
    batch_named = sum(1 for r in snap.tensor_list if any(n.startswith("batches[") for n in r.names))
    model_named = sum(1 for r in snap.tensor_list if any(n.startswith("model.") for n in r.names))
    storages = len(snap.tensor_list)
    del snap

    wall, cpu = {k: [] for k in methods}, {k: [] for k in methods}
    for _ in range(args.runs):       # interleaved: machine noise falls on every method alike
        for key, fn in methods.items():
            w, c = timed(fn)
            wall[key].append(w)
            cpu[key].append(c)
    wall = {k: statistics.median(v) for k, v in wall.items()}
    cpu = {k: statistics.median(v) for k, v in cpu.items()}

    rows = [
        ("bare scan: `[o for o in gc.get_objects() if isinstance(o, torch.Tensor)]`", "bare", "none"),
        ("cuda_magic census: `snapshot(shell)`", "snapshot", f"{named:,} of {storages:,} storages"),
        ("cuda_magic `%gpumem -q` (the whole magic)", "gpumem", f"{named:,} of {storages:,} storages"),
        ("cuda_magic `%gpumem` (text display, printed to a sink)", "gpumem_text", "top 10 shown, all named"),
        ("pytorch_memlab `MemReporter(model)`: `collect_tensor()` + `get_stats()`", "memlab_census",
         "parameters and grads; the rest `Tensor<N>`"),
        ("pytorch_memlab `MemReporter(model).report()` (printed to a sink)", "memlab_report", "as above"),
    ]
    print(f"Command: `{' '.join(['.venv/bin/python', *sys.argv])}`")
    print()
    print(f"Heap: {args.tensors:,} tensors in a list + an 8-layer MLP with Adam state ({found:,} tensors), "
          f"{args.objects:,} other objects (strings, tuples, dicts, lists); {heap['gc_objects']:,} objects "
          f"tracked by gc. Median of {args.runs} interleaved runs, each after an untimed gc.collect(); "
          f"CPU = this thread's CPU time (steady on a loaded machine), wall = elapsed. Python "
          f"{platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs.")
    print()
    print("| method | CPU ms | CPU vs bare scan | CPU vs MemReporter | wall ms | wall vs bare scan | "
          "wall vs MemReporter | tensors named |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for label, key, naming in rows:
        if key not in cpu:
            print(f"| {label} | n/a | n/a | n/a | n/a | n/a | n/a | {note} |")
            continue
        cells = []
        for med in (cpu, wall):
            peer = med.get("memlab_census")
            cells += [f"{med[key] * 1e3:.1f}", f"{med[key] / med['bare']:.2f}x",
                      f"{med[key] / peer:.2f}x" if peer else "n/a"]
        print(f"| {label} | {' | '.join(cells)} | {naming} |")
    print()
    for what, med in (("CPU", cpu), ("wall", wall)):
        ratio = med["snapshot"] / med["bare"]
        line = (f"- {what}: census / bare scan {ratio:.2f}x (goal at most {GOAL_VS_BARE}x: "
                f"{'met' if ratio <= GOAL_VS_BARE else 'MISSED'})")
        if "memlab_census" in med:
            peer = med["snapshot"] / med["memlab_census"]
            report = med["snapshot"] / med["memlab_report"]
            line += (f"; census / MemReporter's collect + get_stats {peer:.2f}x; census / its report() "
                     f"{report:.2f}x (goal at most 1.0x: {'met' if report <= 1 else 'MISSED'})")
        else:
            line += f"; MemReporter not measured: {note}"
        print(line)
    print(f"- names: {batch_named:,} of {args.tensors:,} list tensors as `batches[i]`, {model_named} model "
          f"storages as `model.*` (parameters and their grads), the rest as `opt.state[...]`")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
