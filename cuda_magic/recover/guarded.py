"""The core: one guarded call, from start to result.

A `GuardedRun` is the life of one guarded call on one meter. It runs the call (again, for a retry:
recover/retry_loop.py), takes the one path after an out-of-memory error (inside the `except` block, read
what the failure says; outside it, undo the attempt, release what the failure held, stop the black box)
and builds the report. Nothing else writes the report. Its shapes:

    result = GuardedRun(meter, options, ...).run(call)      # the core calls it (and again, for a retry)
    report = run.begin(); ...; result = run.end(exc)       # a block runs in between (the `with` form)
    run.record(); ...; result = run.end(exc)               # a cell runs under IPython's own handler
                                                           # (`%oomguard on`); run.discard() if it fits

`%%oomguard` (magics/guard.py), `%oomguard on` (magics/guard_all.py), the decorator and the `with` block
(api.py) are adapters: they pass options in and read the `GuardResult` out.
"""
from __future__ import annotations

import inspect
import time
from contextlib import ExitStack
from dataclasses import dataclass

from cuda_magic.devices.meter import autocast, capacity_of, metered_devices
from cuda_magic.recover.containers import container_length, container_lengths, reached_names, value_ids
from cuda_magic.recover.failure import (Failure, cell_filename_of, error_text, kind_of, read_counter, read_failure,
                                        release_failure, short_oom_error)
from cuda_magic.recover.report import Attempt, GuardReport, Outcome


@dataclass(frozen=True)
class RetrySpec:
    """`-r VAR [-a VAR2] [--min N] [--search] [--exact]`, checked already."""

    variable: str
    accumulate: str | None = None
    floor: int = 1
    search: bool = False
    exact: bool = False          # with accumulate: only divisors of the effective batch (VAR x VAR2 exact)


@dataclass(frozen=True)
class GuardOptions:
    """How to guard (or predict) a call, checked and parsed by `recover/options.AskedOptions.check`."""

    retry: RetrySpec | None = None
    limit: int | None = None             # the cap in bytes (`-l`), resolved on the meter's capacity
    amp: str | None = None               # 'bf16' / 'fp16': run under torch.autocast
    timeline: bool | None = None         # None: record, shown after an OOM; True: shown always; False: off
    source: str = "%%oomguard"           # what guards: '%%oomguard', '%oomguard on', 'oomguard'
    api: bool = False                    # the Python API: advice speaks of it, not of magics or a kernel
    filename: str | None = None          # the compiled cell, to say which of its lines failed
    lines: tuple[str, ...] | None = None
    timed_lines: tuple[str, ...] | None = None   # a cell that starts with `%%time`: its lines after it,
                                                 # which IPython runs as "<timed exec>"
    rank_timeout: float | None = None    # in a process group: seconds the ranks wait for each other at
                                         # each agreement (None: the group's timeout and a minute)
    shown_by_ipython: bool = False       # `%oomguard on`: IPython shows the error, so its traceback and
                                         # chain are kept (their frames cleared) and IPython's references
                                         # to it (`sys.last_*`, its stored traceback) dropped
    code: object = None                  # the code object the run runs where there are no `lines` (a
                                         # decorated function's, a `with` block's frame's): its names say
                                         # which of the user's containers are watched for growth
    expandable: bool = False             # `--expandable-segments`: switched on first, by the adapter
                                         # (recover/options.switch_expandable_segments) or the prediction


@dataclass
class GuardResult:
    """What a guarded call came to: the report, the call's value, the error to pass through untouched
    (not out of memory), and the last out-of-memory failure."""

    report: GuardReport
    value: object = None
    error: BaseException | None = None
    failure: Failure | None = None

    @property
    def ran_out(self) -> bool:
        """Out of memory, and nothing fitted: the caller raises `short_error()` (or returns)."""
        return self.report.outcome == Outcome.OOM

    def short_error(self):
        """The short out-of-memory error to raise: it holds nothing of the failed run."""
        return short_oom_error(self.report)


