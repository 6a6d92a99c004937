"""The black box through `%%oomguard` and the Python API: a real shell, real OOMs on the simulated device."""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest
from conftest import run_ok
from IPython.core.error import UsageError

MiB = 2**20

MODEL = """
from torch import nn

class Attention(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2)
        return scores.softmax(-1) @ v

model = nn.Sequential(Attention(64), nn.Linear(64, 64), nn.BatchNorm1d(256))
opt = torch.optim.AdamW(model.parameters())
seq, batch, accum = 256, 48, 1
"""

STEP = """
for _ in range(2):
    x = torch.randn(batch, seq, 64)
    loss = model(x).pow(2).mean() / accum
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.fixture
def mip(no_gpu, tip, monkeypatch):
    monkeypatch.setenv("CUDA_MAGIC_DISPLAY", "text")
    # a session device: only what the notebook makes from here on counts (not tensors other tests left)
    run_ok(tip, "%gpumem --simulate 1GiB -q")
    run_ok(tip, MODEL)
    return tip


def test_by_line_at_the_failure_names_the_attention_line_and_sums_exactly(mip, capsys):
    result = mip.run_cell(f"%%oomguard -l 24MiB -o --no-raise\n{STEP}")
    report = result.result
    out = capsys.readouterr().out
    assert report.outcome == "oom"
    bb = report.blackbox
    assert bb.at == "failure" and bb.failure is not None
    # by-line bytes add up to what the device had allocated at the failure (the message's figure, which
    # the message rounds to 0.01 MiB)
    assert report.by_line.bytes.sum() == bb.total == bb.failure.allocated
    assert abs(bb.total - report.oom.allocated_by_torch) < 0.01 * MiB
    # the attention scores (batch x seq x seq) are the request that did not fit
    site = bb.failure.site
    assert site.code == "scores = q @ k.transpose(-1, -2)" and site.function == "forward"
    assert site.cell_line == 3 and bb.failure.requested == 48 * 256 * 256 * 4
    qkv = next(u for u in bb.by_line if u.code.startswith("q, k, v = self.qkv"))
    assert qkv.function == "forward" and qkv.bytes > 0 and re.fullmatch(r"In\[\d+\] line \d+", qkv.where)
    frame = report.timeline
    assert list(frame.columns) == ["event", "seconds", "allocated", "attempt"] and (frame.event == "oom").any()
    # shown before the diagnosis, which cites the line that held the most
    # the headline names the line that asked; the chart and the top lines come before the folded rest
    flat = " ".join(out.split())
    assert "Alive at the failure, by line" in out
    assert "out of memory at `scores = q @ k.transpose(-1, -2)` at In[" in flat and "(forward), cell line 3" in flat
    assert out.index("Cause:") < out.index("Alive at the failure") < out.index("More (")
    assert f"was alive from `{bb.top.code}` at {bb.top.where}" in report.diagnosis.summary
    assert "sequences per batch" not in out          # a training step is not inference


def test_each_retry_attempt_is_its_own_trace(mip):
    report = mip.run_cell(f"%%oomguard -l 48MiB -r batch -o\n{STEP}").result
    assert report.outcome == "recovered" and len(report.attempts) >= 2
    bb = report.blackbox
    assert bb.attempts == list(range(len(report.attempts)))
    assert sorted(report.timeline.attempt.unique()) == bb.attempts
    from cuda_magic.display.blackbox_view import timeline_chart

    svg = ET.fromstring(timeline_chart(bb))
    assert len(svg.findall("{http://www.w3.org/2000/svg}polyline")) == len(report.attempts)
    text = repr(bb)
    assert all(f"attempt {n + 1}: peak" in text for n in bb.attempts)
    html = report.blackbox._repr_html_()
    assert "<script" not in html.lower() and "<svg" in html


def test_timeline_for_a_run_that_fits_is_at_its_peak(mip, capsys):
    report = mip.run_cell(f"%%oomguard -l 1GiB --timeline -o\n{STEP}").result
    out = capsys.readouterr().out
    assert report.outcome == "ok" and report.blackbox.at == "peak"
    assert "Alive at the peak, by line" in out
    assert report.blackbox.peak == report.peaks[report.device]
    quiet = mip.run_cell(f"%%oomguard -l 1GiB -o\n{STEP}").result
    assert quiet.blackbox is not None and "Black box" not in capsys.readouterr().out


def test_no_timeline_records_nothing(mip):
    report = mip.run_cell(f"%%oomguard -l 48MiB --no-timeline -o --no-raise\n{STEP}").result
    assert report.outcome == "oom" and report.blackbox is None
    assert report.timeline is None and report.by_line is None


@pytest.mark.parametrize("line, words", [
    ("--timeline --no-timeline", "exclude each other"),
    ("-r batch --exact", "--exact needs -a"),
])
def test_bad_flags_are_usage_errors(mip, line, words):
    with pytest.raises(UsageError, match=words):
        mip.run_cell_magic("oomguard", line, "x = 1")


def test_exact_keeps_the_effective_batch_exactly(mip):
    mip.user_ns.update(batch=48, accum=1)
    report = mip.run_cell(f"%%oomguard -l 48MiB -r batch -a accum --exact -o\n{STEP}").result
    assert report.outcome == "recovered"
    assert all(48 % a.value == 0 for a in report.attempts)
    assert mip.user_ns["batch"] * mip.user_ns["accum"] == 48


def test_inference_gets_advice_about_sequences(mip, capsys):
    cell = "with torch.no_grad():\n    out = model(torch.randn(batch * 8, seq, 64))\n"
    report = mip.run_cell(f"%%oomguard -l 48MiB -o --no-raise\n{cell}").result
    assert report.blackbox.failure.grad_enabled is False
    joined = " ".join(a.text for a in report.diagnosis.advice)
    assert "sequences per batch" in joined and "accumulation" not in joined


def test_python_api_takes_timeline(mip):
    run_ok(mip, """
