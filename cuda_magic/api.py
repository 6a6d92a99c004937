"""The Python API: the machinery of `%%oomguard` outside notebooks.

    from cuda_magic import oomguard

    @oomguard(retry="batch_size", accumulate="accum_steps", search=True)
    def train(batch_size=512, accum_steps=1): ...

    with oomguard(limit="4GiB"):     # clean-up and explanation, no retry (a block cannot re-run)
        ...
"""
from __future__ import annotations

import functools
import inspect

from cuda_magic.units import SizeError, is_positive_int, parse_size


class oomguard:  # noqa: N801 - used as a decorator, like contextlib's
    """Decorator and context manager.

    As a decorator, `retry="NAME"` names a keyword argument of the function: on an out-of-memory error
    it is halved (or, with `search=True`, predicted from what each attempt measured) and the function
    called again, down to `min`; `accumulate="NAME2"` scales another argument so that NAME x NAME2 stays
    at least what it was. The report of the last call is `func.last_report`. When nothing fits, the
    short out-of-memory error is raised (or None returned with `raise_on_oom=False`).
    As a context manager it frees what the failed block's callees held, explains the OOM, and raises the
    short error (or, with `raise_on_oom=False`, suppresses it); the report is the `as` target.
    """

    def __init__(self, retry: str | None = None, *, min: int = 1, search: bool = False,  # noqa: A002
                 accumulate: str | None = None, limit: str | int | float | None = None,
                 amp: str | None = None, device: str | None = None, raise_on_oom: bool = True,
                 quiet: bool = False):
        if accumulate is not None and retry is None:
            raise ValueError("accumulate= needs retry=: it is scaled as the retried argument is reduced")
        if isinstance(min, bool) or not isinstance(min, int) or min < 1:
            raise ValueError(f"min must be an int of at least 1, not {min!r}")
        if amp not in (None, "bf16", "fp16"):
            raise ValueError(f"amp must be 'bf16' or 'fp16', not {amp!r}")
        if limit is not None:
            try:
                parse_size(str(limit), 1)   # reject bad text now, not at the first call
            except SizeError as exc:
                raise ValueError(str(exc)) from None
        self.retry, self.floor, self.search, self.accumulate = retry, min, search, accumulate
        self.limit, self.amp, self.device = limit, amp, device
        self.raise_on_oom, self.quiet = raise_on_oom, quiet
        self.report = None

    # decorator -----------------------------------------------------------------------------------
    def __call__(self, func):
        signature = inspect.signature(func)
        for name in (self.retry, self.accumulate):
            if name is not None and name not in signature.parameters:
                raise ValueError(f"{func.__name__}() has no argument {name!r} to retry")

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = bound.arguments
            for name in (self.retry, self.accumulate):
                if name is not None:
                    value = arguments.get(name)
                    if not is_positive_int(value):
                        raise ValueError(f"{name} must be a positive int to be retried, not {value!r}")
            if self.retry is not None and arguments[self.retry] < self.floor:
                raise ValueError(f"{self.retry}={arguments[self.retry]} is already below min={self.floor}")

            def call():
                return func(*bound.args, **bound.kwargs)

            try:
                result, _ = self._run(call, arguments)
            finally:
                wrapper.last_report = self.report
            return result

        wrapper.last_report = None
        return wrapper

    def _run(self, call, arguments):
        __tracebackhide__ = True  # noqa: F841
        from cuda_magic.recover.engine import GuardEngine, diagnose_report, finish_report, short_oom_error
        from cuda_magic.devices.meter import choose_meter, metered_devices
        from cuda_magic.recover.report import GuardReport

        meter, limit = choose_meter(self.device, None if self.limit is None else str(self.limit),
                                    lambda text, cap: parse_size(text, cap))
        report = GuardReport(device=meter.key, variable=self.retry, accumulate=self.accumulate, limit=limit,
                             source="oomguard")
        report.before = metered_devices(meter)
        self.report = report
        from cuda_magic.display.show import show_guard

        handle = show_guard(report, quiet=self.quiet)
        engine = GuardEngine(meter, limit=limit, amp=self.amp, variable=self.retry,
                             accumulate=self.accumulate, floor=self.floor, search=self.search,
                             get_value=arguments.__getitem__, set_value=arguments.__setitem__,
                             on_attempt=handle.add_attempt)
        try:
            result, passthrough = engine.run(call, report)
        finally:
            finish_report(report, meter)
        if report.oom is not None:
            report.diagnosis = diagnose_report(report, meter, amp=self.amp is not None)
        handle.finish(report)
        if passthrough is not None:
            raise passthrough
        if report.outcome == "oom" and self.raise_on_oom:
            error = short_oom_error(report)
            del engine, handle
            raise error
        return result, report

    # context manager -----------------------------------------------------------------------------
    def __enter__(self):
        if self.retry is not None:
            raise TypeError("retry= needs a function to call again: use @oomguard(retry=...) as a decorator")
        from cuda_magic.devices.meter import choose_meter
        from cuda_magic.recover.report import GuardReport

        self._meter, limit = choose_meter(self.device, None if self.limit is None else str(self.limit),
                                          lambda text, cap: parse_size(text, cap))
        self._limit = limit
        self.report = GuardReport(device=self._meter.key, limit=limit, source="oomguard")
        self._meter.reset_peak()
        self._start = self._meter.allocated()
        self._running = self._meter.running(limit)
        self._running.__enter__()
        return self.report

    def __exit__(self, etype, value, tb):
        from cuda_magic.recover.engine import diagnose_report, failure_point, free_failure, short_oom_error
        from cuda_magic.oom.classify import oom_fields, oom_kind
        from cuda_magic.recover.report import Attempt

        self._running.__exit__(None, None, None)
        report, meter = self.report, self._meter
        peak = meter.peak()
        report.peaks[meter.key] = peak
        if value is None or oom_kind(value) not in ("oom", "possible"):
            report.attempts.append(Attempt(None, "ok" if value is None else "error", peak,
                                           start_allocated=self._start))
            report.outcome = "ok" if value is None else "error"
            return False
        report.oom = oom_fields(value)
        report.failure = failure_point(tb, None, None)
        report.attempts.append(Attempt(None, "oom", peak, report.oom.requested if report.oom else None,
                                       start_allocated=self._start))
        del tb
        reclaimed = free_failure(value, meter)
        del value
        if reclaimed is not None:
            report.reclaimed[meter.key] = reclaimed
        report.outcome = "oom"
        report.diagnosis = diagnose_report(report, meter, amp=self.amp is not None)
        if not self.quiet:
            from cuda_magic.display.show import show_guard

            show_guard(report).finish(report)
        if self.raise_on_oom:
            raise short_oom_error(report)
        return True
