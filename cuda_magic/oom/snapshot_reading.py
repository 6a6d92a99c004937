"""`read_snapshot`: a GPU's own record (a `_dump_snapshot` file or a `_snapshot()` dict) read and explained,
and replayed on another device or with other settings (`SnapshotReading.replay`).

Read through the same path as the live CUDA black box (devices/cuda_history.py `replay` into a
`Recorder`, then memory/blackbox.py): the timeline, what was alive at a moment by line of user code, the
failing request's line. The allocator's replay (devices/snapshot_replay.py) gives the block sizes
`memory_allocated` counted, the reserved memory over the run and the what-ifs. An out-of-memory error in
the recording is diagnosed as a live one is (oom/diagnosis.py). Sizes are int bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cuda_magic.devices.cuda_history import Reading, replay as history_replay
from cuda_magic.devices.recorder import BACKWARD_THREAD, BEFORE, NO_FRAMES, python_frames
from cuda_magic.devices.snapshot_load import (
    DeviceSnapshot, SnapshotError, UnsafePickle, read_snapshot_data, recording_of, settings_conf)
from cuda_magic.devices import snapshot_replay as R
from cuda_magic.memory.blackbox import LineUse, lines_of
from cuda_magic.reprs import Rendered
from cuda_magic.units import format_bytes

__all__ = ["SnapshotError", "UnsafePickle", "SnapshotReading", "WhatIf", "read_snapshot"]

BEFORE_RECORDING = "before the recording"
KIND_SAMPLES = 5              # allocations of a line whose frames say its kind (the most frequent wins)
KIND_ORDER = ("parameters", "gradients", "optimizer_state", "activations", "other", BEFORE_RECORDING)
NO_HISTORY = ("this snapshot has no history (the state only): the timeline and the replay need one recorded "
              "with torch.cuda.memory._record_memory_history() before the run")
KEPT_NOTE = ("what was reserved before the recording began stays as it was recorded (its segments are not "
             "re-made with other settings)")


def kind_of(frames) -> str:
    """What made an allocation, from its frames: parameters, gradients, optimizer state, activations or
    other (the kinds of memory/kinds.py)."""
    python = python_frames(frames)
    if not python:
        if any("autograd::Engine" in (f.get("name") or "") for f in frames or ()):
            return "gradients"
        return "other"
    for f in python:
        name = (f.get("filename") or "").replace("\\", "/")
        fn = f.get("name") or ""
        if "/torch/optim/" in name:
            return "optimizer_state"
        if "/torch/autograd/" in name and fn in ("backward", "_engine_run_backward", "run_backward", "grad"):
            return "gradients"
        if name.endswith(("/torch/nn/parameter.py", "/torch/nn/init.py")) or (
                name.endswith("/torch/nn/modules/module.py") and fn in ("_apply", "to", "cuda", "register_parameter")):
            return "parameters"
    for f in python:
        name = (f.get("filename") or "").replace("\\", "/")
        if (name.endswith("/torch/nn/modules/module.py") and f.get("name") in ("_call_impl", "_wrapped_call_impl")) \
                or f.get("name") == "forward":
            return "activations"
    return "other"


@dataclass
class FailureAt:
    """The first request that ran out in a replay (or in the recording): its line, its size, and
    memory_allocated and reserved when it ran out (after the allocator released what it could)."""

    line: LineUse | None
    requested: int
    allocated: int
    reserved: int
    alloc_size: int = 0
    seconds: float = 0.0


@dataclass(repr=False)
class WhatIf(Rendered):
    """`reading.replay(capacity, conf)`: the recording replayed on a device of `capacity` bytes (None: no
    limit) with `conf` laid over the recorded settings."""

    _html_repr = True
    capacity: int | None = None
    conf: str = ""
    settings: str = ""                    # the settings replayed (recorded, with conf over them)
    fits: bool = True
    failure: FailureAt | None = None
    peak_reserved: int = 0
    peak_allocated: int = 0
    recorded_peak_reserved: int = 0
    notes: list[str] = field(default_factory=list)
    reading: SnapshotReading | None = None
    _smallest: int | None = None

    @property
    def smallest_capacity(self) -> int | None:
        """The smallest capacity (to 2 MiB) on which the recording fits with these settings."""
        if self._smallest is None and self.reading is not None and self.reading.recording.has_trace:
            self._smallest = self.reading._smallest(self.conf)
        return self._smallest


@dataclass(repr=False)
class SnapshotReading(Rendered):
    """What `read_snapshot` and `%gpumem --snapshot` read from a memory snapshot."""

    _html_repr = True
    source: str = ""
    device: int = 0
    devices: list[int] = field(default_factory=list)
    settings: str = ""                    # the recorded allocator settings ('' : torch's defaults, or not said)
    era: str = ""                         # torch's era, from what the file holds
    has_trace: bool = False
    events: int = 0
    peak_allocated: int = 0
    peak_allocated_seconds: float = 0.0
    peak_allocated_line: LineUse | None = None
    peak_reserved: int = 0
    peak_reserved_seconds: float = 0.0
    peak_reserved_line: LineUse | None = None
    start_allocated: int = 0
    start_reserved: int = 0
    end_allocated: int = 0
    end_reserved: int = 0
    timeline: list[tuple[float, int, int]] = field(default_factory=list)   # (seconds, allocated, reserved)
    timed: bool = True                    # False: the entries have no times (spaced evenly)
    by_line: list[LineUse] = field(default_factory=list)                    # alive at the peak allocated
    by_kind: dict[str, int] = field(default_factory=dict)                   # alive at the peak, by kind
    by_line_end: list[LineUse] = field(default_factory=list)
    by_kind_end: dict[str, int] = field(default_factory=dict)
    fragmentation: int = 0                # reserved but unallocated at the peak reserved
    inactive_split: int = 0               # of it, free pieces in segments that also hold blocks (at the end)
    oom: FailureAt | None = None          # the recording's out-of-memory error
    oom_by_line: list[LineUse] = field(default_factory=list)
    diagnosis: object = None              # oom/findings.Diagnosis of the recording's OOM
    segments_match: bool | None = None    # the replay at the recorded settings reproduced every segment event
    notes: list[str] = field(default_factory=list)
    recording: DeviceSnapshot | None = None
    _start: list | None = None
    _smallests: dict = field(default_factory=dict)
    _sites: dict = field(default_factory=dict)     # entry index -> LineUse of the alloc/oom there
    what_ifs: list = field(default_factory=list)   # replays to show with the reading (--capacity, --conf)
    rows: int = 8                                  # rows of the by-line tables shown

    @property
    def smallest_capacity(self) -> int | None:
        """The smallest capacity (to 2 MiB) on which the recording fits at its recorded settings; None
        without a history."""
        return self._smallest("") if self.has_trace else None

    def _smallest(self, conf: str) -> int:
        if conf not in self._smallests:
            self._smallests[conf] = R.smallest_capacity(self.recording, conf or None, start=self._start)
        return self._smallests[conf]

    def replay(self, capacity=None, conf: str | None = None) -> WhatIf:
        """The recording replayed on a device of `capacity` (bytes or a size such as '48GiB'; None: no
        limit) with `conf` ("expandable_segments:True,max_split_size_mb:128") laid over the recorded
        settings as torch's setter does. ValueError for a size or settings that do not parse."""
        if not self.has_trace:
            raise SnapshotError(NO_HISTORY)
        if isinstance(capacity, str):
            from cuda_magic.units import parse_size

            capacity = parse_size(capacity, allow_fraction=False)
        if capacity is not None and (isinstance(capacity, bool) or int(capacity) <= 0):
            raise ValueError(f"capacity takes a positive number of bytes, not {capacity!r}")
        conf = (conf or "").strip()
        model = R.model_for(self.recording, capacity, conf)     # ValueError: settings torch would refuse
        result = R.replay(self.recording, capacity, conf, follow=False, series=False, start=self._start)
        failure = None
        if result.failure is not None:
            f = result.failure
            failure = FailureAt(self._line_at(f.index), f.requested, f.allocated, f.reserved, f.alloc_size,
                                self._seconds_at(f.index))
        notes = [KEPT_NOTE] if conf else []
        return WhatIf(capacity=capacity, conf=conf, settings=model.settings(), fits=result.fits,
                      failure=failure, peak_reserved=result.peak_reserved, peak_allocated=result.peak_allocated,
                      recorded_peak_reserved=self.peak_reserved, notes=notes, reading=self)

    def _line_at(self, index: int) -> LineUse | None:
        return self._sites.get(index)

    def _seconds_at(self, index: int) -> float:
        if 0 <= index < len(self._times):
            return self._times[index]
        return 0.0

    _times: list = field(default_factory=list)


