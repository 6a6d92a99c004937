"""A thin NVML layer: lazy start under a lock, one choke point for queries, notes instead of tracebacks.

Every query goes through `Nvml.query`, which turns any NVML error into a default value and a one-line
note, so that one failing call (no permission in a container, a query the driver does not support, a
GPU lost mid-session) never breaks a whole report. pynvml comes from the nvidia-ml-py package.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field


@dataclass
class NvmlDevice:
    """One GPU as NVML sees it. Sizes in bytes (as `nvidia-smi --query-gpu=memory.total,memory.free,
    memory.used`), None where the query failed."""

    nvml_index: int
    name: str
    total: int | None
    free: int | None
    used: int | None
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, used bytes)
    processes_known: bool = True
    notes: list[str] = field(default_factory=list)


class Nvml:
    def __init__(self):
        self._lock = threading.Lock()
        self._started = False
        self._failed: str | None = None
        self._pynvml = None

    def start(self) -> bool:
        """True when NVML answers; otherwise `self.failure` says why, in one line."""
        with self._lock:
            if self._started:
                return True
            if self._failed is not None:
                return False
            try:
                import pynvml
            except ImportError:
                self._failed = "NVML's Python bindings are not installed (pip install nvidia-ml-py)"
                return False
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as exc:
                self._failed = f"NVML is not available ({_reason(exc)})"
                return False
            except OSError as exc:  # a broken driver library can fail to load at all
                self._failed = f"NVML is not available ({exc})"
                return False
            self._pynvml = pynvml
            self._started = True
            return True

    @property
    def failure(self) -> str | None:
        return self._failed

    def shutdown(self) -> None:
        with self._lock:
            if self._started:
                try:
                    self._pynvml.nvmlShutdown()
                except self._pynvml.NVMLError:
                    pass
            self._started = False
            self._failed = None

    def _errors(self) -> tuple:
        """What a failed query raises: NVMLError, and (nvidia-ml-py 12.550.52+) NVMLLibraryMismatchError,
        which is no NVMLError, raised when the bindings call a versioned function the driver lacks."""
        mismatch = getattr(self._pynvml, "NVMLLibraryMismatchError", None)
        return (self._pynvml.NVMLError,) + ((mismatch,) if isinstance(mismatch, type) else ())

    def query(self, fn_name: str, *args, default=None, notes: list | None = None, what: str = ""):
        """Call pynvml.<fn_name>(*args); on an NVML error return `default` and add a note."""
        fn = getattr(self._pynvml, fn_name, None)
        if fn is None:
            if notes is not None:
                notes.append(f"{what or fn_name}: not in this NVML version")
            return default
        try:
            return fn(*args)
        except self._errors() as exc:
            if notes is not None:
                notes.append(f"{what or fn_name} unavailable ({_reason(exc)})")
            return default

    def memory(self, handle, notes: list) -> tuple[int | None, int | None, int | None]:
        """(total, free, used) bytes as CUDA counts them.

        NVML's v1 total includes the memory the driver reserves for itself, which CUDA's total leaves out
        (hundreds of MiB on a large GPU): v2 (`nvmlDeviceGetMemoryInfo(handle, nvmlMemory_v2)`, driver
        R510+) says how much that is, and total - reserved is CUDA's figure. v1 where the driver or the
        bindings lack v2."""
        version = getattr(self._pynvml, "nvmlMemory_v2", None)
        if version is not None:
            try:
                mem = self._pynvml.nvmlDeviceGetMemoryInfo(handle, version)
                reserved = int(mem.reserved)
            except self._errors() + (TypeError, AttributeError):
                pass       # older driver or bindings: v1 below
            else:
                total, free = int(mem.total) - reserved, int(mem.free)
                return total, free, total - free
        mem = self.query("nvmlDeviceGetMemoryInfo", handle, notes=notes, what="memory")
        if mem is None:
            return None, None, None
        return int(mem.total), int(mem.free), int(mem.used)

    def process_list(self, fn_name: str, handle, notes: list) -> list | None:
        """pynvml.<fn_name>(handle), the compute or graphics processes; None (and a note) where unknown.

        The unversioned query calls the driver's `_v3` function. On a driver without it, nvidia-ml-py
        12.550.52+ raises NVMLLibraryMismatchError (12.535 NVMLError_FunctionNotFound): the `_v2` query
        answers there, where the bindings have it."""
        fn = getattr(self._pynvml, fn_name, None)
        if fn is None:
            notes.append("process list: not in this NVML version")
            return None
        mismatch = tuple(c for c in (getattr(self._pynvml, "NVMLLibraryMismatchError", None),
                                     getattr(self._pynvml, "NVMLError_FunctionNotFound", None))
                         if isinstance(c, type))
        try:
            return fn(handle)
        except mismatch:
            if getattr(self._pynvml, f"{fn_name}_v2", None) is not None:
                return self.query(f"{fn_name}_v2", handle, notes=notes, what="process list")
            notes.append("process list unavailable: the NVML bindings (nvidia-ml-py) are newer than the "
                         "driver; install the nvidia-ml-py release matching the driver")
            return None
        except self._errors() as exc:
            notes.append(f"process list unavailable ({_reason(exc)})")
            return None

    def devices(self) -> list[NvmlDevice]:
        """Every GPU NVML sees, in NVML's order (PCI bus order; not yet mapped to CUDA's)."""
        if not self.start():
            return []
        count = self.query("nvmlDeviceGetCount", default=0)
        result = []
        for i in range(count):
            notes: list[str] = []
            handle = self.query("nvmlDeviceGetHandleByIndex", i, notes=notes, what=f"GPU {i}")
            if handle is None:
                result.append(NvmlDevice(i, f"GPU {i}", None, None, None, [], False, notes))
                continue
            name = self.query("nvmlDeviceGetName", handle, default=f"GPU {i}", notes=notes, what="name")
            if isinstance(name, bytes):
                name = name.decode(errors="replace")
            total, free, used = self.memory(handle, notes)
            procs: dict[int, int | None] = {}
            known = True
            for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
                listed = self.process_list(fn, handle, notes)
                if listed is None:
                    known = False
                    continue
                for p in listed:
                    used_p = getattr(p, "usedGpuMemory", None)
                    used_p = int(used_p) if isinstance(used_p, int) and used_p < 2**63 else None
                    pid = int(p.pid)
                    # a process with a compute and a graphics context is listed in both, with the same
                    # memory: one entry per pid
                    prev = procs.get(pid)
                    procs[pid] = used_p if prev is None else max(prev, used_p or 0)
            result.append(NvmlDevice(i, name, total, free, used, sorted(procs.items()), known,
                                     list(dict.fromkeys(notes))))
        return result

    def uuid(self, nvml_index: int) -> str | None:
        handle = self.query("nvmlDeviceGetHandleByIndex", nvml_index)
        if handle is None:
            return None
        value = self.query("nvmlDeviceGetUUID", handle)
        return value.decode() if isinstance(value, bytes) else value

    def process_name(self, pid: int) -> str:
        name = self.query("nvmlSystemGetProcessName", pid)
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        if name:
            return os.path.basename(str(name))
        try:
            with open(f"/proc/{pid}/comm") as fh:
                return fh.read().strip()
        except OSError:
            return ""


def _reason(exc) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0]


def visible_nvml_devices(nvml: Nvml) -> tuple[list[NvmlDevice] | None, list[str]]:
    """(NVML's devices in CUDA's order before torch starts CUDA, notes), CUDA_VISIBLE_DEVICES read by
    torch's rules. None instead of the list where NVML cannot map them (MIG instances)."""
    from cuda_magic.devices.visible import pci_order_known, visible_indices

    devices = nvml.devices()
    indices, note = visible_indices(len(devices), nvml.uuid)
    if indices is None:
        return None, [note]
    picked = [devices[i] for i in indices]
    notes = [note] if note else []
    if len({d.name for d in picked}) > 1 and not pci_order_known():
        notes.append("CUDA numbers GPUs fastest first (CUDA_DEVICE_ORDER is not PCI_BUS_ID): until torch "
                     "uses CUDA, which cuda:N is which GPU here follows NVML's PCI order and may differ")
    return picked, notes


_nvml = Nvml()


def get_nvml() -> Nvml:
    return _nvml
