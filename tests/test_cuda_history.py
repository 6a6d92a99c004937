"""The black box on CUDA (devices/cuda_history.py) against a fake of torch's caching allocator that records
what the real one records, as its sources say (c10/cuda/CUDACachingAllocator.cpp and torch/cuda/memory.py,
torch 2.13; the same in 2.2 for what is used here):

- `malloc` rounds a request to a block (`round_size`: 512 B at least, a multiple of 512 B; a cached
  block that is not split keeps its whole size), records an `alloc` trace entry with the size *asked*
  (`orig_size`) and the frames gathered in the calling thread, and adds the block's size to
  `allocated_bytes` (what `memory_allocated` returns);
- `free` takes the block's size off `allocated_bytes` at once and records `free_requested`, then
  `free_completed` once no other stream uses the block;
- an out-of-memory error records an `oom` entry (size asked, `device_free`) with the calling thread's
  frames, then calls each observer `obs(device, alloc_size, total_or_allowed, device_free)` in that same
  thread with the allocator's lock released, then raises;
- the trace is a ring of `alloc_trace_max_entries` that overwrites its oldest entry once full;
- `_snapshot()` returns `segments` (each block: size, requested_size, address, state, frames) and
  `device_traces` (one list of entries per device, oldest first);
- the cudaMallocAsync backend raises RuntimeError from recordHistory, attachOutOfMemoryObserver and
  snapshot (c10/cuda/CUDAMallocAsyncAllocator.cpp).
A stack is gathered from the calling thread only (torch/csrc/profiler/combined_traceback.cpp gathers the
current thread's Python frames): autograd's device thread, which runs no Python, records none.
"""
from __future__ import annotations

import sys
import threading
import time
import types

import pytest

from cuda_magic.devices.recorder import NO_FRAMES
from cuda_magic.memory.blackbox import BEFORE_TEXT, NO_FRAMES_TEXT, blackbox_from

MiB = 1 << 20
TORCH_FILE = "/usr/lib/python3/site-packages/torch/nn/modules/module.py"
AUTOGRAD_FILE = "/usr/lib/python3/site-packages/torch/autograd/__init__.py"


class OutOfMemoryError(RuntimeError):
    pass


def here(depth: int = 1) -> list[dict]:
    """The calling thread's Python frames, innermost first, as torch gathers them (filename, line, name)."""
    out, frame = [], sys._getframe(depth)
    while frame is not None:
        out.append({"filename": frame.f_code.co_filename, "line": frame.f_lineno, "name": frame.f_code.co_name})
        frame = frame.f_back
    return out


