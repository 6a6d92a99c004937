"""Device backends: where each device's memory is, as DeviceMemory records whose parts add up.

CUDA reads torch's allocator statistics only where torch has already initialised CUDA, and NVML for
device totals, this process's share and the other processes; where torch has not touched CUDA, NVML
alone answers, so reading memory never creates a CUDA context. ROCm builds have no NVML: amdsmi lists
the processes there, and where no list says how much this process holds, its share and other processes'
stay unknown (None) rather than one counted as the other. MPS reads torch.mps; with no GPU at all
the CPU is shown (process memory, CPU tensors). The session's simulated device comes first when active.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from cuda_magic.devices.probe import cuda_device_count, cuda_started, loaded_torch, mps_available
from cuda_magic.devices.proc import process_rss, shared_reader
from cuda_magic.devices.readings import DeviceMemory, ProcessMemory
from cuda_magic.devices.amdsmi import AmdSmiDevice, get_amdsmi, hip_build
from cuda_magic.devices.nvml import NvmlDevice, get_nvml, visible_nvml_devices


@dataclass
class DeviceReading:
    devices: list[DeviceMemory]
    processes: list[ProcessMemory] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    gpu_present: bool = False


def _has_context(torch, index: int) -> bool:
    probe = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    return bool(probe(index)) if probe is not None else True


def _nvml_for_torch(nvml, torch, count: int, notes: list[str]) -> list:
    """NVML's record of each of torch's started CUDA devices, matched by UUID (torch 2.4+ reports it);
    by CUDA_VISIBLE_DEVICES order where torch does not say. None where NVML has no match (a MIG instance)."""
    from cuda_magic.devices.visible import torch_uuid

    uuids = [torch_uuid(torch, i) for i in range(count)]
    if None in uuids:
        nv, map_notes = visible_nvml_devices(nvml)
        notes.extend(map_notes)
        nv = nv or []
        return [nv[i] if i < len(nv) else None for i in range(count)]
    by_uuid = {nvml.uuid(d.nvml_index): d for d in nvml.devices()}
    return [by_uuid.get(u) for u in uuids]


def nvml_records(notes: list[str]) -> list[NvmlDevice | None] | None:
    """NVML's record of cuda:0, cuda:1, ...: once torch has started CUDA, matched by the UUID torch reports
    (CUDA numbers GPUs fastest first, NVML by PCI bus); before, by CUDA_VISIBLE_DEVICES over NVML's
    order, since asking torch would start CUDA. None where NVML cannot say (MIG before CUDA starts)."""
    nvml = get_nvml()
    if cuda_started():
        torch = loaded_torch()
        return _nvml_for_torch(nvml, torch, int(torch.cuda.device_count()), notes)
    records, map_notes = visible_nvml_devices(nvml)
    notes.extend(map_notes)
    return records


def nvml_record_for(index: int, notes: list[str]) -> NvmlDevice | None:
    """NVML's record of cuda:index, as `%gpumem` matches it (nvml_records)."""
    records = nvml_records(notes) or []
    return records[index] if index < len(records) else None


def gpu_record_for(index: int, notes: list[str]) -> NvmlDevice | AmdSmiDevice | None:
    """What lists the processes on cuda:index: amdsmi on a ROCm build (there is no NVML), else NVML."""
    if hip_build():
        record = get_amdsmi().device(index)
        if record is None:
            notes.append(get_amdsmi().failure)
        return record
    return nvml_record_for(index, notes)


def _cuda_records(initialized: bool, notes: list[str]) -> list:
    """One record per CUDA device (NvmlDevice, AmdSmiDevice or None where nothing answers)."""
    if hip_build():
        torch = loaded_torch()
        count = int(torch.cuda.device_count()) if initialized else cuda_device_count()
        amd = get_amdsmi()
        records = [amd.device(i) for i in range(count)]
        if count and amd.failure:
            notes.append(f"{amd.failure}; this process's and other processes' shares are not known")
        return records
    nvml = get_nvml()
    nv = nvml_records(notes)
    if initialized:
        if not any(nv) and nvml.failure:
            notes.append(f"{nvml.failure}; figures come from torch alone")
        return nv
    if nv is None or (not nv and nvml.failure):
        # NVML absent is not "no GPU": compute-only containers have devices torch sees
        count = cuda_device_count()
        if count and nv is not None:
            notes.append(f"{nvml.failure}: torch sees {count} GPU(s); their figures appear once torch "
                         "uses them")
        return [None] * count
    return nv


