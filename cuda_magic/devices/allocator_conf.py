"""The caching allocator's settings ("key:value,key:value"), switching expandable_segments on, and the MPS
allocator's memory limit.

Where torch reads the settings at start-up (c10/cuda/CUDAAllocatorConfig.h, c10/core/AllocatorConfig.cpp;
checked in the wheels' headers and libraries of 2.2 to 2.11 and by running 2.13):
- torch 2.2 to 2.7: PYTORCH_CUDA_ALLOC_CONF only.
- torch 2.8 and 2.9: PYTORCH_CUDA_ALLOC_CONF, then on ROCm builds PYTORCH_HIP_ALLOC_CONF. The CUDA allocator
  does not read PYTORCH_ALLOC_CONF: 2.9's AcceleratorAllocatorConfig reads it first (then the other two,
  calling them deprecated), but in 2.9 only the pinned host allocator uses that config.
- torch 2.10+: the first set of PYTORCH_CUDA_ALLOC_CONF, PYTORCH_HIP_ALLOC_CONF, PYTORCH_ALLOC_CONF, on every
  build (AcceleratorAllocatorConfig, which holds expandable_segments, max_split_size_mb,
  garbage_collection_threshold, roundup_power2_divisions, and is what the getter reports). The CUDA-only
  options (backend, release_lock_on_cudamalloc, pinned_*) come from CUDAAllocatorConfig, which skips
  PYTORCH_HIP_ALLOC_CONF on CUDA builds: only a CUDA build with both PYTORCH_HIP_ALLOC_CONF and
  PYTORCH_ALLOC_CONF set reads the two kinds from different variables.
At runtime they can be changed with `torch._C._accelerator_setAllocatorSettings` (torch 2.10+) or
`torch.cuda.memory._set_allocator_settings` (older, deprecated since): each call resets the options it does
not name, except expandable_segments, which keeps its value; so a line that switches on expandable_segments
must repeat the options already in force. The getter `torch._C._accelerator_getAllocatorSettings` (torch
2.12+) returns the last string set (the environment's at start), not the state in force: expandable_segments
from an earlier string is added back.

Setting expandable_segments only records it: the setters never check it. The allocator acts on it when it
next reserves memory, and only then does a build without the driver API it needs warn "expandable_segments
not supported on this platform" (`CUDAAllocatorConfig::expandable_segments()`, TORCH_WARN_ONCE: once per
process) and keep ordinary segments. Those builds: Windows (c10/cuda/CMakeLists.txt defines
PYTORCH_C10_DRIVER_API_SUPPORTED only off Windows) and ROCm (before torch 2.12 always; 2.13 supports ROCm
7+; 2.12 not checked); the Linux CUDA wheels (libc10_cuda.so, 2.2 to 2.10) do not even contain that
warning. Switching on changes only segments reserved afterwards: `torch.cuda.empty_cache()` returns the
cached ones.

MPS (aten/src/ATen/mps/MPSAllocator.h and .mm, torch 2.2 to 2.13): the hard limit is the high-watermark
ratio times Metal's recommendedMaxWorkingSetSize (`torch.mps.recommended_max_memory()`, torch 2.5+; about 75%
of the RAM), counted against everything Metal holds for the process (`torch.mps.driver_allocated_memory()`).
The ratio is PYTORCH_MPS_HIGH_WATERMARK_RATIO, read once when the allocator starts (strtod), default 1.7, 0
for no limit; `torch.mps.set_per_process_memory_fraction(f)` sets it to f and has no getter.
"""
from __future__ import annotations

import json
import os
import sys

#: Environment variables torch 2.10+ reads its allocator settings from, in the order it looks at them
#: (older versions read fewer: `env_vars_read()`).
ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

_set_here: str | None = None    # the settings enable_expandable_segments last set in this process
NEW_SETTER = "torch._C._accelerator_setAllocatorSettings"
OLD_SETTER = "torch.cuda.memory._set_allocator_settings"


