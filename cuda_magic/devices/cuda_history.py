"""The black box on CUDA: torch's allocator history, replayed into a `blackbox.Recorder`.

While a guarded run executes, `torch.cuda.memory._record_memory_history(enabled="all", context="alloc",
stacks="python", max_entries=...)` makes the caching allocator keep a ring of alloc / free entries with
the Python frames of each allocation (never `stacks="all"`: C++ frames make a snapshot take minutes).
On an out-of-memory error the allocator records an `oom` entry before it raises, and calls the observers
attached with `torch._C._cuda_attach_out_of_memory_observer` before the error unwinds: there the history
is read with `torch.cuda.memory._snapshot()`, so the frees of the unwinding come after the `oom` entry.
An observer cannot be detached: it is attached once per process, and the `_active` history decides
whether it does anything.

The user's own recording is left as it was: when history was already on, it is read and kept on (its
settings untouched); otherwise it is switched on for the run and off afterwards.

Versions: the string form of `_record_memory_history` (enabled / context / stacks / max_entries), the
trace entries' `frames`, `_snapshot()` and the OOM observer are in torch 2.1 and later (torch 2.0 had
only the boolean form); `torch._C._cuda_isHistoryEnabled` and the entries' `time_us` are checked for
where used. A torch without them gets a one-line note and the rest of the report.
"""
from __future__ import annotations

import inspect
import time

from cuda_magic.devices.recorder import Recorder, grad_mode

MAX_ENTRIES = 100_000                 # torch keeps the newest entries past this (several KB each)
NOTE_UNAVAILABLE = ("no black box on CUDA: this torch has no allocator history with Python stacks "
                    "(torch.cuda.memory._record_memory_history(stacks=...), torch 2.1 and later)")

NOTE_NOT_STARTED = ("no black box for this run: torch had not used the GPU yet when it started (recording "
                    "would have started CUDA); run the cell again to record it")

_observer_attached = False
_active: CudaHistory | None = None


def history_support(torch) -> str | None:
    """None where this torch can record the allocator history with Python stacks; else a one-line note."""
    memory = getattr(getattr(torch, "cuda", None), "memory", None)
    record = getattr(memory, "_record_memory_history", None)
    if record is None or getattr(memory, "_snapshot", None) is None:
        return NOTE_UNAVAILABLE
    if not hasattr(getattr(torch, "_C", None), "_cuda_record_memory_history"):   # a CPU build
        return NOTE_UNAVAILABLE
    try:
        params = inspect.signature(record).parameters
    except (TypeError, ValueError):
        return NOTE_UNAVAILABLE
    if "stacks" not in params and "max_entries" not in params:
        return NOTE_UNAVAILABLE
    return None


def _on_oom(device, alloc, device_alloc, device_free) -> None:
    """torch's OOM observer: called by the allocator before the error is raised. Never raises."""
    history = _active
    if history is None or history.snapshot is not None:
        return
    try:
        if device == history.index:
            history.grad_enabled = grad_mode()
            history.snapshot = history.torch.cuda.memory._snapshot()
    except Exception as exc:  # an observer that raises would replace the user's OutOfMemoryError
        history.notes.append(f"could not read the allocator history at the failure ({type(exc).__name__})")


def _attach_observer(torch) -> bool:
    global _observer_attached
    if not _observer_attached:
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is None:
            return False
        attach(_on_oom)
        _observer_attached = True
    return True


