"""The guard engine: run something that may run out of memory, measure it, and on an OOM copy out what
the failure says, free everything it held, and (with a retried variable) try again at a value that fits.

Shared by `%%oomguard` and the Python API's `oomguard` decorator and context manager. The call is a
no-argument callable; the retried variable is read and written through `get_value` / `set_value`.
"""
from __future__ import annotations

import gc
import time
from contextlib import nullcontext
from dataclasses import dataclass

from cuda_magic.paths import is_library_file
from cuda_magic.oom.classify import oom_fields, oom_kind
from cuda_magic.recover.notebook_refs import drop_exception
from cuda_magic.recover.cleanup import empty_caches
from cuda_magic.recover.report import Attempt, FailurePoint, GuardReport
from cuda_magic.oom.records import OomFields

FATAL_NOTE = ("cuda_magic: this is not an out-of-memory error: after 'device-side assert triggered' or "
              "'an illegal memory access', the CUDA context is unusable, and unlike an OOM this does need "
              "a kernel restart.")


@dataclass
class RunOutcome:
    kind: str                          # 'ok', 'oom', 'error'
    duration: float
    start_allocated: int | None
    peak: int | None
    exc: BaseException | None = None   # a non-OOM error, passed through untouched
    oom: OomFields | None = None
    failure: FailurePoint | None = None
    allocated_at_failure: int | None = None
    reclaimed: int | None = None


