"""Smaller device details (issue 19): what switching expandable_segments on really does, which variable
torch reads its allocator settings from, `--watch` on MPS and XPU, the MPS memory limit and fraction, the
CUDA fraction before torch 2.8, the XPU generators in a retry's rollback.

The fakes are torch's public surface replaced, each written from the torch source named beside it (the
wheels' Python files and headers, c10/aten sources); none needs a GPU."""
from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest

from fresh import run_fresh

torch = pytest.importorskip("torch")

MiB, GiB = 1 << 20, 1 << 30


@pytest.fixture
def no_alloc_env(monkeypatch):
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF",
                 "PYTORCH_MPS_HIGH_WATERMARK_RATIO"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def fresh_meter_state(monkeypatch):
    """The fractions cuda_magic set, and the warnings given, start empty (module state of one process)."""
    from cuda_magic.devices import meter

    monkeypatch.setattr(meter, "_fractions_set", {})
    monkeypatch.setattr(meter, "_fraction_warned", set(), raising=False)
    return meter


def _no_cuda():
    if torch.cuda.is_initialized():
        pytest.skip("torch has initialised CUDA here: its counters would mix with the fakes")


# ------------------------------------------------------------------ 1. switching expandable_segments on

@pytest.fixture
def settable_allocator(no_alloc_env):
    """The installed torch's own setter and getter (2.12+), with a CUDA device counted (the settings are
    shared by every backend: only the device check needs standing in for)."""
    if not hasattr(torch._C, "_accelerator_getAllocatorSettings"):
        pytest.skip("the allocator settings getter is in torch 2.12+")
    from cuda_magic.devices import allocator_conf

    before = torch._C._accelerator_getAllocatorSettings()
    no_alloc_env.setattr(torch.cuda, "device_count", lambda: 1)
    no_alloc_env.setattr(allocator_conf, "_set_here", None)
    yield allocator_conf
    torch._C._accelerator_setAllocatorSettings(before)


def test_the_setter_only_records_expandable_segments_and_the_sentence_says_so(settable_allocator):
    # c10/core/AllocatorConfig.cpp (2.10+) parseExpandableSegments: use_expandable_segments_ = toBool();
    # the warning "expandable_segments not supported on this platform" is TORCH_WARN_ONCE in
    # CUDAAllocatorConfig::expandable_segments() (c10/cuda/CUDAAllocatorConfig.h, 2.2 to 2.13), which the
    # allocator calls when it reserves memory. The real setter here: it records and says nothing.
    ac = settable_allocator
    torch._C._accelerator_setAllocatorSettings("max_split_size_mb:256")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        said = ac.enable_expandable_segments()
    assert torch._C._accelerator_getAllocatorSettings() == "max_split_size_mb:256,expandable_segments:True"
    assert not [w for w in caught if "expandable_segments" in str(w.message)]
    # nothing is known yet of whether this build and driver can use it: the sentence says when it is, and
    # how to check (segment dicts carry is_expandable: torch/csrc/cuda/memory_snapshot.cpp, 2.2+)
    assert "next reserves memory" in said and "is_expandable" in said and "memory_snapshot()" in said
    assert "for this session" not in said


def test_the_start_up_variable_named_is_the_one_torch_reads(settable_allocator, monkeypatch):
    # torch 2.10+ reads PYTORCH_CUDA_ALLOC_CONF before PYTORCH_ALLOC_CONF (c10/core/AllocatorConfig.cpp):
    # a user who already sets PYTORCH_CUDA_ALLOC_CONF and adds PYTORCH_ALLOC_CONF would be ignored
    ac = settable_allocator
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6")
    torch._C._accelerator_setAllocatorSettings("garbage_collection_threshold:0.6")
    said = ac.enable_expandable_segments()
    assert said.endswith("set PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:0.6,"
                         "expandable_segments:True before starting Python."), said


def test_a_rocm_build_known_to_ignore_it_is_refused_before_anything_is_set(settable_allocator, monkeypatch):
    ac = settable_allocator
    set_to = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", set_to.append)
    monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: "")
    for version, hip, refused in (
            ("2.13.0+rocm6.4", "6.4.43482", True),   # ROCm before 7: CUDAAllocatorConfig.h 2.13 warns, ignores
            ("2.11.0+rocm7.0", "7.0.51831", True),   # 2.11's header: #ifndef PYTORCH_C10_DRIVER_API_SUPPORTED
            ("2.13.0+rocm7.0", "7.0.51831", False)):  # 2.13: (!defined(USE_ROCM) || ROCM_VERSION < 70000)
        monkeypatch.setattr(torch, "__version__", version)
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(ac, "_set_here", None)
        set_to.clear()
        if refused:
            with pytest.raises(RuntimeError, match="ROCm"):
                ac.enable_expandable_segments()
            assert set_to == [] and ac._set_here is None, version
        else:
            assert "switched on" in ac.enable_expandable_segments()
            assert set_to == ["expandable_segments:True"], version


