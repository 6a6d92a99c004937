"""The caching allocator's settings ("key:value,key:value"), and switching expandable_segments on.

torch reads PYTORCH_ALLOC_CONF (torch 2.9+; before it PYTORCH_CUDA_ALLOC_CONF, on ROCm also
PYTORCH_HIP_ALLOC_CONF) once, at start-up. At runtime the settings can be changed with
`torch._C._accelerator_setAllocatorSettings` (torch 2.9+) or `torch.cuda.memory._set_allocator_settings`
(older, deprecated since): each call resets every option it does not name, so a line that switches on
expandable_segments must repeat the options already in force.
"""
from __future__ import annotations

import json
import os
import sys

#: Environment variables torch reads its allocator settings from, in the order it looks at them.
ENV_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
NEW_SETTER = "torch._C._accelerator_setAllocatorSettings"
OLD_SETTER = "torch.cuda.memory._set_allocator_settings"


def current_allocator_conf(*, runtime: bool = True) -> str:
    """The allocator settings in force: what torch's allocator reports where torch is imported and
    can say (that includes changes made at runtime), else the first of ENV_VARS that is set, else ''.
    runtime=False: the environment only."""
    if runtime:
        now = runtime_allocator_conf()
        if now is not None:
            return now
    for name in ENV_VARS:
        value = os.environ.get(name)
        if value is not None:
            return value.strip()
    return ""


def runtime_allocator_conf() -> str | None:
    """The settings torch's allocator is using now (they may have been changed since start-up).

    None where torch is not imported or too old to say; this never imports torch itself.
    """
    torch = sys.modules.get("torch")
    getter = getattr(getattr(torch, "_C", None), "_accelerator_getAllocatorSettings", None)
    return getter() if callable(getter) else None


def parse_conf(conf: str) -> list[tuple[str, str]]:
    """[(key, value), ...] in order. Commas inside brackets belong to the value:
    'roundup_power2_divisions:[256:1,512:2,>:8]' is one option."""
    items: list[tuple[str, str]] = []
    depth, start = 0, 0
    text = conf or ""
    for i, ch in enumerate(text + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(0, depth - 1)
        elif ch == "," and depth == 0:
            part = text[start:i].strip()
            start = i + 1
            if not part:
                continue
            key, _, value = part.partition(":")
            items.append((key.strip(), value.strip()))
    return items


def _format_value(value) -> str:
    if isinstance(value, bool):
        return "True" if value else "False"
    return str(value)


def merge_conf(conf: str, **options) -> str:
    """`conf` with `options` set: existing keys keep their place, new ones go at the end, a value of
    None removes the key. Booleans are written True/False, as torch expects.

    >>> merge_conf("max_split_size_mb:128,expandable_segments:False", expandable_segments=True)
    'max_split_size_mb:128,expandable_segments:True'
    """
    items = parse_conf(conf)
    keys = [k for k, _ in items]
    for key, value in options.items():
        if value is None:
            items = [(k, v) for k, v in items if k != key]
            keys = [k for k, _ in items]
        elif key in keys:
            items = [(k, _format_value(value) if k == key else v) for k, v in items]
        else:
            items.append((key, _format_value(value)))
            keys.append(key)
    return ",".join(f"{k}:{v}" if v != "" else k for k, v in items)


def conf_value(conf: str, key: str) -> str | None:
    """The value of `key` in `conf`, or None."""
    for k, v in parse_conf(conf):
        if k == key:
            return v
    return None


def expandable_segments_on(conf: str) -> bool:
    return (conf_value(conf, "expandable_segments") or "").lower() == "true"


def _setter_name() -> str:
    """The setter the user's torch has, found without importing torch."""
    torch = sys.modules.get("torch")
    if torch is not None:
        has_new = hasattr(getattr(torch, "_C", None), "_accelerator_setAllocatorSettings")
        return NEW_SETTER if has_new else OLD_SETTER
    try:
        from importlib.metadata import version

        major, minor = (int(x) for x in version("torch").split(".")[:2])
    except Exception:  # not installed, or a version string we cannot read: assume a current torch
        return NEW_SETTER
    return NEW_SETTER if (major, minor) >= (2, 9) else OLD_SETTER


def expandable_segments_line(conf: str | None = None, *, setter: str | None = None) -> str:
    """The line a user pastes to switch expandable_segments on now, keeping the other options.

    `conf`: the settings in force (default: the runtime settings where torch says, else the
    environment's). `setter`: NEW_SETTER or OLD_SETTER (default: the one the installed torch has).

    >>> expandable_segments_line("max_split_size_mb:128", setter=NEW_SETTER)
    'import torch; torch._C._accelerator_setAllocatorSettings("max_split_size_mb:128,expandable_segments:True")'
    """
    if conf is None:
        conf = current_allocator_conf()
    new = merge_conf(conf, expandable_segments=True)
    return f"import torch; {setter or _setter_name()}({json.dumps(new)})"


def enable_expandable_segments() -> str:
    """Switch expandable_segments on for this process now, keeping the other allocator options.

    Returns a sentence saying what it did. Raises RuntimeError saying why where it cannot: no CUDA
    device, or the cudaMallocAsync backend (which has no expandable segments).
    """
    import torch

    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a build without CUDA"
        raise RuntimeError(
            f"cannot switch on expandable_segments: no CUDA device is available (torch "
            f"{torch.__version__}, {build}). It is an option of the CUDA caching allocator; the CPU, "
            "MPS and the simulated device have nothing to switch.")
    conf = current_allocator_conf()
    if (conf_value(conf, "backend") or "native").lower() != "native":
        raise RuntimeError(
            f"cannot switch on expandable_segments: the allocator backend is "
            f"{conf_value(conf, 'backend')} (from the allocator settings {conf!r}); expandable segments "
            "belong to the native caching allocator, and the backend can only be chosen before torch "
            "starts.")
    if expandable_segments_on(conf):
        return f"expandable_segments is already on (allocator settings {conf!r}); nothing changed."
    new = merge_conf(conf, expandable_segments=True)
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            torch.cuda.memory._set_allocator_settings(new)
    else:
        setter(new)
    env_var = "PYTORCH_ALLOC_CONF" if setter is not None else "PYTORCH_CUDA_ALLOC_CONF"
    return (f"expandable_segments switched on for this session (allocator settings now {new!r}). It "
            f"applies to memory PyTorch reserves from now on; to have it from the start, set "
            f"{env_var}={new} before starting Python.")