def failure_point(tb, filename: str | None, lines: list[str] | None) -> FailurePoint | None:
    """Where a run failed: the deepest line of the cell itself, and the function it was in, if deeper."""
    cell_line = None
    deepest = None
    while tb is not None:
        code = tb.tb_frame.f_code
        if filename is not None and code.co_filename == filename:
            cell_line = tb.tb_lineno
        if not is_library_file(code.co_filename):
            deepest = (code.co_name, code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    if cell_line is None and deepest is None:
        return None
    text = ""
    if cell_line is not None and lines and 0 < cell_line <= len(lines):
        text = lines[cell_line - 1].strip()
    elif cell_line is not None and filename is not None:
        import linecache

        text = linecache.getline(filename, cell_line).strip()
    function = filename_out = None
    if deepest is not None and (deepest[1] != filename):
        function, filename_out = deepest[0], f"{deepest[1]}:{deepest[2]}"
    return FailurePoint(line=cell_line, text=text, function=function, filename=filename_out)


def autocast(amp: str | None, meter):
    if amp is None:
        return nullcontext()
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[amp]
    device_type = "cuda" if meter.key.startswith("cuda") else "cpu"
    return torch.autocast(device_type=device_type, dtype=dtype)


def run_once(call, meter, *, limit=None, amp=None, filename=None, lines=None, user_ns=None) -> tuple[RunOutcome, object]:
    """One run of `call`, measured. KeyboardInterrupt propagates. Returns (outcome, call's value)."""
    __tracebackhide__ = True  # noqa: F841
    start = meter.allocated()
    meter.reset_peak()
    t0 = time.perf_counter()
    failed = None
    value = None
    try:
        with meter.running(limit), autocast(amp, meter):
            value = call()
    except Exception as exc:
        kind = oom_kind(exc)
        if kind not in ("oom", "possible"):
            if kind == "fatal" and hasattr(exc, "add_note"):
                exc.add_note(FATAL_NOTE)
            return RunOutcome("error", time.perf_counter() - t0, start, meter.peak(), exc=exc), None
        # Copy what the failure says into plain values; the exception itself is dropped below,
        # outside this block, where its frames are no longer executing.
        outcome = RunOutcome("oom", time.perf_counter() - t0, start, meter.peak(),
                             oom=oom_fields(exc), failure=failure_point(exc.__traceback__, filename, lines),
                             allocated_at_failure=meter.allocated())
        failed = exc
    else:
        return RunOutcome("ok", time.perf_counter() - t0, start, meter.peak()), value
    outcome.reclaimed = free_failure(failed, meter, user_ns=user_ns)
    del failed
    return outcome, None


def free_failure(exc, meter, *, user_ns=None) -> int | None:
    """Free what a failed run held: clear and sever the exception's frames, then a gc pass, then the
    allocator cache, in that order. Call it outside the `except` block. Returns the bytes the device got
    back (reserved before minus after), or None where the meter cannot say."""
    reserved_at_failure = meter.reserved()
    drop_exception(exc, user_ns=user_ns)
    gc.collect()
    empty_caches()
    after = meter.reserved()
    if reserved_at_failure is None or after is None:
        return None
    return max(0, reserved_at_failure - after)


def finish_report(report: GuardReport, meter) -> None:
    """The device after the run, and the highest peak of its attempts."""
    from cuda_magic.devices.meter import metered_devices

    report.after = metered_devices(meter)
    peaks = [a.peak for a in report.attempts if a.peak is not None]
    report.peaks[meter.key] = max(peaks) if peaks else None


def diagnose_report(report: GuardReport, meter, *, amp: bool, holders=()):
    """Why the report's OOM happened, with ranked advice."""
    from cuda_magic.devices.allocator_conf import current_allocator_conf
    from cuda_magic.oom.diagnosis import diagnose

    try:
        capacity = meter.capacity()
    except Exception:
        capacity = None
    return diagnose(report.oom or OomFields(), holders=holders, amp=amp, device_capacity=capacity,
                    peak=report.peaks.get(meter.key), alloc_conf=current_allocator_conf(),
                    limit=report.limit, batch_var=report.variable, accum_var=report.accumulate)


class GuardEngine:
    """Runs a call under a meter, with the retry policy when a variable is retried."""

    def __init__(self, meter, *, limit=None, amp=None, variable=None, accumulate=None, floor=1,
                 search=False, get_value=None, set_value=None, shell=None, filename=None, lines=None,
                 on_attempt=None, namespace=None):
        self.meter = meter
        self.limit, self.amp = limit, amp
        self.variable, self.accumulate = variable, accumulate
        self.floor, self.search = floor, search
        self.get_value, self.set_value = get_value, set_value
        self.shell = shell
        self.filename, self.lines = filename, lines
        self.on_attempt = on_attempt
        self.namespace = namespace   # watched for rebinding by failed attempts (effects that repeat)

    def run(self, call, report: GuardReport):
        """Returns (value of the last successful run, passthrough exception or None)."""
        __tracebackhide__ = True  # noqa: F841
        from cuda_magic.recover.retry import BatchSearch

        user_ns = getattr(self.shell, "user_ns", None)
        policy = None
        if self.variable is not None:
            report.original_value = self.get_value(self.variable)
            if self.accumulate is not None:
                report.original_accumulate = self.get_value(self.accumulate)
            capacity = self.limit or _capacity(self.meter)
            policy = BatchSearch(int(report.original_value), self.floor, self.search, capacity=capacity)
            value = policy.first()
        else:
            value = None
        result = None
        last_ok_value = None
        try:
            while True:
                if policy is not None:
                    self._apply(value, report)
                before_ns = _bindings(self.namespace) if policy is not None else None
                outcome, out = run_once(call, self.meter, limit=self.limit, amp=self.amp,
                                        filename=self.filename, lines=self.lines, user_ns=user_ns)
                attempt = Attempt(value=value, outcome=outcome.kind, peak=outcome.peak,
                                  requested=outcome.oom.requested if outcome.oom else None,
                                  duration=outcome.duration, start_allocated=outcome.start_allocated)
                report.attempts.append(attempt)
                if outcome.kind == "oom":
                    report.oom, report.failure = outcome.oom, outcome.failure
                    report.reclaimed[self.meter.key] = report.reclaimed.get(self.meter.key, 0) + (outcome.reclaimed or 0)
                    if before_ns is not None:
                        self._warn_rebound(before_ns, report)
                if self.on_attempt is not None:
                    self.on_attempt(attempt)
                if outcome.kind == "error":
                    if policy is not None:
                        self._restore(report)
                        report.warnings.append(f"stopped: {type(outcome.exc).__name__} is not an out-of-memory "
                                               f"error; {self._restored_words(report)}")
                    report.outcome = "error"
                    report.exception_text = f"{type(outcome.exc).__name__}: {outcome.exc}"
                    return None, outcome.exc
                if outcome.kind == "ok":
                    result, last_ok_value = out, value
                if policy is None:
                    report.outcome = "ok" if outcome.kind == "ok" else "oom"
                    return result, None
                policy.record(value, outcome.kind == "ok", peak=outcome.peak, requested=attempt.requested,
                              baseline=outcome.start_allocated,
                              allocated_at_failure=outcome.allocated_at_failure,
                              capacity=outcome.oom.capacity if outcome.oom and not self.limit else None)
                value = policy.next()
                if value is None:
                    break
        except KeyboardInterrupt:
            if policy is not None:
                self._restore(report)
                report.warnings.append(f"interrupted: {self._restored_words(report)}")
            report.outcome = "interrupted"
            raise
        best = policy.best
        if best is None:
            self._restore(report)
            report.outcome = "oom"
            report.warnings.append(f"even {self.variable}={report.attempts[-1].value} ran out of memory (the "
                                   f"floor is {self.floor}); {self._restored_words(report)}")
            return None, None
        self._apply(best, report)
        report.final_value = best
        if self.accumulate is not None:
            report.final_accumulate = self.get_value(self.accumulate)
        report.outcome = "recovered" if best != report.original_value else "ok"
        if last_ok_value != report.attempts[-1].value:
            report.warnings.append(f"the last attempt ({self.variable}={report.attempts[-1].value}) ran out of "
                                   f"memory after the run with {self.variable}={best} had finished; the cell's "
                                   "state is from that failed attempt, so run the cell again to redo its work")
        return result, None

    # variables ----------------------------------------------------------------------------------
    def _apply(self, value, report) -> None:
        from cuda_magic.recover.retry import scale_accumulation

        self.set_value(self.variable, value)
        if self.accumulate is not None:
            self.set_value(self.accumulate, scale_accumulation(int(report.original_value),
                                                               int(report.original_accumulate), value))

    def _restore(self, report) -> None:
        if report.original_value is not None:
            self.set_value(self.variable, report.original_value)
        if self.accumulate is not None and report.original_accumulate is not None:
            self.set_value(self.accumulate, report.original_accumulate)

    def _restored_words(self, report) -> str:
        words = f"{self.variable} restored to {report.original_value}"
        if self.accumulate is not None:
            words += f" and {self.accumulate} to {report.original_accumulate}"
        return words

    def _warn_rebound(self, before: dict, report) -> None:
        after = _bindings(self.namespace)
        skip = {self.variable, self.accumulate}
        changed = sorted(k for k, v in after.items() if k not in skip and before.get(k) != v)
        if changed:
            shown = ", ".join(changed[:6]) + (f" and {len(changed) - 6} more" if len(changed) > 6 else "")
            note = (f"the cell changed {shown} before it ran out of memory; each retry re-runs the cell from "
                    "its first line, so those effects repeat")
            if note not in report.warnings:
                report.warnings.append(note)


def _bindings(namespace) -> dict | None:
    if namespace is None:
        return None
    return {k: id(v) for k, v in list(namespace.items()) if not k.startswith("_")}


def _capacity(meter) -> int | None:
    try:
        return meter.capacity()
    except Exception:
        return None


def short_oom_error(report: GuardReport):
    """The short error raised after an OOM: holds no frames of the failed run, and no context."""
    cls = _short_error_class()
    reclaimed = sum(report.reclaimed.values())
    from cuda_magic.units import format_bytes

    what = f"{report.variable}={report.attempts[-1].value}: " if report.variable and report.attempts else ""
    return cls(f"{what}out of memory in this cell (explained above; {format_bytes(reclaimed)} reclaimed, the "
               "kernel can keep going)")


_short_cls = None


def _short_error_class():
    global _short_cls
    if _short_cls is None:
        import torch

        class OutOfMemoryError(torch.OutOfMemoryError):
            """Raised by `%%oomguard` after an out-of-memory error it cleaned up: holds nothing.
            A subclass of torch.OutOfMemoryError, so `except torch.OutOfMemoryError` still catches it."""

            def _render_traceback_(self):
                return [f"OutOfMemoryError: {self}"]

        OutOfMemoryError.__module__ = "cuda_magic"
        OutOfMemoryError.__qualname__ = "OutOfMemoryError"
        _short_cls = OutOfMemoryError
    return _short_cls
