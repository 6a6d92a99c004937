"""The model of torch's CUDA caching allocator (devices/caching_allocator.py), rule by rule, against torch's
source, and the simulated device that reserves through it.

Sources cited (see the module docstring): c10/cuda/CUDACachingAllocator.cpp, class DeviceCachingAllocator,
in the 2.2-era code and in the pytorch/pytorch revision 001074d2 (2.4-era); c10/cuda/CUDAAllocatorConfig.cpp
(2.2-era) for the settings; the newest form, c10/core/CachingDeviceAllocator.h (CachingDeviceAllocatorImpl),
with torch 2.13's c10/core/AllocatorConfig.h. "torch 2.2 to 2.13" below means the rule reads the same in
all of them.
"""
from __future__ import annotations

import pytest

from cuda_magic.devices.caching_allocator import (CachingAllocatorModel, CannotReserve, kLargeBuffer,
                                                  parse_divisions, roundup_power2_next_division)

MiB = 2**20


def test_simulated_devices_reserve_as_the_caching_allocator_unless_told_plain(tip):
    """The default everywhere: a device made with no allocator named, and `%gpumem --simulate`'s, model
    torch's caching allocator (a 1-byte tensor takes a 512-byte block of a 2 MiB segment); "plain" counts
    the storages' bytes, for one device or (`default_allocator`) for every device made afterwards."""
    from cuda_magic.devices.simulated import SimulatedDevice, active_device

    with SimulatedDevice(1 << 30) as dev:
        t = torch.empty(1, dtype=torch.uint8)
        assert dev.allocator == "caching" and (dev.allocated, dev.reserved) == (512, 2 * MiB)
    with SimulatedDevice(1 << 30, allocator="plain") as dev:
        t = torch.empty(1, dtype=torch.uint8)
        assert dev.model is None and (dev.allocated, dev.reserved) == (1, 1)
    del t
    tip.run_line_magic("gpumem", "--simulate 64MiB -q")
    try:
        assert active_device().allocator == "caching"
    finally:
        tip.run_line_magic("gpumem", "--simulate off -q")
    SimulatedDevice.default_allocator = "plain"
    try:
        tip.run_line_magic("gpumem", "--simulate 64MiB -q")
        assert active_device().allocator == "plain"
        tip.run_line_magic("gpumem", "--simulate off -q")
    finally:
        SimulatedDevice.default_allocator = "caching"


def test_a_snapshot_keeps_the_allocator_of_its_moment_and_gives_a_fresh_copy_each_time():
    """allocator_snapshot(): what a retry asks later about the moment after a failure was undone (a
    --search probe still holds its memory when the next probe is chosen)."""
    from cuda_magic.devices.simulated import SimulatedDevice

    with SimulatedDevice(1 << 30) as dev:
        kept = torch.empty(5 * MiB, dtype=torch.uint8)
        snapshot = dev.allocator_snapshot()
        later = torch.empty(30 * MiB, dtype=torch.uint8)
        copy = snapshot()
        assert (copy.allocated, copy.reserved) == (5 * MiB, 20 * MiB)     # not the 30 MiB taken after it
        assert (dev.allocated, dev.reserved) == (35 * MiB, 50 * MiB)
        copy.malloc(10 * MiB)                                            # a replay changes its own copy
        assert snapshot().allocated == 5 * MiB and dev.allocated == 35 * MiB
    del kept, later
    with SimulatedDevice(1 << 30, allocator="plain") as dev:
        assert dev.allocator_snapshot() is None


def model(capacity=1 << 30, **settings) -> CachingAllocatorModel:
    return CachingAllocatorModel(capacity, **settings)


# ---------------------------------------------------------------------------------------- round_size

def test_sizes_round_up_to_512_bytes():
    # round_size (CUDACachingAllocator.cpp, torch 2.2 to 2.13; get_round_size in CachingDeviceAllocator.h):
    # below kMinBlockSize (512) a request takes 512 bytes, else a multiple of 512
    m = model()
    assert [m.round_size(n) for n in (1, 511, 512, 513, 40_000, 2**20)] == [512, 512, 512, 1024, 40_448, 2**20]


