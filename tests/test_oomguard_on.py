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
    assert "out of memory at" in out and "cell line 1" in out and "Cause:" in out and "Do this:" in out
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


TRAINING = """
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

def make_model(width):
    return nn.Sequential(nn.Linear(64, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, 10))

model = make_model(256)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
data = TensorDataset(torch.randn(512, 64), torch.randint(0, 10, (512,)))
"""

FAILING_STEP = """loader = DataLoader(data, batch_size=128)
for xb, yb in loader:
    loss = nn.functional.cross_entropy(model(xb), yb)
    loss.backward()
    opt.step()
    opt.zero_grad()
wide = make_model(8192)(torch.randn(4096, 64))
"""


def test_a_failed_cell_gets_the_black_box(oip, capsys):
    """SPEC: every cell that fails under `%oomguard on` is recorded: the report has the timeline and the
    table "alive at the failure, by line", and the failing request's line (here a function defined in an
    earlier cell, reached from the cell's last line)."""
    from cuda_magic.magics.state import get_state

    run_ok(oip, TRAINING, store_history=True)
    oip.run_line_magic("oomguard", "on")
    capsys.readouterr()
    result = oip.run_cell(FAILING_STEP, store_history=True)
    assert result.success is False
    del result
    out = capsys.readouterr().out
    assert "Black box: allocated memory over the run" in out and "Alive at the failure, by line" in out
    report = get_state(oip).guard_all.last_report
    bb = report.blackbox
    assert bb is not None and bb.at == "failure"
    assert report.by_line.bytes.sum() == bb.total == bb.failure.allocated
    # what the training loop left (the model, momentum buffers) came before; the request is the wide
    # activation: 4096 x 8192 float32 from make_model's Linear, at the cell's line 7
    assert bb.failure.requested == 4096 * 8192 * 4 and bb.failure.site.cell_line == 7
    assert bb.failure.site.code.startswith("wide = make_model(8192)")
    assert "out of memory at cell line 7 `wide = make_model(8192)" in " ".join(out.split())
    assert (report.timeline.event == "oom").any()


def test_cells_that_fit_keep_no_recording_and_off_removes_the_hooks(oip):
    from cuda_magic.devices.simulated import active_device

    events = oip.events.callbacks
    before = (list(events["pre_run_cell"]), list(events["post_run_cell"]))
    oip.run_line_magic("oomguard", "on")
    run_ok(oip, "x = torch.ones(256, 1024)", store_history=True)
    assert active_device().recorders == ()       # recorded while it ran, dropped unread when it fitted
    oip.run_line_magic("oomguard", "off")
    assert (list(events["pre_run_cell"]), list(events["post_run_cell"])) == before


def test_a_guarded_cell_is_explained_once(oip, capsys):
    oip.run_line_magic("oomguard", "on")
    capsys.readouterr()
    result = oip.run_cell("%%oomguard\ny = step(1024)", store_history=True)
    assert result.success is False and getattr(result.error_in_exec, "frames_freed", False)
    del result
    out = capsys.readouterr().out
    assert out.count("Cause:") == 1 and "%oomguard on: out of memory" not in out


def test_in_a_real_kernel_the_cell_line_is_found():
    """In Jupyter (ipykernel) cells are files `/tmp/ipykernel_PID/HASH.py`, and the kernel's launcher
    (`site-packages/ipykernel_launcher.py`) is an outer `<module>` frame: the black box must take the
    cell's file, so that a helper defined in an earlier cell is shown with the failing cell's line."""
    from pathlib import Path

    import nbformat
    from nbclient import NotebookClient
    from nbformat.v4 import new_code_cell, new_notebook

    root = Path(__file__).resolve().parent.parent
    cells = ["%load_ext cuda_magic", "import torch\n%gpumem --simulate 64MiB -q",
             "def make(n):\n    return torch.ones(n, 1024, 256)", "%oomguard on", "a = make(10)\nb = make(100)"]
    nb = new_notebook(cells=[new_code_cell(c) for c in cells])
    nb.cells[0].source = "import os\nos.environ['CUDA_MAGIC_DISPLAY'] = 'text'\n%load_ext cuda_magic"
    NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(root)}}).execute()
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs if o.get("output_type") == "stream")
    assert "Alive at the failure, by line" in text
    assert "In[3] line 2 (make), cell line 1  return torch.ones(n, 1024, 256)" in text
    assert ("out of memory at `return torch.ones(n, 1024, 256)` at In[3] line 2 (make), cell line 2: asked 100.00 MiB"
            in " ".join(text.split()))


def test_the_folded_before_is_read_before_the_cell_ran(oip, capsys):
    """Issue 36: the folded table's 'before' of a cell under `%oomguard on` was read at the failure (91.75 MiB
    where 3.36 MiB was in use before the cell): it is what the device held when the cell started."""
    run_ok(oip, "kept = torch.ones(3 * 2**20 // 4)")          # 3 MiB in use before the cell
    oip.run_line_magic("oomguard", "on")
    oip.run_cell("acts = [torch.ones(2**20 // 4) for _ in range(40)]\nbig = torch.empty(2**30, dtype=torch.uint8)")
    capsys.readouterr()
    oip.run_line_magic("oomguard", "last")
    full = capsys.readouterr().out
    lines = full.splitlines()
    head = lines.index("Memory in use (PyTorch allocated; the process's memory on the CPU)")
    row = lines[head + 2].split()
    assert row[0] == "sim:0" and row[1:3] == ["3.00", "MiB"], lines[head:head + 3]   # before: 3 MiB, not 43
