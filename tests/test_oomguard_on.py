"""`%oomguard on|off`: every cell guarded through IPython's custom exception handling."""
from __future__ import annotations

import gc
import sys

import pytest
from conftest import STEP, run_ok



@pytest.fixture
def oip(no_gpu, tip):
    run_ok(tip, STEP)
    tip.run_line_magic("gpumem", "--simulate 64MiB -q")
    return tip


def test_on_frees_a_failed_cells_tensors_and_explains(oip, capsys):
    oip.run_line_magic("oomguard", "on")
    capsys.readouterr()
    result = oip.run_cell("out = step(1024)", store_history=True)
    assert result.success is False
    assert "CUDA out of memory" in str(result.error_in_exec)
    del result
    gc.collect()
    assert oip.user_ns["refs"][0]() is None
    out = capsys.readouterr().out
    assert "out of memory" in out and "Failed at cell line 1" in out and "Diagnosis" in out
    assert "reclaimed" in out.lower()
    assert "out" not in oip.user_ns


def test_off_stops_it_and_a_failed_cell_keeps_its_tensors(oip):
    custom = (oip.custom_exceptions, oip.CustomTB)
    oip.run_line_magic("oomguard", "on")
    oip.run_line_magic("oomguard", "off")
    assert (oip.custom_exceptions, oip.CustomTB) == custom
    result = oip.run_cell("out = step(1024)", store_history=True)
    assert result.success is False
    del result
    gc.collect()
    assert oip.user_ns["refs"][0]() is not None


def test_bare_says_which_is_active(ip, capsys):
    capsys.readouterr()
    ip.run_line_magic("oomguard", "")
    assert "%oomguard is off" in capsys.readouterr().out
    ip.run_line_magic("oomguard", "on")
    ip.run_line_magic("oomguard", "on")        # twice: still one handler
    capsys.readouterr()
    ip.run_line_magic("oomguard", "")
    assert "%oomguard is on" in capsys.readouterr().out
    ip.run_line_magic("oomguard", "off")
    capsys.readouterr()
    ip.run_line_magic("oomguard", "")
    assert "%oomguard is off" in capsys.readouterr().out


@pytest.mark.parametrize("cell, name", [("raise KeyError('k')", "KeyError"),
                                        ("raise RuntimeError('plain runtime error')", "RuntimeError"),
                                        ("def f():\n    raise ValueError('v')\nf()", "ValueError")])
def test_non_oom_errors_show_their_normal_traceback(oip, capsys, cell, name):
    oip.run_line_magic("oomguard", "on")
    capsys.readouterr()
    result = oip.run_cell(cell, store_history=True)
    assert result.success is False
    assert type(result.error_in_exec).__name__ == name
    assert sys.last_value is result.error_in_exec
    out = capsys.readouterr().out
    assert "Traceback (most recent call last)" in out and name in out
    assert "Diagnosis" not in out


def test_restores_a_handler_that_was_there_before(oip, capsys):
    seen = []

    def handler(shell, etype, value, tb, tb_offset=None):
        seen.append(value)

    oip.set_custom_exc((KeyError,), handler)
    oip.run_line_magic("oomguard", "on")
    result = oip.run_cell("raise KeyError('forwarded')")
    assert [str(v) for v in seen] == ["'forwarded'"]
    del result
    oip.run_line_magic("oomguard", "off")
    assert oip.custom_exceptions == (KeyError,)
    oip.run_cell("raise KeyError('again')")
    assert len(seen) == 2
