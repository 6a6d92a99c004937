"""The batch-size retry policy of `%%oomguard -r VAR [--min N] [--search] [-a VAR2]`.

Pure logic: no IPython, no torch. The guard drives a `BatchSearch`: it asks for a value, runs the cell
with it, records what the run measured, and asks again until the policy says it is done.

Re-running a cell is expensive (it may be a whole epoch), so `--search` does not walk. Each attempt
measures something: a run that fitted gives its exact peak above the baseline (the memory allocated
before the cell); a run that ran out of memory gives a lower bound on the peak it needed (what was
allocated when it failed plus the allocation that failed). With the capacity, and memory growing about
linearly with the value, these predict the largest value that fits:

- nothing fitted yet: a failure at v that needed at least N of the C - B available bounds the maximum by
  v * (C - B) / N; `--search` tries a quarter of that bound (plain halving when nothing was measured),
  low enough to fit even when the failing allocation came early in the cell, so that its peak is measured;
  `-r` (which keeps the first value that fits) predicts instead. Where the model was measured on slices
  of the batch it failed on (recover/replay.py: its pass's memory at each moment as a line in the rows),
  the largest value whose pass, optimizer state to come and share of the rest of what the failure held
  fit in what is available is found, and 95% of it tried. Otherwise, when the failure came inside a
  `torch.nn.Module` call, the failing module's place among the model's leaf modules says how much of the
  forward pass was done (recover/progress.py). For a chain of common layers (`nn.Sequential` all the way
  down) the output sizes of the layers still to run follow from their settings (recover/shapes.py) and
  are added to what the failure held, with one activation as large as the failing request for the
  backward pass; otherwise what the failure held, less the model's input, is extrapolated to the whole
  pass (the modules still to run taking what those before took). The gradients the backward pass has
  still to allocate are added, and 88% of the value that fits in that is tried.
  Elsewhere (no module call in the traceback) it tries 88% of the bound, or 60% when the first failure came
  midway through the cell (the failing request less than half of what it needed);
- one value fitted: its peak per unit predicts the maximum; the fixed part of the cell counted as per-unit
  memory makes this prediction fall short, never over, so it fits and gives a second exact point;
- two values fitted: their peaks give slope and fixed part, and the fitted maximum less a small margin.

A prediction that fails bounds the maximum from above (the line through the best peak and the failure's
lower bound); bisection is the last resort. Values tried are never at or above the smallest value that
failed, never below the floor, never repeated.
"""
from __future__ import annotations

from dataclasses import dataclass

from cuda_magic.recover.largest import FitMap, islands, within_bracket
from cuda_magic.recover.progress import Progress
from cuda_magic.units import format_bytes

RETRY_SHARE = 0.88   # -r: try this fraction of the largest value a failure leaves possible, when the
                     # failing request was most of what the cell needed (it failed at its peak) ...
MIDWAY_SHARE = 0.6   # ... and this one when it failed midway (many allocations, then a smaller one):
                     # the bound then overestimates by what the rest of the cell would have taken
PROGRESS_SHARE = 0.88  # -r: try this fraction of the value predicted from a failure inside the model's
                       # forward pass, extrapolated from the share of it done (recover/progress.py)
MEASURED_SHARE = 0.95  # -r: ... and this one of the value predicted from the model measured on slices
                       # of the failing batch (recover/replay.py): what remains unknown is what the cell
                       # holds besides the model in later steps (a previous step's outputs still bound)
                       # and, on a GPU, the allocator's rounding
REPEAT_SHARE = 0.6   # -r, after more than one failure (the last not measured, recover/replay.py): at most
                     # this fraction of the smallest value that failed
GOAL = 0.95          # settle once the best value is at least this fraction of the largest that can fit
MARGIN = 0.025       # predictions aim this fraction below the predicted maximum, so that they fit
DESCENT = 0.25       # nothing fitted yet: try this fraction of the largest value a failure leaves possible
MAX_ATTEMPTS = 8     # attempts in all, once something has fitted (going down never stops before the floor)


