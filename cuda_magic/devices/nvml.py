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
                self._failed = "NVML bindings missing: pip install nvidia-ml-py"
                return False
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as exc:
                self._failed = f"NVML unavailable ({_reason(exc)})"
                return False
            except OSError as exc:  # a broken driver library can fail to load at all
                self._failed = f"NVML unavailable ({exc})"
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

    def query(self, fn_name: str, *args, default=None, notes: list | None = None, what: str = ""):
        """Call pynvml.<fn_name>(*args); on an NVML error return `default` and add a note."""
        fn = getattr(self._pynvml, fn_name, None)
        if fn is None:
            if notes is not None:
                notes.append(f"{what or fn_name}: not in this NVML version")
            return default
        try:
            return fn(*args)
        except self._pynvml.NVMLError as exc:
            if notes is not None:
                notes.append(f"{what or fn_name} unavailable ({_reason(exc)})")
            return default

    def devices(self) -> list[NvmlDevice]:
        """Every GPU NVML sees, in NVML's order (not yet mapped through CUDA_VISIBLE_DEVICES)."""
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
            mem = self.query("nvmlDeviceGetMemoryInfo", handle, notes=notes, what="memory")
            total = free = used = None
            if mem is not None:
                total, free, used = int(mem.total), int(mem.free), int(mem.used)
            procs: dict[int, int | None] = {}
            known = True
            for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
                listed = self.query(fn, handle, notes=notes, what="process list")
                if listed is None:
                    known = False
                    continue
                for p in listed:
                    used_p = getattr(p, "usedGpuMemory", None)
                    used_p = int(used_p) if isinstance(used_p, int) and used_p < 2**63 else None
                    prev = procs.get(int(p.pid))
                    procs[int(p.pid)] = used_p if prev is None else prev + (used_p or 0)
            result.append(NvmlDevice(i, name, total, free, used, sorted(procs.items()), known, notes))
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


def visible_nvml_devices(nvml: Nvml) -> list[NvmlDevice]:
    """NVML's devices in CUDA's order, as CUDA_VISIBLE_DEVICES makes them visible to this process."""
    devices = nvml.devices()
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        return devices
    picked = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            break
        if item.lstrip("-").isdigit():
            idx = int(item)
            if idx < 0 or idx >= len(devices):
                break  # CUDA stops at the first invalid entry
            picked.append(devices[idx])
            continue
        match = [d for d in devices if (nvml.uuid(d.nvml_index) or "").startswith(item)]
        if len(match) != 1:
            break
        picked.append(match[0])
    return picked


_nvml = Nvml()


def get_nvml() -> Nvml:
    return _nvml