def test_roundup_power2_divisions():
    # roundup_power2_next_division's own example (CUDACachingAllocator.cpp, 2.2 to 2.13): 1200 with 4
    # divisions of 1024..2048 is 1280; a power of two stays
    assert roundup_power2_next_division(1200, 4) == 1280
    assert roundup_power2_next_division(4096, 4) == 4096
    m = model(roundup_power2_divisions=4)
    # round_size uses it above kMinBlockSize * divisions (2048 here): 5 MiB + 1 B between 4 and 8 MiB in
    # steps of 1 MiB is 6 MiB; 1200 bytes is below 2048 and gets plain 512-byte rounding
    assert m.round_size(5 * MiB + 1) == 6 * MiB
    assert m.round_size(1200) == 1536
    # divisions of 1 mean plain rounding (2.4-era and newest: "divisions > 1"; the 2.2-era code returned
    # the size unrounded there)
    assert model(roundup_power2_divisions=1).round_size(5 * MiB + 1) == 5 * MiB + 512


def test_roundup_power2_divisions_per_interval_parse_as_torch():
    # parseRoundUpPower2Divisions (c10/core/AllocatorConfig.cpp, newest; CUDAAllocatorConfig.cpp in 2.2):
    # keys are MiB (powers of two), the first key's divisions also below it, ">" after the last key named
    # (2.2 filled from that key itself); 16 intervals from 1 MiB to 64 GiB
    divs = parse_divisions("[256:1,512:2,>:8]")
    assert divs[:8] == (1,) * 8 and divs[8] == 1 and divs[9] == 2 and divs[10:] == (8,) * 6
    assert parse_divisions("4") == (4,) * 16
    with pytest.raises(ValueError):
        parse_divisions("3")                   # "the divisons has to be power of 2"
    m = CachingAllocatorModel.from_conf(1 << 34, "roundup_power2_divisions:[256:1,512:2,>:8]")
    assert m.round_size(600 * MiB + 1) == 768 * MiB          # 512..1024 MiB in 2 steps
    assert m.round_size(100 * MiB + 1) == 100 * MiB + 512    # 1 division below 512 MiB: plain rounding


# ------------------------------------------------------------------------- pools and segment sizes

def test_one_byte_reserves_a_2_MiB_small_segment_and_allocates_512_bytes():
    # get_pool: size <= kSmallSize (1 MiB) is the small pool; get_allocation_size: kSmallBuffer (2 MiB)
    m = model()
    m.malloc(1)
    assert (m.allocated, m.reserved) == (512, 2 * MiB)
    # small requests pack into that segment: 4096 blocks of 512 bytes fill it, the next needs another
    for _ in range(4095):
        m.malloc(1)
    assert m.reserved == 2 * MiB and m.segments == 1
    m.malloc(1)
    assert m.reserved == 4 * MiB and m.segments == 2


def test_one_MiB_is_small_and_one_byte_more_is_large():
    m = model()
    m.malloc(MiB)
    assert m.reserved == 2 * MiB
    m.malloc(MiB + 1)                                     # large pool: a 20 MiB segment
    assert m.reserved == 2 * MiB + kLargeBuffer


def test_five_MiB_reserves_20_MiB_and_the_rest_serves_the_next_requests():
    # get_allocation_size: kSmallSize < size < kMinLargeAlloc (10 MiB) reserves kLargeBuffer (20 MiB);
    # should_split (large pool): the remainder (15 MiB > kSmallSize) is split off and cached
    m = model()
    m.malloc(5 * MiB)
    assert (m.allocated, m.reserved, m.largest_free_block) == (5 * MiB, 20 * MiB, 15 * MiB)
    m.malloc(5 * MiB)                                     # best fit: the cached 15 MiB
    assert m.reserved == 20 * MiB and m.inactive_split == 10 * MiB


