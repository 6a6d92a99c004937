"""`%debug` and `%tb` after a guarded OOM say that the failed run's frames were freed to give the memory
back (issue 9, item 6), under `%%oomguard` and under `%oomguard on`; other errors keep their debugger."""
from __future__ import annotations

import sys

import pytest

from conftest import run_ok

FAIL = "x = torch.ones(64, 2**20)"


def failing_cell(ip, guard_all: bool):
    if guard_all:
        ip.run_line_magic("gpumem", "--simulate 16MiB -q")
        ip.run_line_magic("oomguard", "on")
        return ip.run_cell(FAIL)
    return ip.run_cell("%%oomguard -l 16MiB -q\n" + FAIL)


@pytest.mark.parametrize("guard_all", [False, True], ids=["%%oomguard", "%oomguard on"])
def test_debug_and_tb_say_the_frames_were_freed(tip, capsys, guard_all):
    result = failing_cell(tip, guard_all)
    assert not result.success and getattr(type(sys.last_value), "frames_freed", False)
    capsys.readouterr()
    tip.run_line_magic("debug", "")
    assert "frames were freed to give the memory back" in capsys.readouterr().out
    tip.run_line_magic("tb", "")
    out = capsys.readouterr()
    assert "frames were freed to give the memory back" in out.out + out.err


def test_debug_after_another_error_is_the_usual_debugger(tip, monkeypatch):
    """The wrapper only speaks for a freed OOM: any other error reaches IPython's own debugger."""
    seen = []
    monkeypatch.setattr(vars(tip)["debugger"], "original", lambda force=False: seen.append(force))
    tip.run_cell("raise ValueError('x')")
    tip.run_line_magic("debug", "")
    assert seen == [True]


def test_unload_removes_the_debugger_wrapper(tip):
    assert "debugger" in vars(tip)
    tip.run_line_magic("unload_ext", "cuda_magic")
    assert "debugger" not in vars(tip)
    run_ok(tip, "1")
