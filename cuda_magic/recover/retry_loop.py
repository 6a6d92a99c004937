"""The retry of a guarded run (`-r VAR`, `oomguard(retry=...)`): part of the core (recover/guarded.py).
The one loop, for one process and for the ranks of a process group (recover/ranked_retry.py decides there
what the ranks decide together).

Before the first attempt a checkpoint is taken (recover/rollback.py); each failed attempt (and each
`--search` probe) is undone, and the next value comes from the policy (recover/retry.py), fed with what
the failures measured and, after a failure inside the model, with the model measured on slices of the
failing batch (recover/replay.py). A run that fitted at the value kept stands: the cell ends as if it
had run once, at that value.
"""
from __future__ import annotations

from dataclasses import replace

from cuda_magic.devices.meter import autocast, capacity_of
from cuda_magic.recover.report import Outcome, Retry


async def run_retried(run, call):
    """Attempts of `call` on the GuardedRun `run` until one fits or the policy stops, decided by this process
    alone or, inside a torch.distributed process group of more than one rank, by every rank together
    (recover/ranked_retry.py). Returns (the value of the run that stands, the error to pass through or None);
    the report says the rest."""
    __tracebackhide__ = True  # noqa: F841
    deciding = Alone()
    if ranks_in_group() > 1:
        from cuda_magic.recover.ranked_retry import Ranked

        deciding = Ranked(run)
    return await RetryLoop(run, deciding).attempts(call)


