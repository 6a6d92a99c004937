"""Objects in the namespace (or in a failing cell's frames) that refuse to be looked at never crash
`%gpumem`, a guarded cell's report or `%oomguard on`: a dead `weakref.proxy` (every attribute raises
ReferenceError, `isinstance` included), an object whose `__getattr__`, `__eq__`, `__hash__`, `__len__` or
`__class__` raises, a property that raises. They are skipped, and the rest is reported as usual."""
from __future__ import annotations

import pytest

from conftest import run_ok

HOSTILE = """
import weakref

class Gone:
    pass

_target = Gone()
dead = weakref.proxy(_target)
del _target                                   # the proxy's referent is gone: touching it raises

class Angry:
    def __getattr__(self, name):
        raise RuntimeError(f"no {name} for you")
    def __eq__(self, other):
        raise RuntimeError("no comparing")
    def __hash__(self):
        raise RuntimeError("no hashing")
    @property
    def __class__(self):
        raise RuntimeError("no class")

class BadList(list):
    def __len__(self):
        raise RuntimeError("no length")

class Prop:
    @property
    def weights(self):
        raise ValueError("lazy and broken")

angry, bad, prop = Angry(), BadList([torch.ones(4)]), Prop()
nest = {"a": [dead, angry], Gone: prop}
kept = torch.ones(2**20)                        # a plain tensor: still named
"""


@pytest.fixture
def hostile(tip):
    tip.run_line_magic("gpumem", "--simulate 32MiB -q")
    run_ok(tip, HOSTILE)
    return tip


def test_gpumem_skips_them_and_names_the_rest(hostile, capsys):
    snap = hostile.run_line_magic("gpumem", "-o -n 5")
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err and "ReferenceError" not in out.out + out.err
    assert any("kept" in rec.names for rec in snap.tensor_list)


def test_a_guarded_oom_is_explained_with_them_around(hostile):
    run_ok(hostile, "def step():\n    local_dead = dead\n    local_angry = angry\n"
                    "    return torch.empty(64 * 2**20, dtype=torch.uint8)\n")
    result = hostile.run_cell("%%oomguard --no-raise -q -o\nstep()")
    assert result.success, result.error_in_exec
    report = result.result
    assert report.outcome == "oom" and report.diagnosis is not None
    assert "kept" in {h.name for h in report.diagnosis.holders}


def test_oomguard_on_explains_the_oom_with_them_around(hostile, capsys):
    hostile.run_line_magic("oomguard", "on")
    capsys.readouterr()
    hostile.run_cell("x = torch.empty(64 * 2**20, dtype=torch.uint8)")
    err = capsys.readouterr().err
    assert "could not explain" not in err and "ReferenceError" not in err
    from cuda_magic.magics.state import get_state

    report = get_state(hostile).guard_all.last_report
    assert report is not None and report.diagnosis is not None


def test_a_retry_rolls_back_around_them(hostile):
    run_ok(hostile, "bs = 64")
    report = hostile.run_cell("%%oomguard -r bs -q -o\ny = torch.empty(bs * 2**20, dtype=torch.uint8)").result
    assert report.outcome == "recovered" and report.final_value < 64


def test_freecuda_lists_what_holds_memory_with_them_around(hostile, capsys):
    report = hostile.run_line_magic("freecuda", "-o")
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    assert [name for name, _ in report.still_held][:1] == ["kept"]