def _this_process_share(info, initialized: bool, reserved: int = 0, in_use: bool = False):
    """(this process's bytes on the device by its process list, the pid the list names it by): None for
    the bytes where the list cannot say (NVML's "not available" included: unknown, not 0; in a container,
    where this process's entry cannot be told apart: devices/pids.py)."""
    from cuda_magic.devices.pids import this_process_pid

    if info is None or not info.processes_known:
        return None, None
    if initialized and not info.processes:
        return None, None  # an empty list once CUDA is in use here does not see this process
    own, known = this_process_pid(info.processes, reserved, in_use)
    if not known:
        return None, None
    used = [u for pid, u in info.processes if pid == own]
    if any(u is None for u in used):
        return None, own
    return sum(used), own


def _split_used(dev: DeviceMemory, used: int, this_proc: int | None, reserved: int, in_use: bool) -> None:
    """Split what is used beyond torch's reserve into this process's rest and other processes'."""
    if this_proc is not None and this_proc >= reserved:
        dev.other_this_process = this_proc - reserved
        dev.other_processes = max(0, used - this_proc)
    elif this_proc is None and in_use:
        # this process's context holds memory here and no process list says how much: calling the rest
        # other processes' would blame them for our own context (ROCm without amdsmi, NVML without a
        # list); the note of what failed says why
        dev.other_this_process = dev.other_processes = None
    else:
        dev.other_this_process = None if reserved else 0
        dev.other_processes = max(0, used - reserved)
        if reserved:
            dev.notes.append("the GPU's process list does not show this process here (a container?): "
                             "its CUDA context is counted under other processes")


def cuda_devices(notes: list[str]) -> tuple[list[DeviceMemory], list[ProcessMemory]]:
    torch = loaded_torch()
    initialized = cuda_started()
    records = _cuda_records(initialized, notes)
    devices, processes = [], []
    for i, info in enumerate(records):
        dnotes = list(info.notes) if info else []
        total = info.total if info else None
        free = info.free if info else None
        name = info.name if info and info.name else None
        allocated = reserved = peak = 0
        in_use = False
        if initialized:
            allocated = int(torch.cuda.memory_allocated(i))
            reserved = int(torch.cuda.memory_reserved(i))
            peak = int(torch.cuda.max_memory_allocated(i))
            in_use = _has_context(torch, i)
            if in_use:
                free_t, total_t = torch.cuda.mem_get_info(i)
                free, total = int(free_t), int(total_t)
            if name is None:
                name = torch.cuda.get_device_name(i)
        this_proc, own = _this_process_share(info, initialized, reserved, in_use)
        dev = DeviceMemory(key=f"cuda:{i}", name=name or f"GPU {i}", kind="cuda", capacity=total,
                           torch_allocated=allocated, torch_cached=reserved - allocated,
                           peak=peak if initialized else None, notes=dnotes)
        if total is not None and free is not None:
            _split_used(dev, total - free, this_proc, reserved, in_use)
            dev.free = free
        else:
            dev.other_this_process = dev.other_processes = dev.free = None
            dev.notes.append("device totals unknown")
        if not initialized:
            dev.notes.append("torch has not used this GPU yet in this process")
        devices.append(dev)
        if info is not None:
            for pid, used_p in info.processes:
                processes.append(ProcessMemory(device=dev.key, pid=pid, used=used_p,
                                               name=_process_name(info, pid), user=_user_of(pid),
                                               this_process=pid == own))
    return devices, processes


def _process_name(info, pid: int) -> str:
    if isinstance(info, AmdSmiDevice):
        return info.process_names.get(pid, "")
    return get_nvml().process_name(pid)


