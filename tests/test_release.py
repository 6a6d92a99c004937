"""The release machinery against a real IPython shell and real torch: what keeps a failed cell's tensors
alive, and that release() frees them without touching user variables."""
import gc
import sys
import weakref

import pytest
import torch
from IPython.testing import globalipapp

from cuda_magic.recover.notebook_refs import clear_frame, drop_exception, drop_exception_refs, drop_output_cache
from cuda_magic.memory.reach import has_gpu, holds_device_memory, is_device_tensor
from cuda_magic.recover.release import (MissingNames, all_device_variables, cpu_tensor_bytes, free_variables, release)

CPU_IS_DEVICE = not has_gpu()
needs_cpu_device = pytest.mark.skipif(not CPU_IS_DEVICE, reason="CPU tensors count only without a GPU")

FAILING_CELL = (
    "def f():\n"
    "    x = torch.ones(1000)\n"
    "    refs.append(weakref.ref(x))\n"
    "    raise RuntimeError('CUDA out of memory. Tried to allocate 2.00 MiB')\n"
    "f()\n"
)


@pytest.fixture
def ip():
    globalipapp.start_ipython()
    shell = globalipapp.get_ipython()
    mode = shell.InteractiveTB.mode
    before = set(shell.user_ns)
    shell.user_ns.update(torch=torch, weakref=weakref, refs=[])
    yield shell
    shell.run_line_magic("xmode", mode)
    for name in set(shell.user_ns) - before:
        shell.user_ns.pop(name, None)
    drop_exception_refs(shell)
    drop_output_cache(shell, only_device=False)
    for name in ("_", "__", "___"):  # a test may have assigned its own `_`
        shell.user_ns[name] = shell.user_ns_hidden[name] = ""
        setattr(shell.displayhook, name, "")
    gc.collect()


def fail_cell(ip):
    result = ip.run_cell(FAILING_CELL, store_history=True)
    assert isinstance(result.error_in_exec, RuntimeError)
    ref = ip.user_ns["refs"][-1]
    gc.collect()
    assert ref() is not None
    return ref


# ------------------------------------------------------------------------------------- device tensors

@needs_cpu_device
def test_cpu_tensors_are_device_tensors_without_a_gpu():
    assert is_device_tensor(torch.ones(2))
    assert is_device_tensor(torch.nn.Parameter(torch.ones(2)))
    assert not is_device_tensor(torch.ones(2, device="meta"))
    assert not is_device_tensor([torch.ones(2)])
    assert not is_device_tensor(3)


def test_gpu_probe_never_imports_torch_and_asks_torch_once(monkeypatch):
    import subprocess

    code = ("import sys\nfrom cuda_magic.devices.probe import has_gpu\n"
            "print(has_gpu(), 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr

    from cuda_magic.devices import probe

    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: calls.append(1) or 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("is_available starts the driver"))
    probe.forget()
    try:
        first = has_gpu()
        is_device_tensor(torch.ones(1))
        is_device_tensor(torch.ones(1))
        assert has_gpu() == first and len(calls) == 1
    finally:
        probe.forget()


# --------------------------------------------------------------------------------- reachable bytes

@needs_cpu_device
def test_views_share_one_storage():
    t = torch.ones(1000)  # 4000 bytes
    assert holds_device_memory(t) == 4000
    assert holds_device_memory([t, t[10:], t.view(10, 100), {"again": t}]) == 4000
    assert holds_device_memory([t, torch.ones(10)]) == 4040


@needs_cpu_device
def test_modules_optimizers_and_objects():
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.BatchNorm1d(10))
    params = sum(p.numel() * 4 for p in model.parameters())
    buffers = sum(b.untyped_storage().nbytes() for b in model.buffers())
    assert holds_device_memory(model) == params + buffers

    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 10)).sum().backward()
    opt.step()
    state = sum(v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values())
    assert state > 0
    # the optimizer reaches its params (and their grads) and its state
    assert holds_device_memory(opt) == 2 * params + state

    class Holder:
        pass

    h = Holder()
    h.inner = {"model": model}
    h.cycle = h
    assert holds_device_memory(h) == 2 * params + buffers


