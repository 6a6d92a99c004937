"""Meters: the allocated bytes, exact peak and capacity of the one device a guarded run is measured on,
and the `-l` cap. One small interface over CUDA and ROCm (torch's counters), MPS, XPU, the simulated
device and the CPU; `device_type` is what torch.autocast is given for the device."""
from __future__ import annotations

import sys
from contextlib import contextmanager, nullcontext

from cuda_magic.devices.probe import cuda_started


class Meter:
    """What every meter has: `key`, `device_type`, allocated / reserved / capacity / peak readers,
    `reset_peak()`, `running(limit)` around a run; `counting()` around work between runs."""

    def counting(self):
        return nullcontext()


class SimMeter(Meter):
    device_type = "cpu"       # its tensors are CPU tensors

    def __init__(self, device, temporary: bool = False):
        self.device = device
        self.temporary = temporary    # made for this run by -l: started and stopped around it
        self.key = device.key
        if temporary:                 # what exists counts against the cap, as on a GPU (one gc scan)
            device.count_existing()

    def allocated(self) -> int:
        return self.device.allocated

    def reserved(self) -> int:
        return self.device.reserved

    def capacity(self) -> int:
        return self.device.capacity

    def reset_peak(self) -> None:
        self.device.reset_peak()

    def peak(self) -> int:
        return self.device.peak

    @contextmanager
    def running(self, limit: int | None = None):
        if self.temporary:
            with self.device:
                yield
        elif limit is not None:
            # as on a GPU (CudaMeter.running): the cap is checked only when a segment is reserved or pages
            # mapped, so what the cache holds from earlier cells is given back first
            self.device.empty_cache()
            with self.device.limited(limit):
                yield
        else:
            yield

    def counting(self):
        """What is made inside counts on the device, between runs too (a retry's restored states): a
        device made for the run counts only while it runs, so it runs here too."""
        return self.device if self.temporary and not self.device.active else nullcontext()


#: The memory fraction cuda_magic last set per device key: torch.cuda before 2.6 and torch.mps have no
#: getter, so a later `-l` restores this rather than guessing.
_fractions_set: dict[str, float] = {}
_fraction_warned: set[str] = set()     # device keys whose "set it again" warning was given (once a process)


def _warn_once(key: str, message: str) -> None:
    if key not in _fraction_warned:
        _fraction_warned.add(key)
        import warnings

        warnings.warn(message, RuntimeWarning, stacklevel=2)


@contextmanager
def _fraction_capped(key: str, set_fraction, fraction: float, old: float | None, unset: float):
    """Run with the allocator's memory fraction at `fraction`, then put `old` back (`unset`, the value of
    no fraction, where the fraction in force is not known). Nothing is set where nothing would change: on
    CUDA before torch 2.8 (and XPU) setting a fraction, even 1.0, leaves the allocator "fraction set"
    for the rest of the process (c10/cuda/CUDACachingAllocator.cpp, setMemoryFraction: set_fraction =
    true): its out-of-memory messages say "allowed" and a garbage_collection_threshold starts acting."""
    if fraction == (unset if old is None else old):
        yield
        return
    set_fraction(fraction)
    _fractions_set[key] = fraction
    try:
        yield
    finally:
        restore = unset if old is None else old
        set_fraction(restore)
        _fractions_set[key] = restore