def test_large_requests_reserve_their_size_rounded_to_2_MiB():
    # get_allocation_size: from kMinLargeAlloc (10 MiB) the size rounded up to kRoundLarge (2 MiB)
    m = model()
    m.malloc(30 * MiB)
    assert m.reserved == 30 * MiB
    m.malloc(31 * MiB)
    assert m.reserved == 30 * MiB + 32 * MiB
    m.malloc(10 * MiB)                                    # 10 MiB is not below kMinLargeAlloc
    assert m.reserved == 72 * MiB


def test_large_segment_size_mb_of_torch_2_13():
    # c10/core/AllocatorConfig.h (torch 2.13): large_segment_size_mb replaces the 20 MiB of kLargeBuffer
    m = CachingAllocatorModel.from_conf(1 << 30, "large_segment_size_mb:40")
    m.malloc(5 * MiB)
    assert m.reserved == 40 * MiB


# ---------------------------------------------------------------------------------------- best fit

def test_freed_blocks_are_reused_best_fit_and_allocated_counts_the_whole_block():
    # get_free_block: lower_bound over the pool's blocks ordered by size: the smallest that fits
    m = model()
    blocks = [m.malloc(n * MiB) for n in (12, 24, 14)]
    for b in blocks:
        m.free(b)
    assert m.allocated == 0 and m.reserved == 50 * MiB
    m.malloc(13 * MiB)                 # the 14 MiB block; the 1 MiB left is not more than kSmallSize: no split
    assert m.allocated == 14 * MiB     # allocated_bytes counts block->size (alloc_found_block)
    m.malloc(12 * MiB + 512 * 1024)    # the 12 MiB block is too small: the 24 MiB one, split
    assert m.allocated == 14 * MiB + 12 * MiB + 512 * 1024
    assert m.reserved == 50 * MiB      # nothing new reserved


# ------------------------------------------------------------------------------- splits and merges

def test_split_rules_small_and_large():
    # should_split (2.2 to 2.13): small pool splits a remainder >= kMinBlockSize; large pool only one
    # > kSmallSize (1 MiB)
    m = model()
    m.malloc(2 * MiB - 512)            # above 1 MiB: the large pool; 18 MiB + 512 left of 20 MiB, split off
    assert m.allocated == 2 * MiB - 512 and m.largest_free_block == 18 * MiB + 512
    m2 = model()
    m2.malloc(MiB - 512)               # small pool, one 2 MiB segment: 1 MiB + 512 left, split off
    m2.malloc(MiB)                     # from that remainder: the 512 bytes left are split off too
    assert m2.allocated == 2 * MiB - 512 and m2.reserved == 2 * MiB and m2.largest_free_block == 512
    m3 = model()
    m3.malloc(19 * MiB)                # its own 20 MiB segment: the 1 MiB left is not split off
    assert m3.allocated == 20 * MiB and m3.largest_free_block == 0
    m4 = model()
    m4.malloc(18 * MiB + 512 * 1024)   # 1.5 MiB left: split
    assert m4.allocated == 18 * MiB + 512 * 1024 and m4.largest_free_block == 1536 * 1024


def test_a_freed_block_merges_with_free_neighbours_and_whole_segments_go_back():
    # free_block / try_merge_blocks: a freed block merges with free neighbours in its segment;
    # release_cached_blocks (empty_cache) frees only blocks that are a whole segment
    m = model()
    a, b, c = (m.malloc(4 * MiB) for _ in range(3))     # one 20 MiB segment: 4 + 4 + 4 + 8 free
    m.free(b)
    assert m.inactive_split == 4 * MiB + 8 * MiB         # free pieces of a segment still in use
    assert m.empty_cache() == 0                          # nothing is a whole free segment
    m.free(a)
    assert m.largest_free_block == 8 * MiB               # a + b merged
    m.free(c)                                            # a + b + c + the 8 MiB: the whole segment
    assert m.largest_free_block == 20 * MiB and m.inactive_split == 0
    assert m.empty_cache() == 20 * MiB and m.reserved == 0


# -------------------------------------------------------------------------------- max_split_size

