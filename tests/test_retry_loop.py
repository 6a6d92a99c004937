"""The one retry loop (recover/retry_loop.py): what --search does after its last probe, and a real run at the
value found undone like any attempt. The same loop runs the ranks of a process group (tests/test_distributed.py
checks that with one rank it decides as one process does)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from cuda_magic import oomguard, simulated_device  # noqa: E402

CAPACITY = 300_000      # bytes of a plain simulated device: the cliff's cell fits up to CLIFF (16 KiB a unit)
CLIFF = 20


def cliff_step(calls, fail_at):
    """A step that fits up to CLIFF and needs four times as much above it (no line through its peaks finds
    the cliff: --search's last probe up runs out); it adds 1 to the model's weight in place first, and the
    call numbered `fail_at[0]` needs eight times as much."""

    @oomguard(retry="n", search=True, quiet=True)
    def step(model, n=64):
        calls[0] += 1
        with torch.no_grad():
            model.weight.add_(1.0)
        rows = (n if n <= CLIFF else 4 * n) * (8 if calls[0] == fail_at[0] else 1)
        return float(torch.zeros(rows, 1024).sum())

    return step


def test_after_a_probe_up_runs_out_the_value_found_runs_for_real():
    model, calls = torch.nn.Linear(4, 4), [0]
    step = cliff_step(calls, [None])
    start = model.weight.detach().clone()
    with simulated_device(CAPACITY, allocator="plain"):
        step(model)
    report = step.last_report
    assert report.outcome == "recovered" and report.final_value == CLIFF, report.attempts
    probe_up, real = report.attempts[-2], report.attempts[-1]
    assert probe_up.outcome == "oom" and probe_up.value > CLIFF            # the last probe ran out
    assert (real.value, real.outcome, real.probe) == (CLIFF, "ok", False)
    assert real.reason == "the largest value the probes found to fit"
    assert torch.equal(model.weight, start + 1)          # every other attempt undone: the real run's step stands


def test_a_real_run_at_the_value_found_that_runs_out_is_undone():
    model, calls = torch.nn.Linear(4, 4), [0]
    step = cliff_step(calls, [None])
    with simulated_device(CAPACITY, allocator="plain"):
        step(model)
    runs = calls[0]                                      # the same attempts again, the last one running out
    model, calls[0] = torch.nn.Linear(4, 4), 0
    start = model.weight.detach().clone()
    step = cliff_step(calls, [runs])
    with simulated_device(CAPACITY, allocator="plain"), pytest.raises(torch.cuda.OutOfMemoryError):
        step(model)
    report = step.last_report
    assert report.outcome == "oom" and len(report.attempts) == runs
    assert f"n={CLIFF} fitted as a probe but ran out of memory when run for real" in report.warnings
    assert report.not_undone == []
    assert torch.equal(model.weight, start)              # the failed real run's step was undone too
