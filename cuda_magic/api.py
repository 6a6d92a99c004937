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
        from cuda_magic.recover.options import AskedOptions, OptionError

        self._asked = AskedOptions(api=True, retry=retry, accumulate=accumulate, floor=min, search=search,
                                   exact=exact, limit=limit, device=device, amp=amp, timeline=timeline,
                                   timeout=timeout)
        try:
            self._asked.check_form()        # bad text now, not at the first call
        except OptionError as exc:
            raise exc.as_api_error() from None
        self.retry, self.floor, self.search, self.accumulate = retry, min, search, accumulate
        self.limit, self.amp, self.device = limit, amp, device
        self.raise_on_oom, self.quiet = raise_on_oom, quiet
        self.timeline, self.exact, self.timeout = timeline, exact, timeout
        self.report = None          # the last call's report (each call keeps its own run: reentrant)
        self._blocks = []           # the runs of the `with` blocks entered and not yet left

    # decorator -----------------------------------------------------------------------------------
    def __call__(self, func):
        from cuda_magic.recover.options import OptionError

        signature = inspect.signature(func)
        try:
            self._asked.check_arguments(signature.parameters, func.__name__)
        except OptionError as exc:
            raise exc.as_api_error() from None

        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = bound.arguments
            meter, options = self._checked(arguments, func.__name__)   # before the function runs

            def call():
                return func(*bound.args, **bound.kwargs)

            globals_ = [v for k, v in func.__globals__.items() if not k.startswith("_")]
            # arguments are bound again for every call: the function's own names need no rollback
            run = self._guarded_run(meter, options, values=arguments, roots=[*arguments.values(), *globals_],
                                    code=func.__code__)
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

    def _guarded_run(self, meter, options, code=None, **where):
        import dataclasses

        from cuda_magic.ipython import current_shell
        from cuda_magic.recover.guarded import GuardedRun

        return GuardedRun(meter, dataclasses.replace(options, code=code), shell=current_shell(), **where)

    def _checked(self, values=None, function: str = "fn"):
        """(meter, GuardOptions): recover/options.py's checks, as the API's ValueError or TypeError (values
        None: a `with` block's)."""
        from cuda_magic.recover.options import OptionError

        try:
            if values is None:
                self._asked.check_block()
            return self._asked.check(values, function=function)
        except OptionError as exc:
            raise exc.as_api_error() from None

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
        meter, options = self._checked()
        from cuda_magic.recover.retry_loop import ranks_in_group

        import sys

        run, ranked = self._guarded_run(meter, options, code=sys._getframe(1).f_code), None
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
    from cuda_magic.fakerun.predicting import PredictedRun
    from cuda_magic.recover.options import AskedOptions, OptionError

    asked = AskedOptions(api=True, retry=retry, accumulate=accumulate, floor=min, exact=exact, limit=limit,
                         amp=amp, device=device)
    try:                            # every option checked, the meter chosen: before anything runs
        asked.check_form()
        bound = inspect.signature(fn).bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        meter, options = asked.check(arguments, function=getattr(fn, "__name__", "fn"))
    except OptionError as exc:
        raise exc.as_api_error() from None
    code = getattr(fn, "__code__", None)
    named = set(code.co_names) if code is not None else set()
    globals_ = getattr(fn, "__globals__", None)
    run = PredictedRun(meter, options, lambda: fn(*bound.args, **bound.kwargs), bind=arguments,
                       more=[(globals_, named)] if globals_ is not None else [])
    return run.predict()


def read_snapshot(path_or_dict, device: int | None = None):
    """A memory snapshot read and explained: a path to what `torch.cuda.memory._dump_snapshot()` wrote
    (gzip'd or not) or the dict `torch.cuda.memory._snapshot()` returns. The reading has `.peak_allocated`,
    `.peak_reserved`, `.by_line`, `.by_kind`, `.timeline`, `.oom`, `.smallest_capacity` and
    `.replay(capacity=None, conf=None)`. A file that is not a snapshot, or that asks to run anything while
    it loads (it is read as plain data only, and nothing in it runs), raises `cuda_magic.SnapshotError`.
    `device`: of a recording of several devices (default: the one that held the most)."""
    from cuda_magic.oom.snapshot_reading import read_snapshot as read

    return read(path_or_dict, device)