def test_max_split_size_blocks_are_not_split_and_serve_only_close_requests():
    # should_split: not for requests >= max_split_size; get_free_block: a request below max_split_size
    # never gets an oversize block, one above only a block less than kLargeBuffer (20 MiB) larger
    # (max_non_split_rounding_size in the newest code, default 20 MiB)
    m = CachingAllocatorModel.from_conf(1 << 30, "max_split_size_mb:64")
    assert m.max_split_size == 64 * MiB
    m.free(m.malloc(100 * MiB))
    m.malloc(30 * MiB)                 # not from the cached 100 MiB block: a segment of its own
    assert m.reserved == 130 * MiB
    m.malloc(70 * MiB)                 # 100 >= 70 + 20: not served by the oversize block either
    assert m.reserved == 200 * MiB
    big = m.malloc(90 * MiB)           # within 20 MiB: the whole 100 MiB block, not split
    assert big.size == 100 * MiB and m.reserved == 200 * MiB
    # without max_split_size the cached block would have been split for the 30 MiB request
    m2 = model()
    m2.free(m2.malloc(100 * MiB))
    m2.malloc(30 * MiB)
    assert m2.reserved == 100 * MiB and m2.largest_free_block == 70 * MiB


def test_max_non_split_rounding_mb_of_the_newest_code():
    m = CachingAllocatorModel.from_conf(1 << 30, "max_split_size_mb:64,max_non_split_rounding_mb:40")
    m.free(m.malloc(100 * MiB))
    m.malloc(70 * MiB)                 # 100 < 70 + 40: served
    assert m.reserved == 100 * MiB and m.allocated == 100 * MiB


def test_max_split_size_must_be_at_least_20_MiB():
    # parseMaxSplitSize: "max_split_size_mb too small, must be > 20" (2.2); >= kLargeBuffer / 1 MiB (newest)
    with pytest.raises(ValueError):
        CachingAllocatorModel.from_conf(1 << 30, "max_split_size_mb:10")
    assert CachingAllocatorModel.from_conf(1 << 30, "max_split_size_mb:10", strict=False).max_split_size is None


# ----------------------------------------------------------------------------- the out-of-memory path

def test_cached_segments_are_released_before_running_out():
    # malloc: alloc_block fails -> release_cached_blocks (every cached block that is a whole segment) ->
    # alloc_block again (2.2 to 2.13)
    m = model(100 * MiB)
    m.free(m.malloc(30 * MiB))
    m.free(m.malloc(30 * MiB + 1))     # too large for the cached 30 MiB block: a 32 MiB segment
    assert m.reserved == 62 * MiB
    m.malloc(50 * MiB)                 # 62 + 50 > 100: both cached segments go back, then it fits
    assert m.reserved == 50 * MiB and m.num_alloc_retries == 1


def test_with_max_split_size_only_enough_oversize_blocks_are_released_first():
    # release_available_cached_blocks (only with max_split_size set): no single cached block of at least
    # max(request, max_split_size), so the largest oversize blocks go until that much is released; the
    # other cached segments stay (release_cached_blocks is not reached)
    m = CachingAllocatorModel.from_conf(200 * MiB, "max_split_size_mb:64")
    for n in (100, 80, 5):
        m.free(m.malloc(n * MiB))      # cached: 100 and 80 MiB (oversize) and a 20 MiB small segment
    assert m.reserved == 200 * MiB
    m.malloc(130 * MiB)
    assert m.reserved == 20 * MiB + 130 * MiB        # the 20 MiB segment is still cached
    assert m.num_alloc_retries == 0


def test_out_of_memory_states_torchs_figures():
    # malloc's OOM message: "Tried to allocate" format_size(alloc_size), allocated_bytes, and
    # reserved_bytes - allocated_bytes "reserved by PyTorch but unallocated" (2.2 to 2.13)
    m = model(64 * MiB)
    keep = m.malloc(30 * MiB)
    with pytest.raises(CannotReserve) as err:
        m.malloc(40 * MiB)
    e = err.value
    assert (e.requested, e.size, e.alloc_size) == (40 * MiB, 40 * MiB, 40 * MiB)
    assert (e.allocated, e.reserved, e.free, e.reserved_unallocated) == (30 * MiB, 30 * MiB, 34 * MiB, 0)
    assert m.num_ooms == 1 and keep.allocated


