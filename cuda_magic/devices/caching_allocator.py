"""A model of torch's CUDA caching allocator: what a GPU reserves for the tensors a program makes.

A GPU runs out when the caching allocator cannot reserve a new segment, not when tensors add up to the
capacity: each request is rounded, served from a cached free block of the right pool when one fits (best
fit), else from a new segment reserved from the device; freed blocks stay cached (reserved but
unallocated) and only whole free segments can be given back. This module reproduces those rules in pure
Python (no torch import) so that the simulated device (devices/simulated.py) reserves as a GPU does and
fragmentation shows up in the lab as on a GPU.

Written from torch's source, `c10/cuda/CUDACachingAllocator.cpp` (`DeviceCachingAllocator`), read at three
points: the pytorch/pytorch revision the search index stores (commit 001074d2, the 2.4-era code: "total
capacity" in the OOM message, `release_lock_on_cudamalloc`, private pools in the message, no
`max_non_split_rounding_mb`), allocators forked from the 2.2-era file (the "total capacty" message of
2.1-2.3, `CUDAAllocatorConfig.cpp` with `expandable_segments` and `release_lock_on_cudamalloc` but no pinned
options), and the newest generic form `c10/core/CachingDeviceAllocator.h` (`CachingDeviceAllocatorImpl`, which
the CUDA allocator builds on after 2.13) with torch 2.13's own header `c10/core/AllocatorConfig.h`
(`AcceleratorAllocatorConfig`, checked in the installed 2.13 wheel). The rules, with the function each
comes from (the names are the same in all three unless said):

- `round_size`: below `kMinBlockSize` (512 B) a request takes 512 B, else it is rounded up to a multiple of
  512 B; with `roundup_power2_divisions` (`roundup_power2_next_division`) a size above 512 B x divisions is
  rounded up to the next of `divisions` equal steps between two powers of two. The divisions are chosen per
  power-of-two interval from 1 MiB to 64 GiB (16 intervals: `CUDAAllocatorConfig::roundup_power2_divisions`,
  2.10+ `AcceleratorAllocatorConfig::roundup_power2_divisions`); `roundup_power2_divisions:4` sets all of
  them, `[256:1,512:2,>:8]` sets them per interval (keys in MiB, the first key also below it, `>` the rest:
  `parseRoundUpPower2Divisions`). Changed: the 2.2-era code rounds when divisions > 0 and
  `roundup_power2_next_division` returns the size unrounded for 1 division; the 2.4-era and newest code
  round only for divisions > 1 (`TORCH_CHECK(divisions >= 2)`), 1 meaning plain 512 B rounding, which is
  what this model does. `>` in the list fills the intervals after the last key named in the newest
  `c10/core/AllocatorConfig.cpp` (`last_index + 1`), from that key itself in the 2.2-era
  `CUDAAllocatorConfig.cpp`; this model follows the newest.
- pools (`get_pool`): requests of at most `kSmallSize` (1 MiB) come from the small pool, the rest from the
  large pool; blocks never move between pools.
- segment sizes (`get_allocation_size`): a small request reserves `kSmallBuffer` (2 MiB); a large one under
  `kMinLargeAlloc` (10 MiB) reserves `kLargeBuffer` (20 MiB); a bigger one its size rounded up to
  `kRoundLarge` (2 MiB). Changed: torch 2.13's `AllocatorConfig.h` makes the 20 MiB `large_segment_size_mb`
  (`AcceleratorAllocatorConfig::large_segment_size()`, default 20 MiB), which this model reads too.
- best fit (`get_free_block`): the smallest cached free block of the pool at least as large as the request
  (the pool's blocks are ordered by size, then address). With `max_split_size` set, a request below it is
  never given a block of at least `max_split_size` ("oversize"), and a request of at least
  `max_split_size` only a block less than 20 MiB larger than itself. Changed: that 20 MiB is `kLargeBuffer`
  in the 2.2- and 2.4-era code, `max_non_split_rounding_size()` (option `max_non_split_rounding_mb`,
  default 20 MiB) in the newest and in 2.13's `AllocatorConfig.h`.
- splitting (`should_split`, `alloc_found_block`): the block found is split when what remains is at least
  512 B in the small pool (or with expandable segments on), and, in the large pool, when it is more than
  1 MiB and the request is below `max_split_size`; the remainder goes back to the pool as a free block.
  So blocks of `max_split_size` or more are never split.
- freeing (`free_block`, `try_merge_blocks`; `DeviceBlock::try_merge` in the newest): a freed block merges
  with free neighbours in its segment (mapped with mapped, unmapped with unmapped) and is cached.
- reserving (`alloc_block`): a new segment of the allocation size is reserved when it fits in what the
  device has left (here: `capacity - reserved`, as with a memory fraction: `set_fraction`). With a memory
  fraction below the device (`device_total` set above `capacity`) and expandable segments, the whole
  allocation size is checked against the fraction before any page is mapped, and the pages are then
  mapped while the device has memory (so reserved can pass the fraction by up to one page).
- the out-of-memory path (`malloc`): when no cached block fits and the segment cannot be reserved, the
  allocator first releases oversize cached blocks (`release_available_cached_blocks`, only where
  `max_split_size` is set: the smallest cached block of at least max(request, max_split_size), else the
  largest oversize blocks until that much is released; the newest code skips expandable blocks there) and
  tries again, then releases every cached block that is a whole segment, and unmaps the free pages of
  expandable segments (`release_cached_blocks`, `release_blocks`, `unmap_block`) and tries once more. If
  that fails it is an out-of-memory error: torch's message says "Tried to allocate" the allocation size
  (the segment it could not reserve), the free memory, the bytes allocated (the `allocated_bytes` stat: the
  sizes of the blocks handed out) and reserved minus allocated as "reserved by PyTorch but unallocated".
  (The 2.2-era message hints `max_split_size_mb`; from 2.4 `expandable_segments:True`.)
- `empty_cache()` (`emptyCache` -> `release_cached_blocks`): the same release, at any time.
- settings (`CUDAAllocatorConfig::parseArgs`, 2.10+ `AcceleratorAllocatorConfig::parseArgs`): each
  settings string resets max_split_size_mb, roundup_power2_divisions and garbage_collection_threshold
  where it does not name them; expandable_segments (and in the newest max_non_split_rounding_mb) keep
  their value. max_split_size_mb must be more than 20 (2.2: "must be > 20") or at least 20 (newest);
  max_non_split_rounding_mb at least 20.
- expandable segments (`try_allocate_expandable_block`, `find_expandable_block`, `map_block`,
  `unmap_block`, `release_expandable_segment`; `ExpandableSegment::map` / `unmap`): one segment per pool
  reserves address space for 1 1/8 of the device and maps physical pages as blocks need them - 2 MiB pages
  in the small pool, 20 MiB in the large pool (`kLargeBuffer`; `large_segment_size()` in the newest) - at the
  lowest address with enough free and unmapped room, so that a block that ends a segment grows into the
  pages after it. Mapped pages stay mapped (reserved) when their blocks are freed; the out-of-memory path
  and `empty_cache()` unmap every page that lies wholly inside a free block, which gives back the holes
  that cudaMalloc'd segments would keep. With expandable segments on, best fit counts an expandable block as
  large as it can grow (its size plus the unmapped room after it) and blocks split down to 512 B;
  switching the setting on or off changes only what is reserved afterwards (`get_free_block` skips
  expandable blocks while the setting is off).
- `inactive_split`: the bytes of cached free blocks in segments that also hold blocks in use (torch's
  `inactive_split_bytes` stat, which leaves expandable segments out): memory that only freeing the rest of
  the segment can give back, i.e. fragmentation.

- `garbage_collection_threshold` (`garbage_collect_cached_blocks`, acting only with a memory fraction set:
  here `gc_allowed_maximum`): see `_garbage_collect`.

Not modelled: streams and events (one stream: a freed block is free at once), CUDA graphs' private pools,
the free-memory callbacks, the
`cudaMallocAsync` backend, and memory outside the allocator (the CUDA context): the capacity is what the
allocator may reserve.
"""
from __future__ import annotations

