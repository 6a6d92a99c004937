"""`%gpumem --snapshot FILE` and `cuda_magic.read_snapshot`: a GPU's own record read, explained and replayed.

Real recordings (../shared/gpu_traces, skipped where absent) and small recordings built here in the
layout torch writes: `torch.cuda.memory._snapshot()` (torch/cuda/memory.py, torch 2.6) returns
{"segments", "device_traces", "allocator_settings"}; the trace entries are `TraceEntry`s
(c10/cuda/CUDACachingAllocator.h: action alloc / free_requested / free_completed / segment_alloc /
segment_free / oom, addr, size, stream, time_us, frames); an `oom` entry's addr is the device's free
memory (`record_trace(TraceEntry::OOM, device_free, ...)` in CUDACachingAllocator.cpp). With
`stacks="all"` each entry's frames are what torch/csrc/cuda/memory_snapshot.cpp (`gather_with_cpp`,
symbolized by `_memory_snapshot_pickled`, torch 2.6) writes: the C++ frames of the unwinder and the
allocator first ('??', memory_snapshot.cpp, CUDACachingAllocator.cpp), the Python frames among them.
"""
from __future__ import annotations

import gzip
import pickle

import pytest
from gpu_traces import need_traces, trace_files
from IPython.core.error import UsageError

MiB = 1 << 20
GiB = 1 << 30
A = 0x7F00_0000_0000          # addresses of the small recordings' segments
B = 0x7F00_4000_0000
C = 0x7F00_8000_0000
D = 0x7F00_C000_0000
E = 0x7F01_0000_0000


def cpp(*names):
    """C++ frames as memory_snapshot.cpp symbolizes them (stacks="all")."""
    head = [{"name": "torch::unwind::unwind()", "filename": "??", "line": 0},
            {"name": "torch::CapturedTraceback::gather(bool, bool, bool)", "filename": "??", "line": 0},
            {"name": "torch::cuda::(anonymous namespace)::gather_with_cpp()", "filename": "memory_snapshot.cpp",
             "line": 0}]
    return head + [{"name": n, "filename": "CUDACachingAllocator.cpp", "line": 0} for n in names]


def py(line, name="train", filename="/home/me/train.py"):
    return {"filename": filename, "line": line, "name": name}


def entry(action, addr, size, t, frames=(), stream=0):
    return {"action": action, "addr": addr, "size": size, "stream": stream, "time_us": 1_000_000 + t,
            "frames": list(frames)}


def alloc_frames(line, name="train"):
    return cpp("c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(signed char, unsigned long, CUstream_st*)") + [
        {"name": "PyNumber_Add", "filename": "??", "line": 0}, py(line, name)]


EMPTY_CACHE = cpp("c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::emptyCache()") + [
    {"name": "empty_cache", "filename": "/usr/lib/python3/site-packages/torch/cuda/memory.py", "line": 218},
    py(40)]
BACKWARD = cpp("c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(signed char, unsigned long, CUstream_st*)",
               "torch::autograd::Engine::thread_main(std::shared_ptr<torch::autograd::GraphTask> const&)")


