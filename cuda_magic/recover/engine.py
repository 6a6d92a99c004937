"""The guard engine: run something that may run out of memory, measure it, and on an OOM take the one
path after a failure (recover/failure.py); with a retried variable, undo the failed attempt
(recover/rollback.py) and try again at a value predicted to fit (recover/retry.py).

Shared by `%%oomguard` and the Python API's `oomguard` decorator. The call takes no argument; the
retried variable lives in `values` (the user namespace, or the decorated function's arguments).
"""
from __future__ import annotations

import inspect
import time
from contextlib import nullcontext
from dataclasses import dataclass

from cuda_magic.devices.meter import capacity_of
from cuda_magic.recover.failure import Failure, error_text, kind_of, read_failure, release_failure
from cuda_magic.recover.report import Attempt, GuardReport, Outcome, Retry


@dataclass(frozen=True)
class RetrySpec:
    """`-r VAR [-a VAR2] [--min N] [--search]`, checked already."""

    variable: str
    accumulate: str | None = None
    floor: int = 1
    search: bool = False
    exact: bool = False          # with accumulate: only divisors of the effective batch (VAR x VAR2 exact)


@dataclass
class RunResult:
    """One run of the call: its attempt record, the call's value, and the exception to pass through."""

    attempt: Attempt
    value: object = None
    error: BaseException | None = None       # not out of memory: passed through untouched
    failure: Failure | None = None           # out of memory: what it said


def autocast(amp: str | None, meter):
    if amp is None:
        return nullcontext()
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[amp]
    device_type = meter.device_type   # cuda, mps, xpu; cpu for the CPU and the simulated device
    return torch.autocast(device_type=device_type, dtype=dtype)


