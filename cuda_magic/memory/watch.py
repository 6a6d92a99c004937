"""`%gpumem --watch`: after every cell, its change in allocated memory, its exact peak and duration.

Peaks come from the allocators' own peak counters, reset when a cell starts (torch.cuda's, torch.xpu's
from torch 2.5, the simulated device's). MPS keeps none: its peak is the higher of the allocated figures at
the cell's start and end (torch.mps.current_allocated_memory), marked approximate. With no GPU in use, from
the kernel's resident-set high-water mark, which Linux lets us reset (/proc/self/clear_refs), marked
approximate. No polling thread.
"""
from __future__ import annotations

import sys
from time import perf_counter

from cuda_magic.devices.errors import is_oom
from cuda_magic.devices.gauge_reader import gauge_reads, peak_reset
from cuda_magic.devices.probe import cuda_started, loaded_torch, mps_available, xpu_started
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
        """(kind, what to read it from) for the device this cell runs on: the simulated device, CUDA once
        started, an XPU once started (with its counters: torch 2.5+), MPS where torch has it, else the
        CPU (the process's resident memory)."""
        sim = active_device()
        if sim is not None:
            return "sim", sim
        return _gpu_now() or ("cpu", None)

    # Both hooks run after every cell: each asks about the devices once, and the CPU's case (no GPU in
    # use) comes first. bench/bench_watch.py measures them.
    def pre_run_cell(self, info=None) -> None:
        try:
            kind, dev = self._device()
            # a live gauge reading the counter keeps the peak the reset takes away (gauge_reader)
            if kind == "cpu":
                proc = self._proc
                if proc is None:
                    proc = self._proc = ProcReader()
                if gauge_reads("cpu"):     # the peak costs a read of /proc/self/status: only for a gauge
                    peak_reset("cpu", proc.rss_and_peak()[1])
                before = proc.start_cell()
            elif kind == "sim":
                peak_reset(dev.key, dev.peak)
                dev.reset_peak()
                before = dev.allocated
            elif kind == "cuda":
                i = dev.cuda.current_device()
                peak_reset(f"cuda:{i}", dev.cuda.max_memory_allocated(i))
                dev.cuda.reset_peak_memory_stats(i)
                before = dev.cuda.memory_allocated(i)
            else:                    # an XPU or MPS
                if kind == "xpu":    # MPS: this meter's own figure, not the one a gauge reads
                    peak_reset(dev.key, dev.peak())
                dev.reset_peak()
                before = dev.allocated()
            self._start = (kind, dev, before, perf_counter())
        except Exception as exc:  # a hook must never raise: note it once and carry on
            self._start = None
            self._note(exc)

    def post_run_cell(self, result=None) -> None:
        start, self._start = self._start, None
        if start is None:
            return
        kind, dev, before, t0 = start
        duration = perf_counter() - t0
        try:
            if kind == "sim":
                after, peak, exact, key = dev.allocated, dev.peak, True, dev.key
            else:
                if kind == "cpu":
                    # a cell that starts CUDA or an XPU, or imports torch on a Mac, is that device's cell:
                    # it began with nothing there; the peak counters count from the device's start
                    gpu = _gpu_now()
                    if gpu is not None:
                        (kind, dev), before = gpu, 0
                elif kind != "cuda" and cuda_started():
                    kind, before = "cuda", 0
                if kind == "cpu":
                    after, peak = self._proc.end_cell()
                    exact, key = False, "cpu"
                elif kind == "cuda":
                    torch = sys.modules["torch"]
                    i = torch.cuda.current_device()
                    after = torch.cuda.memory_allocated(i)
                    peak, exact, key = torch.cuda.max_memory_allocated(i), True, f"cuda:{i}"
                else:
                    after, peak, key = dev.allocated(), dev.peak(), dev.key
                    exact = kind == "xpu"        # MPS: the higher figure read, approximate
            delta = (after - before) if after is not None and before is not None else None
            record = CellRecord(cell=_cell_number(self.shell, result, len(self.records) + 1),
                                allocated_delta=delta, peak=peak, peak_exact=exact, duration=duration,
                                device=key, allocated_after=after,
                                capacity=None if kind == "cpu" else _capacity(kind, dev),
                                outcome=_outcome(result))
            self.records.append(record)
            if self.on_record is not None:
                self.on_record(record)
        except Exception as exc:
            self._note(exc)

    def _note(self, exc) -> None:
        if not getattr(self, "_noted", False):
            self._noted = True
            print(f"[gpumem --watch] could not read memory: {type(exc).__name__}: {exc}", file=sys.stderr)


def _gpu_now():
    """('cuda', torch) once torch has started CUDA; for an XPU torch has started (its allocator counters
    need torch 2.5+) or Apple's MPS where torch can use it, (its device type, its meter); else None (no GPU
    in use, or torch not loaded). Neither meter reads the process's resident memory, which on macOS (no
    /proc) cannot be read per cell anyway."""
    torch = loaded_torch()
    if torch is None:
        return None
    if cuda_started(torch):
        return "cuda", torch
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu_started(torch) and hasattr(xpu, "max_memory_allocated"):
        from cuda_magic.devices.meter import XpuMeter

        return "xpu", XpuMeter(int(xpu.current_device()))
    if mps_available() and hasattr(getattr(torch, "mps", None), "current_allocated_memory"):
        from cuda_magic.devices.meter import MpsMeter

        return "mps", MpsMeter()
    return None


def _capacity(kind: str, dev) -> int | None:
    """The capacity of the device a cell ran on, read from counters only (None for the CPU, or where the
    backend cannot say)."""
    try:
        if kind == "sim":
            return int(dev.capacity)
        if kind == "cuda" or cuda_started():
            torch = sys.modules["torch"]
            return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
        if kind in ("xpu", "mps"):
            from cuda_magic.devices.meter import capacity_of

            return capacity_of(dev)
    except Exception:
        pass
    return None


def _outcome(result) -> str | None:
    """'ok', 'oom' (an out-of-memory error in the error's chain, as the guard decides it:
    devices/errors.py, so a guard's short error after an OOM is one too) or 'error', from IPython's
    ExecutionResult; None without one."""
    if result is None or not hasattr(result, "error_in_exec"):
        return None
    error = result.error_in_exec or getattr(result, "error_before_exec", None)
    if error is None:
        return "ok"
    return "oom" if is_oom(error) else "error"


def _cell_number(shell, result, fallback: int) -> int:
    """The cell's own execution count: the ExecutionResult's, which IPython sets whether or not the cell
    is stored in history (the shell's counter is already one ahead in IPython 9, and not in IPython 8)."""
    number = getattr(result, "execution_count", None)
    if isinstance(number, int):
        return number
    count = getattr(shell, "execution_count", None)
    return count - 1 if isinstance(count, int) else fallback
