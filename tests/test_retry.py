"""The batch-size retry policy, driven by a memory model of a cell (pure: no torch, no IPython)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuda_magic.recover.progress import ModelCost, Progress
from cuda_magic.recover.retry import BatchSearch, scale_accumulation

GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10


@dataclass
class CellMemory:
    """A cell whose memory grows with the value v: a fixed part, then the per-unit part allocated as
    tensors in the order of `shares` (fractions of per_unit * v), optionally a quadratic term, values
    rounded up to `step` (allocator rounding), and a transient `spike` taken and freed after the fixed part.
    The first allocation that would go over the capacity fails, as a caching allocator's would."""

    capacity: int
    baseline: int
    fixed: int
    per_unit: int
    shares: tuple[float, ...] = (1.0,)
    quadratic: int = 0          # bytes * v * v
    step: int = 1
    spike: int = 0

    def events(self, v: int) -> list[int]:
        units = -(-v // self.step) * self.step
        out = [self.fixed]
        if self.spike:
            out += [self.spike, -self.spike]
        out += [int(self.per_unit * units * share) for share in self.shares]
        if self.quadratic:
            out.append(self.quadratic * v * v)
        return out

    def peak(self, v: int) -> int:
        total = top = self.baseline
        for size in self.events(v):
            total += size
            top = max(top, total)
        return top

    def run(self, v: int) -> dict:
        total = top = self.baseline
        for size in self.events(v):
            if size > 0 and total + size > self.capacity:
                return dict(ok=False, requested=size, baseline=self.baseline, allocated_at_failure=total)
            total += size
            top = max(top, total)
        return dict(ok=True, peak=top, baseline=self.baseline)

    def maximum(self) -> int:
        lo, hi = 0, 1
        while self.peak(hi) <= self.capacity:
            hi *= 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.peak(mid) <= self.capacity else (lo, mid)
        return lo


def with_maximum(maximum: int, *, capacity=16 * GiB, baseline=2 * GiB, fixed_share=0.1, **kw) -> CellMemory:
    """A model whose largest fitting value is `maximum` (checked)."""
    available = capacity - baseline
    fixed = int(available * fixed_share)
    scale = sum(kw.get("shares", (1.0,)))
    per_unit = int((available - fixed - kw.get("quadratic", 0) * maximum**2) / ((maximum + 0.5) * scale))
    model = CellMemory(capacity, baseline, fixed, per_unit, **kw)
    return model


def drive(model: CellMemory, start: int, *, search=True, floor=1, capacity=True, **options) -> BatchSearch:
    policy = BatchSearch(start, floor, search, model.capacity if capacity else None, **options)
    value = policy.first()
    while value is not None:
        assert value >= floor
        policy.record(value, **model.run(value))
        value = policy.next()
    return policy


def check_invariants(policy: BatchSearch, floor: int = 1) -> None:
    values = [v for v, _, _, _ in policy.attempts]
    assert len(values) == len(set(values)), f"a value was tried twice: {values}"
    smallest_failed = None
    for value, ok, _, _ in policy.attempts:
        assert value >= floor
        if smallest_failed is not None:
            assert value < smallest_failed, f"{value} tried after {smallest_failed} failed: {values}"
        if not ok:
            smallest_failed = value if smallest_failed is None else min(smallest_failed, value)
    assert policy.done
    assert policy.best == max((v for v, ok, _, _ in policy.attempts if ok), default=None)


# --- accumulation -------------------------------------------------------------------------------
@pytest.mark.parametrize("original, accum, new, expected", [
    (64, 1, 32, 2), (64, 1, 20, 4), (100, 3, 64, 5), (32, 2, 32, 2), (32, 4, 64, 2), (32, 1, 64, 1),
    (1000, 1, 999, 2), (7, 3, 1, 21),
])
def test_scale_accumulation(original, accum, new, expected):
    result = scale_accumulation(original, accum, new)
    assert result == expected
    assert new * result >= original * accum > new * (result - 1) or result == 1


@pytest.mark.parametrize("args", [(0, 1, 4), (4, 0, 4), (4, 1, 0)])
def test_scale_accumulation_rejects_non_positive(args):
    with pytest.raises(ValueError):
        scale_accumulation(*args)


# --- arguments and protocol ---------------------------------------------------------------------
@pytest.mark.parametrize("start, floor", [(0, 1), (4, 0), (3, 4), (True, 1), (2.5, 1)])
def test_rejects_bad_start_and_floor(start, floor):
    with pytest.raises(ValueError):
        BatchSearch(start, floor)


def test_record_must_match_the_value_to_run():
    policy = BatchSearch(64)
    assert policy.first() == 64
    with pytest.raises(RuntimeError):
        policy.next()
    with pytest.raises(ValueError):
        policy.record(32, ok=False)
    policy.record(64, ok=False)
    assert policy.next() == 32


# --- without --search: a prediction from the failure, less a margin ----------------------------------
@pytest.mark.parametrize("maximum", [128, 130, 200, 256, 300])
@pytest.mark.parametrize("shares", [(1.0,), (0.5, 0.5), (0.3, 0.3, 0.4)])
def test_retry_fits_at_the_first_or_second_retry_within_15_percent(maximum, shares):
    """Item 2: the failure's measure (what it had and asked for) predicts the largest value; the first
    retry aims 12% below it. A failure that comes early in the cell (the first of several tensors per
    unit) overestimates the largest value, so it takes a retry or two more, each from its own failure."""
    model = with_maximum(maximum, shares=shares)
    policy = drive(model, 1024, search=False)
    check_invariants(policy)
    values = [v for v, _, _, _ in policy.attempts]
    assert values[0] == 1024 and len(values) <= 1 + len(shares), values
    assert "leaves possible" in policy.history[1].reason
    if shares == (1.0,):                     # the failing allocation was the peak: one retry
        assert len(values) == 2, values
    assert 0.85 * maximum <= policy.best <= maximum and not policy.exhausted


def test_retry_without_a_capacity_halves():
    policy = drive(with_maximum(200), 1024, search=False, capacity=False)
    assert [v for v, _, _, _ in policy.attempts][:3] == [1024, 512, 256]
    assert policy.history[1].reason == "halved from 1024"


def test_two_failures_with_the_same_request_mean_the_value_does_not_matter():
    """Item 4: the same request with the same memory in use at two values: stop, do not walk to 1."""
    policy = BatchSearch(1024, search=False, capacity=1000)
    value = policy.first()
    while value is not None:
        policy.record(value, ok=False, requested=2000, baseline=0, allocated_at_failure=100, peak=100)
        value = policy.next()
    assert len(policy.attempts) == 2 and policy.independent and policy.exhausted
    assert "does not depend" in policy.stop_reason


def test_start_that_fits_runs_once_with_and_without_search():
    model = with_maximum(500)
    for search in (False, True):
        policy = drive(model, 300, search=search)
        assert policy.attempts == [(300, True, model.peak(300), None)]
        assert policy.best == 300 and not policy.exhausted


def test_floor_is_tried_last_and_exhausts():
    model = with_maximum(10)
    policy = drive(model, 100, search=False, floor=30)
    assert [v for v, _, _, _ in policy.attempts] == [100, 30]
    assert policy.exhausted and policy.best is None
    assert "floor" in policy.stop_reason


def test_floor_that_fits_is_the_answer():
    model = with_maximum(40)
    policy = drive(model, 100, search=False, floor=30)
    assert [v for v, _, _, _ in policy.attempts] == [100, 37]
    assert policy.best == 37 and not policy.exhausted


def test_start_at_floor_that_fails_is_exhausted_at_once():
    policy = drive(with_maximum(10), 16, search=True, floor=16)
    assert len(policy.attempts) == 1 and policy.exhausted


@pytest.mark.parametrize("maximum", [1, 3, 33])
def test_search_never_goes_below_floor(maximum):
    model = with_maximum(maximum, fixed_share=0.0)
    policy = drive(model, 4096, search=True, floor=8)
    check_invariants(policy, floor=8)
    if maximum < 8:
        assert policy.exhausted and policy.attempts[-1][0] == 8
    else:
        assert policy.best >= 0.95 * maximum


# --- with --search: predictions -----------------------------------------------------------------
MODELS = [  # (capacity, baseline, fixed share) on the model the issue describes: the failing allocation
    (8 * GiB, 2 * GiB, 0.0),        # is the cell's big per-unit tensor, after everything else
    (16 * GiB, 1 * GiB, 0.1),
    (24 * GiB, 6 * GiB, 0.3),
    (80 * GiB, 30 * GiB, 0.5),
    (12 * GiB, 0, 0.6),
]


@pytest.mark.parametrize("start", [4096, 1000, 300, 235, 20000])
@pytest.mark.parametrize("capacity, baseline, fixed_share", MODELS)
def test_search_gets_within_5_percent_in_4_attempts(start, capacity, baseline, fixed_share):
    model = with_maximum(234, capacity=capacity, baseline=baseline, fixed_share=fixed_share)
    maximum = model.maximum()
    assert maximum == 234
    policy = drive(model, start)
    check_invariants(policy)
    assert len(policy.attempts) <= 4, policy.history
    assert 0.95 * maximum <= policy.best <= maximum


def test_first_step_after_a_failure_is_a_prediction():
    model = with_maximum(234, fixed_share=0.0)
    policy = BatchSearch(4096, search=True, capacity=model.capacity)
    policy.record(policy.first(), **model.run(4096))
    second = policy.next()
    assert second < 4096 // 4 and second <= 234
    assert "failure at 4096" in policy.reason
    policy.record(second, **model.run(second))
    third = policy.next()
    assert "peak" in policy.reason
    assert 0.95 * 234 <= third <= 234  # no fixed part: the peak per unit is the whole story


def test_without_capacity_search_halves_then_bisects():
    model = with_maximum(234)
    policy = drive(model, 4096, capacity=False)
    check_invariants(policy)
    values = [v for v, _, _, _ in policy.attempts]
    assert values[:6] == [4096, 2048, 1024, 512, 256, 128]
    assert values[6] == (128 + 256) // 2
    assert "bisecting" in policy.history[6].reason
    assert len(values) <= 8 and policy.best >= 0.9 * 234


def test_capacity_can_come_with_the_failure():
    model = with_maximum(234, fixed_share=0.0)
    policy = BatchSearch(4096, search=True)
    policy.record(policy.first(), capacity=model.capacity, **model.run(4096))
    assert policy.next() < 2048  # the capacity from the message made a prediction possible


def test_a_failed_prediction_narrows_the_search():
    # strongly super-linear memory: the linear prediction from the peaks overshoots
    model = with_maximum(200, quadratic=200 * 1024, fixed_share=0.2)
    maximum = model.maximum()
    policy = drive(model, 4096)
    check_invariants(policy)
    assert 0.95 * maximum <= policy.best <= maximum
    assert len(policy.attempts) <= 8


def test_a_baseline_that_grows_after_each_failure():
    model = with_maximum(300, fixed_share=0.2)
    policy = BatchSearch(4096, search=True, capacity=model.capacity)
    value = policy.first()
    while value is not None:
        policy.record(value, **model.run(value))
        if not policy.history[-1].ok:
            model.baseline += 64 * MiB  # a leak the clean-up did not get back
        value = policy.next()
    check_invariants(policy)
    assert 0.95 * model.maximum() <= policy.best <= model.maximum()


variants = st.sampled_from(["single", "two", "sixteen", "quadratic", "step", "spike"])


@settings(max_examples=300, deadline=None)
@given(
    variant=variants,
    maximum=st.integers(40, 3000),
    fixed_share=st.sampled_from([0.0, 0.05, 0.2, 0.4, 0.6]),
    capacity_gib=st.sampled_from([8, 16, 24, 80]),
    baseline_share=st.floats(0.0, 0.5),
    overshoot=st.floats(1.001, 40.0),
)
def test_search_from_any_start(variant, maximum, fixed_share, capacity_gib, baseline_share, overshoot):
    capacity = capacity_gib * GiB
    kw = {"single": {}, "two": {"shares": (0.4, 0.6)}, "sixteen": {"shares": (1 / 16,) * 16},
          "quadratic": {"shares": (0.3, 0.7), "quadratic": 64},
          "step": {"shares": (0.3, 0.7), "step": 8},
          "spike": {"spike": int(capacity * 0.05)}}[variant]
    model = with_maximum(maximum, capacity=capacity, baseline=int(capacity * baseline_share),
                         fixed_share=fixed_share, **kw)
    true_max = model.maximum()
    start = max(true_max + 1, int(true_max * overshoot))
    policy = drive(model, start)
    check_invariants(policy)
    assert policy.best <= true_max
    slack = kw.get("step", 1)  # rounding makes memory a staircase: one step of slack
    assert policy.best >= 0.95 * true_max - slack, policy.history
    assert len(policy.attempts) <= (4 if variant == "single" else 8), policy.history


def test_exact_tries_only_divisors_of_the_effective_batch():
    from cuda_magic.recover.retry import BatchSearch, divisors

    assert divisors(12) == [1, 2, 3, 4, 6, 12] and divisors(1) == [1] and divisors(49) == [1, 7, 49]
    policy = BatchSearch(48, 1, search=True, capacity=1000, allowed=divisors(48))
    tried = [policy.first()]
    fits = 20                                        # values up to 20 fit; 48's divisors below: 16
    while True:
        v = tried[-1]
        policy.record(v, v <= fits, peak=v * 40 if v <= fits else None, requested=None if v <= fits else 400,
                      baseline=0, allocated_at_failure=None if v <= fits else v * 30)
        nxt = policy.next()
        if nxt is None:
            break
        tried.append(nxt)
    assert all(48 % v == 0 for v in tried)
    assert policy.best == 16 and len(set(tried)) == len(tried)


# --- -r with the share of the forward pass a failure had done (recover/progress.py) -------------------
def drive_with_progress(model: CellMemory, start: int, *, known: bool = True) -> BatchSearch:
    """-r on a cell whose per-unit tensors are the outputs of len(shares) modules in turn: a failure in
    module k (of n) is k/n of the way through the forward pass."""
    policy = BatchSearch(start, 1, False, model.capacity)
    value = policy.first()
    while value is not None:
        run = model.run(value)
        progress = None
        if not run["ok"] and known:
            total, index = model.baseline, 0
            for index, size in enumerate(model.events(value)):   # the failing allocation's place
                if size > 0 and total + size > model.capacity:
                    break
                total += size
            first = 3 if model.spike else 1                       # the per-unit outputs come after these
            progress = Progress((index - first + 1) / len(model.shares)) if index >= first else None
        policy.record(value, **run, progress=progress)
        value = policy.next()
    return policy


@pytest.mark.parametrize("start", [1200, 1500, 2048, 3000, 5000])
def test_a_failure_midway_through_the_forward_pass_predicts_from_the_share_done(start):
    """Issue 9, item 2: six equal module outputs per unit (an MLP's activations); wherever in the forward
    pass the first failure comes, knowing how far it came makes the first retry fit within 15% of the
    largest value: 2 runs. Without it, a failure early in the pass overestimates what fits."""
    model = with_maximum(1000, shares=(1 / 6,) * 6, fixed_share=0.05)
    maximum = model.maximum()
    policy = drive_with_progress(model, start)
    values = [v for v, _, _, _ in policy.attempts]
    assert len(values) == 2 and 0.85 * maximum <= policy.best <= maximum, (values, maximum)
    assert "of the way through the model's forward pass" in policy.history[1].reason
    blind = drive_with_progress(model, start, known=False)
    blind_values = [v for v, _, _, _ in blind.attempts]
    assert len(blind_values) > 2 or blind.best < 0.85 * maximum, (blind_values, maximum)


def test_the_sizes_of_the_layers_still_to_run_replace_the_extrapolation():
    """A failure early in a chain of layers whose later layers are smaller (a CNN after pooling): counting
    what those layers will allocate predicts far more than extrapolating what the first layers took."""
    capacity, baseline, v = 96 * MiB, 13 * MiB, 256
    common = dict(peak=81 * MiB, requested=32 * MiB, baseline=baseline, allocated_at_failure=81 * MiB)
    values = {}
    for rest in (None, 336 * MiB):
        policy = BatchSearch(v, 1, False, capacity)
        policy.first()
        policy.record(v, False, **common,
                      progress=Progress(3 / 17, input_bytes=3 * MiB, grads_to_come=MiB, rest_bytes=rest))
        values[rest] = policy.next()
        assert ("from their sizes" in policy.reason) == (rest is not None)
    # what fits: (capacity - baseline) / (needed + rest + grads + one more activation) per unit
    assert values[336 * MiB] == int(0.88 * int(v * 83 * MiB / ((100 + 336 + 1 + 32) * MiB)))
    assert values[336 * MiB] > 1.1 * values[None]


# --- -r with the model measured on slices of the failing batch (recover/replay.py) --------------------
def measured_policy(cost, value: int = 1000) -> BatchSearch:
    """A failure at `value` on a 64 MiB device with 10 MiB before the cell, 50 MiB held, 8 MiB asked."""
    policy = BatchSearch(value, 1, False, 64 * MiB)
    policy.first()
    policy.record(value, False, peak=60 * MiB, requested=8 * MiB, baseline=10 * MiB,
                  allocated_at_failure=60 * MiB, progress=Progress(0.5, cost=cost))
    return policy


def test_the_measured_model_predicts_the_largest_value_whose_pass_fits():
    """54 MiB available. At the failure the model held 40 KiB a row of the 50 MiB (its entry line), so the
    rest, 11.2 KiB a unit, is the cell's own; the pass peaks at 2 MiB + 60 KiB a row (above 4 MiB +
    50 KiB a row from 205 rows on), and the optimizer will add 4 MiB: 6 MiB + 71.2 KiB x u <= 54 MiB up to
    u = 690, and 95% of it is tried."""
    cost = ModelCost(rows=1000, lines=((2 * MiB, 60 * KiB),), forward_lines=((0, 50 * KiB),),
                     grads_in_forward=4 * MiB, entries=((0, 40 * KiB),), state_to_come=4 * MiB,
                     probe_rows=(31, 62), seconds=0.1)
    policy = measured_policy(cost)
    assert policy.next() == int(690 * 0.95)
    assert policy.reason.startswith("95% of 690, predicted from the model measured on 31 and 62 rows")
    # without knowing what the model held at the failure, all 50 MiB count as the cell's own, per unit:
    # 6 MiB + 111.2 KiB x u <= 54 MiB up to 442
    assert measured_policy(replace(cost, entries=())).next() == int(442 * 0.95)
    # gradients and optimizer state the attempt had allocated are not the cell's per-unit memory
    held = measured_policy(replace(cost, entries=(), fixed_held=10 * MiB)).next()
    assert held > int(442 * 0.95)


def test_a_measured_batch_that_is_not_the_value_is_not_used():
    cost = ModelCost(rows=250, lines=((2 * MiB, 60 * KiB),), entries=((0, 40 * KiB),), probe_rows=(7, 14))
    policy = measured_policy(cost)
    value = policy.next()
    assert "measured" not in policy.reason and value < 1000


def test_after_a_measured_prediction_fails_the_next_is_measured_again_not_cut_to_60_percent():
    """A second failure that was measured predicts the next value itself (the 60% cut is for failures that
    say nothing better)."""
    cost = ModelCost(rows=1000, lines=((2 * MiB, 60 * KiB),), entries=((0, 40 * KiB),), probe_rows=(31, 62))
    policy = measured_policy(cost)
    second = policy.next()
    cost2 = replace(cost, rows=second, probe_rows=(20, 40))
    policy.record(second, False, peak=63 * MiB, requested=4 * MiB, baseline=10 * MiB,
                  allocated_at_failure=61 * MiB, progress=Progress(0.9, cost=cost2))
    third = policy.next()
    assert "measured" in policy.reason and int(0.6 * second) < third < second
