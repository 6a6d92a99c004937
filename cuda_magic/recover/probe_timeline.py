"""The cell's own runs under `%%oomguard -r VAR --search`, replayed at another value on the allocator model.

`--search` probes up from a value that fitted. Its predictions count allocated bytes (the peaks of the
runs that fitted, the lower bound of what a failure needed), while on torch's caching allocator what runs
out is reserved segments: a transformers Llama on 2 GiB fits at 94 with a peak of 1.73 GB allocated
(81% of the capacity), the rest reserved in blocks the next request could not use, so a line through the
peaks said 112 and three probes above 94 ran out before the search found it. Where the failure came
inside a model call, the model measured on slices of its batch is replayed on the allocator
(recover/replay.py); a failure outside any module call (the loss's backward pass) leaves nothing to
replay.

So on a device that models the caching allocator (the simulated device: `allocator_copy`,
`copy_state`, `attach_recorder`), each run `--search` makes is recorded: its allocations and frees in
order (devices/allocator_replay.Timeline). The runs that fitted, matched event for event (two values
make the same sequence of requests, each a line in the value), are replayed at a candidate value on a
copy of the allocator as the next run will find it (the probe's own tensors given back and the cache
emptied, as the roll-back does): the candidate fits where the copy serves every request. With one run
that fitted, the run that failed gives the second point for the events it made before failing (`run_lines`);
one run alone scaled in proportion is the last resort (a fixed allocation grown with the value shares
segments otherwise). Pure Python, no torch import.
The recorders of a measured pass (recover/replay.py, recover/generation.py) are attached here too
(`timeline_of`).
"""
from __future__ import annotations

import weakref

from cuda_magic.devices.allocator_replay import ALLOC, FREE, Timeline, replay_fits

MAX_EVENTS = 500_000      # a run recording more stops recording (and is not replayed)


class RunTimeline(Timeline):
    """A run's allocations and frees; it stops recording once its policy is gone (a loop stopped by an
    error never calls `record`) or past MAX_EVENTS."""

    def __init__(self, device, owner):
        super().__init__(device)
        self._owner = weakref.ref(owner)
        self.recording = True
        self.complete = True

    def _on(self) -> bool:
        if self.recording and (self._owner() is None or len(self.events) >= MAX_EVENTS):
            self.complete = False
            self._detach()
        return self.recording

    def alloc(self, key, nbytes, allocated, *args, **kwargs) -> None:
        if self._on():
            super().alloc(key, nbytes, allocated)

    def free(self, key, allocated, *args, **kwargs) -> None:
        if self._on():
            super().free(key, allocated)

    def resize(self, key, nbytes, allocated, *args, **kwargs) -> None:
        if self._on():
            super().resize(key, nbytes, allocated)

    def _detach(self) -> None:
        # called from the device's own callbacks (it holds its lock): the tuple of recorders is replaced
        # as detach_recorder does, without taking the lock again
        self.recording = False
        device = self.device
        device.recorders = tuple(r for r in device.recorders if r is not self)

    def stop(self) -> None:
        """The run is over: no more events."""
        if self.recording:
            self.recording = False
            self.device.detach_recorder(self)

    @property
    def live(self) -> list[int]:
        """The storages the run made that are still alive (the cell's names hold them until rolled back)."""
        return list(self._index)


def reserves_segments(meter) -> bool:
    """Whether the metered device reserves as torch's caching allocator does (its out-of-memory message then
    names the segment it could not reserve): a simulated device with its model of it, or a CUDA GPU."""
    return getattr(getattr(meter, "device", None), "model", None) is not None or meter.key.startswith("cuda")


def timeline_of(meter):
    """A recorder of the pass's allocations and frees, attached to the metered device where it models torch's
    caching allocator (a simulated device); else None."""
    device = getattr(meter, "device", None)
    if getattr(device, "model", None) is None or not hasattr(device, "allocator_copy"):
        return None
    recording = Timeline(device)
    device.attach_recorder(recording)
    return recording


def _device(allocator):
    device = getattr(allocator, "__self__", None)
    needed = ("attach_recorder", "detach_recorder", "copy_state", "requested_bytes", "recorders")
    if device is None or getattr(device, "model", None) is None or not all(hasattr(device, n) for n in needed):
        return None
    return device


