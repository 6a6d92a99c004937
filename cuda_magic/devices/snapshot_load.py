"""A GPU's own record opened safely: what `torch.cuda.memory._dump_snapshot()` writes (a pickle, plain or
gzip-compressed) or the dict `torch.cuda.memory._snapshot()` returns, as plain data for one device.

A pickle runs code when it is loaded (a `__reduce__` names a function to call); a snapshot is only dicts,
lists, tuples, strings, numbers, bytes, None and bools, which pickle builds with no global at all. So the
unpickler refuses every global (`find_class`) and persistent id: a file that needs one is refused before
anything it names is looked up, let alone called.

The layouts read (torch/cuda/memory.py `_snapshot`, c10/cuda/CUDACachingAllocator.h `SegmentInfo` /
`BlockInfo` / `TraceEntry`, torch/csrc/cuda/memory_snapshot.cpp `_memory_snapshot_pickled`):
- torch 2.1 and later: {"segments": [...], "device_traces": [[entry, ...] per device],
  "allocator_settings": {...} (2.5+), "external_annotations": [...] (2.6+)}; each segment has "device",
  "address", "total_size", "segment_type", "stream", "is_expandable" and "blocks", each block "address",
  "size", "requested_size", "state", "frames".
- torch 2.0: the same without "address" on blocks (they follow each other from the segment's address)
  and with a block's stack in its "history" ([{"addr", "real_size", "frames"}], torch 2.0's
  torch/cuda/_memory_viz.py reads the first).
"""
from __future__ import annotations

import gzip
import io
import pickle
from dataclasses import dataclass, field

GZIP_MAGIC = b"\x1f\x8b"


class SnapshotError(ValueError):
    """A file or object that is not a memory snapshot, or that cannot be opened safely."""


class UnsafePickle(SnapshotError):
    """A pickle that needs more than plain data (a class or function to look up and call)."""


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        raise UnsafePickle(f"the file asks to run {module}.{name} while loading: a memory snapshot is plain "
                           "data, so it was not loaded and nothing in it ran")

    def persistent_load(self, pid):
        raise UnsafePickle("the file holds a persistent reference (not plain data): it was not loaded")


def load_plain(data: bytes):
    """Unpickle `data` (gzip-compressed or not) building plain data only; UnsafePickle otherwise."""
    if data[:2] == GZIP_MAGIC:
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise SnapshotError(f"a gzip file that does not decompress ({exc})") from None
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except UnsafePickle:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to parse is "not a snapshot"
        raise SnapshotError(f"not a pickle ({type(exc).__name__}: {exc})") from None


@dataclass
class DeviceSnapshot:
    """One device's part of a snapshot, normalized: segments with every block's address and frames,
    the trace entries in order, the recorded allocator settings."""

    device: int
    devices: list[int]                    # the devices the snapshot holds
    segments: list[dict]
    trace: list[dict]
    settings: dict = field(default_factory=dict)
    has_trace: bool = False
    source: str = ""
    completes: bool = True                # the trace has free_completed entries


def read_snapshot_data(path_or_dict) -> dict:
    """The snapshot dict from a path (a `_dump_snapshot` pickle, maybe gzip'd), bytes or the dict itself."""
    if isinstance(path_or_dict, dict):
        data = path_or_dict
    elif isinstance(path_or_dict, (bytes, bytearray)):
        data = load_plain(bytes(path_or_dict))
    else:
        with open(path_or_dict, "rb") as f:
            data = load_plain(f.read())
    if isinstance(data, list) and all(isinstance(s, dict) and "blocks" in s for s in data):
        data = {"segments": data, "device_traces": []}     # memory_snapshot()'s list of segments
    if not isinstance(data, dict) or not isinstance(data.get("segments"), list):
        raise SnapshotError("not a memory snapshot (no 'segments': write one with "
                            "torch.cuda.memory._dump_snapshot(path))")
    return data


def devices_of(data: dict) -> dict[int, int]:
    """{device: bytes reserved at the dump} for every device with segments or a trace."""
    held: dict[int, int] = {}
    for seg in data.get("segments") or ():
        d = int(seg.get("device", 0))
        held[d] = held.get(d, 0) + int(seg.get("total_size", 0))
    for d, trace in enumerate(data.get("device_traces") or ()):
        if trace:
            held.setdefault(d, 0)
    return held


def recording_of(data: dict, device: int | None = None, source: str = "") -> DeviceSnapshot:
    """The normalized recording of `device` (default: the one that held the most at the dump)."""
    held = devices_of(data)
    devices = sorted(held)
    if device is None:
        device = max(devices, key=lambda d: (held[d], -d)) if devices else 0
    elif devices and device not in held:
        raise SnapshotError(f"the snapshot has no device {device}: it has {', '.join(map(str, devices))}")
    segments = [_segment(s) for s in data.get("segments") or () if int(s.get("device", 0)) == device]
    segments.sort(key=lambda s: s["address"])
    traces = data.get("device_traces") or []
    trace = list(traces[device]) if device < len(traces) and traces[device] else []
    has_trace = any(e.get("action") in ("alloc", "free_requested", "free_completed", "segment_alloc")
                    for e in trace)
    completes = any(e.get("action") == "free_completed" for e in trace)
    return DeviceSnapshot(device, devices, segments, trace, dict(data.get("allocator_settings") or {}), has_trace,
                     source, completes)


def _segment(seg: dict) -> dict:
    address = int(seg.get("address", 0))
    blocks, at = [], address
    for b in seg.get("blocks") or ():
        history = b.get("history") or ()
        first = history[0] if history else {}
        frames = b.get("frames") or first.get("frames") or []
        size = int(b.get("size", 0))
        blocks.append({"address": int(b.get("address", at)), "size": size,
                       "requested_size": int(b.get("requested_size", first.get("real_size", size)) or 0),
                       "state": b.get("state", "inactive"), "frames": frames})
        at += size
    return {"device": int(seg.get("device", 0)), "address": address, "total_size": int(seg.get("total_size", 0)),
            "segment_type": seg.get("segment_type", "large"), "stream": seg.get("stream", 0),
            "is_expandable": bool(seg.get("is_expandable", False)), "blocks": blocks, "frames": seg.get("frames") or []}


def settings_conf(settings: dict) -> str:
    """The recorded allocator settings (`allocator_settings`, torch 2.5+) as a settings string."""
    parts = []
    split = settings.get("max_split_size", -1)
    if isinstance(split, int) and split > 0:
        parts.append(f"max_split_size_mb:{split // (1024 * 1024)}")
    if settings.get("expandable_segments"):
        parts.append("expandable_segments:True")
    divisions = settings.get("roundup_power2_divisions") or {}
    if isinstance(divisions, dict) and any(int(v) for v in divisions.values()):
        parts.append("roundup_power2_divisions:[" + ",".join(f"{k}:{int(v)}" for k, v in divisions.items()) + "]")
    gc = settings.get("garbage_collection_threshold") or 0.0
    if gc:
        parts.append(f"garbage_collection_threshold:{float(gc)}")
    return ",".join(parts)