class CudaHistory:
    """The allocator history of one CUDA device around a guarded run: start(), begin_attempt(n) for each
    attempt, stop(), then `recorder` holds the replayed events."""

    def __init__(self, torch, index: int, *, cell_filename: str | None = None, max_entries: int = MAX_ENTRIES,
                 find_cell: bool = False):
        self.torch = torch
        self.index = index
        self.cell_filename = cell_filename
        self.find_cell = find_cell
        self.max_entries = max_entries
        self.snapshot: dict | None = None
        self.grad_enabled: bool | None = None     # read in the failing thread by the OOM observer
        self.notes: list[str] = []
        self.user_recording = False
        self.started = False
        self.start_allocated = 0
        self.start_us = 0.0
        self.attempt_starts: list[tuple[float, int]] = []   # (epoch µs, attempt number)
        self.recorder: Recorder | None = None
        self.previous: CudaHistory | None = None

    def start(self) -> bool:
        global _active
        note = history_support(self.torch)
        if note is not None:
            self.notes.append(note)
            return False
        if not self.torch.cuda.is_initialized():       # never start CUDA (and its context) for this
            self.notes.append(NOTE_NOT_STARTED)
            return False
        memory = self.torch.cuda.memory
        enabled = getattr(self.torch._C, "_cuda_isHistoryEnabled", None)
        self.user_recording = bool(enabled()) if enabled is not None else False
        if not self.user_recording:
            memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                          max_entries=self.max_entries)
        self.start_allocated = int(self.torch.cuda.memory_allocated(self.index))
        self.start_us = time.time() * 1e6
        if not _attach_observer(self.torch):
            self.notes.append("this torch has no OOM observer: the history is read after the error unwound")
        self.snapshot = None
        self.previous, _active = _active, self     # a guarded run inside a `%oomguard on` cell: nested
        self.started = True
        return True

    def begin_attempt(self, number: int) -> None:
        self.attempt_starts.append((time.time() * 1e6, number))
        self.snapshot = None if number else self.snapshot

    def take(self) -> None:
        """Read the history now, if the observer has not already (an OOM caught after it unwound)."""
        if self.started and self.snapshot is None:
            self.grad_enabled = grad_mode()
            try:
                self.snapshot = self.torch.cuda.memory._snapshot()
            except Exception as exc:
                self.notes.append(f"could not read the allocator history ({type(exc).__name__}: {exc})")

    def stop(self) -> Recorder | None:
        """Stop recording (unless the user was), and replay what was recorded."""
        if not self.started:
            return None
        self.take()
        self._switch_off()
        if self.snapshot is not None:
            self.recorder = replay(self.snapshot, self.index, cell_filename=self.cell_filename,
                                   find_cell=self.find_cell,
                                   start_allocated=self.start_allocated, start_us=self.start_us,
                                   attempt_starts=self.attempt_starts, grad_enabled=self.grad_enabled)
            self.recorder.notes.extend(self.notes)
        self.snapshot = None       # the snapshot holds frames of every allocation: let it go
        return self.recorder

    def discard(self) -> None:
        """Stop recording without reading the history (the run fitted and nobody asked to see it)."""
        if self.started:
            self._switch_off()
        self.snapshot = None

    def _switch_off(self) -> None:
        global _active
        if _active is self:
            _active = self.previous
        self.started = False
        if not self.user_recording:
            try:
                self.torch.cuda.memory._record_memory_history(enabled=None)
            except Exception as exc:
                self.notes.append(f"could not switch the allocator history off ({type(exc).__name__})")


def replay(snapshot: dict, index: int, *, cell_filename: str | None = None, start_allocated: int = 0,
           start_us: float | None = None, attempt_starts=(), grad_enabled: bool | None = None,
           find_cell: bool = False) -> Recorder:
    """A Recorder filled from a `torch.cuda.memory._snapshot()` dict: the run's `alloc` and
    `free_completed` entries (those at or after `start_us`, where entries carry `time_us`), the `oom`
    entries, and what was allocated before the run (`start_allocated`) as one starting block."""
    traces = snapshot.get("device_traces") or []
    entries = traces[index] if index < len(traces) else []
    timed = bool(entries) and all("time_us" in e for e in entries)
    if timed and start_us is not None:
        entries = [e for e in entries if e["time_us"] >= start_us]
    t0 = entries[0]["time_us"] if timed and entries else 0.0
    starts = sorted(attempt_starts)
    recorder = Recorder(cell_filename=cell_filename, clock=lambda: 0.0, find_cell=find_cell)
    before_key = -1
    recorder.seed({before_key: start_allocated} if start_allocated else {}, start_allocated)
    allocated = start_allocated
    if not timed:
        recorder.notes.append("this torch's history has no times: events are spaced evenly")
    for n, entry in enumerate(entries):
        seconds = (entry["time_us"] - t0) / 1e6 if timed else float(n)
        if timed and starts:
            attempt = 0
            for at, number in starts:
                if entry["time_us"] >= at:
                    attempt = number
            if attempt != recorder.attempt:
                recorder.attempt = attempt
        action = entry.get("action")
        size = int(entry.get("size") or 0)
        if action == "alloc":
            allocated += size
            site = recorder.site_of_frames(entry.get("frames"))
            recorder.alloc(("block", entry.get("addr")), size, allocated, site=site, seconds=seconds)
        elif action == "free_completed":
            key = ("block", entry.get("addr"))
            allocated -= size
            if key in recorder.alive:
                recorder.free(key, allocated, seconds=seconds)
            elif before_key in recorder.alive:         # a block made before the run
                held = recorder.alive[before_key][0]
                recorder.resize(before_key, max(0, held - size), allocated)
        elif action == "oom":
            site = recorder.site_of_frames(entry.get("frames"))
            recorder.oom(size, allocated, site=site, seconds=seconds, grad_enabled=grad_enabled)
    return recorder
