"""What the live gauge and `%gpumem` read on real GPUs, against torch's, NVML's and amdsmi's own APIs faked
at their public surface: the gauge's process list on NVIDIA (the same device `%gpumem` matches, by UUID
once CUDA has started), and ROCm, where there is no NVML and amdsmi lists the processes (issue 19)."""
from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pynvml
import pytest

from test_nvml_backends import FakeGpu, FakeNvml, GiB, ME, OTHER, THIRD

from cuda_magic.devices import amdsmi as amdsmi_layer
from cuda_magic.devices.backends import read_devices
from cuda_magic.devices.gauge_reader import GaugeReader
from cuda_magic.devices.meter import CudaMeter

torch = pytest.importorskip("torch")


@pytest.fixture
def fresh_amdsmi(monkeypatch):
    """A new amdsmi singleton for this test (the module's one remembers its first failure and its map)."""
    monkeypatch.setattr(amdsmi_layer, "_amdsmi", amdsmi_layer.AmdSmi())


@pytest.fixture
def clean_env(monkeypatch):
    if torch.cuda.is_initialized():
        pytest.skip("torch has initialised CUDA in this process: its figures would mix with the fakes")
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)


def _nested_stats(allocated: int, reserved: int) -> dict:
    # torch 2.13 torch/cuda/memory.py memory_stats_as_nested_dict: torch._C._cuda_memoryStats(device), a
    # dict per statistic of {"all", "small_pool", "large_pool"}, each {"current", "peak", "allocated",
    # "freed"}
    def stat(current):
        entry = {"current": current, "peak": current, "allocated": current, "freed": 0}
        return {"all": dict(entry), "small_pool": dict(entry, current=0, peak=0), "large_pool": dict(entry)}

    return {"allocated_bytes": stat(allocated), "reserved_bytes": stat(reserved),
            "num_alloc_retries": 0, "num_ooms": 0}


def _started_cuda(monkeypatch, gpus: list[dict]):
    """torch.cuda once CUDA (or HIP) has started on len(gpus) devices. Each: uuid (as torch 2.4+ reports
    it, without 'GPU-'), total, free, reserved, allocated, context. From torch 2.13 torch/cuda/__init__.py
    (is_initialized, device_count, get_device_properties, get_device_name) and torch/cuda/memory.py
    (memory_allocated, memory_reserved, max_memory_allocated, mem_get_info -> (free, total),
    memory_stats_as_nested_dict); torch._C._cuda_hasPrimaryContext(i) says whether device i has a context."""
    from cuda_magic.devices import probe

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(cuda, "memory_allocated", lambda i=None: gpus[i]["allocated"])
    monkeypatch.setattr(cuda, "memory_reserved", lambda i=None: gpus[i]["reserved"])
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda i=None: gpus[i]["allocated"])
    monkeypatch.setattr(cuda, "mem_get_info", lambda i=None: (gpus[i]["free"], gpus[i]["total"]))
    monkeypatch.setattr(cuda, "memory_stats_as_nested_dict",
                        lambda i=None: _nested_stats(gpus[i]["allocated"], gpus[i]["reserved"]))
    monkeypatch.setattr(cuda, "get_device_name", lambda i=None: f"torch GPU {i}")
    monkeypatch.setattr(cuda, "get_device_properties", lambda i: SimpleNamespace(
        name=f"torch GPU {i}", total_memory=gpus[i]["total"], uuid=gpus[i].get("uuid")))
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda i: gpus[i]["context"], raising=False)
    monkeypatch.setattr(probe, "_gpu", None)


# ------------------------------------------------------------------------------------- NVIDIA

def _nvml_gpus():
    return [
        FakeGpu("NVIDIA A100-SXM4-40GB", 40 * GiB, 13 * GiB, "GPU-aaaa1111-0000",
                compute=[(ME, 3 * GiB), (OTHER, 10 * GiB)]),
        FakeGpu("NVIDIA A100-SXM4-40GB", 40 * GiB, 6 * GiB, "GPU-bbbb2222-0000",
                compute=[(THIRD, 4 * GiB)], graphics=[(OTHER, 2 * GiB)]),
        FakeGpu("Tesla T4", 16 * GiB, 0, "GPU-cccc3333-0000"),
    ]