def streams_recording() -> dict:
    """A block used on another stream (freed when asked, reusable only when completed), and
    empty_cache(): the model must not hand block A out again before its free_completed."""
    trace = [
        entry("segment_alloc", A, 20 * MiB, 1, alloc_frames(10)),
        entry("alloc", A, 4 * MiB, 2, alloc_frames(10)),
        entry("alloc", A + 4 * MiB, 4 * MiB, 3, alloc_frames(11)),
        entry("free_requested", A, 4 * MiB, 4, stream=7),
        entry("alloc", A + 8 * MiB, 4 * MiB, 5, alloc_frames(12)),       # A is not free yet
        entry("free_completed", A, 4 * MiB, 6, stream=7),
        entry("free_requested", A + 4 * MiB, 4 * MiB, 7), entry("free_completed", A + 4 * MiB, 4 * MiB, 8),
        entry("free_requested", A + 8 * MiB, 4 * MiB, 9), entry("free_completed", A + 8 * MiB, 4 * MiB, 10),
        entry("segment_free", A, 20 * MiB, 11, EMPTY_CACHE),
        entry("segment_alloc", B, 2 * MiB, 12, alloc_frames(20)),
        entry("alloc", B, 1000, 13, alloc_frames(20)),
        entry("alloc", B + 1024, 3000, 14, BACKWARD),
    ]
    segments = [{"device": 0, "address": B, "total_size": 2 * MiB, "allocated_size": 4096, "active_size": 4096,
                 "requested_size": 4000, "stream": 0, "segment_type": "small", "segment_pool_id": (0, 0),
                 "is_expandable": False, "frames": alloc_frames(20),
                 "blocks": [{"address": B, "size": 1024, "requested_size": 1000, "state": "active_allocated",
                             "frames": alloc_frames(20)},
                            {"address": B + 1024, "size": 3072, "requested_size": 3000,
                             "state": "active_allocated", "frames": BACKWARD},
                            {"address": B + 4096, "size": 2 * MiB - 4096, "requested_size": 0, "state": "inactive",
                             "frames": []}]}]
    return {"segments": segments, "device_traces": [trace],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "expandable_segments": False,
                                   "garbage_collection_threshold": 0.0, "roundup_power2_divisions": {}}}


def oom_recording() -> dict:
    """Before the recording: a cached 40 MiB segment C and an 8 MiB block in segment D. The allocator
    runs out reserving 60 MiB, releases C (segment_free from malloc's out-of-memory path) and retries;
    then a 100 MiB request fails (an `oom` entry: device_free 10 MiB)."""
    retry = cpp("c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::release_cached_blocks()",
                "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(signed char, unsigned long, CUstream_st*)") + [py(30)]
    trace = [
        entry("segment_free", C, 40 * MiB, 1, retry),
        entry("segment_alloc", E, 60 * MiB, 2, alloc_frames(30)),
        entry("alloc", E, 60 * MiB, 3, alloc_frames(30)),
        entry("oom", 10 * MiB, 100 * MiB, 4, alloc_frames(31, "step")),
    ]
    segments = [
        {"device": 0, "address": D, "total_size": 20 * MiB, "segment_type": "large", "stream": 0,
         "is_expandable": False, "blocks": [
             {"address": D, "size": 8 * MiB, "requested_size": 8 * MiB, "state": "active_allocated",
              "frames": alloc_frames(5, "<module>")},
             {"address": D + 8 * MiB, "size": 12 * MiB, "requested_size": 0, "state": "inactive", "frames": []}]},
        {"device": 0, "address": E, "total_size": 60 * MiB, "segment_type": "large", "stream": 0,
         "is_expandable": False, "blocks": [
             {"address": E, "size": 60 * MiB, "requested_size": 60 * MiB, "state": "active_allocated",
              "frames": alloc_frames(30)}]}]
    return {"segments": segments, "device_traces": [trace]}


# ---- small recordings --------------------------------------------------------------------------------

def test_a_block_used_on_another_stream_is_reused_only_after_free_completed():
    from cuda_magic.devices.snapshot_load import recording_of
    from cuda_magic.devices.snapshot_replay import replay

    rec = recording_of(streams_recording())
    result = replay(rec)
    assert result.segments_match, (result.segment_events, result.recorded_segment_events)
    assert result.address_mismatches == 0          # the third 4 MiB went to A + 8 MiB, not to A
    # memory_allocated drops at free_requested (entry 3), the block is reusable at free_completed
    assert result.allocated[3] == 4 * MiB and result.allocated[4] == 8 * MiB
    assert result.peak_allocated == 8 * MiB and result.peak_allocated_at == 2
    # empty_cache() released the 20 MiB segment: reserved went back to the small segment only
    assert result.reserved[10] == 0 and result.reserved[-1] == 2 * MiB


def test_a_replay_that_treated_free_requested_as_free_would_have_moved_the_block():
    """The check above can fail: freeing at free_requested hands A out again (another address)."""
    from cuda_magic.devices.snapshot_load import recording_of
    from cuda_magic.devices.snapshot_replay import replay

    data = streams_recording()
    trace = data["device_traces"][0]
    # the same recording if the block had been free at once (its free_completed moved up)
    moved = [trace[0], trace[1], trace[2], trace[3], trace[5], trace[4]] + trace[6:]
    assert replay(recording_of(data)).address_mismatches == 0
    assert replay(recording_of({**data, "device_traces": [moved]})).address_mismatches == 1