def test_holes_in_full_segments_run_out_without_expandable_segments_and_fit_with_them():
    """A 60 MiB tensor freed, a 30 MiB one made in its segment (best fit, split), then 40 MiB: the 30 MiB
    hole stays reserved (its segment is in use) and there is no room for a new 40 MiB segment. With
    expandable segments the hole is the end of the one segment: the 40 MiB block grows into one more
    20 MiB page (try_allocate_expandable_block, map_block; 2.2 to 2.13)."""
    m = model(80 * MiB)
    m.free(m.malloc(60 * MiB))
    m.malloc(30 * MiB)
    with pytest.raises(CannotReserve) as err:
        m.malloc(40 * MiB)
    e = err.value
    assert (e.allocated, e.reserved, e.reserved_unallocated) == (30 * MiB, 60 * MiB, 30 * MiB)
    assert e.inactive_split == 30 * MiB and e.largest_free_block == 30 * MiB

    x = model(80 * MiB, expandable_segments=True)
    x.free(x.malloc(60 * MiB))
    x.malloc(30 * MiB)
    x.malloc(40 * MiB)
    assert (x.allocated, x.reserved, x.segments) == (70 * MiB, 80 * MiB, 1)
    [segment] = x.snapshot()
    assert segment["is_expandable"] and [b["size"] for b in segment["blocks"]] == [30 * MiB, 40 * MiB, 10 * MiB]


# ------------------------------------------------------------------------------ expandable segments

def test_expandable_segments_map_2_MiB_pages_small_and_20_MiB_pages_large():
    # find_expandable_block: segment_size kSmallBuffer for the small pool, kLargeBuffer for the large;
    # try_allocate_expandable_block maps the pages the request needs (its rounded size, not alloc_size)
    x = model(expandable_segments=True)
    x.malloc(1)
    assert x.reserved == 2 * MiB
    x.malloc(30 * MiB)                 # two 20 MiB pages; the 10 MiB left is split off (>= 512 B)
    assert x.reserved == 2 * MiB + 40 * MiB and x.largest_free_block == 10 * MiB
    x.malloc(10 * MiB)                 # the rest of the mapped pages
    assert x.reserved == 42 * MiB and x.segments == 2        # one segment per pool


def test_free_pages_stay_mapped_until_the_out_of_memory_path_or_empty_cache_unmaps_them():
    # free_block keeps pages mapped; release_cached_blocks -> release_blocks -> unmap_block unmaps the
    # pages lying wholly inside a free block (ExpandableSegment::unmap: segmentRight(begin)..segmentLeft(end))
    x = model(80 * MiB, expandable_segments=True)
    a = x.malloc(30 * MiB)             # pages 0-1
    x.malloc(10 * MiB)                 # the rest of page 1
    x.free(a)
    assert x.reserved == 40 * MiB      # freed, still mapped
    x.malloc(45 * MiB)                 # 40 + 60 > 80: page 0 (wholly free) is unmapped, then 60 MiB mapped
    assert x.reserved == 80 * MiB
    y = model(expandable_segments=True)
    b = y.malloc(30 * MiB)
    y.malloc(10 * MiB)
    y.free(b)
    assert y.empty_cache() == 20 * MiB and y.reserved == 20 * MiB   # page 1 still holds the 10 MiB block


def test_expandable_blocks_split_down_to_512_bytes_and_the_segment_goes_when_wholly_free():
    x = model(expandable_segments=True)
    b = x.malloc(19 * MiB)             # one 20 MiB page; 1 MiB left is split off (expandable: >= 512 B)
    assert x.allocated == 19 * MiB
    x.free(b)
    assert x.empty_cache() == 20 * MiB and x.segments == 0 and x.reserved == 0