@needs_cpu_device
def test_logged_losses_count_their_graphs():
    w = torch.randn(100, 100, requires_grad=True)
    losses = []
    for _ in range(3):
        x = torch.randn(64, 100)
        losses.append((x @ w).relu().sum())
    just_values = sum(loss.untyped_storage().nbytes() for loss in losses)
    # each graph saved its input and its relu output: far more than the scalar losses
    assert holds_device_memory(losses) > just_values + 3 * 64 * 100 * 4
    assert holds_device_memory([loss.item() for loss in losses]) == 0


def test_walk_is_bounded():
    nested = torch.ones(10)
    for _ in range(50):
        nested = [nested]
    assert holds_device_memory(nested) == 0
    assert holds_device_memory(nested, depth=60) == (40 if CPU_IS_DEVICE else 0)
    wide = [torch.ones(10)] + [[i] for i in range(1000)]  # the walk reaches the tensor last
    assert holds_device_memory(wide, limit=100) == 0


# ------------------------------------------------------------------------- a failed cell's holders

def _keep_only(ip, holder):
    if holder != "sys":
        for attr in ("last_type", "last_value", "last_traceback", "last_exc"):
            if hasattr(sys, attr):
                delattr(sys, attr)
    if holder != "stored traceback":
        ip.InteractiveTB.tb = None
    if holder != "result":
        ip.last_execution_result.error_in_exec = None


@pytest.mark.parametrize("holder,name", [
    ("sys", "sys.last_value"),
    ("stored traceback", "IPython's stored traceback"),
    ("result", "IPython's last error"),
])
def test_each_holder_alone_keeps_the_failed_cells_tensor(ip, holder, name):
    ref = fail_cell(ip)
    _keep_only(ip, holder)
    gc.collect()
    assert ref() is not None, f"{holder} alone should keep the tensor alive"
    report = release(ip)
    assert ref() is None
    assert name in report.dropped


def test_release_frees_a_failed_cell(ip):
    ref = fail_cell(ip)
    report = release(ip)
    assert ref() is None
    assert {"sys.last_value", "IPython's stored traceback", "IPython's last error"} <= set(report.dropped)
    assert not hasattr(sys, "last_value")
    assert ip.InteractiveTB.tb is None
    assert ip.last_execution_result.error_in_exec is None
    assert "f" in ip.user_ns  # the user's function is still there


def test_release_frees_a_failed_cell_in_verbose_mode(ip):
    # Verbose formatting reads each frame's f_locals; the user keeps the exception (and so its frames)
    ip.run_line_magic("xmode", "Verbose")
    ref = fail_cell(ip)
    ip.run_cell("import sys\nerr = sys.last_value", store_history=True)
    release(ip)
    assert ref() is None
    assert isinstance(ip.user_ns["err"], RuntimeError) and "out of memory" in str(ip.user_ns["err"])


@pytest.mark.skipif(sys.version_info >= (3, 13), reason="3.13 has no cached f_locals dict")
def test_clear_frame_resyncs_cached_locals():
    def failing():
        x = torch.ones(10)
        refs.append(weakref.ref(x))
        raise ValueError

    for use_helper in (False, True):
        refs = []
        try:
            failing()
        except ValueError as e:
            frame = e.__traceback__.tb_next.tb_frame
        frame.f_locals  # what a traceback formatter does
        if use_helper:
            assert clear_frame(frame)
        else:
            frame.clear()
        gc.collect()
        # plain clear() leaves the cached f_locals holding x; the helper does not
        assert (refs[0]() is None) == use_helper
        del frame


def test_module_frame_is_never_cleared(ip):
    ip.run_cell("import sys as _s\nkeep_me = 1\nraise_here = _s._getframe()", store_history=False)
    frame = ip.user_ns["raise_here"]
    assert not clear_frame(frame, ip.user_ns)
    assert ip.user_ns["keep_me"] == 1