def test_reading_names_user_lines_not_cpp_frames_and_the_backward_thread():
    from cuda_magic import read_snapshot

    reading = read_snapshot(streams_recording())
    wheres = {u.where for u in reading.by_line_end}
    assert "train.py:20" in wheres
    assert not any("memory_snapshot.cpp" in w or "CUDACachingAllocator" in w for w in wheres)
    assert any(u.code == "(backward pass)" for u in reading.by_line_end)
    assert reading.peak_allocated == 8 * MiB
    assert reading.peak_allocated_line.where == "train.py:11"
    assert reading.by_kind_end == {"gradients": 3072, "other": 1024}


def test_oom_retry_and_oom_entry_replayed_and_explained():
    from cuda_magic import read_snapshot
    from cuda_magic.devices.snapshot_load import recording_of
    from cuda_magic.devices.snapshot_replay import replay, start_state

    rec = recording_of(oom_recording())
    start = {s["address"]: s["total_size"] for s in start_state(rec)}
    assert start == {C: 40 * MiB, D: 20 * MiB}          # rewound: C was there, E was not
    assert replay(rec).segments_match
    reading = read_snapshot(oom_recording())
    assert reading.oom.line.where == "train.py:31" and reading.oom.requested == 100 * MiB
    assert reading.oom.allocated == 68 * MiB
    rows = {u.where or u.code: u.bytes for u in reading.oom_by_line}
    assert rows == {"train.py:30": 60 * MiB, "(allocated before the recording)": 8 * MiB}
    assert reading.diagnosis is not None and reading.diagnosis.summary
    # what if: on 80 MiB the allocator's own retry releases C and the 60 MiB fits; the 100 MiB does not
    w = reading.replay(80 * MiB)
    assert not w.fits and w.failure.line.where == "train.py:31" and w.failure.requested == 100 * MiB
    assert w.failure.reserved == 80 * MiB
    # on 70 MiB even the 60 MiB request runs out: reserved after releasing C is 20 MiB, + 60 > 70
    w = reading.replay("70MiB")
    assert w.failure.line.where == "train.py:30" and w.failure.reserved == 20 * MiB
    assert reading.replay(200 * MiB).fits
    assert reading.smallest_capacity == 180 * MiB          # 20 + 60 + 100: found by the bisection
    assert reading.replay(180 * MiB).fits and not reading.replay(178 * MiB).fits


def test_garbage_collection_threshold_releases_old_cached_segments_with_a_capacity():
    """garbage_collection_threshold acts only with a memory fraction (here: --capacity): above the
    threshold, cached whole segments at least as old as the average are released before reserving."""
    from cuda_magic.devices.caching_allocator import CachingAllocatorModel

    def run(threshold, allowed):
        m = CachingAllocatorModel(100 * MiB)
        m.garbage_collection_threshold, m.gc_allowed_maximum = threshold, allowed
        blocks = [m.malloc(30 * MiB) for _ in range(2)]
        for b in blocks:
            m.free(b)
        m.malloc(40 * MiB)              # no cached block fits: GC first where it acts
        return m.reserved

    assert run(0.0, 100 * MiB) == 100 * MiB       # no GC: 60 cached + 40 new
    assert run(0.5, None) == 100 * MiB            # no memory fraction: no GC
    assert run(0.5, 100 * MiB) == 40 * MiB        # 60 reserved > 50: both old segments released


def test_conf_is_laid_over_the_recorded_settings_as_torchs_setter_does():
    from cuda_magic import read_snapshot

    reading = read_snapshot(oom_recording())
    w = reading.replay(None, "expandable_segments:True")
    assert "expandable_segments:True" in w.settings and w.fits
    assert any("before the recording" in n for n in w.notes)
    with pytest.raises(ValueError):
        reading.replay(None, "max_split_size_mb:5")