class CudaMeter(Meter):
    device_type = "cuda"      # for torch.autocast

    def __init__(self, index: int):
        import torch

        self.torch = torch
        self.index = index
        self.key = f"cuda:{index}"

    def _ready(self) -> bool:
        return cuda_started()

    def allocated(self) -> int | None:
        return int(self.torch.cuda.memory_allocated(self.index)) if self._ready() else 0

    def reserved(self) -> int | None:
        return int(self.torch.cuda.memory_reserved(self.index)) if self._ready() else 0

    def capacity(self) -> int | None:
        """The device's total memory as CUDA counts it, without starting CUDA: torch's device properties
        once CUDA has started; before, NVML's figure (None where NVML cannot say)."""
        if self._ready():
            return self.total()
        from cuda_magic.devices.backends import cuda_devices

        return next((d.capacity for d in cuda_devices([])[0] if d.key == self.key), None)

    def total(self) -> int:
        """torch's figure for the device's memory. Reads device properties, which start CUDA: only once
        it has started, or for `-l`, whose memory fraction starts it anyway."""
        return int(self.torch.cuda.get_device_properties(self.index).total_memory)

    def reset_peak(self) -> None:
        if self._ready():
            self.torch.cuda.reset_peak_memory_stats(self.index)

    def peak(self) -> int | None:
        return int(self.torch.cuda.max_memory_allocated(self.index)) if self._ready() else None

    @contextmanager
    def running(self, limit: int | None = None):
        """Cap everything PyTorch reserves on the device (what the notebook already holds included) at
        `limit` bytes for the run, through the allocator's memory fraction; then put back the fraction
        that was in force: torch's getter (2.6+), else the one cuda_magic last set, else 1.0 (torch
        before 2.6 cannot say whether the user set one: a warning, once, says so). A cap of the whole
        device where no fraction is known to be in force sets nothing. torch 2.8+ clears the fraction
        when 1.0 is set back; before 2.8 the allocator stays "fraction set" (see `_fraction_capped`)."""
        if limit is None:
            yield
            return
        cuda = self.torch.cuda
        getter = getattr(cuda, "get_per_process_memory_fraction", None)
        old = float(getter(self.index)) if getter is not None else _fractions_set.get(self.key)
        if old is not None and old > 1.0:
            # backend:cudaMallocAsync starts its limit at UINT64_MAX and its getter divides it by the
            # device's memory (c10/cuda/CUDAMallocAsyncAllocator.cpp, lazy_init_device and
            # getMemoryFraction, 2.6 to 2.13): about 2e8, which the setter refuses (torch/cuda/memory.py:
            # "Allowed range: 0~1"). 1.0 puts the limit at the device's memory, the same as none.
            old = 1.0
        fraction = min(1.0, limit / self.total())
        # the native allocator checks its fraction only when it reserves a new segment (alloc_block in
        # c10/cuda/CUDACachingAllocator.cpp, 2.2 to 2.13): a request its cache serves never runs out, so
        # the cache goes first and the cap bounds everything PyTorch reserves (cudaMallocAsync counts
        # what is allocated against its limit: emptying trims its pool, nothing more)
        cuda.empty_cache()
        try:
            with _fraction_capped(self.key, lambda f: cuda.set_per_process_memory_fraction(f, self.index),
                                  fraction, old, 1.0):
                yield
        finally:
            if old is None and self.key in _fractions_set:    # set, and put back to 1.0 unknowing
                from cuda_magic.devices.allocator_conf import installed_torch_version

                stays = (installed_torch_version() or (2, 8)) < (2, 8)
                _warn_once(self.key, f"cuda_magic: -l restored {self.key}'s memory fraction to 1.0: torch "
                           f"{self.torch.__version__} cannot report the fraction in force before, so one set "
                           "with torch.cuda.set_per_process_memory_fraction must be set again"
                           + ("; before torch 2.8 a fraction once set stays set, 1.0 included (out-of-memory "
                              "messages say \"allowed\")" if stays else ""))


