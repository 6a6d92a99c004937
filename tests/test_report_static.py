"""Issue 37: what a report leaves in a notebook reads without widget state and untrusted, one figure per
fact, and a layout that holds in narrow outputs and in the classic Notebook. The browser checks of the same
are in tests/browser/test_reopened.py; these check the markup they rely on."""
from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest
from conftest import run_ok
from test_display import guard_report

from cuda_magic.display import html as H
from cuda_magic.display import text as T
from cuda_magic.display.elements import CHART_BOX as BOX_STYLE
from cuda_magic.display.chart import CHAR, Chart, Marker, Series, _legend, svg
from cuda_magic.oom.findings import Advice

MiB = 2**20
NS = "{http://www.w3.org/2000/svg}"

CELL = """%%oomguard --no-raise -o
a = torch.zeros(2**20)
b = torch.zeros(2**20)
c = torch.zeros(2**20)
d = torch.zeros(2**20)
e = torch.zeros(2**20)
y = model(x)
"""


@pytest.fixture
def failed(tip, monkeypatch):
    """A real report after an OOM on the simulated device, with seven lines alive at the failure."""
    monkeypatch.setenv("CUDA_MAGIC_DISPLAY", "text")
    run_ok(tip, "%gpumem --simulate 64MiB -q")
    run_ok(tip, "from torch import nn\nmodel = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, "
                "1024), nn.ReLU(), nn.Linear(1024, 256))\nx = torch.randn(4096, 256)")
    report = tip.run_cell(CELL).result
    assert report.outcome == "oom" and len(report.blackbox.by_line) > 5
    return report


def test_unfolded_the_by_line_table_is_not_repeated(failed):
    html = H.guard_html(failed, full=True)
    answer, details = html.split("<details", 1)
    shown = re.findall(r"cell line (\d)</td>", answer)
    rest = re.findall(r"cell line (\d)</td>", details)
    assert shown and rest and not set(shown) & set(rest)          # each line in one of the two tables
    assert len(shown) + len(rest) + 1 == len(failed.blackbox.by_line)    # + "before the run"
    text = T.guard_text(failed, full=True)
    assert text.count("a = torch.zeros(2**20)") == 1 and text.count("b = torch.zeros(2**20)") == 1


def test_a_single_hidden_line_is_shown_not_summed(failed):
    from cuda_magic.display.blackbox_view import by_line_html, timeline_text

    bb = failed.blackbox
    n = len(bb.by_line)
    table = by_line_html(bb, rows=n - 1)
    assert "1 more lines" not in table and table.count("<tr>") == n + 1     # the header and every line
    assert "1 more lines" not in timeline_text(bb, rows=n - 1)
    assert "2 more lines" in by_line_html(bb, rows=n - 2)


def test_the_chart_degrades_to_a_line_of_words_where_svg_is_dropped(failed):
    html = H.guard_html(failed)
    boxes = re.findall(r'<div class="cuda-magic-timeline" style="([^"]*)"><svg', html)
    assert boxes == [BOX_STYLE] and "font-size:0" in BOX_STYLE   # stripped labels take no room
    svg_text = re.search(r"<svg.*?</svg>", html).group(0)
    root = ET.fromstring(svg_text)
    fo = root.find(f"{NS}desc")                                  # never drawn with the SVG
    assert fo is not None and root[0] is fo
    line = "".join(fo.itertext())
    assert "font-size:12.5px" in fo.find(f"{NS}div").get("style")
    assert line.startswith("Chart: allocated: up to ") and "capacity 64.00 MiB" in line
    assert re.search(r"peak [0-9.]+ MiB at [0-9.]+ seconds", line)


def test_the_legend_stays_inside_the_chart():
    labels = [f"attempt {i}: out of memory" for i in range(1, 7)] + ["peak 41.39 MiB", "failed request +16 MiB"]
    chart = Chart([Series(label, [(0.0, i * MiB), (1.0, (i + 1) * MiB)]) for i, label in enumerate(labels[:6])],
                  [Marker(labels[6], 7 * MiB, x=0.5), Marker(labels[7], 9 * MiB, x=0.8)])
    entries = [("line", "#000", label, False) for label in labels]
    for x, _, (_, _, label, _) in _legend(entries, 70, 640 - 26):
        assert x + 22 + CHAR * len(label) <= 640 - 26
    assert CHAR >= 7.2              # 12 px system-ui text measured up to 7.1 px a character in Chromium
    root = ET.fromstring(svg(chart))
    assert len(root.findall(f"{NS}text")) >= len(labels)


