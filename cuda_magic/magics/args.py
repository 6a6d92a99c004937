"""Validation of what users type into the magics: each problem becomes one-line UsageError."""
from __future__ import annotations

import re

from IPython.core.error import UsageError

from cuda_magic.units import SizeError, parse_size


def parse_count(text, flag: str = "-n") -> int:
    try:
        value = int(str(text).strip())
    except ValueError:
        raise UsageError(f"{flag} takes a whole number >= 0, not {text!r}") from None
    if value < 0:
        raise UsageError(f"{flag} takes a whole number >= 0, not {value}")
    return value


def parse_size_arg(text, flag: str, capacity: int | None = None, *, allow_fraction: bool = True) -> int:
    try:
        return parse_size(text, capacity, allow_fraction=allow_fraction)
    except SizeError as exc:
        raise UsageError(f"{flag}: {exc}") from None


_DEVICE_RE = re.compile(r"^(?:(cuda|gpu|sim|mps|cpu|xpu)(?::(\d+))?|(\d+))$", re.IGNORECASE)


def parse_device(text: str, available: list[str]) -> str:
    """The device key among `available` ('cuda:1', 'sim:0', 'cpu') that `text` names."""
    raw = str(text).strip()
    m = _DEVICE_RE.match(raw)
    listed = ", ".join(available) if available else "none"
    if not m:
        raise UsageError(f"-d {raw!r} is not a device: give an index (0, 1) or a name like cuda:1; "
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
    raise UsageError(f"-d {raw!r}: no such device; devices here: {listed}")


def parse_args(magic_func, line: str):
    """magic_arguments parsing, with every argparse complaint as the one-line UsageError."""
    from IPython.core.magic_arguments import parse_argstring

    try:
        args = parse_argstring(magic_func, line)
    except UsageError:
        raise
    except SystemExit:
        raise UsageError(f"could not read the options {line!r}; see {magic_func.__name__}?") from None
    except ValueError as exc:   # unbalanced quotes in shlex
        raise UsageError(f"could not read the options {line!r}: {exc}") from None
    # IPython splits magic lines without removing quotes: -l '5 GiB' arrives as "'5 GiB'".
    for key, value in vars(args).items():
        if isinstance(value, str):
            setattr(args, key, _unquote(value))
        elif isinstance(value, list):
            setattr(args, key, [_unquote(v) if isinstance(v, str) else v for v in value])
    return args


def _unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text
