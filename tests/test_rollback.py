"""A retried cell ends as if it had run once at the final value (issue 9, item 1): a real training cell,
a model with BatchNorm and SGD with momentum, whose out-of-memory error comes after some optimizer steps
(an evaluation at the end of the cell needs more than the steps), in a real IPython shell on the
simulated device."""
from __future__ import annotations

import pytest

from conftest import run_ok

SETUP = """
import copy, random
import numpy as np
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
start = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict()),
         torch.get_rng_state(), random.getstate(), np.random.get_state())
bs = 2048
"""

# three optimizer steps on random data (torch's RNG, numpy's and random's are all drawn), then an
# evaluation whose activations grow with bs and run out of memory at the large values
CELL = """
model.train()
for step in range(3):
    x = torch.randn(bs, 64) + float(np.random.rand()) + random.random()
    y = torch.randint(0, 10, (bs,))
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
model.eval()
with torch.no_grad():
    wide = torch.randn(bs * 16, 512)
    score = float(wide.mean())
"""

CLEAN = """
model.load_state_dict(start[0]); opt.load_state_dict(start[1]); sched.load_state_dict(start[2])
for p in model.parameters():
    p.grad = None
torch.set_rng_state(start[3]); random.setstate(start[4]); np.random.set_state(start[5])
"""


def states(ip) -> dict:
    ns = ip.user_ns
    out = {f"model.{k}": v.clone() for k, v in ns["model"].state_dict().items()}
    for i, s in ns["opt"].state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": (v.clone() if hasattr(v, "clone") else v) for k, v in s.items()})
    out["opt.lr"] = ns["opt"].param_groups[0]["lr"]
    out["sched"] = dict(ns["sched"].state_dict())
    out["grads"] = [p.grad.clone() for p in ns["model"].parameters()]
    out["training"] = ns["model"].training
    out["rng"] = (ns["torch"].get_rng_state().clone(), ns["random"].getstate(), ns["np"].random.get_state()[1].copy())
    return out


def assert_same(a: dict, b: dict) -> None:
    import numpy as np
    import torch

    assert a.keys() == b.keys()
    different = []
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            same = torch.equal(x, y)
        elif key == "grads":
            same = all(torch.equal(p, q) for p, q in zip(x, y))
        elif key == "rng":
            same = torch.equal(x[0], y[0]) and x[1] == y[1] and np.array_equal(x[2], y[2])
        else:
            same = x == y
        if not same:
            different.append(key)
    assert not different, f"differ from one clean run: {different}"


@pytest.mark.parametrize("flags", ["-r bs", "-r bs --search"])
def test_retried_training_cell_equals_one_clean_run_at_the_final_value(tip, flags):
    run_ok(tip, SETUP)
    result = tip.run_cell(f"%%oomguard -l 24MiB -q -o {flags}\n" + CELL)
    assert result.success, result.error_in_exec
    report = result.result
    assert report.outcome == "recovered" and report.attempts[0].outcome == "oom"
    assert report.attempts[0].peak > 0                        # the first attempt stepped before failing
    final = tip.user_ns["bs"]
    assert final == report.final_value < 2048
    guarded = states(tip)
    bn = tip.user_ns["model"][1]
    assert int(bn.num_batches_tracked) == 3                   # three steps, once: not 3 per attempt
    run_ok(tip, CLEAN)
    run_ok(tip, f"bs = {final}\n" + CELL)
    assert_same(guarded, states(tip))
    if "--search" in flags:
        ran = [a for a in report.attempts if a.outcome == "ok" and not a.probe]
        assert len(ran) == 1 and ran[0].value == final         # one real run, after the probes


def test_without_the_rollback_the_failed_steps_would_stay(tip):
    """The same cell unguarded shows what the rollback prevents: steps of a failed run stay in the model."""
    run_ok(tip, SETUP)
    tip.run_cell("%%oomguard -l 24MiB -q --no-raise\n" + CELL)
    assert int(tip.user_ns["model"][1].num_batches_tracked) == 3   # the failed run's three steps stayed


def test_limit_without_cuda_counts_the_tensors_that_exist(tip):
    """Item 5: `-l` on a machine without CUDA caps the whole, as on a GPU: a 16 MiB tensor made before
    leaves 8 MiB of a 24 MiB cap, so a 12 MiB tensor does not fit."""
    run_ok(tip, "held = torch.ones(4, 2**20)")
    result = tip.run_cell("%%oomguard -l 24MiB -q -o --no-raise\nx = torch.ones(3, 2**20)")
    assert result.result.outcome == "oom"
    assert result.result.before[0].torch_allocated >= 16 * 2**20
    run_ok(tip, "del held")
    assert tip.run_cell("%%oomguard -l 24MiB -q -o\nx = torch.ones(3, 2**20)").result.outcome == "ok"


