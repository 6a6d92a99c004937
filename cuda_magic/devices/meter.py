"""Meters: the allocated bytes, exact peak and capacity of the one device a guarded run is measured on,
and the `-l` cap. One small interface over CUDA (torch's counters), the simulated device and the CPU."""
from __future__ import annotations

import sys
from contextlib import contextmanager


class SimMeter:
    def __init__(self, device, temporary: bool = False):
        self.device = device
        self.temporary = temporary    # made for this run by -l: started and stopped around it
        self.key = device.key

    def allocated(self) -> int:
        return self.device.allocated

    def reserved(self) -> int:
        return self.device.allocated

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
            with self.device.limited(limit):
                yield
        else:
            yield


class CudaMeter:
    def __init__(self, index: int):
        import torch

        self.torch = torch
        self.index = index
        self.key = f"cuda:{index}"

    def _ready(self) -> bool:
        return bool(self.torch.cuda.is_initialized())

    def allocated(self) -> int | None:
        return int(self.torch.cuda.memory_allocated(self.index)) if self._ready() else 0

    def reserved(self) -> int | None:
        return int(self.torch.cuda.memory_reserved(self.index)) if self._ready() else 0

    def capacity(self) -> int:
        return int(self.torch.cuda.get_device_properties(self.index).total_memory)

    def reset_peak(self) -> None:
        if self._ready():
            self.torch.cuda.reset_peak_memory_stats(self.index)

    def peak(self) -> int | None:
        return int(self.torch.cuda.max_memory_allocated(self.index)) if self._ready() else None

    @contextmanager
    def running(self, limit: int | None = None):
        if limit is None:
            yield
            return
        cuda = self.torch.cuda
        getter = getattr(cuda, "get_per_process_memory_fraction", None)
        old = getter(self.index) if getter is not None else 1.0
        cuda.set_per_process_memory_fraction(min(1.0, limit / self.capacity()), self.index)
        try:
            yield
        finally:
            cuda.set_per_process_memory_fraction(old, self.index)


class CpuMeter:
    """The process's resident memory: approximate, since Python and the allocator keep pages."""

    key = "cpu"

    def __init__(self):
        from cuda_magic.devices.proc import shared_reader

        self.proc = shared_reader()

    def allocated(self) -> int | None:
        return self.proc.rss_and_peak()[0]

    reserved = allocated

    def capacity(self) -> int | None:
        from cuda_magic.devices.proc import meminfo

        return meminfo().get("MemTotal")

    def reset_peak(self) -> None:
        self.proc.reset_peak()

    def peak(self) -> int | None:
        return self.proc.rss_and_peak()[1]

    @contextmanager
    def running(self, limit: int | None = None):
        yield


def available_memory() -> int | None:
    from cuda_magic.devices.proc import meminfo

    return meminfo().get("MemAvailable")


def cuda_usable() -> bool:
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def choose_meter(device: str | None = None, limit_text: str | None = None, parse_limit=None):
    """(meter, limit bytes) for a guarded run.

    The session's simulated device when one is on; else CUDA when torch can use it; else, with a `-l`
    cap, a simulated device made for this run (so that the same cell runs out of memory on a CPU-only
    machine as on a small GPU); else the CPU. `parse_limit(text, capacity)` turns the cap into bytes.
    """
    from cuda_magic.devices.simulated import SimulatedDevice, active_device

    sim = active_device()
    if sim is not None and device in (None, "sim", "sim:0", "0"):
        limit = parse_limit(limit_text, sim.capacity) if limit_text else None
        return SimMeter(sim), limit
    if cuda_usable() and device not in ("cpu", "sim"):
        torch = sys.modules["torch"]
        index = _cuda_index(device, torch)
        meter = CudaMeter(index)
        limit = parse_limit(limit_text, meter.capacity()) if limit_text else None
        return meter, limit
    if limit_text:
        limit = parse_limit(limit_text, available_memory())
        return SimMeter(SimulatedDevice(limit), temporary=True), None
    return CpuMeter(), None


def _cuda_index(device: str | None, torch) -> int:
    if device is None:
        return torch.cuda.current_device() if torch.cuda.is_initialized() else 0
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
