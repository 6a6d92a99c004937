"""A recording replayed through the model of torch's caching allocator (devices/caching_allocator.py).

The state when recording began is the dump rewound entry by entry (`start_state`): from the segments and
live blocks of the dump, each `alloc` undone (its block was not there yet), each `free_completed` undone
(its block was), each `segment_alloc` undone and each `segment_free` undone. What was allocated before
the recording is only in the dump's `segments`; a block alive at the start and freed during the
recording has the size of its request rounded as `round_size` rounds it, or up to what follows it where
the allocator would not have split the rest off (`should_split`).

Then the entries are replayed in order (`replay`): `alloc` asks the model for a block; `free_requested`
is when `memory_allocated` drops, `free_completed` when the block is free for reuse (later where other
streams used it); a run of `segment_free` entries made by `empty_cache()` (its frames say so) is
`empty_cache()`; one made by the out-of-memory path (the allocator releasing its cache to retry) is left
to the model, or at the recorded settings (`follow=True`) releases the segments it names; `oom` is a
request that failed (retried in a what-if). At the recorded settings each new segment takes the
address of the `segment_alloc` it matches (its size), and every segment reserved and released is
compared with the recording (`ReplayResult.segments_match`).

`smallest_capacity` finds the smallest capacity (to 2 MiB) on which the replay fits, by bisection between
what the replay must hold (its peak allocated) and the peak reserved with no limit; a failing probe says
how much it needed when it ran out (reserved after releasing what it could, plus the segment it asked
for), which is where the next lower bound is (fitting is not monotonic in the capacity: the result is
a capacity that fits with the one 2 MiB below it failing). Pure Python, no torch import.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from cuda_magic.devices.allocator_conf import parse_conf
from cuda_magic.devices.caching_allocator import (
    MiB, CachingAllocatorModel, CannotReserve, kMinBlockSize, kSmallBuffer, kSmallSize)
from cuda_magic.devices.snapshot_load import DeviceSnapshot, settings_conf

NO_LIMIT = 1 << 62
STEP = 2 * MiB
FREES = ("free_requested", "free_completed")
TAKEN = ("active_allocated", "active_pending_free")


@dataclass
class ReplayFailure:
    """The first request a replay could not serve."""

    index: int                    # its entry in the recording
    requested: int                # bytes asked for
    alloc_size: int               # the segment it tried to reserve (torch's "Tried to allocate")
    allocated: int                # memory_allocated when it ran out
    reserved: int                 # reserved then, after the allocator released what it could


@dataclass
class ReplayResult:
    capacity: int | None
    conf: str
    fits: bool
    failure: ReplayFailure | None
    peak_allocated: int
    peak_reserved: int
    peak_allocated_at: int = -1          # entry index (-1: the start state)
    peak_reserved_at: int = -1
    allocated: list[int] = field(default_factory=list)   # memory_allocated after each entry
    reserved: list[int] = field(default_factory=list)    # reserved after each entry
    block_sizes: dict[int, int] = field(default_factory=dict)   # alloc entry -> its block's size
    start_allocated: int = 0
    start_reserved: int = 0
    segment_events: list[tuple] = field(default_factory=list)   # (action, address, size) of the model
    recorded_segment_events: list[tuple] = field(default_factory=list)
    address_mismatches: int = 0          # blocks handed out at another address than recorded (follow)
    needed: int = 0                      # a failure: what it needed reserved (reserved + the segment asked)
    mapped: int = 0                      # segment_map / segment_unmap entries (expandable segments): not compared

    @property
    def segments_match(self) -> bool:
        return self.segment_events == self.recorded_segment_events and self.address_mismatches == 0


def _is_empty_cache(frames) -> bool:
    return any("emptyCache" in (f.get("name") or "") or (f.get("name") == "empty_cache") for f in frames or ())


def empty_cache_runs(trace) -> set[int]:
    """Indexes of `segment_free` entries made by `empty_cache()` (not by the out-of-memory path): their
    frames say so; without frames, a run of them not followed by a `segment_alloc` before the next
    `alloc` (the out-of-memory path releases, then reserves)."""
    out, i, n = set(), 0, len(trace)
    while i < n:
        if trace[i].get("action") != "segment_free":
            i += 1
            continue
        j = i
        while j < n and trace[j].get("action") == "segment_free":
            j += 1
        framed = [k for k in range(i, j) if trace[k].get("frames")]
        if framed:
            cache = any(_is_empty_cache(trace[k].get("frames")) for k in framed)
        else:
            nxt = next((trace[k].get("action") for k in range(j, n)
                        if trace[k].get("action") in ("alloc", "segment_alloc")), None)
            cache = nxt != "segment_alloc"
        if cache:
            out.update(range(i, j))
        i = j
    return out


def start_state(rec: DeviceSnapshot) -> list[dict]:
    """The segments when recording began, with their blocks (see the module's docstring)."""
    segs = {s["address"]: (s["total_size"], s["segment_type"]) for s in rec.segments}
    alive = {b["address"]: b["size"] for s in rec.segments for b in s["blocks"] if b["state"] in TAKEN}
    guessed = set()
    for e in reversed(rec.trace):
        action, addr = e.get("action"), e.get("addr")
        if action == "alloc":
            alive.pop(addr, None)
        elif action == "free_completed" or (action == "free_requested" and not _completes(rec)):
            size = int(e.get("size") or 0)
            alive[addr] = max(kMinBlockSize, -(-size // kMinBlockSize) * kMinBlockSize)
            guessed.add(addr)
        elif action == "segment_alloc":
            segs.pop(addr, None)
        elif action == "segment_free":
            size = int(e.get("size") or 0)
            segs[addr] = (size, "small" if size == kSmallBuffer else "large")
    out = []
    starts = sorted(alive)
    for base in sorted(segs):
        total, kind = segs[base]
        end = base + total
        i = bisect.bisect_left(starts, base)
        blocks, at = [], base
        while i < len(starts) and starts[i] < end:
            ptr = starts[i]
            size = alive[ptr]
            nxt = starts[i + 1] if i + 1 < len(starts) and starts[i + 1] < end else end
            if ptr in guessed and kind == "large" and 0 < nxt - (ptr + size) <= kSmallSize:
                size = nxt - ptr                 # the allocator would not have split so little off
            if ptr > at:
                blocks.append({"address": at, "size": ptr - at, "state": "inactive"})
            blocks.append({"address": ptr, "size": size, "requested_size": size, "state": "active_allocated"})
            at = ptr + size
            i += 1
        if at < end:
            blocks.append({"address": at, "size": end - at, "state": "inactive"})
        out.append({"address": base, "total_size": total, "segment_type": kind, "blocks": blocks})
    return out


def _completes(rec: DeviceSnapshot) -> bool:
    """Whether the recording has `free_completed` entries (else a `free_requested` frees at once)."""
    return rec.completes


def model_for(rec: DeviceSnapshot, capacity: int | None, conf: str | None) -> CachingAllocatorModel:
    """The allocator at the recorded settings, with `conf` laid over them as torch's setter does (options
    it does not name go back to their defaults, expandable_segments keeps its value); ValueError for
    settings torch would refuse."""
    model = CachingAllocatorModel(NO_LIMIT if capacity is None else int(capacity))
    recorded = settings_conf(rec.settings)
    model.configure(recorded, strict=False)
    gc = _gc_threshold(recorded)
    if conf:
        model.configure(conf)
        gc = _gc_threshold(conf)
    model.garbage_collection_threshold = gc
    model.gc_allowed_maximum = None if capacity is None else int(capacity)
    return model


def check_conf(conf: str) -> str:
    """`conf` if torch's setter would take it (ValueError saying why not)."""
    CachingAllocatorModel(NO_LIMIT).configure(conf)
    _gc_threshold(conf)
    return conf


def _gc_threshold(conf: str) -> float:
    value = 0.0
    for key, text in parse_conf(conf or ""):
        if key == "garbage_collection_threshold":
            try:
                value = float(text)
            except ValueError:
                raise ValueError(f"garbage_collection_threshold takes a number, not {text!r}") from None
            if not 0.0 < value < 1.0:
                raise ValueError(f"garbage_collection_threshold must be between 0 and 1, not {text}")
    return value


def replay(rec: DeviceSnapshot, capacity: int | None = None, conf: str | None = None, *, follow: bool | None = None,
           series: bool = True, start: list[dict] | None = None) -> ReplayResult:
    """Replay the recording on a device of `capacity` bytes (None: no limit) with `conf` laid over the
    recorded settings. `follow` (default: at the recorded settings with no capacity): take the recorded
    segments' addresses and compare every segment event with the recording."""
    if follow is None:
        follow = capacity is None and not conf
    model = model_for(rec, capacity, conf)
    trace = rec.trace
    start = start_state(rec) if start is None else start
    held = model.load_segments(start)
    addresses = [e.get("addr") or 0 for e in trace if e.get("action") in ("segment_alloc", "alloc")]
    model.addresses_from(max(addresses, default=0) + (1 << 34))
    hints: list[tuple[int, int]] = []
    seen: list[tuple] = []
    recorded: list[tuple] = []
    if follow:
        def take(size):
            if hints and hints[0][1] == size:
                return hints.pop(0)[0]
            return None
        model.address_source = take
    model.segment_listener = lambda action, addr, size: seen.append((action, addr, size))
    sizes = {addr: b.size for addr, b in held.items()}     # what memory_allocated counts per held block
    counted = set(held)                                    # blocks memory_allocated still counts
    level = model.allocated
    completes = _completes(rec)
    cache_frees = empty_cache_runs(trace) if any(e.get("action") == "segment_free" for e in trace) else set()
    result = ReplayResult(capacity, conf or "", True, None, level, model.reserved, start_allocated=level,
                          start_reserved=model.reserved)
    peak_a, peak_r = level, model.reserved
    alloc_series, reserved_series, block_sizes = result.allocated, result.reserved, result.block_sizes
    mismatched = 0
    for i, e in enumerate(trace):
        action = e.get("action")
        addr = e.get("addr")
        if action == "alloc":
            try:
                block = model.malloc(int(e.get("size") or 0))
            except CannotReserve as exc:
                _ran_out(result, i, exc, level)
                break
            if block is not None:
                model.note_handed_out(block)
                if follow and block.ptr != addr:
                    mismatched += 1
                held[addr] = block
                sizes[addr] = block.size
                counted.add(addr)
                level += block.size
                block_sizes[i] = block.size
        elif action in FREES:
            if addr in counted and (action == "free_requested" or not completes):
                counted.discard(addr)
                level -= sizes.get(addr, 0)
            if action == "free_completed" or not completes:
                block = held.pop(addr, None)
                if block is not None:
                    model.free(block)
        elif action == "segment_alloc":
            if follow:
                hints.append((addr, int(e.get("size") or 0)))
                recorded.append(("segment_alloc", addr, int(e.get("size") or 0)))
        elif action == "segment_free":
            if follow:
                recorded.append(("segment_free", addr, int(e.get("size") or 0)))
            if i in cache_frees:
                if i - 1 not in cache_frees:         # the first of one empty_cache()'s releases
                    model.empty_cache()
            elif follow:
                model.release_segment(addr)
        elif action in ("segment_map", "segment_unmap"):
            result.mapped += 1
        elif action == "oom" and not follow:
            try:
                block = model.malloc(int(e.get("size") or 0))
            except CannotReserve as exc:
                _ran_out(result, i, exc, level)
                break
            model.free(block)
        reserved = model.reserved
        # a peak the recording reaches again counts as its own (not the state from before it)
        if level > peak_a or (level == peak_a and result.peak_allocated_at < 0):
            peak_a, result.peak_allocated_at = level, i
        if reserved > peak_r or (reserved == peak_r and result.peak_reserved_at < 0):
            peak_r, result.peak_reserved_at = reserved, i
        if series:
            alloc_series.append(level)
            reserved_series.append(reserved)
    result.peak_allocated, result.peak_reserved = peak_a, peak_r
    result.segment_events, result.recorded_segment_events = seen, recorded
    result.address_mismatches = mismatched
    return result


def smallest_capacity(rec: DeviceSnapshot, conf: str | None = None, *, start: list[dict] | None = None,
                      unlimited: ReplayResult | None = None) -> int:
    """The smallest capacity (a multiple of 2 MiB) on which the replay with `conf` fits, the capacity 2 MiB
    below it failing (see the module's docstring)."""
    start = start_state(rec) if start is None else start
    if unlimited is None:
        unlimited = replay(rec, None, conf, follow=False, series=False, start=start)
    hi = -(-unlimited.peak_reserved // STEP) * STEP          # fits: nothing more is ever asked for
    lo = max(0, (unlimited.peak_allocated // STEP) * STEP - STEP)   # fails: less than what is held
    lo = min(lo, hi - STEP)
    while hi - lo > STEP:
        mid = lo + ((hi - lo) // 2 // STEP) * STEP
        probe = replay(rec, mid, conf, follow=False, series=False, start=start)
        if probe.fits:
            hi = mid
        else:
            lo = mid
            # it needed this much reserved when it ran out: capacities below fail at the same request or
            # earlier where nothing before it differs; start the next probes there
            need = -(-probe.needed // STEP) * STEP - STEP
            if lo < need < hi:
                check = replay(rec, need, conf, follow=False, series=False, start=start)
                if check.fits:
                    hi = need
                else:
                    lo = need
    return hi


def _ran_out(result, index: int, exc, allocated: int) -> None:
    """The replay's first request that could not be served: where, what it asked, what was held."""
    result.fits = False
    result.failure = ReplayFailure(index, exc.requested, exc.alloc_size, allocated, exc.reserved)
    result.needed = exc.reserved + exc.alloc_size
