"""Issue 38: the CUDA paths against torch's sources, round 3. `-l` under the cudaMallocAsync backend and
over torch's cache, a memory fraction with expandable segments, and `--expandable-segments` followed by
`--predict` / `-r` on the simulated device. The fakes of torch.cuda do what torch's code does (file and
version at each); none needs a GPU."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from conftest import run_ok
from cuda_magic.devices import meter as meter_module
from cuda_magic.devices.caching_allocator import CachingAllocatorModel, CannotReserve

MiB = 2**20
GiB = 2**30
UINT64_MAX = 2**64 - 1


@pytest.fixture
def fresh_fractions(monkeypatch):
    monkeypatch.setattr(meter_module, "_fractions_set", {})
    monkeypatch.setattr(meter_module, "_fraction_warned", set())


def _fake_cuda(monkeypatch, torch, *, backend: str, total: int, allocator=None):
    """torch.cuda's fraction API over one device of `total` bytes, as torch 2.6-2.13 have it.

    The setter's checks are torch/cuda/memory.py's `set_per_process_memory_fraction` (2.2-2.13: TypeError
    for a non-float, ValueError outside 0~1). backend "cudaMallocAsync": c10/cuda/CUDAMallocAsyncAllocator.cpp
    (2.6-2.13): `lazy_init_device` starts `pytorch_memory_limits` at UINT64_MAX, `getMemoryFraction` returns
    it divided by the device's total, `setMemoryFraction` sets it to fraction x total, `mallocAsync` fails
    when `pytorch_used_bytes + size` exceeds it. backend "native": `allocator`, a CachingAllocatorModel, whose
    capacity is `allowed_memory_maximum` (c10/cuda/CUDACachingAllocator.cpp `setMemoryFraction`)."""
    state = {"limit": UINT64_MAX, "used": 0, "emptied": 0}

    def set_fraction(fraction, device=None):
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        state["limit"] = int(fraction * total)
        if allocator is not None:
            allocator.capacity = state["limit"]
            allocator.device_total = total

    def get_fraction(device=None):
        if allocator is not None:
            return allocator.capacity / total
        return state["limit"] / total

    def empty_cache():
        state["emptied"] += 1
        if allocator is not None:
            allocator.empty_cache()

    cuda = torch.cuda
    monkeypatch.setattr(cuda, "get_allocator_backend", lambda: backend)
    monkeypatch.setattr(cuda, "set_per_process_memory_fraction", set_fraction)
    monkeypatch.setattr(cuda, "get_per_process_memory_fraction", get_fraction, raising=False)
    monkeypatch.setattr(cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=total))
    monkeypatch.setattr(cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(meter_module, "cuda_started", lambda: True)
    return state


def test_cap_under_cuda_malloc_async_restores_no_limit_without_error(monkeypatch, fresh_fractions):
    import torch

    state = _fake_cuda(monkeypatch, torch, backend="cudaMallocAsync", total=80 * GiB)
    assert torch.cuda.get_per_process_memory_fraction(0) > 2e8      # what the issue saw: about 2.3e8
    meter = meter_module.CudaMeter(0)
    with meter.running(20 * GiB):
        assert state["limit"] == 20 * GiB
    # 1.0 is the device's whole memory: nothing the driver can give is refused (before the fix:
    # ValueError from the setter, and the 20 GiB cap stayed for the process)
    assert state["limit"] == 80 * GiB
    with meter.running(80 * GiB):          # a cap of the whole device sets nothing
        assert state["limit"] == 80 * GiB


def test_cap_empties_the_cache_first_so_a_cached_segment_does_not_escape_it(monkeypatch, fresh_fractions):
    import torch

    model = CachingAllocatorModel(80 * GiB)
    _fake_cuda(monkeypatch, torch, backend="native", total=80 * GiB, allocator=model)
    earlier = model.malloc(2 * GiB)        # an earlier, larger cell: its segment stays cached
    model.free(earlier)
    assert model.reserved == 2 * GiB
    meter = meter_module.CudaMeter(0)
    with meter.running(1 * GiB):
        # get_free_block would serve 1.5 GiB from the cache without checking the fraction (alloc_block is
        # the only place it is checked): emptied first, the request must reserve, and the cap says no
        with pytest.raises(CannotReserve):
            model.malloc(1536 * MiB)
        model.free(model.malloc(512 * MiB))
    assert model.capacity == 80 * GiB


# ------------------------------------------------------------ a memory fraction with expandable segments

def test_a_fraction_checks_the_whole_allocation_size_before_mapping_expandable_pages():
    # c10/cuda/CUDACachingAllocator.cpp alloc_block (2.2 to 2.13): `set_fraction && total_allocated_memory +
    # size > allowed_memory_maximum` with size = p.alloc_size, before try_allocate_expandable_block maps
    # any page; the pages are then mapped while the device has memory.
    model = CachingAllocatorModel(64 * MiB, expandable_segments=True)
    model.device_total = 1 * GiB           # the fraction: 64 MiB of a 1 GiB device
    a = model.malloc(30 * MiB)             # alloc_size 30 MiB fits; two 20 MiB pages mapped
    assert model.reserved == 40 * MiB
    # 25 MiB: no cached block that large; mapping one more page (60 MiB reserved) would fit, but 40 MiB +
    # its 26 MiB allocation size is past the fraction
    with pytest.raises(CannotReserve):
        model.malloc(25 * MiB)
    # without a fraction (a 64 MiB device) the pages are what counts
    plain = CachingAllocatorModel(64 * MiB, expandable_segments=True)
    plain.malloc(30 * MiB)
    plain.malloc(25 * MiB)
    assert plain.reserved == 60 * MiB
    model.free(a)


def test_expandable_segments_span_the_device_under_a_fraction_and_a_forced_request_past_it_goes_on():
    # find_expandable_block: address space for 1 1/8 of prop.totalGlobalMem, the device's, not the fraction's
    model = CachingAllocatorModel(64 * MiB, expandable_segments=True)
    model.device_total = 1 * GiB
    block = model.malloc(60 * MiB)         # alloc_size 60 MiB under 64; 3 pages mapped (past it by a page
    assert model.reserved == 60 * MiB      # is allowed: map_block does not check the fraction)
    model.free(block)
    # a fake run reserves past the capacity (force): a request larger than the segment gets one that
    # holds it instead of failing on a missing next block (the lab's AttributeError)
    big = model.malloc(4 * GiB, force=True)
    assert big is not None and big.size == 4 * GiB


# ------------------------------------------- --expandable-segments, then --predict and -r (the lab bug)

@pytest.fixture
def expandable(tip):
    from cuda_magic.devices.simulated import apply_allocator_settings

    tip.run_line_magic("gpumem", "--simulate 1GiB -q")
    try:
        run_ok(tip, "%%oomguard -q -l 64MiB --expandable-segments\ny = torch.ones(4)")
        yield tip
    finally:
        tip.run_cell("y = None")
        tip.run_line_magic("gpumem", "--simulate off -q")
        apply_allocator_settings(None)


def _run_capped(ip, bs: int):
    ip.user_ns["bs"] = bs
    return ip.run_cell("%%oomguard -q -o --no-raise -l 64MiB\nx = torch.ones(bs, 2**16)\ndel x").result


def _fits(ip, bs: int) -> bool:
    return _run_capped(ip, bs).outcome == "ok"


def test_predict_after_expandable_segments_finds_the_largest_value(expandable):
    from cuda_magic.devices.simulated import active_device

    assert active_device().expandable_segments
    expandable.user_ns["bs"] = 1000
    result = expandable.run_cell("%%oomguard --predict -q -o -r bs -l 64MiB\nx = torch.ones(bs, 2**16)")
    assert result.error_in_exec is None, result.error_in_exec
    p = result.result
    assert p.complete, str(p)                         # was: stopped at line 1 (AttributeError)
    assert p.fits is False and p.largest is not None, str(p)
    assert expandable.user_ns["bs"] == 1000                # --predict changes nothing
    # the real runs agree: the largest fits, 5% more does not (a 64 MiB fraction: 2 MiB of small pool
    # and the request's allocation size)
    assert _fits(expandable, p.largest)
    assert not _fits(expandable, int(p.largest / 0.95) + 1)


def test_a_cap_after_a_larger_cell_empties_the_simulated_cache(expandable):
    assert _fits(expandable, 248)          # 62 MiB + 2 MiB of small pool: exactly the cap
    # its pages stay mapped (80 MiB) and would serve 64 MiB without a new allocation: -l empties them first
    report = _run_capped(expandable, 256)
    assert report.outcome == "oom"
    # and the report says what the cap bounds (y, 512 B, was held before the run)
    said = [w for w in report.warnings if "bounds everything PyTorch reserves on sim:0" in w]
    assert said and "512 B held before the run" in said[0], report.warnings


def test_retry_under_expandable_segments_lands_on_a_value_that_fits(expandable):
    expandable.user_ns["bs"] = 1000
    report = expandable.run_cell("%%oomguard -q -o -r bs -l 64MiB\nx = torch.ones(bs, 2**16)\ndel x").result
    assert report.outcome == "recovered" and report.final_value is not None
    assert 0.85 * 248 <= report.final_value <= 248, [a.value for a in report.attempts]


# -------------------------------------------------- NVML: containers' host pids, "not available" figures

from test_gpu_readers import (FakeAmdSmi, TWO_STARTED, _rocm, _started_cuda,  # noqa: E402
                              clean_env, fresh_amdsmi)
from test_nvml_backends import ME, OTHER, THIRD, FakeGpu, FakeNvml  # noqa: E402

from cuda_magic.devices.backends import read_devices  # noqa: E402
from cuda_magic.devices.gauge_reader import GaugeReader  # noqa: E402

HOST_PID = 3_900_417       # this process's pid in the host's namespace, which NVML lists


def _in_container(monkeypatch):
    """A PID namespace of its own: /proc/self/ns/pid is not the initial namespace's (PROC_PID_INIT_INO,
    4026531836, include/linux/proc_ns.h), and NVML lists this process by its host pid (NVML's
    nvmlProcessInfo_t.pid is the driver's, i.e. the host's)."""
    import os

    real = os.readlink
    monkeypatch.setattr(os, "readlink", lambda path, *a, **k: "pid:[4026532513]" if path == "/proc/self/ns/pid"
                        else real(path, *a, **k))


STARTED_A100 = [dict(uuid="aaaa1111-0000", total=40 * GiB, free=27 * GiB, reserved=2 * GiB, allocated=GiB,
                     context=True)]


def test_in_a_container_this_process_is_found_by_its_figures_not_its_pid(clean_env, fresh_nvml, monkeypatch):
    _in_container(monkeypatch)
    # NVML's list: this process under its host pid (2 GiB reserved + a 500 MiB context), another job
    FakeNvml([FakeGpu("NVIDIA A100-SXM4-40GB", 40 * GiB, 13 * GiB, "GPU-aaaa1111-0000",
                      compute=[(HOST_PID, 2 * GiB + 500 * MiB), (OTHER, 10 * GiB)])]).install(monkeypatch)
    _started_cuda(monkeypatch, STARTED_A100)
    assert GaugeReader(meter_module.CudaMeter(0)).read().other_processes == 10 * GiB   # was 12.5 GiB
    reading = read_devices()
    (dev,) = [d for d in reading.devices if d.kind == "cuda"]
    assert dev.other_this_process == 500 * MiB and dev.other_processes == 13 * GiB - 2 * GiB - 500 * MiB
    rows = {p.pid: p for p in reading.processes}
    assert rows[HOST_PID].this_process and not rows[OTHER].this_process


def test_in_a_container_two_entries_that_could_be_this_process_leave_it_unknown(clean_env, fresh_nvml,
                                                                                monkeypatch):
    _in_container(monkeypatch)
    FakeNvml([FakeGpu("NVIDIA A100-SXM4-40GB", 40 * GiB, 13 * GiB, "GPU-aaaa1111-0000",
                      compute=[(HOST_PID, 2 * GiB + 500 * MiB), (OTHER, 2 * GiB + 700 * MiB)])]).install(monkeypatch)
    _started_cuda(monkeypatch, STARTED_A100)
    assert GaugeReader(meter_module.CudaMeter(0)).read().other_processes is None     # never ours as theirs


def test_nvml_not_available_for_another_process_is_unknown_not_zero(clean_env, fresh_nvml, monkeypatch):
    # pynvml (nvidia-ml-py 13.615, nvmlDeviceGetComputeRunningProcesses) turns NVML_VALUE_NOT_AVAILABLE
    # into usedGpuMemory None ("special case for WDDM on Windows")
    FakeNvml([FakeGpu("NVIDIA A100-SXM4-40GB", 40 * GiB, 13 * GiB, "GPU-aaaa1111-0000",
                      compute=[(ME, 3 * GiB), (OTHER, None)])]).install(monkeypatch)
    assert GaugeReader(meter_module.CudaMeter(0)).read().other_processes is None       # was 0
    _started_cuda(monkeypatch, STARTED_A100)
    FakeNvml([FakeGpu("NVIDIA A100-SXM4-40GB", 40 * GiB, 13 * GiB, "GPU-aaaa1111-0000",
                      compute=[(ME, None), (OTHER, 10 * GiB)])]).install(monkeypatch)
    (dev,) = [d for d in read_devices().devices if d.kind == "cuda"]
    # this process's own figure not available: its share is not known (was: 0, so 11 GiB blamed on others)
    assert dev.other_this_process is None and dev.other_processes is None


# ----------------------------------------------------------- ROCm: torch 2.4-2.11's amdsmi index helper

def test_rocm_uses_torchs_index_helper_where_it_flags_amdsmi_as_pynvml(clean_env, fresh_nvml, fresh_amdsmi,
                                                                       monkeypatch):
    # torch 2.4 to 2.11 (torch/cuda/__init__.py): the HIP build imports amdsmi and sets _HAS_PYNVML (there is
    # no _HAS_AMDSMI, 2.13's); _get_amdsmi_device_index maps cuda:N through HIP_VISIBLE_DEVICES (its
    # indices: position N of the list) and nothing else
    import os

    import torch

    def helper_2_4(device):
        idx = device if isinstance(device, int) else torch.device(device).index or 0
        visible = [int(v) for v in os.environ["HIP_VISIBLE_DEVICES"].split(",")]
        if idx >= len(visible):
            raise RuntimeError(f"device {idx} is not visible (HIP_VISIBLE_DEVICES={visible})")
        return visible[idx]

    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1")
    in_hip_order = [{"hip_id": 0, "processes": [(THIRD, 5 * GiB, "/opt/other/train")]},
                    {"hip_id": 1, "processes": [(ME, 3 * GiB, "python3"), (OTHER, 2 * GiB, "serve")]}]
    _rocm(monkeypatch, FakeAmdSmi(in_hip_order).module(), torch_helper=False)
    monkeypatch.delattr(torch.cuda, "_HAS_AMDSMI", raising=False)
    monkeypatch.setattr(torch.cuda, "_HAS_PYNVML", True, raising=False)
    monkeypatch.setattr(torch.cuda, "_get_amdsmi_device_index", helper_2_4, raising=False)
    _started_cuda(monkeypatch, TWO_STARTED[:1])
    (dev,) = [d for d in read_devices().devices if d.kind == "cuda"]
    # cuda:0 is amdsmi GPU 1, this process's (was: GPU 0, another job's 5 GiB)
    assert (dev.other_this_process, dev.other_processes) == (GiB, 2 * GiB)
    assert not [n for n in dev.notes if "HIP_VISIBLE_DEVICES is set" in n]


# -------------------------------------------- --predict for a GPU: CUDA's cast lists, cuBLAS's workspace

def test_cuda_cast_lists_einsum_in_bf16_exp_and_sum_in_fp32_weight_casts_cached():
    # CUDA's lists (ATen/autocast_mode.h of torch 2.13, registered for AutocastCUDA in autocast_mode.cpp):
    # einsum and linear lower_precision_fp, exp fp32, sum fp32_set_opt_dtype; cached_cast keeps one cast of
    # a leaf fp32 weight that requires grad for the whole region. The CPU's lists have no einsum, exp, sum.
    import torch

    from cuda_magic.fakerun.cuda_autocast import cuda_autocast

    w = torch.nn.Parameter(torch.randn(8, 16))
    x = torch.randn(4, 16)
    with cuda_autocast("bf16") as mode:
        y = torch.einsum("ij,bj->bi", w, x)
        assert y.dtype == torch.bfloat16
        assert torch.exp(y).dtype == torch.float32 and y.exp().dtype == torch.float32
        assert y.sum(-1).dtype == torch.float32 and torch.sum(y).dtype == torch.float32
        assert torch.nn.functional.softmax(y, -1).dtype == torch.float32
        assert torch.nn.functional.linear(x, w).dtype == torch.bfloat16
        assert (x @ w.t()).dtype == torch.bfloat16
        assert len(mode.cache) == 1                     # w cast once, used three times
        loss = torch.nn.functional.cross_entropy(y, torch.tensor([0, 1, 2, 3]))
        assert loss.dtype == torch.float32
    assert not mode.cache                               # cleared with the region, as torch's
    with torch.autocast("cpu", dtype=torch.bfloat16):   # the CPU's lists: what the prediction used
        assert torch.exp(y).dtype == torch.bfloat16 and y.sum(-1).dtype == torch.bfloat16


def test_cublas_workspace_size_per_architecture_and_config():
    # aten/src/ATen/cuda/CublasHandlePool.cpp parseChosenWorkspaceSize: ":4096:2:16:8" by default
    # (8.125 MiB), 4096 KiB x 8 on sm 9.0; each ":SIZE:COUNT" adds SIZE KiB x COUNT
    from cuda_magic.fakerun.cuda_autocast import cublas_workspace_size

    assert cublas_workspace_size((8, 0), (2, 6), config=None) == 8 * MiB + 128 * 1024
    assert cublas_workspace_size((9, 0), (2, 6), config=None) == 32 * MiB
    assert cublas_workspace_size((10, 0), (2, 6), config=None) == 8 * MiB + 128 * 1024
    assert cublas_workspace_size((10, 0), (2, 13), config=None) == 32 * MiB
    assert cublas_workspace_size((9, 0), (2, 6), config=":16:8") == 128 * 1024
    assert cublas_workspace_size((8, 0), (2, 6), config=":4096:8:16:8") == 32 * MiB + 128 * 1024
    assert cublas_workspace_size((9, 0), (2, 6), config="garbage") == 32 * MiB    # torch warns, default


@pytest.fixture
def gpu_like(tip):
    tip.run_line_magic("gpumem", "--simulate 1GiB -q")
    try:
        run_ok(tip, "torch.manual_seed(0)\nw = torch.nn.Parameter(torch.randn(1024, 1024))\nx = torch.randn(4096, 1024)")
        yield tip
    finally:
        tip.run_cell("w = x = None")
        tip.run_line_magic("gpumem", "--simulate off -q")


def _predicted(ip, flags: str, cell: str):
    result = ip.run_cell(f"%%oomguard --predict -q -o {flags}\n" + cell)
    assert result.error_in_exec is None, result.error_in_exec
    return result.result


def test_predict_amp_on_a_simulated_gpu_uses_cudas_lists_and_counts_workspaces(gpu_like):
    from cuda_magic.devices.simulated import active_device

    cell = "e = torch.exp(torch.einsum('ij,bj->bi', w, x))"
    p = _predicted(gpu_like, "--amp bf16", cell)
    # CUDA: x's bf16 copy (8 MiB) and w's (2 MiB, cached), the einsum's bf16 output (8 MiB) cast back to
    # fp32 for exp (16 MiB) and exp's fp32 output (16 MiB), over w and x (4 + 16 MiB); the CPU's lists run
    # einsum in fp32 (16 MiB) and exp on it: 52 MiB
    assert p.peak >= 60 * MiB, p.peak
    step = "y = torch.einsum('ij,bj->bi', w, x)\ny.sum().backward()"
    before = _predicted(gpu_like, "", step).peak
    active_device().cublas_workspace = 32 * MiB
    try:
        after = _predicted(gpu_like, "", step).peak
        forward_only = _predicted(gpu_like, "", "y = torch.einsum('ij,bj->bi', w, x)").peak
    finally:
        active_device().cublas_workspace = 0
    # the cell's thread and autograd's one workspace each: the second is taken in the backward pass, when
    # some of the forward's tensors are gone, so it adds to the peak what it overlaps
    assert 32 * MiB < after - before <= 64 * MiB, (after - before) / MiB
    assert forward_only - _predicted(gpu_like, "", "y = torch.einsum('ij,bj->bi', w, x)").peak == 32 * MiB


def test_predict_of_the_recorded_cs336_bf16_forward_is_within_1_percent():
    """The 3.41B model's forward under bf16 autocast, recorded on an H100 with torch 2.6
    (../shared/gpu_traces/cs336_ctx512_fwd_mixed), predicted from the public model code
    kkaitlyn111/cs336-assignment1 where `fetch` left it (skipped where the code, einops/jaxtyping or the
    recording is absent)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    import bench_cs336_amp as bench

    # context 512: the CPU's cast lists (what the prediction used before) were 3.8% low there
    trace = os.path.join(bench.TRACES, "cs336_ctx512_fwd_mixed.pickle.gz")
    source = bench.model_source(None)
    deps = "/tmp/cs336deps"
    if not os.path.exists(trace) or source is None or not os.path.isdir(deps):
        pytest.skip("the cs336 recording, the fetched model code or einops/jaxtyping (in /tmp/cs336deps) is absent")
    sys.path[:0] = [source, deps]
    real = bench.recorded_peak(trace)
    predicted = bench.predict_forward(512).peak
    assert abs(predicted - real) <= 0.01 * real, (predicted, real)


