"""Charts and colours that are right in every front end (issue 21): the inline SVG scales down to a 400 px
output, its y axis has round ticks, a failing request larger than the device does not flatten the trace,
the history chart shows the capacity and the cells that ran out of memory, a retry's fitted attempt is
not drawn in the failure's red, colours keep their contrast on light and dark themes, one colour per
meaning, and figures do not wrap."""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

from cuda_magic.display import elements as E
from cuda_magic.display import html as H
from cuda_magic.display import text as T
from cuda_magic.display.blackbox_view import timeline_chart
from cuda_magic.display.chart import (AXIS, CHAR, GRID, PALETTE, Chart, Marker, Series, compact_bytes,
                                      nice_ticks, svg)
from cuda_magic.display.history import history_html, history_svg
from cuda_magic.memory.blackbox import BlackBox, FailedRequest
from cuda_magic.memory.snapshot import CellRecord

MiB, GiB = 1 << 20, 1 << 30
NS = "{http://www.w3.org/2000/svg}"


def parse(text: str) -> ET.Element:
    return ET.fromstring(re.search(r"<svg.*?</svg>", text, re.S).group(0))


def y_ticks(root) -> list[str]:
    return [t.text for t in root.iter(f"{NS}text") if t.get("class") == "cuda-magic-y-tick"]


def tick_y(root, label: str) -> float:
    return next(float(t.get("y")) - 4 for t in root.iter(f"{NS}text")
                if t.get("class") == "cuda-magic-y-tick" and t.text == label)


def polyline_ys(line) -> list[float]:
    return [float(p.split(",")[1]) for p in line.get("points").split()]


def failing(points, *, capacity=256 * MiB, requested=900 * MiB, allocated=150 * MiB, attempt=0, seconds=None):
    pts = [(s, a, n, "alloc") for s, a, n in points]
    peak = max([a for _, a, _ in points] + [0])
    at = seconds if seconds is not None else (points[-1][0] if points else 0.0)
    return BlackBox(device="sim:0", points=pts, capacity=capacity, peak=peak, peak_seconds=at,
                    failure=FailedRequest(requested, at, attempt, allocated))


# ---- 1. the chart fits its output, down to 400 px -----------------------------------------------

def test_the_svg_scales_to_its_container_and_keeps_its_labels_readable():
    root = parse(svg(Chart([Series("allocated", [(0.0, 0), (1.0, 40 * MiB)])], [Marker("capacity", 64 * MiB)])))
    assert root.get("width") == "100%" and root.get("height") is None      # no fixed size to overflow
    style = dict(p.split(":", 1) for p in root.get("style").split(";") if p)
    assert style["width"] == "100%" and style["height"] == "auto" and style["max-width"] == "640px"
    _, _, vw, vh = map(float, root.get("viewBox").split())
    assert vw == 640 and vh > 0 and root.get("preserveAspectRatio") == "xMinYMin meet"
    font = float(style["font-size"].removesuffix("px"))
    assert font * 400 / vw >= 7                                             # still 7 px at 400 px wide


def test_a_long_legend_wraps_inside_the_view_box():
    series = [Series(f"attempt {i + 1}: a rather long label for this trace", [(float(i), i * MiB)])
              for i in range(6)]
    root = parse(svg(Chart(series)))
    width = float(root.get("viewBox").split()[2])
    height = float(root.get("viewBox").split()[3])
    texts = [t for t in root.iter(f"{NS}text") if t.text and t.text.startswith("attempt")]
    assert len(texts) == 6 and len({t.get("y") for t in texts}) >= 3         # several rows
    for t in texts:
        assert float(t.get("x")) + CHAR * len(t.text) <= width and float(t.get("y")) <= height


def test_the_timeline_in_a_report_has_no_fixed_width():
    html = failing([(0.0, 0, 0), (1.0, 100 * MiB, 0)])._repr_html_()
    assert 'width="640"' not in html and 'width="100%"' in html


# ---- 2. round y ticks ----------------------------------------------------------------------------

