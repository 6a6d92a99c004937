"""The steps of the one path after an out-of-memory error, taken by the guarded run (recover/guarded.py)
and by nothing else:

1. `read_failure`: inside the `except` block, copy what the failure says into plain values (the parsed
   message, the cell's failing line, the meter's counters at the failure, its tensors by kind);
2. `release_failure`: outside it, clear the frames of the exception and everything chained to it, drop
   the notebook's references to it where asked, collect garbage, empty the allocator cache, and measure
   what the device got back.

The meter is the device that ran out (`meter_for_failure` picks it from the message where the caller
did not choose one), so "before", "after" and "reclaimed" all speak of the same device.
"""
from __future__ import annotations

import gc
import sys
from dataclasses import dataclass

from cuda_magic.devices.meter import capacity_of
from cuda_magic.devices.errors import oom_kind
from cuda_magic.oom.messages import FATAL_NOTE, attach_note, oom_fields
from cuda_magic.memory.kinds import IN_FAILING_OP
from cuda_magic.oom.findings import OomFields
from cuda_magic.paths import is_library_file, is_torch_or_python_file
from cuda_magic.recover.release import empty_caches
from cuda_magic.recover.notebook_refs import drain_autograd, drop_exception, drop_exception_refs
from cuda_magic.recover.report import FailurePoint, GuardReport, Outcome


@dataclass
class Failure:
    """What an out-of-memory error said, copied out of it: holds no frame and no tensor (but `replay`, the
    model and its input, which a retry takes out at once)."""

    oom: OomFields
    point: FailurePoint | None
    allocated: int | None          # allocated on the meter's device when it failed
    reserved: int | None           # reserved then: what a clean-up gives back is measured against it
    by_kind: dict[str, int] | None = None   # the device's tensors by kind then (memory.kinds)
    progress: object = None        # where in the model's forward pass it failed (recover.progress.Progress)
    replay: object = None          # what to measure the model with (recover.replay.Replay): holds the
                                   # model's input, so the retry takes it and drops it once measured
    in_frames: frozenset = frozenset()   # ids of the modules and optimizers the failing frames held
    source: str = ""               # the user's code the failing frames ran (the cell, its functions)
    trains: bool = False           # a library function on the failing stack (a Trainer's training step,
                                   # Lightning's closure) runs a backward pass or an optimizer step
    trainer: object = None         # a transformers Trainer's settings (oom.cell_reading.TrainerSettings)
    holders: tuple | None = None   # the names that held memory then (memory.holders.Holder), before undoing
    in_use: frozenset = frozenset()      # the namespace's names the failing cell used
    grown: frozenset = frozenset()       # the namespace's containers that grew during the run
    ints: tuple = ()               # (name, value) of the integer names the failing cell reads: its batch
    own: frozenset = frozenset()         # the names the failing run bound itself (`out = model(x)`): the
                                         # step's own values, part of its working set, never a leak


def kind_of(exc: BaseException) -> Outcome:
    """OOM for an out-of-memory error (also cuDNN's possible one), INTERRUPTED for Ctrl-C, else ERROR.
    A fatal CUDA error gets the note that, unlike an OOM, it needs a kernel restart."""
    if isinstance(exc, KeyboardInterrupt):
        return Outcome.INTERRUPTED
    kind = oom_kind(exc)
    if kind in ("oom", "possible"):
        return Outcome.OOM
    if kind == "fatal":
        add_fatal_note(exc)
    return Outcome.ERROR


def add_fatal_note(exc: BaseException) -> None:
    notes = getattr(exc, "__notes__", None) or []
    if FATAL_NOTE not in notes:
        attach_note(exc, FATAL_NOTE)     # printed on Python 3.10, which has no notes


def error_text(exc: BaseException) -> str:
    """`Type: message` of an error, for a report (its first line)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


TIMED = "<timed exec>"                # what IPython's %%time compiles its cell's body as


def failure_point(tb, filename: str | None, lines: list[str] | None,
                  timed: tuple | None = None) -> FailurePoint | None:
    """Where a run failed: the deepest line of the cell itself, and the function it was in, if deeper.
    `timed`: a cell that starts with `%%time`, whose lines after it run as "<timed exec>": its line k is
    the cell's line k + 1."""
    cell_line = None
    deepest = None
    if timed is not None:
        lines = ["%%time", *timed]
    while tb is not None:
        code = tb.tb_frame.f_code
        if filename is not None and code.co_filename == filename:
            cell_line = tb.tb_lineno
        elif timed is not None and code.co_filename == TIMED:
            cell_line = tb.tb_lineno + 1
            tb = tb.tb_next
            continue
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


