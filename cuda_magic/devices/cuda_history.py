"""The black box on CUDA: torch's allocator history, read into a `recorder.Recorder`.

While a guarded run executes, `torch.cuda.memory._record_memory_history(enabled="all", context="alloc",
stacks="python", max_entries=...)` makes the caching allocator keep a ring of trace entries with the
Python frames gathered in the allocating thread, and each live block with the frames that made it
(never `stacks="all"`: C++ frames make a snapshot take minutes; a user's own recording, kept on, may
be `stacks="all"`, torch's default, whose C++ frames `Recorder.site_of_frames` skips). What torch does, as its sources say
(c10/cuda/CUDACachingAllocator.cpp and torch/cuda/memory.py, torch 2.2 to 2.13), and what follows here:

- an `alloc` entry carries the size asked for; `memory_allocated` counts the block's size: at least
  512 B, rounded up to 512 B, more where a cached block is not split. The live blocks of the snapshot's
  `segments` carry both (`size`, `requested_size`); a freed block's size is estimated from its request.
  The black box shows block sizes, what `memory_allocated` counts.
- `memory_allocated` drops when a block is freed (`free_requested`), not when other streams are done
  with it (`free_completed`).
- the ring keeps the newest `max_entries` entries. The allocated level is therefore anchored at the
  moment the history is read (`memory_allocated` then, exact) and replayed backwards, and what was alive
  at the failure is the allocator's live blocks with their own frames, plus those freed while the error
  unwound: exact whatever the ring dropped.
- an out-of-memory error records an `oom` entry and calls the observers attached with
  `torch._C._cuda_attach_out_of_memory_observer` in the thread that allocates, before it raises. For a
  backward pass that is autograd's device thread, where grad mode is off and no Python frame is
  gathered: the observer reads the run's own thread instead (blocked in `.backward()`). Code that
  catches the error and goes on (cuDNN's algorithm and workspace fallbacks in
  aten/src/ATen/native/cudnn/Conv_v8.cpp) records more of them: the failure is the last, and the history
  is read when the error reaches the guard (its frames still alive), never frozen at the first.
- with `backend:cudaMallocAsync` (or a pluggable allocator) torch refuses the history, the observer
  and the snapshot with a RuntimeError (c10/cuda/CUDAMallocAsyncAllocator.cpp): the run goes on without
  a black box, and says so in one line.

An observer cannot be detached: it is attached once per process, and the `_active` history decides
whether it does anything. The user's own recording is left as it was: when history was already on, it
is read and kept on (its settings untouched); otherwise it is switched on for the run and off after.

Versions: the string form of `_record_memory_history` (enabled / context / stacks / max_entries), the
entries' `frames`, `_snapshot()` and the OOM observer are in torch 2.1 and later (2.0 had only the
boolean form); `torch._C._cuda_isHistoryEnabled`, `get_allocator_backend` and the entries' `time_us`
are checked for where used. A torch without them gets a one-line note and the rest of the report.
"""
from __future__ import annotations

import inspect
import sys
import threading
import time
from dataclasses import dataclass

from cuda_magic.devices.recorder import BEFORE, Recorder, grad_mode

MAX_ENTRIES = 100_000                 # torch keeps the newest entries past this (several KB each)
MIN_BLOCK = 512                       # kMinBlockSize in CUDACachingAllocator.cpp
NOTE_UNAVAILABLE = ("no black box on CUDA: this torch has no allocator history with Python stacks "
                    "(torch.cuda.memory._record_memory_history(stacks=...), torch 2.1 and later)")
NOTE_NOT_STARTED = ("no black box for this run: torch had not used the GPU yet when it started (recording "
                    "would have started CUDA); run the cell again to record it")
NOTE_BACKEND = ("no black box: the {backend} allocator backend keeps no history (torch records one for its "
                "native caching allocator only)")
BACKWARD_CALLS = {"backward", "_engine_run_backward", "run_backward", "grad"}

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
    backend = allocator_backend(torch)
    if backend != "native":
        return NOTE_BACKEND.format(backend=backend)
    return None