@pytest.mark.parametrize("top, labels", [
    (256 * MiB, ["0", "64 MiB", "128 MiB", "192 MiB", "256 MiB"]),
    (474 * MiB, ["0", "100 MiB", "200 MiB", "300 MiB", "400 MiB", "500 MiB"]),
    (8 * GiB, ["0", "2 GiB", "4 GiB", "6 GiB", "8 GiB"]),
    (3 * GiB // 2, ["0", "0.5 GiB", "1 GiB", "1.5 GiB"]),
    (80 * GiB, ["0", "20 GiB", "40 GiB", "60 GiB", "80 GiB"]),
])
def test_y_ticks_are_round_figures(top, labels):
    root = parse(svg(Chart([Series("allocated", [(0.0, 0), (1.0, top)])])))
    assert y_ticks(root) == labels


def test_nice_ticks_are_int_bytes_evenly_spaced_at_or_above_the_top():
    for top in (1, 3, 1000, 5000, 12 * MiB + 5, 301.9 * MiB, 1023 * MiB, 1100 * MiB, 24 * GiB, 3 * (1 << 40)):
        ticks = nice_ticks(int(top))
        assert all(isinstance(t, int) for t in ticks) and ticks[0] == 0 and ticks[-1] >= top
        steps = {b - a for a, b in zip(ticks, ticks[1:])}
        assert len(steps) == 1 and (3 if top >= 1024 else 1) <= len(ticks) - 1 <= 5, (top, ticks)
        assert all(re.fullmatch(r"0|\d+(\.\d\d?)? (B|KiB|MiB|GiB|TiB)", compact_bytes(t)) for t in ticks), ticks
    assert compact_bytes(128 * MiB) == "128 MiB" and compact_bytes(3 * GiB // 2) == "1.5 GiB"


def test_no_tick_reads_like_an_unround_figure():
    """The issue's chart: a peak of 301.90 MiB gave ticks at 150.95 and 301.90 MiB."""
    root = parse(svg(Chart([Series("allocated", [(0.0, 0), (1.0, int(301.9 * MiB))])])))
    assert not [t for t in y_ticks(root) if "." in t]


# ---- 3. the failing request does not set the scale -----------------------------------------------

def test_a_request_larger_than_the_device_is_pinned_to_the_top_and_the_trace_keeps_its_height():
    tl = failing([(0.0, 0, 0), (0.5, 120 * MiB, 0), (1.0, 200 * MiB, 0), (1.5, 150 * MiB, 0)])
    root = parse(timeline_chart(tl))
    assert y_ticks(root)[-1] == "256 MiB"                    # the capacity sets the top, not 150 + 900 MiB
    top, zero = tick_y(root, "256 MiB"), tick_y(root, "0")
    trace = root.find(f"{NS}polyline")
    highest = min(polyline_ys(trace))
    assert (zero - highest) / (zero - top) == pytest.approx(200 / 256, abs=0.02)    # not squashed
    pins = [p for p in root.iter(f"{NS}path") if p.get("class") == "cuda-magic-off-scale"]
    assert len(pins) == 1
    ys = [float(v) for v in re.findall(r"[\d.]+,([\d.]+)", pins[0].get("d"))]
    assert min(ys) < top <= max(ys) + 1                      # on the top edge, pointing up out of the plot
    labels = [t.text for t in root.iter(f"{NS}text")]
    assert "failed request +900.00 MiB (off the scale)" in labels


def test_a_request_that_fits_the_scale_is_a_bar_on_top_of_what_was_allocated():
    tl = failing([(0.0, 0, 0), (1.0, 100 * MiB, 0)], requested=50 * MiB, allocated=100 * MiB)
    root = parse(timeline_chart(tl))
    assert not [p for p in root.iter(f"{NS}path") if p.get("class") == "cuda-magic-off-scale"]
    point = next(c for c in root.iter(f"{NS}circle") if (c.findtext(f"{NS}title") or "").startswith("failed"))
    assert float(point.get("cy")) == pytest.approx(tick_y(root, "0") + (tick_y(root, "256 MiB") - tick_y(root, "0"))
                                                   * 150 / 256, abs=0.2)


def test_a_cell_that_failed_at_once_still_draws_a_sensible_chart():
    """No points, 0 seconds: the issue saw a flat line to 0.00 seconds on a scale the request set."""
    tl = failing([], requested=474 * MiB, allocated=0)
    root = parse(timeline_chart(tl))
    assert y_ticks(root)[-1] == "256 MiB"
    assert [p for p in root.iter(f"{NS}path") if p.get("class") == "cuda-magic-off-scale"]
    x_labels = [t.text for t in root.iter(f"{NS}text") if t.get("text-anchor") == "middle"]
    assert x_labels[0] == "0" and x_labels[-1] == "0.01" and len(set(x_labels)) == len(x_labels)
    one = parse(svg(Chart([Series("allocated", [(0.0, 30 * MiB)])])))    # one reading: a visible level
    coords = one.find(f"{NS}polyline").get("points").split()
    assert len(coords) >= 2 and coords[0] != coords[-1]


def test_with_nothing_else_on_the_chart_the_request_sets_the_scale():
    tl = failing([], capacity=None, requested=300 * MiB, allocated=0)
    root = parse(timeline_chart(tl))
    assert y_ticks(root)[-1] == "300 MiB"
    assert not [p for p in root.iter(f"{NS}path") if p.get("class") == "cuda-magic-off-scale"]


# ---- 4. the history chart: capacity and the cells that ran out of memory ---------------------------

def records(n=8, oom=(4,), capacity=128 * MiB):
    return [CellRecord(10 + i, MiB, (i + 3) * 10 * MiB, True, 0.1, "sim:0", allocated_after=(i + 1) * 10 * MiB,
                       capacity=capacity, outcome="oom" if i in oom else "ok") for i in range(n)]


def test_the_history_chart_draws_the_capacity_and_marks_the_cell_that_ran_out_of_memory():
    root = parse(history_svg(records()))
    assert y_ticks(root)[-1] == "128 MiB"
    cap = [line for line in root.iter(f"{NS}line") if (line.findtext(f"{NS}title") or "") == "capacity 128.00 MiB"]
    assert len(cap) == 1 and float(cap[0].get("y1")) == pytest.approx(tick_y(root, "128 MiB"), abs=0.2)
    red = [c for c in root.iter(f"{NS}circle") if c.get("fill") == E.FAIL_COLOR and c.find(f"{NS}title") is not None]
    assert len(red) == 1
    cell_x = next(float(t.get("x")) for t in root.iter(f"{NS}text") if t.get("text-anchor") == "middle"
                  and t.text == "14")
    assert float(red[0].get("cx")) == pytest.approx(cell_x, abs=0.2)
    assert float(red[0].get("cy")) == pytest.approx(
        tick_y(root, "0") + (tick_y(root, "128 MiB") - tick_y(root, "0")) * 70 / 128, abs=0.3)   # at its peak
    plain = parse(history_svg(records(oom=(), capacity=None)))
    assert not [c for c in plain.iter(f"{NS}circle") if c.get("fill") == E.FAIL_COLOR and c.find(f"{NS}title")]
    assert not [line for line in plain.iter(f"{NS}line") if "capacity" in (line.findtext(f"{NS}title") or "")]


def test_the_history_table_says_its_allocated_column_is_a_change():
    recs = records(3)
    assert "allocated change" in T.history_text(recs).splitlines()[1]
    assert "<th" in history_html(recs) and ">allocated change</th>" in H.history_html(recs)


@pytest.mark.usefixtures("no_gpu")
def test_watch_records_carry_the_capacity_and_whether_the_cell_ran_out_of_memory(tip):
    from conftest import run_ok

    from cuda_magic.magics.state import get_state

    tip.run_line_magic("gpumem", "--simulate 64MiB -q")
    tip.run_line_magic("gpumem", "--watch -q")
    try:
        run_ok(tip, "small = torch.zeros(2**18)", store_history=True)
        failed = tip.run_cell("too_big = torch.zeros(2**25)", store_history=True)
        boom = tip.run_cell("raise ValueError('not memory')", store_history=True)
    finally:
        tip.run_line_magic("gpumem", "--unwatch -q")
        tip.run_cell("del small", store_history=False)
    assert not failed.success and not boom.success
    recs = list(get_state(tip).history)[-3:]
    assert [r.outcome for r in recs] == ["ok", "oom", "error"]
    assert {r.capacity for r in recs} == {64 * MiB}
    root = parse(history_svg(recs))
    assert [c for c in root.iter(f"{NS}circle") if c.get("fill") == E.FAIL_COLOR and c.find(f"{NS}title") is not None]


# ---- 5. a retry's fitted attempt is not drawn in red -----------------------------------------------

def strokes(root) -> dict[str, str]:
    return {line.findtext(f"{NS}title"): line.get("stroke") for line in root.iter(f"{NS}polyline")}


def test_the_attempt_that_fitted_is_not_drawn_in_the_failures_red():
    tl = failing([(0.0, 0, 0), (0.4, 171 * MiB, 0), (0.5, 0, 1), (1.0, 120 * MiB, 1), (1.5, 60 * MiB, 1)],
                 requested=120 * MiB, allocated=171 * MiB, seconds=0.4)
    lines = strokes(parse(timeline_chart(tl)))
    assert lines == {"attempt 1: out of memory": E.FAIL_COLOR, "attempt 2": E.COLORS["torch_allocated"]}
    single = strokes(parse(timeline_chart(failing([(0.0, 0, 0), (1.0, 100 * MiB, 0)]))))
    assert single == {"allocated": E.COLORS["torch_allocated"]}            # the failure is its marker's


# ---- 6. contrast on light and dark themes ------------------------------------------------------------

WHITE, DARK = "#ffffff", "#111111"          # JupyterLab 4's light --jp-layout-color0, and its dark one
# JupyterLab 4's theme variables used here: (light theme, dark theme)
JUPYTERLAB = {
    "--jp-success-color0": ("#1b5e20", "#388e3c"),
    "--jp-error-color1": ("#d32f2f", "#f44336"),
    "--jp-warn-color0": ("#e65100", "#f57c00"),
    "--jp-content-font-color0": ("#000000", "#ffffff"),
}


def rgb(color: str) -> tuple[float, float, float, float]:
    color = color.strip()
    if color.startswith("#"):
        h = color[1:] if len(color) == 7 else "".join(c * 2 for c in color[1:])
        return int(h[0:2], 16), int(h[2:4], 16), int(h[4:6], 16), 1.0
    r, g, b, a = (float(v) for v in re.fullmatch(r"rgba\(([^)]*)\)", color).group(1).split(","))
    return r, g, b, a


def over(color: str, background: str) -> tuple[float, float, float]:
    r, g, b, a = rgb(color)
    br, bg, bb, _ = rgb(background)
    return r * a + br * (1 - a), g * a + bg * (1 - a), b * a + bb * (1 - a)


def luminance(c) -> float:
    def lin(v):
        v /= 255
        return v / 12.92 if v <= 0.04045 else ((v + 0.055) / 1.055) ** 2.4
    r, g, b = c
    return 0.2126 * lin(r) + 0.7152 * lin(g) + 0.0722 * lin(b)


def contrast(color: str, background: str) -> float:
    a, b = sorted((luminance(over(color, background)), luminance(over(background, WHITE))), reverse=True)
    return (a + 0.05) / (b + 0.05)


def resolve(value: str, theme: int | None) -> str:
    """A CSS colour as it computes: `theme` 0 (JupyterLab light), 1 (dark) or None (no JupyterLab
    variables: nbconvert, GitHub); var() and color-mix(in srgb, A p%, B) resolved."""
    value = value.strip()
    m = re.fullmatch(r"var\((--[\w-]+),\s*(.+)\)", value)
    if m:
        return JUPYTERLAB[m.group(1)][theme] if theme is not None else resolve(m.group(2), None)
    m = re.fullmatch(r"color-mix\(in srgb,\s*(var\([^)]*\)|#\w+)\s+(\d+)%,\s*(var\([^)]*\)|#\w+)\)", value)
    if m:
        a, p, b = resolve(m.group(1), theme), int(m.group(2)) / 100, resolve(m.group(3), theme)
        mixed = [round(x * p + y * (1 - p)) for x, y in zip(rgb(a)[:3], rgb(b)[:3])]
        return "#" + "".join(f"{v:02x}" for v in mixed)
    assert value.startswith("#") or value.startswith("rgba("), value
    return value


def text_colors() -> dict[str, str]:
    return {f"outcome {k}": v for k, v in E.OUTCOME_COLORS.items()}


def mark_colors() -> dict[str, str]:
    marks = {f"bar {k}": v for k, v in E.COLORS.items() if k != "free"}
    marks |= {f"kind {k}": v for k, v in H.KIND_COLORS.items()}
    marks |= {"peak": E.PEAK_COLOR, "failure": E.FAIL_COLOR, "axis": AXIS}
    marks |= {f"palette {i}": c for i, c in enumerate(PALETTE)}
    return marks


def test_outcome_colours_are_marks_and_the_report_text_keeps_the_page_colour():
    """No fixed colour reads as text on both white and #111111, and a theme variable is not the theme's
    everywhere (ipywidgets 7's classic Notebook CSS sets --jp-error-color1 to #F44336: 3.7:1 on white), so
    the outcome colours are marks (3:1 on both) beside words in the page's own colour."""
    from cuda_magic.recover.report import Attempt, GuardReport, Retry

    for name, value in text_colors().items():
        assert contrast(value, WHITE) >= 3 and contrast(value, DARK) >= 3, name
    report = GuardReport(device="sim:0", retry=Retry("bs", 8, final=4), outcome="recovered", reclaimed={"sim:0": 1},
                         attempts=[Attempt(8, "oom"), Attempt(4, "ok")], warnings=["w"], not_undone=["n"])
    html = H.guard_html(report)
    colored_text = re.findall(r'style="[^"]*(?<![-\w])color:([^;"]+)[^"]*">([^<]*)<', html)
    assert colored_text and all(text in ("●", "✔", "⚠") for _, text in colored_text), colored_text
    assert "border-left:4px solid " + E.OUTCOME_COLORS["ok"] in html


def test_mark_colours_keep_3_to_1_on_white_and_on_dark():
    for name, value in mark_colors().items():
        assert contrast(value, WHITE) >= 3 and contrast(value, DARK) >= 3, name
    free = E.COLORS["free"]                  # the background's own part: translucent, never a glare
    assert rgb(free)[3] <= 0.3 and contrast(free, WHITE) < 1.5 and contrast(free, DARK) < 1.5


def test_the_no_one_fixed_colour_rule_that_needs_theme_variables_for_text():
    """Why text colours are theme variables: no fixed colour has 4.5:1 on both white and #111111."""
    best = max(min(contrast(f"#{v:02x}{v:02x}{v:02x}", WHITE), contrast(f"#{v:02x}{v:02x}{v:02x}", DARK))
               for v in range(256))
    assert best < 4.5


def test_every_colour_a_chart_uses_is_the_text_colour_or_a_mark_that_passes():
    tl = failing([(0.0, 0, 0), (0.4, 171 * MiB, 0), (0.5, 0, 1), (1.0, 120 * MiB, 1)], seconds=0.4)
    allowed = set(mark_colors().values()) | {"currentColor", "none", GRID}
    for text in (timeline_chart(tl), history_svg(records())):
        root = parse(text)
        for el in root.iter():
            for attr in ("fill", "stroke"):
                if el.get(attr) is not None:
                    assert el.get(attr) in allowed, (el.tag, attr, el.get(attr))
            if el.tag == f"{NS}text":
                assert el.get("fill") == "currentColor", el.text


# ---- 7. one colour per meaning -------------------------------------------------------------------------

def test_no_two_meanings_share_a_colour():
    meanings = {f"bar {k}": v for k, v in E.COLORS.items()}
    meanings |= {f"kind {k}": v for k, v in H.KIND_COLORS.items()}
    meanings |= {"peak": E.PEAK_COLOR, "failure": E.FAIL_COLOR}
    by_color: dict[str, list[str]] = {}
    for name, value in meanings.items():
        by_color.setdefault(value.lower().replace(" ", ""), []).append(name)
    assert not {c: names for c, names in by_color.items() if len(names) > 1}
    assert E.COLORS["other_this_process"] != H.KIND_COLORS["optimizer_state"]        # the pair


# ---- 8. figures never wrap -----------------------------------------------------------------------------

def test_figure_cells_do_not_wrap():
    html = H.history_html(records(2))
    cells = re.findall(r'<td style="([^"]*)">([^<]*)</td>', html)
    figures = [style for style, value in cells if re.search(r"\d", value)]
    assert figures and all("white-space:nowrap" in style for style in figures if "text-align:right" in style)
    assert "white-space:nowrap" in E.NUM


def test_one_colour_per_kind_in_every_view():
    # issue 37: --predict's bar coloured parameters in the "allocated" blue, unlike %gpumem's by-kind bar
    from cuda_magic.display import prediction_view as PV
    from cuda_magic.fakerun.fake_device import KINDS
    from cuda_magic.memory.kinds import KIND_LABELS

    assert set(H.KIND_COLORS) == set(KIND_LABELS)
    assert set(PV.KIND_COLORS) == set(KINDS)
    same = {"parameters": "parameters", "gradients": "gradients", "optimizer state": "optimizer_state",
            "activations": "activations", "the rest": "other"}
    for kind, color in PV.KIND_COLORS.items():
        assert color == H.KIND_COLORS[same[kind]], kind
    assert not set(PV.KIND_COLORS.values()) & set(E.COLORS.values())     # no bar part's colour for a kind
