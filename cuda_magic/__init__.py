"""cuda_magic: IPython/Jupyter magics that end the "CUDA out of memory" kernel restart.

`%load_ext cuda_magic` registers `%gpumem`, `%%oomguard` / `%oomguard on|off` and `%freecuda`.
Importing this package imports no torch, pandas, ipywidgets or pynvml: the public API below is
loaded on first use.
"""
from __future__ import annotations

# the display registers the records' forms (cuda_magic/reprs.py): a record's repr works wherever one exists
from cuda_magic.display.render import render as _draws_the_records  # noqa: F401

__version__ = "0.1.0"

_API = {
    "diff": ("cuda_magic.memory.snapshot", "diff"),
    "explain": ("cuda_magic.oom.diagnosis", "explain"),
    "release": ("cuda_magic.recover.release", "release"),
    "snapshot": ("cuda_magic.memory.capture", "snapshot"),
    "is_oom": ("cuda_magic.devices.errors", "is_oom"),
    "oomguard": ("cuda_magic.api", "oomguard"),
    "predict": ("cuda_magic.api", "predict"),
    "SimulatedDevice": ("cuda_magic.devices.simulated", "SimulatedDevice"),
    "simulated_device": ("cuda_magic.devices.simulated", "simulated_device"),
    "parse_size": ("cuda_magic.units", "parse_size"),
    "read_snapshot": ("cuda_magic.api", "read_snapshot"),
    "SnapshotError": ("cuda_magic.oom.snapshot_reading", "SnapshotError"),
}

__all__ = sorted([*_API, "load_ipython_extension", "unload_ipython_extension"])


def __getattr__(name: str):
    target = _API.get(name)
    if target is None:
        raise AttributeError(f"module 'cuda_magic' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(target[0]), target[1])
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))


def load_ipython_extension(shell) -> None:
    from cuda_magic.magics.extension import load

    load(shell)


def unload_ipython_extension(shell) -> None:
    from cuda_magic.magics.extension import unload

    unload(shell)