@dataclass(frozen=True)
class Measured:
    """One recorded attempt; sizes are int bytes, None where not measured."""

    value: int
    ok: bool
    reason: str                           # why this value was tried
    peak: int | None = None               # exact peak of allocated bytes during a run that fitted
    requested: int | None = None          # the allocation that failed
    baseline: int | None = None           # allocated before the cell ran
    allocated_at_failure: int | None = None
    capacity: int | None = None           # what the run could allocate in all, as known after it
    progress: Progress | None = None      # where in the model's forward pass it failed, if known

    @property
    def own_peak(self) -> int | None:
        """The cell's own peak (above the baseline) of a run that fitted."""
        if not self.ok or self.peak is None:
            return None
        return self.peak - (self.baseline or 0)

    @property
    def needed_estimate(self) -> int | None:
        """What the whole training step would have held (an estimate, not a bound): what the failure held,
        the layers still to run (from their sizes for a chain of common layers, else extrapolated from the
        share of the forward pass done: each module still to run taking what those before took, the
        model's input not counted again), and the gradients still to come."""
        needed, where = self.needed_at_least, self.progress
        if needed is None or not self.knows_progress:
            return needed
        if where.growth is not None:
            # a generation loop: what the failing step needed, and the key/value cache still to come for
            # each row where the model says its size; else all of it taken to grow with the sequence
            if where.cache_to_come is not None:
                return needed + where.cache_to_come * self.value
            return int(needed * where.growth)
        if where.rest_bytes is not None:
            # the layers still to run, from their sizes; the backward pass then holds, besides what the
            # forward pass kept, the gradient of an activation about as large as the failing one
            return needed + where.rest_bytes + where.grads_to_come + (self.requested or 0)
        inputs = min(where.input_bytes, needed)
        return int(inputs + (needed - inputs) / where.share) + where.grads_to_come

    def measured_max(self, available: int, kept: bool = False) -> int | None:
        """The largest value predicted to fit in `available` bytes from the model measured on slices of the
        failing batch (recover/replay.py), where that batch is the value: the model's pass, per row and
        fixed, the optimizer state its first step will allocate, and the rest of what the failure held
        (the batch, labels, what earlier steps left) taken to grow with the value."""
        cost = self.progress.cost if self.progress is not None else None
        if cost is None or cost.rows != self.value or self.needed_at_least is None:
            return None
        held = self.needed_at_least - (self.requested or 0)
        besides = max(0, held - cost.fixed_held)
        other = (besides - cost.held_by_model(self.value, besides, self.requested)) / self.value

        def fits(u: int) -> bool:
            return cost.state_to_come + other * u + cost.peak(u, kept) <= available

        if not fits(1):
            return None
        lo, hi = 1, self.value        # it failed at the value: the largest that fits is below it
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def allocator_max(self, value: int, kept: bool = False) -> int | None:
        """Of the values up to `value` (the most that fits in bytes, `measured_max`), the largest whose step
        the device's caching allocator can serve: the pass's measured allocations and frees replayed at it
        on a copy of the allocator as it is now (ModelCost.fits_allocator: rounded blocks, 2 and 20 MiB
        segments, the cache and its holes), found by recover/largest.scan, which does not take fitting to
        be monotone; 0 where none can be; None where there is no allocator to ask (the plain count, a GPU)."""
        found = self.allocator_map(value, kept)
        return None if found is None else found[0]

    def allocator_verdict(self, kept: bool = False):
        """fits(u): whether a step at `u` fits on the allocator model (None: no model to ask)."""
        cost = self.progress.cost
        held = self.needed_at_least - (self.requested or 0)
        besides = max(0, held - cost.fixed_held)
        other = (besides - cost.held_by_model(self.value, besides, self.requested)) / self.value
        return lambda u: cost.fits_allocator(u, kept, other * u)

    def allocator_map(self, value: int, kept: bool = False):
        """(the largest value up to `value` the allocator model serves or 0, its verdicts, the verdict);
        None where there is no model to ask."""
        from cuda_magic.recover.largest import scan

        fits = self.allocator_verdict(kept)
        largest, seen = scan(fits, 1, value)
        if not seen.verdicts:
            return None
        return (largest or 0), seen, fits

    def fitting(self, available: int, kept: bool = False) -> tuple[int | None, int | None]:
        """(the largest value `measured_max` predicts to fit in `available` bytes, the largest of those the
        caching allocator serves: `allocator_max`, None where there is no allocator to ask)."""
        measured = self.measured_max(available, kept)
        return measured, None if measured is None else self.allocator_max(measured, kept)

    @property
    def knows_progress(self) -> bool:
        """Whether the failure came a known share of the way through the model's forward pass."""
        return self.progress is not None and 0 < self.progress.share <= 1

    @property
    def needed_at_least(self) -> int | None:
        """A lower bound of the cell's own peak for a run that failed: allocated then + requested."""
        if self.ok or self.requested is None:
            return None
        allocated = self.allocated_at_failure if self.allocated_at_failure is not None else self.baseline
        return self.requested + max(0, (allocated or 0) - (self.baseline or 0))


