"""Attempts and found/maximum of batch-size retry policies, from starts 4096, 1000 and 300.

    .venv/bin/python bench/bench_retry.py [--tensors N]

Policies: (a) `%%oomguard -r VAR`: a value predicted from the failure, less a margin; (b) halving then
bisection to the exact maximum, the naive search; (c) `%%oomguard -r VAR --search` (cuda_magic.recover.retry.BatchSearch); (d) accelerate's
`find_executable_batch_size` (multiplies by 0.9 on each OOM; skipped with a note where accelerate is not
installed: it is not a dependency of cuda_magic).

The policies alone: the training cell as users run it (with the rollback) is bench_retry_training.py.
`run_table(make_runner)` takes a factory of runners, so the memory model here can be swapped for a real
device: `make_runner()` returns a fresh runner with `.maximum` (largest value that fits), `.capacity`
(bytes) and `runner(value) -> Outcome`.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuda_magic.recover.retry import BatchSearch  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20
STARTS = (4096, 1000, 300)


@dataclass
class Outcome:
    """What one run of the cell measured; sizes in bytes."""

    ok: bool
    peak: int | None = None                   # allocated peak of a run that fitted
    requested: int | None = None              # the allocation that failed
    baseline: int | None = None               # allocated before the run
    allocated_at_failure: int | None = None
    capacity: int | None = None


class ModelRunner:
    """A cell whose memory grows linearly with the value: after the baseline, a fixed part, then the
    per-unit part as `tensors` equal tensors; the first allocation over the capacity fails."""

    def __init__(self, capacity=8 * GiB, baseline=2 * GiB, fixed=512 * MiB, per_unit=24 * MiB, tensors=1):
        self.capacity, self.baseline, self.fixed = capacity, baseline, fixed
        self.per_unit, self.tensors = per_unit, tensors
        self.maximum = (capacity - baseline - fixed) // per_unit

    def __call__(self, value: int) -> Outcome:
        allocated = self.baseline
        for size in [self.fixed] + [self.per_unit * value // self.tensors] * self.tensors:
            if allocated + size > self.capacity:
                return Outcome(False, requested=size, baseline=self.baseline,
                               allocated_at_failure=allocated, capacity=self.capacity)
            allocated += size
        return Outcome(True, peak=allocated, baseline=self.baseline, capacity=self.capacity)


class SimRunner:
    """The same kind of cell run for real on cuda_magic's simulated device: a baseline tensor (the model),
    then per unit of the value an input row, its ReLU and a scaled copy (three live tensors at the peak).
    The maximum is found by bisection on the runner itself; outcomes are what the device measured."""

    def __init__(self, capacity=64 * MiB, baseline=4 * MiB, row=22400):
        self.capacity, self.baseline_bytes, self.row = capacity, baseline, row
        self.maximum = self._largest_fitting()

    def __call__(self, value: int) -> Outcome:
        import torch

        from cuda_magic.oom.messages import parse_oom_message
        from cuda_magic.devices.simulated import SimulatedDevice

        dev = SimulatedDevice(self.capacity)
        with dev:
            model = torch.empty(self.baseline_bytes, dtype=torch.uint8)
            baseline = dev.allocated
            dev.reset_peak()
            try:
                x = torch.randn(value, self.row)
                y = x.relu()
                z = y * 2
                del x, y, z
            except torch.OutOfMemoryError as exc:
                fields = parse_oom_message(str(exc))
                return Outcome(False, requested=fields.requested, baseline=baseline,
                               allocated_at_failure=dev.allocated, capacity=self.capacity)
            finally:
                del model
        return Outcome(True, peak=dev.peak, baseline=baseline, capacity=self.capacity)

    def _largest_fitting(self) -> int:
        lo, hi = 0, 1
        while self(hi).ok:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self(mid).ok else (lo, mid)
        return lo


def retry(runner, start: int) -> tuple[int, int | None]:
    """(attempts, value found) for `%%oomguard -r VAR`."""
    return _drive(BatchSearch(start, search=False), runner)


def halving_then_bisection(runner, start: int) -> tuple[int, int | None]:
    """Halve until a value fits, then bisect between it and the smallest failure down to the exact max."""
    attempts, value, failed = 0, start, None
    while value >= 1:
        attempts += 1
        if runner(value).ok:
            break
        failed, value = value, value // 2
    else:
        return attempts, None
    best = value
    while failed is not None and failed - best > 1:
        middle = (best + failed) // 2
        attempts += 1
        if runner(middle).ok:
            best = middle
        else:
            failed = middle
    return attempts, best


def oomguard_search(runner, start: int) -> tuple[int, int | None]:
    """(attempts, value found) for `%%oomguard -r VAR --search`."""
    return _drive(BatchSearch(start, search=True, capacity=runner.capacity), runner)


def _drive(policy: BatchSearch, runner) -> tuple[int, int | None]:
    value = policy.first()
    while value is not None:
        out = runner(value)
        policy.record(value, out.ok, peak=out.peak, requested=out.requested, baseline=out.baseline,
                      allocated_at_failure=out.allocated_at_failure, capacity=out.capacity)
        value = policy.next()
    return len(policy.attempts), policy.best


def accelerate_search(runner, start: int) -> tuple[int, int | None] | None:
    """accelerate's decorator on the same runner, which raises a CUDA-style OutOfMemoryError; None when
    accelerate is not installed."""
    try:
        from accelerate.utils import find_executable_batch_size
    except ImportError:
        return None
    import torch

    attempts = 0

    @find_executable_batch_size(starting_batch_size=start)
    def cell(batch_size):
        nonlocal attempts
        attempts += 1
        out = runner(batch_size)
        if not out.ok:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {out.requested / MiB:.2f} MiB. GPU 0 has a total "
                f"capacity of {out.capacity / GiB:.2f} GiB of which 0 bytes is free.")
        return batch_size

    try:
        found = cell()
    except RuntimeError:  # "No executable batch size found, reached zero."
        found = None
    return attempts, found


POLICIES = {
    "`-r`": retry,
    "halving + bisection": halving_then_bisection,
    "--search": oomguard_search,
    "accelerate": accelerate_search,
}


def run_table(make_runner, starts=STARTS) -> list[dict]:
    """One row per start: for each policy, attempts and found; a policy that cannot run gives None."""
    rows = []
    for start in starts:
        row = {"start": start}
        for name, policy in POLICIES.items():
            runner = make_runner()
            row["maximum"] = runner.maximum
            result = policy(runner, start)
            row[name] = None if result is None else {"attempts": result[0], "found": result[1]}
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    names = [n for n in POLICIES if any(r[n] is not None for r in rows)]
    head = ["start", "maximum"] + [f"{n}: attempts, found" for n in names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["start"]), str(r["maximum"])]
        for n in names:
            found = r[n]["found"]
            share = f"{found / r['maximum']:.1%}" if found else "none"
            cells.append(f"{r[n]['attempts']}, {found} ({share})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=1,
                        help="split the per-unit memory into this many tensors (the OOM then comes earlier)")
    parser.add_argument("--device", choices=("model", "sim"), default="model",
                        help="model: the memory model above; sim: real tensors on the simulated device")
    args = parser.parse_args(argv)
    if args.device == "sim":
        maximum = SimRunner().maximum
        rows = run_table(SimRunner)
        print("note: accelerate is not installed; its column is skipped (pip install accelerate)"
              if all(r["accelerate"] is None for r in rows) else "", end="")
        print(f"simulated device: 64 MiB, 4 MiB baseline, per unit three rows of 22400 float32 "
              f"(maximum {maximum})\n")
        print(markdown(rows))
        return
    rows = run_table(lambda: ModelRunner(tensors=args.tensors))
    if all(r["accelerate"] is None for r in rows):
        print("note: accelerate is not installed; its column is skipped (pip install accelerate)")
    print(f"memory model: 8 GiB capacity, 2 GiB baseline, 512 MiB fixed + 24 MiB per unit "
          f"in {args.tensors} tensor(s)\n")
    print(markdown(rows))


if __name__ == "__main__":
    main()
