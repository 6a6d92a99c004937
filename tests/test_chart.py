"""The inline SVG chart and the sparkline: bucketed by maximum, no script, nothing fetched."""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET

from cuda_magic.display.chart import Chart, Marker, Series, bucket_max, sparkline, svg

MiB = 1 << 20


def test_bucket_max_keeps_every_peak():
    values = [0] * 10_000
    values[4321] = 7
    cells = bucket_max(values, 100)
    assert len(cells) == 100 and max(cells) == 7 and sum(cells) == 7


def test_sparkline_scales_to_the_top():
    assert sparkline([0, 5, 10]) == "▁▅█"
    assert sparkline([0, 5, 10], top=20) == "▁▃▅"
    assert len(sparkline(list(range(500)), width=40)) == 40
    assert sparkline([]) == ""


def test_svg_is_well_formed_and_self_contained():
    chart = Chart(series=[Series("attempt 1", [(0.0, 0), (1.0, 40 * MiB), (2.0, 10 * MiB)]),
                          Series("attempt 2", [(2.5, 0), (3.0, 20 * MiB)], dashed=True)],
                  markers=[Marker("capacity 64.00 MiB", 64 * MiB), Marker("request <b>", 30 * MiB, x=1.0)],
                  title="allocated")
    text = svg(chart)
    root = ET.fromstring(text)          # well-formed XML, user strings escaped
    assert root.tag.endswith("svg")
    assert "<script" not in text.lower() and "href" not in text and "http" not in text.replace(
        'xmlns="http://www.w3.org/2000/svg"', "")
    assert len(root.findall("{http://www.w3.org/2000/svg}polyline")) == 2
    assert "request &lt;b&gt;" in text and "64.00 MiB" in text


def test_a_long_series_is_drawn_in_at_most_a_thousand_columns():
    points = [(float(i), i % 97) for i in range(50_000)]
    text = svg(Chart(series=[Series("s", points, step=False)]))
    coords = re.search(r'points="([^"]+)"', text).group(1).split()
    assert len(coords) <= 1000

