"""The black box: recording on the simulated device, the by-line analysis, the CUDA history replay, and
the timeline drawn (text sparkline, inline SVG with no script)."""
from __future__ import annotations

import linecache
import sys
import textwrap
import xml.etree.ElementTree as ET

import pytest

from cuda_magic.devices.recorder import Recorder
from cuda_magic.memory.blackbox import blackbox_from

MiB = 1 << 20

MODEL_PY = '''
import torch
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2)
        return scores.softmax(-1) @ v
'''


@pytest.fixture
def model_module(tmp_path, monkeypatch):
    (tmp_path / "bb_model.py").write_text(MODEL_PY)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("bb_model", None)
    import bb_model

    yield bb_model
    sys.modules.pop("bb_model", None)


def run_cell_source(source: str, filename: str, ns: dict):
    """Run `source` as a notebook cell would be: compiled under its own file name, lines in linecache."""
    source = textwrap.dedent(source).lstrip("\n")
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), ns)
    return source.splitlines()


def recorded(dev, source, ns, *, cell="<cell-bb-1>", max_events=200_000):
    rec = Recorder(cell_filename=cell, max_events=max_events)
    dev.attach_recorder(rec)
    try:
        lines = run_cell_source(source, cell, ns)
    except Exception as exc:      # noqa: BLE001 - the test looks at what the recorder saw
        failed = exc
        lines = textwrap.dedent(source).lstrip("\n").splitlines()
    else:
        failed = None
    finally:
        dev.detach_recorder(rec)
    return rec, lines, failed


def test_by_line_bytes_sum_to_what_the_device_had_at_the_failure(torch_warm, model_module):
    """A training step with BatchNorm and AdamW, several steps, then an attention that does not fit."""
    torch = torch_warm
    from cuda_magic.devices.simulated import SimulatedDevice

    dev = SimulatedDevice(40 * MiB)
    with dev:
        ns = {"torch": torch, "nn": torch.nn, "bb_model": model_module}
        exec(textwrap.dedent("""
            net = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 64))
            opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
            attn = bb_model.Attention(64)
        """), ns)
        cell = """
            for step in range(3):
                x = torch.randn(256, 64)
                loss = net(x).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
            tokens = torch.randn(16, 512, 64)
            out = attn(tokens)
        """
        rec, lines, failed = recorded(dev, cell, ns)
        allocated_at_failure = rec.failures[-1].allocated
    assert isinstance(failed, torch.cuda.OutOfMemoryError)
    tl = blackbox_from(rec, device=dev.key, capacity=dev.capacity, lines=lines)
    assert tl.at == "failure"
    assert tl.total == allocated_at_failure == sum(u.bytes for u in tl.by_line)
    # the failing request: the attention scores, 16 x 512 x 512 float32, from the module file's line
    assert tl.failure.requested == 16 * 512 * 512 * 4
    site = tl.failure.site
    assert site.filename.endswith("bb_model.py") and site.function == "forward"
    assert site.code == "scores = q @ k.transpose(-1, -2)" and site.cell_line == 8
    assert site.where == "bb_model.py:13"
    # the cell's own line holds the input tokens; the model's parameters and AdamW state are from before
    rows = {u.where: u for u in tl.by_line}
    assert rows["cell line 7"].bytes == 16 * 512 * 64 * 4 and rows["cell line 7"].code.startswith("tokens =")
    assert any(u.filename is None and u.code == "(allocated before the run)" for u in tl.by_line)
    assert rows["bb_model.py:12"].function == "forward"       # the q, k, v projection inside the module


def test_a_run_that_fits_is_shown_at_its_peak(torch_warm):
    torch = torch_warm
    from cuda_magic.devices.simulated import SimulatedDevice

    dev = SimulatedDevice(64 * MiB)
    with dev:
        rec, lines, failed = recorded(dev, """
            a = torch.ones(1024, 1024)
            b = torch.ones(2048, 1024)
            del b
            c = torch.ones(512, 1024)
        """, {"torch": torch})
        peak = dev.peak
    assert failed is None
    tl = blackbox_from(rec, capacity=dev.capacity, lines=lines, failed=False)
    assert tl.at == "peak" and tl.peak == peak == 12 * MiB
    assert {u.where: u.bytes for u in tl.by_line} == {"cell line 1": 4 * MiB, "cell line 2": 8 * MiB}


def test_the_ring_drops_old_events_and_the_alive_set_stays_exact(torch_warm):
    torch = torch_warm
    from cuda_magic.devices.simulated import SimulatedDevice

    dev = SimulatedDevice(64 * MiB)
    with dev:
        rec, lines, failed = recorded(dev, """
            keep = [torch.ones(1024) for _ in range(100)]
            for _ in range(500):
                tmp = torch.ones(256)
            big = torch.empty(64 * 1024 * 1024)
        """, {"torch": torch}, max_events=50)
        allocated = rec.failures[-1].allocated
    assert isinstance(failed, torch.cuda.OutOfMemoryError)
    assert len(rec.events) == 50 and rec.dropped > 1000
    tl = blackbox_from(rec, capacity=dev.capacity, lines=lines)
    assert tl.total == allocated
    rows = {u.where: (u.bytes, u.tensors) for u in tl.by_line}
    assert rows["cell line 1"] == (100 * 4096, 100)
    assert rows["cell line 3"] == (1024, 1)
    assert "dropped" in repr(tl)


