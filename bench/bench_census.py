"""The census cost of `%gpumem`: 10,000 tensors and a model among 1,000,000 other objects.

    .venv/bin/python bench/bench_census.py [--tensors 10000] [--objects 1000000] [--runs 7]

Side by side, in one process and interleaved run by run (each figure is a median): a bare scan
`[o for o in gc.get_objects() if isinstance(o, torch.Tensor)]` (finds, names nothing), the census
`cuda_magic.snapshot.snapshot(shell)` of a real IPython shell whose user_ns holds the heap, the whole
`%gpumem -q` magic, and pytorch_memlab's `MemReporter` (a peer; skipped with a note where it is not
installed: it is not a dependency of cuda_magic). Goals: the census at most 1.5x the bare scan, and faster
than MemReporter, while naming the tensors.
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


def timed(fn) -> float:
    gc.collect()   # untimed: a full collection owed to an earlier method must not land in this one
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


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
        with contextlib.redirect_stdout(io.StringIO()):
            MemReporter(ns["model"]).report()

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

    import torch
    from IPython.core.interactiveshell import InteractiveShell

    from cuda_magic.snapshot import snapshot

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "cuda_magic")
    ns = shell.user_ns
    heap = build_heap(ns, args.tensors, args.objects)

    methods = {
        "bare": lambda: [o for o in gc.get_objects() if isinstance(o, torch.Tensor)],
        "snapshot": lambda: snapshot(shell),
        "gpumem": lambda: shell.run_line_magic("gpumem", "-q"),
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

    times = {k: [] for k in methods}
    for _ in range(args.runs):       # interleaved: machine noise falls on every method alike
        for key, fn in methods.items():
            times[key].append(timed(fn))
    med = {k: statistics.median(v) for k, v in times.items()}
    bare = med["bare"]
    memlab = med.get("memlab_census")

    rows = [
        ("bare scan: `[o for o in gc.get_objects() if isinstance(o, torch.Tensor)]`", "bare", "none"),
        ("cuda_magic census: `snapshot(shell)`", "snapshot",
         f"{named:,} of {storages:,} storages named"),
        ("cuda_magic `%gpumem -q` (whole magic)", "gpumem", "same as above"),
        ("pytorch_memlab `MemReporter(model)` collect_tensor + get_stats", "memlab_census",
         "model parameters and grads only; others `Tensor<N>`"),
        ("pytorch_memlab `MemReporter(model).report()` (printing to a sink)", "memlab_report", "as above"),
    ]
    print(f"Command: `{' '.join([Path(sys.executable).name, *sys.argv])}`  ")
    print(f"Heap: {args.tensors:,} tensors in `batches` + an 8-layer MLP with Adam state ({found:,} tensors in "
          f"all), {args.objects:,} other objects (strings, tuples, dicts, lists); {heap['gc_objects']:,} objects "
          f"tracked by gc. Median of {args.runs} interleaved runs, each after an untimed gc.collect(). Python {platform.python_version()}, "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs.")
    print()
    print("| method | median ms | ratio to bare scan | ratio to MemReporter | tensors named |")
    print("|---|---:|---:|---:|---|")
    for label, key, naming in rows:
        if key not in med:
            print(f"| {label} | n/a | n/a | n/a | {note} |")
            continue
        vs_memlab = f"{med[key] / memlab:.2f}x" if memlab else "n/a"
        print(f"| {label} | {med[key] * 1e3:.1f} | {med[key] / bare:.2f}x | {vs_memlab} | {naming} |")
    print()
    ratio = med["snapshot"] / bare
    print(f"- census / bare scan: {ratio:.2f}x (goal at most {GOAL_VS_BARE}x): "
          f"{'met' if ratio <= GOAL_VS_BARE else 'MISSED'}")
    if memlab:
        print(f"- census / MemReporter: {med['snapshot'] / memlab:.2f}x (goal below 1x): "
              f"{'met' if med['snapshot'] < memlab else 'MISSED'}")
    else:
        print(f"- census / MemReporter: not measured ({note})")
    print(f"- names: {batch_named:,} of {args.tensors:,} batch tensors as `batches[i]`, {model_named} model "
          f"storages as `model.*` (parameters, grads), optimizer state as `opt.state[...]`")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