# ----------------------------- the default path's prediction tests, with expandable segments switched on

@pytest.fixture
def mlp_expandable(tip):
    from test_predict import MLP

    from cuda_magic.devices.simulated import apply_allocator_settings

    run_ok(tip, "%gpumem --simulate 64MiB")
    try:
        run_ok(tip, "%%oomguard -q --expandable-segments\npass")
        run_ok(tip, MLP + "bs = 512")
        yield tip
    finally:
        tip.run_line_magic("gpumem", "--simulate off -q")
        apply_allocator_settings(None)


def test_expandable_the_predicted_peak_is_the_peak_of_a_real_run(mlp_expandable):
    from test_predict import STEP, measured, predict

    from cuda_magic.devices.simulated import active_device

    assert active_device().expandable_segments
    p = predict(mlp_expandable, "", STEP)
    real = measured(mlp_expandable, "", STEP)
    assert real.outcome == "ok" and p.complete and p.fits is True
    assert abs(p.peak - real.peaks["sim:0"]) <= 0.05 * real.peaks["sim:0"], (p.peak, real.peaks)


def test_expandable_largest_with_accumulation_fits_when_run(mlp_expandable):
    from test_predict import STEP, measured, predict

    run_ok(mlp_expandable, "bs, acc = 4096, 2")
    cell = STEP.replace("for step in range(3):", "for step in range(3 * acc):").replace(
        "loss.backward()", "(loss / acc).backward()")
    p = predict(mlp_expandable, "-r bs -a acc", cell)
    assert p.fits is False and p.largest is not None and p.largest * p.largest_accumulation >= 4096 * 2
    run_ok(mlp_expandable, f"bs, acc = {p.largest}, {p.largest_accumulation}")
    assert measured(mlp_expandable, "", cell).outcome == "ok"
    run_ok(mlp_expandable, f"bs = {int(p.largest / 0.95) + 1}")
    assert measured(mlp_expandable, "", cell).outcome == "oom"


