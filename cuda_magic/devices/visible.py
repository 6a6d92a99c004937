"""Which NVML devices this process's CUDA devices are, read by torch's own rules.

CUDA_VISIBLE_DEVICES is read exactly as torch's `torch.cuda._parse_visible_devices` and
`_transform_uuid_to_ordinals` read it on a CUDA build (tests compare the two): a list of ordinals parsed
like C's strtoul (`1gpu2` is 1), stopping at the first negative or unreadable entry, a repeated entry
making the whole list empty; or a list of `GPU-` / `MIG-` UUID prefixes, each matching exactly one UUID,
stopping at the first that does not. Ordinals count in CUDA's order, which is NVML's PCI order only with
CUDA_DEVICE_ORDER=PCI_BUS_ID (CUDA's default is fastest first). Once torch has started CUDA, devices are
matched by the UUID torch reports (torch 2.4+) instead.
"""
from __future__ import annotations

import os


def parse_visible_devices(spec: str | None) -> list[int] | list[str] | None:
    """torch's reading of CUDA_VISIBLE_DEVICES: None where unset (every device), else ordinals or UUIDs."""
    if spec is None:
        return None
    if spec.startswith(("GPU-", "MIG-")):
        prefix = spec[:4]
        uuids: list[str] = []
        for item in spec.split(","):
            if item in uuids:
                return []          # a repeated entry hides every device
            if not item.startswith(prefix):
                break
            uuids.append(item)
        return uuids
    ordinals: list[int] = []
    for item in spec.split(","):
        value = _strtoul(item.strip())
        if value in ordinals:
            return []
        if value < 0:
            break
        ordinals.append(value)
    return ordinals


def _strtoul(text: str) -> int:
    """The number `text` starts with (an optional sign, then digits), or -1."""
    end = 0
    for i, ch in enumerate(text):
        if not (ch.isdigit() or (i == 0 and ch in "+-")):
            break
        end = i + 1
    try:
        return int(text[:end]) if end else -1
    except ValueError:     # a sign alone
        return -1


def uuid_ordinals(candidates: list[str], uuids: list[str]) -> list[int]:
    """Indices into `uuids` of each UUID prefix in `candidates`; stops at one that matches none or several."""
    found: list[int] = []
    for candidate in candidates:
        matches = [i for i, u in enumerate(uuids) if u.startswith(candidate)]
        if len(matches) != 1:
            break
        if matches[0] in found:
            return []
        found.append(matches[0])
    return found


def visible_indices(count: int, uuid_of) -> tuple[list[int] | None, str | None]:
    """(NVML indices of CUDA devices 0, 1, ..., a note or None) before torch starts CUDA.

    `count`: how many devices NVML lists; `uuid_of(i)`: NVML device i's UUID. None instead of the list
    where NVML cannot say (MIG instances are not NVML's top-level devices)."""
    parsed = parse_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))
    if parsed is None:
        indices = list(range(count))
    elif parsed and isinstance(parsed[0], str):
        if parsed[0].startswith("MIG-"):
            return None, "MIG instances in CUDA_VISIBLE_DEVICES: figures appear once torch uses the GPU"
        indices = uuid_ordinals(parsed, [uuid_of(i) or "" for i in range(count)])
        return indices, None
    else:
        indices = []
        for value in parsed:
            if value >= count:
                break          # torch trims the list at the first device NVML does not have
            indices.append(value)
    return indices, None


def pci_order_known() -> bool:
    """Whether CUDA numbers devices in NVML's (PCI bus) order."""
    return os.environ.get("CUDA_DEVICE_ORDER", "").strip().upper() == "PCI_BUS_ID"


def torch_uuid(torch, index: int) -> str | None:
    """NVML's spelling ('GPU-...') of the UUID torch reports for a started CUDA device (torch 2.4+), or
    None. Reads device properties, which start CUDA: call only once torch has started it."""
    try:
        uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    except (AssertionError, RuntimeError):
        return None
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"
