"""Shared fixtures: a real IPython shell with cuda_magic loaded, left clean after every test."""
from __future__ import annotations

import gc
import os
import sys

import pytest
from hypothesis import settings

# CI (CI=true) runs the property tests on hypothesis's fixed examples, so that a run is repeatable; local
# runs keep exploring new ones.
settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

#: A function that keeps one tensor (weakly referenced in `refs`) and then asks for far more than a small
#: simulated device has: its frame's locals are what an out-of-memory error keeps alive.
STEP = """
refs = []
def step(n):
    act = torch.ones(n, 1024)
    refs.append(weakref.ref(act))
    return torch.empty(n * 4096, 1024)
"""

OUR_MAGICS = {"line": {"gpumem", "oomguard", "freecuda"}, "cell": {"oomguard"}}


def pytest_collection_modifyitems(config, items):
    """Tests marked `ipython8` are skipped on IPython 7 (Colab's 7.34)."""
    import IPython

    if IPython.version_info[0] >= 8:
        return
    skip = pytest.mark.skip(reason=f"needs IPython 8 or later (this is {IPython.__version__})")
    for item in items:
        if "ipython8" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def global_ip():
    """IPython's global test shell (a real TerminalInteractiveShell), made once per session."""
    from IPython.testing.globalipapp import get_ipython

    return get_ipython()


@pytest.fixture(scope="session")
def torch_warm():
    """torch imported, and the simulated device's first use (torch loads its meta kernels) paid once."""
    import torch

    from cuda_magic.devices.simulated import SimulatedDevice

    with SimulatedDevice(1 << 30):
        torch.zeros(4) + torch.ones(4)
    return torch


def _clean_notebook_refs(ip) -> None:
    """Drop what IPython keeps from earlier cells: last error, stored traceback, output cache."""
    for attr in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, attr):
            delattr(sys, attr)
    ip.InteractiveTB.tb = None
    ip.last_execution_result = None
    ip.history_manager.output_hist.clear()
    for name in ("_", "__", "___"):
        setattr(ip.displayhook, name, "")
        for ns in (ip.user_ns, ip.user_ns_hidden):
            if name in ns:
                ns[name] = ""


def unload_everything(ip) -> None:
    """`%oomguard off`, stop the simulated session, `%unload_ext`: what a test may have turned on."""
    from cuda_magic.devices.simulated import active_device

    if "cuda_magic" in ip.extension_manager.loaded:
        ip.run_line_magic("oomguard", "off")
        ip.run_line_magic("unload_ext", "cuda_magic")
    while (dev := active_device()) is not None:    # a device a failed test left on
        dev.stop()
        dev.forget()


@pytest.fixture
def bare_ip(global_ip):
    """The real shell without cuda_magic loaded; every user variable a test adds is removed afterwards."""
    ip = global_ip
    unload_everything(ip)
    names_before = set(ip.user_ns)
    hidden_before = set(ip.user_ns_hidden)
    custom_before = (ip.custom_exceptions, ip.CustomTB)
    callbacks_before = {k: list(v) for k, v in ip.events.callbacks.items()}
    try:
        yield ip
    finally:
        unload_everything(ip)
        for name in set(ip.user_ns) - names_before:
            del ip.user_ns[name]
        for name in set(ip.user_ns_hidden) - hidden_before:
            del ip.user_ns_hidden[name]
        _clean_notebook_refs(ip)
        # a test that failed half-way must not leave hooks for the next one
        ip.custom_exceptions, ip.CustomTB = custom_before
        for event, cbs in ip.events.callbacks.items():
            cbs[:] = callbacks_before.get(event, [])
        gc.collect()


@pytest.fixture
def ip(bare_ip):
    """The real shell with `%load_ext cuda_magic` done."""
    bare_ip.run_line_magic("load_ext", "cuda_magic")
    return bare_ip


@pytest.fixture
def tip(ip, torch_warm):
    """The loaded shell with `torch` and `weakref` imported in the user namespace."""
    ip.run_cell("import torch, weakref, gc")
    return ip


def run_ok(ip, cell: str, *, store_history: bool = False):
    """Run a cell that must succeed; its error, if any, fails the test with the cell's own exception."""
    result = ip.run_cell(cell, store_history=store_history)
    if not result.success:
        raise AssertionError(f"cell failed: {result.error_before_exec or result.error_in_exec!r}\n{cell}")
    return result


@pytest.fixture
def fresh_nvml(monkeypatch):
    """A new NVML singleton for this test (the module's one remembers its first failure)."""
    from cuda_magic.devices import nvml

    monkeypatch.setattr(nvml, "_nvml", nvml.Nvml())
    yield
    nvml.get_nvml().shutdown()


@pytest.fixture
def no_gpu(monkeypatch, fresh_nvml, torch_warm):
    """A machine without a GPU, also on one that has one: NVML's library is not found and torch reports
    no CUDA, so tensors are CPU tensors and the CPU is the device. Skipped where torch has already
    initialised CUDA or an MPS device is present."""
    import pynvml

    from cuda_magic.devices import probe

    torch = torch_warm
    if torch.cuda.is_initialized():
        pytest.skip("torch has initialised CUDA in this process")
    if torch.backends.mps.is_available():
        pytest.skip("an Apple MPS device is present")

    def not_found():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", not_found)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    probe.forget()
    yield
    probe.forget()


def tensors_reachable(root, ip, limit: int = 200_000) -> list:
    """Tensors reachable from `root` through gc referents, not going through the shell, namespaces,
    modules, classes, functions or a frame's callers (those reach every user variable by design)."""
    import types

    torch = sys.modules["torch"]
    blocked = {id(ip), id(ip.user_ns), id(ip.user_global_ns), id(ip.user_ns_hidden), id(sys.modules)}
    blocked |= {id(vars(m)) for m in list(sys.modules.values()) if m is not None and hasattr(m, "__dict__")}
    skip_types = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.CodeType)
    found, seen, stack = [], set(), [root]
    while stack and len(seen) < limit:
        obj = stack.pop()
        if id(obj) in seen or id(obj) in blocked or isinstance(obj, skip_types):
            continue
        seen.add(id(obj))
        if issubclass(type(obj), torch.Tensor):
            found.append(obj)
            continue
        if isinstance(obj, types.FrameType):
            stack.extend(list(obj.f_locals.values()))   # not f_back, f_globals or f_builtins (3.13: a proxy)
            continue
        stack.extend(gc.get_referents(obj))
    return found