# ------------------------------------------------------------------ 2. which variable torch reads

def test_the_environments_settings_are_those_the_installed_torch_read():
    # no fake: the installed torch (2.12+ has the getter) says what it read at start-up
    if not hasattr(torch._C, "_accelerator_getAllocatorSettings"):
        pytest.skip("the allocator settings getter is in torch 2.12+")
    for env in ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"},
                {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"},
                {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64", "PYTORCH_HIP_ALLOC_CONF": "max_split_size_mb:256"},
                {"PYTORCH_HIP_ALLOC_CONF": "max_split_size_mb:256",
                 "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}):
        out = run_fresh('''
            import torch
            from cuda_magic.devices.allocator_conf import env_allocator_conf
            print(repr((env_allocator_conf(), torch._C._accelerator_getAllocatorSettings())))
        ''', env=env)
        ours, torchs = eval(out.strip().splitlines()[-1])
        assert ours == torchs, (env, ours, torchs)


@pytest.mark.parametrize("version, hip, expected", [
    # 2.9.1's c10/cuda/CUDAAllocatorConfig.h instance(): PYTORCH_CUDA_ALLOC_CONF, on ROCm (#ifdef USE_ROCM)
    # PYTORCH_HIP_ALLOC_CONF; its libc10_cuda.so holds no "PYTORCH_ALLOC_CONF" at all
    ("2.9.1", None, ""),
    ("2.9.1", "6.4.43482", "max_split_size_mb:256"),
    # 2.7.1's header: getenv("PYTORCH_CUDA_ALLOC_CONF") only
    ("2.7.1", "6.3.42131", ""),
    # 2.10+: c10/core/AllocatorConfig.cpp reads CUDA, HIP, then PYTORCH_ALLOC_CONF, on every build
    ("2.10.0", None, "max_split_size_mb:256"),
])
def test_env_settings_follow_the_torch_version(no_alloc_env, monkeypatch, version, hip, expected):
    from cuda_magic.devices.allocator_conf import env_allocator_conf

    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.setenv("PYTORCH_HIP_ALLOC_CONF", "max_split_size_mb:256")
    assert env_allocator_conf() == expected
    monkeypatch.delenv("PYTORCH_HIP_ALLOC_CONF")
    assert env_allocator_conf() == ("expandable_segments:True" if version == "2.10.0" else "")
    from cuda_magic.devices.allocator_conf import env_var_to_set

    assert env_var_to_set() == ("PYTORCH_ALLOC_CONF" if version == "2.10.0" else "PYTORCH_CUDA_ALLOC_CONF")


# ------------------------------------------------------------------ 3. --watch on MPS and XPU

def _fake_mps(monkeypatch, state):
    """torch.mps as torch 2.5+ has it (torch/mps/__init__.py: current_allocated_memory,
    driver_allocated_memory, recommended_max_memory, set_per_process_memory_fraction(float 0..2))."""
    from cuda_magic.devices import probe

    def set_fraction(fraction):
        if not isinstance(fraction, float):          # torch/mps/__init__.py's own checks
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 2:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~2")
        state["fractions"].append(fraction)

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.mps, "current_allocated_memory", lambda: state["allocated"])
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: state["driver"])
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: state["recommended"], raising=False)
    monkeypatch.setattr(torch.mps, "set_per_process_memory_fraction", set_fraction)
    monkeypatch.setattr(probe, "_gpu", None)
    monkeypatch.setattr(probe, "_mps", None)      # asked once per process: the fake answers afresh


def _needs_xpu():
    if not hasattr(torch, "xpu"):      # torch 2.2 has no torch.xpu: there cuda_magic never looks for one
        pytest.skip(f"torch {torch.__version__} has no torch.xpu")