def read_failure(exc: BaseException, meter, *, filename: str | None = None,
                 lines: list[str] | None = None, progress: bool = False, timed: tuple | None = None) -> Failure:
    """Step 1, inside the `except` block: plain values only (the failed run's tensors are still alive: what
    they are, by kind, is counted now). `progress`: also how far through the model's forward pass it came
    (for a retry's prediction)."""
    from cuda_magic.recover.replay import read_model_calls

    now = read_counter(meter.allocated)
    where, replay = read_model_calls(exc.__traceback__) if progress else (None, None)
    fields = oom_fields(exc) or OomFields()
    by_kind = kinds_at_failure(meter, now)
    # allocated when it ran out is the message's figure: by the time the error reaches the guard, the failed
    # operation's intermediate results are gone (what it needed is at least that plus the request)
    told = fields.allocated_by_torch
    allocated = now
    if meter.key != "cpu" and told is not None and now is not None and told > now:
        by_kind[IN_FAILING_OP] = told - now
        allocated = told
    in_frames, source, trains, trainer = frames_facts(exc.__traceback__, lines)
    point = failure_point(exc.__traceback__, filename, lines, timed)
    if replay is not None and point is not None and hasattr(replay, "keep_output"):
        from cuda_magic.recover.replay import output_kept

        replay.keep_output = output_kept(point.text)
    return Failure(oom=fields, point=point, allocated=allocated,
                   reserved=read_counter(meter.reserved), by_kind=by_kind, progress=where, replay=replay,
                   in_frames=in_frames, source=source, trains=trains, trainer=trainer)


def frames_facts(tb, lines: list[str] | None) -> tuple[frozenset, str, bool, object]:
    """(ids of the modules and optimizers the failing frames hold, the source of the user's code they
    ran: the cell's lines and the functions of the user's own files, whether a library function on the
    stack trains, the settings of a transformers Trainer running it (recover.trainers), or None), read
    while the frames are alive. A cell of `trainer.train()` shows no backward pass
    in its own source; the Trainer's training step on the stack does (torch's own functions are left
    out: its module call and hooks name backward without running one)."""
    import inspect
    import linecache

    from cuda_magic.oom.cell_reading import read_cell
    from cuda_magic.recover.trainers import trainer_settings

    torch = sys.modules.get("torch")
    held_types = (torch.nn.Module, torch.optim.Optimizer) if torch is not None else ()
    ids: set[int] = set()
    sources: list[str] = ["\n".join(lines)] if lines else []
    seen_code = set()
    trains, trainer = False, None
    while tb is not None:
        frame = tb.tb_frame
        code = frame.f_code
        if held_types:
            for value in list(frame.f_locals.values()) if frame.f_locals is not frame.f_globals else ():
                if issubclass(type(value), held_types):
                    ids.add(id(value))
        if code not in seen_code and not is_library_file(code.co_filename):
            seen_code.add(code)
            try:
                text = "".join(linecache.getlines(code.co_filename)) if code.co_name.startswith("<") \
                    else inspect.getsource(code)
            except (OSError, TypeError):
                text = ""
            sources.append(text)
        elif not is_torch_or_python_file(code.co_filename):
            if trainer is None and "self" in code.co_varnames[:1]:
                trainer = trainer_settings(frame.f_locals.get("self"))
            if code not in seen_code and not trains:
                seen_code.add(code)
                try:
                    reading = read_cell(inspect.getsource(code))
                except (OSError, TypeError, SyntaxError, IndentationError):
                    reading = None
                trains = reading is not None and (reading.backward or reading.steps)
        tb = tb.tb_next
    return frozenset(ids), "\n".join(sources), trains or trainer is not None, trainer


def kinds_at_failure(meter, allocated: int | None) -> dict[str, int]:
    """The metered device's tensors by kind (parameters, gradients, optimizer state, activations, other)."""
    from cuda_magic.devices.meter import SimMeter
    from cuda_magic.memory.capture import kinds_on

    simulated = meter.device if isinstance(meter, SimMeter) else None
    return kinds_on(meter.key, allocated=allocated if meter.key != "cpu" else None, simulated=simulated)


