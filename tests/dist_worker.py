"""One rank of the distributed retry tests (tests/test_distributed.py), run as its own process:

    python tests/dist_worker.py RANK WORLD INIT_FILE SCENARIO OUT_DIR

SCENARIO is "PHASE:WHO[:FLAG...]": PHASE forward / backward / step / error / stall, WHO one (rank 1 alone
runs out: a longer sequence, its own small simulated device) or all. Each rank trains one DDP step under
`oomguard(retry="batch_size")` on its own simulated device, whose capacity is measured so that the
step fails in PHASE at batch_size=64; it saves what it ended with to OUT_DIR/rank{R}.pt. FLAGs: accum,
search, floor (min=60); block: the step in `with oomguard(raise_on_oom=False)` instead, in the user's own
loop that halves the batch while the report says "oom" (raise: raise_on_oom=True, no loop).
"""
from __future__ import annotations

import datetime
import sys
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn

D, SEQ, ROWS, BATCH = 32, 8, 512, 64
POOLED_SEQ = 64          # the step scenario: a long input averaged first, so the optimizer step is the peak
GROUP_TIMEOUT = 6        # seconds: the process group's own timeout (a rank blocked in DDP's all-reduce)
AGREE_TIMEOUT = 20       # seconds: oomguard(timeout=...), above GROUP_TIMEOUT and what a failing rank takes


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))


def seq_of(rank: int, phase: str, who: str) -> int:
    if phase == "step":
        return POOLED_SEQ * (2 if who == "one" and rank == 1 else 1)
    return SEQ * (4 if who == "one" and rank == 1 else 1)


def data_of(rank: int, phase: str, who: str):
    g = torch.Generator().manual_seed(100 + rank)
    seq = seq_of(rank, phase, who)
    return torch.randn(ROWS, seq, D, generator=g), torch.randn(ROWS, 8, generator=g)


def make_optimizer(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def loss_of(model, x, y, pooled: bool):
    out = model(x.mean(1)) if pooled else model(x).mean(1)
    return ((out - y) ** 2).mean()


def reference(world: int, phase: str, who: str, batch: int, accum: int):
    """One clean step at (batch, accum) of the same model on every rank's data, as DDP averages it."""
    model = make_model()
    opt = make_optimizer(model.parameters())
    total = 0
    for r in range(world):
        x, y = data_of(r, phase, who)
        for i in range(accum):
            total = total + loss_of(model, x[i * batch:(i + 1) * batch], y[i * batch:(i + 1) * batch],
                                    phase == "step") / accum / world
    total.backward()
    opt.step()
    return model.state_dict(), opt.state_dict()


def phase_peaks(rank, phase, who, batch):
    """Peaks of the step on a throwaway DDP copy of the model on a large simulated device: after forward,
    backward, step (every rank measures: DDP's collectives need them all)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cuda_magic import simulated_device

    model = DDP(make_model())
    opt = make_optimizer(model.parameters())
    X, Y = data_of(rank, phase, who)
    with simulated_device(1 << 34, allocator="plain") as dev:
        x, y = X[:batch].clone(), Y[:batch].clone()
        out = model(x.mean(1)) if phase == "step" else model(x).mean(1)
        loss = ((out - y) ** 2).mean()
        forward = dev.peak
        loss.backward()
        backward = dev.peak
        opt.step()
        step = dev.peak
    return forward, backward, step


def capacity_for(rank, phase, who) -> int:
    tight = who == "all" or rank == 1
    if phase in ("error", "stall"):
        return 1 << 34
    f, b, s = phase_peaks(rank, phase, who, BATCH)
    if not tight:
        return 1 << 34
    if phase == "forward":
        return int(f * 0.7)
    if phase == "backward":
        assert b > f, (f, b)
        return (f + b) // 2
    assert s > b, (f, b, s)
    return (b + s) // 2


def main(rank: int, world: int, init_file: str, scenario: str, out_dir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cuda_magic import oomguard, simulated_device

    phase, who, *more = scenario.split(":")
    accumulate = "accum" if "accum" in more else None
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT))
    result: dict = {"rank": rank}
    capacity = capacity_for(rank, phase, who)
    model = DDP(make_model())
    opt = make_optimizer(model.parameters())
    X, Y = data_of(rank, phase, who)
    log: list = []

    @oomguard(retry="batch_size", accumulate=accumulate, timeout=AGREE_TIMEOUT, search="search" in more,
              min=60 if "floor" in more else 1)
    def train(model, opt, batch_size=BATCH, accum=1):
        log.append(("start", batch_size, accum))
        for i in range(accum):
            x, y = X[i * batch_size:(i + 1) * batch_size].clone(), Y[i * batch_size:(i + 1) * batch_size].clone()
            log.append("forward")
            if phase == "error" and rank == 1:
                raise ValueError("a bug on rank 1")
            if phase == "stall" and rank == 1:
                time.sleep(AGREE_TIMEOUT + 5)
            loss = loss_of(model, x, y, phase == "step") / accum
            log.append("backward")
            loss.backward()
        log.append("step")
        opt.step()
        opt.zero_grad(set_to_none=True)
        log.append("done")
        return batch_size

    guard = oomguard(timeout=AGREE_TIMEOUT, raise_on_oom="raise" in more)

    def train_in_blocks(batch_size=BATCH):
        """The user's own loop around `with oomguard():` (no retry: a block cannot run again)."""
        result["blocks"] = blocks = []
        while True:
            log.append(("start", batch_size, 1))
            with guard as report:
                x, y = X[:batch_size].clone(), Y[:batch_size].clone()
                log.append("forward")
                if phase == "error" and rank == 1:
                    raise ValueError("a bug on rank 1")
                loss = loss_of(model, x, y, phase == "step")
                log.append("backward")
                loss.backward()
                log.append("step")
                opt.step()
                log.append("done")
            opt.zero_grad(set_to_none=True)
            blocks.append({"outcome": str(report.outcome), "warnings": list(report.warnings),
                           "ranks": report.ranks})
            if report.outcome != "oom":
                return batch_size
            batch_size //= 2

    t0 = time.monotonic()
    try:
        with simulated_device(capacity, allocator="plain"):
            if "block" in more:
                result["value"], result["final_accum"] = train_in_blocks(), 1
            else:
                result["value"] = train(model, opt)
        if "block" not in more:
            report = train.last_report
            result["final_accum"] = report.retry.final_accumulate
            result["outcome"] = str(report.outcome)
            result["ranks"] = report.ranks
            result["warnings"] = list(report.warnings)
            result["reasons"] = [a.reason for a in report.attempts]
    except Exception as exc:  # noqa: BLE001 - what each rank stopped with is the test's to read
        report = guard.report if "block" in more else train.last_report
        result["ranks"] = report.ranks if report is not None else None
        result["warnings"] = list(report.warnings) if report is not None else []
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["trace"] = traceback.format_exc()
    result["seconds"] = time.monotonic() - t0
    result["log"] = log
    result["model"] = {k: v.clone() for k, v in model.module.state_dict().items()}
    result["optimizer"] = opt.state_dict()
    torch.save(result, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()

if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