@dataclass
class AttemptResult:
    """One run of the call: its attempt record, the call's value, the error to pass through."""

    attempt: Attempt
    value: object = None
    error: BaseException | None = None
    failure: Failure | None = None


def _ignore(*_):
    return None


class GuardedRun:
    """One guarded call on `meter`.

    values: the mapping that holds the retried variables (the user namespace, or the decorated function's
    arguments). namespace: the user namespace, whose bindings an undone attempt restores and whose frames
    a release never clears (None in a script). roots: further objects whose state (modules, optimizers)
    the rollback keeps (a function's arguments and globals). shell: the IPython shell whose names the
    diagnosis looks up (None: `__main__`'s). on_attempt(attempt) / on_note(text): called as each attempt
    ends and as a note comes up, for a live display.
    """

    def __init__(self, meter, options: GuardOptions = GuardOptions(), *, values=None, namespace=None, roots=(),
                 shell=None, on_attempt=None, on_note=None):
        self.meter, self.options = meter, options
        self.values, self.namespace, self.roots, self.shell = values, namespace, roots, shell
        self.on_attempt = on_attempt or _ignore
        self.on_note = on_note or _ignore
        self.on_trying = _ignore        # on_trying(value, accumulation): a retry is about to run at value
        self.report = GuardReport(device=meter.key, limit=options.limit, source=options.source, api=options.api,
                                  timeline_requested=bool(options.timeline))
        self.recording = None           # devices/recording.py: the black box of this run
        self.failure: Failure | None = None
        self.why = ""                   # why the value about to run was chosen (the retry policy's words)
        self._started = self._finished = False
        self._lengths: dict[str, tuple[int, int]] = {}     # containers' (id, length) when the run began
        self._ids: dict[str, int] | None = {}   # the id of each watched name's value when the run began
        self._block = None              # begin() / record(): (start allocated, t0, the entered contexts,
                                        # whether the device's peak counter was reset for the run)
        self._counters_read = True      # the attempts' peaks are the device's counters
        self._before_counters = (None, None)    # record(): allocated and reserved before the cell ran

    # -- a call the core runs -------------------------------------------------------------------------
    def run(self, call) -> GuardResult:
        __tracebackhide__ = True  # noqa: F841
        return run_sync(self.run_async(call))

    async def run_async(self, call) -> GuardResult:
        """`run` for a call that may return an awaitable: IPython awaits this for a cell with `await`."""
        __tracebackhide__ = True  # noqa: F841
        self.start()
        self._remember_names(codes=getattr(call, "codes", ()))     # a compiled cell's code objects
        value = error = None
        try:
            if self.options.retry is None:
                result = await self.attempt(call)
                value, error = result.value, result.error
                self.report.outcome = result.attempt.outcome
            else:
                from cuda_magic.recover.retry_loop import run_retried

                value, error = await run_retried(self, call)   # in a process group: every rank together
        except KeyboardInterrupt:
            self.report.outcome = Outcome.INTERRUPTED
            raise
        finally:
            self._finish()
        if error is not None:
            self.report.exception_text = error_text(error)
        return GuardResult(self.report, value, error, self.failure)

    async def attempt(self, call, value=None, *, undo=None) -> AttemptResult:
        """Run and measure once. On an OOM: copy out what it says, `undo()` (the names the attempt bound),
        then release what the failure held. KeyboardInterrupt is recorded and propagates. A call marked
        `is_async` (a cell with top-level `await`) returns an awaitable, awaited here."""
        __tracebackhide__ = True  # noqa: F841
        meter = self.meter
        start = read_counter(meter.allocated)
        meter.reset_peak()
        t0 = time.perf_counter()
        if self.recording is not None:
            self.recording.begin_attempt(len(self.report.attempts))
        try:
            with meter.running(self.options.limit), autocast(self.options.amp, meter):
                out = call()
                if getattr(call, "is_async", False) and inspect.isawaitable(out):
                    out = await out
        except KeyboardInterrupt:
            self._pause()
            self._record(Attempt(value, Outcome.INTERRUPTED, self._peak(), duration=time.perf_counter() - t0,
                                 start_allocated=start))
            raise
        except Exception as exc:
            attempt, failure = self._caught(exc, value, t0, start)
            if failure is None:
                return AttemptResult(self._record(attempt), error=exc)
            failed = exc
        else:
            self._pause()
            attempt = Attempt(value, Outcome.OK, self._peak(), duration=time.perf_counter() - t0,
                              start_allocated=start)
            return AttemptResult(self._record(attempt), value=out)
        # outside the `except` block: the failed frames have finished and can be cleared
        self._release(failed, failure, attempt, undo=undo)
        del failed
        return AttemptResult(self._record(attempt), failure=failure)

    # -- a block between begin() and end() -----------------------------------------------------------
    def begin(self) -> GuardReport:
        """Start guarding a block that runs after this returns (the `with` form); `end(exc)` after it."""
        self.start()
        self._remember_names()
        meter, stack = self.meter, ExitStack()
        meter.reset_peak()
        start = read_counter(meter.allocated)
        if self.recording is not None:
            self.recording.begin_attempt(0)
        stack.enter_context(meter.running(self.options.limit))
        stack.enter_context(autocast(self.options.amp, meter))
        self._block = (start, time.perf_counter(), stack, True)
        return self.report

    def record(self, source: str = "") -> None:
        """Start the black box of a cell that IPython runs itself (`%oomguard on`; `source`: the cell);
        nothing else is touched (the device's own peak counter is the user's). Then `end(exc)`, or
        `discard()`."""
        self._started = True
        self._remember_names(source)
        if self.options.timeline is not False:
            self.recording = _start_recording(self.meter, None, find_cell=True)
        # the device before the cell: two counters now (cheap for every cell), the rest read at a failure
        reserved = getattr(self.meter, "reserved", None)
        self._before_counters = (read_counter(self.meter.allocated), read_counter(reserved) if reserved else None)
        self._block = (self._before_counters[0], time.perf_counter(), ExitStack(), False)

    def discard(self) -> None:
        """The cell fitted and nobody asked for its report: stop recording, read nothing."""
        recording, self.recording = self.recording, None
        if recording is not None:
            recording.discard()
        self._finished = True

    def end(self, exc: BaseException | None) -> GuardResult:
        """The block or cell ended, with `exc` (None: it fitted). Also for a failure the run saw no begin
        of (`%oomguard on` on another device than the one recorded): the devices are read now."""
        __tracebackhide__ = True  # noqa: F841
        block, self._block = self._block, None
        self._started = True
        if not self.report.before:          # a cell IPython ran: its devices read now, its counters before it
            self.report.before = _as_before(metered_devices(self.meter), self._before_counters)
        start, t0, stack, measured = block if block is not None else (None, time.perf_counter(), ExitStack(), False)
        stack.close()
        self._counters_read = measured
        peak = self._peak() if measured else None
        error = None
        if exc is None:
            self._pause()
            attempt = self._record(Attempt(None, Outcome.OK, peak, duration=time.perf_counter() - t0,
                                           start_allocated=start))
        else:
            attempt, failure = self._caught(exc, None, t0, start, peak=peak)
            if failure is None:             # not out of memory: the caller lets it propagate untouched
                error = exc
                self.report.exception_text = error_text(exc)
            else:
                self._release(exc, failure, attempt)
            self._record(attempt)
        del exc
        self.report.outcome = attempt.outcome
        self._finish()
        return GuardResult(self.report, error=error, failure=self.failure)

    # -- the one path after a failure ------------------------------------------------------------------
    def _caught(self, exc, value, t0, start, *, peak=...) -> tuple[Attempt, Failure | None]:
        """Inside the `except` block, while the failed frames are alive: the attempt's record, and for an
        out-of-memory error what it says (a fatal CUDA error gets its restart note in `kind_of`)."""
        kind = kind_of(exc)
        peak = self._peak() if peak is ... else peak
        duration = time.perf_counter() - t0
        if kind is not Outcome.OOM:
            self._pause()
            return Attempt(value, kind, peak, duration=duration, start_allocated=start), None
        if self.recording is not None:
            self.recording.failed()         # on CUDA: the history now, while the failed tensors are alive
        self._pause()
        options = self.options
        filename = options.filename
        if filename is None and options.shown_by_ipython:
            filename = cell_filename_of(exc.__traceback__)
        failure = read_failure(exc, self.meter, filename=filename, lines=options.lines,
                               progress=options.retry is not None, timed=options.timed_lines)
        return Attempt(value, Outcome.OOM, peak, failure.oom.requested, duration, start,
                       where=failure.point), failure

    def _release(self, exc, failure: Failure, attempt: Attempt, *, undo=None) -> None:
        """Outside the `except` block: what the namespace held at the failure (before the attempt is undone:
        each failure is explained from its own names), then undo the attempt's bindings, free what the
        failure held, and put the failure on the report."""
        self._names_at(failure)
        if undo is not None:
            undo()
        shown = self.options.shown_by_ipython
        attempt.reclaimed = release_failure(exc, failure, self.meter, user_ns=self.namespace, sever=not shown,
                                            shell=self.shell if shown else None,
                                            start_allocated=attempt.start_allocated)
        report = self.report
        report.oom, report.failure, report.by_kind = failure.oom, failure.point, failure.by_kind
        if attempt.reclaimed is not None:
            report.reclaimed[self.meter.key] = attempt.reclaimed     # per clean-up, never summed
        self.failure = failure

    def let_go(self, exc: BaseException) -> None:
        """Free what an error that is not out of memory held (an attempt another rank stopped, or that
        waited in a collective for it): its frames and chain, what a failed backward pass left in the
        autograd engine, then the caches."""
        import gc

        from cuda_magic.recover.release import empty_caches
        from cuda_magic.recover.notebook_refs import drain_autograd, drop_exception

        drop_exception(exc, user_ns=self.namespace, sever=True)
        drain_autograd()
        gc.collect(1)
        empty_caches(self.meter)

    def _names_at(self, failure: Failure) -> None:
        """The names holding memory at the failure, those the failing cell uses (it reads them, or its
        frames hold their modules and optimizers), and the containers that grew during the run."""
        from cuda_magic.ipython import user_variables
        import collections

        from cuda_magic.oom.cell_reading import bound_before_read, names_in
        from cuda_magic.memory.holders import notebook_holders

        variables = user_variables(self.shell)
        failure.holders = tuple(notebook_holders(self.shell))
        used = names_in(failure.source)
        # a name the cell binds before it reads: still its old value (the cell had not got there), which the
        # cell only replaces, so deleting it helps; or a value this run bound, the step's own
        bound = bound_before_read(failure.source) if self._ids is not None else frozenset()
        old = {n for n in bound if n in variables and self._ids.get(n) == id(variables[n])}
        # (a list or set the run made is a collector that can keep every step's graph: not the step's own)
        failure.own = frozenset(n for n in bound if n in variables and n not in old
                                and not isinstance(variables[n], (list, set, collections.deque)))
        failure.in_use = frozenset(n for n, v in variables.items()
                                   if (n in used and n not in old) or id(v) in failure.in_frames)
        failure.ints = tuple((n, v) for n, v in variables.items() if n in used and type(v) is int)
        failure.grown = frozenset(n for n, (ident, length) in self._lengths.items()
                                  if id(variables.get(n)) == ident and container_length(variables[n]) > length)

    def _record(self, attempt: Attempt) -> Attempt:
        attempt.reason = self.why
        self.report.attempts.append(attempt)
        self.on_attempt(attempt)
        return attempt

    def note(self, text: str) -> None:
        """A warning for the report, shown as it comes up too (then the report does not say it again)."""
        self.report.warnings.append(text)
        if self.on_note is not _ignore:
            self.report.said.append(text)
        self.on_note(text)

    def _peak(self) -> int | None:
        return read_counter(self.meter.peak)

    def _pause(self) -> None:
        if self.recording is not None:
            self.recording.pause()      # between attempts and after the end: the clean-up's frees are not the run's

    # -- start and finish ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Read the device before the run, and start its black box. run() and begin() do it where it was
        not done; a caller that shows the run while it goes calls it first."""
        if self._started:
            return
        self._started = True
        self.report.before = metered_devices(self.meter)
        limit = self.options.limit
        capacity = capacity_of(self.meter) if limit is not None else None   # reading it may start CUDA
        if capacity is not None and limit > capacity:
            from cuda_magic.units import format_bytes

            self.note(f"the cap {format_bytes(limit)} is above the device's capacity ({format_bytes(capacity)}): "
                      "the capacity is the limit")
        held = sum((d.torch_allocated or 0) for d in self.report.before if d.key == self.meter.key)
        if (limit is not None and held and self.meter.key.startswith(("cuda", "sim"))
                and not getattr(self.meter, "temporary", False)):
            from cuda_magic.units import format_bytes

            # with the report, not as it comes up: the run's own lines lead
            self.report.warnings.append(
                f"the cap {format_bytes(limit)} bounds everything PyTorch reserves on {self.meter.key}: the "
                f"{format_bytes(held)} held before the run counts against it, and the allocator's cache was "
                "emptied first (torch checks the cap only when it reserves memory, not when its cache serves "
                "a request)")
        if self.options.timeline is not False:
            self.recording = _start_recording(self.meter, self.options.filename)

    def _remember_names(self, source: str = "", codes=()) -> None:
        """Right before the run: the lengths of the containers it may grow and the values its names hold."""
        names = self._watched_names(source, tuple(codes))
        self._lengths = container_lengths(self.shell, names)
        self._ids = value_ids(self.shell, names)

    def _watched_names(self, source: str = "", codes: tuple = ()):
        """The names whose containers are watched for growth: those the run's code reaches (None where its
        code is not known: every user name). The compiled code's names where it is given (no parse of the
        source), else the source's."""
        options = self.options
        if options.code is not None:
            codes += (options.code,)
        if codes:
            source = ""
        elif options.lines is not None:
            source = "\n".join(options.lines)
        if not source and not codes:
            return None
        namespace = self.shell.user_ns if self.shell is not None else {}
        return reached_names(namespace, source, codes)

    def _finish(self) -> None:
        """The end of the run: the black box's record, the device after, the peak, and after an OOM the
        diagnosis with the names that still hold memory. Once."""
        if self._finished:
            return
        self._finished = True
        report = self.report
        recording, self.recording = self.recording, None
        if recording is not None:
            self._blackbox(recording)
        report.after = metered_devices(self.meter)
        box = report.blackbox
        if not self._counters_read and box is not None and box.points:
            for attempt in report.attempts:     # a cell IPython ran: the recording's peak is its own (the
                attempt.peak = box.peak         # device's counter was not reset for it)
        peaks = [a.peak for a in report.attempts if a.peak is not None]
        report.peaks[self.meter.key] = max(peaks) if peaks else None
        if report.oom is not None:
            report.diagnosis = self._diagnose()

    def _blackbox(self, recording) -> None:
        from cuda_magic.memory.blackbox import BlackBox, blackbox_from

        report, meter, limit = self.report, self.meter, self.options.limit
        recorder = recording.stop()
        if recorder is None:            # (no capacity asked: on an unused GPU that would start CUDA)
            report.blackbox = BlackBox(device=meter.key, notes=recording.notes)
            return
        failed = any(a.outcome == Outcome.OOM for a in report.attempts)
        lines = list(self.options.lines) if self.options.lines is not None else None
        report.blackbox = blackbox_from(recorder, device=meter.key, capacity=limit or capacity_of(meter),
                                        limited=limit is not None, lines=lines, failed=failed,
                                        timed=self.options.timed_lines)

    def _diagnose(self):
        """The last failure's diagnosis, from what was true at that failure: its names, its frames, its
        black box (never what a later attempt or the retry's measuring left)."""
        from cuda_magic.devices.allocator_conf import current_allocator_conf
        from cuda_magic.oom.cell_reading import batch_names
        from cuda_magic.oom.diagnosis import CellFacts, diagnose, tensor_request
        from cuda_magic.memory.holders import notebook_holders

        report, failure = self.report, self.failure
        box = report.blackbox
        failed = box.failure if box is not None else None
        top = box.top if box is not None and box.at == "failure" else None
        holders = (failure.holders if failure is not None and failure.holders is not None
                   else notebook_holders(self.shell))
        start = report.attempts[-1].start_allocated if report.attempts else None
        batch_var, accum_var = report.variable, report.accumulate
        if batch_var is None and failure is not None:     # the cell's own names, for a line to paste
            batch_var, guessed_accum = batch_names(dict(failure.ints), failure.point.text if failure.point else "",
                                                   failure.source)
            accum_var = accum_var or guessed_accum
        facts = CellFacts(
            holders=tuple(holders), amp=self.options.amp is not None,
            device_capacity=capacity_of(self.meter), peak=report.peaks.get(self.meter.key),
            alloc_conf=current_allocator_conf(), limit=report.limit, batch_var=batch_var,
            accum_var=accum_var, api=report.api,
            inference=failed is not None and failed.grad_enabled is False,
            retried=report.outcome == Outcome.RECOVERED,
            top_line=(top.bytes, top.code, top.where) if top is not None and top.code else None,
            cell=_cell_reading(failure),
            in_use=failure.in_use if failure is not None else frozenset(),
            own=failure.own if failure is not None else frozenset(),
            grown=failure.grown if failure is not None else frozenset(),
            by_kind=dict(failure.by_kind or {}) if failure is not None else {},
            held_at_start=start, independent=report.retry is not None and report.retry.independent,
            backward=failed is not None and failed.phase == "backward",
            tensor_requested=tensor_request(report.oom, failed.requested if failed is not None else None))
        return diagnose(report.oom, facts)