def test_state_only_dump_shows_the_state_and_says_the_replay_needs_history():
    from cuda_magic import SnapshotError, read_snapshot

    data = oom_recording()
    data["device_traces"] = [[]]
    reading = read_snapshot(data)
    assert not reading.has_trace and reading.end_allocated == 68 * MiB
    assert "history" in repr(reading)
    with pytest.raises(SnapshotError, match="history"):
        reading.replay(GiB)


def test_torch_2_0_blocks_with_history_are_read():
    """torch 2.0 wrote a block's stack in its `history` and no block address."""
    from cuda_magic import read_snapshot

    data = {"segments": [{"device": 0, "address": D, "total_size": 20 * MiB, "segment_type": "large", "blocks": [
        {"size": 8 * MiB, "state": "active_allocated",
         "history": [{"addr": D, "real_size": 8 * MiB, "frames": [py(7, "load")]}]},
        {"size": 12 * MiB, "state": "inactive", "history": []}]}], "device_traces": [[]]}
    reading = read_snapshot(data)
    assert [(u.where, u.bytes) for u in reading.by_line] == [("train.py:7", 8 * MiB)]


def test_several_devices_default_to_the_one_that_held_most(tmp_path):
    from cuda_magic import SnapshotError, read_snapshot

    one = oom_recording()
    two = streams_recording()
    for s in two["segments"]:
        s["device"] = 1
    data = {"segments": one["segments"] + two["segments"], "device_traces": [one["device_traces"][0],
                                                                             two["device_traces"][0]]}
    assert read_snapshot(data).device == 0
    assert read_snapshot(data, device=1).peak_allocated == 8 * MiB
    with pytest.raises(SnapshotError, match="no device 3"):
        read_snapshot(data, device=3)


# ---- safe to open ----------------------------------------------------------------------------------

class Touch:
    """A pickle that, when loaded, would create a file (what any `__reduce__` can do)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.path),))


@pytest.mark.parametrize("gz", [False, True])
def test_malicious_pickle_refused_and_nothing_runs(ip, tmp_path, gz):
    from cuda_magic import SnapshotError, read_snapshot

    marker = tmp_path / "ran"
    data = pickle.dumps({"segments": [], "device_traces": [], "x": Touch(str(marker))})
    pickle.loads(data)                      # the payload works: loading it plainly runs it
    assert marker.exists()
    marker.unlink()
    path = tmp_path / ("evil.pickle.gz" if gz else "evil.pickle")
    path.write_bytes(gzip.compress(data) if gz else data)
    with pytest.raises(UsageError) as err:
        ip.run_line_magic("gpumem", f"--snapshot {path}")
    assert "\n" not in str(err.value) and "pathlib" in str(err.value)
    with pytest.raises(SnapshotError):
        read_snapshot(str(path))
    assert not marker.exists()


def test_not_a_snapshot_and_bad_flags_are_one_line_usage_errors(ip, tmp_path):
    plain = tmp_path / "list.pickle"
    plain.write_bytes(pickle.dumps([1, 2, 3]))
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    good = tmp_path / "good.pickle"
    good.write_bytes(pickle.dumps(oom_recording()))
    for line in (f"--snapshot {plain}", f"--snapshot {text}", f"--snapshot {tmp_path / 'missing.pickle'}",
                 f"--snapshot {good} --capacity lots", f"--snapshot {good} --conf max_split_size_mb:5",
                 f"--snapshot {good} --conf nonsense_option:1", "--capacity 48GiB", f"--snapshot {good} --diff",
                 f"--snapshot {good} -d 4"):
        with pytest.raises(UsageError) as err:
            ip.run_line_magic("gpumem", line)
        assert "\n" not in str(err.value), line


def test_magic_shows_the_answer_first_and_the_what_if(ip, tmp_path, capsys):
    good = tmp_path / "oom.pickle.gz"
    good.write_bytes(gzip.compress(pickle.dumps(oom_recording())))
    capsys.readouterr()
    reading = ip.run_line_magic("gpumem", f"--snapshot {good} --capacity 80MiB -o")
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[1].startswith("Peak allocated 68.00 MiB")
    assert "runs out at train.py:31 (step), asking for 100.00 MiB" in out
    assert reading.what_ifs[0].failure.line.where == "train.py:31"
    html = reading._repr_html_()
    assert "<svg" in html and "<script" not in html


# ---- the live path reads a stacks="all" history (issue 38, finding 3) -------------------------------

def test_live_history_of_a_stacks_all_recording_names_user_lines():
    from cuda_magic.devices.cuda_history import Reading, replay
    from cuda_magic.devices.recorder import BACKWARD_THREAD

    data = streams_recording()
    recorder = replay(Reading(data, 4096, float("inf")), 0, start_us=0, max_entries=None)
    files = {recorder.sites[s][0] for s in recorder.by_site}
    assert "/home/me/train.py" in files and BACKWARD_THREAD in files
    assert not any(f and f.endswith(".cpp") for f, *_ in recorder.sites)


# ---- real recordings --------------------------------------------------------------------------------

def _real(name):
    return need_traces() / name


def test_every_real_recording_with_a_trace_replays_exactly_at_its_recorded_settings():
    """Every segment reserved and released where the real allocator did it (same address, same size, same
    order), every block at its recorded address, the peak reserved and the end state equal to the
    recording's."""
    from cuda_magic.devices.snapshot_load import read_snapshot_data, recording_of
    from cuda_magic.devices.snapshot_replay import replay

    need_traces()
    checked = 0
    for path in trace_files():
        rec = recording_of(read_snapshot_data(str(path)))
        if not rec.has_trace:
            continue
        result = replay(rec)
        assert result.segment_events == result.recorded_segment_events, path.name
        assert result.address_mismatches == 0, path.name
        level = peak = result.start_reserved
        for e in rec.trace:
            if e["action"] in ("segment_alloc", "segment_free"):
                level += e["size"] if e["action"] == "segment_alloc" else -e["size"]
                peak = max(peak, level)
        assert result.peak_reserved == peak, path.name
        assert result.reserved[-1] == sum(s["total_size"] for s in rec.segments), path.name
        assert result.allocated[-1] == sum(b["size"] for s in rec.segments for b in s["blocks"]
                                           if b["state"] == "active_allocated"), path.name
        checked += 1
    assert checked == 14