def test_attempts_are_separate_traces(torch_warm):
    torch = torch_warm
    from cuda_magic.devices.simulated import SimulatedDevice

    # 64 MiB does not fit; 8 MiB twice does, in one 20 MiB segment (requests of 1 to 10 MiB reserve 20 MiB)
    dev = SimulatedDevice(32 * MiB)
    rec = Recorder(cell_filename="<cell-bb-2>")
    dev.attach_recorder(rec)
    with dev:
        for attempt, n in enumerate((16, 2)):
            rec.begin_attempt(attempt)
            try:
                x = torch.ones(n, 1024, 1024)
                y = x * 2
                del x, y
            except torch.cuda.OutOfMemoryError:
                pass
            rec.pause()
    dev.detach_recorder(rec)
    tl = blackbox_from(rec, capacity=dev.capacity, failed=False)
    assert tl.attempts == [0, 1]
    assert rec.failures[-1].attempt == 0
    from cuda_magic.display.blackbox_view import attempt_series, timeline_chart

    assert set(attempt_series(tl)) == {0, 1}
    root = ET.fromstring(timeline_chart(tl))
    assert len(root.findall("{http://www.w3.org/2000/svg}polyline")) == 2
    assert "attempt 1" in repr(tl) and "attempt 2" in repr(tl)


def test_the_drawn_timeline_has_no_script_and_loads_nothing(torch_warm):
    torch = torch_warm
    from cuda_magic.devices.simulated import SimulatedDevice

    dev = SimulatedDevice(20 * MiB)     # 8 MiB in a 20 MiB segment; the 16 MiB product needs one of its own
    with dev:
        rec, lines, failed = recorded(dev, """
            a = torch.ones(2048, 1024)
            scores = a @ a.T @ a
        """, {"torch": torch})
    tl = blackbox_from(rec, capacity=dev.capacity, lines=lines)
    html = tl._repr_html_()
    lowered = html.lower()
    assert "<svg" in lowered and "<script" not in lowered and "<iframe" not in lowered
    assert "src=" not in lowered and "href" not in lowered and "@import" not in lowered and "url(" not in lowered
    assert "http" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "Alive at the failure, by line" in html and "cell line 1" in html
    text = repr(tl)
    assert "Black box" in text and "8.00 MiB" in text and "The failing request: 16.00 MiB from `scores = a @ a.T @ a`" in text
    frame = tl.timeline_frame()
    assert list(frame.columns) == ["event", "seconds", "allocated", "attempt"] and "oom" in set(frame.event)
    lines_frame = tl.by_line_frame()
    assert list(lines_frame.columns) == ["file", "line", "code", "bytes", "tensors"]
    assert lines_frame.bytes.sum() == tl.total


# ---- the cell's file found from frames as torch records them (tests/test_cuda_history.py: the CUDA replay) --

def frames(*where):
    """Frames innermost first, as torch records them (library frames included)."""
    return [{"filename": f, "line": n, "name": name} for f, n, name in where]


TORCH_FILE = "/usr/lib/python3/site-packages/torch/nn/modules/module.py"


def test_the_cell_file_is_found_from_the_frames_when_not_known(torch_warm, model_module):
    """`%oomguard on` starts recording before IPython compiles the cell: the cell's file is the outermost
    cell module among the frames, not a function defined in an earlier cell."""
    from cuda_magic.devices.simulated import SimulatedDevice

    earlier = "/tmp/ipykernel_41/1111.py"           # a cell that defined a helper
    cell = "/tmp/ipykernel_41/2222.py"              # the cell running now
    launcher = "/env/lib/python3.12/site-packages/ipykernel_launcher.py"   # outermost, not a cell
    rec = Recorder(find_cell=True)
    site = rec.site_of_frames(frames((TORCH_FILE, 1, "_call_impl"), (earlier, 7, "helper"), (cell, 3, "<module>"),
                                     (launcher, 18, "<module>")))
    assert rec.cell_filename == cell and rec.sites[site] == (earlier, 7, "helper", 3)
    # IPython 7.34 on Python 3.11+ names a cell's top-level code `<cell line: N>`
    old = Recorder(find_cell=True)
    old.site_of_frames(frames((earlier, 7, "helper"), (cell, 3, "<cell line: 3>"), (launcher, 18, "<module>")))
    assert old.cell_filename == cell
    # on the simulated device, from the live frames: a module function called from a cell line
    dev = SimulatedDevice(256 * MiB)
    ns = {"torch": torch_warm, "bb_model": model_module}
    live = Recorder(find_cell=True)
    dev.attach_recorder(live)
    try:
        with dev:
            run_cell_source("""
                att = bb_model.Attention(16)
                y = att(torch.ones(2, 8, 16))
            """, "<ipython-input-9-abc>", ns)
    finally:
        dev.detach_recorder(live)
    assert live.cell_filename == "<ipython-input-9-abc>"
    alive = {live.sites[s]: nbytes for s, (nbytes, _) in live.by_site.items()}
    module_rows = {(fn, cell_line) for (filename, _, fn, cell_line) in alive if filename == model_module.__file__}
    assert ("forward", 2) in module_rows            # bb_model's forward, reached from the cell's line 2
    assert alive[(model_module.__file__, 9, "__init__", 1)] > 0   # the Linear's weights, made at cell line 1