def read_snapshot(path_or_dict, device: int | None = None) -> SnapshotReading:
    """Read a memory snapshot: a path to what `torch.cuda.memory._dump_snapshot()` wrote (gzip'd or not),
    its bytes, or the dict `torch.cuda.memory._snapshot()` returns. Loading builds plain data only:
    `UnsafePickle` (a `SnapshotError`, a ValueError) for a file that asks for anything else, which is not
    run. `device`: of a recording of several devices (default: the one that held the most)."""
    data = read_snapshot_data(path_or_dict)
    source = path_or_dict if isinstance(path_or_dict, str) else getattr(path_or_dict, "name", "")
    rec = recording_of(data, device, str(source) if not isinstance(path_or_dict, dict) else "")
    reading = SnapshotReading(source=rec.source, device=rec.device, devices=rec.devices,
                              settings=settings_conf(rec.settings), era=_era(data, rec), has_trace=rec.has_trace,
                              events=len(rec.trace), recording=rec)
    if len(rec.devices) > 1:
        reading.notes.append(f"the snapshot holds devices {', '.join(map(str, rec.devices))}: this is device "
                             f"{rec.device} (-d N for another)")
    blocks = [b for s in rec.segments for b in s["blocks"] if b["state"] in R.TAKEN]
    reading.end_allocated = sum(b["size"] for b in blocks)
    reading.end_reserved = sum(s["total_size"] for s in rec.segments)
    if not rec.has_trace:
        _state_only(reading, rec)
        return reading
    start = R.start_state(rec)
    reading._start = start
    result = R.replay(rec, start=start)
    reading.segments_match = result.segments_match if not result.mapped else None
    if result.mapped:
        reading.notes.append("recorded with expandable segments: their pages mapped and unmapped are not compared "
                             "with the model's, and the segments from before the recording are replayed as "
                             "ordinary ones")
    elif not result.segments_match:
        reading.notes.append("the allocator's model did not reproduce every segment of the recording: the "
                             "what-ifs are estimates")
    _read_history(reading, rec, result)
    return reading


