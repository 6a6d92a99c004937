"""The retry under torch.distributed: cuda_magic's `oomguard(retry=...)` beside accelerate's
`find_executable_batch_size`, in the same 2-process DDP run (gloo, CPU; tests/dist_worker.py's model and
data): rank 1 alone runs out of memory at batch_size=64 (a longer sequence, its own small simulated
device), in the forward pass (the backward and step cases are tests/test_distributed.py's). Reports, for `-r` (retry="batch_size"), `--search` (search=True) and accelerate:
whether every rank finished, the value each rank ended at and the runs it took, the largest value that
fits rank 1, wall time, and whether the models are equal across ranks. The simulated devices reserve as
torch's caching allocator (`--plain`: the tensors' bytes).

    .venv/bin/python bench/bench_distributed.py [--timeout 10] [--plain]
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import dist_worker as w  # noqa: E402

WHO = "one"
PHASE = "forward"
ALLOCATOR = "caching"    # set by main(): --plain
METHODS = ("-r", "--search", "accelerate")


def step(model, opt, X, Y, batch_size):
    w.loss_of(model, X[:batch_size].clone(), Y[:batch_size].clone(), False).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return batch_size


def rank_main(rank, method, init, out, capacity, timeout, allocator):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cuda_magic import oomguard, simulated_device

    global ALLOCATOR
    ALLOCATOR = allocator
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout))
    model = DDP(w.make_model())
    opt = w.make_optimizer(model.parameters())
    X, Y = w.data_of(rank, PHASE, WHO)
    result = {"rank": rank}
    t0 = time.monotonic()
    try:
        with simulated_device(capacity if rank == 1 else 1 << 34, allocator=allocator):
            if method != "accelerate":
                guarded = oomguard(retry="batch_size", timeout=4 * timeout, quiet=True, search=method == "--search")(
                    lambda model, opt, batch_size=w.BATCH: step(model, opt, X, Y, batch_size))
                try:
                    result["value"] = guarded(model, opt)
                finally:
                    report = guarded.last_report
                    result["tried"] = [a.value for a in report.attempts] if report is not None else []
            else:
                from accelerate.utils import find_executable_batch_size

                result["tried"] = tried = []

                @find_executable_batch_size(starting_batch_size=w.BATCH)
                def run(batch_size):
                    tried.append(batch_size)
                    try:
                        return step(model, opt, X, Y, batch_size)
                    except oom_class() as exc:
                        # the simulated device says "CUDA out of memory (simulated device)."; accelerate looks
                        # for " out of memory." as in CUDA's own message (as bench_retry_training.py does)
                        raise RuntimeError("CUDA out of memory. " + str(exc)) from None

                result["value"] = run()
    except Exception as exc:  # noqa: BLE001 - the table says what each rank stopped with
        text = str(exc).splitlines()[0]
        result["error"] = type(exc).__name__ + (" (collective: " + text.rsplit("] ", 1)[-1][:40] + ")"
                                                if "gloo" in text else f": {text[:60]}")
    result["seconds"] = time.monotonic() - t0
    result["params"] = [p.detach().clone() for p in model.module.parameters()]
    torch.save(result, f"{out}/{method}{rank}.pt")
    dist.destroy_process_group()


def oom_class():
    return getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


def largest_fitting(capacity: int) -> int:
    """The largest batch_size whose step fits rank 1's device (a plain model copy, one process)."""
    from cuda_magic import simulated_device

    X, Y = w.data_of(1, PHASE, WHO)

    def fits(b):
        model = w.make_model()
        opt = w.make_optimizer(model.parameters())
        try:
            with simulated_device(capacity, allocator=ALLOCATOR):
                step(model, opt, X, Y, b)
            return True
        except oom_class():
            return False

    lo, hi = 0, w.BATCH
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def forward_peak(b: int) -> int:
    """Rank 1's peak after the forward pass at batch b, on a device too large to fill."""
    from cuda_magic import simulated_device

    X, Y = w.data_of(1, PHASE, WHO)
    with simulated_device(1 << 34, allocator=ALLOCATOR) as dev:
        w.loss_of(w.make_model(), X[:b].clone(), Y[:b].clone(), False)
        return dev.peak_reserved if ALLOCATOR == "caching" else dev.peak


def main(argv=None) -> None:
    global ALLOCATOR
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=10.0, help="the process group's timeout, seconds")
    parser.add_argument("--plain", action="store_true", help="the simulated devices count the tensors' bytes")
    parser.add_argument("--only", nargs="+", choices=[m.lstrip("-") for m in METHODS],
                        help="run only these methods (r: -r, search: --search, accelerate)")
    parser.add_argument("--check", action="store_true",
                        help="exit status 1 unless every cuda_magic method ends every rank at one value within "
                             "15%% of the largest that fits")
    args = parser.parse_args(argv)
    ALLOCATOR = "plain" if args.plain else "caching"
    capacity = int(forward_peak(w.BATCH) * 0.7)
    best = largest_fitting(capacity)
    rows, found_of = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        chosen = [m for m in METHODS if args.only is None or m.lstrip("-") in args.only]
        for i, method in enumerate(chosen):
            t0 = time.monotonic()
            mp.start_processes(rank_main, args=(method, f"{tmp}/{i}-init", tmp, capacity, args.timeout,
                                                ALLOCATOR), nprocs=2, start_method="spawn", join=True)
            wall = time.monotonic() - t0
            res = [torch.load(f"{tmp}/{method}{r}.pt", weights_only=False) for r in range(2)]
            equal = all(torch.equal(a, b) for a, b in zip(res[0]["params"], res[1]["params"]))
            ends = ", ".join(f"rank {r['rank']}: " + (str(r["value"]) if "value" in r else r["error"]) for r in res)
            tried = " / ".join(" ".join(map(str, r.get("tried") or [])) or "-" for r in res)
            values = {r.get("value") for r in res}
            found = values.pop() if len(values) == 1 and None not in values else None
            share = f"{found} ({100 * found / best:.1f}%)" if found else "-"
            found_of[method] = found
            rows.append((method, ends, tried, share, best, f"{wall:.1f}", max(r["seconds"] for r in res), equal))
    print(f"`{' '.join([Path(sys.executable).name, *sys.argv])}` (2 processes, gloo, one rank out of memory in "
          f"the {PHASE} pass at {w.BATCH}, {ALLOCATOR} allocator, process group timeout {args.timeout:g} s, "
          f"torch {torch.__version__}, {os.cpu_count()} cores)\n")
    print("| method | what each rank ended at | values each rank ran (rank 0 / rank 1) | found (of largest) | "
          "largest that fits rank 1 | wall s (with process start) | s in the call | models equal across ranks |")
    print("|---|---|---|---|---|---|---|---|")
    for method, ends, tried, share, fit, wall, seconds, equal in rows:
        print(f"| {method} | {ends} | {tried} | {share} | {fit} | {wall} | {seconds:.1f} | {equal} |")
    short = [method for method, _, _, _, _, _, _, _ in rows if method != "accelerate"
             and not (found_of[method] and found_of[method] >= 0.85 * best)]
    if args.check and short:
        sys.exit(f"not within 15% of the largest that fits ({best}): {', '.join(short)}")


if __name__ == "__main__":
    main()