def test_a_cap_above_the_capacity_gets_a_note(tip, capsys):
    tip.run_line_magic("gpumem", "--simulate 64MiB -q")
    result = tip.run_cell("%%oomguard -l 2GiB -o\nx = torch.ones(4)")
    assert any("above the device's capacity" in w for w in result.result.warnings)
    assert "note: the cap 2.00 GiB is above the device's capacity (64.00 MiB)" in capsys.readouterr().out


def test_a_variable_the_memory_does_not_depend_on_stops_after_two_attempts(tip):
    """Item 4: the same failing request and peak at two values: stop, restore the variable, say so."""
    run_ok(tip, "bs = 4096")
    result = tip.run_cell("%%oomguard -l 64MiB -q -o --no-raise -r bs\nx = torch.ones(32, 2**20)")
    report = result.result
    assert len(report.attempts) == 2 and report.outcome == "oom"
    assert tip.user_ns["bs"] == 4096
    assert any("does not depend on this value" in w and "bs restored to 4096" in w for w in report.warnings)
    # issue 20 item 6: what follows is what the memory does depend on, not another smaller batch
    assert "does not depend on bs" in report.diagnosis.summary
    assert not any(c.startswith("%%oomguard -r") for c in (a.code or "" for a in report.diagnosis.advice))


def test_reclaimed_is_per_clean_up_and_never_above_the_capacity(tip):
    """Item 5: a retry that fails several times reports what one clean-up gave back, not the sum."""
    run_ok(tip, "bs = 1024")
    cell = "a = torch.ones(bs, 8192)\nb = torch.ones(bs, 8192)\nc = torch.ones(bs, 8192)\nd = torch.ones(bs, 65536)"
    report = tip.run_cell("%%oomguard -l 64MiB -q -o -r bs\n" + cell).result
    failed = [a for a in report.attempts if a.outcome == "oom"]
    assert len(failed) >= 2
    assert report.reclaimed["sim:0"] == failed[-1].reclaimed <= 64 * 2**20
    assert sum(a.reclaimed for a in failed) > report.reclaimed["sim:0"]


def test_files_written_by_a_failed_attempt_are_named_and_no_wrapper_stays(tip, tmp_path):
    """Files an undone attempt opened for writing (open, pathlib, numpy.save, torch.save, os.open) are named
    as not undone; those of the run that stands are not; afterwards `open`, `io.open`, `os.open` and
    `torch.save` are the original objects again: nothing stays installed (an audit hook would)."""
    import builtins
    import io
    import os

    import torch

    originals = (builtins.open, io.open, os.open, torch.save)
    shell_open = tip.user_ns.get("open")            # IPython 8+'s own, bound to the original io.open
    tip.user_ns["out_dir"] = str(tmp_path)
    cell = ("import pathlib, numpy as np, os\n"
            "name = 'failed' if bs > 512 else 'kept'\n"
            "open(f'{out_dir}/{name}.txt', 'w').close()\n"
            "pathlib.Path(out_dir, f'{name}.path').write_text('x')\n"
            "np.save(f'{out_dir}/{name}.npy', np.zeros(2))\n"
            "torch.save({'a': 1}, f'{out_dir}/{name}.pt')\n"
            "os.close(os.open(f'{out_dir}/{name}.raw', os.O_WRONLY | os.O_CREAT))\n"
            "open(f'{out_dir}/read-only.txt', 'w').close() if False else None\n"
            "big = torch.ones(bs, 2**16)\n")
    run_ok(tip, "bs = 1024")
    report = tip.run_cell("%%oomguard -l 200MiB -q -o -r bs\n" + cell).result
    assert report.outcome == "recovered" and report.attempts[0].outcome == "oom"
    written = [w for w in report.not_undone if w.startswith("files written")]
    assert len(written) == 1
    for suffix in ("txt", "path", "npy", "pt", "raw"):
        assert f"failed.{suffix}" in written[0], (suffix, written)
    assert "kept" not in written[0]
    assert (builtins.open, io.open, os.open, torch.save) == originals
    assert all(a is b for a, b in zip((builtins.open, io.open, os.open, torch.save), originals))
    assert tip.user_ns.get("open") is shell_open      # (IPython 7 puts none there)


def test_the_wrappers_go_even_on_ctrl_c(tip):
    import builtins

    original = builtins.open
    run_ok(tip, "bs = 64\nimport builtins\n_open = builtins.open")
    tip.run_cell("%%oomguard -q -r bs\nwrapped = builtins.open is not _open\nraise KeyboardInterrupt")
    assert tip.user_ns["wrapped"]                   # installed while the attempt ran
    assert builtins.open is original