def test_switching_expandable_segments_on_changes_only_what_is_reserved_afterwards():
    # get_free_block: blocks of ordinary segments still serve requests; with the setting off again,
    # expandable blocks are skipped ("Rarely expandable segments has been turned off ...")
    m = model()
    m.free(m.malloc(30 * MiB))
    m.expandable_segments = True
    assert m.malloc(20 * MiB).segment is None        # from the ordinary cached segment
    assert m.reserved == 30 * MiB
    grown = m.malloc(15 * MiB)         # the 10 MiB left there is too small: an expandable segment
    assert grown.segment is not None and m.reserved == 50 * MiB
    m.expandable_segments = False
    before = m.reserved
    block = m.malloc(4 * MiB)          # best fit is the expandable 5 MiB left over: skipped
    assert block.segment is None and m.reserved == before


# ------------------------------------------------------------------------------------------ settings

def test_settings_string_as_torch_parses_it():
    m = CachingAllocatorModel.from_conf(1 << 30, "max_split_size_mb:128, expandable_segments:True,"
                                        "roundup_power2_divisions:[256:1,>:4],garbage_collection_threshold:0.6")
    assert m.max_split_size == 128 * MiB and m.expandable_segments
    assert m.roundup_power2_divisions[9] == 4
    assert m.settings().startswith("max_split_size_mb:128,expandable_segments:True")
    with pytest.raises(ValueError):
        CachingAllocatorModel.from_conf(1 << 30, "no_such_option:1")
    # torch's setter semantics (CUDAAllocatorConfig::parseArgs): unnamed options back to their defaults,
    # expandable_segments kept
    m.configure("roundup_power2_divisions:2")
    assert m.max_split_size is None and m.expandable_segments and m.roundup_power2_divisions == (2,) * 16


def test_the_environment_settings_are_read(monkeypatch):
    from cuda_magic.devices import allocator_conf

    monkeypatch.setattr(allocator_conf, "runtime_allocator_conf", lambda: None)
    monkeypatch.setattr(allocator_conf, "_set_here", None)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:256")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_HIP_ALLOC_CONF", raising=False)
    m = CachingAllocatorModel.from_environment(1 << 30)
    assert m.expandable_segments and m.max_split_size == 256 * MiB


# ------------------------------------------------------------------------- the simulated device

torch = pytest.importorskip("torch")


@pytest.fixture
def settings_back():
    """Simulated devices back on the process's allocator settings after the test."""
    from cuda_magic.devices import simulated

    yield simulated
    simulated.apply_allocator_settings(None)


def test_the_simulated_device_reserves_as_the_caching_allocator(torch_warm):
    from cuda_magic.devices.simulated import SimulatedDevice

    with SimulatedDevice(1 << 30, conf="") as dev:
        t = torch.empty(1, dtype=torch.uint8)
        assert (dev.allocated, dev.reserved) == (512, 2 * MiB)
        mem = dev.memory()
        assert mem.torch_allocated == 512 and mem.torch_cached == 2 * MiB - 512
        assert mem.free == (1 << 30) - 2 * MiB
        assert sum(v for v in mem.parts().values()) == mem.capacity
        u = torch.empty(5 * MiB, dtype=torch.uint8)
        assert dev.reserved == 22 * MiB
        del t, u
        assert dev.allocated == 0 and dev.reserved == 22 * MiB       # cached
        assert dev.empty_cache() == 22 * MiB and dev.reserved == 0


def test_plain_count_is_kept_as_an_option(torch_warm):
    from cuda_magic.devices.simulated import SimulatedDevice

    with SimulatedDevice(10_000, allocator="plain") as dev:
        t = torch.empty(3, dtype=torch.uint8)
        assert (dev.allocated, dev.reserved, dev.model) == (3, 3, None)
        assert dev.memory().torch_cached == 0
        with pytest.raises(torch.cuda.OutOfMemoryError) as err:
            torch.empty(20_000, dtype=torch.uint8)
        assert "0 bytes is reserved by PyTorch but unallocated" in str(err.value)
        del t
    with pytest.raises(ValueError):
        SimulatedDevice(1 << 20, allocator="plain", conf="expandable_segments:True")