def test_code_blocks_follow_the_sentence_that_introduces_them():
    report = guard_report()
    code = "with torch.no_grad():\n    out = model(x)"
    report = replace(report, outcome="oom", diagnosis=replace(report.diagnosis, advice=[
        Advice("Run the evaluation without a graph: wrap it in `torch.no_grad()` so nothing is kept", code)]))
    html = H.answer_html(report)
    sentence = html.index("so nothing is kept")
    block = html.index("<pre")
    assert sentence < block
    pre = re.search(r'<pre[^>]*style="([^"]*)"', html).group(1)
    assert "display:block" in pre and "inline-block" not in pre
    one_line = H.answer_html(guard_report())
    assert re.search(r'<div style="margin:2px 0"><code[^>]*>batch_size = 16</code></div>', one_line)


def test_details_have_a_disclosure_marker_in_every_front_end():
    html = H.details_html(guard_report())
    summary = re.search(r'<summary style="([^"]*)">', html).group(1)
    assert "display:list-item" in summary      # the classic Notebook's normalize.css makes it a block


def test_the_gauge_figures_can_wrap_between_them():
    from cuda_magic.display.gauge import gauge_html

    class Reading:
        key, allocated, reserved, peak, peak_exact, capacity, other_processes = (
            "sim:0", 10 * MiB, 12 * MiB, 20 * MiB, True, 256 * MiB, None)

    html = gauge_html(Reading())
    assert re.search(r"</span> <span", html) and "</span><span" not in html


def test_a_line_says_predict_runs_past_a_second_and_the_prediction_takes_its_place(tip, monkeypatch):
    from IPython.utils.capture import capture_output

    import cuda_magic.display.gauge as gauge

    monkeypatch.setenv("CUDA_MAGIC_DISPLAY", "html")
    monkeypatch.setattr(gauge, "gauge_possible", lambda: True)      # as in a notebook's kernel
    run_ok(tip, "%gpumem --simulate 256MiB -q")
    with capture_output() as cap:
        tip.run_cell("%%oomguard --predict\nimport time\nt = torch.zeros(2**20)\ntime.sleep(1.6)")
    first, *rest = cap.outputs
    assert first.data["text/plain"].startswith("%%oomguard --predict: predicting the cell's memory")
    assert not first.update and first.transient["display_id"]
    last = cap.outputs[-1]
    assert last.update and last.transient == first.transient           # the line's place, not a new output
    assert "cuda-magic-waiting" not in last.data["text/html"] and "4.00 MiB" in last.data["text/plain"]
    assert len(cap.outputs) >= 2 and all(o.transient == first.transient for o in rest)


def test_a_short_prediction_shows_no_line(tip, monkeypatch):
    from IPython.utils.capture import capture_output

    import cuda_magic.display.gauge as gauge

    monkeypatch.setenv("CUDA_MAGIC_DISPLAY", "html")
    monkeypatch.setattr(gauge, "gauge_possible", lambda: True)
    run_ok(tip, "%gpumem --simulate 256MiB -q")
    with capture_output() as cap:
        tip.run_cell("%%oomguard --predict\nt = torch.zeros(2**20)")
    assert len(cap.outputs) == 1 and "cuda-magic-waiting" not in cap.outputs[0].data["text/html"]


def test_the_html_header_names_the_attempt_running_now_not_the_old_value(monkeypatch):
    # issue 37: the HTML form said "attempt 2" over "batch_size = 64" (the value that had run out) while the
    # retry measured the model and chose the next value
    from IPython.testing.globalipapp import get_ipython
    from IPython.utils.capture import capture_output

    from cuda_magic.display.show import show_guard
    from cuda_magic.recover.report import GuardReport, Retry

    get_ipython()
    monkeypatch.setenv("CUDA_MAGIC_DISPLAY", "html")
    report = GuardReport(device="cuda:0", retry=Retry("batch_size", 64))
    first = guard_report().attempts[0]                                  # 64 ran out of memory
    with capture_output() as cap:
        handle = show_guard(report)
        report.attempts.append(first)
        handle.add_attempt(first)
        between = cap.outputs[-1].data
        handle.try_value(16)
        trying = cap.outputs[-1].data
    assert "attempt 1 ran out of memory at batch_size=64, choosing the next value" in between["text/html"]
    assert "batch_size = 64" not in between["text/html"] and "batch_size = 64" not in between["text/plain"]
    assert "attempt 2 at batch_size = 16" in trying["text/html"] and "batch_size = 64<" not in trying["text/html"]
