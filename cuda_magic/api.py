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

from cuda_magic.units import SizeError, is_positive_int, parse_limit


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

    Inside a torch.distributed process group (DDP) the ranks retry together (recover/ranks.py): every
    rank undoes a step that failed on any rank, all take the smallest value predicted, rank 0 shows the
    report; `timeout=` (seconds) bounds each wait for the other ranks, and an unrecoverable failure stops
    every rank with the same `RankError`. A `with` block there ends on every rank together
    (recover/ranked_block.py): where one rank ran out, every rank stops, frees, and raises the same short
    error (or, with `raise_on_oom=False`, goes on with `report.outcome == "oom"` on every rank).
    """

    def __init__(self, retry: str | None = None, *, min: int = 1, search: bool = False,  # noqa: A002
                 accumulate: str | None = None, limit: str | int | float | None = None,
                 amp: str | None = None, device: str | None = None, raise_on_oom: bool = True,
                 quiet: bool = False, timeline: bool | None = None, exact: bool = False,
                 timeout: float | None = None):
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
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise ValueError(f"timeout is seconds above 0, not {timeout!r}")
        if limit is not None:
            try:
                parse_limit(str(limit))     # reject bad text now, not at the first call
            except SizeError as exc:
                raise ValueError(str(exc)) from None
        self.retry, self.floor, self.search, self.accumulate = retry, min, search, accumulate
        self.limit, self.amp, self.device = limit, amp, device
        self.raise_on_oom, self.quiet = raise_on_oom, quiet
        self.timeline, self.exact, self.timeout = timeline, exact, timeout
        self.report = None          # the last call's report (each call keeps its own run: reentrant)
        self._blocks = []           # the runs of the `with` blocks entered and not yet left

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

            globals_ = [v for k, v in func.__globals__.items() if not k.startswith("_")]
            # arguments are bound again for every call: the function's own names need no rollback
            run = self._guarded_run(values=arguments, roots=[*arguments.values(), *globals_], code=func.__code__)
            try:
                result = run.run(call) if not self._ranked_once() else self._run_ranked(run, call)
            finally:
                wrapper.last_report = self.report = run.report
            del run
            return self._outcome(result)

        wrapper.last_report = None
        return wrapper

    def _ranked_once(self) -> bool:
        """No retry=, inside a process group of more than one rank: the call ends on every rank together."""
        from cuda_magic.recover.retry_loop import ranks_in_group

        return self.retry is None and ranks_in_group() > 1

    def _run_ranked(self, run, call):
        """One call that every rank ends together (recover/ranked_block.py), as a `with` block does."""
        __tracebackhide__ = True  # noqa: F841
        from cuda_magic.recover.ranked_block import RankedBlock

        ranked = RankedBlock(run, self.timeout, run.roots, what="call")
        run.begin()
        ranked.begin()
        value = error = None
        try:
            value = call()
        except BaseException as exc:  # noqa: BLE001 - every rank learns how it ended; others propagate
            error = exc
        result = ranked.end(error)          # outside the `except` block: the failed frames have finished
        del error
        result.value = value
        return result

    def _guarded_run(self, code=None, **where):
        from cuda_magic.ipython import current_shell
        from cuda_magic.recover.guarded import GuardedRun, GuardOptions, RetrySpec

        meter, limit = self._choose_meter()
        retry = None if self.retry is None else RetrySpec(self.retry, self.accumulate, self.floor, self.search,
                                                          self.exact)
        options = GuardOptions(retry=retry, limit=limit, amp=self.amp, timeline=self.timeline, source="oomguard",
                               api=True, rank_timeout=self.timeout, code=code)
        return GuardedRun(meter, options, shell=current_shell(), **where)

    def _outcome(self, result):
        """Pass a non-OOM error through; show the report where it is worth it; raise the short error."""
        __tracebackhide__ = True  # noqa: F841
        if result.error is not None:
            error, result = result.error, None
            raise error
        self._show(result.report)
        if result.ran_out and self.raise_on_oom:
            error, result = result.short_error(), None
            raise error
        return result.value

    def _choose_meter(self):
        """(meter, limit bytes) for this run; `device=` must name a device that is here (ValueError)."""
        from cuda_magic.devices.meter import choose_meter

        device = self.device
        if device is not None:
            from cuda_magic.devices.names import present_devices, resolve_device

            device = resolve_device(device, present_devices(), flag="device=")
        try:
            return choose_meter(device, None if self.limit is None else parse_limit(str(self.limit)))
        except SizeError as exc:
            raise ValueError(f"limit={self.limit!r}: {exc}") from None

    def _show(self, report) -> None:
        """Silent for a call that fits, at once or after retries (SPEC: "prints nothing for a call that
        fits"; the report is on `last_report`); the report after an OOM it could not get past."""
        if self.quiet or (report.outcome in ("ok", "recovered") and not self.timeline):
            return
        if report.ranks is not None and report.ranks.rank:   # in a process group: rank 0 shows them all
            return
        from cuda_magic.display.show import show

        show(report)

    # context manager -----------------------------------------------------------------------------
    def __enter__(self):
        if self.retry is not None:
            raise TypeError("retry= needs a function to call again: use @oomguard(retry=...) as a decorator")
        from cuda_magic.recover.retry_loop import ranks_in_group

        import sys

        run, ranked = self._guarded_run(code=sys._getframe(1).f_code), None
        if ranks_in_group() > 1:        # in a process group: the ranks end the block together
            from cuda_magic.recover.ranked_block import RankedBlock

            caller = sys._getframe(1)
            ranked = RankedBlock(run, self.timeout, [*caller.f_locals.values(), *caller.f_globals.values()])
            del caller
        report = run.begin()
        if ranked is not None:
            ranked.begin()
        self._blocks.append((run, ranked))
        self.report = report
        return report

    def __exit__(self, etype, value, tb):
        __tracebackhide__ = True  # noqa: F841
        run, ranked = self._blocks.pop()
        del tb
        result = run.end(value) if ranked is None else ranked.end(value)
        del value, run, ranked
        report = self.report = result.report
        if result.error is not None:        # not out of memory, or Ctrl-C: it propagates untouched
            return False
        if result.ran_out:
            self._show(report)
            if self.raise_on_oom:
                raise result.short_error()
            return True
        self._show(report)
        return False


def predict(fn, *args, retry: str | None = None, accumulate: str | None = None, min: int = 1,  # noqa: A002
            exact: bool = False, limit: str | int | float | None = None, amp: str | None = None,
            device: str | None = None, **kwargs):
    """Predict the memory of `fn(*args, **kwargs)` without running it: `fn` runs on fake tensors, with
    fake copies of the modules and optimizers among its arguments and the globals it names, and nothing
    it does stays. Returns a `Prediction` (`.peak`, `.by_kind`, `.by_line`, `.largest`, `.fits`);
    `print(prediction)` shows it. `retry="batch_size"` (a keyword argument of fn, given or defaulted)
    also finds the largest value that fits, down to `min`; `accumulate="accum_steps"` scales another so
    that the effective batch stays at least what it was (`exact=True`: a divisor of it). `limit` ("16GiB",
    a fraction) and `device` choose what to fit in, as for `oomguard`; `amp` ('bf16', 'fp16') predicts
    under torch.autocast."""
    from cuda_magic.fakerun.cuda_autocast import prediction_autocast as autocast_for
    from cuda_magic.devices.meter import capacity_of
    from cuda_magic.fakerun.planner import Planner, prediction_meter
    from cuda_magic.recover.guarded import RetrySpec

    guard = oomguard(retry, min=min, accumulate=accumulate, limit=limit, amp=amp, device=device, exact=exact)
    signature = inspect.signature(fn)
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = bound.arguments
    spec = None
    if retry is not None:
        for name in (retry, accumulate):
            if name is not None:
                if name not in arguments:
                    raise ValueError(f"{getattr(fn, '__name__', 'fn')}() has no argument {name!r} to retry")
                if not is_positive_int(arguments[name]):
                    raise ValueError(f"{name} must be a positive int to be retried, not {arguments[name]!r}")
        if arguments[retry] < min:
            raise ValueError(f"{retry}={arguments[retry]} is already below min={min}")
        spec = RetrySpec(retry, accumulate, min, False, exact)
    meter, cap = guard._choose_meter()
    meter, note = prediction_meter(meter)
    code = getattr(fn, "__code__", None)
    named = set(code.co_names) if code is not None else set()
    globals_ = getattr(fn, "__globals__", None)
    planner = Planner(meter, lambda: fn(*bound.args, **bound.kwargs), capacity=cap if cap is not None else capacity_of(meter),
                      limited=cap is not None, bind=arguments,
                      more=[(globals_, named)] if globals_ is not None else [], namespace=None, retry=spec, amp=amp,
                      autocast=lambda: autocast_for(amp, meter), api=True,
                      device_name=meter.device.name if meter.key.startswith("sim") else "")
    prediction = planner.predict()
    if note:
        prediction.notes.insert(0, note)
    return prediction


def read_snapshot(path_or_dict, device: int | None = None):
    """A memory snapshot read and explained: a path to what `torch.cuda.memory._dump_snapshot()` wrote
    (gzip'd or not) or the dict `torch.cuda.memory._snapshot()` returns. The reading has `.peak_allocated`,
    `.peak_reserved`, `.by_line`, `.by_kind`, `.timeline`, `.oom`, `.smallest_capacity` and
    `.replay(capacity=None, conf=None)`. A file that is not a snapshot, or that asks to run anything while
    it loads (it is read as plain data only, and nothing in it runs), raises `cuda_magic.SnapshotError`.
    `device`: of a recording of several devices (default: the one that held the most)."""
    from cuda_magic.oom.snapshot_reading import read_snapshot as read

    return read(path_or_dict, device)