def test_drop_exception_cuts_chains():
    refs = []

    def inner():
        x = torch.ones(100)
        refs.append(weakref.ref(x))
        raise RuntimeError("CUDA out of memory.")

    def outer():
        try:
            inner()
        except RuntimeError as e:
            raise ValueError("short") from e

    try:
        outer()
    except ValueError as e:
        err = e
    assert err.__cause__ is not None and refs[0]() is not None
    assert drop_exception(err) >= 2
    gc.collect()
    assert refs[0]() is None
    assert err.__traceback__ is None and err.__cause__ is None and err.__context__ is None
    assert str(err) == "short"


# ----------------------------------------------------------------------------------- output cache

def test_output_cache_entries_are_freed_and_named(ip):
    result = ip.run_cell("torch.ones(10)", store_history=True)
    n = result.execution_count
    ref = weakref.ref(ip.user_ns["Out"][n])
    gc.collect()
    assert ref() is not None
    report = release(ip)
    assert ref() is None
    assert {f"Out[{n}]", f"_{n}", "_"} <= set(report.dropped)
    assert n not in ip.user_ns["Out"] and f"_{n}" not in ip.user_ns
    assert ip.user_ns["_"] == "" and ip.displayhook._ == ""


def test_older_outputs_in_double_and_triple_underscore(ip):
    n = ip.run_cell("torch.ones(10)", store_history=True).execution_count
    ref = weakref.ref(ip.user_ns["Out"][n])
    ip.run_cell("1", store_history=True)
    ip.run_cell("2", store_history=True)
    assert ip.user_ns["___"] is ref()
    report = release(ip)
    assert ref() is None
    assert "___" in report.dropped and "_" not in report.dropped
    assert ip.user_ns["_"] == 2  # outputs without device tensors stay


def test_user_variables_are_never_touched(ip):
    n = ip.run_cell("t = torch.ones(10)\nt", store_history=True).execution_count
    ip.run_cell(f"_x = t\nkeep = t\n_{n + 5} = torch.ones(3)\ndel t", store_history=True)
    ip.run_cell("_ = torch.ones(4)", store_history=True)  # the user's own `_`
    user_underscore = ip.user_ns["_"]
    ref = weakref.ref(ip.user_ns["keep"])
    report = release(ip)
    assert ref() is not None
    assert ip.user_ns["_x"] is ref() and ip.user_ns["keep"] is ref()
    assert ip.user_ns["_"] is user_underscore
    assert f"_{n + 5}" in ip.user_ns
    assert f"Out[{n}]" in report.dropped
    if CPU_IS_DEVICE:
        held = dict(report.still_held)
        # `keep` and `_x` are one tensor: deleting either alone gives nothing back, both together 40 B
        assert held["_x, keep"] == 40 and held["_"] == 16 and held[f"_{n + 5}"] == 12
        assert "keep" not in held and "torch" not in held and "Out" not in held
        assert any(note.startswith("_x, keep share memory") for note in report.notes)


def test_dry_run_changes_nothing(ip):
    ref = fail_cell(ip)
    n = ip.run_cell("refs[0]().view(10, 100)", store_history=True).execution_count
    ip.user_ns["refs"].clear()
    out_before = dict(ip.user_ns["Out"])
    report = release(ip, dry_run=True)
    gc.collect()
    assert report.dry_run
    assert ref() is not None
    assert sys.last_value is not None and ip.InteractiveTB.tb is not None
    assert dict(ip.user_ns["Out"]) == out_before and ip.user_ns[f"_{n}"] is out_before[n]
    assert {"sys.last_value", f"Out[{n}]", f"_{n}"} <= set(report.dropped)
    del out_before  # the test's own copy of Out
    release(ip)
    assert ref() is None


# --------------------------------------------------------------------------------- %freecuda NAME

def test_missing_name_deletes_nothing(ip):
    ip.user_ns["a"] = torch.ones(10)
    with pytest.raises(MissingNames) as info:
        free_variables(ip, ["a", "nope", "also_not"])
    assert info.value.names == ["nope", "also_not"]
    assert "nope" in str(info.value)
    assert "a" in ip.user_ns


def test_free_variables_deletes_only_named(ip):
    ip.run_cell("a = torch.ones(100000)\nkeep = torch.ones(10)\nalias = keep", store_history=True)
    ref = weakref.ref(ip.user_ns["a"])
    report = free_variables(ip, ["a"])
    assert ref() is None
    assert "a" not in ip.user_ns and "keep" in ip.user_ns
    assert report.deleted == ["a"]
    if CPU_IS_DEVICE:
        assert report.freed["cpu"] >= 400000
        assert ("alias, keep", 40) in report.still_held and "keep" not in dict(report.still_held)


