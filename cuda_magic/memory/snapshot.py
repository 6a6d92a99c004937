"""The memory records: tensors, a snapshot, the diff of two snapshots, a watched cell.

Nothing here holds a tensor or imports torch; every size is an int in bytes. pandas is imported only
when a table is asked for.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from cuda_magic.reprs import Rendered

from cuda_magic.devices.readings import PARTS, DeviceMemory, ProcessMemory

@dataclass
class TensorRecord:
    """One live storage: counted once however many tensors view it. Holds no reference to it."""

    storage_id: int               # stable while the storage lives (the StorageImpl pointer)
    names: list[str]
    shape: tuple
    dtype: str
    device: str
    nbytes: int                   # the storage's bytes
    grad_fn: bool                 # whether a tensor on it carries an autograd graph
    views: int = 1                # how many live tensors were found on this storage
    kind: str = "other"           # memory.kinds.KINDS: what reaches it (parameter, gradient, ...)

    def as_row(self) -> dict:
        return {
            "names": ", ".join(self.names) if self.names else "(unnamed)",
            "shape": tuple(self.shape), "dtype": self.dtype, "device": self.device,
            "bytes": self.nbytes, "grad_fn": self.grad_fn, "views": self.views,
            "kind": self.kind,
        }


TENSOR_COLUMNS = ("names", "shape", "dtype", "device", "bytes", "grad_fn", "views", "kind")
BY_KIND_COLUMNS = ("device", "kind", "bytes")
DEVICE_COLUMNS = ("device", "name", "kind", "capacity", *PARTS, "peak", "peak_exact")


@dataclass(repr=False)
class Snapshot(Rendered):
    """Where memory was at one moment. `.devices` and `.tensors` are pandas DataFrames."""

    device_list: list[DeviceMemory]
    tensor_list: list[TensorRecord]          # largest first
    processes: list[ProcessMemory] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    taken_at: float = field(default_factory=time.time)
    tensor_count: int = 0                    # distinct storages found (tensor_list may be cut to top N)
    tensor_bytes: dict[str, int] = field(default_factory=dict)  # per device key, all storages found
    top: int = 10                            # how many of tensor_list to display
    kind_bytes: dict[str, dict[str, int]] = field(default_factory=dict)  # device key -> kind -> bytes

    @property
    def devices(self):
        import pandas as pd

        return pd.DataFrame([d.as_row() for d in self.device_list], columns=list(DEVICE_COLUMNS))

    @property
    def tensors(self):
        import pandas as pd

        return pd.DataFrame([t.as_row() for t in self.tensor_list], columns=list(TENSOR_COLUMNS))

    @property
    def by_kind(self):
        """Bytes per device and kind (memory.kinds.KINDS, then 'unseen' where allocated exceeds them)."""
        import pandas as pd

        shown = [d.key for d in self.device_list]
        rows = [{"device": key, "kind": kind, "bytes": nbytes}
                for key in shown for kind, nbytes in self.kind_bytes.get(key, {}).items()]
        return pd.DataFrame(rows, columns=list(BY_KIND_COLUMNS))

    def device(self, key: str) -> DeviceMemory | None:
        for d in self.device_list:
            if d.key == key:
                return d
        return None


@dataclass
class DeviceDelta:
    key: str
    changes: dict[str, int]                  # part -> bytes after minus before (None parts skipped)


@dataclass(repr=False)
class SnapshotDiff(Rendered):
    """What changed between two snapshots."""

    before: Snapshot
    after: Snapshot
    device_deltas: list[DeviceDelta]
    appeared: list[TensorRecord]
    went: list[TensorRecord]


def diff(before: Snapshot, after: Snapshot) -> SnapshotDiff:
    """What changed from one `snapshot()` to a later one: per device, and the storages that appeared and went."""
    for name, value in (("before", before), ("after", after)):
        if not isinstance(value, Snapshot):
            raise TypeError(f"diff() takes two snapshot() results; {name} is a {type(value).__name__}")
    deltas = []
    for dev in after.device_list:
        old = before.device(dev.key)
        if old is None:
            continue
        changes = {}
        for part in PARTS:
            a, b = getattr(old, part), getattr(dev, part)
            if a is not None and b is not None:
                changes[part] = b - a
        deltas.append(DeviceDelta(dev.key, changes))
    # A freed storage's address can be reused by a new one: identity is the address with what it holds.
    def ident(t):
        return (t.storage_id, t.nbytes, t.device, t.dtype)

    old_ids = {ident(t): t for t in before.tensor_list}
    new_ids = {ident(t): t for t in after.tensor_list}
    appeared = [t for k, t in new_ids.items() if k not in old_ids]
    went = [t for k, t in old_ids.items() if k not in new_ids]
    return SnapshotDiff(before, after, deltas, appeared, went)


@dataclass
class CellRecord:
    """One cell seen by `%gpumem --watch`: its change in allocated bytes, exact peak and duration."""

    cell: int                                # the execution count
    allocated_delta: int                     # allocated bytes after the cell minus before
    peak: int | None                         # peak allocated bytes during the cell
    peak_exact: bool                         # False: the operating system's figure
    duration: float                          # seconds
    device: str                              # device key the figures are for
    allocated_after: int | None = None       # allocated bytes when the cell ended
    capacity: int | None = None              # the device's capacity, where known
    outcome: str | None = None               # 'ok', 'oom' (ran out of memory), 'error'; None: not known

    def as_row(self) -> dict:
        return {"cell": self.cell, "device": self.device, "allocated_delta": self.allocated_delta,
                "allocated_after": self.allocated_after, "peak": self.peak, "peak_exact": self.peak_exact,
                "duration": self.duration}


CELL_COLUMNS = ("cell", "device", "allocated_delta", "allocated_after", "peak", "peak_exact", "duration")