def release_failure(exc: BaseException, failure: Failure, meter, *, user_ns=None, sever: bool = True,
                    shell=None, start_allocated: int | None = None) -> int | None:
    """Step 2, outside the `except` block: free what the failed run held. `sever` also cuts the
    exception's traceback and chain (not when IPython still shows it, as under `%oomguard on`); `shell`
    also drops IPython's and `sys.last_*` references to the last error. Returns the bytes the device got
    back (reserved at the failure less reserved now, at most the capacity), None where not measurable.

    With the failed frames cleared and the exception cut loose, what only they held is freed by reference
    counting; what sits in reference cycles needs the collector. The young generations are collected
    always (a millisecond); the whole heap (about 0.1 s in a notebook) only where the device still holds
    more than when the run started (`start_allocated`; unknown: always), which is where a cycle can still
    hold what the run made."""
    drop_exception(exc, user_ns=user_ns, sever=sever)
    if shell is not None:
        drop_exception_refs(shell)
    drain_autograd()
    gc.collect(1)
    now = read_counter(meter.allocated)
    if start_allocated is None or now is None or now > start_allocated:
        gc.collect()
    empty_caches(meter)
    after = read_counter(meter.reserved)
    if failure.reserved is None or after is None:
        return None
    reclaimed = max(0, failure.reserved - after)
    capacity = capacity_of(meter)
    return min(reclaimed, capacity) if capacity else reclaimed


def meter_for_failure(fields: OomFields):
    """The meter of the device an OOM message names (the first GPU, or the CPU, where it names none)."""
    from cuda_magic.devices.meter import choose_meter

    device = fields.device
    try:
        meter, _ = choose_meter(device)
    except (ValueError, RuntimeError, AssertionError):
        meter, _ = choose_meter()
    return meter


def cell_filename_of(tb) -> str | None:
    """The filename IPython compiled the failing cell under: the first frame of the traceback that is a
    cell (`%oomguard on` learns it only from the failure)."""
    from cuda_magic.paths import is_cell_file

    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if is_cell_file(name):
            return name
        tb = tb.tb_next
    return None


def read_counter(counter) -> int | None:
    """A meter reading, None where the backend cannot give it now."""
    try:
        return counter()
    except (AssertionError, RuntimeError, OSError):
        return None


def short_oom_error(report: GuardReport):
    """The short error raised after an OOM: holds no frames of the failed run, and no context."""
    from cuda_magic.units import format_bytes

    cls = short_error_class()
    reclaimed = sum(report.reclaimed.values())
    what = f"{report.variable}={report.attempts[-1].value}: " if report.variable and report.attempts else ""
    where = "call" if report.api else "cell"
    keep_going = "" if report.api else ", the kernel can keep going"
    ranks = report.ranks
    if ranks is not None and ranks.attempts:    # in a process group: the same words on every rank (recover/ranks.py)
        failed = [str(r) for r in ranks.failed()]
        return cls(f"{what}out of memory in this {ranks.what or where} on rank{'s' if len(failed) > 1 else ''} "
                   f"{', '.join(failed)} of {len(ranks[-1])}: every rank stopped it (explained in rank 0's report)")
    return cls(f"{what}out of memory in this {where} (explained above; {format_bytes(reclaimed)} "
               f"reclaimed{keep_going})")


FREED_TB_NOTE = ("(the failed run's frames were freed to give the memory back: there is no traceback to "
                 "show or debug; run the cell without the guard to step through it)")
_short_cls = None


def short_error_class():
    global _short_cls
    if _short_cls is None:
        from cuda_magic.devices.errors import oom_error_class

        class OutOfMemoryError(oom_error_class()):
            """Raised by `%%oomguard` after an out-of-memory error it cleaned up: holds nothing.
            A subclass of torch.OutOfMemoryError, so `except torch.OutOfMemoryError` still catches it."""

            frames_freed = True     # %debug and %tb say so (magics/freed.py)

            def _render_traceback_(self):
                lines = [f"OutOfMemoryError: {self}"]
                shown = getattr(self, "_shown", 0)
                self._shown = shown + 1
                if shown:           # shown again: %tb
                    lines.append(FREED_TB_NOTE)
                return lines

        OutOfMemoryError.__module__ = "cuda_magic"
        OutOfMemoryError.__qualname__ = "OutOfMemoryError"
        _short_cls = OutOfMemoryError
    return _short_cls
