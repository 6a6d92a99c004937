"""Sizes: parsing what users type and formatting bytes for display. Inside, sizes are int bytes."""
from __future__ import annotations

import numbers
import re
from dataclasses import dataclass

_UNITS = {
    "B": 1,
    "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4,
    "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]+)\s*$")
_NUMBER_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*$")


def is_unit(word: str) -> bool:
    """Whether `word` alone is a unit parse_size knows ('GiB', 'mb'): a size split by a space."""
    return str(word).strip().upper() in _UNITS


class SizeError(ValueError):
    """A size the user typed cannot be understood; the message says what is accepted."""


@dataclass(frozen=True)
class Limit:
    """A cap as the user typed it, parsed once: bytes, or a fraction of a capacity known only once the
    device is chosen (`of`)."""

    nbytes: int | None = None
    fraction: float | None = None
    text: str = ""

    def of(self, capacity: int | None) -> int:
        """The cap in bytes on a device of `capacity` bytes (a fraction needs it: SizeError where None)."""
        if self.nbytes is not None:
            return self.nbytes
        if capacity is None:
            raise SizeError(f"size {self.text!r} is a fraction, but the capacity is not known here: give a unit")
        return max(1, int(capacity * self.fraction))


def parse_limit(text, *, allow_fraction: bool = True) -> Limit:
    """A Limit from '4GiB', '512MB', '64MiB', '1024B', or a fraction of the capacity such as '0.25'.

    A fraction must be above 0 and at most 1. A bare number above 1, zero, a negative number or an
    unknown unit raises SizeError.
    """
    raw = str(text).strip()
    number = _NUMBER_RE.match(raw)
    if number:
        value = float(number.group(1))
        if not allow_fraction:
            raise SizeError(f"size {raw!r} has no unit: write it like 4GiB, 512MB or 64MiB")
        if not 0 < value <= 1:
            raise SizeError(
                f"size {raw!r} is not valid: give a fraction of the capacity above 0 and at most 1 "
                "(0.25), or a size with a unit (4GiB, 512MB, 64MiB)")
        return Limit(fraction=value, text=raw)
    match = _SIZE_RE.match(raw)
    if not match:
        fraction = " or a fraction of the capacity (0.25)" if allow_fraction else ""
        raise SizeError(
            f"size {raw!r} is not valid: give a size with a unit (4GiB, 512MB, 64MiB; units B, KiB, MiB, "
            f"GiB, TiB, KB, MB, GB, TB){fraction}")
    value, unit = float(match.group(1)), match.group(2).upper()
    if unit not in _UNITS:
        raise SizeError(
            f"size {raw!r} has an unknown unit {match.group(2)!r}: use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB")
    nbytes = int(value * _UNITS[unit])
    if nbytes <= 0:
        raise SizeError(f"size {raw!r} is not valid: it must be more than 0 bytes")
    return Limit(nbytes=nbytes, text=raw)


def parse_size(text: str, capacity: int | None = None, *, allow_fraction: bool = True) -> int:
    """Bytes for '4GiB', '512MB', '64MiB', '1024B', or a fraction of `capacity` such as '0.25'
    (`parse_limit`, resolved on `capacity`)."""
    return parse_limit(text, allow_fraction=allow_fraction).of(capacity)


def format_bytes(n: int | float | None, signed: bool = False) -> str:
    """'1.50 GiB', '512 B'; with signed=True a leading '+' or '-'. None gives 'n/a'."""
    if n is None:
        return "n/a"
    sign = ""
    if signed:
        sign = "+" if n > 0 else ("-" if n < 0 else "±")
    elif n < 0:
        sign = "-"
    n = abs(n)
    if n < 1024:
        return f"{sign}{int(n)} B"
    # the unit found by comparison, one division (by a power of two: the same float as dividing by 1024
    # step by step); printed after every cell under --watch
    if n < 1 << 20:
        return f"{sign}{n / 1024.0:.2f} KiB"
    if n < 1 << 30:
        return f"{sign}{n / 1048576.0:.2f} MiB"
    if n < 1 << 40:
        return f"{sign}{n / 1073741824.0:.2f} GiB"
    if n < 1 << 50:
        return f"{sign}{n / 1099511627776.0:.2f} TiB"
    return f"{sign}{n / 1125899906842624.0:.2f} PiB"


def format_duration(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    if seconds < 120:
        return f"{seconds:.2f} s"
    return f"{int(seconds // 60)} min {seconds % 60:.0f} s"


def is_positive_int(value) -> bool:
    """A whole number above 0: int or numpy's integers, not bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1
