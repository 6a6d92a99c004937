"""What a device reading is: one device's memory split into parts that add up to its capacity, and
the processes using a GPU. Plain records, sizes in int bytes, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

#: The parts a device's capacity is split into, in display order. They add up to the capacity.
PARTS = ("torch_allocated", "torch_cached", "other_this_process", "other_processes", "free")
PART_LABELS = {
    "torch_allocated": "PyTorch allocated",
    "torch_cached": "PyTorch cached",
    "other_this_process": "other (this process)",
    "other_processes": "other processes",
    "free": "free",
}


@dataclass
class DeviceMemory:
    """One device's memory at one moment. All sizes in bytes; None where unknown."""

    key: str                      # 'cuda:0', 'mps', 'cpu', 'sim:0'
    name: str                     # 'NVIDIA H200', 'simulated GPU', 'CPU (no GPU)'
    kind: str                     # 'cuda', 'mps', 'cpu', 'simulated'
    capacity: int | None
    torch_allocated: int | None = 0
    torch_cached: int | None = 0
    other_this_process: int | None = 0
    other_processes: int | None = 0
    free: int | None = None
    peak: int | None = None       # peak of torch_allocated since the last reset
    peak_exact: bool = True       # False: the operating system's figure, not the allocator's
    notes: list[str] = field(default_factory=list)

    def parts(self) -> dict[str, int | None]:
        return {p: getattr(self, p) for p in PARTS}

    def as_row(self) -> dict:
        row = {"device": self.key, "name": self.name, "kind": self.kind, "capacity": self.capacity}
        row.update(self.parts())
        row["peak"] = self.peak
        row["peak_exact"] = self.peak_exact
        return row


@dataclass
class ProcessMemory:
    """A process using a GPU (from NVML), as `nvidia-smi --query-compute-apps` lists it."""

    device: str
    pid: int
    used: int | None              # bytes; None where the driver does not say (some containers)
    name: str = ""
    user: str = ""
    this_process: bool = False