def test_live_path_on_a_real_stacks_all_file_attributes_no_allocation_to_cpp():
    """Issue 39's finding: all 2,058 allocations of cs336_ctx128_fwd went to memory_snapshot.cpp:0."""
    from cuda_magic.devices.cuda_history import Reading, replay
    from cuda_magic.devices.snapshot_load import read_snapshot_data

    data = read_snapshot_data(str(_real("cs336_ctx128_fwd.pickle.gz")))
    sites = {}
    replay(Reading(data, 0, float("inf")), 0, start_us=None, max_entries=None, sites=sites)
    recorder = replay(Reading(data, 0, float("inf")), 0, start_us=None, max_entries=None)
    assert len(sites) == 2058
    files = {recorder.sites[s][0] for s in set(sites.values())}
    assert not any(str(f).endswith(".cpp") for f in files)
    assert any(str(f).endswith("cs336_basics/transformer.py") for f in files)


def test_magic_on_a_cs336_step_file_names_its_lines_and_where_48gib_runs_out(ip, capsys):
    path = _real("cs336_ctx128_step.pickle.gz")
    capsys.readouterr()
    reading = ip.run_line_magic("gpumem", f"--snapshot {path} --capacity 48GiB -o")
    out = capsys.readouterr().out
    # the step's peak is in its own AdamW step (cs336_basics/optimizers.py), the model's lines below it
    assert "Peak allocated 51.30 GiB" in out and "asked for by optimizers.py:100 (step)" in out
    assert reading.peak_reserved == 61_111_009_280 and reading.peak_reserved_line.where == "optimizers.py:100"
    assert any(u.where == "transformer.py:22" for u in reading.by_line)
    assert "transformer.py:22 (forward)" in out
    w = reading.what_ifs[0]
    assert not w.fits and w.failure.line.where == "optimizers.py:100" and w.failure.requested == 100 * MiB
    assert "On 48.00 GiB with torch defaults: runs out at optimizers.py:100 (step), asking for 100.00 MiB" in out
    assert "memory_snapshot.cpp" not in out
    # the one path: the black box's recorder and the allocator's replay agree on the peak
    assert reading.peak_allocated == max(a for _, a, _ in reading.timeline)


