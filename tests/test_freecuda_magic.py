"""`%freecuda` in a real IPython shell: after an unguarded OOM on the simulated device, and on the output
cache and user variables. Without a GPU the CPU is the device, so CPU tensors count."""
from __future__ import annotations

import gc
import sys

import pytest
from conftest import STEP, run_ok
from IPython.core.error import UsageError

pytestmark = pytest.mark.usefixtures("no_gpu")



def test_frees_the_failed_frames_tensors_after_an_unguarded_oom(tip, capsys):
    run_ok(tip, STEP)
    tip.run_line_magic("gpumem", "--simulate 64MiB -q")
    result = tip.run_cell("out = step(1024)", store_history=True)
    assert not result.success
    assert "CUDA out of memory" in str(result.error_in_exec)
    del result
    gc.collect()
    ref = tip.user_ns["refs"][0]
    assert ref() is not None                      # held by sys.last_*, IPython's traceback, the result
    capsys.readouterr()
    report = tip.run_line_magic("freecuda", "-o")
    assert ref() is None
    assert report.freed["sim:0"] == 4 * 2**20
    assert "sys.last_value" in report.dropped and "IPython's stored traceback" in report.dropped
    assert getattr(sys, "last_value", None) is None
    assert "Freed" in capsys.readouterr().out


def test_a_tensor_held_only_by_the_output_cache(tip):
    result = run_ok(tip, "torch.ones(1000, 10)", store_history=True)
    n = result.execution_count
    del result
    run_ok(tip, f"ref = weakref.ref(Out[{n}])")
    gc.collect()
    assert tip.user_ns["ref"]() is not None
    report = tip.run_line_magic("freecuda", "-o -q")
    assert tip.user_ns["ref"]() is None
    assert f"Out[{n}]" in report.dropped
    assert n not in tip.user_ns["Out"]
    assert report.freed["cpu"] == 40_000


def test_named_variables_are_deleted(tip):
    run_ok(tip, "a = torch.ones(100)\nb = torch.ones(50)\nwa = weakref.ref(a)")
    report = tip.run_line_magic("freecuda", "a -o -q")
    assert report.deleted == ["a"]
    assert "a" not in tip.user_ns and "b" in tip.user_ns
    assert tip.user_ns["wa"]() is None
    assert ("b", 200) in report.still_held


def test_a_missing_name_deletes_nothing(tip):
    run_ok(tip, "a = torch.ones(100)")
    with pytest.raises(UsageError) as excinfo:
        tip.run_line_magic("freecuda", "a nosuch")
    assert type(excinfo.value) is UsageError
    assert "nosuch" in str(excinfo.value) and "\n" not in str(excinfo.value)
    assert "a" in tip.user_ns


def test_offload_keeps_the_data(tip):
    run_ok(tip, "a = torch.arange(10.)\nmodel = torch.nn.Linear(3, 2)")
    report = tip.run_line_magic("freecuda", "--offload a model -o -q")
    assert report.offloaded == ["a", "model"]
    assert tip.user_ns["a"].tolist() == list(map(float, range(10)))
    assert tip.user_ns["model"].weight.shape == (2, 3)
    with pytest.raises(UsageError) as excinfo:
        tip.run_line_magic("freecuda", "--offload")
    assert type(excinfo.value) is UsageError


def test_all_lists_and_deletes_only_variables_holding_device_tensors(tip):
    run_ok(tip, "a = torch.ones(100)\nbox = {'t': torch.ones(10)}\nmodel = torch.nn.Linear(2, 2)\n"
                "keep = [1, 2, 3]\n_x = 'text'\nn = 5")
    dry = tip.run_line_magic("freecuda", "--all --dry-run -o -q")
    assert set(dry.deleted) == {"a", "box", "model"}
    assert {k for k in ("a", "box", "model", "keep", "_x", "n") if k in tip.user_ns} == \
        {"a", "box", "model", "keep", "_x", "n"}
    report = tip.run_line_magic("freecuda", "--all -o -q")
    assert set(report.deleted) == {"a", "box", "model"}
    assert not any(k in tip.user_ns for k in ("a", "box", "model"))
    assert tip.user_ns["keep"] == [1, 2, 3] and tip.user_ns["_x"] == "text" and tip.user_ns["n"] == 5


