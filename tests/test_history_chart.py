"""`%gpumem --history`: allocated-after and peak per cell as an inline SVG chart and as sparklines."""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest
from conftest import run_ok

from cuda_magic.display.history import history_chart, history_html, history_text
from cuda_magic.memory.snapshot import CellRecord

MiB = 1 << 20
pytestmark = pytest.mark.usefixtures("no_gpu")


def leak(n=6):
    return [CellRecord(10 + i, MiB, (i + 3) * MiB, True, 0.1, "sim:0", allocated_after=(i + 1) * MiB)
            for i in range(n)]


def test_chart_has_both_series_and_the_cell_numbers_on_the_axis():
    chart = history_chart(leak())
    after, peak = chart.series
    assert after.points == [(10.0 + i, (i + 1) * MiB) for i in range(6)]
    assert peak.points[-1] == (15.0, 8 * MiB)
    assert [label for _, label in chart.x_ticks] == ["10", "11", "12", "13", "14", "15"]
    many = history_chart(leak(100))
    labels = [label for _, label in many.x_ticks]
    assert len(labels) <= 12 and labels[0] == "10" and labels[-1] == "109"
    assert history_chart(leak(1)) is None


def test_history_html_is_an_inline_svg_without_script_and_text_has_sparklines():
    html = history_html(leak())
    svg = re.search(r"<svg.*?</svg>", html, re.S).group(0)
    root = ET.fromstring(svg)
    assert len(root.findall(".//{http://www.w3.org/2000/svg}polyline")) == 2
    assert "<script" not in html and "http" not in html.replace("http://www.w3.org/2000/svg", "")
    text = history_text(leak())
    assert "after ▁▂▃▄▅▆  1.00 MiB -> 6.00 MiB" in text and "peak  ▃▄▅▆▇█  max 8.00 MiB" in text


def test_history_magic_after_a_leak_across_cells(tip, capsys):
    from cuda_magic.display.show import forms_of

    tip.run_line_magic("gpumem", "--simulate 64MiB -q")
    run_ok(tip, "kept = []")
    tip.run_line_magic("gpumem", "--watch -q")
    cells = [run_ok(tip, "kept.append(torch.zeros(2**18))", store_history=True).execution_count for _ in range(4)]
    tip.run_line_magic("gpumem", "--unwatch -q")
    frame = tip.run_line_magic("gpumem", "--history -o")
    assert list(frame["allocated_after"]) == [(i + 1) * MiB for i in range(4)]
    capsys.readouterr()
    tip.run_line_magic("gpumem", "--history")
    out = capsys.readouterr().out
    assert f"cells {cells[0]}..{cells[-1]}" in out and "1.00 MiB -> 4.00 MiB" in out
    from cuda_magic.magics.state import get_state

    _, html, _ = forms_of(list(get_state(tip).history))
    ticks = re.findall(r'text-anchor="middle" fill="currentColor">(\d+)</text>', html())
    assert ticks == [str(c) for c in cells]
