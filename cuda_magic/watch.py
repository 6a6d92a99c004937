"""`%gpumem --watch`: after every cell, its change in allocated memory, its exact peak and duration.

Peaks come from the allocators' own peak counters, reset when a cell starts (torch.cuda's, the simulated
device's); on a CPU-only machine from the kernel's resident-set high-water mark, which Linux lets us reset
(/proc/self/clear_refs) and which is marked approximate. No polling thread.
"""
from __future__ import annotations

import os
import sys
import time

try:
    import resource
except ImportError:   # Windows
    resource = None

from .backends import status_bytes
from .model import CellRecord
from .simulated import active_device


_PEAK_SLACK = 256 * 1024   # bytes: how far getrusage's peak may sit above RSS right after a reset


class _ProcReader:
    """Reads /proc/self/status through one open descriptor: the cheapest way to VmRSS and VmHWM.

    Per watched cell there is a cheaper pair, start_cell / end_cell: /proc/self/status costs about 15 us
    to generate, /proc/self/statm (RSS alone) and getrusage (the same high-water mark as VmHWM) a few.
    """

    def __init__(self):
        self.status_fd = self.clear_fd = self.statm_fd = None
        self.page_size = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self._rusage_peak = False
        try:
            self.status_fd = os.open("/proc/self/status", os.O_RDONLY)
            self.statm_fd = os.open("/proc/self/statm", os.O_RDONLY)
            self.clear_fd = os.open("/proc/self/clear_refs", os.O_WRONLY)
        except OSError:
            pass

    def reset_peak(self) -> bool:
        if self.clear_fd is None:
            return False
        try:
            os.write(self.clear_fd, b"5")
            return True
        except OSError:
            return False

    def rss_and_peak(self) -> tuple[int | None, int | None]:
        if self.status_fd is None:
            return None, None
        text = os.pread(self.status_fd, 4096, 0)
        return status_bytes(text, b"\nVmRSS:"), status_bytes(text, b"\nVmHWM:")

    def rss(self) -> int | None:
        """Resident bytes now, from /proc/self/statm (its second field, in pages)."""
        if self.statm_fd is None:
            return self.rss_and_peak()[0]
        return int(os.pread(self.statm_fd, 128, 0).split()[1]) * self.page_size

    def start_cell(self) -> int | None:
        """Reset the peak and return the resident bytes now.

        Also decides how end_cell reads the peak: getrusage's ru_maxrss is the kernel's same high-water
        mark as VmHWM and follows the reset, unless a thread that exited earlier left a higher mark in
        the process's record (kept as the larger of the two); then, and where the reset failed,
        /proc/self/status is read instead. A thread exiting during the cell can leave only a mark from
        this cell, so the figure stays the cell's peak.
        """
        reset = self.reset_peak()
        rss = self.rss()
        self._rusage_peak = False
        if reset and rss is not None and resource is not None:
            self._rusage_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 <= rss + _PEAK_SLACK
        return rss

    def end_cell(self) -> tuple[int | None, int | None]:
        """(resident bytes now, resident peak since start_cell)."""
        if not self._rusage_peak:
            return self.rss_and_peak()
        rss = self.rss()
        return rss, max(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)

    def close(self) -> None:
        for fd in (self.status_fd, self.clear_fd, self.statm_fd):
            if fd is not None:
                os.close(fd)
        self.status_fd = self.clear_fd = self.statm_fd = None

    def __del__(self):
        # a reader dropped without close() (a watcher never stopped) gives its descriptors back
        try:
            self.close()
        except OSError:
            pass


_shared = None


def shared_reader() -> _ProcReader:
    """One reader for every guarded cell on the CPU: its descriptors are opened once per process."""
    global _shared
    if _shared is None:
        _shared = _ProcReader()
    return _shared


class CellWatcher:
    """Per-cell records through IPython's pre_run_cell / post_run_cell events. Cheap; never raises."""

    def __init__(self, shell, on_record=None):
        self.shell = shell
        self.records: list[CellRecord] = []
        self.on_record = on_record
        self.active = False
        self._proc = None
        self._start = None

    # events ------------------------------------------------------------------------------------
    def start(self) -> None:
        if not self.active:
            self.shell.events.register("pre_run_cell", self.pre_run_cell)
            self.shell.events.register("post_run_cell", self.post_run_cell)
            self.active = True

    def stop(self) -> None:
        if self.active:
            for name, cb in (("pre_run_cell", self.pre_run_cell), ("post_run_cell", self.post_run_cell)):
                try:
                    self.shell.events.unregister(name, cb)
                except ValueError:
                    pass
            self.active = False
        if self._proc is not None:
            self._proc.close()
            self._proc = None

    def _device(self):
        """(key, allocated, reset_peak, read_peak, exact) for the device this cell runs on."""
        sim = active_device()
        if sim is not None:
            return "sim", sim
        torch = sys.modules.get("torch")
        if torch is not None:
            try:
                if torch.cuda.is_initialized():
                    return "cuda", torch
            except Exception:
                pass
        return "cpu", None

    def pre_run_cell(self, info=None) -> None:
        try:
            kind, dev = self._device()
            if kind == "sim":
                dev.reset_peak()
                before = dev.allocated
            elif kind == "cuda":
                i = dev.cuda.current_device()
                dev.cuda.reset_peak_memory_stats(i)
                before = dev.cuda.memory_allocated(i)
            else:
                if self._proc is None:
                    self._proc = _ProcReader()
                before = self._proc.start_cell()
            self._start = (kind, before, time.perf_counter())
        except Exception as exc:  # a hook must never raise: note it once and carry on
            self._start = None
            self._note(exc)

    def post_run_cell(self, result=None) -> None:
        start, self._start = self._start, None
        if start is None:
            return
        kind, before, t0 = start
        duration = time.perf_counter() - t0
        try:
            if kind == "sim":
                dev = active_device()
                if dev is None:
                    return
                after, peak, exact, key = dev.allocated, dev.peak, True, dev.key
            elif kind == "cuda":
                torch = sys.modules["torch"]
                i = torch.cuda.current_device()
                after = torch.cuda.memory_allocated(i)
                peak, exact, key = torch.cuda.max_memory_allocated(i), True, f"cuda:{i}"
            else:
                after, peak = self._proc.end_cell()
                exact, key = False, "cpu"
            delta = (after - before) if after is not None and before is not None else None
            record = CellRecord(cell=_cell_number(self.shell, result, len(self.records) + 1),
                                allocated_delta=delta, peak=peak, peak_exact=exact, duration=duration,
                                device=key)
            self.records.append(record)
            if self.on_record is not None:
                self.on_record(record)
        except Exception as exc:
            self._note(exc)

    def _note(self, exc) -> None:
        if not getattr(self, "_noted", False):
            self._noted = True
            print(f"[gpumem --watch] could not read memory: {type(exc).__name__}: {exc}", file=sys.stderr)


def _cell_number(shell, result, fallback: int) -> int:
    """The cell's own execution count: the ExecutionResult's, which IPython sets whether or not the cell
    is stored in history (the shell's counter is already one ahead in IPython 9, and not in IPython 8)."""
    number = getattr(result, "execution_count", None)
    if isinstance(number, int):
        return number
    count = getattr(shell, "execution_count", None)
    return count - 1 if isinstance(count, int) else fallback