def _as_before(devices: list, counters) -> list:
    """The device as it was before a cell IPython ran (`%oomguard on`), from its reading at the failure and
    the allocated and reserved counters read before the cell: what the cell allocated and cached is not
    'before' (the folded table showed 91.75 MiB before a cell that started from 3.36 MiB)."""
    import dataclasses

    allocated, reserved = counters
    if allocated is None:
        return devices
    out = []
    for d in devices:
        changes = {"torch_allocated": allocated}
        if reserved is not None and reserved >= allocated:
            changes["torch_cached"] = reserved - allocated
            if None not in (d.free, d.torch_allocated, d.torch_cached):
                changes["free"] = max(0, d.free + d.torch_allocated + d.torch_cached - reserved)
        out.append(dataclasses.replace(d, **changes, peak=None))
    return out


def _start_recording(meter, filename: str | None, *, find_cell: bool = False):
    """The black box of one run on the meter's device (devices/recording.py), started."""
    from cuda_magic.devices.recording import Recording

    recording = Recording(meter, cell_filename=filename, find_cell=find_cell)
    recording.start()
    return recording


def run_sync(coroutine):
    """Run a coroutine that never suspends (a call without `await`) to its end: what IPython's own
    pseudo-sync runner does."""
    __tracebackhide__ = True  # noqa: F841
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return stop.value
    coroutine.close()
    raise RuntimeError("the guarded call awaited something; run it with `await run.run_async(...)`")


def _cell_reading(failure):
    """What the failing code does already: its own source, and a training step of a library on its
    stack (a `trainer.train()` cell trains though its source shows no backward pass)."""
    import dataclasses

    from cuda_magic.oom.cell_reading import read_cell

    if failure is None:
        return read_cell("")
    reading = read_cell(failure.source)
    tokens = dict(failure.ints).get(reading.new_tokens_name) if reading.new_tokens_name else None
    if type(tokens) is int:                 # `max_new_tokens=n`: n's value when it failed
        reading = dataclasses.replace(reading, new_tokens=tokens)
    if failure.trains or failure.trainer is not None:
        reading = dataclasses.replace(reading, backward=reading.backward or failure.trains, trainer=failure.trainer)
    return reading
