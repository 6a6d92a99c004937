"""The caching allocator's settings ("key:value,key:value"), and switching expandable_segments on.

torch reads them once, at start-up, from the first of PYTORCH_CUDA_ALLOC_CONF, PYTORCH_HIP_ALLOC_CONF (ROCm
builds) and PYTORCH_ALLOC_CONF (torch 2.9+) that is set. At runtime they can be changed with
`torch._C._accelerator_setAllocatorSettings` (torch 2.10+) or `torch.cuda.memory._set_allocator_settings`
(older, deprecated since): each call resets the options it does not name, except expandable_segments, which
keeps its value; so a line that switches on expandable_segments must repeat the options already in force.
The getter `torch._C._accelerator_getAllocatorSettings` (torch 2.12+) returns the last string set (the
environment's at start), not the state in force: expandable_segments from an earlier string is added back.
Switching expandable_segments on changes only segments reserved afterwards: `torch.cuda.empty_cache()`
returns the cached ones, so that later reservations use the new kind. Builds without the driver API it
needs (Windows) ignore the setting with a warning.
"""
from __future__ import annotations

import json
import os
import sys

#: Environment variables torch reads its allocator settings from, in the order it looks at them.
ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

_set_here: str | None = None    # the settings enable_expandable_segments last set in this process
NEW_SETTER = "torch._C._accelerator_setAllocatorSettings"
OLD_SETTER = "torch.cuda.memory._set_allocator_settings"


def current_allocator_conf(*, runtime: bool = True) -> str:
    """The allocator settings in force: the last settings string set at runtime where torch says (2.12+)
    or cuda_magic set one, else the environment's (the first of ENV_VARS that is set), else ''; with
    expandable_segments carried over from earlier settings where the last string does not name it.
    runtime=False: the environment only."""
    env = env_allocator_conf()
    if not runtime:
        return env
    last = runtime_allocator_conf()
    if last is None:
        last = _set_here if _set_here is not None else env
    if conf_value(last, "expandable_segments") is None:
        for earlier in (_set_here, env):
            value = conf_value(earlier or "", "expandable_segments")
            if value is not None:
                return merge_conf(last, expandable_segments=value)
    return last


def env_allocator_conf() -> str:
    """The settings torch read from the environment at start-up ('' where none is set)."""
    hip = getattr(getattr(sys.modules.get("torch"), "version", None), "hip", "unknown")
    for name in ENV_VARS:
        if name == "PYTORCH_HIP_ALLOC_CONF" and hip is None:
            continue            # a CUDA build of torch does not read it
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
    return NEW_SETTER if (major, minor) >= (2, 10) else OLD_SETTER


def expandable_segments_line(conf: str | None = None, *, setter: str | None = None) -> str:
    """The line a user pastes to switch expandable_segments on now, keeping the other options.

    `conf`: the settings in force (default: the runtime settings where torch says, else the
    environment's). `setter`: NEW_SETTER or OLD_SETTER (default: the one the installed torch has).

    Ends with torch.cuda.empty_cache(): segments reserved before stay as they were until returned.

    >>> expandable_segments_line("max_split_size_mb:128", setter=NEW_SETTER)
    'import torch; torch._C._accelerator_setAllocatorSettings("max_split_size_mb:128,expandable_segments:True"); torch.cuda.empty_cache()'
    """
    if conf is None:
        conf = current_allocator_conf()
    new = merge_conf(conf, expandable_segments=True)
    return f"import torch; {setter or _setter_name()}({json.dumps(new)}); torch.cuda.empty_cache()"


def enable_expandable_segments() -> str:
    """Switch expandable_segments on for this process now, keeping the other allocator options.

    Returns a sentence saying what it did. Raises RuntimeError saying why where it cannot: no CUDA
    device, the cudaMallocAsync backend (which has no expandable segments), or a build that ignores it.
    """
    global _set_here
    import torch

    from cuda_magic.devices.probe import cuda_device_count, cuda_started

    if not (cuda_started() or cuda_device_count() > 0):   # not is_available(): it initialises the driver
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a build without CUDA"
        raise RuntimeError(
            f"cannot switch on expandable_segments: no CUDA device is available (torch "
            f"{torch.__version__}, {build}). It is an option of the CUDA caching allocator; the CPU, "
            "MPS and the simulated device have nothing to switch.")
    if sys.platform == "win32":
        raise RuntimeError("cannot switch on expandable_segments: torch's Windows builds do not support "
                           "it (they ignore the setting with a warning)")
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
    import warnings

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        if setter is None:
            torch.cuda.memory._set_allocator_settings(new)
        else:
            setter(new)
    ignored = [str(w.message) for w in said
               if "expandable_segments" in str(w.message) and "not supported" in str(w.message)]
    for w in said:
        if str(w.message) not in ignored and not issubclass(w.category, FutureWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if ignored:
        raise RuntimeError(f"cannot switch on expandable_segments: this build ignores it ({ignored[0]})")
    _set_here = new
    env_var = "PYTORCH_ALLOC_CONF" if setter is not None else "PYTORCH_CUDA_ALLOC_CONF"
    return (f"expandable_segments switched on for this session (allocator settings now {new!r}). It "
            f"applies to memory PyTorch reserves from now on: torch.cuda.empty_cache() returns the cached "
            f"segments, reserved the old way, so that later ones are expandable. To have it from the "
            f"start, set {env_var}={new} before starting Python.")
