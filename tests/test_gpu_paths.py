"""The GPU paths against torch's and NVML's own APIs, faked at their public surface (torch.cuda, torch.mps,
torch.xpu and pynvml functions replaced), each in a fresh interpreter where a cached answer would hide the
fault. One test per finding of issue 10; none needs a GPU."""
from __future__ import annotations

import pytest

from fresh import run_fresh

pytest.importorskip("torch")


def test_oom_class_falls_back_to_torch_cuda_before_torch_2_4():
    # torch 2.1 to 2.3 have torch.cuda.OutOfMemoryError only
    out = run_fresh('''
        import torch
        del torch.OutOfMemoryError
        from IPython.testing.globalipapp import get_ipython
        ip = get_ipython()
        ip.run_line_magic("load_ext", "cuda_magic")
        ip.run_line_magic("gpumem", "--simulate 64MiB -q")
        ip.run_cell("import torch\\ndef grow():\\n    return torch.empty(256 * 2**20, dtype=torch.uint8)")
        result = ip.run_cell("%%oomguard -q\\ngrow()")
        err = result.error_in_exec
        assert isinstance(err, torch.cuda.OutOfMemoryError), repr(err)
        assert type(err).__module__ == "cuda_magic", type(err)
        from cuda_magic.devices.simulated import SimulatedDevice
        with SimulatedDevice(1024):
            try:
                torch.empty(4096, dtype=torch.uint8)
            except torch.cuda.OutOfMemoryError as exc:
                print("simulated", type(exc).__name__)
        print("ok")
    ''')
    assert "simulated OutOfMemoryError" in out and out.rstrip().endswith("ok")


# ----------------------------------------------------------------------------------------- NVML

import os  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pynvml  # noqa: E402

from test_nvml_backends import FakeGpu, FakeNvml, GiB, MiB, ME, OTHER  # noqa: E402

from cuda_magic.devices.backends import read_devices  # noqa: E402


def _no_cuda_started():
    import torch

    if torch.cuda.is_initialized():
        pytest.skip("torch has initialised CUDA in this process: its figures would mix with the fake")


@pytest.fixture
def three(monkeypatch, fresh_nvml):
    """Three faked GPUs (two A100s, a T4), CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER unset."""
    _no_cuda_started()
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"):
        monkeypatch.delenv(name, raising=False)
    gpus = [
        FakeGpu("NVIDIA A100-SXM4-40GB", 40 * GiB, 13 * GiB, "GPU-aaaa1111-0000", compute=[(ME, 3 * GiB)]),
        FakeGpu("NVIDIA A100-SXM4-40GB", 40 * GiB, 6 * GiB, "GPU-bbbb2222-0000", compute=[(OTHER, 2 * GiB)],
                graphics=[(OTHER, 2 * GiB)]),
        FakeGpu("Tesla T4", 16 * GiB, 1 * GiB, "GPU-cccc3333-0000"),
    ]
    return FakeNvml(gpus, names={OTHER: "/usr/bin/Xorg"}).install(monkeypatch)


def test_library_mismatch_on_process_lists_falls_back_to_v2(three, monkeypatch, ip, capsys):
    # nvidia-ml-py 12.550.52+: the unversioned query calls a _v3 the driver lacks -> not an NVMLError
    mismatch = getattr(pynvml, "NVMLLibraryMismatchError")
    v3 = pynvml.nvmlDeviceGetComputeRunningProcesses

    def unversioned(handle):
        raise mismatch("Unversioned function called and the pyNVML version does not match the NVML lib")

    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses", unversioned)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetGraphicsRunningProcesses", unversioned)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetComputeRunningProcesses_v2", v3)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetGraphicsRunningProcesses_v2", lambda h: [])
    reading = read_devices()
    assert {(p.device, p.pid) for p in reading.processes} == {("cuda:0", ME), ("cuda:1", OTHER)}
    # bindings without the _v2 queries: processes omitted with one note, the rest of %gpumem works
    monkeypatch.delattr(pynvml, "nvmlDeviceGetComputeRunningProcesses_v2")
    monkeypatch.delattr(pynvml, "nvmlDeviceGetGraphicsRunningProcesses_v2")
    reading = read_devices()
    assert reading.processes == []
    first = reading.devices[0]
    assert sum(first.parts().values()) == first.capacity
    assert [n for n in first.notes if "nvidia-ml-py" in n] and len(first.notes) == len(set(first.notes))
    capsys.readouterr()
    ip.run_line_magic("gpumem", "--processes")
    out = capsys.readouterr().out
    assert "nvidia-ml-py" in out and "Traceback" not in out


def test_memory_v2_leaves_out_driver_reserved_memory(three, monkeypatch):
    reserved = 470 * MiB
    v1 = pynvml.nvmlDeviceGetMemoryInfo

    def memory(handle, version=None):
        if version is None:
            return v1(handle)
        assert version == pynvml.nvmlMemory_v2
        free = handle.total - handle.used
        return SimpleNamespace(version=version, total=handle.total, reserved=reserved, free=free,
                               used=handle.total - reserved - free)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", memory)
    first = read_devices().devices[0]
    assert first.capacity == 40 * GiB - reserved
    assert first.free == 27 * GiB and first.other_processes == 13 * GiB - reserved - 3 * GiB
    assert sum(first.parts().values()) == first.capacity


def test_memory_v1_where_the_driver_lacks_v2(three, monkeypatch):
    v1 = pynvml.nvmlDeviceGetMemoryInfo

    def memory(handle, version=None):
        if version is not None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        return v1(handle)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", memory)
    first = read_devices().devices[0]
    assert first.capacity == 40 * GiB and first.free == 27 * GiB
    assert not [n for n in first.notes if "memory" in n]


