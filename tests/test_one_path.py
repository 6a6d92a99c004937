"""One path after an OOM for `%%oomguard`, the Python API and `%oomguard on` (issue 8, "one path for each
fact"): the device that ran out is the one measured, Ctrl-C is not an error, an error's text is kept, the
decorator's diagnosis knows the names holding memory."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def test_guard_all_measures_the_device_that_ran_out(tip):
    tip.run_line_magic("gpumem", "--simulate 32MiB -q")
    tip.run_line_magic("oomguard", "on")
    from cuda_magic.magics.state import get_state

    tip.run_cell("x = torch.ones(64, 2**20)")
    report = get_state(tip).guard_all.last_report
    assert report.device == "sim:0" and [d.key for d in report.before] == ["sim:0"]
    assert [d.key for d in report.after] == ["sim:0"] and report.outcome == "oom"


@pytest.mark.parametrize("raised, outcome, text", [
    ("KeyboardInterrupt()", "interrupted", "KeyboardInterrupt"),
    ("ValueError('bad shape (3, 4)')", "error", "ValueError: bad shape (3, 4)"),
])
def test_context_manager_labels_and_keeps_the_error(torch_warm, raised, outcome, text):
    from cuda_magic import oomguard

    guard = oomguard(quiet=True)
    with pytest.raises(BaseException):
        with guard:
            raise eval(raised)
    assert str(guard.report.outcome) == outcome
    assert guard.report.exception_text == text


def test_decorator_diagnosis_names_the_holders_in_a_script():
    script = textwrap.dedent("""
        import torch
        from cuda_magic import oomguard, simulated_device

        with simulated_device("64MiB"):
            kept = [torch.ones(10, 2**20)]          # a module-level name holding 40 MiB

            @oomguard(quiet=True, raise_on_oom=False)
            def step():
                return torch.ones(8, 2**20)

            step()
        print("HOLDERS", [(h.name, h.bytes) for h in step.last_report.diagnosis.holders])
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "HOLDERS [('kept', 41943040)" in out.stdout, out.stdout


def test_search_probes_are_marked_with_their_durations(tip):
    """Item 3: the cost of --search is shown: each probe (undone) in the attempts table, with its time."""
    tip.run_cell("bs = 1000")
    report = tip.run_cell("%%oomguard -l 64MiB -q -o -r bs --search\nx = torch.ones(bs, 65536)").result
    probes = [a for a in report.attempts if a.probe]
    assert probes and all(a.outcome == "ok" and a.duration > 0 for a in probes)
    text = str(report)
    assert text.count("fitted, a probe (rolled back)") == len(probes)
    assert report.probe_time == sum(a.duration for a in probes)
