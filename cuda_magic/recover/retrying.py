"""The retry of a guarded run (`-r VAR`, `oomguard(retry=...)`): part of the core (recover/guarded.py).

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
    """Attempts of `call` on the GuardedRun `run` until one fits or the policy stops. Returns (the value of
    the run that stands, the error to pass through or None); the report says the rest."""
    __tracebackhide__ = True  # noqa: F841
    return await RetryLoop(run).attempts(call)


def ranks_in_group() -> int:
    """The ranks of the torch.distributed process group this process is in (1 outside one). Imports
    nothing: without torch.distributed loaded there is no group."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size()


class RetryLoop:
    def __init__(self, run):
        self.guarded = run
        self.spec = run.options.retry
        self._measured = False          # a failure was measured on slices of its batch (recover/replay.py)
        self.values = run.values
        report = run.report
        report.retry = self.retry = Retry(self.spec.variable, int(self.values[self.spec.variable]),
                                          accumulate=self.spec.accumulate, search=self.spec.search)
        if self.spec.accumulate is not None:
            self.retry.original_accumulate = int(self.values[self.spec.accumulate])

    async def attempts(self, call):
        __tracebackhide__ = True  # noqa: F841
        from cuda_magic.recover.retry import BatchSearch, divisors
        from cuda_magic.recover.rollback import Checkpoint

        run, spec, retry, report = self.guarded, self.spec, self.retry, self.guarded.report
        keep = {spec.variable, spec.accumulate} - {None}
        self.checkpoint = checkpoint = Checkpoint(run.namespace, roots=run.roots, keep=keep)
        for note in checkpoint.take():
            run.note(note)
        allowed = divisors(retry.original * retry.original_accumulate) if spec.exact and spec.accumulate else None
        policy = BatchSearch(retry.original, spec.floor, spec.search,
                             capacity=run.options.limit or capacity_of(run.meter), allowed=allowed,
                             accumulating=spec.accumulate is not None,
                             allocator=getattr(getattr(run.meter, "device", None), "allocator_copy", None))
        value = policy.first()
        kept = None                              # the run whose effects stand: (value, call's value)
        try:
            while value is not None:
                self._apply(value)
                run.why = policy.reason
                with checkpoint.watching():
                    result = await run.attempt(call, value, undo=checkpoint.restore_bindings)
                if result.error is not None:
                    return self._stopped_by(result.error, words=True)
                ok = result.failure is None
                progress = None if ok else self._undo_failed(result.failure, value)
                failure = result.failure
                policy.record(value, ok, peak=result.attempt.peak, requested=result.attempt.requested,
                              baseline=result.attempt.start_allocated,
                              allocated_at_failure=failure.allocated if failure else None, progress=progress,
                              capacity=failure.oom.capacity if failure and not run.options.limit else None)
                following = policy.next()
                if ok and (following is None and policy.best == value):
                    kept = (value, result.value)       # the last run fitted at the value found: it stands
                    break
                if ok:                                 # a --search probe: undone, like a failed attempt
                    result.attempt.probe = True
                    self._restore()
                if following is None and policy.best is not None:
                    following = policy.best            # the real run at the value found
                    run.on_note(f"running the cell at {spec.variable}={following}, the value found")
                    self._apply(following)
                    run.why = "the largest value the probes found to fit"
                    with checkpoint.watching():
                        result = await run.attempt(call, following)
                    if result.error is not None:
                        return self._stopped_by(result.error, words=False)
                    if result.failure is None:
                        kept = (following, result.value)
                    else:
                        report.warnings.append(f"{spec.variable}={following} fitted as a probe but ran out of "
                                               "memory when run for real")
                    break
                value = following
        except KeyboardInterrupt:
            self._restore_values()
            report.outcome = Outcome.INTERRUPTED
            report.warnings.append(f"interrupted: {self._restored_words()}")
            report.not_undone = checkpoint.not_undone()
            raise
        report.not_undone = checkpoint.not_undone()
        if kept is None:
            self._restore_values()
            report.outcome = Outcome.OOM
            last = report.attempts[-1].value
            retry.independent = policy.independent
            why = policy.stop_reason if policy.independent else (
                f"even {spec.variable}={last} ran out of memory (the floor is {spec.floor})")
            report.warnings.append(f"{why}; {self._restored_words()}")
            return None, None
        if policy.islands and kept[0] == policy.best:
            run.note(policy.islands)        # the value found sits above values that ran out
        return self._kept(kept), None

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

    def _restore(self) -> None:
        """Undo an attempt whose memory is given back, and collect what it leaves unbound. What the restore
        makes (fresh copies of the states) counts on the device, as on a GPU."""
        import gc

        from cuda_magic.recover.cleanup import empty_caches

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
            self._restore()
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
