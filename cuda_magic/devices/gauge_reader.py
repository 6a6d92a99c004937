"""What the live gauge reads: counters only, from a thread, never allocating on the device.

- the simulated device: its int counters;
- CUDA: one `torch.cuda.memory_stats_as_nested_dict(i)` per reading (the allocator's own statistics,
  read without allocating and without starting CUDA: torch answers {} before it is initialised), and
  the process list for what other processes hold (NVML's, amdsmi's on ROCm; and NVML's capacity, until
  torch has started CUDA), at most every `nvml_every` seconds;
- other GPUs (MPS, XPU): their meter's counters;
- the CPU: the process's resident memory and its high-water mark from /proc.
Each reading is a small record of ints; what cannot be read is None.

The peak a gauge shows never goes down while it shows: it is the highest figure read since the reader
was made (a guarded cell's gauge has its own reader; `%gpumem --live`'s counts from when it was turned
on), and a peak counter reset under it (`%gpumem --watch` resets it as each cell starts) first hands the
peak it is about to lose to `peak_reset()`, so that a peak between two readings is not lost either.
"""
from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass

from cuda_magic.devices.meter import capacity_of
from cuda_magic.devices.probe import cuda_started


APPROXIMATE = ("cpu", "mps")      # peaks from readings (the OS's high-water mark, MPS's highest figure read)
_readers: weakref.WeakSet = weakref.WeakSet()     # the GaugeReaders alive, for peak_reset()


def gauge_reads(key: str) -> bool:
    """Whether a gauge reads device `key` now: only then is its peak worth reading before a reset."""
    # `.data`, the set of weak references under the WeakSet: empty means no gauge, asked without the
    # Python-level len() and iteration of a WeakSet (this runs twice a cell under --watch)
    return bool(_readers.data) and any(reader.key == key for reader in list(_readers))


def peak_reset(key: str, peak: int | None) -> None:
    """Call before resetting the peak counter of device `key`: the gauges reading it keep `peak` (the
    counter's figure now). Cheap where no gauge is on; never raises."""
    if not _readers.data:
        return
    for reader in list(_readers):
        if reader.key == key:
            reader.keep_peak(peak, read_before=True)


@dataclass
class GaugeReading:
    """The metered device at one moment. Bytes; None where not known."""

    key: str                          # 'cuda:0', 'sim:0', 'cpu'
    allocated: int | None
    reserved: int | None
    peak: int | None                  # since the cell (or the gauge) started
    capacity: int | None
    other_processes: int | None = None
    peak_exact: bool = True           # False where the device keeps no exact peak counter (APPROXIMATE)
    seconds: float = 0.0              # since the gauge started

    def figures(self) -> tuple:
        """What the gauge shows; equal figures need no new frame."""
        return (self.allocated, self.reserved, self.peak, self.capacity, self.other_processes)


class GaugeReader:
    """Reads one meter's counters (devices.meter: SimMeter, CudaMeter, CpuMeter). Call `read()` from the
    gauge's thread; it holds the GIL only for a few dictionary lookups and int reads."""

    def __init__(self, meter, *, nvml_every: float = 2.0):
        self.meter = meter
        self.key = meter.key
        self.nvml_every = nvml_every
        self.started = time.monotonic()
        self._other = None
        self._other_at = None
        self._nvml_total = None
        self._cuda = meter.key.startswith("cuda")
        # CUDA's capacity from device properties would start CUDA: read it once torch has (or from NVML)
        self._capacity = None if self._cuda else capacity_of(meter)
        self._peak: int | None = None     # the highest peak read (or handed over) since this reader was made
        self._peak_lock = threading.Lock()
        _readers.add(self)

    def keep_peak(self, peak: int | None, *, read_before: bool = False) -> int | None:
        """The running peak, raised to `peak`. With `read_before` (a counter about to be reset) only once
        this reader has read: the counter's figure then covers only what it already counted."""
        with self._peak_lock:
            if peak is not None and (self._peak is None or peak > self._peak) \
                    and not (read_before and self._peak is None):
                self._peak = int(peak)
            return self._peak

    def read(self) -> GaugeReading:
        now = time.monotonic()
        if self._cuda:
            allocated, reserved, peak = self._cuda_counters()
            other = self._other_processes(now)
            if self._capacity is None and cuda_started():
                self._capacity = capacity_of(self.meter)
        else:
            allocated, reserved, peak = self.meter.allocated(), self.meter.reserved(), self.meter.peak()
            other = None
        peak = self.keep_peak(max(peak, allocated) if peak is not None and allocated is not None else peak)
        capacity = self._capacity if self._capacity is not None else self._nvml_total
        if self.key.startswith("sim"):
            capacity = self.meter.capacity()      # `-l` lowers it for the run
        return GaugeReading(self.key, allocated, reserved, peak, capacity, other, self.key not in APPROXIMATE,
                            now - self.started)

    def _cuda_counters(self):
        stats = self.meter.torch.cuda.memory_stats_as_nested_dict(self.meter.index)
        if not stats:                             # CUDA not started yet: nothing allocated
            return 0, 0, 0

        def pick(name, which):
            try:
                return int(stats[name]["all"][which])
            except (KeyError, TypeError):
                return None

        return (pick("allocated_bytes", "current"), pick("reserved_bytes", "current"),
                pick("allocated_bytes", "peak"))

    def _other_processes(self, now: float) -> int | None:
        if self._other_at is not None and now - self._other_at < self.nvml_every:
            return self._other
        self._other_at = now
        from cuda_magic.devices.backends import gpu_record_for

        # the same record `%gpumem` shows for this cuda:N (matched by UUID once CUDA has started); the
        # gauge has no place for notes: what cannot be read is None
        record = gpu_record_for(self.meter.index, [])
        if record is not None and self._capacity is None:
            self._nvml_total = record.total
        if record is None or not record.processes_known:
            self._other = None
        else:
            from cuda_magic.devices.pids import others_total, this_process_pid
            from cuda_magic.devices.probe import cuda_started

            started = cuda_started()
            reserved = self.meter.reserved() if started else 0
            own, known = this_process_pid(record.processes, reserved, started)
            # NVML's "not available" for a process is unknown, not 0; so is this process's entry in a
            # container where it cannot be told apart (its host pid is not os.getpid())
            self._other = others_total(record.processes, own) if known else None
        return self._other