from cuda_magic import oomguard

@oomguard(retry="n", limit="48MiB", quiet=True)
def train(n=48):
    x = torch.randn(n, seq, 64)
    model(x).pow(2).mean().backward()

@oomguard(limit="48MiB", quiet=True, timeline=False, raise_on_oom=False)
def blind(n=48):
    model(torch.randn(n, seq, 64)).pow(2).mean().backward()

train()
blind()
""")
    report = mip.user_ns["train"].last_report
    assert report.outcome == "recovered" and report.by_line.bytes.sum() > 0
    assert re.search(r"self\.qkv\(self\.norm\(x\)\)", " ".join(report.by_line.code))
    assert mip.user_ns["blind"].last_report.blackbox is None
    with pytest.raises(ValueError, match="exact=True needs accumulate="):
        mip.user_ns["oomguard"](retry="n", exact=True)


def test_a_retry_reports_one_peak_its_attempts_own_at_its_real_time(mip):
    # issue 37: the measuring between attempts (the model run on slices of its batch, while the recorder is
    # paused) raised the recorded peak and stamped it at 0 s: the chart said 47.23 MiB at 0 s where its
    # line was at 16 MiB, the attempts table 41.39 MiB. The run's peak is an attempt's, where its trace is.
    report = mip.run_cell(f"%%oomguard -l 48MiB -r batch -o\n{STEP}").result
    assert report.outcome == "recovered" and len(report.attempts) >= 2
    bb = report.blackbox
    traces = {}
    for seconds, allocated, attempt, _ in bb.points:
        traces.setdefault(attempt, []).append((seconds, allocated))
    top = max(a for pts in traces.values() for _, a in pts)
    assert bb.peak == top                                     # the chart's peak dot is on its own line
    at = [s for s, a in traces[bb.peak_attempt] if a == bb.peak]
    assert bb.peak_seconds in at and bb.peak_seconds > 0
    assert bb.peak_attempt < len(report.attempts)


def test_the_recorder_keeps_the_measurings_peak_apart_at_its_real_time():
    from cuda_magic.devices.recorder import Recorder

    now = [0.0]
    rec = Recorder(clock=lambda: now[0])
    rec.begin_attempt(0)
    now[0] = 1.0
    rec.alloc(1, 10 * MiB, 10 * MiB)
    rec.free(1, 0)
    rec.pause()                                               # the measuring between attempts
    now[0] = 2.0
    rec.alloc(2, 30 * MiB, 30 * MiB)
    rec.free(2, 0)
    rec.begin_attempt(1)
    now[0] = 3.0
    rec.alloc(3, 20 * MiB, 20 * MiB)
    assert (rec.peak, rec.peak_seconds, rec.peak_attempt) == (20 * MiB, 3.0, 1)
    assert (rec.between_peak, rec.between_peak_seconds) == (30 * MiB, 2.0)