class GuardEngine:
    """Runs a call under a meter; with `retry`, the retry policy and the rollback of failed attempts.

    values: the mapping that holds the retried variables. namespace: the user namespace, whose bindings
    an undone attempt restores and whose frames a clean-up never clears (None in a script). roots:
    further objects whose state (modules, optimizers) is kept for the rollback (a function's arguments
    and globals). filename/lines: the compiled cell, to say which of its lines failed.
    """

    def __init__(self, meter, *, values=None, namespace=None, retry: RetrySpec | None = None, limit=None,
                 amp=None, filename=None, lines=None, roots=(), on_attempt=None, on_note=None,
                 timeline: bool | None = None):
        self.meter, self.values, self.namespace = meter, values, namespace
        self.timeline = timeline        # None: record, shown after an OOM; True: shown always; False: off
        self.box = None
        self.retry, self.limit, self.amp = retry, limit, amp
        self.filename, self.lines = filename, lines
        self.roots = roots
        self.on_attempt = on_attempt or (lambda attempt: None)
        self.on_note = on_note or (lambda text: None)
        self.why = ""                   # why the value about to run was chosen (the retry policy's words)

    # one run ------------------------------------------------------------------------------------
    async def run_once(self, call, value=None, *, undo=None) -> RunResult:
        """Run and measure. On an OOM: copy out what it says, `undo()` (the names the attempt bound), then
        free what the failure held. KeyboardInterrupt is recorded and propagates. A call marked `is_async`
        (a cell with top-level `await`) returns an awaitable, awaited here."""
        __tracebackhide__ = True  # noqa: F841
        meter = self.meter
        start = meter.allocated()
        meter.reset_peak()
        t0 = time.perf_counter()
        failed = None
        box = self.box
        if box is not None:
            box.begin_attempt(len(self.report.attempts))
        try:
            with meter.running(self.limit), autocast(self.amp, meter):
                out = call()
                if getattr(call, "is_async", False) and inspect.isawaitable(out):
                    out = await out
        except KeyboardInterrupt:
            if box is not None:
                box.pause()
            self._record(Attempt(value, Outcome.INTERRUPTED, meter.peak(), duration=time.perf_counter() - t0,
                                 start_allocated=start))
            raise
        except Exception as exc:
            kind = kind_of(exc)
            if box is not None:
                if kind is Outcome.OOM:
                    box.failed()
                box.pause()
            if kind is not Outcome.OOM:
                attempt = Attempt(value, Outcome.ERROR, meter.peak(), duration=time.perf_counter() - t0,
                                  start_allocated=start)
                return RunResult(self._record(attempt), error=exc)
            failure = read_failure(exc, meter, filename=self.filename, lines=self.lines,
                                   progress=self.retry is not None)
            attempt = Attempt(value, Outcome.OOM, meter.peak(), failure.oom.requested,
                              time.perf_counter() - t0, start)
            failed = exc
        else:
            if box is not None:
                box.pause()
            attempt = Attempt(value, Outcome.OK, meter.peak(), duration=time.perf_counter() - t0,
                              start_allocated=start)
            return RunResult(self._record(attempt), value=out)
        # outside the `except` block: the failed frames have finished and can be cleared
        if undo is not None:
            undo()
        attempt.reclaimed = release_failure(failed, failure, meter, user_ns=self.namespace)
        del failed
        return RunResult(self._record(attempt), failure=failure)

    def _record(self, attempt: Attempt) -> Attempt:
        attempt.reason = self.why
        self.report.attempts.append(attempt)
        self.on_attempt(attempt)
        return attempt

    def _failed(self, result: RunResult) -> None:
        report = self.report
        report.oom, report.failure = result.failure.oom, result.failure.point
        report.by_kind = result.failure.by_kind
        if result.attempt.reclaimed is not None:
            report.reclaimed[self.meter.key] = result.attempt.reclaimed   # per clean-up, never summed

    # the run ------------------------------------------------------------------------------------
    def run(self, call, report: GuardReport):
        """Returns (value of the run that stands, exception to pass through or None)."""
        __tracebackhide__ = True  # noqa: F841
        return run_sync(self.run_async(call, report))

    async def run_async(self, call, report: GuardReport):
        """`run` for a call that may return an awaitable: IPython awaits this for a cell with `await`."""
        __tracebackhide__ = True  # noqa: F841
        self.report = report
        capacity = capacity_of(self.meter) if self.limit is not None else None   # reading it may start CUDA
        if capacity is not None and self.limit > capacity:
            from cuda_magic.units import format_bytes

            note = (f"the cap {format_bytes(self.limit)} is above the device's capacity "
                    f"({format_bytes(capacity)}): the capacity is the limit")
            report.warnings.append(note)
            self.on_note(note)
        report.timeline_requested = bool(self.timeline)
        if self.timeline is not False:
            self.box = start_blackbox(self.meter, self.filename)
        try:
            return await self._run(call, report)
        finally:
            self._finish_box(report)

    def _finish_box(self, report: GuardReport) -> None:
        box, self.box = self.box, None
        if box is not None:
            finish_blackbox(box, report, self.meter, self.limit, self.lines)

    async def _run(self, call, report: GuardReport):
        __tracebackhide__ = True  # noqa: F841
        if self.retry is None:
            try:
                result = await self.run_once(call)
            except KeyboardInterrupt:
                report.outcome = Outcome.INTERRUPTED
                raise
            report.outcome = result.attempt.outcome
            if result.error is not None:
                report.exception_text = error_text(result.error)
                return None, result.error
            if result.failure is not None:
                self._failed(result)
            return result.value, None
        return await self._run_retried(call, report)

    async def _run_retried(self, call, report: GuardReport):
        __tracebackhide__ = True  # noqa: F841
        from cuda_magic.recover.retry import BatchSearch
        from cuda_magic.recover.rollback import Checkpoint

        spec, values = self.retry, self.values
        report.retry = retry = Retry(spec.variable, int(values[spec.variable]), accumulate=spec.accumulate,
                                     search=spec.search)
        if spec.accumulate is not None:
            retry.original_accumulate = int(values[spec.accumulate])
        keep = {spec.variable, spec.accumulate} - {None}
        checkpoint = Checkpoint(self.namespace, roots=self.roots, keep=keep)
        for note in checkpoint.take():
            report.warnings.append(note)
            self.on_note(note)
        allowed = None
        if spec.exact and spec.accumulate is not None:
            from cuda_magic.recover.retry import divisors

            allowed = divisors(retry.original * retry.original_accumulate)
        policy = BatchSearch(retry.original, spec.floor, spec.search,
                             capacity=self.limit or capacity_of(self.meter), allowed=allowed,
                             accumulating=spec.accumulate is not None)
        value = policy.first()
        kept = None                              # the run whose effects stand: (value, call's value)
        try:
            while value is not None:
                self._apply(value)
                self.why = policy.reason
                with checkpoint.watching():
                    result = await self.run_once(call, value, undo=checkpoint.restore_bindings)
                if result.error is not None:
                    self._restore_values()
                    report.outcome = Outcome.ERROR
                    report.exception_text = error_text(result.error)
                    report.warnings.append(f"stopped: {type(result.error).__name__} is not an out-of-memory "
                                           f"error; {self._restored_words()}")
                    report.not_undone = checkpoint.not_undone()
                    return None, result.error
                ok = result.failure is None
                progress = None
                if not ok:
                    self._failed(result)
                    progress = self._undo_failed(result.failure, value, checkpoint, spec)
                policy.record(value, ok, peak=result.attempt.peak, requested=result.attempt.requested,
                              baseline=result.attempt.start_allocated,
                              allocated_at_failure=result.failure.allocated if result.failure else None,
                              progress=progress,
                              capacity=result.failure.oom.capacity if result.failure and not self.limit else None)
                following = policy.next()
                if ok and (following is None and policy.best == value):
                    kept = (value, result.value)       # the last run fitted at the value found: it stands
                    break
                if ok:                                 # a --search probe: undone, like a failed attempt
                    result.attempt.probe = True
                    checkpoint.restore()
                    collect_freed()
                if following is None and policy.best is not None:
                    following = policy.best            # the real run at the value found
                    self.on_note(f"running the cell at {spec.variable}={following}, the value found")
                    self._apply(following)
                    self.why = "the largest value the probes found to fit"
                    with checkpoint.watching():
                        result = await self.run_once(call, following)
                    if result.error is not None:
                        self._restore_values()
                        report.outcome = Outcome.ERROR
                        report.exception_text = error_text(result.error)
                        report.not_undone = checkpoint.not_undone()
                        return None, result.error
                    if result.failure is None:
                        kept = (following, result.value)
                    else:
                        self._failed(result)
                        report.warnings.append(f"{spec.variable}={following} fitted as a probe but ran out "
                                               "of memory when run for real")
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
            why = policy.stop_reason if policy.independent else (
                f"even {spec.variable}={last} ran out of memory (the floor is {spec.floor})")
            report.warnings.append(f"{why}; {self._restored_words()}")
            return None, None
        final, out = kept
        self._apply(final)
        retry.final = final
        if spec.accumulate is not None:
            retry.final_accumulate = int(values[spec.accumulate])
        report.outcome = Outcome.RECOVERED if final != retry.original else Outcome.OK
        return out, None

    def _undo_failed(self, failure: Failure, value, checkpoint, spec: RetrySpec):
        """After a failed attempt whose memory is given back: undo it, and with -r after a failure inside
        the model, measure the model on slices of the failing batch (recover/replay.py), where that batch
        is the value retried and the checkpoint holds the model (what the measuring changes is undone the
        same way); the failure's progress, with the measure where taken."""
        progress, replay, failure.replay = failure.progress, failure.replay, None
        checkpoint.restore()       # the states, now that the failure's memory is back (its names: done)
        if (replay is None or progress is None or spec.search or replay.rows != value
                or not checkpoint.holds(replay.root)):
            return progress
        from dataclasses import replace

        try:
            with self.meter.running(self.limit), autocast(self.amp, self.meter):
                cost = replay.measure(self.meter)
        finally:
            del replay
            checkpoint.restore()
            collect_freed()
        return progress if cost is None else replace(progress, cost=cost)

    # variables ----------------------------------------------------------------------------------
    def _apply(self, value) -> None:
        from cuda_magic.recover.retry import scale_accumulation

        retry = self.report.retry
        self.values[retry.variable] = value
        if retry.accumulate is not None:
            self.values[retry.accumulate] = scale_accumulation(retry.original, retry.original_accumulate, value)

    def _restore_values(self) -> None:
        retry = self.report.retry
        self.values[retry.variable] = retry.original
        if retry.accumulate is not None:
            self.values[retry.accumulate] = retry.original_accumulate

    def _restored_words(self) -> str:
        retry = self.report.retry
        words = f"{retry.variable} restored to {retry.original}"
        if retry.accumulate is not None:
            words += f" and {retry.accumulate} to {retry.original_accumulate}"
        return words