def test_a_process_with_compute_and_graphics_contexts_counts_once(three):
    rows = [p for p in read_devices().processes if p.device == "cuda:1"]
    assert [(p.pid, p.used) for p in rows] == [(OTHER, 2 * GiB)]


# ------------------------------------------------------------------------- CUDA_VISIBLE_DEVICES

SPECS = ["0", "1,0", "2,0,1", "0,0", "1,2,1", "1gpu2,0", "0,-1,1", "0, 1", "+1", "", "a,1", "0,x", "7,1",
         "GPU-aaaa", "GPU-bbbb,GPU-aaaa", "GPU-aaaa,GPU-aaaa", "GPU-a,GPU-bbbb", "GPU-zzzz,GPU-aaaa",
         "GPU-cccc,1", "MIG-GPU-aaaa/1/0", "MIG-1,MIG-1", "1,GPU-aaaa"]


@pytest.mark.parametrize("spec", SPECS)
def test_visible_devices_read_by_torchs_own_rules(monkeypatch, spec):
    import torch

    from cuda_magic.devices.visible import parse_visible_devices, uuid_ordinals

    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", spec)
    theirs = torch.cuda._parse_visible_devices()
    assert parse_visible_devices(spec) == theirs
    uuids = ["GPU-aaaa1111-0000", "GPU-abbb2222-0000", "GPU-bbbb2222-0000"]
    if theirs and isinstance(theirs[0], str):
        assert uuid_ordinals(theirs, uuids) == torch.cuda._transform_uuid_to_ordinals(theirs, uuids)


@pytest.mark.parametrize("spec, picked", [
    ("1,1", []),                       # a repeated entry hides every device, as torch has it
    ("GPU-bbbb,GPU-bbbb2222", []),
    ("1gpu2,0", ["GPU-bbbb2222-0000", "GPU-aaaa1111-0000"]),
    ("0,GPU-cccc", ["GPU-aaaa1111-0000"]),
    ("GPU-cccc,0", ["GPU-cccc3333-0000"]),
])
def test_gpumem_maps_visible_devices_like_torch(three, monkeypatch, spec, picked):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", spec)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    gpus = [d for d in read_devices().devices if d.kind == "cuda"]
    by_free = {g.total - g.used: g.uuid for g in three.gpus}
    assert [by_free[d.free] for d in gpus] == picked


def test_fastest_first_order_is_said_before_cuda_starts(three, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")
    notes = read_devices().notes
    assert [n for n in notes if "fastest first" in n]
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    assert not [n for n in read_devices().notes if "fastest first" in n]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")          # two of the same model: order is moot
    monkeypatch.delenv("CUDA_DEVICE_ORDER")
    assert not [n for n in read_devices().notes if "fastest first" in n]


def _fake_started_cuda(monkeypatch, uuids, *, props_have_uuid=True):
    """torch.cuda as it is once CUDA has started on len(uuids) devices (torch's UUIDs without 'GPU-')."""
    import torch

    from cuda_magic.devices import probe

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: len(uuids))
    for fn in ("memory_allocated", "memory_reserved", "max_memory_allocated"):
        monkeypatch.setattr(cuda, fn, lambda i=None: 0)
    monkeypatch.setattr(cuda, "get_device_name", lambda i=None: f"torch GPU {i}")

    def props(i):
        p = SimpleNamespace(name=f"torch GPU {i}", total_memory=0)
        if props_have_uuid:
            p.uuid = uuids[i]
        return p

    monkeypatch.setattr(cuda, "get_device_properties", props)
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda i: False, raising=False)
    monkeypatch.setattr(probe, "_gpu", None)


def test_started_cuda_maps_nvml_devices_by_uuid(three, monkeypatch):
    # CUDA's order (fastest first) put the T4 second; torch's UUIDs say which is which
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-cccc,GPU-aaaa")
    _fake_started_cuda(monkeypatch, ["cccc3333-0000", "aaaa1111-0000"])
    gpus = [d for d in read_devices().devices if d.kind == "cuda"]
    assert [d.name for d in gpus] == ["Tesla T4", "NVIDIA A100-SXM4-40GB"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    _fake_started_cuda(monkeypatch, ["bbbb2222-0000", "cccc3333-0000", "aaaa1111-0000"])
    gpus = [d for d in read_devices().devices if d.kind == "cuda"]
    assert [d.free for d in gpus] == [34 * GiB, 15 * GiB, 27 * GiB]


def test_started_cuda_on_a_mig_instance_shows_torchs_view(three, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-5c1ea1b2-0000")
    assert not [d for d in read_devices().devices if d.kind == "cuda" and d.capacity is not None]
    _fake_started_cuda(monkeypatch, ["5c1ea1b2-0000"])
    gpus = [d for d in read_devices().devices if d.kind == "cuda"]
    assert [d.name for d in gpus] == ["torch GPU 0"]      # no NVML device of that UUID: torch's figures


def test_without_nvml_torchs_devices_are_shown(monkeypatch, fresh_nvml, ip, capsys):
    # compute-only containers and ROCm: torch sees GPUs, NVML is not there
    import torch

    _no_cuda_started()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    FakeNvml([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND).install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    reading = read_devices()
    assert reading.gpu_present
    assert [d.key for d in reading.devices] == ["cuda:0", "cuda:1"]
    assert not [n for n in reading.notes if "No GPU found" in n]
    assert [n for n in reading.notes if "torch sees 2 GPU(s)" in n]
    assert not torch.cuda.is_initialized()
    capsys.readouterr()
    ip.run_line_magic("gpumem", "")
    out = capsys.readouterr().out
    assert "cuda:1" in out and "No GPU found" not in out and "Traceback" not in out