class MpsMeter(Meter):
    """Apple's MPS: torch.mps's counters. There is no peak counter: the peak is the highest figure read
    at the run's start and end, marked approximate."""

    key = "mps"
    device_type = "mps"

    def __init__(self):
        import torch

        self.torch = torch
        self._peak = 0

    def allocated(self) -> int:
        return int(self.torch.mps.current_allocated_memory())

    def reserved(self) -> int:
        return int(self.torch.mps.driver_allocated_memory())

    def recommended(self) -> int | None:
        """Metal's recommended working-set size (torch 2.5+; about 75% of the RAM), the base of the memory
        fraction and of the high-watermark limit. None where torch cannot say."""
        getter = getattr(self.torch.mps, "recommended_max_memory", None)
        return int(getter()) if getter is not None else None

    def capacity(self) -> int | None:
        """What torch lets this process hold on MPS before it raises out of memory: the high-watermark
        ratio (PYTORCH_MPS_HIGH_WATERMARK_RATIO, default 1.7) times the recommended size, counted against
        `reserved()` (aten/src/ATen/mps/MPSAllocator.mm); with the ratio 0 (no limit), the RAM. None where
        the recommended size is not known (torch before 2.5). A fraction the user set with
        torch.mps.set_per_process_memory_fraction cannot be read back, so it is not seen here."""
        from cuda_magic.devices.allocator_conf import mps_capacity

        return mps_capacity(self.recommended())

    def reset_peak(self) -> None:
        self._peak = self.allocated()

    def peak(self) -> int:
        self._peak = max(self._peak, self.allocated())
        return self._peak

    @contextmanager
    def running(self, limit: int | None = None):
        """`-l` through torch.mps.set_per_process_memory_fraction (a fraction of the recommended size,
        0 to 2: the allocator's high-watermark ratio); then the ratio cuda_magic last set, else the
        environment's or torch's default. torch.mps has no getter (2.2 to 2.13, nor any torch._C._mps_*
        binding): a fraction the user set is replaced, and a warning says so once."""
        if limit is None:
            yield
            return
        from cuda_magic.devices.allocator_conf import mps_watermark_ratio

        mps = self.torch.mps
        old = _fractions_set.get(self.key)
        if old is None:
            old = mps_watermark_ratio()
        fraction = min(2.0, limit / self.recommended())
        try:
            with _fraction_capped(self.key, mps.set_per_process_memory_fraction, fraction, old, old):
                yield
        finally:
            if self.key in _fractions_set:
                _warn_once(self.key, f"cuda_magic: -l put the MPS memory fraction back to {old:g} "
                           "(PYTORCH_MPS_HIGH_WATERMARK_RATIO, else torch's default 1.7): torch.mps cannot "
                           "report the fraction in force, so one set with "
                           "torch.mps.set_per_process_memory_fraction must be set again")


class XpuMeter(Meter):
    """Intel XPU: torch.xpu's allocator counters (torch 2.5+)."""

    device_type = "xpu"

    def __init__(self, index: int):
        import torch

        self.xpu = torch.xpu
        self.index = index
        self.key = f"xpu:{index}"

    def allocated(self) -> int:
        return int(self.xpu.memory_allocated(self.index))

    def reserved(self) -> int:
        return int(self.xpu.memory_reserved(self.index))

    def capacity(self) -> int:
        return int(self.xpu.get_device_properties(self.index).total_memory)

    def reset_peak(self) -> None:
        self.xpu.reset_peak_memory_stats(self.index)

    def peak(self) -> int:
        return int(self.xpu.max_memory_allocated(self.index))

    @contextmanager
    def running(self, limit: int | None = None):
        """`-l` through torch.xpu's memory fraction (set and get both from torch 2.10), put back after."""
        if limit is None:
            yield
            return
        getter = getattr(self.xpu, "get_per_process_memory_fraction", None)
        old = float(getter(self.index)) if getter is not None else _fractions_set.get(self.key)
        fraction = min(1.0, limit / self.capacity())
        with _fraction_capped(self.key, lambda f: self.xpu.set_per_process_memory_fraction(f, self.index),
                              fraction, old, 1.0):
            yield


class CpuMeter(Meter):
    """The process's resident memory: approximate, since Python and the allocator keep pages."""

    key = "cpu"
    device_type = "cpu"

    def __init__(self):
        from cuda_magic.devices.proc import shared_reader

        self.proc = shared_reader()

    def allocated(self) -> int | None:
        return self.proc.rss()          # /proc/self/statm: a tenth of the time of /proc/self/status

    reserved = allocated

    def capacity(self) -> int | None:
        return self.proc.memory()[0]

    def reset_peak(self) -> None:
        self.proc.start_cell()          # and the peak since then read from getrusage where exact (proc.py)

    def peak(self) -> int | None:
        return self.proc.rss_and_peak()[1]

    @contextmanager
    def running(self, limit: int | None = None):
        yield


def available_memory() -> int | None:
    from cuda_magic.devices.proc import shared_reader

    return shared_reader().memory()[1]


