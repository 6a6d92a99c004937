"""torch's out-of-memory exception class: the one place that knows where it lives in each torch version.

`torch.OutOfMemoryError` exists from torch 2.4; torch 1.13 to 2.3 have only `torch.cuda.OutOfMemoryError`
(the same class where both exist). The short error after a guarded OOM and every simulated OOM use this.
"""
from __future__ import annotations

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