def test_fragmentation_on_the_simulated_device_is_in_its_message_and_fails_before_allocating(torch_warm):
    from cuda_magic.devices.simulated import SimulatedDevice
    from cuda_magic.oom.messages import parse_oom_message

    with SimulatedDevice(80 * MiB, conf="") as dev:
        a = torch.empty(60 * MiB, dtype=torch.uint8)
        del a
        b = torch.empty(30 * MiB, dtype=torch.uint8)
        with pytest.raises(torch.cuda.OutOfMemoryError) as err:
            torch.ones(40 * MiB, dtype=torch.uint8)
        fields = parse_oom_message(str(err.value))
        assert fields.backend == "simulated" and fields.requested == 40 * MiB
        assert fields.allocated_by_torch == 30 * MiB and fields.reserved_unallocated == 30 * MiB
        assert fields.free == 20 * MiB and fields.other_processes == 0
        assert dev.allocated == dev.model.allocated == 30 * MiB        # no block left taken
        del b
    with SimulatedDevice(80 * MiB, conf="expandable_segments:True") as dev:
        a = torch.empty(60 * MiB, dtype=torch.uint8)
        del a
        b = torch.empty(30 * MiB, dtype=torch.uint8)
        c = torch.ones(40 * MiB, dtype=torch.uint8)
        assert (dev.allocated, dev.reserved) == (70 * MiB, 80 * MiB)
        del b, c


def test_blocks_taken_before_an_op_go_to_its_outputs_or_back(torch_warm):
    from cuda_magic.devices.simulated import SimulatedDevice

    with SimulatedDevice(1 << 30, conf="") as dev:
        x = torch.randn(1000)
        values, indices = torch.sort(x)          # two fresh outputs: 4000 and 8000 bytes
        assert dev.allocated == 4096 + 4096 + 8192 and not dev._pending
        a = torch.zeros(3)
        with pytest.raises(IndexError):
            a[torch.tensor([10])]                # sized on the meta device, then fails for real
        assert not dev._pending and dev.allocated == dev.model.allocated
        out = torch.empty(0)
        torch.cat([x, x], out=out)               # resized in place: a new block, the old one given back
        assert dev.allocated == dev.model.allocated == 4096 + 4096 + 8192 + 512 + 8192   # x, sort's, a, out
        del values, indices, a, out, x
        assert dev.allocated == 0 == dev.model.allocated


def test_existing_storages_are_reserved_even_past_the_capacity(torch_warm):
    from cuda_magic.devices.simulated import SimulatedDevice

    keep = torch.zeros(3 * MiB)                  # 12 MiB, made before the device
    dev = SimulatedDevice(4 * MiB, conf="")
    added = dev.count_existing()
    assert added >= 12 * MiB and dev.reserved > dev.capacity
    del keep
    dev.forget()
    assert dev.reserved == 0 and dev.model.allocated == 0


def test_the_device_follows_the_allocator_settings_cuda_magic_switches(torch_warm, settings_back):
    from cuda_magic.devices.allocator_conf import enable_expandable_segments
    from cuda_magic.devices.simulated import SimulatedDevice

    dev = SimulatedDevice(1 << 30)
    own = SimulatedDevice(1 << 30, conf="max_split_size_mb:64")
    plain = SimulatedDevice(1 << 30, allocator="plain")
    assert not dev.expandable_segments
    said = enable_expandable_segments(dev)
    assert "switched on for simulated devices" in said and "empty" in said
    assert dev.expandable_segments and SimulatedDevice(1 << 30).expandable_segments
    assert not own.expandable_segments                       # settings of its own: not followed
    assert "already on" in enable_expandable_segments(dev)
    assert "this simulated device" in enable_expandable_segments(own)
    assert own.expandable_segments and own.model.max_split_size == 64 * MiB
    with pytest.raises(RuntimeError, match="allocator='plain'"):
        enable_expandable_segments(plain)
    settings_back.apply_allocator_settings(None)
    assert not dev.expandable_segments