def test_the_gauge_reads_other_processes_from_nvml_before_cuda_starts(clean_env, fresh_nvml, monkeypatch):
    FakeNvml(_nvml_gpus()).install(monkeypatch)
    first = GaugeReader(CudaMeter(0)).read()
    assert (first.allocated, first.reserved, first.peak) == (0, 0, 0)     # torch answers {} before CUDA
    assert first.other_processes == 10 * GiB                              # not this process's 3 GiB
    assert first.capacity == 40 * GiB                                     # NVML's, until CUDA starts
    second = GaugeReader(CudaMeter(1)).read()
    assert second.other_processes == 6 * GiB and second.capacity == 40 * GiB


def test_the_gauge_reads_the_gpu_torch_calls_cuda_n_once_cuda_has_started(clean_env, fresh_nvml, monkeypatch):
    # CUDA numbers fastest first: torch's cuda:0 is NVML's third GPU (the T4), cuda:1 its first
    FakeNvml(_nvml_gpus()).install(monkeypatch)
    _started_cuda(monkeypatch, [
        dict(uuid="cccc3333-0000", total=16 * GiB, free=16 * GiB, reserved=0, allocated=0, context=False),
        dict(uuid="aaaa1111-0000", total=40 * GiB, free=27 * GiB, reserved=2 * GiB, allocated=GiB,
             context=True),
        dict(uuid="bbbb2222-0000", total=40 * GiB, free=34 * GiB, reserved=0, allocated=0, context=False),
    ])
    reading = GaugeReader(CudaMeter(1)).read()
    assert (reading.allocated, reading.reserved, reading.capacity) == (GiB, 2 * GiB, 40 * GiB)
    assert reading.other_processes == 10 * GiB                            # the A100 with the 10 GiB job
    assert GaugeReader(CudaMeter(2)).read().other_processes == 6 * GiB
    assert GaugeReader(CudaMeter(0)).read().other_processes == 0
    # the same fact as %gpumem's
    shown = {d.key: d for d in read_devices().devices}
    assert shown["cuda:1"].other_processes == 10 * GiB and shown["cuda:1"].other_this_process == GiB
    assert shown["cuda:2"].other_processes == 6 * GiB


def test_nvml_record_for_follows_torchs_uuids(clean_env, fresh_nvml, monkeypatch):
    from cuda_magic.devices.backends import nvml_record_for

    FakeNvml(_nvml_gpus()).install(monkeypatch)
    assert [nvml_record_for(i, []).nvml_index for i in range(3)] == [0, 1, 2]     # before: NVML's order
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert [nvml_record_for(i, []).nvml_index for i in range(2)] == [2, 0]
    assert nvml_record_for(2, []) is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    _started_cuda(monkeypatch, [dict(uuid=u, total=0, free=0, reserved=0, allocated=0, context=False)
                                for u in ("bbbb2222-0000", "cccc3333-0000", "aaaa1111-0000")])
    assert [nvml_record_for(i, []).nvml_index for i in range(3)] == [1, 2, 0]


# ---------------------------------------------------------------------------------------- ROCm

