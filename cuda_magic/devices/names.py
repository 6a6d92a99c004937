"""Device names as users type them ('cuda:1', 'gpu', '1', 'sim', 'cpu'), resolved against the devices
present. Used by the magics' `-d` and the Python API's `device=`."""
from __future__ import annotations

import re

_DEVICE_RE = re.compile(r"^(?:(cuda|gpu|sim|mps|cpu|xpu)(?::(\d+))?|(\d+))$", re.IGNORECASE)


def resolve_device(text, available: list[str], flag: str = "-d") -> str:
    """The device key among `available` ('cuda:1', 'sim:0', 'cpu') that `text` names; ValueError (whose
    message starts with `flag`) where it names none of them."""
    raw = str(text).strip()
    m = _DEVICE_RE.match(raw)
    listed = ", ".join(available) if available else "none"
    named = f"{flag}{raw!r}" if flag.endswith("=") else f"{flag} {raw!r}"     # device='x' / -d 'x'
    if not m:
        raise ValueError(f"{named} is not a device: give an index (0, 1) or a name like cuda:1; "
                         f"devices here: {listed}")
    if m.group(3) is not None:
        index = int(m.group(3))
        gpus = [k for k in available if k.split(":")[0] in ("cuda", "xpu")] or \
            [k for k in available if k.startswith("sim:")]
        if index < len(gpus):
            return gpus[index]
    else:
        kind = m.group(1).lower().replace("gpu", "cuda")
        index = m.group(2)
        key = kind if index is None and kind in ("cpu", "mps") else f"{kind}:{index or 0}"
        if key in available:
            return key
    raise ValueError(f"{named}: no such device; devices here: {listed}")


def present_devices() -> list[str]:
    """The keys of the devices here now (reading them never starts CUDA)."""
    from cuda_magic.devices.backends import read_devices

    return [d.key for d in read_devices().devices]