def test_expandable_segments_flag_switches_a_simulated_l_cap_without_cuda(tip, settings_back):
    from cuda_magic.devices.simulated import allocator_settings

    report = tip.run_cell_magic("oomguard", "-l 80MiB -q -o --expandable-segments", "y = 1")
    assert report.outcome.value == "ok" or str(report.outcome).endswith("ok")
    assert "expandable_segments:True" in allocator_settings()


def test_a_cell_that_leaves_holes_runs_out_fragmented_and_fits_with_expandable_segments(tip, settings_back):
    """On the simulated device the cell runs out with 30 MiB reserved but unallocated and the report says
    fragmentation; with `--expandable-segments` (after the cache the first run left is emptied, as
    torch.cuda.empty_cache() would on a GPU) the same cell fits."""
    cell = ("b = c = None\n"
            "a = torch.empty(60 * 2**20, dtype=torch.uint8)\n"
            "del a\n"
            "b = torch.empty(30 * 2**20, dtype=torch.uint8)\n"
            "c = torch.empty(40 * 2**20, dtype=torch.uint8)\n")
    tip.run_line_magic("gpumem", "--simulate 80MiB -q")
    dev = settings_back.active_device()
    report = tip.run_cell("%%oomguard -q -o --no-raise\n" + cell).result
    assert report.oom is not None and report.oom.backend == "simulated"
    assert report.oom.reserved_unallocated == 30 * MiB and report.oom.allocated_by_torch == 30 * MiB
    assert report.diagnosis.causes[0] == "fragmentation"
    assert "fragmentation" in report.diagnosis.summary

    tip.run_cell("b = c = None")
    assert settings_back.empty_caches() == 60 * MiB and dev.reserved == 0
    report = tip.run_cell("%%oomguard -q -o --expandable-segments\n" + cell).result
    assert report.oom is None
    assert dev.expandable_segments and (dev.allocated, dev.reserved) == (70 * MiB, 80 * MiB)
    tip.run_cell("b = c = None")


def test_the_l_cap_without_cuda_reserves_as_the_caching_allocator_by_default(tip, settings_back, monkeypatch):
    """`-l` without CUDA, in a real shell and with no allocator named anywhere: the cell that leaves a hole
    in a segment still in use runs out with it reserved but unallocated, the diagnosis names fragmentation
    and its advice expandable segments; `--expandable-segments` on the same cap makes it fit, and so does
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True set in the environment (the settings torch reads)."""
    cell = ("b = c = None\n"
            "a = torch.empty(60 * 2**20, dtype=torch.uint8)\n"
            "del a\n"
            "b = torch.empty(30 * 2**20, dtype=torch.uint8)\n"
            "c = torch.empty(40 * 2**20, dtype=torch.uint8)\n")
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    report = tip.run_cell("%%oomguard -l 80MiB -q -o --no-raise\n" + cell).result
    assert report.oom is not None and report.oom.backend == "simulated"
    # a's 60 MiB segment keeps b's 30 MiB block and a 30 MiB cached hole; c's 40 MiB segment does not fit
    # beside it (torch does not give back a segment that holds a block in use)
    assert report.oom.requested == 40 * MiB and report.oom.reserved_unallocated == 30 * MiB
    assert report.diagnosis.causes[0] == "fragmentation"
    assert any("--expandable-segments" in (a.code or "") for a in report.diagnosis.advice)
    assert report.reclaimed == {"sim:0": 0}     # b is still bound: its block keeps the 60 MiB segment

    tip.run_cell("b = c = None")
    report = tip.run_cell("%%oomguard -l 80MiB -q -o --expandable-segments\n" + cell).result
    assert report.oom is None and report.outcome.value == "ok"
    tip.run_cell("b = c = None")

    settings_back.apply_allocator_settings(None)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    report = tip.run_cell("%%oomguard -l 80MiB -q -o\n" + cell).result
    assert report.oom is None and report.outcome.value == "ok"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    report = tip.run_cell("%%oomguard -l 80MiB -q -o --no-raise\n" + cell).result
    assert report.oom is not None and report.oom.reserved_unallocated == 30 * MiB
    tip.run_cell("b = c = None")
