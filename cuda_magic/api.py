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
    the function is called again with a value predicted from what the failure measured, down to `min`,
    after undoing what the failed call did to the state of modules and optimizers it reaches (its
    arguments and its module's globals) and to the random generators; `search=True` looks for the largest
    value that fits (each probe undone, then one real call); `accumulate="NAME2"` scales another argument so that NAME x NAME2 stays
    at least what it was. The report of the last call is `func.last_report`;
    nothing is printed for a call that fits, at once or after retries (the report, with its attempts and
    the value that fitted, is on `last_report`). When nothing fits, the report is printed and the
    short out-of-memory error is raised (or None returned with `raise_on_oom=False`).
    As a context manager it frees what the failed block's callees held, explains the OOM, and raises the
    short error (or, with `raise_on_oom=False`, suppresses it); the report is the `as` target.

    The black box records each run (on the simulated device and on CUDA): after an OOM the report shows
    memory over the run and what was alive at the failure, by line (`report.timeline`, `report.by_line`).
    `timeline=True` shows it for a run that fitted too; `timeline=False` records nothing. `exact=True`
    (with accumulate=) tries only divisors of the effective batch, so that NAME x NAME2 equals it.
    """

    def __init__(self, retry: str | None = None, *, min: int = 1, search: bool = False,  # noqa: A002
                 accumulate: str | None = None, limit: str | int | float | None = None,
                 amp: str | None = None, device: str | None = None, raise_on_oom: bool = True,
                 quiet: bool = False, timeline: bool | None = None, exact: bool = False):
        for flag, name in (("retry", retry), ("accumulate", accumulate)):
            if name is not None and not (isinstance(name, str) and name.isidentifier()):
                raise ValueError(f"{flag}= takes the name of a keyword argument (retry=\"batch_size\"), "
                                 f"not {name!r}")
        if accumulate is not None and retry is None:
            raise ValueError("accumulate= needs retry=: it is scaled as the retried argument is reduced")
        if exact and accumulate is None:
            raise ValueError("exact=True needs accumulate=: it keeps NAME x NAME2 equal to the effective batch")
        if timeline not in (None, True, False):
            raise ValueError(f"timeline must be None, True or False, not {timeline!r}")
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
        self.timeline, self.exact = timeline, exact
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

            roots = [v for k, v in func.__globals__.items() if not k.startswith("_")]
            try:
                result, _ = self._run(call, arguments, roots=[*arguments.values(), *roots])
            finally:
                wrapper.last_report = self.report
            return result

        wrapper.last_report = None
        return wrapper

    def _run(self, call, arguments, roots=()):
        __tracebackhide__ = True  # noqa: F841
        from cuda_magic.devices.meter import metered_devices
        from cuda_magic.ipython import current_shell
        from cuda_magic.recover.engine import GuardEngine, RetrySpec
        from cuda_magic.recover.failure import conclude, short_oom_error
        from cuda_magic.recover.report import GuardReport

        meter, limit = self._choose_meter()
        report = GuardReport(device=meter.key, limit=limit, source="oomguard", api=True)
        report.before = metered_devices(meter)
        self.report = report
        retry = None if self.retry is None else RetrySpec(self.retry, self.accumulate, self.floor, self.search,
                                                          self.exact)
        # arguments are bound again for every call: the function's own names need no rollback
        engine = GuardEngine(meter, values=arguments, retry=retry, limit=limit, amp=self.amp, roots=roots,
                             timeline=self.timeline)
        try:
            result, passthrough = engine.run(call, report)
        finally:
            conclude(report, meter, amp=self.amp is not None, shell=current_shell())
        if passthrough is not None:
            raise passthrough
        self._show(report)
        if report.outcome == "oom" and self.raise_on_oom:
            error = short_oom_error(report)
            del engine
            raise error
        return result, report

    def _choose_meter(self):
        """(meter, limit bytes) for this run; `device=` must name a device that is here (ValueError)."""
        from cuda_magic.devices.meter import choose_meter

        device = self.device
        if device is not None:
            from cuda_magic.devices.names import present_devices, resolve_device

            device = resolve_device(device, present_devices(), flag="device=")
        return choose_meter(device, None if self.limit is None else str(self.limit),
                            lambda text, cap: parse_size(text, cap))

    def _show(self, report) -> None:
        """Silent for a call that fits, at once or after retries (SPEC: "prints nothing for a call that
        fits"; the report is on `last_report`); the report after an OOM it could not get past."""
        if self.quiet or (report.outcome in ("ok", "recovered") and not self.timeline):
            return
        from cuda_magic.display.show import show

        show(report)

    # context manager -----------------------------------------------------------------------------
    def __enter__(self):
        if self.retry is not None:
            raise TypeError("retry= needs a function to call again: use @oomguard(retry=...) as a decorator")
        from cuda_magic.recover.report import GuardReport

        self._meter, limit = self._choose_meter()
        self._limit = limit
        self.report = GuardReport(device=self._meter.key, limit=limit, source="oomguard", api=True)
        self._meter.reset_peak()
        self._start = self._meter.allocated()
        self._box = None
        if self.timeline is not False:
            from cuda_magic.recover.engine import start_blackbox

            self._box = start_blackbox(self._meter)
            self._box.begin_attempt(0)
        self.report.timeline_requested = bool(self.timeline)
        self._running = self._meter.running(limit)
        self._running.__enter__()
        return self.report

    def __exit__(self, etype, value, tb):
        from cuda_magic.ipython import current_shell
        from cuda_magic.recover.failure import (conclude, error_text, kind_of, read_failure, release_failure,
                                                short_oom_error)
        from cuda_magic.recover.report import Attempt, Outcome

        from cuda_magic.recover.engine import finish_blackbox

        self._running.__exit__(None, None, None)
        report, meter = self.report, self._meter
        kind = Outcome.OK if value is None else kind_of(value)
        box, self._box = self._box, None
        if box is not None:
            if kind is Outcome.OOM:
                box.failed()
            box.pause()
        if kind is not Outcome.OOM:
            report.attempts.append(Attempt(None, kind, meter.peak(), start_allocated=self._start))
            report.outcome = kind
            if value is not None:
                report.exception_text = error_text(value)
            if box is not None:
                finish_blackbox(box, report, meter, self._limit, None)
            conclude(report, meter)
            if self.timeline and not self.quiet and kind is Outcome.OK:
                from cuda_magic.display.show import show

                show(report)
            return False
        failure = read_failure(value, meter)
        report.oom, report.failure = failure.oom, failure.point
        report.by_kind = failure.by_kind
        attempt = Attempt(None, Outcome.OOM, meter.peak(), failure.oom.requested, start_allocated=self._start)
        report.attempts.append(attempt)
        del tb
        if box is not None:
            finish_blackbox(box, report, meter, self._limit, None)
        attempt.reclaimed = release_failure(value, failure, meter)
        del value
        if attempt.reclaimed is not None:
            report.reclaimed[meter.key] = attempt.reclaimed
        report.outcome = Outcome.OOM
        conclude(report, meter, amp=self.amp is not None, shell=current_shell())
        if not self.quiet:
            from cuda_magic.display.show import show

            show(report)
        if self.raise_on_oom:
            raise short_oom_error(report)
        return True
