"""A thin amdsmi layer for ROCm builds of torch: which processes hold memory on an AMD GPU, and how much.

ROCm has no NVML: the process list comes from AMD's `amdsmi` Python package, read the way torch's own
`torch.cuda.list_gpu_processes` reads it on ROCm (torch 2.13 torch/cuda/memory.py). Like devices/nvml.py:
lazy start under a lock, every query through `AmdSmi.query`, which turns an `AmdSmiException` into a
default and a one-line note, so one failing call never breaks a whole report. Only the processes are read
here: the device's totals come from torch once HIP has started.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from cuda_magic.devices.probe import loaded_torch

VISIBILITY_VARIABLES = ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


@dataclass
class AmdSmiDevice:
    """One AMD GPU's process list as amdsmi gives it (`amd-smi process`). The fields that an NvmlDevice
    also has mean the same; name and totals stay None (torch gives them once HIP has started)."""

    amdsmi_index: int | None
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, VRAM bytes)
    processes_known: bool = False
    notes: list[str] = field(default_factory=list)
    process_names: dict[int, str] = field(default_factory=dict)   # pid -> what amdsmi calls it
    name: str | None = None
    total: int | None = None
    free: int | None = None


def hip_build() -> bool:
    """Whether the loaded torch is a ROCm build (its CUDA devices are AMD GPUs, with no NVML)."""
    version = getattr(loaded_torch(), "version", None)
    return bool(getattr(version, "hip", None))


class AmdSmi:
    def __init__(self):
        self._lock = threading.Lock()
        self._started = False
        self._failed: str | None = None
        self._amdsmi = None
        self._indices: dict[int, tuple[int, str | None]] = {}   # HIP index -> (amdsmi index, its doubt)

    def start(self) -> bool:
        """True when amdsmi answers; otherwise `self.failure` says why, in one line."""
        with self._lock:
            if self._started or self._failed is not None:
                return self._started
            try:
                # on ROCm builds torch has imported it already (with its hook against a second copy of
                # libamd_smi.so): this finds that module
                import amdsmi
            except ImportError:
                self._failed = "amdsmi (ROCm's Python package) is not installed: pip install amdsmi"
                return False
            except OSError as exc:     # the package loads libamd_smi.so when imported
                self._failed = f"amdsmi unavailable ({_reason(exc)})"
                return False
            try:
                amdsmi.amdsmi_init()
            except amdsmi.AmdSmiException as exc:
                self._failed = f"amdsmi unavailable ({_reason(exc)})"
                return False
            self._amdsmi = amdsmi
            self._started = True
            return True

    @property
    def failure(self) -> str | None:
        return self._failed

    def shutdown(self) -> None:
        with self._lock:
            if self._started:
                try:
                    self._amdsmi.amdsmi_shut_down()
                except self._amdsmi.AmdSmiException:
                    pass          # shutting down: nothing is left to report to
            self._started = False
            self._failed = None
            self._indices.clear()

    def query(self, fn_name: str, *args, default=None, notes: list | None = None, what: str = ""):
        """amdsmi.<fn_name>(*args); on an amdsmi error return `default` and add a note."""
        fn = getattr(self._amdsmi, fn_name, None)
        if fn is None:
            if notes is not None:
                notes.append(f"{what or fn_name}: not in this amdsmi version")
            return default
        try:
            return fn(*args)
        except self._amdsmi.AmdSmiException as exc:
            if notes is not None:
                notes.append(f"{what or fn_name} unavailable ({_reason(exc)})")
            return default

    def device(self, hip_index: int) -> AmdSmiDevice | None:
        """The process list of HIP device `hip_index` (torch's cuda:N); None where amdsmi does not start
        (`failure` says why)."""
        if not self.start():
            return None
        notes: list[str] = []
        index = self.amdsmi_index(hip_index, notes)
        listed = None if index is None else self.processes(index, notes)
        record = AmdSmiDevice(index, notes=list(dict.fromkeys(notes)))
        if listed is not None:
            record.processes = sorted((pid, used) for pid, used, _ in listed)
            record.process_names = {pid: name for pid, _, name in listed}
            record.processes_known = True
        return record

    def amdsmi_index(self, hip_index: int, notes: list) -> int | None:
        """amdsmi's number for HIP device `hip_index`: the two differ (amdsmi's order is not HIP's, and
        HIP_VISIBLE_DEVICES renumbers HIP's). torch's own mapping where this torch has it
        (torch/cuda/__init__.py _get_amdsmi_device_index); else the same number, with a note where a
        visibility variable makes that doubtful."""
        if hip_index not in self._indices:
            cuda = getattr(loaded_torch(), "cuda", None)
            helper = getattr(cuda, "_get_amdsmi_device_index", None)
            # used by capability: torch 2.4 to 2.11 have the helper but flag their amdsmi import as
            # _HAS_PYNVML (_HAS_AMDSMI is 2.13's), and their helper only reads HIP_VISIBLE_DEVICES; 2.13's
            # also asks torch's own `amdsmi` import, which fails (NameError) where that import did
            if helper is None:
                self._indices[hip_index] = (hip_index, self._doubt(hip_index))
            else:
                try:
                    self._indices[hip_index] = (int(helper(hip_index)), None)
                except (RuntimeError, self._amdsmi.AmdSmiException) as exc:
                    notes.append(f"which amdsmi GPU is cuda:{hip_index} is not known ({_reason(exc)})")
                    return None
                except (NameError, AttributeError, ImportError, TypeError, ValueError):
                    self._indices[hip_index] = (hip_index, self._doubt(hip_index))
        index, doubt = self._indices[hip_index]
        if doubt:
            notes.append(doubt)         # every reading says it, not only the first
        return index

    @staticmethod
    def _doubt(hip_index: int) -> str | None:
        set_here = [v for v in VISIBILITY_VARIABLES if os.environ.get(v) is not None]
        if not set_here:
            return None
        return (f"{set_here[0]} is set and this torch cannot map HIP devices to amdsmi's: cuda:{hip_index} "
                f"is read as amdsmi GPU {hip_index}, which may be another GPU")

    def processes(self, index: int, notes: list) -> list[tuple[int, int | None, str]] | None:
        """(pid, VRAM bytes, name) of each process on amdsmi GPU `index`; None (and a note) where unknown:
        a list missing one process would show less than other processes hold."""
        handles = self.query("amdsmi_get_processor_handles", notes=notes, what="GPU list")
        if handles is None:
            return None
        if not 0 <= index < len(handles):
            notes.append(f"amdsmi lists {len(handles)} GPU(s), not GPU {index}")
            return None
        handle = handles[index]
        listed = self.query("amdsmi_get_gpu_process_list", handle, notes=notes, what="process list")
        if listed is None:
            return None
        found = []
        for entry in listed:
            info = self._process_info(handle, entry, notes)
            if info is None:
                return None
            found.append(info)
        return found

    def _process_info(self, handle, entry, notes: list) -> tuple[int, int | None, str] | None:
        """(pid, VRAM bytes, name) of one listed process. amdsmi before its commit c551c3c (April 2024)
        lists process handles that `amdsmi_get_gpu_process_info` turns into a dict; later versions list
        the dicts and have no such function."""
        info = entry if isinstance(entry, dict) else self.query(
            "amdsmi_get_gpu_process_info", handle, entry, notes=notes, what="process details")
        if info is None:
            return None
        try:
            pid = int(info["pid"])
            used = info["memory_usage"]["vram_mem"]
        except (KeyError, TypeError, ValueError):
            notes.append("process list: amdsmi answered in a form this version of cuda_magic does not read")
            return None
        name = str(info.get("name") or "")
        return (pid, int(used) if isinstance(used, int) and used >= 0 else None,
                "" if name == "N/A" else os.path.basename(name))


def _reason(exc) -> str:
    """One line: amdsmi's library errors print as 'Error code:\\n\\t<n> | <status - words>'."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return " ".join(lines) or type(exc).__name__


_amdsmi = AmdSmi()


def get_amdsmi() -> AmdSmi:
    return _amdsmi
