"""The black box's recorder: each storage's bytes and the line of user code that made it, each free, and
the failing request, with the device's allocated bytes after every event.

Bounded: events go to a ring (the oldest are dropped past `max_events`), while the set of storages alive
now is kept apart, exactly, so that what was alive at the failure (and at the peak) is exact however many
events were dropped. Aggregates per site (a line of code) are kept as events happen, so copying them at
the peak or the failure costs as many entries as there are lines, not tensors.

A site is where a storage was made: the innermost frame that is not torch, another installed package or
cuda_magic (`paths.is_library_file`, cached per code object), and the line of the cell that was running.
The simulated device calls `alloc` / `free` / `oom` inside its own accounting; the CUDA history replay
(cuda_history.py) calls them with the frames torch recorded.
"""
from __future__ import annotations

import functools
import sys
import time
from collections import deque

from cuda_magic.paths import is_cell_file, is_cell_top_level, is_library_file

DEFAULT_MAX_EVENTS = 200_000      # about 20 MB of events at most; the alive set is separate and exact
BEFORE = 0                        # the site of storages that existed before the recording started
#: The file of the site of an allocation torch recorded with no Python frame: it came from a thread that
#: runs no Python code, on CUDA autograd's device thread running the backward pass.
NO_FRAMES = "<no Python frames>"
#: The file of the site of an allocation made on autograd's device thread (its C++ frames say so): the
#: backward pass, which runs no Python code.
BACKWARD_THREAD = "<backward pass>"
ALLOC, FREE, OOM, RESIZE = "alloc", "free", "oom", "resize"
_CPP = (".cpp", ".cc", ".cu", ".h", ".hpp", ".cuh", ".c")


def is_python_file(filename: str) -> bool:
    """A file of Python code among the frames torch recorded (not C++: '??', '', 'memory_snapshot.cpp')."""
    if not filename or filename.startswith("??") or filename.endswith(_CPP):
        return False
    return filename.endswith((".py", ".pyw")) or filename.startswith("<") or is_cell_file(filename)


_PYTHON_FILES: dict[str, bool] = {}


def is_python_frame(frame: dict) -> bool:
    filename = frame.get("filename") or ""
    known = _PYTHON_FILES.get(filename)
    if known is None:
        known = _PYTHON_FILES[filename] = is_python_file(filename)
    return known


def python_frames(frames) -> list[dict]:
    """The Python frames among those torch recorded, innermost first."""
    files = _PYTHON_FILES
    out = []
    for fr in frames or ():
        filename = fr.get("filename") or ""
        known = files.get(filename)
        if known is None:
            known = files[filename] = is_python_file(filename)
        if known:
            out.append(fr)
    return out


@functools.lru_cache(maxsize=4096)
def library_file(filename: str) -> bool:
    """`paths.is_library_file`, remembered per file name (a recording names the same files many times)."""
    return is_library_file(filename)


_BACKWARD = {"backward", "_engine_run_backward", "run_backward", "grad"}


def grad_mode() -> bool | None:
    """Whether the failing code is training: autograd records a graph (not under no_grad or
    inference_mode), or a backward pass is running (which itself runs with grad mode off). None without
    torch. Called only at a failure: it may walk the stack."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if bool(torch.is_grad_enabled()) and not bool(torch.is_inference_mode_enabled()):
        return True
    return backward_running(sys._getframe(1))


def backward_running(frame) -> bool:
    """Whether `frame` or a caller is torch's autograd running a backward pass."""
    f = frame
    while f is not None:
        code = f.f_code
        if code.co_name in _BACKWARD and "autograd" in code.co_filename.replace("\\", "/").split("/torch/")[-1]:
            return True
        f = f.f_back
    return False


def _outward(frame):
    while frame is not None:
        yield frame
        frame = frame.f_back


class RecordedFailure:
    """The request that did not fit, and the storages alive per site at that moment."""

    __slots__ = ("seconds", "requested", "allocated", "site", "attempt", "by_site", "grad_enabled", "phase")

    def __init__(self, seconds, requested, allocated, site, attempt, by_site, grad_enabled=None, phase=None):
        self.seconds, self.requested, self.allocated = seconds, requested, allocated
        self.site, self.attempt, self.by_site = site, attempt, by_site
        self.grad_enabled = grad_enabled      # False: no autograd graph was being built (inference)
        self.phase = phase                    # 'backward': it failed in autograd's backward pass


