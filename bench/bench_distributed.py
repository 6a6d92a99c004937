"""The retry under torch.distributed: cuda_magic's `oomguard(retry=...)` beside accelerate's
`find_executable_batch_size`, in the same 2-process DDP run (gloo, CPU; tests/dist_worker.py's model and
data): rank 1 alone runs out of memory in the forward pass at batch_size=64 (a longer sequence, its own
small simulated device). Reports, for each: whether every rank finished, the value each rank ended at,
the largest value that fits rank 1, wall time, and whether the models are equal across ranks.

    .venv/bin/python bench/bench_distributed.py [--timeout 10]
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

PHASE, WHO = "forward", "one"


def step(model, opt, X, Y, batch_size):
    w.loss_of(model, X[:batch_size].clone(), Y[:batch_size].clone(), False).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return batch_size


def rank_main(rank, method, init, out, capacity, timeout):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cuda_magic import oomguard, simulated_device

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout))
    model = DDP(w.make_model())
    opt = w.make_optimizer(model.parameters())
    X, Y = w.data_of(rank, PHASE, WHO)
    result = {"rank": rank}
    t0 = time.monotonic()
    try:
        with simulated_device(capacity if rank == 1 else 1 << 34, allocator="plain"):
            if method == "cuda_magic":
                guarded = oomguard(retry="batch_size", timeout=4 * timeout, quiet=True)(
                    lambda model, opt, batch_size=w.BATCH: step(model, opt, X, Y, batch_size))
                result["value"] = guarded(model, opt)
            else:
                from accelerate.utils import find_executable_batch_size

                @find_executable_batch_size(starting_batch_size=w.BATCH)
                def run(batch_size):
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
            with simulated_device(capacity, allocator="plain"):
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
    from cuda_magic import simulated_device

    X, Y = w.data_of(1, PHASE, WHO)
    with simulated_device(1 << 34, allocator="plain") as dev:
        w.loss_of(w.make_model(), X[:b].clone(), Y[:b].clone(), False)
        return dev.peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=10.0, help="the process group's timeout, seconds")
    args = parser.parse_args()
    capacity = int(forward_peak(w.BATCH) * 0.7)
    best = largest_fitting(capacity)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in ("cuda_magic", "accelerate"):
            t0 = time.monotonic()
            mp.start_processes(rank_main, args=(method, f"{tmp}/{method}-init", tmp, capacity, args.timeout),
                               nprocs=2, start_method="spawn", join=True)
            wall = time.monotonic() - t0
            res = [torch.load(f"{tmp}/{method}{r}.pt", weights_only=False) for r in range(2)]
            equal = all(torch.equal(a, b) for a, b in zip(res[0]["params"], res[1]["params"]))
            ends = ", ".join(f"rank {r['rank']}: " + (str(r["value"]) if "value" in r else r["error"]) for r in res)
            rows.append((method, ends, best, f"{wall:.1f}", max(r["seconds"] for r in res), equal))
    print(f"`{' '.join([Path(sys.executable).name, *sys.argv])}` (2 processes, gloo, process group timeout "
          f"{args.timeout:g} s, torch {torch.__version__}, {os.cpu_count()} cores)\n")
    print("| method | what each rank ended at | largest that fits rank 1 | wall s (with process start) | "
          "s in the call | models equal across ranks |")
    print("|---|---|---|---|---|---|")
    for method, ends, fit, wall, seconds, equal in rows:
        print(f"| {method} | {ends} | {fit} | {wall} | {seconds:.1f} | {equal} |")


if __name__ == "__main__":
    main()
