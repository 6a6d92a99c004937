"""Sizes: the one unit table answers both "what does 4GiB mean" and "is this word a unit"."""
from __future__ import annotations

import pytest

from cuda_magic.units import SizeError, format_bytes, is_unit, parse_size


@pytest.mark.parametrize("word", ["B", "KiB", "MiB", "GiB", "TiB", "KB", "MB", "GB", "TB", "gib", " mb "])
def test_every_unit_word_is_a_size_unit(word):
    assert is_unit(word)
    assert parse_size(f"2{word.strip()}") >= 2


@pytest.mark.parametrize("word", ["on", "off", "5", "GiBs", "", "PB"])
def test_other_words_are_not_units(word):
    assert not is_unit(word)
    with pytest.raises(SizeError):
        parse_size(f"2{word}") if word not in ("5", "") else parse_size(f"2{word}", allow_fraction=False)


def test_a_size_without_fractions_does_not_offer_one():
    """`--simulate` takes no fraction (there is no capacity to take it of): its message must not offer one."""
    with pytest.raises(SizeError) as no_fraction:
        parse_size("nan", allow_fraction=False)
    assert "fraction" not in str(no_fraction.value) and "4GiB" in str(no_fraction.value)
    with pytest.raises(SizeError) as with_fraction:
        parse_size("nan", 1 << 30)
    assert "a fraction of the capacity (0.25)" in str(with_fraction.value)


@pytest.mark.parametrize("nbytes, signed, text", [
    (1023, False, "1023 B"), (1023.9, False, "1023 B"), (0, True, "±0 B"), (1024, False, "1.00 KiB"),
    ((1 << 20) - 1, False, "1024.00 KiB"),           # rounds up to 1024 but stays in the smaller unit
    (1 << 20, True, "+1.00 MiB"), ((1 << 30) - 1, False, "1024.00 MiB"), (1 << 30, False, "1.00 GiB"),
    (1.5 * (1 << 30), False, "1.50 GiB"), (-1536, True, "-1.50 KiB"), (-(1 << 40) + 1, False, "-1024.00 GiB"),
    (1 << 40, True, "+1.00 TiB"), (1 << 50, False, "1.00 PiB"), (5 << 60, False, "5120.00 PiB"),
])
def test_sizes_read_in_the_largest_unit_below_them(nbytes, signed, text):
    """format_bytes picks the unit by comparison and divides once (it runs after every cell under
    --watch): the texts at each unit's edges are those of dividing by 1024 step by step."""
    assert format_bytes(nbytes, signed=signed) == text