class Recorder:
    """Events of one guarded run (all its attempts). Sizes are int bytes; times are seconds since start."""

    def __init__(self, *, cell_filename: str | None = None, max_events: int = DEFAULT_MAX_EVENTS,
                 clock=time.perf_counter, find_cell: bool = False):
        self.cell_filename = cell_filename
        # `find_cell`: the running cell's file is not known yet (`%oomguard on` starts recording before
        # IPython compiles the cell): it is the file of the outermost cell frame, found at the first event
        self.find_cell = find_cell and cell_filename is None
        self.events: deque = deque(maxlen=max_events)   # (seconds, kind, bytes, allocated after, site, attempt)
        self.total_events = 0
        self.sites: list[tuple] = [(None, None, None, None)]   # site id -> (file, line, function, cell line)
        self._site_ids: dict[tuple, int] = {}
        self._library: dict = {}                        # code object -> is it a library's
        self.alive: dict[int, tuple[int, int]] = {}     # storage key -> (bytes, site)
        self.by_site: dict[int, list[int]] = {}         # site -> [bytes, storages]
        self.attempt = 0
        self.recording = True                           # False between attempts: the alive set still follows
        self.clock = clock
        self.t0 = clock()
        self.allocated = 0
        self.peak = 0
        self.peak_seconds = 0.0
        self.peak_attempt = 0
        self.peak_by_site: dict[int, tuple[int, int]] = {}
        self.between_peak = 0                           # the highest allocated while paused (measuring)
        self.between_peak_seconds = 0.0
        self._peak_stale = False
        self.failures: list[RecordedFailure] = []
        self.notes: list[str] = []

    # -- setting up --------------------------------------------------------------------------------
    def seed(self, live: dict[int, int], allocated: int | None = None) -> None:
        """Storages alive before the recording started (key -> bytes): counted under BEFORE."""
        for key, nbytes in live.items():
            self.alive[key] = (nbytes, BEFORE)
        if live:
            self.by_site[BEFORE] = [sum(live.values()), len(live)]
        self.allocated = sum(live.values()) if allocated is None else allocated
        self.peak = self.allocated
        self.peak_by_site = self._copy_sites()
        self.events.append((0.0, ALLOC, 0, self.allocated, BEFORE, self.attempt))
        self.total_events += 1

    def begin_attempt(self, number: int) -> None:
        self.attempt = number
        self.recording = True
        self._append(ALLOC, 0, BEFORE)      # a point where the attempt's trace starts

    def pause(self) -> None:
        self.recording = False

    # -- sites -------------------------------------------------------------------------------------
    def site_here(self) -> int:
        """The site of the code that is running now (called from inside the device's accounting)."""
        library, cell_file = self._library, self.cell_filename
        f = sys._getframe(1)
        if self.find_cell:
            cell_file = self._cell_file_of((g.f_code.co_name, g.f_code.co_filename) for g in _outward(f))
        inner = None
        cell_line = None
        while f is not None:
            code = f.f_code
            lib = library.get(code)
            if lib is None:
                lib = library[code] = is_library_file(code.co_filename)
            if not lib:
                if inner is None:
                    inner = (code.co_filename, f.f_lineno, code.co_name)
                if cell_file is None:
                    break
                if code.co_filename == cell_file:
                    cell_line = f.f_lineno
                    break
            f = f.f_back
        if inner is None:
            return BEFORE if cell_line is None else self.site_id((None, None, None, cell_line))
        return self.site_id((*inner, cell_line))

    def site_of_frames(self, frames) -> int:
        """The site of an allocation from the frames torch recorded (dicts of filename, line, name;
        innermost first). Only Python frames can be the user's: a recording made with `stacks="all"`
        (torch's default for `_record_memory_history`) starts each stack with C++ frames
        (memory_snapshot.cpp, CUDACachingAllocator.cpp, '??'), which are skipped. No Python frame at all:
        torch ran it on a thread with no Python code: autograd's device thread where the C++ frames say so
        (BACKWARD_THREAD), else NO_FRAMES. Python frames that are all library code: BEFORE's row, unless
        the cell's line is among them or no cell is known (a recording read from a file): then the
        innermost of them."""
        python = python_frames(frames)
        if not python:
            if frames and any("autograd::Engine" in (fr.get("name") or "") for fr in frames):
                return self.site_id((BACKWARD_THREAD, None, None, None))
            return self.site_id((NO_FRAMES, None, None, None))
        inner = None
        cell_line = None
        if self.find_cell:
            self._cell_file_of((fr.get("name"), fr.get("filename") or "") for fr in python)
        for fr in python:
            filename = fr.get("filename") or ""
            if library_file(filename):
                continue
            if inner is None:
                inner = (filename, int(fr.get("line") or 0), fr.get("name"))
            if self.cell_filename is None:
                break
            if filename == self.cell_filename:
                cell_line = int(fr.get("line") or 0)
                break
        if inner is None:
            if cell_line is None and self.cell_filename is None and not self.find_cell:
                fr = python[0]
                return self.site_id((fr.get("filename"), int(fr.get("line") or 0), fr.get("name"), None))
            return BEFORE if cell_line is None else self.site_id((None, None, None, cell_line))
        return self.site_id((*inner, cell_line))

    def _cell_file_of(self, frames) -> str | None:
        """The file of the outermost cell module among `frames` (name, filename; innermost first), kept as
        the cell's file once found."""
        found = None
        for name, filename in frames:
            if is_cell_top_level(name) and is_cell_file(filename):
                found = filename
        if found is not None:
            self.cell_filename, self.find_cell = found, False
        return found

    def site_id(self, site: tuple) -> int:
        sid = self._site_ids.get(site)
        if sid is None:
            sid = self._site_ids[site] = len(self.sites)
            self.sites.append(site)
        return sid

    # -- events ------------------------------------------------------------------------------------
    def _append(self, kind, nbytes, site, seconds=None):
        if self.recording:
            self.events.append((self.clock() - self.t0 if seconds is None else seconds, kind, nbytes,
                                self.allocated, site, self.attempt))
            self.total_events += 1

    def alloc(self, key: int, nbytes: int, allocated: int, site: int | None = None,
              seconds: float | None = None) -> None:
        if site is None:
            site = self.site_here() if self.recording else BEFORE
        self.alive[key] = (nbytes, site)
        agg = self.by_site.get(site)
        if agg is None:
            self.by_site[site] = [nbytes, 1]
        else:
            agg[0] += nbytes
            agg[1] += 1
        self.allocated = allocated
        self._append(ALLOC, nbytes, site, seconds)
        if not self.recording:
            # between attempts (a retry measuring the model on slices of its batch): not the run's peak,
            # which is one of its attempts' (one figure per fact); the measuring's own, at its real time
            if allocated > self.between_peak:
                self.between_peak = allocated
                self.between_peak_seconds = self.clock() - self.t0 if seconds is None else seconds
        elif allocated > self.peak:
            self.peak = allocated
            self.peak_seconds = self.events[-1][0] if self.events else self.clock() - self.t0
            self.peak_attempt = self.attempt
            self._peak_stale = True

    def free(self, key: int, allocated: int, seconds: float | None = None) -> None:
        entry = self.alive.pop(key, None)
        if entry is None:
            return
        if self._peak_stale:
            self._take_peak()
        nbytes, site = entry
        agg = self.by_site[site]
        agg[0] -= nbytes
        agg[1] -= 1
        if agg[1] <= 0:
            del self.by_site[site]
        self.allocated = allocated
        self._append(FREE, nbytes, site, seconds)

    def resize(self, key: int, nbytes: int, allocated: int) -> None:
        entry = self.alive.get(key)
        if entry is None:
            return
        old, site = entry
        self.alive[key] = (nbytes, site)
        self.by_site[site][0] += nbytes - old
        if nbytes < old and self._peak_stale:
            self._take_peak()
        self.allocated = allocated
        self._append(RESIZE, nbytes - old, site)
        if self.recording and allocated > self.peak:
            self.peak, self.peak_attempt, self._peak_stale = allocated, self.attempt, True
            self.peak_seconds = self.events[-1][0] if self.events else self.clock() - self.t0

    def oom(self, requested: int, allocated: int, site: int | None = None, seconds: float | None = None,
            grad_enabled: bool | None = ..., *, by_site: dict | None = None, phase: str | None = None) -> None:
        """The request that did not fit (recorded before the error is raised, in the failing thread, so
        that the grad mode read here is the failing code's). `by_site`: what was alive then, where the
        caller knows it better than the events replayed so far (the CUDA history's live blocks). Between
        attempts (paused) an out-of-memory error is not the run's (a retry measuring the model on slices of
        its batch finds what fits by running out): not a failure."""
        if not self.recording:
            self.allocated = allocated
            return
        if site is None:
            site = self.site_here()
        if grad_enabled is ...:
            grad_enabled = grad_mode()
            if phase is None and backward_running(sys._getframe(1)):
                phase = "backward"
        if self._peak_stale:
            self._take_peak()
        self.allocated = allocated
        self._append(OOM, requested, site, seconds)
        when = self.events[-1][0] if self.recording and self.events else (self.clock() - self.t0)
        self.failures.append(RecordedFailure(when, requested, allocated, site, self.attempt,
                                             self._copy_sites() if by_site is None else by_site, grad_enabled,
                                             phase))

    # -- reading -----------------------------------------------------------------------------------
    def _copy_sites(self) -> dict[int, tuple[int, int]]:
        return {s: (b, n) for s, (b, n) in self.by_site.items()}

    def _take_peak(self) -> None:
        self.peak_by_site = self._copy_sites()
        self._peak_stale = False

    def at_peak(self) -> dict[int, tuple[int, int]]:
        """Bytes and storages per site when the recording's allocated bytes were highest."""
        if self._peak_stale:
            self._take_peak()
        return self.peak_by_site

    @property
    def dropped(self) -> int:
        return self.total_events - len(self.events)
