"""The options line of `%%oomguard`: parsed once per distinct line (a fresh copy each time), and `$name` /
`{expr}` expanded as IPython expands any magic's line, though the magic opts out of IPython's own
expansion (which copies the whole namespace for every cell, a cost that grows with the notebook)."""
from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from cuda_magic.magics.args import parse_args

MiB = 2**20


def test_a_line_parsed_again_gives_a_fresh_copy(ip):
    from cuda_magic.magics.guard import GuardMagics

    magics = ip.magics_manager.registry[GuardMagics.__name__]
    first = parse_args(magics.oomguard, "-q -l '64 MiB'")
    assert first.quiet and first.limit == "64 MiB"          # quotes removed
    first.limit = "changed"
    first.quiet = False
    second = parse_args(magics.oomguard, "-q -l '64 MiB'")
    assert second.quiet and second.limit == "64 MiB"        # what a caller changed stays its own
    assert parse_args(magics.oomguard, "").quiet is False


def test_a_bad_line_is_a_usage_error_every_time(ip):
    from cuda_magic.magics.guard import GuardMagics

    magics = ip.magics_manager.registry[GuardMagics.__name__]
    for _ in range(2):
        with pytest.raises(UsageError):
            parse_args(magics.oomguard, "--no-such-option")


def test_dollar_and_brace_names_are_expanded(ip):
    ip.run_cell("cap = '64MiB'\nhalf = 16")
    report = ip.run_cell("%%oomguard -q -o -l $cap\nx = 1\n").result
    assert report.limit == 64 * MiB
    report = ip.run_cell("%%oomguard -q -o -l {half * 2}MiB\nx = 1\n").result
    assert report.limit == 32 * MiB


def test_expansion_reads_the_frame_ipython_reads(ip):
    """A line magic called from a function: IPython expands from the function's own names."""
    ip.run_cell("word = 'on'")
    ip.run_cell("def switch():\n    word = 'off'\n    get_ipython().run_line_magic('oomguard', '$word')\n")
    ip.run_cell("%oomguard on")
    ip.run_cell("switch()")
    from cuda_magic.magics.state import get_state

    assert get_state(ip).guard_all is None                  # 'off', the function's word, not 'on'


def test_a_line_without_dollar_or_brace_is_not_expanded(ip, monkeypatch):
    """IPython's var_expand copies the namespace: a plain line never reaches it."""
    def copy_of_everything(*_, **__):
        raise AssertionError("var_expand called for a line with nothing to expand")

    monkeypatch.setattr(ip, "var_expand", copy_of_everything)
    report = ip.run_cell("%%oomguard -q -o -l 64MiB\nx = 1\n").result
    assert report.limit == 64 * MiB