@pytest.fixture
def trainer_expandable(tip):
    from test_retry_prediction import SETUP

    from cuda_magic.devices.simulated import apply_allocator_settings

    tip.run_line_magic("gpumem", "--simulate 128MiB -q")
    try:
        run_ok(tip, "%%oomguard -q --expandable-segments\npass")
        run_ok(tip, SETUP)
        yield tip
    finally:
        tip.run_line_magic("gpumem", "--simulate off -q")
        apply_allocator_settings(None)


#: the largest bs at which test_retry_prediction's MLP cell fits on 128 MiB with expandable segments
#: (torch 2.13 CPU build; `largest` checks it and searches outward where another torch differs). On
#: 32 MiB the large pool's 20 MiB pages leave one page mapped, and the retry's check that the allocator
#: can serve the failure's memory scaled (recover/retry.py `_served`, one block for all that was held)
#: lands at 71% of the largest: not this issue's code, said in its report
LARGEST_MLP_EXPANDABLE = 9830


def test_expandable_the_first_retry_fits_within_15_percent_of_the_largest(trainer_expandable):
    from retry_helpers import largest
    from test_retry_prediction import CELL

    maximum = largest(trainer_expandable, CELL, LARGEST_MLP_EXPANDABLE)
    for start in (int(maximum * 1.4), int(maximum * 1.9)):
        run_ok(trainer_expandable, f"reset()\nbs = {start}")
        report = trainer_expandable.run_cell("%%oomguard -q -o -r bs\n" + CELL).result
        values = [a.value for a in report.attempts]
        assert len(values) == 2 and 0.85 * maximum <= report.final_value <= maximum, (values, maximum)