def allocator_backend(torch) -> str:
    """torch's allocator backend ('native', 'cudaMallocAsync', a pluggable allocator's name), read
    without starting CUDA; 'native' where torch cannot say (it has no other before 2.0)."""
    getter = getattr(getattr(torch, "cuda", None), "get_allocator_backend", None)
    if getter is None:
        getter = getattr(getattr(torch, "_C", None), "_cuda_getAllocatorBackend", None)
    try:
        return str(getter()) if getter is not None else "native"
    except RuntimeError:
        return "native"


def block_size(requested: int) -> int:
    """The block the allocator gives a request at least: 512 B, rounded up to 512 B (round_size)."""
    return max(MIN_BLOCK, -(-int(requested) // MIN_BLOCK) * MIN_BLOCK)


@dataclass
class OomSeen:
    """What the observer saw of one out-of-memory error, in the thread that allocated."""

    time_us: float
    grad_enabled: bool | None
    thread: str                      # 'run': the run's own thread; 'backward'; 'other'
    run_frames: list | None = None   # the run's thread's frames then, innermost first, as torch's dicts


def frames_of(frame) -> list[dict]:
    """A live frame and its callers as torch writes frames: dicts of filename, line, name, innermost first."""
    out = []
    while frame is not None:
        out.append({"filename": frame.f_code.co_filename, "line": frame.f_lineno, "name": frame.f_code.co_name})
        frame = frame.f_back
    return out


def in_backward(frames) -> bool:
    return any(f["name"] in BACKWARD_CALLS and "autograd" in f["filename"].replace("\\", "/").split("/torch/")[-1]
               for f in frames or ())


def _on_oom(device, alloc, device_total, device_free) -> None:
    """torch's OOM observer: called by the allocator, in the allocating thread, before the error is raised.
    Never raises: an observer that raised would replace the user's OutOfMemoryError."""
    history = _active
    if history is None or device != history.index:
        return
    try:
        if threading.get_ident() == history.thread:
            # the run's own thread can be in a backward pass too (torch.autograd.backward's _make_grads, a
            # CPU part of the graph, a backward the engine runs here): its Python frames say so
            backward = in_backward(frames_of(sys._getframe()))
            seen = OomSeen(time.time() * 1e6, True if backward else grad_mode(), "backward" if backward else "run")
        else:
            run_frames = frames_of(sys._current_frames().get(history.thread))
            backward = in_backward(run_frames)
            seen = OomSeen(time.time() * 1e6, True if backward else None, "backward" if backward else "other",
                           run_frames)
        history.seen.append(seen)
    except Exception as exc:  # noqa: BLE001 - see above; the report says what is missing
        history.notes.append(f"could not read the out-of-memory error's thread ({type(exc).__name__})")


def _attach_observer(torch) -> bool:
    global _observer_attached
    if not _observer_attached:
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is None:
            return False
        attach(_on_oom)
        _observer_attached = True
    return True


@dataclass
class Reading:
    """The history read at one moment: the snapshot, memory_allocated then, and when (epoch µs)."""

    snapshot: dict
    allocated: int
    at_us: float


class CudaHistory:
    """The allocator history of one CUDA device around a guarded run: start(), begin_attempt(n) for each
    attempt, failed() inside the `except` block of an OOM, stop(), then `recorder` holds the replay."""

    def __init__(self, torch, index: int, *, cell_filename: str | None = None, max_entries: int = MAX_ENTRIES,
                 find_cell: bool = False):
        self.torch = torch
        self.index = index
        self.cell_filename = cell_filename
        self.find_cell = find_cell
        self.max_entries = max_entries
        self.thread = threading.get_ident()
        self.seen: list[OomSeen] = []                  # the observer's, one per OOM of the run
        self.at_failure: Reading | None = None         # read when the last failure reached the guard
        self.notes: list[str] = []
        self.user_recording = False
        self.switched_on = False                       # this run switched the history on (and switches it off)
        self.started = False
        self.start_allocated = 0
        self.start_us = 0.0
        self.attempt_starts: list[tuple[float, int]] = []   # (epoch µs, attempt number)
        self.pauses: list[float] = []                       # epoch µs: between attempts, after the end
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
        try:
            if not self.user_recording:
                memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                              max_entries=self.max_entries)
                self.switched_on = True
            if not _attach_observer(self.torch):
                self.notes.append("this torch has no OOM observer: the failing request's thread is not known")
        except RuntimeError as exc:       # an allocator that keeps no history (see the module's docstring)
            self.notes.append(f"no black box: torch's allocator refused to record ({_first_line(exc)})")
            self._switch_off()
            return False
        self.start_allocated = int(self.torch.cuda.memory_allocated(self.index))
        self.start_us = time.time() * 1e6
        self.previous, _active = _active, self     # a guarded run inside a `%oomguard on` cell: nested
        self.started = True
        return True

    def begin_attempt(self, number: int) -> None:
        self.attempt_starts.append((time.time() * 1e6, number))

    def pause(self) -> None:
        """Between attempts and after the run: what happens now (a release's frees) is not the run's."""
        self.pauses.append(time.time() * 1e6)

    def failed(self) -> None:
        """Inside the `except` block of an OOM, while the failed frames still hold their tensors: read the
        history now (the allocator's live blocks then are what the failure held)."""
        if not self.started:
            return
        reading = self._read()
        if reading is not None:
            self.at_failure = reading

    def _read(self) -> Reading | None:
        at = time.time() * 1e6
        try:
            snapshot = self.torch.cuda.memory._snapshot()
            allocated = int(self.torch.cuda.memory_allocated(self.index))
        except RuntimeError as exc:
            note = f"could not read the allocator history ({_first_line(exc)})"
            if note not in self.notes:
                self.notes.append(note)
            return None
        return Reading(snapshot, allocated, at)

    def stop(self) -> Recorder | None:
        """Stop recording (unless the user was), and replay what was recorded."""
        if not self.started:
            return None
        final = self._read()
        self._switch_off()
        if final is not None:
            self.recorder = replay(final, self.index, failure=self.at_failure, cell_filename=self.cell_filename,
                                   find_cell=self.find_cell, start_allocated=self.start_allocated,
                                   start_us=self.start_us, attempt_starts=self.attempt_starts, pauses=self.pauses,
                                   seen=self.seen, max_entries=None if self.user_recording else self.max_entries)
            self.recorder.notes.extend(self.notes)
        self.at_failure = None       # the snapshots hold frames of every allocation: let them go
        return self.recorder

    def discard(self) -> None:
        """Stop recording without reading the history (the run fitted and nobody asked to see it)."""
        if self.started:
            self._switch_off()
        self.at_failure = None

    def _switch_off(self) -> None:
        global _active
        if _active is self:
            _active = self.previous
        self.started = False
        if self.switched_on:
            self.switched_on = False
            try:
                self.torch.cuda.memory._record_memory_history(enabled=None)
            except RuntimeError as exc:
                self.notes.append(f"could not switch the allocator history off ({_first_line(exc)})")


def _first_line(exc) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# ---- the replay -----------------------------------------------------------------------------------

def live_blocks(snapshot: dict, index: int) -> dict[int, tuple[int, list]]:
    """{address: (size, frames)} of the blocks `memory_allocated` counts (state active_allocated) on the
    device, from the snapshot's segments."""
    blocks = {}
    for segment in snapshot.get("segments") or ():
        if segment.get("device", index) != index:
            continue
        for block in segment.get("blocks") or ():
            if block.get("state") == "active_allocated":
                blocks[int(block["address"])] = (int(block["size"]), block.get("frames") or [])
    return blocks


def replay(final: Reading, index: int, *, failure: Reading | None = None, cell_filename: str | None = None,
           start_allocated: int = 0, start_us: float | None = None, attempt_starts=(), pauses=(), seen=(),
           max_entries: int | None = MAX_ENTRIES, find_cell: bool = False,
           block_sizes: dict[int, int] | None = None, sites: dict[int, int] | None = None) -> Recorder:
    """A Recorder from the history read at the end (`final`) and when the last failure reached the guard
    (`failure`): the run's entries (those at or after `start_us`) with the allocated level anchored at
    each reading, the last `oom` entry before `failure` as the failure with what was alive then from the
    live blocks, and each entry's site from its frames (no frames: another thread, recorder.NO_FRAMES).
    Entries after a pause and before the next attempt (a release's frees) change the level, not the
    timeline. `max_entries`: the ring's size, where this run set it (None: the user's recording, whose
    size is not known). `start_allocated` is what torch counted when the run began (the level replayed
    back to the run's first entry is checked against it). `block_sizes`: {entry index: block size} of the
    `alloc` entries where the allocator's replay knows them (a snapshot read from a file,
    devices/snapshot_replay.py), else estimated from the requests. `sites`: a dict filled with {entry
    index: site} of the `alloc` and `oom` entries.

    The one reader of recordings: the live black box on CUDA calls it with what it read from the
    allocator, `read_snapshot` (oom/snapshot_reading.py) with a file's or a `_snapshot()` dict."""
    traces = final.snapshot.get("device_traces") or []
    everything = traces[index] if index < len(traces) else []
    timed = bool(everything) and all("time_us" in e for e in everything)
    entries = [e for e in everything if e["time_us"] >= start_us] if timed and start_us is not None else list(everything)
    lost = _lost_entries(everything, entries, timed, start_us, max_entries)
    recorder = Recorder(cell_filename=cell_filename, clock=lambda: 0.0, find_cell=find_cell)
    if not timed:
        recorder.notes.append("this torch's history has no times: events are spaced evenly")
    end_blocks = live_blocks(final.snapshot, index)
    frees = {"free_requested"} if any(e.get("action") == "free_requested" for e in entries) else {"free_completed"}
    sizes, deltas = _deltas(entries, end_blocks, frees, block_sizes)
    # the level after each entry, anchored at the readings (memory_allocated then, exact)
    levels = _levels(entries, deltas, final, failure)
    start_level = levels[0] - deltas[0] if entries else final.allocated
    before_key = -1
    recorder.seed({before_key: start_level} if start_level > 0 else {}, start_level)
    if lost:
        recorder.notes.append(f"the allocator's history kept its newest {len(everything)} entries, which begin "
                              "after the run did: the timeline starts there; what was alive at the failure is "
                              "exact (the allocator's live blocks)")
    ooms = [i for i, e in enumerate(entries) if e.get("action") == "oom"]
    last_oom = _failure_entry(entries, ooms, failure)
    t0 = entries[0]["time_us"] if timed and entries else 0.0
    starts = sorted(attempt_starts)
    marks = sorted([(at, True) for at, _ in starts] + [(at, False) for at in pauses])
    seen_for = dict(zip(reversed(ooms), reversed(list(seen))))     # last with last: the observer's order
    the_failure = None
    for n, entry in enumerate(entries):
        seconds = (entry["time_us"] - t0) / 1e6 if timed else float(n)
        if timed and starts:
            recorder.attempt = max((number for at, number in starts if entry["time_us"] >= at), default=0)
        if timed and marks:
            recorder.recording = next((on for at, on in reversed(marks) if at <= entry["time_us"]), True)
        action, level = entry.get("action"), levels[n]
        key = ("block", entry.get("addr"))
        if action == "alloc":
            site = recorder.site_of_frames(entry.get("frames"))
            if sites is not None:
                sites[n] = site
            recorder.alloc(key, sizes[n], level, site=site, seconds=seconds)
        elif action in frees:
            if key in recorder.alive:
                recorder.free(key, level, seconds=seconds)
            elif before_key in recorder.alive:         # a block made before the run
                recorder.resize(before_key, max(0, recorder.alive[before_key][0] - sizes[n]), level)
        elif action == "oom":
            look = seen_for.get(n)      # the observer's: grad mode and thread; none: not known
            frames = entry.get("frames") or (look.run_frames if look is not None else None)
            by_site = None
            if n == last_oom:
                by_site = _alive_at(n, entries, failure or final, index, recorder, lost, sizes)
            site = recorder.site_of_frames(frames)
            if sites is not None:
                sites[n] = site
            recorder.oom(int(entry.get("size") or 0), level, site=site,
                         seconds=seconds, grad_enabled=look.grad_enabled if look is not None else None,
                         by_site=by_site, phase="backward" if look is not None and look.thread == "backward" else None)
            if n == last_oom and recorder.failures and recorder.failures[-1].by_site is by_site:
                the_failure = recorder.failures[-1]
    caught = len(ooms) - (1 if the_failure is not None else 0)
    if caught > 0:
        recorder.notes.append(f"torch caught {caught} out-of-memory error{'s' if caught != 1 else ''} of this run "
                              "itself and went on (cuDNN, for one, retries with less workspace)")
    if the_failure is not None:              # the failure that reached the guard is the one shown
        recorder.failures.remove(the_failure)
        recorder.failures.append(the_failure)
    if entries and not lost and start_allocated and abs(start_level - start_allocated) > MIN_BLOCK * len(entries):
        recorder.notes.append("the level replayed back to the run's start is not what torch counted then: the "
                              "allocated figures before the failure are estimates")
    return recorder


def _lost_entries(everything, entries, timed, start_us, max_entries) -> bool:
    """Whether the ring overwrote entries of this run: it is full (this run set its size), or (the user's
    recording, of a size not known) it holds nothing from before the run any more."""
    if not everything:
        return False
    if max_entries is not None:
        return len(everything) >= max_entries
    return timed and start_us is not None and len(entries) == len(everything)


def _deltas(entries, end_blocks, frees, block_sizes=None) -> tuple[list[int], list[int]]:
    """Each entry's block size (exact for a block alive at the end, else its request rounded) and what it
    changes memory_allocated by."""
    last_alloc = {}
    for n, e in enumerate(entries):
        if e.get("action") == "alloc":
            last_alloc[e.get("addr")] = n
    sizes, deltas, held = [], [], {}
    for n, e in enumerate(entries):
        action, addr = e.get("action"), e.get("addr")
        size = block_size(e.get("size") or 0)
        if action == "alloc":
            if block_sizes is not None and n in block_sizes:
                size = block_sizes[n]
            elif last_alloc.get(addr) == n and addr in end_blocks:
                size = end_blocks[addr][0]
            held[addr] = size
            delta = size
        elif action in frees:
            size = held.pop(addr, size)
            delta = -size
        else:
            delta = 0
        sizes.append(size)
        deltas.append(delta)
    return sizes, deltas


def _levels(entries, deltas, final: Reading, failure: Reading | None) -> list[int]:
    """memory_allocated after each entry: backwards from `final` (and, for the entries up to when the
    failure was read, from `failure`, so that the level at the failure is exact)."""
    levels = [0] * len(entries)
    level, anchor_at = final.allocated, None
    if failure is not None:
        anchor_at = max((n for n, e in enumerate(entries) if e.get("time_us", 0) <= failure.at_us), default=None)
    for n in range(len(entries) - 1, -1, -1):
        if n == anchor_at:
            level = failure.allocated
        levels[n] = level
        level -= deltas[n]
    return levels


def _failure_entry(entries, ooms, failure: Reading | None) -> int | None:
    """The `oom` entry of the failure that reached the guard: the last before it was read."""
    if failure is None:
        return None
    before = [n for n in ooms if entries[n].get("time_us", 0) <= failure.at_us]
    return before[-1] if before else (ooms[-1] if ooms else None)


def _alive_at(n: int, entries, reading: Reading, index: int, recorder: Recorder, lost: bool,
              sizes) -> dict[int, tuple[int, int]]:
    """Bytes and blocks per site alive at entry `n` (the failure): the live blocks when the failure was
    read, less those allocated after entry n, plus those freed after it (while the error unwound)."""
    alive = live_blocks(reading.snapshot, index)
    allocated_in_run = {}
    for k, e in enumerate(entries):
        if e.get("action") == "alloc":
            allocated_in_run.setdefault(e.get("addr"), []).append(k)
    for k in range(len(entries) - 1, n, -1):
        e = entries[k]
        if e.get("time_us", 0) > reading.at_us:
            continue
        addr = e.get("addr")
        if e.get("action") == "alloc":
            alive.pop(addr, None)
        elif e.get("action") in ("free_requested", "free_completed") and addr not in alive:
            made = [j for j in allocated_in_run.get(addr, ()) if j < k]
            frames = entries[made[-1]].get("frames") if made else []
            alive[addr] = (sizes[k], frames or [])
    by_site: dict[int, list[int]] = {}
    for addr, (size, frames) in alive.items():
        made_in_run = any(j <= n for j in allocated_in_run.get(addr, ()))
        # a block with no entry of this run was made before it, unless the ring lost the run's start:
        # then its own frames say where it was made
        site = recorder.site_of_frames(frames) if made_in_run or (lost and frames) else BEFORE
        agg = by_site.setdefault(site, [0, 0])
        agg[0] += size
        agg[1] += 1
    return {s: (b, c) for s, (b, c) in by_site.items()}