def test_magic_on_a_cs336_forward_file_names_a_transformer_line_as_the_peaks(ip, capsys):
    capsys.readouterr()
    ip.run_line_magic("gpumem", f"--snapshot {_real('cs336_ctx512_fwd.pickle.gz')}")
    out = capsys.readouterr().out
    assert "asked for by transformer.py:22 (forward)" in out.splitlines()[1]
    assert "Smallest capacity that fits: " in out and "with expandable_segments:True" in out


def test_smallest_capacity_of_a_real_recording_fits_and_2_mib_less_does_not():
    from cuda_magic import read_snapshot

    reading = read_snapshot(str(_real("ftcourse.pickle.gz")))
    for conf in ("", "expandable_segments:True"):
        smallest = reading.replay(None, conf).smallest_capacity
        assert smallest % (2 * MiB) == 0
        assert reading.replay(smallest, conf).fits
        below = reading.replay(smallest - 2 * MiB, conf)
        assert not below.fits and below.failure.line is not None


def test_a_peak_reserved_from_before_the_recording_is_not_given_a_line():
    """cs336_ctx256_step begins with the cache of the runs before it (56.91 GiB) and empties it: the
    recording itself reserves at most 56.83 GiB, at optimizers.py:100."""
    from cuda_magic import read_snapshot

    reading = read_snapshot(str(_real("cs336_ctx256_step.pickle.gz")))
    assert reading.peak_reserved_line is None and reading.peak_reserved_seconds == 0.0
    assert any("56.83 GiB, asked for by optimizers.py:100" in n for n in reading.notes)
    assert "when the recording began" in repr(reading)


def test_real_forward_file_peak_line_and_kinds():
    from cuda_magic import read_snapshot

    reading = read_snapshot(str(_real("cs336_ctx128_fwd.pickle.gz")))
    assert reading.peak_allocated_line.where == "transformer.py:22"
    assert set(reading.by_kind) == {"activations", "before the recording"}
    assert reading.smallest_capacity <= reading.peak_reserved


def test_real_state_only_file():
    from cuda_magic import read_snapshot

    reading = read_snapshot(str(_real("oom_yiyi.pickle.gz")))
    assert not reading.has_trace and reading.era == "torch 2.0"
    assert reading.by_line[0].where == "pytorch_backend.py:190"


def test_rows_quiet_and_the_widget_form(ip, tmp_path, capsys):
    from cuda_magic.display.snapshot_view import forms

    good = tmp_path / "streams.pickle"
    good.write_bytes(pickle.dumps(streams_recording()))
    capsys.readouterr()
    reading = ip.run_line_magic("gpumem", f"--snapshot {good} -n 1 -q -o")
    assert capsys.readouterr().out == ""
    assert reading.rows == 1
    text = repr(reading)
    assert "1 more lines" in text                 # the end's two rows shown as one and the rest summed
    _, html, widget = forms(reading)
    bundle = widget().bundle()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/plain"] == text and "<svg" in bundle["text/html"] and "<svg" in html()


def test_torch_era_from_the_frames():
    """module.py's `_call_impl` line: 1520 in torch 2.2 (the floor's own source), 1527 in 2.1."""
    from cuda_magic import read_snapshot

    assert read_snapshot(str(_real("eor.pickle.gz"))).era == "torch 2.2 (going by its frames)"
    assert read_snapshot(str(_real("ftcourse.pickle.gz"))).era == "torch 2.1 (going by its frames)"


def test_an_expandable_segments_recording_says_what_is_not_compared():
    from cuda_magic import read_snapshot

    data = streams_recording()
    data["device_traces"][0].insert(1, entry("segment_map", A, 20 * MiB, 1))
    reading = read_snapshot(data)
    assert reading.segments_match is None and any("expandable" in n for n in reading.notes)
    assert read_snapshot(streams_recording()).segments_match is True