def current_allocator_conf(*, runtime: bool = True) -> str:
    """The allocator settings in force: the last settings string set at runtime where torch says (2.12+)
    or cuda_magic set one, else the environment's (`env_allocator_conf()`), else ''; with
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


def installed_torch_version() -> tuple[int, int] | None:
    """(major, minor) of the torch loaded, else of the one installed; None where neither says. Never
    imports torch."""
    torch = sys.modules.get("torch")
    text = getattr(torch, "__version__", None) if torch is not None else None
    if text is None:
        try:
            from importlib.metadata import version

            text = version("torch")
        except Exception:  # not installed, or no metadata
            return None
    try:
        major, minor = (int(x) for x in str(text).split(".")[:2])
    except ValueError:
        return None
    return major, minor


def env_vars_read() -> tuple[str, ...]:
    """The variables the installed torch reads its allocator settings from, in its order (see the module
    docstring). A torch whose version cannot be read is taken as a current one."""
    version = installed_torch_version()
    if version is None or version >= (2, 10):
        return ENV_VARS
    # None where torch is loaded and a CUDA build; "unknown" where torch is not loaded yet
    hip = getattr(getattr(sys.modules.get("torch"), "version", None), "hip", "unknown")
    if version >= (2, 8) and hip is not None:
        return ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
    return ("PYTORCH_CUDA_ALLOC_CONF",)


def env_allocator_conf() -> str:
    """The settings torch read from the environment at start-up ('' where none is set): the first set of
    `env_vars_read()`."""
    for name in env_vars_read():
        value = os.environ.get(name)
        if value is not None:
            return value.strip()
    return ""


def env_var_to_set() -> str:
    """The variable a user sets before starting Python for torch to read: the one torch reads now where
    one is set (another would lose to it), else PYTORCH_ALLOC_CONF from torch 2.10 (the name torch's own
    messages give), else PYTORCH_CUDA_ALLOC_CONF."""
    names = env_vars_read()
    for name in names:
        if name in os.environ:
            return name
    return names[-1] if "PYTORCH_ALLOC_CONF" in names else "PYTORCH_CUDA_ALLOC_CONF"


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
    version = installed_torch_version()          # unreadable: assume a current torch
    return NEW_SETTER if version is None or version >= (2, 10) else OLD_SETTER


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


def unsupported_build(torch) -> str | None:
    """Why this torch build is known to ignore expandable_segments (it warns at the next allocation, not
    when set), or None where it is not known to: see the module docstring."""
    if sys.platform == "win32":
        return ("torch's Windows builds lack the CUDA driver API it needs (they ignore the setting and warn "
                "\"expandable_segments not supported on this platform\" at the next allocation)")
    hip = getattr(getattr(torch, "version", None), "hip", None)
    if hip:
        version = installed_torch_version()
        rocm = str(hip).split(".")[0]
        if (version is not None and version < (2, 12)) or (rocm.isdigit() and int(rocm) < 7):
            return (f"torch {torch.__version__} on ROCm {hip} ignores it (torch supports it on ROCm 7 and "
                    "later, from 2.13); it warns \"expandable_segments not supported on this platform\" at "
                    "the next allocation")
    return None


def enable_expandable_segments(simulated=None) -> str:
    """Switch expandable_segments on in the allocator settings for this process now, keeping the other
    options.

    Returns a sentence saying what is known now and how to check the rest: torch only records the
    setting; it acts on it, and a build that cannot use it says so, when it next reserves memory.
    Raises RuntimeError saying why where it cannot: no CUDA device, the cudaMallocAsync backend (which has
    no expandable segments), or a build known to ignore it (`unsupported_build`).

    `simulated`: the simulated device (devices/simulated.py) a run is metered on. Its model of the caching
    allocator is switched instead of CUDA's (`SimulatedDevice.enable_expandable_segments`: for simulated
    devices from then on, as torch's setting is the process's).
    """
    global _set_here
    if simulated is not None:
        return simulated.enable_expandable_segments()
    import torch

    from cuda_magic.devices.probe import cuda_device_count, cuda_started

    if not (cuda_started() or cuda_device_count() > 0):   # not is_available(): it initialises the driver
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a build without CUDA"
        raise RuntimeError(
            f"cannot switch on expandable_segments: no CUDA device is available (torch "
            f"{torch.__version__}, {build}). It is an option of the CUDA caching allocator; the CPU, "
            "MPS and the simulated device have nothing to switch.")
    why_not = unsupported_build(torch)
    if why_not is not None:
        raise RuntimeError(f"cannot switch on expandable_segments: {why_not}")
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
    # torch's setters (2.2 to 2.13) only record the string: whether the build can use it shows when the
    # allocator next reserves memory (a once-per-process warning there), which the sentence below says
    if setter is None:
        torch.cuda.memory._set_allocator_settings(new)
    else:
        setter(new)
    _set_here = new
    return (f"expandable_segments switched on in the allocator settings (now {new!r}). torch acts on it "
            f"when it next reserves memory, not now: a build or driver that cannot use it says so then. "
            f"Segments reserved before stay as they were: torch.cuda.empty_cache() returns the cached ones, "
            f"so that later ones are expandable. To check, after the next allocation: the segments in "
            f"torch.cuda.memory_snapshot() say is_expandable. To have it from the start, set "
            f"{env_var_to_set()}={new} before starting Python.")


# ---- MPS: the allocator's hard limit ---------------------------------------------------------------

#: torch's MPS high-watermark ratio when PYTORCH_MPS_HIGH_WATERMARK_RATIO is not set
#: (MPSHeapAllocatorImpl::default_high_watermark_ratio, 1.7 in torch 2.2 to 2.13).
MPS_DEFAULT_RATIO = 1.7


def _strtod(text: str) -> float:
    """C's strtod, as torch reads the ratio: the longest leading number, 0.0 where there is none."""
    import re

    match = re.match(r"\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)", text)
    return float(match.group(1)) if match else 0.0


def mps_watermark_ratio() -> float:
    """The high-watermark ratio the MPS allocator started with: PYTORCH_MPS_HIGH_WATERMARK_RATIO, else
    1.7; 0 means no limit. torch reads the variable once, when the allocator starts: a later change of
    os.environ is not seen by torch (nor is a torch.mps.set_per_process_memory_fraction, which has no
    getter)."""
    text = os.environ.get("PYTORCH_MPS_HIGH_WATERMARK_RATIO")
    return MPS_DEFAULT_RATIO if text is None else _strtod(text)


def mps_memory_limit(recommended: int | None, ratio: float | None = None) -> int | None:
    """The bytes the MPS allocator lets this process hold (its driver-allocated memory, cached buffers and
    MPSGraph's own included) before it raises out of memory: `ratio` (default `mps_watermark_ratio()`)
    times Metal's recommended working set, truncated as torch does; None for no limit (ratio 0) or where
    the recommended size is not known (torch before 2.5)."""
    ratio = mps_watermark_ratio() if ratio is None else ratio
    if recommended is None or ratio == 0.0:
        return None
    return int(ratio * float(recommended))


def mps_capacity(recommended: int | None) -> int | None:
    """What this process can hold on MPS: torch's limit (`mps_memory_limit`), or with no limit (ratio 0)
    the machine's RAM (sysconf), which MPS shares with the CPU. None where the recommended size is not
    known (torch before 2.5) or the system does not say."""
    if recommended is None:
        return None
    limit = mps_memory_limit(recommended)
    if limit is not None:
        return limit
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None