def autocast(amp: str | None, meter):
    """torch.autocast for the meter's device at `amp` ('bf16', 'fp16'); nothing for None."""
    if amp is None:
        return nullcontext()
    import torch

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[amp]
    return torch.autocast(device_type=meter.device_type, dtype=dtype)   # cpu for the simulated device


def capacity_of(meter) -> int | None:
    """The meter's capacity, None where the backend cannot give one."""
    try:
        return meter.capacity()
    except (AssertionError, RuntimeError, AttributeError, OSError):
        return None


def cuda_usable() -> bool:
    """Whether torch has a CUDA (or ROCm) device, asked without initialising the driver (no
    `is_available()`: a later fork would be unsafe)."""
    from cuda_magic.devices.probe import cuda_device_count, cuda_started

    return cuda_started() or cuda_device_count() > 0


def mps_usable() -> bool:
    from cuda_magic.devices.probe import mps_available

    return mps_available() and hasattr(getattr(sys.modules.get("torch"), "mps", None), "current_allocated_memory")


def xpu_usable() -> bool:
    """An XPU whose allocator torch can read (torch.xpu.memory_reserved and the rest are 2.5+)."""
    xpu = getattr(sys.modules.get("torch"), "xpu", None)
    return (xpu is not None and hasattr(xpu, "memory_reserved") and hasattr(xpu, "is_available")
            and bool(xpu.is_available()))


def choose_meter(device: str | None = None, limit=None):
    """(meter, limit bytes) for a guarded run. `limit`: a `units.Limit` the caller parsed (None: no cap);
    a fraction is taken of the chosen device's capacity (`units.SizeError` where that is not known).

    The session's simulated device when one is on; else CUDA (or ROCm) where torch has a device; else
    MPS; else an XPU; else, with a cap, a simulated device made for this run (so that the same cell
    runs out of memory on a CPU-only machine as on a small GPU); else the CPU.
    """
    from cuda_magic.devices.simulated import SimulatedDevice, active_device

    sim = active_device()
    if sim is not None and device in (None, "sim", "sim:0", "0"):
        return SimMeter(sim), limit.of(sim.capacity) if limit is not None else None
    text = str(device or "")
    if device not in ("cpu", "sim") and not text.startswith(("mps", "xpu")) and cuda_usable():
        torch = sys.modules["torch"]
        meter = CudaMeter(_cuda_index(device, torch))
        return meter, limit.of(meter.capacity() or meter.total()) if limit is not None else None
    if device in (None, "mps") and mps_usable():
        meter = MpsMeter()
        capacity = meter.capacity()
        if limit is None or capacity is not None:
            return meter, limit.of(capacity) if limit is not None else None
        # torch before 2.5 cannot say the size a fraction is of: the cap is simulated below
    elif (device is None or text.startswith("xpu")) and xpu_usable():
        index = int(text.split(":")[-1]) if text.split(":")[-1].isdigit() else 0
        meter = XpuMeter(index)
        if limit is None or hasattr(meter.xpu, "set_per_process_memory_fraction"):
            return meter, limit.of(meter.capacity()) if limit is not None else None
    if limit is not None:            # the device is the cap; the report still says it is one
        cap = limit.of(available_memory())
        return SimMeter(SimulatedDevice(cap), temporary=True), cap
    return CpuMeter(), None


def _cuda_index(device: str | None, torch) -> int:
    if device is None:
        return torch.cuda.current_device() if cuda_started() else 0
    text = str(device).split(":")[-1]
    return int(text) if text.isdigit() else 0


def metered_devices(meter) -> list:
    """The metered device's memory now (DeviceMemory records), read alone where that is cheaper."""
    if meter.key.startswith("sim"):
        return [meter.device.memory()]
    if meter.key == "cpu":
        from cuda_magic.devices.backends import cpu_device

        dev = cpu_device(None)
        # no census here: the process's resident memory is the figure, PyTorch's share unknown
        dev.other_this_process = (dev.torch_allocated or 0) + (dev.other_this_process or 0)
        dev.torch_allocated = None
        return [dev]
    from cuda_magic.devices.backends import read_devices

    return [d for d in read_devices().devices if d.key == meter.key]
