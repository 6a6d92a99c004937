"""What the Python API and `-o` show (issue 9, item 7): nothing for a call that fits (at once or after
retries: SPEC, "prints nothing for a call that fits"), advice in the API's
words on an OOM, the report as one line as a cell's value; `%freecuda --offload` on the simulated device
lists only what still holds its memory."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from conftest import run_ok

SCRIPT = textwrap.dedent("""
    import torch
    from cuda_magic import oomguard

    @oomguard(retry="bs", limit="64MiB")
    def step(bs=8):
        return torch.ones(bs, 65536).sum().item()

    step()
    print("REPORT", step.last_report.outcome)
    step(bs=1024)                       # 256 MiB: fits only after a retry, and that is a call that fits
    print("REPORT", step.last_report.outcome, step.last_report.final_value < 1024)

    @oomguard(limit="16MiB")
    def too_big():
        return torch.ones(64, 2**20)

    try:
        too_big()
    except torch.cuda.OutOfMemoryError as exc:
        print("RAISED", exc)
""")


def test_api_is_silent_when_it_fits_and_speaks_of_itself_on_an_oom():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    first, rest = out.stdout.split("REPORT ok\n", 1)
    assert first == ""                                  # the call that fitted printed nothing
    retried, rest = rest.split("REPORT recovered True\n", 1)
    assert retried == ""                                # nor the one that fitted after retries (SPEC)
    assert "oomguard(" in rest or "cuda_magic.release()" in rest
    for magic_words in ("%%oomguard", "%freecuda", "%gpumem", "kernel"):
        assert magic_words not in rest, (magic_words, rest)
    assert "RAISED out of memory in this call" in rest


def test_quiet_output_is_one_line(tip, capsys):
    run_ok(tip, "pass")
    capsys.readouterr()
    tip.run_cell("%%oomguard -q -o\nx = torch.ones(4)", store_history=True)
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1 and out.endswith("<GuardReport cpu: ok>"), out


def test_offloaded_model_is_not_listed_as_holding_the_simulated_device(tip, capsys):
    tip.run_line_magic("gpumem", "--simulate 256MiB -q")
    run_ok(tip, "from torch import nn\nmodel = nn.Linear(1024, 1024)\n"
                "opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n"
                "model(torch.randn(8, 1024)).sum().backward(); opt.step()\nother = torch.ones(1024, 256)")
    capsys.readouterr()
    tip.run_line_magic("freecuda", "--offload model opt")
    out = capsys.readouterr().out
    held = out.split("Still holding device memory", 1)[1]
    assert "other" in held and "model" not in held and "opt" not in held, out


def test_bad_arguments_are_named_errors_before_anything_runs():
    """Bad input to the API: a one-line error that says what to do, before the function runs."""
    import cuda_magic as cm

    with pytest.raises(ValueError, match=r"retry= takes the name of a keyword argument"):
        cm.oomguard(retry=3)
    calls = []

    @cm.oomguard(device="cuda:9")
    def f():
        calls.append(1)

    with pytest.raises(ValueError, match=r"device='cuda:9': no such device; devices here: .*cpu"):
        f()
    assert calls == []
    with pytest.raises(TypeError, match="explain\\(\\) takes an exception"):
        cm.explain(42)
    assert "not an out-of-memory message" in cm.explain("KeyError: 'x'").summary
    with pytest.raises(TypeError, match="diff\\(\\) takes two snapshot\\(\\) results"):
        cm.diff(1, 2)