#: The line of `return forward_call(*args, **kwargs)` in torch/nn/modules/module.py's `Module._call_impl`,
#: a frame nearly every recording of a model has: read in the installed torch 2.2.2 and 2.13.0, and (2.1,
#: 2.6) in the real recordings whose torch is known (../shared/gpu_traces/SOURCES.md).
CALL_IMPL_LINES = {1527: "2.1", 1520: "2.2", 1750: "2.6", 1789: "2.13"}


def _era_from_frames(rec: DeviceSnapshot) -> str | None:
    for e in rec.trace[:2000]:
        for f in e.get("frames") or ():
            if f.get("name") == "_call_impl" and (f.get("filename") or "").endswith("nn/modules/module.py"):
                version = CALL_IMPL_LINES.get(int(f.get("line") or 0))
                if version is not None:
                    return f"torch {version} (going by its frames)"
    return None


def _era(data: dict, rec: DeviceSnapshot) -> str:
    from_frames = _era_from_frames(rec)
    if from_frames is not None:
        return from_frames
    if "external_annotations" in data:
        return "torch 2.6 or later"
    if "allocator_settings" in data:
        return "torch 2.5 or later"
    if any("history" in b for s in data.get("segments") or () for b in s.get("blocks") or ()):
        return "torch 2.0"
    if rec.trace and all("time_us" in e for e in rec.trace[:50]):
        return "torch 2.1 or later"
    return "torch 2.1 or later" if rec.trace else ""