def mps_device() -> DeviceMemory | None:
    torch = loaded_torch()
    if torch is None or not mps_available():
        return None
    from cuda_magic.devices.allocator_conf import mps_capacity

    allocated = int(torch.mps.current_allocated_memory())
    driver = int(torch.mps.driver_allocated_memory())
    recommended = int(torch.mps.recommended_max_memory()) if hasattr(torch.mps, "recommended_max_memory") else None
    capacity = mps_capacity(recommended)      # torch's limit: high-watermark ratio x recommended (or the RAM)
    free = max(0, capacity - driver) if capacity is not None else None   # torch counts the driver's memory
    return DeviceMemory(key="mps", name="Apple MPS", kind="mps", capacity=capacity,
                        torch_allocated=allocated, torch_cached=max(0, driver - allocated),
                        other_this_process=0, other_processes=None, free=free,
                        peak=None, peak_exact=False,
                        notes=["MPS keeps no peak counter",
                               "capacity is torch's limit for this process (PYTORCH_MPS_HIGH_WATERMARK_RATIO, "
                               "default 1.7, times Metal's recommended working set); other processes share "
                               "the unified memory and are not known"])


def xpu_devices() -> list[DeviceMemory]:
    """Intel XPUs torch has started, from its allocator counters (torch 2.5+). None listed before torch
    uses them: reading their properties would start the runtime."""
    torch = loaded_torch()
    xpu = getattr(torch, "xpu", None)
    if xpu is None or not hasattr(xpu, "memory_reserved") or not getattr(xpu, "is_initialized", lambda: False)():
        return []
    devices = []
    for i in range(int(xpu.device_count())):
        props = xpu.get_device_properties(i)
        allocated, reserved = int(xpu.memory_allocated(i)), int(xpu.memory_reserved(i))
        capacity = int(props.total_memory)
        devices.append(DeviceMemory(key=f"xpu:{i}", name=str(getattr(props, "name", f"XPU {i}")), kind="xpu",
                                    capacity=capacity, torch_allocated=allocated,
                                    torch_cached=reserved - allocated, other_this_process=None,
                                    other_processes=None, free=None,
                                    peak=int(xpu.max_memory_allocated(i)),
                                    notes=["XPU: other processes' memory is not known here"]))
    return devices


def cpu_device(tensor_bytes: int | None) -> DeviceMemory:
    reader = shared_reader()            # descriptors opened once per process: read per guarded cell
    total, available = reader.memory()
    rss, hwm = reader.rss_and_peak()
    if rss is None and hwm is None:     # no /proc (macOS, Windows)
        rss, hwm = process_rss()
    dev = DeviceMemory(key="cpu", name="CPU memory", kind="cpu", capacity=total,
                       torch_cached=0, peak=hwm, peak_exact=False,
                       notes=["peak is the operating system's resident peak (approximate)"])
    if rss is None:
        rss = tensor_bytes or 0
    allocated = min(tensor_bytes, rss) if tensor_bytes is not None else 0
    dev.torch_allocated = allocated
    dev.other_this_process = rss - allocated
    if total is not None and available is not None:
        dev.other_processes = max(0, total - available - rss)
        dev.free = total - rss - dev.other_processes   # MemAvailable, unless it counts our own pages
    else:
        dev.other_processes = dev.free = None
    return dev


def read_devices(*, cpu_tensor_bytes: int | None = None) -> DeviceReading:
    """Every device, the simulated one first; with no GPU, the CPU view and a note saying so."""
    from cuda_magic.devices.simulated import active_device

    reading = DeviceReading(devices=[])
    sim = active_device()
    if sim is not None:
        reading.devices.append(sim.memory())
    cuda, procs = cuda_devices(reading.notes)
    reading.devices.extend(cuda)
    reading.processes.extend(procs)
    mps = mps_device()
    if mps is not None:
        reading.devices.append(mps)
    xpus = xpu_devices()
    reading.devices.extend(xpus)
    reading.gpu_present = bool(cuda or mps or xpus)
    if not reading.gpu_present:
        nvml_failure = get_nvml().failure
        found = f"No GPU found: {nvml_failure}." if nvml_failure else "No GPU found."
        if sim is not None:
            reading.notes.insert(0, f"{found} The simulated device stands in for one; this process's CPU "
                                    "memory follows.")
        else:
            reading.notes.insert(0, f"{found} Showing this process's CPU memory and CPU tensors.")
    if not reading.gpu_present:
        reading.devices.append(cpu_device(cpu_tensor_bytes))
    return reading


def _user_of(pid: int) -> str:
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return ""
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return str(uid)