class FakeAmdSmi:
    """The `amdsmi` module as ROCm/amdsmi py-interface/amdsmi_interface.py and amdsmi_exception.py have
    it. shape 'dicts': amdsmi_get_gpu_process_list returns one dict per process ({"name", "pid", "mem",
    "engine_usage", "memory_usage": {"gtt_mem", "cpu_mem", "vram_mem"}}, bytes) and there is no
    amdsmi_get_gpu_process_info (since its commit c551c3c, April 2024). shape 'handles': it returns
    amdsmi_proc_info_t structs, which amdsmi_get_gpu_process_info(handle, proc) turns into that dict (and
    rejects anything else with AmdSmiParameterException). amdsmi_get_gpu_enumeration_info (ROCm 6.4+)
    gives each GPU's "hip_id". Each GPU: {"hip_id", "processes": [(pid, vram bytes, name)], "fail": {fn:
    status code}}."""

    NO_PERM = 10                                   # amdsmi_wrapper.AMDSMI_STATUS_NO_PERM
    ERR_INFO = {10: "AMDSMI_STATUS_NO_PERM - Permission Denied",
                34: "AMDSMI_STATUS_DRIVER_NOT_LOADED - Driver not loaded"}

    def __init__(self, gpus, shape="dicts", init_error=None):
        self.gpus, self.shape, self.init_error = gpus, shape, init_error

    def module(self):
        fake = self
        mod = types.ModuleType("amdsmi")

        class AmdSmiException(Exception):
            pass

        class AmdSmiLibraryException(AmdSmiException):
            def __init__(self, err_code):
                err_code = abs(err_code)
                super().__init__(err_code)
                self.err_code = err_code
                self.err_info = fake.ERR_INFO.get(
                    err_code, "AMDSMI_STATUS_UNKNOWN_ERROR - An unknown error occurred")

            def __str__(self):
                return "Error code:\n\t{err_code} | {err_info}".format(err_code=self.err_code,
                                                                        err_info=self.err_info)

        class AmdSmiParameterException(AmdSmiException):
            pass

        class ProcessorHandle:              # amdsmi_wrapper.amdsmi_processor_handle
            def __init__(self, gpu):
                self.gpu = gpu

        class ProcInfo:                     # amdsmi_wrapper.amdsmi_proc_info_t
            def __init__(self, pid, vram, name):
                self.pid, self.mem, self.name = pid, vram, name.encode()
                self.engine_usage = SimpleNamespace(gfx=0, enc=0)
                self.memory_usage = SimpleNamespace(gtt_mem=0, cpu_mem=0, vram_mem=vram)

        def as_dict(p):
            name = p.name.decode("utf-8")
            return {"name": name.strip() or "N/A", "pid": p.pid, "mem": p.mem,
                    "engine_usage": {"gfx": p.engine_usage.gfx, "enc": p.engine_usage.enc},
                    "memory_usage": {"gtt_mem": p.memory_usage.gtt_mem, "cpu_mem": p.memory_usage.cpu_mem,
                                     "vram_mem": p.memory_usage.vram_mem}}

        def check(handle, fn):
            if not isinstance(handle, ProcessorHandle):
                raise AmdSmiParameterException(handle)
            if fn in handle.gpu.get("fail", {}):
                raise AmdSmiLibraryException(handle.gpu["fail"][fn])

        def amdsmi_init(flag=None):
            if fake.init_error is not None:
                raise AmdSmiLibraryException(fake.init_error)

        def amdsmi_get_processor_handles():
            return [ProcessorHandle(g) for g in fake.gpus]

        def amdsmi_get_gpu_enumeration_info(handle):
            check(handle, "amdsmi_get_gpu_enumeration_info")
            return {"drm_render": 128, "drm_card": 0, "hsa_id": 1, "hip_id": handle.gpu["hip_id"],
                    "hip_uuid": "GPU-0000"}

        def amdsmi_get_gpu_process_list(handle):
            check(handle, "amdsmi_get_gpu_process_list")
            procs = [ProcInfo(*p) for p in handle.gpu["processes"]]
            return procs if fake.shape == "handles" else [as_dict(p) for p in procs]

        def amdsmi_get_gpu_process_info(handle, process):
            check(handle, "amdsmi_get_gpu_process_info")
            if not isinstance(process, ProcInfo):
                raise AmdSmiParameterException(process)
            return as_dict(process)

        for name, value in dict(locals()).items():
            if name.startswith(("amdsmi_", "AmdSmi")):
                setattr(mod, name, value)
        mod.amdsmi_shut_down = lambda: None
        if fake.shape == "dicts":
            del mod.amdsmi_get_gpu_process_info
        return mod


