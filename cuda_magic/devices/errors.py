"""Which errors are out-of-memory errors: the one place that decides it (the guard, the diagnosis and
`%gpumem --watch`'s outcome of a cell, memory/watch.py, all ask here), and torch's
out-of-memory exception class, the one place that knows where it lives in each torch version.

`torch.OutOfMemoryError` exists from torch 2.4; torch 1.13 to 2.3 have only `torch.cuda.OutOfMemoryError`
(the same class where both exist). The short error after a guarded OOM and every simulated OOM use this.

Pure: no torch import here (torch's exception class is recognised by name where torch is not loaded), so
an error is classified cheaply. What counts (see SPEC "Out of memory: what counts"):
- 'oom': `torch.OutOfMemoryError` (and `torch.cuda.OutOfMemoryError`, the same class), messages saying
  CUDA / HIP / XPU / MPS out of memory, `CUDA error: out of memory`, `CUBLAS_STATUS_ALLOC_FAILED`, torch's
  CPU allocator failing (`DefaultCPUAllocator: can't allocate memory`, Windows: `not enough memory`),
  and Python's `MemoryError` (a CPU out-of-memory: numpy raises a subclass of it; the kernel survives
  it just as it survives a CUDA OOM, and the same clean-up helps).
- 'possible': cuDNN's `CUDNN_STATUS_NOT_SUPPORTED`, which torch raises when cuDNN cannot get workspace
  memory, but also for inputs cuDNN does not support.
- 'fatal': `device-side assert triggered`, `an illegal memory access was encountered`: not out of
  memory; the CUDA context is unusable and only a kernel restart helps.
"""
from __future__ import annotations

import re
import sys


def oom_error_class(torch=None) -> type:
    """torch.OutOfMemoryError (torch 2.4+), else torch.cuda.OutOfMemoryError (torch 1.13 to 2.3).

    `torch`: the module (default: the one the user imported, imported here if need be)."""
    if torch is None:
        torch = sys.modules.get("torch")
        if torch is None:
            import torch
    cls = getattr(torch, "OutOfMemoryError", None)
    if isinstance(cls, type):
        return cls
    return torch.cuda.OutOfMemoryError


_FATAL_RE = re.compile(r"device-side assert triggered|an illegal memory access was encountered", re.I)
OOM_MESSAGE = re.compile(
    r"CUDA out of memory|CUDA error:\s*out of memory|cuda runtime error \(2\)\s*:\s*out of memory"
    r"|HIP out of memory|hipErrorOutOfMemory|MPS backend out of memory|XPU out of memory"
    r"|CUBLAS_STATUS_ALLOC_FAILED|DefaultCPUAllocator: (?:can't allocate memory|not enough memory)"
    r"|Torch: not enough memory", re.I)
_POSSIBLE_RE = re.compile(r"CUDNN_STATUS_NOT_SUPPORTED", re.I)
CHAIN_LIMIT = 256     # exceptions followed along one chain (a retry loop chains one per failure)


def error_text(exc: BaseException) -> str:
    """str(exc), or '' where its __str__ breaks."""
    try:
        return str(exc)
    except Exception:  # a broken __str__ must not break the classification of the error
        return ""


def _is_torch_oom_class(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")
    oom_class = oom_error_class(torch) if torch is not None else None
    if oom_class is not None and isinstance(exc, oom_class):
        return True
    return any(c.__name__ == "OutOfMemoryError" and (c.__module__ or "").split(".")[0] == "torch"
               for c in type(exc).__mro__)


def message_kind(text: str) -> str | None:
    """What an error message alone says: 'oom', 'possible', 'fatal' or None."""
    if _FATAL_RE.search(text):
        return "fatal"
    if OOM_MESSAGE.search(text):
        return "oom"
    if _POSSIBLE_RE.search(text):
        return "possible"
    return None


def _kind_of_one(exc: BaseException) -> str | None:
    kind = message_kind(error_text(exc))
    if kind is None and (_is_torch_oom_class(exc) or isinstance(exc, MemoryError)):
        return "oom"
    return kind


def exception_chain(exc: BaseException | None, limit: int = CHAIN_LIMIT):
    """exc, then its causes and contexts (and the members of exception groups), each once, at most
    `limit` of them (a chain can be a cycle, or as long as a loop that raised inside `except`)."""
    seen: set[int] = set()
    stack = [exc]
    while stack and len(seen) < limit:
        e = stack.pop()
        if e is None or id(e) in seen or not isinstance(e, BaseException):
            continue
        seen.add(id(e))
        yield e
        following = [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
        stack.extend(reversed([f for f in following if isinstance(f, BaseException)]))


def oom_kind(exc: BaseException | None) -> str | None:
    """'oom', 'possible' (cuDNN's NOT_SUPPORTED), 'fatal' (needs a kernel restart) or None.

    Looks at the exception and its `__cause__` / `__context__` chain. 'fatal' wins over 'oom' (a
    context that is unusable cannot be saved by freeing memory), and 'oom' over 'possible'.
    """
    if exc is None:
        return None
    kinds = {_kind_of_one(e) for e in exception_chain(exc)}
    for kind in ("fatal", "oom", "possible"):
        if kind in kinds:
            return kind
    return None


def is_oom(exc: BaseException | None) -> bool:
    """True for an out-of-memory error, including cuDNN's possible one; False for fatal CUDA errors."""
    return oom_kind(exc) in ("oom", "possible")


def find_oom(exc: BaseException | None) -> BaseException | None:
    """The exception in the chain that carries the out-of-memory message, or None.

    Prefers a definite OOM over a possible one; None where the chain holds a fatal CUDA error.
    """
    if exc is None or oom_kind(exc) not in ("oom", "possible"):
        return None
    found = {}
    for e in exception_chain(exc):
        found.setdefault(_kind_of_one(e), e)
    return found.get("oom") or found.get("possible")
