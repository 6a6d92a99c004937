"""Out-of-memory messages: the figures they state, and the note on a fatal CUDA error.

Which exceptions are out of memory is decided in devices/errors.py (what counts: its docstring), below
both the guard and `%gpumem --watch`. Pure: no torch import, so the parser can be tested on message texts
alone.
"""
from __future__ import annotations

import re
import sys

from cuda_magic.devices.errors import OOM_MESSAGE, error_text, find_oom
from cuda_magic.oom.findings import OomFields

FATAL_NOTE = (
    "This is not an out-of-memory error: after a device-side assert or an illegal memory access the "
    "CUDA context is unusable, and unlike an OOM it does need a kernel restart. Run with "
    "CUDA_LAUNCH_BLOCKING=1 to see which operation failed.")


def attach_note(exc: BaseException, note: str) -> None:
    """Add `note` to the exception's traceback (PEP 678, Python 3.11+); on Python 3.10, which has no
    notes (its tracebacks would drop one silently), print it to stderr now instead."""
    add = getattr(exc, "add_note", None)
    if callable(add):
        add(note)
    else:
        print(note, file=sys.stderr)


def oom_fields(exc: BaseException | None) -> OomFields | None:
    """The parsed message of the OOM in `exc`'s chain, or None when there is no OOM in it."""
    carrier = find_oom(exc)
    if carrier is None:
        return None
    text = error_text(carrier)
    fields = parse_oom_message(text)
    if isinstance(carrier, MemoryError) and not OOM_MESSAGE.search(text):
        fields.backend, fields.device = "cpu", "cpu"
    fields.message = fields.message or type(carrier).__name__
    return fields


# -- parsing --------------------------------------------------------------------------------------

_SIZE = r"(\d+(?:\.\d+)?)\s*(bytes|byte|B|KiB|MiB|GiB|TiB|PiB|KB|MB|GB|TB|PB)\b"
# torch writes "GB" / "MB" in MPS messages and in its old CPU message but computes them with powers
# of 1024 (16 GiB of unified memory x 1.7 watermark x 2/3 prints as "max allowed: 18.13 GB"), so every
# unit here is binary.
_SCALE = {"B": 1, "BYTE": 1, "BYTES": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4,
          "P": 1024**5}


def _bytes(number: str, unit: str) -> int:
    key = unit.upper()
    key = key if key.startswith("BYTE") or key == "B" else key[0]
    return int(round(float(number) * _SCALE[key]))


def _find(text: str, *patterns: str) -> int | None:
    """Bytes of the size captured by the first pattern (each containing `{size}`) that matches."""
    for pattern in patterns:
        m = re.search(pattern.replace("{size}", _SIZE), text, re.I)
        if m:
            return _bytes(m.group(1), m.group(2))
    return None


_BACKENDS = (  # checked in order: the simulated device also says "CUDA out of memory"
    ("simulated", r"out of memory \(simulated device\)"),
    ("hip", r"HIP out of memory|hipErrorOutOfMemory"),
    ("mps", r"MPS backend out of memory"),
    ("xpu", r"XPU out of memory"),
    ("cublas", r"CUBLAS_STATUS_ALLOC_FAILED"),
    ("cudnn", r"CUDNN_STATUS_NOT_SUPPORTED"),
    ("cpu", r"DefaultCPUAllocator|Torch: not enough memory|Unable to allocate .{0,40} for an array"),
    ("cuda", r"CUDA out of memory|CUDA error:\s*out of memory|cuda runtime error \(2\)"),
)


def _backend(text: str) -> tuple[str | None, str | None]:
    """(backend, the text of the match) for the first kind of message found."""
    for name, pattern in _BACKENDS:
        m = re.search(pattern, text, re.I)
        if m:
            return name, m.group(0)
    return None, None


def _first_line(original: str, marker: str | None) -> str:
    lines = [line.strip() for line in original.splitlines() if line.strip()]
    if marker:
        for line in lines:
            if marker.lower() in line.lower():
                return line
    return lines[0] if lines else ""


def parse_oom_message(text: str) -> OomFields:
    """The figures an out-of-memory message states, in bytes; None for what it does not say.

    Knows the messages of torch's CUDA/HIP/XPU caching allocators (current form "GPU 0 has a total
    capacity of ... of which ... is free ...", the form before 2.1 "(GPU 0; ... total capacity; ...
    already allocated; ... free; ... reserved in total by PyTorch)", the 1.x "... cached)" form and the
    "capacty" typo of 2.1-2.3), MPS, cuBLAS, cuDNN, the CPU allocator (Linux and Windows), numpy's
    MemoryError and the simulated device. Never raises: unknown text gives fields that are None.

    `other_processes` is capacity - free - this process, when the message states all three; it is left
    None otherwise (in a container the driver may list this very process as "Process N has ...").
    """
    if not isinstance(text, str):
        try:
            text = str(text)
        except Exception:  # the parser's contract is never to raise
            text = ""
    flat = " ".join(text.split())
    backend, marker = _backend(flat)
    fields = OomFields(message=_first_line(text, marker))
    if backend is None:
        return fields
    fields.backend = backend
    fields.possible = backend == "cudnn"

    fields.requested = _find(flat, r"Tried to allocate {size}", r"you tried to allocate {size}",
                             r"Unable to allocate {size} for an array")
    fields.capacity = _find(flat, r"total capac\w* of {size}", r"{size} total capacity",
                            r"max allowed: {size}")
    fields.free = _find(flat, r"of which {size} is free", r"{size} free\b")
    fields.this_process = _find(flat, r"this process has {size} memory in use")
    fields.allocated_by_torch = _find(flat, r"{size} is allocated by PyTorch", r"{size} already allocated",
                                      r"MPS allocated: {size}")
    fields.reserved_unallocated = _find(flat, r"{size} is reserved by PyTorch but unallocated",
                                        r"{size} cached\)")
    fields.reserved_total = _find(flat, r"{size} reserved in total by PyTorch")
    fields.allowed = _find(flat, r"{size} allowed;")
    fields.processes = [(int(pid), _bytes(number, unit)) for pid, number, unit in
                        re.findall(r"Process (\d+) has " + _SIZE + r" memory in use", flat, re.I)]

    if backend == "mps":
        other = _find(flat, r"other allocations: {size}")
        if fields.allocated_by_torch is not None and other is not None:
            fields.this_process = fields.allocated_by_torch + other
    alloc, unalloc, total = fields.allocated_by_torch, fields.reserved_unallocated, fields.reserved_total
    if total is None and alloc is not None and unalloc is not None:
        fields.reserved_total = alloc + unalloc
    if unalloc is None and alloc is not None and total is not None:
        fields.reserved_unallocated = max(0, total - alloc)
    if None not in (fields.capacity, fields.free, fields.this_process) and backend != "mps":
        fields.other_processes = max(0, fields.capacity - fields.free - fields.this_process)
    fields.device = _device(backend, flat)
    return fields


def _device(backend: str, flat: str) -> str | None:
    if backend == "mps":
        return "mps"
    if backend == "cpu":
        return "cpu"
    m = re.search(r"\bGPU (\d+)", flat)
    if backend == "simulated":
        return f"sim:{m.group(1) if m else 0}"
    if m is None:
        return None
    return f"{'xpu' if backend == 'xpu' else 'cuda'}:{m.group(1)}"