def start_recording(allocator, owner) -> RunTimeline | None:
    """A recording of the next run on the device whose `allocator_copy` is `allocator`; None where the
    device does not model torch's caching allocator."""
    device = _device(allocator)
    if device is None:
        return None
    recording = RunTimeline(device, owner)
    device.attach_recorder(recording)
    return recording


def run_lines(runs: dict, failed: dict | None = None) -> tuple | None:
    """(ALLOC, fixed, per_unit, False) and (FREE, index) events from the runs that fitted (value ->
    RunTimeline): the two largest values whose runs made the same sequence; else the largest with the
    run that failed whose events up to its failure match it longest (`failed`): those events a line
    through both, each later allocation growing as the first one of the same size at the fitted value
    did, or in proportion; else the largest alone in proportion (an allocation of fixed size counted as
    growing: on a caching allocator that changes how blocks share segments, so it is the last resort).
    None where there are none."""
    values = sorted(runs, reverse=True)
    for i, high in enumerate(values):
        for low in values[i + 1:]:
            lines = _matched(runs[low].events, low, runs[high].events, high)
            if lines is not None:
                return lines
    if not values:
        return None
    top = values[0]
    events = runs[top].events
    best, lines = 0, None
    for value, run in (failed or {}).items():
        if value == top:
            continue
        length = _prefix(events, run.events)
        if length > best:
            best, lines = length, _matched(events[:length], top, run.events[:length], value) \
                if value > top else _matched(run.events[:length], value, events[:length], top)
    if lines is None:
        return tuple((ALLOC, 0.0, a / top, False) if kind == ALLOC else (FREE, a) for kind, a in events)
    grown = {}
    for (kind, a), line in zip(events, lines):
        if kind == ALLOC:
            grown.setdefault(a, line)
    rest = []
    for kind, a in events[best:]:
        if kind == FREE:
            rest.append((FREE, a))
        else:
            same = grown.get(a)
            rest.append(same if same is not None else (ALLOC, 0.0, a / top, False))
    return tuple(lines) + tuple(rest)


def _prefix(a: list, b: list) -> int:
    """How many events the two sequences share in kind (and, for a free, in the event it gives back)."""
    n = 0
    for (kind, x), (other, y) in zip(a, b):
        if kind != other or (kind == FREE and x != y):
            break
        n += 1
    return n


def _matched(small, low: int, large, high: int) -> tuple | None:
    if len(small) != len(large) or high <= low:
        return None
    out = []
    for (kind, a), (other, b) in zip(small, large):
        if kind != other or (kind == FREE and a != b):
            return None
        if kind == FREE:
            out.append((FREE, a))
        else:
            per_unit = (b - a) / (high - low)
            out.append((ALLOC, a - per_unit * low, per_unit, False))
    return tuple(out)


def next_run_allocator(allocator, live: list[int] = ()):
    """A callable giving a copy of the device's allocator as the next run will find it: the storages
    `live` (the last probe's, still bound when the policy is asked) given back and the cache emptied, as
    the roll-back after a probe and the clean-up after a failure do (recover/retrying.py): segments left
    cached for the value before would serve other requests than a fresh reservation (101 where 94 is the
    largest on the 2 GiB Llama; 1605 where 1706 is on the MLP). None where the device has no model."""
    device = _device(allocator)
    if device is None:
        return None

    def copy():
        model, blocks = device.copy_state()
        for key in live:
            block = blocks.get(key)
            if block is not None:
                model.free(block)
        model.empty_cache()
        return model

    return copy


def replay_verdict(runs: dict, allocator, live: list[int] = (), failed: dict | None = None):
    """fits(value): whether the runs' events (`run_lines`) at `value` are served by a copy of the device's
    allocator as the next run will find it (`next_run_allocator`); None where there is nothing to replay
    or no allocator model."""
    fresh = next_run_allocator(allocator, live)
    lines = run_lines(runs, failed) if fresh is not None else None
    if lines is None:
        return None
    return lambda value: replay_fits(fresh(), lines, value)