from bisect import bisect_left, insort

KiB = 1024
MiB = 1024 * 1024
kMinBlockSize = 512               # all sizes are rounded to at least 512 bytes
kSmallSize = 1 * MiB              # largest "small" allocation
kSmallBuffer = 2 * MiB            # "small" allocations are packed in 2 MiB segments
kMinLargeAlloc = 10 * MiB         # allocations between 1 and 10 MiB may use kLargeBuffer
kRoundLarge = 2 * MiB             # large allocations are rounded up to 2 MiB
kLargeBuffer = 20 * MiB           # "large" allocations may be packed in 20 MiB segments
NO_LIMIT = (1 << 64) - 1          # size_t max: max_split_size when it is not set
kRoundUpPowerOfTwoIntervals = 16  # 1 MiB .. 64 GiB
_INTERVAL_START = 20              # log2(1 MiB)

OPTIONS = ("max_split_size_mb", "expandable_segments", "roundup_power2_divisions",
           "max_non_split_rounding_mb", "large_segment_size_mb")
#: options of torch's allocator settings that this model takes and ignores (nothing of theirs is modelled)
IGNORED = ("garbage_collection_threshold", "backend", "release_lock_on_cudamalloc",
           "release_lock_on_hipmalloc", "pinned_use_cuda_host_register", "pinned_use_hip_host_register",
           "pinned_num_register_threads", "pinned_use_background_threads", "pinned_max_register_threads",
           "pinned_reserve_segment_size_mb", "pinned_free_catch_all", "graph_capture_record_stream_reuse",
           "expandable_segments_handle_type", "per_process_memory_fraction")