def _fake_xpu(monkeypatch, state):
    """torch.xpu as torch 2.5+ has it (torch/xpu/memory.py: memory_allocated, max_memory_allocated,
    reset_peak_memory_stats; torch/xpu/__init__.py: is_initialized, current_device)."""
    _needs_xpu()

    def reset(device=None):
        state["peak"] = state["allocated"]

    monkeypatch.setattr(torch.xpu, "is_initialized", lambda: state["started"])
    monkeypatch.setattr(torch.xpu, "current_device", lambda: 0)
    monkeypatch.setattr(torch.xpu, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.xpu, "max_memory_allocated", lambda device=None: state["peak"])
    monkeypatch.setattr(torch.xpu, "reset_peak_memory_stats", reset)


def _watched(cells):
    """Run `cells` (callables) between the watcher's own pre/post hooks; the records."""
    from cuda_magic.memory.watch import CellWatcher

    watcher = CellWatcher(shell=None)
    for n, cell in enumerate(cells, 1):
        watcher.pre_run_cell()
        cell()
        watcher.post_run_cell(SimpleNamespace(execution_count=n))
    watcher.stop()
    return watcher.records


def test_watch_on_mps_reads_mps_counters_with_an_approximate_peak(monkeypatch):
    _no_cuda()
    state = {"allocated": 100 * MiB, "driver": 300 * MiB, "recommended": 8 * GiB, "fractions": []}
    _fake_mps(monkeypatch, state)

    def grow():
        state["allocated"] += 50 * MiB

    def shrink():
        state["allocated"] -= 30 * MiB

    first, second = _watched([grow, shrink])
    assert (first.device, first.allocated_delta, first.allocated_after, first.peak, first.peak_exact) == (
        "mps", 50 * MiB, 150 * MiB, 150 * MiB, False)
    # MPS keeps no peak counter: the higher of the figures at the cell's start and end
    assert (second.device, second.allocated_delta, second.peak, second.peak_exact) == (
        "mps", -30 * MiB, 150 * MiB, False)


def test_watch_on_an_xpu_reads_its_peak_counter(monkeypatch):
    _no_cuda()
    state = {"started": True, "allocated": 10 * MiB, "peak": 0}
    _fake_xpu(monkeypatch, state)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)

    def spike():
        state["allocated"] += 200 * MiB
        state["peak"] = max(state["peak"], state["allocated"])
        state["allocated"] -= 180 * MiB

    record, = _watched([spike])
    assert (record.device, record.allocated_delta, record.peak, record.peak_exact) == (
        "xpu:0", 20 * MiB, 210 * MiB, True)


def test_watch_counts_the_cell_that_starts_an_xpu_as_an_xpu_cell(monkeypatch):
    _no_cuda()
    state = {"started": False, "allocated": 0, "peak": 0}
    _fake_xpu(monkeypatch, state)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)

    def start():
        state.update(started=True, allocated=64 * MiB, peak=96 * MiB)    # counted from the XPU's start

    record, = _watched([start])
    assert (record.device, record.allocated_delta, record.peak, record.peak_exact) == (
        "xpu:0", 64 * MiB, 96 * MiB, True)


# ------------------------------------------------------------------ 4. and 5. the MPS limit and fraction

def test_mps_capacity_is_the_limit_torch_enforces(no_alloc_env, fresh_meter_state):
    # aten/src/ATen/mps/MPSAllocator.mm setHighWatermarkRatio: m_max_total_allowed_size =
    # ratio * recommendedMaxWorkingSetSize, ratio = PYTORCH_MPS_HIGH_WATERMARK_RATIO (strtod) or 1.7
    # (MPSAllocator.h default_high_watermark_ratio, 2.2 to 2.13); 0 disables the limit
    _no_cuda()
    from cuda_magic.devices.meter import MpsMeter, choose_meter
    from cuda_magic.units import parse_limit

    state = {"allocated": 0, "driver": 0, "recommended": 8 * GiB, "fractions": []}
    _fake_mps(no_alloc_env, state)
    assert MpsMeter().capacity() == int(1.7 * 8 * GiB)
    no_alloc_env.setenv("PYTORCH_MPS_HIGH_WATERMARK_RATIO", "1.25")
    assert MpsMeter().capacity() == int(1.25 * 8 * GiB)
    meter, limit = choose_meter(None, parse_limit("0.5"))      # half of what torch allows
    assert limit == int(0.5 * int(1.25 * 8 * GiB))
    with meter.running(limit):
        pass
    assert state["fractions"] == [pytest.approx(0.625), 1.25]   # the fraction is of the recommended size
    no_alloc_env.setenv("PYTORCH_MPS_HIGH_WATERMARK_RATIO", "0")
    import os

    assert MpsMeter().capacity() == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_mps_fraction_cannot_be_read_back_so_a_warning_says_so_once(no_alloc_env, fresh_meter_state):
    # torch.mps has set_per_process_memory_fraction and no getter (torch/mps/__init__.py 2.2 to 2.13; no
    # torch._C._mps_* binding reads getHighWatermarkLimit back)
    _no_cuda()
    assert not [n for n in dir(torch.mps) if "fraction" in n and n.startswith("get")]
    from cuda_magic.devices.meter import MpsMeter

    state = {"allocated": 0, "driver": 0, "recommended": 8 * GiB, "fractions": []}
    _fake_mps(no_alloc_env, state)
    meter = MpsMeter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with meter.running(2 * GiB):
            pass
        with pytest.raises(RuntimeError, match="out of memory"):
            with meter.running(4 * GiB):
                raise RuntimeError("MPS backend out of memory")
    assert state["fractions"] == [0.25, 1.7, 0.5, 1.7]
    said = [str(w.message) for w in caught if "set_per_process_memory_fraction" in str(w.message)]
    assert len(said) == 1 and "\n" not in said[0], said
    assert "set again" in said[0]