def _share_of_bound(share: float, limit: int, m: Measured) -> str:
    return (f"{share:.0%} of {limit}, the most that the failure at {m.value} "
            f"leaves possible (it needed at least {format_bytes(m.needed_at_least)})")


@dataclass(frozen=True)
class NextValue:
    """A value to try next, why, whether it comes from the model measured on slices of the batch, and
    whether that model's allocations were replayed on the caching allocator's model to find it."""

    value: int
    reason: str
    measured: bool = False
    replayed: bool = False


def measured_prediction(m: Measured, available: int, kept: bool) -> NextValue | None:
    """From the model measured on slices of the batch that failed at `m.value` (recover/replay.py):
    MEASURED_SHARE of the largest value whose training step fits in `available` bytes; where the caching
    allocator's model can be asked, of the largest it serves (recover/largest.scan), and then, at or below
    that share, the largest value it serves whose neighbours it serves too (recover/largest.steady)."""
    from cuda_magic.recover.largest import islands, steady

    measured = m.measured_max(available, kept)
    if measured is None:
        return None
    found = m.allocator_map(measured, kept)
    if found is not None and found[0] == 0:
        return None
    cost = m.progress.cost
    checked, value = "", int(measured * MEASURED_SHARE)
    if found is not None:
        served, seen, fits = found
        steps = (", as the cell's first two steps (the optimizer's state made after the first)"
                 if cost.state_to_come else "")
        checked = (f"; {measured} by the bytes, {served} once its allocations are replayed on the caching "
                   f"allocator as it is now{steps}" if served < measured
                   else f"; its allocations replayed on the caching allocator fit{steps}")
        measured, value = served, int(served * MEASURED_SHARE)
        chosen = steady(value, fits, 0.15, seen, floor=1)
        if chosen != value:
            checked += f"; {chosen}, the largest at or below {value} whose neighbours fit there too"
            value = chosen
        words = islands(value, seen)
        if words:
            checked += f"; on that allocator it {words}"
    return NextValue(max(1, value),
                     f"{MEASURED_SHARE:.0%} of {measured}, predicted from the model measured on "
                     f"{cost.probe_rows[0]} and {cost.probe_rows[1]} rows of the batch that failed at {m.value} "
                     f"({format_bytes(int(cost.per_row(measured, kept)))} a row at its peak"
                     + (", the gradients kept through the pass" if kept else "") + f", {cost.seconds:.2f}\u00a0s"
                     + checked + ")",
                     measured=True, replayed=found is not None)


def progress_prediction(m: Measured, available: int) -> NextValue:
    """From a failure a known share of the way through the model's forward pass: the whole training step
    estimated (`Measured.needed_estimate`), PROGRESS_SHARE of the value that fits in it."""
    estimate = int(m.value * available / m.needed_estimate)
    if m.progress.growth is not None:
        return NextValue(int(estimate * PROGRESS_SHARE),
                         f"{PROGRESS_SHARE:.0%} of {estimate}, predicted from the failure at {m.value} in a "
                         f"generation loop: {format_bytes(m.needed_at_least)} needed at a step whose sequence is "
                         f"still to grow {m.progress.growth:.1f}x"
                         + (f", its key/value cache by {format_bytes(m.progress.cache_to_come)} a row"
                            if m.progress.cache_to_come is not None else ""))
    how = ("the layers still to run from their sizes" if m.progress.rest_bytes is not None
           else "the rest extrapolated")
    return NextValue(int(estimate * PROGRESS_SHARE),
                     f"{PROGRESS_SHARE:.0%} of {estimate}, predicted from the failure at {m.value}: "
                     f"{format_bytes(m.needed_at_least)} held {m.progress.share:.0%} of the way through the "
                     f"model's forward pass, {how}")


def bound_prediction(m: Measured, limit: int, share: float) -> NextValue:
    """A share of the largest value a failure leaves possible (`limit`)."""
    return NextValue(int(limit * share), _share_of_bound(share, limit, m))