def test_dry_run_changes_nothing(tip):
    run_ok(tip, STEP)
    tip.run_line_magic("gpumem", "--simulate 64MiB -q")
    tip.run_cell("out = step(256)", store_history=True)
    run_ok(tip, "a = torch.ones(100)")
    error = sys.last_value
    report = tip.run_line_magic("freecuda", "a -n -o -q")
    assert report.dry_run and report.deleted == ["a"] and "sys.last_value" in report.dropped
    assert "a" in tip.user_ns and sys.last_value is error
    assert tip.user_ns["refs"][0]() is not None
    del error


def test_user_variables_like_output_cache_names_are_never_touched(tip):
    run_ok(tip, "_x = torch.ones(10)\nkeep = torch.ones(20)\n_ = torch.ones(5)\n_7 = torch.ones(3)")
    ids = {k: id(tip.user_ns[k]) for k in ("_x", "keep", "_", "_7")}
    tip.run_line_magic("freecuda", "-q")
    assert {k: id(tip.user_ns[k]) for k in ("_x", "keep", "_", "_7")} == ids
    tip.run_line_magic("freecuda", "-q keep")
    assert "keep" not in tip.user_ns and id(tip.user_ns["_x"]) == ids["_x"]


def test_offload_takes_tensors_off_the_simulated_device_keeping_data_and_identity(tip):
    tip.run_line_magic("gpumem", "--simulate 64MiB -q")
    run_ok(tip, "model = torch.nn.Linear(512, 512)\nopt = torch.optim.Adam(model.parameters())\n"
                "model(torch.randn(4, 512)).sum().backward(); opt.step()\n"
                "w = model.weight; saved = model.weight.detach().clone()\n"
                "from cuda_magic.devices.simulated import active_device\nbefore = active_device().allocated")
    report = tip.run_line_magic("freecuda", "model opt --offload -q -o")
    sim = tip.user_ns["active_device"]()
    # weight, its grad, exp_avg and exp_avg_sq: 4 x 1 MiB left the device; `saved` (1 MiB) did not
    assert tip.user_ns["before"] - sim.allocated >= 4 * 512 * 512 * 4
    assert report.freed["sim:0"] >= 4 * 512 * 512 * 4
    run_ok(tip, "assert model.weight is w and torch.equal(model.weight, saved)\n"
                "model(torch.randn(4, 512)).sum().backward(); opt.step()")


# ---- sizes that add up (issue 21) -------------------------------------------------------------------

def test_a_release_on_the_simulated_device_is_reported_once_on_it(tip, capsys):
    # the simulated device's tensors are CPU tensors: the bytes it gives back are said once, on sim:0
    from cuda_magic.magics.state import get_state

    tip.run_line_magic("gpumem", "--simulate 64MiB -q")
    run_ok(tip, "big = torch.zeros(2**20)")
    capsys.readouterr()
    report = tip.run_line_magic("freecuda", "big -o")
    out = capsys.readouterr().out
    assert report.freed == {"sim:0": 4 * 2**20}
    assert "Freed 4.00 MiB on sim:0" in out and out.count("Freed") == 1 and "on cpu" not in out
    # the guard's "Memory reclaimed" is measured on the one device it meters
    run_ok(tip, STEP)
    tip.run_cell("%%oomguard --no-raise\nout = step(1024)")
    assert list(get_state(tip).last_report.reclaimed) == ["sim:0"]


def test_names_that_share_memory_are_grouped_and_the_sizes_add_up_to_what_is_held(tip, capsys):
    from cuda_magic.devices.simulated import active_device
    from cuda_magic.display.html import release_html
    from cuda_magic.units import format_bytes

    tip.run_line_magic("gpumem", "--simulate 64MiB -q")
    run_ok(tip, "model = torch.nn.Linear(256, 256)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                "w = model.weight\nx = torch.zeros(2**16)")
    capsys.readouterr()
    report = tip.run_line_magic("freecuda", "-o")
    out = capsys.readouterr().out
    held = active_device().allocated
    assert sum(b for _, b in report.still_held) == held          # the rows add up: each storage once
    assert ("model, opt, w", 257 * 256 * 4) in report.still_held and ("x", 2**18) in report.still_held
    assert any(n.startswith("model, opt, w share memory") for n in report.notes)
    total, = [line for line in out.splitlines() if "total (each storage once)" in line]
    assert total.split()[-2:] == format_bytes(held).split()
    assert "total (each storage once)" in release_html(report)