class CannotReserve(Exception):
    """The allocator could not reserve memory for a request, after releasing what it could: torch's
    out-of-memory error, with the figures its message states."""

    def __init__(self, requested: int, size: int, alloc_size: int, *, capacity: int, allocated: int,
                 reserved: int, inactive_split: int, largest_free_block: int):
        self.requested = requested            # bytes asked for
        self.size = size                      # rounded (round_size)
        self.alloc_size = alloc_size          # the segment it tried to reserve: torch's "Tried to allocate"
        self.capacity = capacity
        self.allocated = allocated
        self.reserved = reserved
        self.free = max(0, capacity - reserved)
        self.reserved_unallocated = max(0, reserved - allocated)
        self.inactive_split = inactive_split
        self.largest_free_block = largest_free_block
        super().__init__(f"cannot reserve {alloc_size} bytes for a request of {requested}: {reserved} of "
                         f"{capacity} reserved, {allocated} allocated")


class ExpandableSegment:
    """The address space of one expandable segment: `pages` pages of `page` bytes from `base`."""

    __slots__ = ("base", "page", "size")

    def __init__(self, base: int, page: int, size: int):
        self.base, self.page, self.size = base, page, size


class Block:
    """A piece of a segment: allocated (handed out), free and cached, or (expandable segments) unmapped."""

    __slots__ = ("size", "ptr", "pool", "segment", "prev", "next", "allocated", "mapped", "requested")

    def __init__(self, size: int, ptr: int, pool: Pool, segment: ExpandableSegment | None = None,
                 mapped: bool = True):
        self.size, self.ptr, self.pool, self.segment = size, ptr, pool, segment
        self.prev: Block | None = None
        self.next: Block | None = None
        self.allocated = False
        self.mapped = mapped
        self.requested = 0

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def splice(self, before: Block | None, after: Block | None) -> None:
        if before is not None:
            before.next = self
        self.prev = before
        if after is not None:
            after.prev = self
        self.next = after

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else ("free" if self.mapped else "unmapped")
        kind = "expandable " if self.segment is not None else ""
        return f"<Block {kind}{state} {self.size} B at {self.ptr:#x}>"


class Pool:
    """Cached free blocks of one size class: mapped free blocks by (size, address) for best fit, unmapped
    blocks of expandable segments by address."""

    __slots__ = ("small", "keys", "free", "unmapped_keys", "unmapped")

    def __init__(self, small: bool):
        self.small = small
        self.keys: list[tuple[int, int]] = []          # (size, ptr) of the free blocks, sorted
        self.free: dict[int, Block] = {}               # ptr -> free mapped block
        self.unmapped_keys: list[int] = []             # ptrs of unmapped blocks, sorted
        self.unmapped: dict[int, Block] = {}

    def add(self, block: Block) -> None:
        if block.mapped:
            insort(self.keys, (block.size, block.ptr))
            self.free[block.ptr] = block
        else:
            insort(self.unmapped_keys, block.ptr)
            self.unmapped[block.ptr] = block

    def remove(self, block: Block) -> None:
        if block.mapped:
            keys = self.keys
            del keys[bisect_left(keys, (block.size, block.ptr))]
            del self.free[block.ptr]
        else:
            keys = self.unmapped_keys
            del keys[bisect_left(keys, block.ptr)]
            del self.unmapped[block.ptr]


def parse_divisions(value: str) -> tuple[int, ...]:
    """roundup_power2_divisions as torch parses it (`parseRoundUpPower2Divisions`): one power of two for
    every interval, or `[MiB:divisions,...,>:divisions]` per power-of-two interval from 1 MiB, the first
    key's value also below it and `>` after the last key named (newest `AllocatorConfig.cpp`; the 2.2-era
    `CUDAAllocatorConfig.cpp` filled `>` from the last key named itself, overwriting it), 0 allowed in a
    list (no rounding there, newest)."""
    text = value.strip()
    divisions = [0] * kRoundUpPowerOfTwoIntervals
    if not text.startswith("["):
        n = int(text)
        if not _power_of_two(n):
            raise ValueError(f"roundup_power2_divisions: the divisions have to be a power of 2, not {n}")
        return (n,) * kRoundUpPowerOfTwoIntervals
    body = text.strip("[]")
    first, last_index = True, 0
    for part in (p.strip() for p in body.split(",") if p.strip()):
        key, _, val = part.partition(":")
        n = int(val)
        if n != 0 and not _power_of_two(n):
            raise ValueError(f"roundup_power2_divisions: the divisions have to be a power of 2, not {n}")
        if key.strip() == ">":
            for i in range(last_index + 1, kRoundUpPowerOfTwoIntervals):
                divisions[i] = n
            continue
        mib = int(key)
        if not _power_of_two(mib):
            raise ValueError(f"roundup_power2_divisions: the intervals have to be a power of 2, not {mib}")
        index = min(mib.bit_length() - 1, kRoundUpPowerOfTwoIntervals - 1)
        if first:
            for i in range(index):
                divisions[i] = n
            first = False
        divisions[index] = n
        last_index = index
    return tuple(divisions)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _mib_option(key: str, value: str, minimum: int = 0) -> int:
    try:
        mib = int(value)
    except ValueError:
        raise ValueError(f"{key} takes a whole number of MiB, not {value!r}") from None
    if mib < minimum:
        raise ValueError(f"{key} must be at least {minimum}, not {mib}")
    return mib * MiB