def _state_only(reading: SnapshotReading, rec: DeviceSnapshot) -> None:
    from cuda_magic.devices.recorder import Recorder

    reading.notes.append(NO_HISTORY)
    recorder = Recorder(clock=lambda: 0.0)
    by_site: dict[int, list[int]] = {}
    kinds: dict[str, int] = {}
    for s in rec.segments:
        for b in s["blocks"]:
            if b["state"] in R.TAKEN:
                site = recorder.site_of_frames(b["frames"]) if b["frames"] else BEFORE
                agg = by_site.setdefault(site, [0, 0])
                agg[0] += b["size"]
                agg[1] += 1
                kind = kind_of(b["frames"]) if b["frames"] else BEFORE_RECORDING
                kinds[kind] = kinds.get(kind, 0) + b["size"]
    reading.by_line = reading.by_line_end = _box_of(recorder, {s: tuple(v) for s, v in by_site.items()})
    reading.by_kind = reading.by_kind_end = _ordered(kinds)
    reading.peak_allocated = reading.end_allocated
    reading.peak_reserved = reading.end_reserved
    reading.fragmentation = reading.end_reserved - reading.end_allocated


def _named(uses: list[LineUse]) -> list[LineUse]:
    for u in uses:
        if u.filename is None and u.cell_line is None:
            u.code = "(allocated before the recording)"
    return uses


def _ordered(kinds: dict[str, int]) -> dict[str, int]:
    return {k: kinds[k] for k in KIND_ORDER if kinds.get(k)}


def _read_history(reading: SnapshotReading, rec: DeviceSnapshot, result) -> None:
    trace = rec.trace
    ooms = [i for i, e in enumerate(trace) if e.get("action") == "oom"]
    final = Reading(_dump_as_snapshot(rec), reading.end_allocated, float("inf"))
    site_of_entry: dict[int, int] = {}
    recorder = history_replay(final, 0, failure=final if ooms else None, start_us=None, max_entries=None,
                              block_sizes=result.block_sizes, sites=site_of_entry)
    timed = bool(trace) and all("time_us" in e for e in trace)
    t0 = trace[0]["time_us"] if timed else 0
    times = [(e["time_us"] - t0) / 1e6 if timed else float(i) for i, e in enumerate(trace)]
    reading._times = times
    reading.timed = timed
    reading.start_allocated, reading.start_reserved = result.start_allocated, result.start_reserved
    reading.timeline = [(0.0, result.start_allocated, result.start_reserved)] + list(
        zip(times, result.allocated, result.reserved))
    reading.peak_allocated, reading.peak_reserved = result.peak_allocated, result.peak_reserved
    # each allocation's line and kind, read once per entry through the recorder's sites
    kinds_of_site: dict[int, dict[str, int]] = {}
    for i, site in site_of_entry.items():
        e = trace[i]
        if True:
            counts = kinds_of_site.setdefault(site, {})
            if e.get("action") == "alloc" and sum(counts.values()) < KIND_SAMPLES:   # a few of each line
                kind = kind_of(e.get("frames"))
                counts[kind] = counts.get(kind, 0) + 1
    site_kind = {s: max(c, key=c.get) for s, c in kinds_of_site.items() if c}
    site_kind[BEFORE] = BEFORE_RECORDING

    def line_of(site: int) -> LineUse | None:
        if site == BEFORE:
            return None
        box = _box_of(recorder, {site: (0, 1)})
        return box[0] if box else None

    reading._sites = _LazySites(site_of_entry, line_of)
    pa, pr = result.peak_allocated_at, result.peak_reserved_at
    reading.peak_allocated_seconds = times[pa] if pa >= 0 else 0.0
    reading.peak_reserved_seconds = times[pr] if pr >= 0 else 0.0
    reading.peak_allocated_line = reading._sites.get(_alloc_at_or_after(trace, pa)) if pa >= 0 else None
    reading.peak_reserved_line = reading._sites.get(_alloc_at_or_after(trace, pr)) if pr >= 0 else None
    if pr < 0 and result.reserved:           # the cache of earlier work was the most reserved
        own = max(range(len(result.reserved)), key=result.reserved.__getitem__)
        line = reading._sites.get(_alloc_at_or_after(trace, own))
        reading.notes.append(
            f"reserved was highest when the recording began ({format_bytes(result.start_reserved)}, the cache of "
            f"earlier work); during the recording the highest was {format_bytes(result.reserved[own])}"
            + (f", asked for by {line.where}" if line is not None else ""))
    reading.fragmentation = result.reserved[pr] - result.allocated[pr] if pr >= 0 else (
        result.start_reserved - result.start_allocated)
    peak_sites = recorder.at_peak()
    reading.by_line = _box_of(recorder, peak_sites)
    reading.by_kind = _by_kind(peak_sites, site_kind)
    end_sites = {s: (b, n) for s, (b, n) in recorder.by_site.items()}
    reading.by_line_end = _box_of(recorder, end_sites)
    reading.by_kind_end = _by_kind(end_sites, site_kind)
    model = R.model_for(rec, None, None)
    model.load_segments(rec.segments)
    reading.inactive_split = model.inactive_split
    if ooms:
        _read_oom(reading, rec, recorder, result, ooms[-1], site_kind)
    reading.notes.extend(n for n in recorder.notes if n not in reading.notes)