def _rocm(monkeypatch, amdsmi_module, *, torch_helper: bool = True):
    """A ROCm build of torch (torch.version.hip set), no NVML, `amdsmi` importable as `amdsmi_module`
    (None: not installed). torch_helper: torch's own amdsmi import succeeded (torch/cuda/__init__.py
    `_HAS_AMDSMI`, its module-level `amdsmi`), so its `_get_amdsmi_device_index` runs for real."""
    if torch_helper and not hasattr(torch.cuda, "_get_amdsmi_device_index"):
        pytest.skip(f"torch {torch.__version__} has no amdsmi helper (its ROCm build reads pynvml); the "
                    "tests without the helper cover it")
    monkeypatch.setattr(torch.version, "hip", "6.4.43482-0")
    monkeypatch.setitem(sys.modules, "amdsmi", amdsmi_module)
    FakeNvml([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND).install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "_HAS_AMDSMI", torch_helper, raising=False)
    if torch_helper:
        monkeypatch.setattr(torch.cuda, "amdsmi", amdsmi_module, raising=False)
        monkeypatch.setattr(torch.cuda, "_cached_hip_to_amdsmi", None)


# amdsmi numbers the GPUs the other way round from HIP
AMD_GPUS = [
    {"hip_id": 1, "processes": [(THIRD, 5 * GiB, "/opt/other/train")]},
    {"hip_id": 0, "processes": [(ME, 3 * GiB, "python3"), (OTHER, 2 * GiB, "serve")]},
]
TWO_STARTED = [
    dict(total=64 * GiB, free=59 * GiB, reserved=2 * GiB, allocated=GiB, context=True),   # amdsmi GPU 1
    dict(total=64 * GiB, free=59 * GiB, reserved=0, allocated=0, context=True),            # amdsmi GPU 0
]


@pytest.mark.parametrize("shape", ["dicts", "handles"])
def test_rocm_reads_this_and_other_processes_through_amdsmi(clean_env, fresh_nvml, fresh_amdsmi, monkeypatch,
                                                            shape):
    _rocm(monkeypatch, FakeAmdSmi(AMD_GPUS, shape).module())
    _started_cuda(monkeypatch, TWO_STARTED)
    reading = read_devices()
    first, second = [d for d in reading.devices if d.kind == "cuda"]
    assert (first.other_this_process, first.other_processes, first.free) == (GiB, 2 * GiB, 59 * GiB)
    assert (second.other_this_process, second.other_processes) == (0, 5 * GiB)
    for dev in (first, second):
        assert sum(dev.parts().values()) == dev.capacity
    rows = {(p.device, p.pid): p for p in reading.processes}
    assert set(rows) == {("cuda:0", ME), ("cuda:0", OTHER), ("cuda:1", THIRD)}
    assert rows[("cuda:0", ME)].this_process and rows[("cuda:0", ME)].used == 3 * GiB
    assert rows[("cuda:1", THIRD)].name == "train"
    assert not [n for n in reading.notes if "NVML" in n or "nvidia" in n]
    assert GaugeReader(CudaMeter(0)).read().other_processes == 2 * GiB
    assert GaugeReader(CudaMeter(1)).read().other_processes == 5 * GiB


def test_rocm_maps_hip_visible_devices_through_torchs_helper(clean_env, fresh_nvml, fresh_amdsmi,
                                                             monkeypatch):
    # HIP_VISIBLE_DEVICES=1: cuda:0 is HIP device 1, amdsmi's GPU 1 here (torch/cuda/__init__.py
    # _get_amdsmi_device_index, run for real over the fake amdsmi); GPU 0 is another job's
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1")
    gpus = [dict(AMD_GPUS[0], hip_id=0), dict(AMD_GPUS[1], hip_id=1)]
    _rocm(monkeypatch, FakeAmdSmi(gpus).module())
    _started_cuda(monkeypatch, TWO_STARTED[:1])
    (dev,) = [d for d in read_devices().devices if d.kind == "cuda"]
    assert (dev.other_this_process, dev.other_processes) == (GiB, 2 * GiB)
    assert not [n for n in dev.notes if "HIP_VISIBLE_DEVICES" in n]


