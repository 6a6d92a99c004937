"""`%gpumem --watch`: after every cell, its change in allocated memory, its exact peak and duration.

Peaks come from the allocators' own peak counters, reset when a cell starts (torch.cuda's, the simulated
device's); on a CPU-only machine from the kernel's resident-set high-water mark, which Linux lets us reset
(/proc/self/clear_refs) and which is marked approximate. No polling thread.
"""
from __future__ import annotations

import sys
import time

from cuda_magic.devices.probe import cuda_started, loaded_torch
from cuda_magic.devices.proc import ProcReader
from cuda_magic.devices.simulated import active_device
from cuda_magic.memory.snapshot import CellRecord


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
        """(kind, what to read it from) for the device this cell runs on."""
        sim = active_device()
        if sim is not None:
            return "sim", sim
        if cuda_started():
            return "cuda", loaded_torch()
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
                    self._proc = ProcReader()
                before = self._proc.start_cell()
            self._start = (kind, dev, before, time.perf_counter())
        except Exception as exc:  # a hook must never raise: note it once and carry on
            self._start = None
            self._note(exc)

    def post_run_cell(self, result=None) -> None:
        start, self._start = self._start, None
        if start is None:
            return
        kind, dev, before, t0 = start
        duration = time.perf_counter() - t0
        try:
            if kind == "sim":
                after, peak, exact, key = dev.allocated, dev.peak, True, dev.key
            elif kind == "cuda" or cuda_started():
                # a cell that starts CUDA is a CUDA cell: it began with nothing allocated there, and the
                # peak counters count from CUDA's start, inside this cell
                if kind != "cuda":
                    before = 0
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
                                device=key, allocated_after=after)
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
