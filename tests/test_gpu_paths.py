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
        if hasattr(torch, "OutOfMemoryError"):
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
    monkeypatch.setattr(probe, "_mps", None)      # asked once per process: the fake answers afresh


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


# ------------------------------------------------------------------------------ -l on CUDA

def test_cuda_cap_restores_the_fraction_in_force():
    out = run_fresh('''
        import warnings
        from types import SimpleNamespace
        import torch
        from cuda_magic.devices.meter import CudaMeter

        state = {"fraction": None}                  # the allocator's: None until someone sets one
        def set_fraction(fraction, device=None):
            state["fraction"] = fraction
        torch.cuda.set_per_process_memory_fraction = set_fraction
        torch.cuda.get_device_properties = lambda i: SimpleNamespace(total_memory=16 * 2**30)
        torch.cuda.get_per_process_memory_fraction = lambda i=None: state["fraction"] or 1.0   # torch 2.6+

        set_fraction(0.5)                           # the user's own cap
        meter = CudaMeter(0)
        with meter.running(4 * 2**30):
            assert state["fraction"] == 0.25, state
        assert state["fraction"] == 0.5, state      # put back exactly

        del torch.cuda.get_per_process_memory_fraction   # torch 2.1 to 2.5: no getter
        import cuda_magic.devices.meter as m
        m._fractions_set.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with meter.running(4 * 2**30):
                pass
        assert state["fraction"] == 1.0
        assert [w for w in caught if "cannot report the fraction" in str(w.message)], caught
        set_fraction(1.0)
        with warnings.catch_warnings(record=True) as caught:   # what cuda_magic set is known: no warning
            warnings.simplefilter("always")
            with meter.running(8 * 2**30):
                assert state["fraction"] == 0.5
        assert state["fraction"] == 1.0 and not caught, caught
        print("ok")
    ''')
    assert out.strip().endswith("ok")


# ---------------------------------------------------------------- nothing starts CUDA unasked

def test_load_ext_gpumem_and_a_guarded_cell_start_no_cuda():
    out = run_fresh('''
        import torch
        called = []
        def record(name):
            def fn(*a, **k):
                called.append(name)
                raise AssertionError(name + " would start CUDA")
            return fn
        for name in ("is_available", "get_device_properties", "set_per_process_memory_fraction",
                     "mem_get_info", "get_device_name", "_lazy_init"):
            setattr(torch.cuda, name, record(name))
        torch.cuda.device_count = lambda: 1           # a GPU is there (NVML-based count)
        from IPython.testing.globalipapp import get_ipython
        ip = get_ipython()
        ip.run_line_magic("load_ext", "cuda_magic")
        ip.run_line_magic("gpumem", "")
        ip.run_line_magic("gpumem", "--watch")
        result = ip.run_cell("%%oomguard -q\\nimport torch\\nx = torch.ones(4) * 2")
        assert result.success, result.error_in_exec
        ip.run_cell("y = 1")
        ip.run_line_magic("gpumem", "--unwatch")
        assert not called, called
        assert not torch.cuda.is_initialized()
        print("ok")
    ''')
    assert out.strip().endswith("ok")


# ------------------------------------------------------------------------- allocator settings

def test_new_setter_is_named_from_torch_2_10():
    out = run_fresh('''
        import sys, importlib.metadata as md
        from cuda_magic.devices import allocator_conf as ac
        assert "torch" not in sys.modules
        for v, want in (("2.9.1", ac.OLD_SETTER), ("2.10.0", ac.NEW_SETTER), ("2.1.2", ac.OLD_SETTER)):
            md.version = lambda name, v=v: v
            assert ac._setter_name() == want, (v, ac._setter_name())
        print("ok")
    ''')
    assert out.strip().endswith("ok")