def test_rocm_without_torchs_helper_reads_the_same_number_and_says_so(clean_env, fresh_nvml, fresh_amdsmi,
                                                                      monkeypatch):
    amd_in_hip_order = [AMD_GPUS[1], AMD_GPUS[0]]
    _rocm(monkeypatch, FakeAmdSmi(amd_in_hip_order).module(), torch_helper=False)
    _started_cuda(monkeypatch, TWO_STARTED)
    first = [d for d in read_devices().devices if d.kind == "cuda"][0]
    assert first.other_processes == 2 * GiB and not [n for n in first.notes if "VISIBLE" in n]
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0,1")
    monkeypatch.setattr(amdsmi_layer, "_amdsmi", amdsmi_layer.AmdSmi())     # it keeps the map it read
    for _ in range(2):                                  # every reading says so, not only the first
        first = [d for d in read_devices().devices if d.kind == "cuda"][0]
        assert first.other_processes == 2 * GiB
        assert [n for n in first.notes if "HIP_VISIBLE_DEVICES is set" in n and "amdsmi GPU 0" in n]


def test_rocm_without_amdsmi_leaves_this_and_other_processes_unknown(clean_env, fresh_nvml, fresh_amdsmi,
                                                                     monkeypatch, ip, capsys):
    _rocm(monkeypatch, None, torch_helper=False)
    _started_cuda(monkeypatch, TWO_STARTED)
    reading = read_devices()
    first = reading.devices[0]
    assert first.key == "cuda:0" and first.free == 59 * GiB
    assert first.other_this_process is None and first.other_processes is None   # never ours as theirs
    said = [n for n in reading.notes if "amdsmi" in n]
    assert len(said) == 1 and "\n" not in said[0] and "pip install amdsmi" in said[0]
    assert GaugeReader(CudaMeter(0)).read().other_processes is None
    capsys.readouterr()
    ip.run_line_magic("gpumem", "")
    out = capsys.readouterr().out
    assert "not known" in out and "Traceback" not in out
    assert len([line for line in out.splitlines() if "pip install amdsmi" in line]) == 1


def test_rocm_amdsmi_errors_become_one_line_notes(clean_env, fresh_nvml, fresh_amdsmi, monkeypatch):
    gpus = [dict(AMD_GPUS[1], hip_id=0, fail={"amdsmi_get_gpu_process_list": FakeAmdSmi.NO_PERM})]
    _rocm(monkeypatch, FakeAmdSmi(gpus).module())
    _started_cuda(monkeypatch, TWO_STARTED[:1])
    (dev,) = [d for d in read_devices().devices if d.kind == "cuda"]
    assert dev.other_this_process is None and dev.other_processes is None
    assert ("process list unavailable (Error code: 10 | AMDSMI_STATUS_NO_PERM - Permission Denied)"
            in dev.notes)


def test_rocm_amdsmi_that_does_not_start_is_one_note(clean_env, fresh_nvml, fresh_amdsmi, monkeypatch):
    _rocm(monkeypatch, FakeAmdSmi(AMD_GPUS, init_error=34).module())
    _started_cuda(monkeypatch, TWO_STARTED)
    reading = read_devices()
    assert [d.other_processes for d in reading.devices] == [None, None]
    said = [n for n in reading.notes if "amdsmi" in n]
    assert said == ["amdsmi unavailable (Error code: 34 | AMDSMI_STATUS_DRIVER_NOT_LOADED - Driver not "
                    "loaded); this process's and other processes' shares are not known"]
