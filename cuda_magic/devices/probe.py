"""Is torch loaded, has it started CUDA, is there a GPU: asked without importing torch or starting CUDA.

torch is looked up in sys.modules, never imported: no tensor exists before the user imports torch, and
`%load_ext` must stay cheap. "Is there a GPU" uses `torch.cuda.device_count()` (NVML-based before CUDA
starts), not `is_available()`, which initialises the driver and makes a later fork unsafe.
"""
from __future__ import annotations

import sys

_gpu: bool | None = None     # the answer, once torch is loaded (devices do not come and go in a process)
_mps: bool | None = None     # whether torch can use MPS, once torch is loaded (asked after every watched cell)


def loaded_torch():
    """The torch module if the user imported it, else None."""
    return sys.modules.get("torch")


def cuda_started(torch=None) -> bool:
    """Whether torch has initialised CUDA in this process (so its counters can be read freely). `torch`:
    the loaded module where the caller has it (`--watch` asks after every cell)."""
    if torch is None:
        torch = loaded_torch()
        if torch is None:
            return False
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:  # a torch build without CUDA support at all
        return False


def cuda_device_count() -> int:
    torch = loaded_torch()
    if torch is None:
        return 0
    try:
        return int(torch.cuda.device_count())
    except (AssertionError, RuntimeError):
        return 0


def mps_available() -> bool:
    """Whether torch can use Apple's MPS device (asked once per process, once torch is loaded)."""
    global _mps
    if _mps is None:
        torch = loaded_torch()
        if torch is None:
            return False
        mps = getattr(getattr(torch, "backends", None), "mps", None)
        _mps = mps is not None and bool(mps.is_available())
    return _mps


def xpu_started(torch=None) -> bool:
    """Whether torch has initialised an Intel XPU (so its counters can be read freely). `torch`: the loaded
    module where the caller has it."""
    is_initialized = getattr(getattr(torch or loaded_torch(), "xpu", None), "is_initialized", None)
    return is_initialized is not None and bool(is_initialized())


def has_gpu() -> bool:
    """Whether this process can use a GPU (CUDA/ROCm, MPS or XPU). False while torch is not loaded."""
    global _gpu
    if _gpu is not None:
        return _gpu
    torch = loaded_torch()
    if torch is None:
        return False
    found = cuda_started() or cuda_device_count() > 0
    if not found:
        found = mps_available()
    if not found:
        xpu = getattr(torch, "xpu", None)
        found = xpu is not None and hasattr(xpu, "device_count") and bool(xpu.device_count())
    _gpu = found
    return found


def real_storage(tensor):
    """The storage that holds `tensor`'s memory, or None where it holds none of its own: a fake or meta
    tensor (its storage is on the meta device: torch.compile's FakeTensors report a real device but keep
    a meta storage), a wrapper subclass (`_make_wrapper_subclass`: its storage cannot be accessed; the
    tensors it wraps hold the memory), a sparse or nested tensor without one plain storage."""
    try:
        if type(tensor) in _PLAIN:         # the common case: a plain tensor's storage is on its device
            return None if tensor.is_meta else tensor.untyped_storage()
        storage = tensor.untyped_storage()
        if storage.device.type == "meta":
            return None
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None
    return storage


class _PlainTypes:
    """torch.Tensor and nn.Parameter, looked up once torch is loaded (this module never imports it)."""

    def __contains__(self, cls) -> bool:
        torch = loaded_torch()
        if torch is None:
            return False
        global _PLAIN
        _PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))
        return cls in _PLAIN


_PLAIN = _PlainTypes()


def subclasses(base) -> frozenset:
    """`base` and every class derived from it now: a gc pass matches exact types against this set
    (`type(o) in found` is several times faster than `issubclass` per object)."""
    found, stack = set(), [base]
    while stack:
        cls = stack.pop()
        if cls not in found:
            found.add(cls)
            stack.extend(cls.__subclasses__())
    return frozenset(found)


def forget() -> None:
    """Ask again next time (tests that fake a device)."""
    global _gpu
    _gpu = None