def ranks_in_group() -> int:
    """The ranks of the torch.distributed process group this process is in (1 outside one). Imports
    nothing: without torch.distributed loaded there is no group."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size()


class Stopped(Exception):
    """An error that is not out of memory stopped the attempts: passed on, the variables put back."""

    def __init__(self, error: BaseException, words: bool):
        super().__init__()
        self.error, self.words = error, words


class Alone:
    """What the loop asks of whoever decides (the hooks, overridden by the ranks in recover/ranked_retry.py
    for what the ranks decide together): how one attempt went, the value after a fit and after a failure,
    and the words that say where. This process decides alone."""

    stops: tuple = ()                    # exceptions that stop the attempts, raised by the deciding itself
    found_note = "running the cell at {}, the value found"
    found_why = "the largest value the probes found to fit"
    where_failed = ""                    # "... ran out of memory{where_failed}"

    def start(self, loop) -> None:
        """Once the checkpoint is taken, before the first attempt."""

    def watching(self, call):
        """`call` as each attempt runs it."""
        return call

    async def attempt(self, loop, call, value, policy) -> tuple[bool, object]:
        """One attempt at `value` (with `policy`: recorded there): (it fitted, its AttemptResult)."""
        __tracebackhide__ = True  # noqa: F841
        result, error = await loop.attempt_here(call, value, policy)
        if error is not None:
            raise Stopped(error, words=policy is not None)
        ok = result.failure is None
        if ok and policy is not None:
            loop.record(policy, value, True, result, None)
        return ok, result

    def next_up(self, loop, policy):
        """The value after one that fitted (a --search probe), or None."""
        return policy.next()

    def next_down(self, loop, policy):
        """The value after one that ran out of memory, or None."""
        return policy.next()


class RetryLoop:
    """The one retry loop: the checkpoint, the policy (with the device's allocator model where there is one),
    the attempts, the probes undone, the real run at the value found; `deciding` says what one attempt came
    to and which value follows (`Alone`, or the ranks together)."""

    def __init__(self, run, deciding: Alone | None = None):
        self.guarded = run
        self.deciding = deciding if deciding is not None else Alone()
        self.spec = run.options.retry
        self._measured = False          # a failure was measured on slices of its batch (recover/replay.py)
        self.values = run.values
        self.policy = None
        report = run.report
        report.retry = self.retry = Retry(self.spec.variable, int(self.values[self.spec.variable]),
                                          accumulate=self.spec.accumulate, search=self.spec.search)
        if self.spec.accumulate is not None:
            self.retry.original_accumulate = int(self.values[self.spec.accumulate])

    def _policy(self):
        """The policy choosing each value (recover/retry.py), asking the device's caching allocator model
        where the meter has one."""
        from cuda_magic.recover.retry import BatchSearch, divisors

        run, spec, retry = self.guarded, self.spec, self.retry
        allowed = divisors(retry.original * retry.original_accumulate) if spec.exact and spec.accumulate else None
        return BatchSearch(retry.original, spec.floor, spec.search,
                           capacity=run.options.limit or capacity_of(run.meter), allowed=allowed,
                           accumulating=spec.accumulate is not None,
                           allocator=getattr(getattr(run.meter, "device", None), "allocator_copy", None))

    async def attempts(self, call):
        __tracebackhide__ = True  # noqa: F841
        from cuda_magic.recover.rollback import Checkpoint

        run, spec, retry, report, deciding = self.guarded, self.spec, self.retry, self.guarded.report, self.deciding
        keep = {spec.variable, spec.accumulate} - {None}
        self.checkpoint = checkpoint = Checkpoint(run.namespace, roots=run.roots, keep=keep)
        for note in checkpoint.take():
            run.note(note)
        deciding.start(self)
        self.policy = policy = self._policy()
        call = deciding.watching(call)
        value = policy.first()
        kept = None                              # the run whose effects stand: (value, call's value)
        try:
            while value is not None:
                self._apply(value)
                run.why = policy.reason
                ok, result = await deciding.attempt(self, call, value, policy)
                following = deciding.next_up(self, policy) if ok else deciding.next_down(self, policy)
                if ok and (following is None and policy.best == value):
                    kept = (value, result.value)       # the last run fitted at the value found: it stands
                    break
                if ok:                                 # a --search probe: undone, like a failed attempt
                    result.attempt.probe = True
                    self.undo_attempt()
                if following is None and policy.best is not None:
                    following = policy.best            # the real run at the value found
                    run.on_note(deciding.found_note.format(f"{spec.variable}={following}"))
                    self._apply(following)
                    run.why = deciding.found_why
                    ok, result = await deciding.attempt(self, call, following, None)
                    if ok:
                        kept = (following, result.value)
                    else:
                        report.warnings.append(f"{spec.variable}={following} fitted as a probe but ran out of "
                                               f"memory{deciding.where_failed} when run for real")
                    break
                value = following
        except KeyboardInterrupt:
            self._restore_values()
            report.outcome = Outcome.INTERRUPTED
            report.warnings.append(f"interrupted: {self._restored_words()}")
            report.not_undone = checkpoint.not_undone()
            raise
        except Stopped as stop:
            return self._stopped_by(stop.error, words=stop.words)
        except deciding.stops as error:
            return self._stopped_by(error, words=False)
        report.not_undone = checkpoint.not_undone()
        if kept is None:
            self._restore_values()
            report.outcome = Outcome.OOM
            last = report.attempts[-1].value
            retry.independent = policy.independent
            why = policy.stop_reason if policy.independent else (
                f"even {spec.variable}={last} ran out of memory{deciding.where_failed} (the floor is {spec.floor})")
            report.warnings.append(f"{why}; {self._restored_words()}")
            return None, None
        if policy.islands and kept[0] == policy.best:
            run.note(policy.islands)        # the value found sits above values that ran out
        return self._kept(kept), None

    async def attempt_here(self, call, value, policy):
        """Run `call` once at `value` in this process: a failed attempt is undone and, with `policy`,
        recorded there. Returns (its AttemptResult, the error that is not out of memory, or None)."""
        __tracebackhide__ = True  # noqa: F841
        checkpoint = self.checkpoint
        with checkpoint.watching():
            result = await self.guarded.attempt(call, value, undo=checkpoint.restore_bindings)
        error, result.error = result.error, None
        if error is None and result.failure is not None:
            progress = self._undo_failed(result.failure, value)
            if policy is not None:
                self.record(policy, value, False, result, progress)
        return result, error

    def record(self, policy, value, ok, result, progress) -> None:
        """What the attempt at `value` measured, told to the policy."""
        failure, attempt = result.failure, result.attempt
        policy.record(value, ok, peak=attempt.peak, requested=attempt.requested, baseline=attempt.start_allocated,
                      allocated_at_failure=failure.allocated if failure else None, progress=progress,
                      capacity=failure.oom.capacity if failure and not self.guarded.options.limit else None)

    def _kept(self, kept):
        """The run whose effects stand, (value, call's value): its value in place; the call's value."""
        retry, spec, report = self.retry, self.spec, self.guarded.report
        final, out = kept
        self._apply(final)
        retry.final = final
        if spec.accumulate is not None:
            retry.final_accumulate = int(self.values[spec.accumulate])
        report.outcome = Outcome.RECOVERED if final != retry.original else Outcome.OK
        return out

    def _stopped_by(self, error, *, words: bool):
        """An error that is not out of memory stopped the attempts: the variables back, the error passed on."""
        report = self.guarded.report
        self._restore_values()
        report.outcome = Outcome.ERROR
        if words:
            report.warnings.append(f"stopped: {type(error).__name__} is not an out-of-memory error; "
                                   f"{self._restored_words()}")
        report.not_undone = self.checkpoint.not_undone()
        return None, error

    def undo_attempt(self) -> None:
        """Undo an attempt whose memory is given back, and collect what it leaves unbound. What the restore
        makes (fresh copies of the states) counts on the device, as on a GPU."""
        import gc

        from cuda_magic.recover.release import empty_caches

        with self.guarded.meter.counting():
            self.checkpoint.restore()
        gc.collect()
        empty_caches(self.guarded.meter)

    def _undo_failed(self, failure, value):
        """After a failed attempt whose memory is given back: undo it, and with -r after a failure inside
        the model (with --search: the first such failure), measure the model on slices of the failing batch
        (recover/replay.py), where that batch
        is the value retried and the checkpoint holds the model (what the measuring changes is undone the
        same way); the failure's progress, with the measure where taken."""
        run, checkpoint = self.guarded, self.checkpoint
        progress, replay, failure.replay = failure.progress, failure.replay, None
        with run.meter.counting():
            checkpoint.restore()   # the states, now that the failure's memory is back (its names: done)
        # --search: the first failure only (its measure bounds the probes up; the later ones, near the
        # largest value, would each cost a measure for little)
        searched = self.spec.search and self._measured
        if (replay is None or progress is None or searched or replay.rows != value
                or not checkpoint.holds(replay.root)):
            return progress
        self._measured = True
        try:
            with run.meter.running(run.options.limit), autocast(run.options.amp, run.meter):
                cost = replay.measure(run.meter)
        finally:
            del replay
            self.undo_attempt()
        if cost is not None and cost.allocator is not None:
            # the allocator as it is now, with the attempt undone: what a value is checked on later too
            # (--search asks after a probe that fitted, while the probe still holds its memory)
            snapshot = getattr(getattr(run.meter, "device", None), "allocator_snapshot", None)
            if snapshot is not None:
                cost = replace(cost, allocator=snapshot())
        return progress if cost is None else replace(progress, cost=cost)

    # the retried variables ----------------------------------------------------------------------------
    def _apply(self, value) -> None:
        from cuda_magic.recover.retry import scale_accumulation

        retry = self.retry
        self.values[retry.variable] = value
        accumulate = None
        if retry.accumulate is not None:
            accumulate = scale_accumulation(retry.original, retry.original_accumulate, value)
            self.values[retry.accumulate] = accumulate
        self.guarded.on_trying(value, accumulate)

    def _restore_values(self) -> None:
        retry = self.retry
        self.values[retry.variable] = retry.original
        if retry.accumulate is not None:
            self.values[retry.accumulate] = retry.original_accumulate

    def _restored_words(self) -> str:
        retry = self.retry
        words = f"{retry.variable} restored to {retry.original}"
        if retry.accumulate is not None:
            words += f" and {retry.accumulate} to {retry.original_accumulate}"
        return words