# ------------------------------------------------------------------ 6. the CUDA fraction before 2.8

class Torch22Fraction:
    """torch 2.2's fraction as its allocator keeps it (c10/cuda/CUDACachingAllocator.cpp 2.2 to 2.7,
    DeviceCachingAllocator::setMemoryFraction: allowed_memory_maximum = fraction * total; set_fraction =
    true, never cleared; OOM messages add "<allowed> allowed;" while set_fraction). torch.cuda has
    set_per_process_memory_fraction (torch/cuda/memory.py: float in [0, 1]) and no getter (2.6+)."""

    total = 16 * GiB

    def __init__(self):
        self.set_fraction = False
        self.allowed = None
        self.calls = []

    def set(self, fraction, device=None):
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.calls.append(fraction)
        self.allowed = int(fraction * self.total)
        self.set_fraction = True


@pytest.fixture
def torch22_cuda(monkeypatch, fresh_meter_state):
    _no_cuda()
    fake = Torch22Fraction()
    monkeypatch.setattr(torch, "__version__", "2.2.2")
    monkeypatch.delattr(torch.cuda, "get_per_process_memory_fraction", raising=False)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", fake.set)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=None: SimpleNamespace(total_memory=fake.total))
    return fake


def test_a_cap_of_the_whole_device_leaves_torch_2_2s_allocator_untouched(torch22_cuda):
    from cuda_magic.devices.meter import CudaMeter

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CudaMeter(0).running(32 * GiB):       # more than the device: no cap to set
            pass
    assert torch22_cuda.calls == [] and not torch22_cuda.set_fraction
    assert not caught


def test_after_a_cap_torch_2_2_is_put_back_to_1_and_the_warning_says_what_stays(torch22_cuda):
    from cuda_magic.devices.meter import CudaMeter

    meter = CudaMeter(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with meter.running(4 * GiB):
            assert torch22_cuda.allowed == 4 * GiB
        with meter.running(8 * GiB):
            pass
    assert torch22_cuda.calls == [0.25, 1.0, 0.5, 1.0]
    assert torch22_cuda.allowed == torch22_cuda.total and torch22_cuda.set_fraction   # torch cannot unset
    said = [str(w.message) for w in caught]
    assert len(said) == 1, said
    assert "must be set again" in said[0] and "stays set" in said[0] and "allowed" in said[0]


# ------------------------------------------------------------------ 7. the XPU generators in a rollback

def test_the_rollback_restores_the_xpu_generators(monkeypatch):
    # torch/xpu/random.py (2.3+): get_rng_state_all() = [default_generators[i].get_state() for each
    # device]; set_rng_state_all(states) sets each (a clone), at once where the XPU is initialised
    from cuda_magic.recover.rollback import rng_state, set_rng_state

    _needs_xpu()
    generators = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]   # two devices'
    monkeypatch.setattr(torch.xpu, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 2)
    monkeypatch.setattr(torch.xpu, "get_rng_state_all", lambda: [g.get_state() for g in generators])

    def set_all(states):
        for g, s in zip(generators, states):
            g.set_state(s.clone())

    monkeypatch.setattr(torch.xpu, "set_rng_state_all", set_all)
    saved = rng_state()
    first = [torch.rand(3, generator=g) for g in generators]
    set_rng_state(saved)
    again = [torch.rand(3, generator=g) for g in generators]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