class _LazySites(dict):
    """entry index -> LineUse, made when asked for."""

    def __init__(self, sites, line_of):
        super().__init__()
        self._sites, self._line_of = sites, line_of

    def get(self, index, default=None):
        if index is None or index not in self._sites:
            return default
        if index not in self:
            self[index] = self._line_of(self._sites[index])
        return dict.get(self, index)


def _alloc_at_or_after(trace, index: int) -> int | None:
    for i in range(max(0, index), len(trace)):
        if trace[i].get("action") == "alloc":
            return i
    return None


def _box_of(recorder, sites: dict) -> list[LineUse]:
    return _named(lines_of(recorder, sites))


def _by_kind(sites: dict, site_kind: dict) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for s, (nbytes, _) in sites.items():
        if nbytes > 0:
            kind = site_kind.get(s, "other")
            kinds[kind] = kinds.get(kind, 0) + nbytes
    return _ordered(kinds)


def _dump_as_snapshot(rec: DeviceSnapshot) -> dict:
    """The recording as torch's `_snapshot()` dict of one device (index 0), for the history's replay."""
    segments = [dict(s, device=0) for s in rec.segments]
    return {"segments": segments, "device_traces": [rec.trace]}


def _read_oom(reading: SnapshotReading, rec: DeviceSnapshot, recorder, result, index: int, site_kind) -> None:
    from cuda_magic.oom.diagnosis import CellFacts, diagnose
    from cuda_magic.oom.findings import OomFields

    entry = rec.trace[index]
    allocated = result.allocated[index] if index < len(result.allocated) else reading.end_allocated
    reserved = result.reserved[index] if index < len(result.reserved) else reading.end_reserved
    requested = int(entry.get("size") or 0)
    free = entry.get("addr")         # torch records the device's free memory in an oom entry's addr
    failure = recorder.failures[-1] if recorder.failures else None
    reading.oom = FailureAt(reading._sites.get(index), requested, allocated, reserved, requested,
                            reading._times[index])
    if failure is not None:
        reading.oom_by_line = _box_of(recorder, failure.by_site)
        by_kind = _by_kind(failure.by_site, site_kind)
    else:
        by_kind = {}
    top = next((u for u in reading.oom_by_line if u.filename not in (None, NO_FRAMES, BACKWARD_THREAD)), None)
    fields = OomFields(requested=requested, free=int(free) if isinstance(free, int) else None,
                       allocated_by_torch=allocated, reserved_unallocated=max(0, reserved - allocated),
                       message="out of memory in the recording")
    facts = CellFacts(api=True, peak=reading.peak_allocated, alloc_conf=reading.settings,
                      top_line=(top.bytes, top.code or f"{top.function}()", top.where)
                      if top is not None and (top.code or top.function) else None,
                      by_kind={k: v for k, v in by_kind.items() if k != BEFORE_RECORDING},
                      backward=failure is not None and failure.phase == "backward")
    reading.diagnosis = diagnose(fields, facts)
