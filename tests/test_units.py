"""Sizes: the one unit table answers both "what does 4GiB mean" and "is this word a unit"."""
from __future__ import annotations

import pytest

from cuda_magic.units import SizeError, is_unit, parse_size


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