class FakeAllocator:
    """torch's native caching allocator on one device, as far as its history, counters and observers go."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.blocks: dict[int, dict] = {}       # address -> block dict, as in a snapshot's segments
        self.allocated = 0                      # allocated_bytes: block sizes
        self.trace: list[dict] = []
        self.max_entries = None                 # None: not recording
        self.next_addr = 0x7F0000000000
        self.observers = []
        self.lock = threading.Lock()

    def _record(self, entry):
        if self.max_entries is None:
            return
        entry["time_us"] = time.time() * 1e6
        self.trace.append(entry)
        if len(self.trace) > self.max_entries:  # the ring: the oldest entry is overwritten
            del self.trace[0]

    def malloc(self, requested: int, frames=None, *, unsplit_extra: int = 0) -> int:
        size = max(512, -(-requested // 512) * 512) + unsplit_extra
        if self.allocated + size > self.capacity:
            self.oom(requested, frames)
        addr = self.next_addr
        self.next_addr += size
        frames = here(2) if frames is None else frames
        self.blocks[addr] = {"address": addr, "size": size, "requested_size": requested, "state": "active_allocated",
                             "frames": frames}
        self.allocated += size
        self._record({"action": "alloc", "addr": addr, "size": requested, "stream": 0, "frames": frames})
        return addr

    def free(self, addr: int) -> None:
        block = self.blocks.pop(addr)
        self.allocated -= block["size"]
        self._record({"action": "free_requested", "addr": addr, "size": block["requested_size"], "stream": 0,
                      "frames": []})
        self._record({"action": "free_completed", "addr": addr, "size": block["requested_size"], "stream": 0,
                      "frames": []})

    def oom(self, requested: int, frames=None):
        free = self.capacity - self.allocated
        self._record({"action": "oom", "size": requested, "stream": 0, "device_free": free,
                      "frames": here(3) if frames is None else frames})
        for observer in list(self.observers):
            observer(0, requested, self.capacity, free)
        raise OutOfMemoryError(f"CUDA out of memory. Tried to allocate {requested} bytes.")

    def snapshot(self) -> dict:
        return {"segments": [{"device": 0, "blocks": [dict(b) for b in self.blocks.values()]}],
                "device_traces": [[dict(e) for e in self.trace]]}


def fake_torch(allocator: FakeAllocator, *, backend: str = "native"):
    """The surface of torch that devices/cuda_history.py uses, over the fake allocator."""
    refuses = backend != "native"

    def record_memory_history(enabled="all", context="all", stacks="all", max_entries=sys.maxsize, device=None,
                              clear_history=False):
        if refuses:
            raise RuntimeError(f"{backend} does not yet support recordHistory. If you need it, please file an "
                               "issue describing your use case.")
        allocator.max_entries = None if enabled is None else max_entries

    def snapshot(device=None):
        if refuses:
            raise RuntimeError(f"Calling snapshot with backend:{backend} is not meaningful.")
        return allocator.snapshot()

    def attach(observer):
        if refuses:
            raise RuntimeError(f"{backend} does not yet support attachOutOfMemoryObserver.")
        allocator.observers.append(observer)

    memory = types.SimpleNamespace(_record_memory_history=record_memory_history, _snapshot=snapshot)
    cuda = types.SimpleNamespace(memory=memory, memory_allocated=lambda index=None: allocator.allocated,
                                 is_initialized=lambda: True, get_allocator_backend=lambda: backend)
    real = sys.modules["torch"]
    return types.SimpleNamespace(
        cuda=cuda, is_grad_enabled=real.is_grad_enabled, is_inference_mode_enabled=real.is_inference_mode_enabled,
        _C=types.SimpleNamespace(_cuda_isHistoryEnabled=lambda: allocator.max_entries is not None,
                                 _cuda_attach_out_of_memory_observer=attach, _cuda_record_memory_history=True))


@pytest.fixture
def history_module(monkeypatch, torch_warm):
    from cuda_magic.devices import cuda_history

    monkeypatch.setattr(cuda_history, "_observer_attached", False)
    monkeypatch.setattr(cuda_history, "_active", None)
    return cuda_history


def guarded(history_module, allocator, body, *, cell="<cell-cuda-1>", max_entries=100_000):
    """Run `body()` as a guarded run's CUDA history sees it: start, the attempt, failed() in the except
    block while the frames are alive, a release of what the failure held, stop()."""
    history = history_module.CudaHistory(fake_torch(allocator), 0, cell_filename=cell, max_entries=max_entries)
    assert history.start()
    history.begin_attempt(0)
    failed = None
    try:
        body()
    except OutOfMemoryError as exc:
        history.failed()
        history.pause()
        failed = exc
    else:
        history.pause()
    return history, failed


def cell_frames(cell: str, line: int, *inner):
    return [*inner, {"filename": TORCH_FILE, "line": 1500, "name": "_call_impl"},
            {"filename": cell, "line": line, "name": "<module>"}]


def test_alive_at_the_failure_is_the_allocators_blocks_and_adds_up_to_memory_allocated(history_module):
    cell = "<cell-cuda-1>"
    allocator = FakeAllocator(64 * MiB)
    early = allocator.malloc(3 * MiB + 100, cell_frames("<earlier cell>", 1))     # before the run
    kept = {}

    def body():
        kept["x"] = allocator.malloc(8 * MiB + 1, cell_frames(cell, 2))
        kept["y"] = allocator.malloc(16 * MiB, cell_frames(cell, 3, {"filename": "/home/u/model.py", "line": 42,
                                                                    "name": "forward"}))
        tmp = allocator.malloc(2 * MiB, cell_frames(cell, 3))
        allocator.free(tmp)
        allocator.malloc(48 * MiB, cell_frames(cell, 3, {"filename": "/home/u/model.py", "line": 43, "name": "forward"}))

    history, failed = guarded(history_module, allocator, body, cell=cell)
    allocated_at_failure = allocator.allocated
    allocator.free(kept.pop("y"))            # the release after the failure: not the run's
    rec = history.stop()
    box = blackbox_from(rec, device="cuda:0", capacity=64 * MiB)
    assert failed is not None and box.failure.requested == 48 * MiB
    # exact: block sizes (what memory_allocated counts, rounded to 512 B), and the message's figure
    assert box.total == allocated_at_failure == box.failure.allocated
    rows = {u.where: u for u in box.by_line}
    assert rows["cell line 2"].bytes == 8 * MiB + 512
    assert rows["model.py:42"].bytes == 16 * MiB and rows["model.py:42"].cell_line == 3
    before = next(u for u in box.by_line if u.code == BEFORE_TEXT)
    assert before.bytes == 3 * MiB + 512
    assert box.failure.site.where == "model.py:43"
    # the release's free came after the pause: it is not a point of the run's timeline
    assert box.points[-1][1] == allocated_at_failure
    assert early in allocator.blocks


def test_a_ring_that_dropped_its_oldest_entries_still_gives_the_exact_figures(history_module):
    """Tens of thousands of small alloc/free pairs overflow a small ring; the level replayed forward from
    the run's start would subtract frees of allocations it never saw (a long cell read -54 MiB where the
    truth was 1034 MiB). Anchored at the reading and taken from the live blocks, it is exact."""
    cell = "<cell-cuda-ring>"
    allocator = FakeAllocator(256 * MiB)
    big = {}

    def body():
        big["weights"] = allocator.malloc(100 * MiB, cell_frames(cell, 1))
        for _ in range(5000):
            allocator.free(allocator.malloc(64 * 1024, cell_frames(cell, 2)))
        big["acts"] = allocator.malloc(60 * MiB, cell_frames(cell, 3))
        allocator.malloc(200 * MiB, cell_frames(cell, 4))

    history, failed = guarded(history_module, allocator, body, cell=cell, max_entries=1000)
    at_failure = allocator.allocated
    rec = history.stop()
    box = blackbox_from(rec, device="cuda:0", capacity=256 * MiB)
    assert failed is not None and len(allocator.trace) == 1000
    assert box.failure.allocated == at_failure == 160 * MiB
    assert box.total == at_failure
    rows = {u.where: u.bytes for u in box.by_line}
    # the block made at line 1 has no entry left in the ring: its own frames say where it came from
    assert rows == {"cell line 1": 100 * MiB, "cell line 3": 60 * MiB}
    assert all(level >= 0 for _, level, _, _ in box.points)
    assert any("newest 1000 entries" in n for n in box.notes)


def test_oom_entries_for_errors_torch_caught_itself_are_not_the_failure(history_module):
    """cuDNN's fallbacks (aten/src/ATen/native/cudnn/Conv_v8.cpp) catch OutOfMemoryError and retry with
    less workspace: the allocator has recorded an `oom` entry and called the observers each time."""
    cell = "<cell-cuda-caught>"
    allocator = FakeAllocator(64 * MiB)

    def conv_with_fallbacks(on=allocator):
        for workspace in (60 * MiB, 40 * MiB):
            try:
                on.malloc(workspace, cell_frames(cell, 2))
            except OutOfMemoryError:
                continue                                 # a smaller algorithm next
        on.malloc(8 * MiB, cell_frames(cell, 2))

    def body():
        allocator.malloc(30 * MiB, cell_frames(cell, 1))
        conv_with_fallbacks()
        allocator.malloc(40 * MiB, cell_frames(cell, 3))     # the failure that reaches the guard

    history, failed = guarded(history_module, allocator, body, cell=cell)
    rec = history.stop()
    box = blackbox_from(rec, device="cuda:0", capacity=64 * MiB)
    assert failed is not None and box.failure.requested == 40 * MiB
    assert box.failure.site.where == "cell line 3" and box.failure.allocated == 38 * MiB
    assert {u.where: u.bytes for u in box.by_line} == {"cell line 1": 30 * MiB, "cell line 2": 8 * MiB}
    assert any("caught 2 out-of-memory errors" in n for n in box.notes)
    # a run that fitted after torch caught its own OOMs: shown at its peak, the catches noted
    fitted = FakeAllocator(64 * MiB)
    fitted.malloc(30 * MiB, cell_frames("<earlier>", 1))
    history2, failed2 = guarded(history_module, fitted, lambda: conv_with_fallbacks(fitted), cell=cell)
    box2 = blackbox_from(history2.stop(), device="cuda:0", capacity=64 * MiB, failed=False)
    assert failed2 is None and box2.at == "peak" and box2.failure is None
    assert any("caught 2 out-of-memory errors" in n for n in box2.notes)


def test_an_oom_in_backward_on_autograds_thread_is_a_training_failure_at_the_backward_call(history_module):
    """On CUDA the backward pass runs on autograd's device thread: grad mode is off there and torch
    gathers no Python frame. The observer, called on that thread, reads the run's thread instead, which
    waits in `.backward()`."""
    cell = "<cell-cuda-backward>"
    allocator = FakeAllocator(64 * MiB)
    errors = []

    def device_thread():
        import torch

        with torch.no_grad():                       # the engine runs backward with grad mode off
            try:
                allocator.malloc(20 * MiB, [])      # no Python frame on this thread
                allocator.malloc(40 * MiB, [])
            except OutOfMemoryError as exc:
                errors.append(exc)

    # torch.autograd.backward as it appears in a stack (its file under torch/autograd)
    namespace = {"threading": threading, "device_thread": device_thread, "errors": errors}
    exec(compile("def backward():\n    t = threading.Thread(target=device_thread)\n    t.start()\n    t.join()\n"
                 "    if errors:\n        raise errors[0]\n", AUTOGRAD_FILE, "exec"), namespace)

    def body():
        allocator.malloc(10 * MiB, cell_frames(cell, 1))
        exec(compile("backward()\n", cell, "exec"), namespace)      # cell line 1: loss.backward()

    history, failed = guarded(history_module, allocator, body, cell=cell)
    box = blackbox_from(history.stop(), device="cuda:0", capacity=64 * MiB)
    assert failed is not None and box.failure.requested == 40 * MiB
    assert box.failure.phase == "backward" and box.failure.grad_enabled is True
    assert box.failure.site.where == "cell line 1"               # the backward() call, from the run's thread
    rows = {u.code: u.bytes for u in box.by_line}
    assert rows[NO_FRAMES_TEXT] == 20 * MiB                      # not "allocated before the run"
    assert next(u for u in box.by_line if u.code == NO_FRAMES_TEXT).filename == NO_FRAMES


def test_an_oom_in_backward_on_the_runs_own_thread_is_a_backward_failure(history_module):
    """Part of a backward pass runs on the calling thread (torch/autograd/__init__.py `backward` makes the
    root's gradient with `_make_grads` there; the engine runs CPU nodes there): the observer, called on
    that thread under torch.autograd.backward's frames, says backward as it does for the device thread."""
    cell = "<cell-cuda-backward-here>"
    allocator = FakeAllocator(64 * MiB)
    namespace = {"allocator": allocator, "MiB": MiB}
    exec(compile("def backward():\n    allocator.malloc(80 * MiB, [])\n", AUTOGRAD_FILE, "exec"), namespace)

    def body():
        allocator.malloc(10 * MiB, cell_frames(cell, 1))
        exec(compile("backward()\n", cell, "exec"), namespace)      # cell line 1: loss.backward()

    history, failed = guarded(history_module, allocator, body, cell=cell)
    box = blackbox_from(history.stop(), device="cuda:0", capacity=64 * MiB)
    assert failed is not None and box.failure.requested == 80 * MiB
    assert box.failure.phase == "backward" and box.failure.grad_enabled is True


def test_a_snapshot_whose_blocks_disagree_with_the_trace_is_believed(history_module):
    """A large block that was not split keeps more than the request (the trace says 1.5 MiB asked; the
    block is 2.5 MiB) and a block made before the run is in no entry: the live blocks are the truth."""
    cell = "<cell-cuda-blocks>"
    allocator = FakeAllocator(16 * MiB)
    allocator.malloc(1 * MiB, cell_frames("<earlier>", 1))

    def body():
        allocator.malloc(3 * MiB // 2, cell_frames(cell, 1), unsplit_extra=1 * MiB)
        allocator.malloc(20 * MiB, cell_frames(cell, 2))

    history, failed = guarded(history_module, allocator, body, cell=cell)
    box = blackbox_from(history.stop(), device="cuda:0", capacity=16 * MiB)
    rows = {u.where or u.code: u.bytes for u in box.by_line}
    assert rows["cell line 1"] == 5 * MiB // 2 and rows[BEFORE_TEXT] == 1 * MiB
    assert box.total == box.failure.allocated == 7 * MiB // 2


def test_an_allocator_that_keeps_no_history_leaves_the_run_without_a_black_box(history_module):
    allocator = FakeAllocator(16 * MiB)
    torch = fake_torch(allocator, backend="cudaMallocAsync")
    note = history_module.history_support(torch)
    assert note == history_module.NOTE_BACKEND.format(backend="cudaMallocAsync") and "\n" not in note
    history = history_module.CudaHistory(torch, 0)
    assert not history.start() and history.notes == [note] and history.stop() is None
    # a backend that says native yet refuses (a pluggable allocator): one line, no traceback
    refusing = fake_torch(allocator, backend="pluggable")
    refusing.cuda.get_allocator_backend = lambda: "native"
    history = history_module.CudaHistory(refusing, 0)
    assert not history.start()
    assert len(history.notes) == 1 and history.notes[0].startswith("no black box: torch's allocator refused")


def test_a_guarded_run_on_a_refusing_allocator_runs_and_says_so_once(history_module, monkeypatch):
    """The guard itself (recover/guarded.py) around a call on CUDA with `backend:cudaMallocAsync`: the call
    runs, its value comes back, and the black box is one note."""
    from cuda_magic.devices.meter import Meter
    from cuda_magic.recover import guarded

    allocator = FakeAllocator(16 * MiB)
    fake = fake_torch(allocator, backend="cudaMallocAsync")

    class FakeCudaMeter(Meter):
        key, device_type, index = "cuda:0", "cuda", 0
        allocated = reserved = peak = staticmethod(lambda: allocator.allocated)
        capacity = staticmethod(lambda: allocator.capacity)
        reset_peak = staticmethod(lambda: None)

        def running(self, limit=None):
            from contextlib import nullcontext
            return nullcontext()

    real = sys.modules["torch"]
    monkeypatch.setattr(guarded, "metered_devices", lambda meter: [])
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(**{**vars(fake), "__name__": "torch"}))
    try:
        result = guarded.GuardedRun(FakeCudaMeter(), guarded.GuardOptions(timeline=True)).run(lambda: 42)
    finally:
        sys.modules["torch"] = real
    assert result.value == 42 and result.error is None and result.report.outcome == "ok"
    assert result.report.blackbox.notes == [history_module.NOTE_BACKEND.format(backend="cudaMallocAsync")]


def test_the_users_own_recording_is_kept_and_read(history_module):
    allocator = FakeAllocator(16 * MiB)
    allocator.max_entries = 5000                      # the user switched history on before the run
    allocator.malloc(1 * MiB, cell_frames("<earlier>", 1))
    history = history_module.CudaHistory(fake_torch(allocator), 0, cell_filename="<c>")
    assert history.start() and history.user_recording
    history.begin_attempt(0)
    allocator.malloc(2 * MiB, cell_frames("<c>", 1))
    history.pause()
    rec = history.stop()
    assert allocator.max_entries == 5000              # still on, as the user set it
    box = blackbox_from(rec, device="cuda:0", capacity=16 * MiB, failed=False)
    assert {u.where or u.code: u.bytes for u in box.by_line} == {"cell line 1": 2 * MiB, BEFORE_TEXT: 1 * MiB}


def test_cuda_history_never_starts_cuda(history_module):
    torch = fake_torch(FakeAllocator(MiB))
    torch.cuda.is_initialized = lambda: False
    history = history_module.CudaHistory(torch, 0)
    assert not history.start() and history.notes == [history_module.NOTE_NOT_STARTED]


def test_a_torch_without_the_history_is_a_note(history_module):
    old = types.SimpleNamespace(cuda=types.SimpleNamespace(memory=types.SimpleNamespace()), _C=types.SimpleNamespace())
    history = history_module.CudaHistory(old, 0)
    assert not history.start() and history.notes == [history_module.NOTE_UNAVAILABLE] and history.stop() is None
    # torch 2.0's boolean-only form is not enough either
    legacy = types.SimpleNamespace(cuda=types.SimpleNamespace(memory=types.SimpleNamespace(
        _record_memory_history=lambda enabled, record_context=True, trace_alloc_max_entries=1: None,
        _snapshot=lambda: {})), _C=types.SimpleNamespace())
    assert history_module.history_support(legacy) == history_module.NOTE_UNAVAILABLE


def test_one_observer_is_attached_per_process(history_module):
    allocator = FakeAllocator(16 * MiB)
    for _ in range(2):
        history = history_module.CudaHistory(fake_torch(allocator), 0)
        assert history.start()
        history.stop()
    assert len(allocator.observers) == 1
    allocator.observers[0](0, 1, 0, 0)               # no history active: the observer does nothing