def divisors(n: int) -> list[int]:
    """The divisors of n, smallest first: the values `--exact` allows, so that VAR x VAR2 equals n."""
    if n < 1:
        raise ValueError(f"divisors of a positive integer only, not {n!r}")
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    return small + large[::-1]


def scale_accumulation(original_value: int, original_accum: int, new_value: int) -> int:
    """The smallest accumulation count `a` with new_value * a >= original_value * original_accum."""
    if new_value < 1 or original_value < 1 or original_accum < 1:
        raise ValueError("values and accumulation steps must be positive integers")
    return max(1, -(-(original_value * original_accum) // new_value))


class BatchSearch:
    """Which value to try next after an out-of-memory error, and when to stop.

    `first()` gives the start, `record(...)` what its run did, `next()` the following value or None.
    `best` is the largest value that ran, `exhausted` says that nothing fitted down to the floor.
    """

    def __init__(self, start: int, floor: int = 1, search: bool = False, capacity: int | None = None,
                 *, max_attempts: int = MAX_ATTEMPTS, goal: float = GOAL, margin: float = MARGIN,
                 descent: float = DESCENT, allowed: list[int] | None = None, accumulating: bool = False,
                 allocator=None):
        for name, number in (("start", start), ("floor", floor)):
            if isinstance(number, bool) or not isinstance(number, int) or number < 1:
                raise ValueError(f"{name} must be a positive integer, not {number!r}")
        if start < floor:
            raise ValueError(f"the value {start} is below the floor {floor}")
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be positive bytes, not {capacity!r}")
        self.start, self.floor, self.search = start, floor, search
        self.capacity = capacity
        self.max_attempts, self.goal, self.margin, self.descent = max_attempts, goal, margin, descent
        self.history: list[Measured] = []
        self.reason = ""
        self.stop_reason = ""
        self._pending: int | None = None
        self._done = False
        self.independent = False          # the memory did not change with the value: stopped
        # -a: the gradients are kept from micro-batch to micro-batch, through whole passes; also taken so
        # once a value predicted from a measured model has failed
        self.accumulating = accumulating
        # a callable giving a copy of the device's caching allocator as it is now (None: no model of it):
        # -r's values from a failure's bound are checked on it (`_served`)
        self.allocator = allocator
        self._measured_values: set[int] = set()
        self._bounds: dict = {}           # _measured_bound's answers, by the failure and the bytes available
        # --search on a device that models torch's caching allocator: each run's allocations and frees are
        # recorded (recover/probe_timeline.py), and two that fitted replay the cell at a candidate value
        self._recording = None
        self._fitted_runs: dict[int, object] = {}
        self._failed_runs: dict[int, object] = {}
        self._live: list[int] = []        # the storages the last run left bound (a probe, until rolled back)
        # --exact: only these values (the divisors of the effective batch) are tried
        self.allowed = sorted(set(allowed)) if allowed is not None else None
        if self.allowed is not None and start not in self.allowed:
            raise ValueError(f"the value {start} is not among the allowed values")

    # the loop the guard drives -------------------------------------------------------------------
    def first(self) -> int:
        if self.history or self._pending is not None:
            raise RuntimeError("first() starts the search and can be called once")
        return self._propose(self.start, "your value")

    def record(self, value: int, ok: bool, peak: int | None = None, requested: int | None = None,
               baseline: int | None = None, allocated_at_failure: int | None = None,
               capacity: int | None = None, progress: Progress | None = None) -> None:
        """What the run with `value` did; `capacity` updates the known capacity (e.g. from the message);
        `progress` where in the model's forward pass a failed run failed (recover/progress.py)."""
        if value != self._pending:
            raise ValueError(f"record() got {value}, but the value to run was {self._pending}")
        if capacity is not None and capacity > 0:
            self.capacity = capacity
        reason, self._pending = self.reason, None
        recording, self._recording = self._recording, None
        if recording is not None:
            recording.stop()
            if recording.complete:
                (self._fitted_runs if ok else self._failed_runs)[value] = recording
            self._live = recording.live if ok else []
        self.history.append(Measured(value, bool(ok), reason, peak, requested, baseline,
                                     allocated_at_failure, self.capacity, progress))
        self._check_independent()

    def _check_independent(self) -> None:
        """Two failures at different values that asked for the same allocation with the same memory in
        use (and reached the same peak): the memory does not depend on the value, so stop."""
        failed = [m for m in self.history if not m.ok and m.requested is not None]
        if len(failed) < 2:
            return
        a, b = failed[-2], failed[-1]
        # Values close together can land on one step of a rounded size (allocations round up to blocks,
        # shapes to multiples): only values at least a quarter apart tell that memory does not follow them.
        if 4 * min(a.value, b.value) > 3 * max(a.value, b.value):
            return

        def used(m):
            return None if m.allocated_at_failure is None else m.allocated_at_failure - (m.baseline or 0)

        def own_peak(m):
            return None if m.peak is None else m.peak - (m.baseline or 0)

        if a.value != b.value and a.requested == b.requested and used(a) == used(b) and own_peak(a) == own_peak(b):
            self._done, self.independent = True, True
            self.stop_reason = (f"the cell's memory does not depend on this value: at {a.value} and at {b.value} "
                                f"it failed asking for the same {format_bytes(b.requested)} with the same memory "
                                "in use, so a smaller value will not help; stopped")

    def next(self) -> int | None:
        if self._pending is not None:
            raise RuntimeError(f"record() the run with {self._pending} first")
        if self._done or not self.history:
            return None
        value, reason = self._choose()
        if value is not None and self.allowed is not None:
            value, reason = self._snap(value, reason)
        if value is None:
            self._done, self.stop_reason, self.reason = True, reason, ""
            return None
        return self._propose(value, reason)

    def adopt(self, value: int | None, reason: str = "") -> None:
        """Run `value` next instead of what `next()` proposed, or nothing more (None): the ranks of a
        process group agreed on it (recover/ranked_retry.py)."""
        if value is None:
            self._pending, self._done = None, True
            return
        self._pending, self.reason = value, reason or self.reason

    def _snap(self, value: int, reason: str) -> tuple[int | None, str]:
        """--exact: the largest allowed value at or below `value` that is still open (above what fitted,
        below what failed, at least the floor, not tried); going down with none there, the smallest open
        one above it."""
        tried = {m.value for m in self.history}
        hi, best = self.smallest_failed, self.best
        open_values = [v for v in self.allowed if v >= self.floor and v not in tried
                       and (hi is None or v < hi) and (best is None or v > best)]
        below = [v for v in open_values if v <= value]
        if below:
            chosen = below[-1]
        elif best is None and open_values:
            chosen = open_values[0]
        else:
            what = f"{best} is the largest" if best is not None else "no"
            return None, f"{what} divisor of the effective batch that fits (--exact)"
        return chosen, (reason if chosen == value else f"{reason}; {chosen}, a divisor of the effective batch")

    # results -----------------------------------------------------------------------------------
    @property
    def attempts(self) -> list[tuple[int, bool, int | None, int | None]]:
        return [(m.value, m.ok, m.peak, m.requested) for m in self.history]

    @property
    def best(self) -> int | None:
        fitted = [m.value for m in self.history if m.ok]
        return max(fitted) if fitted else None

    @property
    def smallest_failed(self) -> int | None:
        failed = [m.value for m in self.history if not m.ok]
        return min(failed) if failed else None

    @property
    def islands(self) -> str:
        """Words where the best value sits above values the runs found not to fit (recover/largest.islands);
        "" otherwise."""
        best = self.best
        if best is None:
            return ""
        return islands(best, FitMap({m.value: m.ok for m in self.history}))

    @property
    def done(self) -> bool:
        return self._done

    @property
    def exhausted(self) -> bool:
        return self._done and self.best is None

    def __repr__(self) -> str:
        tried = ", ".join(f"{v}:{'ok' if ok else 'oom'}" for v, ok, _, _ in self.attempts)
        return f"BatchSearch(start={self.start}, floor={self.floor}, search={self.search}, tried=[{tried}])"

    # choosing ----------------------------------------------------------------------------------
    def _propose(self, value: int, reason: str) -> int:
        self._pending, self.reason = value, reason
        if self.search:
            from cuda_magic.recover.probe_timeline import start_recording

            self._recording = start_recording(self.allocator, self)
        return value

    def _choose(self) -> tuple[int | None, str]:
        best, hi = self.best, self.smallest_failed
        if best is None:
            return self._go_down(hi)
        if not self.search:
            return None, f"{best} fits"
        if best == self.start or hi is None:
            return None, f"{best} fits (the value given is not searched above)"
        if len(self.history) >= self.max_attempts:
            return None, f"stopped after {len(self.history)} attempts (the most allowed)"
        if hi - best <= 1:
            return None, f"{best} is the largest value that fits ({hi} ran out of memory)"
        return self._go_up(best, hi)

    def _go_down(self, hi: int) -> tuple[int | None, str]:
        if hi <= self.floor:
            return None, f"the floor {self.floor} ran out of memory"
        predicted = self._predict_down(hi) if not self.search else None
        value, why, measured = (predicted.value, predicted.reason, predicted.measured) if predicted is not None \
            else (*self._descend(hi), False)
        replayed = predicted is not None and predicted.replayed
        failures = sum(not m.ok for m in self.history)
        # a prediction from a measured model below every value that failed is kept; any other after more
        # than one failure is cut to REPEAT_SHARE
        trusted = measured and value < hi
        if not self.search and failures > 1 and not trusted and value > int(hi * REPEAT_SHARE):
            value, why, measured = int(hi * REPEAT_SHARE), f"{REPEAT_SHARE:.0%} of {hi}, which failed", False
            replayed = False
        value = min(value, hi - 1)
        # a value found by replaying the measured allocations on the allocator's model is not checked again
        # by the cruder scaling of the failure's memory (which cut a replayed 32 to 3 under torch.distributed)
        if not self.search and value >= self.floor and not replayed:
            served = self._served(value)
            if served < value:
                value, why = served, (f"{served}, the most that the caching allocator as it is now can "
                                      f"serve of {why or f'{value}, halved from {hi}'}, scaled")
        if value < self.floor:
            return self.floor, f"the floor {self.floor} (--min)"
        if measured:
            self._measured_values.add(value)
        return value, why or f"halved from {hi}"

    def _served(self, value: int) -> int:
        """-r, a value from a failure's bound: the largest up to `value` at which the latest failure's
        memory, scaled to it (what it held, then its request), can be served by a copy of the device's
        caching allocator as it is now (rounded blocks, 2 and 20 MiB segments, its cache); `value` where
        there is no allocator to ask."""
        from cuda_magic.devices.allocator_replay import replay_fits

        m = self.history[-1]
        if self.allocator is None or m.ok or m.requested is None:
            return value
        held = max(0, (m.allocated_at_failure or 0) - (m.baseline or 0))

        def fits(u: int) -> bool:
            model = self.allocator()
            return model is None or replay_fits(model, (), 0, before=(held * u / m.value,
                                                                      m.requested * u / m.value))

        from cuda_magic.recover.largest import scan

        largest, _ = scan(fits, self.floor, value)
        return value if largest is None else largest

    def _descend(self, hi: int) -> tuple[int, str]:
        """--search, or -r where no failure's measure is usable: a share of the tightest failure bound."""
        bound, why, share = hi, "", self.descent
        for m in self.history:
            limit = self._failure_bound(m)
            if limit is not None and limit < bound:
                bound = limit
                if not self.search:   # a later failure, at a smaller value, gets further into the cell
                    share = self._retry_share(m)
                why = _share_of_bound(share, limit, m)
        return (int(bound * share) if bound < hi else hi // 2), why

    def _retry_share(self, m: Measured) -> float:
        """-r: the share of a failure's bound to try: less when the first failure came midway."""
        first = m is self.history[0]
        return MIDWAY_SHARE if first and m.requested < 0.5 * m.needed_at_least else RETRY_SHARE

    def _predict_down(self, hi: int) -> NextValue | None:
        """-r: a failure whose model was measured on slices of its batch (recover/replay.py) predicts the
        largest value that fits, at most what the other failures leave possible; without one, the smallest
        of the other failures' predictions (from the share of the forward pass done, or from its bound)."""
        available = self._available()
        if available is None:
            return None
        # the gradients through the whole pass: with -a, or once a measured prediction did not fit; the first
        # counts what the measured pass shows the cell holding across it: the gradients where they are there
        # in its forward pass, the optimizer's state where its first step makes it (ModelCost.fits_allocator)
        kept = self.accumulating or any(not m.ok and m.value in self._measured_values for m in self.history)
        measured, other, bounds = [], [], []
        for m in self.history:
            found = measured_prediction(m, available, kept) if m.knows_progress else None
            if found is not None:
                measured.append(found)
                continue
            limit = self._failure_bound(m)
            if limit is None or limit >= hi:
                continue      # a failure at a value far above the others: its bound says nothing more
            bounds.append((limit, m))
            other.append(progress_prediction(m, available) if m.knows_progress
                         else bound_prediction(m, limit, self._retry_share(m)))
        if not measured:
            return min(other, key=lambda p: p.value, default=None)
        best = min(measured, key=lambda p: p.value)
        for limit, m in bounds:
            if limit < best.value:
                best = NextValue(limit, f"{limit}, the most that the failure at {m.value} leaves possible (it "
                                        f"needed at least {format_bytes(m.needed_at_least)}), below {best.reason}",
                                 measured=True)
        return best

    def _go_up(self, best: int, hi: int) -> tuple[int | None, str]:
        available = self._available()
        fitted = [m for m in self.history if m.own_peak is not None]
        bound, predicted, how, fitted_line = hi - 1, None, "", False
        modeled = None        # the largest value the caching allocator's model serves (a failure measured)
        if available is not None and fitted:
            top = max(fitted, key=lambda m: m.value)
            for m in self.history:
                limit = self._secant_bound(top, m, available)
                if limit is not None and limit < bound:
                    bound = limit
                limit = self._measured_bound(m, available)
                if limit is not None and limit < bound:
                    bound = limit
                served = self._bounds.get((id(m), available, "served"))
                if served and (modeled is None or served < modeled):
                    modeled = served
            if modeled is None:
                # no failure measured (it came outside any module call: the loss's backward pass): the
                # cell's own runs that fitted, their allocations replayed at a value on the allocator
                modeled = self._probes_served(best, hi)
                if modeled is not None and modeled < bound:
                    bound = modeled
            # the partner is the nearest smaller value whose peak differs (rounding makes plateaus)
            lower = [m for m in fitted if m.value < top.value and m.own_peak < top.own_peak]
            slope = None
            if lower:
                low = max(lower, key=lambda m: m.value)
                slope = (top.own_peak - low.own_peak) / (top.value - low.value)
                how, fitted_line = f"fitted to the peaks at {low.value} and {top.value}", True
            elif top.own_peak > 0:
                # counting the cell's fixed part as per-unit memory: this falls short, never over
                slope = top.own_peak / top.value
                how = (f"predicted from the peak at {top.value} ({format_bytes(top.own_peak)} above what was "
                       "allocated when it started)")
            if slope:
                predicted = top.value + (available - top.own_peak) / slope
            if modeled is not None and modeled > best and (predicted is None or predicted < modeled):
                # the peaks' line is in bytes; the measured pass replayed on the allocator model says more
                # fits (recover/largest.scan): that is the prediction
                predicted, fitted_line = modeled, False
                how = (f"the largest value whose measured pass the caching allocator's model serves "
                       f"({modeled})")
            elif modeled is not None and predicted is not None and bound == modeled < predicted:
                # the bytes say more; the allocator model bounds it (the value is the same: the bound's)
                how = (f"{how}: {int(predicted)}, at most {modeled}, the largest value the caching allocator's "
                       "model serves")
        tried = {m.value for m in self.history}
        if (modeled is not None and best < modeled < hi and modeled not in tried and best >= self.goal * bound
                and len(self.history) < self.max_attempts):
            # close to what the allocator model serves: that value itself, once (the model's pass was
            # measured on slices; what it leaves out errs either way by a few percent)
            return modeled, (f"the largest value whose measured pass the caching allocator's model serves "
                             f"({modeled}), once, as {best} is within {1 - self.goal:.0%} of it")
        if best >= self.goal * bound:
            return None, f"{best} is within {1 - self.goal:.0%} of the largest value that can fit"
        if fitted_line and best >= (1 - 1.5 * self.margin) * predicted:
            return None, (f"{best} is within {1.5 * self.margin:.1%} of the predicted largest value "
                          f"{int(predicted)}")
        # a value above the best that ran out brackets the largest: right after a failure (or after two) the
        # next is at most the bracket's middle, else within its middle half (recover/largest.within_bracket),
        # so that a prediction that keeps overshooting (a failure's need is a lower bound; segments, not
        # bytes, ran out) halves the bracket, while one that is right gets there in few runs (the middle
        # alone took 8 runs to 92% of a largest value just below a failure)
        first_fit = next(i for i, m in enumerate(self.history) if m.ok)
        overshoots = sum(not m.ok and m.value > best for m in self.history[first_fit + 1:])
        if predicted is not None:
            value = min(int(min(predicted, bound + 1) * (1 - self.margin)), hi - 1)
            why = f"{how}, less {self.margin:.1%}"
            if value <= best:  # the margin would undo the step; the prediction itself is worth a try
                value, why = min(int(predicted), hi - 1), how
            if value > best:
                if overshoots:
                    # a prediction up has just run out, or two have: it overshoots, so at most the
                    # bracket's middle; after one overshoot and a fit, within the bracket's middle half
                    last = self.history[-1]
                    top = (best + hi) // 2 if (not last.ok and last.value > best) or overshoots >= 2 else value
                    kept = within_bracket(min(value, top), best, hi)
                    if kept != value:
                        return kept, (f"{why}: {value}; bisecting between {best} (fits) and {hi} (out of "
                                      "memory), as a prediction above ran out")
                return value, why
        value = (best + hi) // 2
        return value, f"bisecting between {best} (fits) and {hi} (out of memory)"

    # measurements --------------------------------------------------------------------------------
    def _as_next_run(self, m: Measured) -> Measured:
        """`m` with its measured model asking the allocator as the next run will find it: the last probe's
        tensors, still bound when the policy is asked, given back and the cache emptied, as the roll-back
        does (recover/probe_timeline.py); asked as it was (the probe's tensors and the cache in it), the
        MLP's pass was served up to 1605 where 1706 fits."""
        from dataclasses import replace

        from cuda_magic.recover.probe_timeline import next_run_allocator

        cost = m.progress.cost
        allocator = next_run_allocator(cost.allocator, self._live) if cost.allocator is not None else None
        if allocator is None:
            return m
        return replace(m, progress=replace(m.progress, cost=replace(cost, allocator=allocator)))

    def _probes_served(self, best: int, hi: int) -> int | None:
        """--search where no failure was measured: the largest value in (best, hi) at which the runs that
        fitted, their allocations and frees recorded and matched event for event into lines in the value
        (recover/probe_timeline.py), replayed on a copy of the device's caching allocator as it will be
        when the next run starts, are served (recover/largest.scan: not taken to be monotone); `best`
        where none above it is; None where there is nothing to replay (no allocator model, a GPU)."""
        from cuda_magic.recover.largest import scan
        from cuda_magic.recover.probe_timeline import replay_verdict

        key = ("probes", len(self.history))
        if key not in self._bounds:
            fits = replay_verdict(self._fitted_runs, self.allocator, self._live, self._failed_runs)
            found = None
            if fits is not None and hi - best > 1:
                largest, seen = scan(fits, best + 1, hi - 1)
                found = (largest or best) if seen.verdicts else None
            self._bounds[key] = found
        return self._bounds[key]

    def _available(self) -> int | None:
        """Bytes the cell may take: capacity less the latest baseline, lowered by what failed below it."""
        if self.capacity is None:
            return None
        latest = self.history[-1].baseline or 0
        available = self.capacity - latest
        for m in self.history:
            if m.needed_at_least is not None and m.allocated_at_failure is not None:
                # the allocation failed, so at that moment the cell could not hold what it needed
                available = min(available, m.needed_at_least - 1 + (m.baseline or 0) - latest)
        return available if available > 0 else None

    def _failure_bound(self, m: Measured) -> int | None:
        """With memory at least proportional to the value: a failure at v needing N bounds the maximum."""
        needed, available = m.needed_at_least, self._available()
        if needed is None or available is None or needed <= 0:
            return None
        return int(m.value * available / needed)

    def _measured_bound(self, m: Measured, available: int) -> int | None:
        """--search: the largest value that a failure measured on slices of its batch predicts to fit, its
        allocations replayed on the caching allocator where there is one: the probes up stop there."""
        if m.ok or not m.knows_progress or m.progress.cost is None:
            return None
        key = (id(m), available)          # asked again at each probe up: scanned once
        if key not in self._bounds:
            most, served = self._as_next_run(m).fitting(available, self.accumulating)
            self._bounds[key] = most if served is None else served or None
            self._bounds[(*key, "served")] = served
        return self._bounds[key]

    @staticmethod
    def _secant_bound(top: Measured, m: Measured, available: int) -> int | None:
        """The line through the best peak and a larger failure's lower bound crosses `available` at or
        after the largest value that fits."""
        needed = m.needed_at_least
        if needed is None or m.value <= top.value or needed <= top.own_peak:
            return None
        return top.value + int((available - top.own_peak) * (m.value - top.value) / (needed - top.own_peak))