def test_conf_in_force_keeps_expandable_segments_from_earlier_settings():
    import torch

    if not hasattr(torch._C, "_accelerator_getAllocatorSettings"):
        pytest.skip("the allocator settings getter is in torch 2.12+")
    # the getter (torch 2.12+) returns the last string set; expandable_segments from the environment stays on
    out = run_fresh('''
        import torch
        from cuda_magic.devices.allocator_conf import current_allocator_conf, expandable_segments_on
        torch._C._accelerator_setAllocatorSettings("max_split_size_mb:128")
        conf = current_allocator_conf()
        assert expandable_segments_on(conf) and "max_split_size_mb:128" in conf, conf
        print("ok")
    ''', env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,garbage_collection_threshold:0.6"})
    assert out.strip().endswith("ok")


def test_switching_expandable_segments_on_advises_empty_cache(monkeypatch):
    import torch

    from cuda_magic.devices import allocator_conf
    from cuda_magic.devices.allocator_conf import enable_expandable_segments, expandable_segments_line

    if not hasattr(torch._C, "_accelerator_getAllocatorSettings"):
        pytest.skip("the allocator settings getter is in torch 2.12+")
    before = torch._C._accelerator_getAllocatorSettings()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(allocator_conf, "_set_here", None)
    try:
        torch._C._accelerator_setAllocatorSettings("max_split_size_mb:256,expandable_segments:False")
        assert "torch.cuda.empty_cache()" in enable_expandable_segments()
    finally:
        torch._C._accelerator_setAllocatorSettings(before)
    assert expandable_segments_line("").endswith("; torch.cuda.empty_cache()")


# ----------------------------------------------------------------------------- XPU and MPS

def test_torch_2_4_xpu_without_memory_reserved(monkeypatch, tip, capsys):
    import torch

    if not hasattr(torch, "xpu"):
        pytest.skip("this torch has no torch.xpu (from 2.3)")

    from cuda_magic.devices import probe

    xpu = torch.xpu
    monkeypatch.delattr(xpu, "memory_reserved")         # torch 2.4: torch.xpu without allocator counters
    monkeypatch.setattr(xpu, "is_initialized", lambda: True)
    monkeypatch.setattr(xpu, "device_count", lambda: 1)
    monkeypatch.setattr(xpu, "empty_cache", lambda: None)
    monkeypatch.setattr(probe, "_gpu", None)
    monkeypatch.setattr(probe, "_mps", None)      # asked once per process: the fake answers afresh
    tip.run_cell("scratch_xpu = torch.ones(1024)")
    capsys.readouterr()
    report = tip.run_line_magic("freecuda", "scratch_xpu -q -o")
    assert report is not None and "scratch_xpu" not in tip.user_ns
    monkeypatch.setattr(probe, "_gpu", None)
    monkeypatch.setattr(probe, "_mps", None)      # asked once per process: the fake answers afresh


def _fake_mps(monkeypatch, *, recommended=True):
    import torch

    from cuda_magic.devices import probe

    if torch.cuda.is_initialized():
        pytest.skip("CUDA is in use here")
    state = {"allocated": 100 * MiB, "driver": 300 * MiB, "fractions": []}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "current_allocated_memory", lambda: state["allocated"])
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: state["driver"])
    monkeypatch.setattr(torch.mps, "set_per_process_memory_fraction", state["fractions"].append)
    monkeypatch.setattr(torch.mps, "empty_cache", lambda: None)
    if recommended:
        monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 8 * GiB, raising=False)
    else:
        monkeypatch.delattr(torch.mps, "recommended_max_memory", raising=False)
    monkeypatch.setattr(probe, "_gpu", None)
    monkeypatch.setattr(probe, "_mps", None)      # asked once per process: the fake answers afresh
    return state


def test_a_guarded_run_on_mps_is_metered_on_mps(monkeypatch):
    from cuda_magic.devices.meter import autocast, choose_meter
    from cuda_magic.recover.guarded import GuardedRun, GuardOptions
    from cuda_magic.recover.report import Outcome
    from cuda_magic.units import parse_limit

    state = _fake_mps(monkeypatch)
    monkeypatch.delenv("PYTORCH_MPS_HIGH_WATERMARK_RATIO", raising=False)
    meter, limit = choose_meter(None, parse_limit("2GiB"))
    assert meter.key == "mps" and meter.device_type == "mps"
    assert limit == 2 * GiB
    try:
        assert autocast("bf16", meter).device == "mps"
    except RuntimeError as exc:              # torch without MPS autocast (pytorch#99272, about 2.5)
        assert "unsupported autocast device_type 'mps'" in str(exc), exc

    def cell():
        state["allocated"] += 500 * MiB

    report = GuardedRun(meter, GuardOptions(limit=limit)).run(cell).report
    attempt, = report.attempts
    assert attempt.outcome is Outcome.OK
    assert attempt.start_allocated == 100 * MiB and attempt.peak == 600 * MiB
    assert state["fractions"] == [0.25, 1.7]               # the cap, then torch's default ratio back
    meter2, _ = choose_meter()
    assert meter2.key == "mps"