def test_free_variables_dry_run(ip):
    ip.run_cell("a = torch.ones(100)", store_history=True)
    report = free_variables(ip, ["a"], dry_run=True)
    assert "a" in ip.user_ns and report.deleted == ["a"] and report.dry_run
    assert "a" not in dict(report.still_held)


def test_free_variables_offload_keeps_data(ip):
    ip.run_cell("m = torch.nn.Linear(3, 3)\nw = m.weight", store_history=True)
    before = ip.user_ns["m"].weight.detach().clone()
    report = free_variables(ip, ["m"], offload=True)
    assert report.offloaded == ["m"] and not report.deleted
    assert torch.equal(ip.user_ns["m"].weight, before) and ip.user_ns["m"].weight is ip.user_ns["w"]


@needs_cpu_device
def test_all_device_variables_largest_first(ip):
    ip.run_cell("small = torch.ones(10)\nbig = [torch.ones(1000)]\nnot_tensor = 3\ntorch.ones(5)",
                store_history=True)
    names = all_device_variables(ip)
    assert names.index("big") < names.index("small")
    assert "not_tensor" not in names and "torch" not in names
    assert not any(n.startswith("_") or n == "Out" for n in names)


@needs_cpu_device
def test_release_measures_cpu_bytes_freed(ip):
    ip.run_cell(
        "def g():\n    x = torch.ones(1_000_000)\n    raise RuntimeError('CUDA out of memory.')\ng()",
        store_history=True)
    report = release(ip)
    assert report.freed["cpu"] >= 4_000_000
    gc.collect()
    after = cpu_tensor_bytes()
    keep = torch.ones(250_000)
    assert cpu_tensor_bytes() - after == 1_000_000
    del keep


RESNET_STEP = """
xb, yb = data.tensors[0][:85], data.tensors[1][:85]
loss = nn.functional.cross_entropy(model(xb.float().div_(255)), yb)
loss.backward()
"""


def _failed_backward(ip, *, drain: bool, monkeypatch):
    """A ResNet step (tests/model_cells.py) that runs out of memory in its backward pass on a simulated
    64 MiB device, under %%oomguard in a real shell; then the user deletes the names the cell bound. The
    bytes still allocated, and those allocated before the cell."""
    from model_cells import RESNET

    import cuda_magic.recover.failure as failure

    if not drain:
        monkeypatch.setattr(failure, "drain_autograd", lambda: False)
    ip.run_line_magic("load_ext", "cuda_magic")
    ip.run_line_magic("gpumem", "--simulate 64MiB -q")
    try:
        ip.run_cell(RESNET)
        from cuda_magic.devices.simulated import active_device

        device = active_device()
        before = device.allocated
        report = ip.run_cell_magic("oomguard", "-q -o --no-raise --no-live", RESNET_STEP)
        assert report.outcome == "oom" and report.failure.text == "loss.backward()"
        for name in ("xb", "yb", "loss"):
            ip.user_ns.pop(name, None)
        gc.collect()
        return device.allocated, before
    finally:
        ip.run_line_magic("gpumem", "--simulate off -q")


def test_a_failed_backward_pass_leaves_nothing_in_the_autograd_engine(ip, monkeypatch):
    # torch/csrc/autograd/engine.cpp: the calling thread's thread_main() stops at the failed graph task's
    # completion, leaving the rest of that graph (nodes, saved activations) queued until the next backward
    held, before = _failed_backward(ip, drain=False, monkeypatch=monkeypatch)
    assert held - before > 20 << 20, (held, before)          # the engine holds the graph: the leak is real
    monkeypatch.undo()
    (torch.zeros((), requires_grad=True) * 1).backward()     # what the clean-up does, for the next test
    held, before = _failed_backward(ip, drain=True, monkeypatch=monkeypatch)
    assert held - before < 1 << 20, (held, before)           # the clean-up let it go