def run_sync(coroutine):
    """Run a coroutine that never suspends (the engine on a cell without `await`) to its end: what
    IPython's own pseudo-sync runner does."""
    __tracebackhide__ = True  # noqa: F841
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return stop.value
    coroutine.close()
    raise RuntimeError("the guarded call awaited something; run it with `await engine.run_async(...)`")


def start_blackbox(meter, filename: str | None = None):
    """The recording of one guarded run on the meter's device (devices/recording.py), started."""
    from cuda_magic.devices.recording import BlackBox

    box = BlackBox(meter, cell_filename=filename)
    box.start()
    return box


def finish_blackbox(box, report: GuardReport, meter, limit: int | None, lines: list[str] | None) -> None:
    """Stop the recording and put what it says on the report (`report.blackbox`)."""
    from cuda_magic.memory.timeline import Timeline, timeline_from

    recorder = box.stop()
    if recorder is None:            # (no capacity asked: on an unused GPU that would start CUDA)
        report.blackbox = Timeline(device=meter.key, notes=box.notes)
        return
    capacity = limit or capacity_of(meter)
    failed = any(a.outcome == Outcome.OOM for a in report.attempts)
    report.blackbox = timeline_from(recorder, device=meter.key, capacity=capacity, limited=limit is not None,
                                    lines=lines, failed=failed)


def collect_freed() -> None:
    """After an undone probe that fitted: its tensors are unbound; collect them and empty the cache."""
    import gc

    from cuda_magic.recover.cleanup import empty_caches

    gc.collect()
    empty_caches()