def _bool_option(key: str, value: str) -> bool:
    text = value.strip().lower()
    if text not in ("true", "false", "1", "0"):
        raise ValueError(f"{key} takes True or False, not {value!r}")
    return text in ("true", "1")


def roundup_power2_next_division(size: int, divisions: int) -> int:
    """The next of `divisions` equal steps between the powers of two around `size` (torch's
    `roundup_power2_next_division`): 1200 with 4 divisions of 1024..2048 is 1280."""
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step


def segment_asked(nbytes: int) -> int:
    """What torch's out-of-memory message says a request of `nbytes` tried to allocate when no cached block
    served it, with the default settings: the segment it tried to reserve (`get_allocation_size` of the
    rounded size: 2 MiB for at most 1 MiB, 20 MiB below 10 MiB, else the size rounded up to 2 MiB)."""
    size = max(kMinBlockSize, -(-int(nbytes) // kMinBlockSize) * kMinBlockSize)
    if size <= kSmallSize:
        return kSmallBuffer
    if size < kMinLargeAlloc:
        return kLargeBuffer
    return -(-size // kRoundLarge) * kRoundLarge


class CachingAllocatorModel:
    """torch's CUDA caching allocator on one device of `capacity` bytes (see the module docstring).

    `malloc(nbytes)` returns a block (None for 0 bytes) or raises `CannotReserve`; `free(block)` gives it
    back to the cache; `empty_cache()` returns the cached segments. Figures: `allocated`, `reserved`,
    `peak_allocated`, `peak_reserved`, `inactive_split`, `largest_free_block`.
    """

    def __init__(self, capacity: int, *, max_split_size: int | None = None, expandable_segments: bool = False,
                 roundup_power2_divisions=None, max_non_split_rounding_size: int = kLargeBuffer,
                 large_segment_size: int = kLargeBuffer):
        self.capacity = int(capacity)
        self.max_split_size = max_split_size
        self.expandable_segments = bool(expandable_segments)
        self.roundup_power2_divisions = roundup_power2_divisions
        self.max_non_split_rounding_size = int(max_non_split_rounding_size)
        self.large_segment_size = int(large_segment_size)
        self.small = Pool(True)
        self.large = Pool(False)
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.num_ooms = 0
        self.num_alloc_retries = 0
        #: the device's whole memory where `capacity` is a memory fraction's limit below it (None: the
        #: capacity is the device): expandable segments take address space for 1 1/8 of it and map pages
        #: while it has room (`find_expandable_block`: prop.totalGlobalMem)
        self.device_total: int | None = None
        self._segments = 0          # cudaMalloc'd segments and expandable segments alive
        self._active: set[Block] = set()     # the blocks handed out
        self._next_address = 1 << 40
        self._init_recorded_state()

    # -- settings ----------------------------------------------------------------------------------------
    @property
    def max_split_size(self) -> int | None:
        return None if self._max_split == NO_LIMIT else self._max_split

    @max_split_size.setter
    def max_split_size(self, value: int | None) -> None:
        self._max_split = NO_LIMIT if value is None else int(value)

    @property
    def roundup_power2_divisions(self) -> tuple[int, ...] | None:
        return self._divisions if any(self._divisions) else None

    @roundup_power2_divisions.setter
    def roundup_power2_divisions(self, value) -> None:
        if value is None:
            self._divisions = (0,) * kRoundUpPowerOfTwoIntervals
        elif isinstance(value, str):
            self._divisions = parse_divisions(value)
        elif isinstance(value, int):
            self._divisions = parse_divisions(str(value))
        else:
            value = tuple(int(v) for v in value)
            if len(value) != kRoundUpPowerOfTwoIntervals:
                raise ValueError(f"roundup_power2_divisions: {kRoundUpPowerOfTwoIntervals} intervals, not "
                                 f"{len(value)}")
            self._divisions = value

    @classmethod
    def from_conf(cls, capacity: int, conf: str | None, *, strict: bool = True) -> CachingAllocatorModel:
        """A model with the settings of a PYTORCH_CUDA_ALLOC_CONF-style string ("key:value,key:value").
        strict=False: a value that does not parse is left at its default instead of raising (settings read
        from the environment, which torch would have refused at start-up)."""
        model = cls(capacity)
        model.configure(conf or "", strict=strict)
        return model

    @classmethod
    def from_environment(cls, capacity: int) -> CachingAllocatorModel:
        """A model with the allocator settings in force in this process (`allocator_conf.current_allocator_conf`:
        the environment's, or what was set at runtime)."""
        from cuda_magic.devices.allocator_conf import current_allocator_conf

        return cls.from_conf(capacity, current_allocator_conf(), strict=False)

    def configure(self, conf: str, *, strict: bool = True) -> None:
        """Apply a settings string as torch's setter does: max_split_size_mb and roundup_power2_divisions
        go back to their defaults where the string does not name them; expandable_segments keeps its
        value (`CUDAAllocatorConfig::parseArgs`). Unknown keys raise (strict) as in torch; torch's options
        this model has nothing of are ignored (`IGNORED`)."""
        from cuda_magic.devices.allocator_conf import parse_conf

        self.max_split_size = None
        self.roundup_power2_divisions = None
        for key, value in parse_conf(conf or ""):
            try:
                if key == "max_split_size_mb":
                    # torch 2.2: "must be > 20"; the newest: at least kLargeBuffer / 1 MiB
                    self.max_split_size = _mib_option(key, value, minimum=kLargeBuffer // MiB)
                elif key == "expandable_segments":
                    self.expandable_segments = _bool_option(key, value)
                elif key == "roundup_power2_divisions":
                    self.roundup_power2_divisions = value
                elif key == "max_non_split_rounding_mb":
                    self.max_non_split_rounding_size = _mib_option(key, value, minimum=kLargeBuffer // MiB)
                elif key == "large_segment_size_mb":
                    self.large_segment_size = _mib_option(key, value, minimum=1)
                elif key not in IGNORED and strict:
                    raise ValueError(f"unrecognized allocator option {key!r}")
            except ValueError:
                if strict:
                    raise

    def settings(self) -> str:
        """The settings in force, as a settings string (only what differs from the defaults)."""
        parts = []
        if self.max_split_size is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size // MiB}")
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.roundup_power2_divisions is not None:
            divs = self._divisions
            parts.append("roundup_power2_divisions:" + (
                str(divs[0]) if len(set(divs)) == 1 else
                "[" + ",".join(f"{1 << i}:{d}" for i, d in enumerate(divs)) + "]"))
        if self.max_non_split_rounding_size != kLargeBuffer:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding_size // MiB}")
        if self.large_segment_size != kLargeBuffer:
            parts.append(f"large_segment_size_mb:{self.large_segment_size // MiB}")
        return ",".join(parts)

    # -- sizes -------------------------------------------------------------------------------------------
    def round_size(self, size: int) -> int:
        if size < kMinBlockSize:
            return kMinBlockSize
        divisions = self._divisions[min(max(0, size.bit_length() - 1 - _INTERVAL_START),
                                        kRoundUpPowerOfTwoIntervals - 1)]
        if divisions > 1 and size > kMinBlockSize * divisions:
            return roundup_power2_next_division(size, divisions)
        return -(-size // kMinBlockSize) * kMinBlockSize

    def allocation_size(self, size: int) -> int:
        """The segment reserved for a request of `size` (already rounded) when no cached block serves it."""
        if size <= kSmallSize:
            return kSmallBuffer
        if size < kMinLargeAlloc:
            return self.large_segment_size
        return -(-size // kRoundLarge) * kRoundLarge

    # -- the allocator -----------------------------------------------------------------------------------
    def malloc(self, nbytes: int, *, force: bool = False) -> Block | None:
        """A block for `nbytes` (None for 0: torch hands out no memory for an empty storage). force: reserve
        past the capacity rather than fail (memory that exists already, counted late)."""
        if nbytes <= 0:
            return None
        size = self.round_size(nbytes)
        pool = self.small if size <= kSmallSize else self.large
        self._gc_tick(pool)
        block = self._get_free_block(pool, size)
        if block is None:
            self._garbage_collect()
            alloc_size = self.allocation_size(size)
            block = self._alloc_block(pool, size, alloc_size, force)
            if block is None and self._release_available_cached_blocks(pool, size):
                block = self._alloc_block(pool, size, alloc_size, force)
            if block is None:
                self._release_cached_blocks()
                self.num_alloc_retries += 1
                block = self._alloc_block(pool, size, alloc_size, force)
            if block is None:
                self.num_ooms += 1
                raise CannotReserve(nbytes, size, alloc_size, capacity=self.capacity, allocated=self.allocated,
                                    reserved=self.reserved, inactive_split=self.inactive_split,
                                    largest_free_block=self.largest_free_block)
        return self._alloc_found_block(block, size, nbytes, self._should_split(block, size))

    def free(self, block: Block | None) -> None:
        if block is None:
            return
        if not block.allocated:
            raise ValueError(f"{block!r} is not allocated")
        block.allocated = False
        self._active.discard(block)
        self.allocated -= block.size
        pool = block.pool
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        pool.add(block)

    def empty_cache(self) -> int:
        """Return every cached segment that holds no allocated block, and unmap the free pages of expandable
        segments (`torch.cuda.empty_cache()`). Returns the bytes given back."""
        before = self.reserved
        self._release_cached_blocks()
        return before - self.reserved

    def reset_peak(self) -> None:
        self.peak_allocated = self.allocated
        self.peak_reserved = self.reserved

    # -- figures -----------------------------------------------------------------------------------------
    @property
    def reserved_unallocated(self) -> int:
        return self.reserved - self.allocated

    @property
    def inactive_split(self) -> int:
        """Bytes of cached free blocks in segments that also hold allocated blocks (torch's
        inactive_split_bytes: expandable segments left out)."""
        total = 0
        for pool in (self.small, self.large):
            for block in pool.free.values():
                if block.segment is None and (block.prev is not None or block.next is not None):
                    total += block.size
        return total

    @property
    def largest_free_block(self) -> int:
        """The largest cached free block (torch's cacheInfo, without the device's free memory)."""
        return max((pool.keys[-1][0] for pool in (self.small, self.large) if pool.keys), default=0)

    @property
    def segments(self) -> int:
        return self._segments

    def snapshot(self) -> list[dict]:
        """The segments and their blocks, as torch.cuda.memory_snapshot() lists them: one entry per
        cudaMalloc'd segment and per contiguous mapped range of an expandable segment (address order)."""
        blocks = list(self._active)
        for pool in (self.small, self.large):
            blocks.extend(pool.free.values())
        heads = {}
        for block in blocks:
            if block.prev is None or not block.prev.mapped:
                heads[block.ptr] = block
        out = []
        for ptr in sorted(heads):
            walk, listed = heads[ptr], []
            while walk is not None and walk.mapped:
                listed.append({"size": walk.size, "requested_size": walk.requested if walk.allocated else 0,
                               "state": "active_allocated" if walk.allocated else "inactive"})
                walk = walk.next
            head = heads[ptr]
            out.append({"address": ptr, "total_size": sum(b["size"] for b in listed),
                        "allocated_size": sum(b["size"] for b in listed if b["state"] == "active_allocated"),
                        "segment_type": "small" if head.pool.small else "large",
                        "is_expandable": head.segment is not None, "blocks": listed})
        return out

    # -- internals, after DeviceCachingAllocator's private methods ---------------------------------------
    def _new_address(self, size: int) -> int:
        if self.address_source is not None:
            taken = self.address_source(size)
            if taken is not None:
                return taken
        address = self._next_address
        self._next_address += -(-size // kRoundLarge) * kRoundLarge + kRoundLarge
        return address

    def _get_free_block(self, pool: Pool, size: int) -> Block | None:
        keys = pool.keys
        i = bisect_left(keys, (size, 0))
        n = len(keys)
        if i == n:
            return None
        free = pool.free
        block = free[keys[i][1]]
        if block.segment is not None:
            if self.expandable_segments:
                def grows_to(b: Block) -> int:
                    nxt = b.next
                    return b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

                j = i + 1
                while block.segment is not None and j < n:
                    candidate = free[keys[j][1]]
                    if grows_to(candidate) >= grows_to(block):
                        break
                    i, block = j, candidate
                    j += 1
            else:
                # expandable segments switched off since: only blocks of ordinary segments
                i += 1
                while i < n and free[keys[i][1]].segment is not None:
                    i += 1
                if i == n:
                    return None
                block = free[keys[i][1]]
        limit = self._max_split
        if size < limit and block.size >= limit:
            return None                   # an oversize block is not given to a smaller request
        if size >= limit and block.size >= size + self.max_non_split_rounding_size:
            return None
        del keys[i]
        del free[block.ptr]
        return block

    def _should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.pool.small or self.expandable_segments:
            return remaining >= kMinBlockSize
        return size < self._max_split and remaining > kSmallSize

    def _alloc_found_block(self, block: Block, size: int, requested: int, split: bool) -> Block:
        if split:
            remaining = block
            block = Block(size, remaining.ptr, remaining.pool, remaining.segment)
            block.prev = remaining.prev
            if block.prev is not None:
                block.prev.next = block
            block.next = remaining
            remaining.prev = block
            remaining.ptr += size
            remaining.size -= size
            remaining.pool.add(remaining)
        block.allocated = True
        block.requested = requested
        self._active.add(block)
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return block

    @property
    def fraction_set(self) -> bool:
        """Whether `capacity` is a memory fraction's limit below the device (`device_total`)."""
        return self.device_total is not None and self.capacity < self.device_total

    def _alloc_block(self, pool: Pool, size: int, alloc_size: int, force: bool) -> Block | None:
        if self.expandable_segments:
            # alloc_block checks a memory fraction against the whole allocation size before it maps any
            # page (`set_fraction && total_allocated_memory + size > allowed_memory_maximum`, 2.2 to
            # 2.13); the pages are then mapped while the device has memory, past the fraction by up to
            # a page
            if self.fraction_set and not force and self.reserved + alloc_size > self.capacity:
                return None
            return self._try_allocate_expandable_block(pool, size, force)
        if not force and self.reserved + alloc_size > self.capacity:
            return None
        block = Block(alloc_size, self._new_address(alloc_size), pool)
        self._reserve(alloc_size)
        self._segments += 1
        self._report_segment("segment_alloc", block)
        return block

    def _reserve(self, nbytes: int) -> None:
        self.reserved += nbytes
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved

    def _try_merge(self, dst: Block, src: Block | None) -> int:
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        src.pool.remove(src)
        if dst.prev is src:
            dst.ptr = src.ptr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        return src.size

    def _release_block(self, block: Block) -> None:
        """cudaFree a cached block that is a whole segment."""
        block.pool.remove(block)
        self.reserved -= block.size
        self._segments -= 1
        self._report_segment("segment_free", block)

    def _release_available_cached_blocks(self, pool: Pool, size: int) -> bool:
        limit = self._max_split
        if limit == NO_LIMIT:
            return False
        key = max(size, limit)
        keys, free = pool.keys, pool.free
        i = bisect_left(keys, (key, 0))
        if i < len(keys) and free[keys[i][1]].segment is None:
            block = free[keys[i][1]]
            if block.is_split():          # not a whole segment (torch never caches an oversize split block)
                return False
            self._release_block(block)
            return True
        # no single block is large enough: release the largest oversize blocks until enough is released
        released = 0
        i -= 1
        while released < key and i >= 0 and keys[i][0] >= limit:
            block = free[keys[i][1]]
            if block.segment is None and not block.is_split():
                self._release_block(block)
                released += block.size
            i -= 1
        return released >= key

    def _release_cached_blocks(self) -> None:
        for pool in (self.large, self.small):
            to_unmap = []
            for _, ptr in list(pool.keys):
                block = pool.free[ptr]
                if block.segment is not None:
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:
                    self._release_block(block)
            for block in to_unmap:
                self._unmap_block(block)
                if block.prev is None and block.next is None and not block.mapped:
                    pool.remove(block)        # release_expandable_segment: the whole segment is unmapped
                    self._segments -= 1

    # -- expandable segments -----------------------------------------------------------------------------
    def _find_expandable_block(self, pool: Pool, size: int) -> Block:
        for ptr in pool.unmapped_keys:
            c = pool.unmapped[ptr]
            if c.prev is not None and not c.prev.allocated:
                c = c.prev                    # a free block right before the unmapped room grows into it
            room, walk = 0, c
            while room < size and walk is not None and not walk.allocated:
                room += walk.size
                walk = walk.next
            if room >= size:
                return c
        page = kSmallBuffer if pool.small else self.large_segment_size
        device = self.device_total if self.device_total is not None else self.capacity
        total = device + device // 8                      # address space for 1 1/8 of the device
        # a request past the device (forced: a fake run that goes on past the capacity) gets room for it
        span = max(1, -(-max(total, size) // page)) * page
        segment = ExpandableSegment(self._new_address(span), page, span)
        candidate = Block(span, segment.base, pool, segment, mapped=False)
        pool.add(candidate)
        self._segments += 1
        return candidate

    def _try_allocate_expandable_block(self, pool: Pool, size: int, force: bool) -> Block | None:
        candidate = self._find_expandable_block(pool, size)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size), force):
            return None
        while candidate.size < size:
            following = candidate.next
            if not self._map_block(following, min(size - candidate.size, following.size), force):
                return None
            candidate = following             # it took in `candidate` when it merged with its free prev
        pool.remove(candidate)
        return candidate

    def _map_block(self, block: Block, size: int, force: bool) -> bool:
        segment = block.segment
        page = segment.page
        begin = (block.ptr - segment.base) // page
        end = -(-(block.ptr + size - segment.base) // page)
        mapped = (end - begin) * page
        device = self.device_total if self.fraction_set else self.capacity
        if mapped == 0 or (not force and self.reserved + mapped > device):
            return False                      # cuMemCreate ran out: nothing is mapped
        pool = block.pool
        pool.remove(block)
        block.mapped = True
        if mapped < block.size:
            rest = Block(block.size - mapped, block.ptr + mapped, pool, segment, mapped=False)
            rest.splice(block, block.next)
            pool.add(rest)
            block.size = mapped
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        pool.add(block)
        self._reserve(mapped)
        return True

    def _unmap_block(self, block: Block) -> None:
        segment = block.segment
        page, base = segment.page, segment.base
        begin = -(-(block.ptr - base) // page)
        end = (block.ptr + block.size - base) // page
        if begin >= end:
            return
        pool = block.pool
        pool.remove(block)
        start, length = base + begin * page, (end - begin) * page
        before = start - block.ptr
        if before > 0:
            piece = Block(before, block.ptr, pool, segment)
            piece.splice(block.prev, block)
            pool.add(piece)
        after = block.size - before - length
        if after > 0:
            piece = Block(after, start + length, pool, segment)
            piece.splice(block, block.next)
            pool.add(piece)
        block.ptr, block.size, block.mapped = start, length, False
        self._try_merge(block, block.prev)
        self._try_merge(block, block.next)
        pool.add(block)
        self.reserved -= length

    # -- a recorded state, and what a replay of a recording needs (devices/snapshot_replay.py) ----------
    def _init_recorded_state(self) -> None:
        self.address_source = None          # size -> the address a new segment takes (None: a fresh one)
        self.segment_listener = None        # (action, address, size) when a segment is reserved or released
        self.garbage_collection_threshold = 0.0
        self.gc_allowed_maximum: int | None = None   # the memory fraction's bytes, where one is set
        self._gc_calls = {True: 0, False: 0}         # get_free_block calls per pool (small?) while GC acts
        self._gc_base: dict = {}                     # block -> _gc_calls when it was last handed out

    def load_segments(self, segments) -> dict[int, Block]:
        """Take the segments of a memory snapshot as reserved (past the capacity if need be: they exist):
        dicts with "address", "total_size", "segment_type" ('small' or 'large') and "blocks", each with
        "address", "size" and "state" ('active_allocated' and 'active_pending_free' are handed out, the
        rest free and cached; free neighbours merge as torch keeps them). Expandable segments are taken as
        ordinary ones. Returns {address: block} of the blocks handed out. New segments get addresses
        above every loaded one."""
        handed = {}
        for seg in sorted(segments, key=lambda s: s["address"]):
            pool = self.small if seg.get("segment_type") == "small" else self.large
            base, total = int(seg["address"]), int(seg["total_size"])
            pieces, at = [], base
            for b in seg.get("blocks") or ():
                taken = b.get("state") in ("active_allocated", "active_pending_free")
                size = int(b["size"])
                if pieces and not taken and not pieces[-1][2]:
                    pieces[-1][1] += size                       # free next to free: one cached block
                else:
                    pieces.append([int(b.get("address", at)), size, taken, int(b.get("requested_size") or size)])
                at += size
            if not pieces:
                pieces = [[base, total, False, 0]]
            prev = None
            for ptr, size, taken, requested in pieces:
                block = Block(size, ptr, pool)
                block.splice(prev, None)
                if taken:
                    block.allocated, block.requested = True, requested
                    self._active.add(block)
                    self.allocated += size
                    handed[ptr] = block
                else:
                    pool.add(block)
                prev = block
            self._reserve(total)
            self._segments += 1
            self._next_address = max(self._next_address, base + total + kRoundLarge)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return handed

    def addresses_from(self, address: int) -> None:
        """New segments that take no recorded address get addresses from `address` up."""
        self._next_address = max(self._next_address, int(address))

    def block_at(self, address: int) -> Block | None:
        """The block handed out at `address` (a scan: a replay keeps its own map of what it holds)."""
        return next((b for b in self._active if b.ptr == address), None)

    def release_segment(self, address: int) -> bool:
        """Release the cached segment at `address` if it is one free block (as the out-of-memory path
        does); False where no such free segment is there."""
        for pool in (self.large, self.small):
            block = pool.free.get(address)
            if block is not None and block.segment is None and not block.is_split():
                self._release_block(block)
                return True
        return False

    def _report_segment(self, action: str, block: Block) -> None:
        if self.segment_listener is not None:
            self.segment_listener(action, block.ptr, block.size)

    def _gc_on(self) -> bool:
        return self.garbage_collection_threshold > 0 and self.gc_allowed_maximum is not None

    def _gc_tick(self, pool: Pool) -> None:
        """get_free_block counts its calls per pool while garbage collection acts: a cached block's age is
        the calls since it was last handed out (`gc_count`)."""
        if self._gc_on():
            self._gc_calls[pool.small] += 1

    def note_handed_out(self, block: Block | None) -> None:
        """A block was just handed out: its age for garbage collection starts at 0."""
        if block is not None and self._gc_on():
            self._gc_base[block] = self._gc_calls[block.pool.small]

    def _garbage_collect(self) -> None:
        """`garbage_collect_cached_blocks`: with a memory fraction set and garbage_collection_threshold > 0,
        when no cached block serves a request and more than threshold x the allowed maximum is reserved,
        release whole cached segments of the large pool whose age is at least the average age, until
        what is reserved above the threshold is released or no block is old enough."""
        if not self._gc_on():
            return
        threshold = int(self.garbage_collection_threshold * self.gc_allowed_maximum)
        if self.reserved <= threshold:
            return
        target, reclaimed = self.reserved - threshold, 0
        calls = self._gc_calls[False]

        def age(b: Block) -> int:
            return calls - self._gc_base.get(b, calls)

        freeable = [self.large.free[ptr] for _, ptr in self.large.keys]
        freeable = [b for b in freeable if not b.is_split() and b.segment is None]
        total_age = sum(age(b) for b in freeable)
        freed = True
        while reclaimed < target and freed and freeable:
            threshold_age = total_age / len(freeable)
            freed, kept = False, []
            for b in freeable:
                if age(b) >= threshold_age:
                    freed = True
                    reclaimed += b.size
                    total_age -= age(b)
                    self._release_block(b)
                else:
                    kept.append(b)
            freeable = kept

    def __repr__(self) -> str:
        return (f"<CachingAllocatorModel {self.allocated} allocated, {self.reserved} reserved of "
                f"{self.capacity}{', expandable segments' if self.expandable_segments else ''}>")