def test_mps_before_torch_2_5_caps_through_a_simulated_device(monkeypatch):
    from cuda_magic.devices.meter import SimMeter, choose_meter
    from cuda_magic.units import parse_limit

    _fake_mps(monkeypatch, recommended=False)
    meter, _ = choose_meter(None, parse_limit("1GiB"))
    assert isinstance(meter, SimMeter)


# ------------------------------------------------------------------ --watch: the first CUDA cell

def test_watch_records_the_cell_that_starts_cuda_as_a_cuda_cell():
    out = run_fresh('''
        import torch
        state = {"started": False}
        torch.cuda.is_initialized = lambda: state["started"]
        torch.cuda.current_device = lambda: 0
        torch.cuda.memory_allocated = lambda i=None: 300 if state["started"] else 0
        torch.cuda.max_memory_allocated = lambda i=None: 700 if state["started"] else 0
        torch.cuda.reset_peak_memory_stats = lambda i=None: None
        from IPython.testing.globalipapp import get_ipython
        ip = get_ipython()
        ip.user_ns["state"] = state
        ip.run_line_magic("load_ext", "cuda_magic")
        ip.run_line_magic("gpumem", "--watch -q")
        ip.run_cell("state['started'] = True")     # this cell starts CUDA
        rows = ip.run_line_magic("gpumem", "--history -o -q").to_dict("records")
        ip.run_line_magic("gpumem", "--unwatch")
        row = rows[-1]
        assert (row["device"], row["allocated_delta"], row["peak"], bool(row["peak_exact"])) == (
            "cuda:0", 300, 700, True), rows
        print("ok")
    ''')
    assert out.strip().endswith("ok")


# ------------------------------------------------------------------ notes on Python 3.10

def test_the_fatal_note_is_printed_where_python_has_no_add_note(tip, capsys):
    # Python 3.10's exceptions have no add_note: the note would be lost
    class NoNotes(RuntimeError):
        def __getattribute__(self, name):
            if name == "add_note":
                raise AttributeError(name)
            return super().__getattribute__(name)

    tip.user_ns["NoNotes"] = NoNotes
    capsys.readouterr()
    tip.run_cell("%%oomguard -q\nraise NoNotes('CUDA error: device-side assert triggered')")
    err = capsys.readouterr().err
    assert "not an out-of-memory error" in err
    tip.run_line_magic("oomguard", "on")
    capsys.readouterr()
    tip.run_cell("raise NoNotes('CUDA error: an illegal memory access was encountered')")
    assert "not an out-of-memory error" in capsys.readouterr().err
    tip.run_line_magic("oomguard", "off")


# ------------------------------------------------------------------ scripts/gpu_check.py

def _gpu_check_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_finds_the_nvml_device_by_uuid_not_by_parsing_the_variable(three, monkeypatch):
    # the old script did int(CUDA_VISIBLE_DEVICES.split(",")[0]): a crash on GPU-/MIG- lists
    gpu_check = _gpu_check_module()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-cccc,GPU-aaaa")
    by_uuid = {g.uuid: g for g in three.gpus}
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByUUID", lambda u: by_uuid[u], raising=False)
    torch = SimpleNamespace(cuda=SimpleNamespace(
        get_device_properties=lambda i: SimpleNamespace(uuid=["cccc3333-0000", "aaaa1111-0000"][i])))
    assert gpu_check._handle_of(pynvml, torch, 1).uuid == "GPU-aaaa1111-0000"
    # torch before 2.4 reports no UUID: the package's reading of CUDA_VISIBLE_DEVICES, as torch's
    torch.cuda.get_device_properties = lambda i: SimpleNamespace()
    assert gpu_check._handle_of(pynvml, torch, 0).uuid == "GPU-cccc3333-0000"
