"""Charts as inline SVG (HTML and widget forms) and as a sparkline (text form).

No script, no style sheet, nothing fetched: the SVG is plain markup with inline attributes, so it survives
saving, nbconvert, GitHub, VS Code and Colab. Every series is drawn from int byte counts, on a y axis with
round ticks (`nice_ticks`). It scales to its output's width (width 100%, at most its viewBox's 640) with
text that stays readable at 400 px; text is in the page's own colour (currentColor), marks in mid tones
that keep 3:1 on light and dark themes. The black box's timeline and `%gpumem --history` draw through here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

SPARK = "▁▂▃▄▅▆▇█"
MAX_COLUMNS = 1000                      # a series longer than this is bucketed (each bucket's maximum)
# series without a colour of their own: mid tones with 3:1 on white and #111111, no red (a failure's)
PALETTE = ("#2f6fd6", "#2e9d4f", "#d9730d", "#9b59d0", "#1a9494", "#b58900")


@dataclass
class Series:
    """One line of a chart: points (x, y bytes) in x order; `step`: hold each y until the next x."""

    label: str
    points: list[tuple[float, int]]
    color: str | None = None
    step: bool = True
    dashed: bool = False


@dataclass
class Marker:
    """A horizontal line across the chart (a capacity, a cap) or a point (a peak, a failing request).

    `scale`: a point that sets the y scale; one that does not (a failing request larger than the device)
    is drawn as a triangle pinned to the top edge where it is above the scale the rest sets. `base`: a
    point drawn as a bar from this y up to its own (a request on top of what was allocated)."""

    label: str
    y: int
    x: float | None = None              # None: a horizontal line; else a point at (x, y)
    color: str = "#888888"
    scale: bool = True
    base: int | None = None


@dataclass
class Chart:
    series: list[Series]
    markers: list[Marker] = field(default_factory=list)
    x_label: str = ""
    x_ticks: list[tuple[float, str]] | None = None   # (x, label); None: the first and last x
    title: str = ""


def bucket_max(values: list[int], columns: int = MAX_COLUMNS) -> list[int]:
    """At most `columns` values, each the maximum of its bucket, so that no peak is lost."""
    if len(values) <= columns:
        return list(values)
    out = []
    for i in range(columns):
        lo, hi = i * len(values) // columns, (i + 1) * len(values) // columns
        out.append(max(values[lo:max(hi, lo + 1)]))
    return out


def bucket_points(points: list[tuple[float, int]], columns: int = MAX_COLUMNS) -> list[tuple[float, int]]:
    """Points thinned to at most `columns`, each bucket keeping its first x and its maximum y."""
    if len(points) <= columns:
        return list(points)
    out = []
    for i in range(columns):
        lo, hi = i * len(points) // columns, (i + 1) * len(points) // columns
        chunk = points[lo:max(hi, lo + 1)]
        out.append((chunk[0][0], max(y for _, y in chunk)))
    return out


def sparkline(values: list[int], width: int = 60, top: int | None = None) -> str:
    """One line of block characters, each the maximum of its bucket, scaled to `top` (default: the max)."""
    if not values:
        return ""
    cells = bucket_max(values, width)
    top = max(top or 0, max(cells), 1)
    return "".join(SPARK[min(len(SPARK) - 1, max(0, round(v / top * (len(SPARK) - 1))))] for v in cells)


WIDTH = 640                             # the viewBox's width; the chart scales down to its container's
FONT = 12                               # viewBox units: at 400 px wide still 7.5 px
CHAR = 7.4                              # a character's width at FONT, at most for most text (the legend's
                                        # wrapping: at 6.8 a long legend ran 1 px past the chart's edge)
AXIS = "#888888"                        # 3:1 and more on white and on a dark theme's #111
GRID = "rgba(128,128,128,.22)"
BYTE_UNITS = ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"), (1, "B"))
DECIMAL_STEPS = (1, 2, 2.5, 5)
MIN_SPAN = 0.01                         # seconds: the shortest x axis (a cell that failed at once)
BINARY_STEPS = (4, 8, 16, 32, 64, 128, 256, 512)


def byte_unit(top: int) -> tuple[int, str]:
    """The largest binary unit not above `top` (bytes for less than 1 KiB)."""
    return next(((u, n) for u, n in BYTE_UNITS if top >= u), (1, "B"))


def _steps(value: float):
    """Candidate steps in the display unit near value/5: 1, 2, 2.5, 5 x 10^k and powers of two."""
    mag = 10.0 ** math.floor(math.log10(max(value, 1e-12) / 5))
    yield from (m * mag * k for k in (1, 10, 100) for m in DECIMAL_STEPS)
    yield from BINARY_STEPS


def nice_ticks(top: int, most: int = 5) -> list[int]:
    """Tick values in int bytes from 0 to a round figure at or above `top`: a step of 1, 2, 2.5 or 5 x 10^k
    (or a power of two) of one binary unit, at most `most` intervals, the lowest such top (3 or more
    intervals where that costs nothing, else the fewer)."""
    top = max(int(top), 1)
    unit, _ = byte_unit(top)
    value = top / unit
    best = None
    for step in _steps(value):
        if unit == 1 and step < 1:
            continue
        n = max(1, math.ceil(value / step - 1e-9))
        if n > most:
            continue
        key = (round(n * step, 9), n < 3, n)
        if best is None or key < best[0]:
            best = (key, step, n)
    _, step, n = best
    return [round(i * step * unit) for i in range(n + 1)]


def compact_bytes(n: int, unit: tuple[int, str] | None = None) -> str:
    """'128 MiB', '1.5 GiB', '0': in `unit` (default: n's own), without needless decimals."""
    if n == 0:
        return "0"
    size, name = unit or byte_unit(abs(n))
    return f"{n / size:.2f}".rstrip("0").rstrip(".") + f" {name}"


def axis_unit(ticks: list[int]) -> tuple[int, str]:
    """The unit the axis labels are in: the top tick's, or the next smaller where a tick would need more
    than two decimals in it."""
    units = [u for u in BYTE_UNITS if u[0] <= max(ticks[-1], 1)]
    return next((u for u in units if all(abs(t / u[0] * 100 - round(t / u[0] * 100)) < 1e-6 for t in ticks)),
                units[-1])


def nice_range(x0: float, x1: float, most: int = 6) -> tuple[float, float, float]:
    """(start, end, step) of round decimal ticks covering x0..x1 (a span of at least MIN_SPAN)."""
    span = max(x1 - x0, MIN_SPAN)
    mag = 10.0 ** math.floor(math.log10(span / most))
    step = next(m * mag * k for k in (1, 10) for m in DECIMAL_STEPS if span / (m * mag * k) <= most)
    start = math.floor(x0 / step + 1e-9) * step
    end = start + max(1, math.ceil((max(x1, x0 + MIN_SPAN) - start) / step - 1e-9)) * step
    return start, end, step


def _decimals(step: float) -> int:
    return next(d for d in range(10) if abs(round(step, d) - step) < 1e-9 * max(1.0, step))


def _scale_top(chart: Chart) -> int:
    """The y scale's top before rounding: the series, the lines and the points that set the scale; the
    points that do not (a failing request) only where nothing else says anything."""
    ys = [y for s in chart.series for _, y in s.points]
    ys += [m.y for m in chart.markers if m.x is None or m.scale]
    top = max(ys + [0])
    if top <= 0:
        top = max([m.y for m in chart.markers] + [0])
    return top if top > 0 else 1 << 20


def _legend(entries, left: int, right: int):
    """(x, row, entry) for each legend entry, wrapped into rows that fit between left and right."""
    x, row, out = left, 0, []
    for entry in entries:
        w = 22 + CHAR * len(entry[2])
        if x > left and x + w > right:
            x, row = left, row + 1
        out.append((x, row, entry))
        x += w + 12
    return out


def svg(chart: Chart, width: int = WIDTH, plot_height: int = 120) -> str:
    """The chart as one <svg> element (axes with round ticks, series as steps or lines, markers, a legend)
    that scales to its container's width: `width` is its viewBox's and its largest."""
    left, right = 70, 26                # room for the y labels, and half the last x label
    plot_w = width - left - right
    ticks_y = nice_ticks(_scale_top(chart))
    y1 = ticks_y[-1]
    pinned = [m for m in chart.markers if m.x is not None and not m.scale and m.y > y1]
    title_h = 20 if chart.title else 0
    pin_h = 16 if pinned else 0
    top_pad = 6 + title_h + pin_h + 14
    plot_bottom = top_pad + plot_height
    entries = [("line", s.color or PALETTE[i % len(PALETTE)], s.label, s.dashed)
               for i, s in enumerate(chart.series) if s.points]
    for m in chart.markers:
        entry = ("pin" if m in pinned else "point", m.color, m.label, False)
        if m.x is not None and entry not in entries:
            entries.append(entry)
    legend = _legend(entries, left, width - right)
    rows = 1 + max([r for _, r, _ in legend] + [0]) if legend else 0
    height = plot_bottom + 36 + 18 * rows

    xs = [x for s in chart.series for x, _ in s.points] + [m.x for m in chart.markers if m.x is not None]
    x0, x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
    if chart.x_ticks is None:
        x0, x1, x_step = nice_range(x0, x1)
        d = _decimals(x_step)
        n = round((x1 - x0) / x_step)
        ticks_x = [(x0 + i * x_step, _num(x0 + i * x_step, d)) for i in range(n + 1)]
    else:
        ticks_x = chart.x_ticks
    if x1 <= x0:
        x0, x1 = x0 - 0.5, x0 + 0.5

    def px(x):
        return round(left + (x - x0) / (x1 - x0) * plot_w, 1)

    def py(y):
        return round(plot_bottom - min(y, y1) / y1 * plot_height, 1)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="100%" viewBox="0 0 {width} {height}" '
           f'preserveAspectRatio="xMinYMin meet" role="img" class="cuda-magic-chart" '
           f'style="display:block;max-width:{width}px;width:100%;height:auto;'
           f'font-family:system-ui,-apple-system,\'Segoe UI\',sans-serif;font-size:{FONT}px">']
    # the chart in words (elements.CHART_BOX): an SVG <desc> is never drawn, and an HTML element inside it
    # (an HTML integration point) is what a sanitiser that drops SVG keeps, in its own font size
    out.append(f'<desc><div class="cuda-magic-chart-text" style="font-size:12.5px;line-height:1.45;'
               f'margin:2px 0 6px 0">{escape(caption(chart))}</div></desc>')
    if chart.title:
        out.append(f'<text x="{left}" y="15" font-weight="600" fill="currentColor">{escape(chart.title)}</text>')
    unit = axis_unit(ticks_y)
    for y in ticks_y:
        if y:
            out.append(f'<line x1="{left}" y1="{py(y)}" x2="{left + plot_w}" y2="{py(y)}" stroke="{GRID}" '
                       f'stroke-width="1"/>')
        out.append(f'<text x="{left - 6}" y="{py(y) + 4}" text-anchor="end" fill="currentColor" '
                   f'class="cuda-magic-y-tick">{escape(compact_bytes(y, unit))}</text>')
    out.append(f'<line x1="{left}" y1="{plot_bottom}" x2="{left + plot_w}" y2="{plot_bottom}" stroke="{AXIS}" '
               f'stroke-width="1"/>')
    out.append(f'<line x1="{left}" y1="{top_pad}" x2="{left}" y2="{plot_bottom}" stroke="{AXIS}" stroke-width="1"/>')
    for x, label in ticks_x:
        out.append(f'<text x="{px(x)}" y="{plot_bottom + 15}" text-anchor="middle" fill="currentColor">'
                   f'{escape(label)}</text>')
    if chart.x_label:
        out.append(f'<text x="{left + plot_w}" y="{plot_bottom + 30}" text-anchor="end" fill="currentColor" '
                   f'opacity=".8">{escape(chart.x_label)}</text>')
    drawn = [s for s in chart.series if s.points]
    for i, s in enumerate(chart.series):
        color = s.color or PALETTE[i % len(PALETTE)]
        pts = bucket_points(s.points)
        if not pts:
            continue
        if len(pts) == 1 and s.step:       # one reading: held until the next trace starts, or the end
            later = [t.points[0][0] for t in drawn if t.points[0][0] > pts[0][0]]
            pts = pts + [(min(later + [x1]), pts[0][1])]
        coords = []
        for j, (x, y) in enumerate(pts):
            if s.step and j:
                coords.append(f"{px(x)},{py(pts[j - 1][1])}")
            coords.append(f"{px(x)},{py(y)}")
        dash = ' stroke-dasharray="5 3"' if s.dashed else ""
        out.append(f'<polyline points="{" ".join(coords)}" fill="none" stroke="{color}" stroke-width="2"{dash}>'
                   f'<title>{escape(s.label)}</title></polyline>')
        if len(pts) == 1:
            out.append(f'<circle cx="{px(pts[0][0])}" cy="{py(pts[0][1])}" r="2.5" fill="{color}"/>')
    # a line's label goes at the right end, or the left where a pinned point's triangle is on the right
    at_right = not any(px(m.x) > left + plot_w / 2 for m in pinned)
    for m in chart.markers:
        out += _marker(m, m in pinned, px, py, (left, plot_w, at_right), 6 + title_h + 12)
    for lx, row, (kind, color, label, dashed) in legend:
        ly = plot_bottom + 40 + 18 * row + 12
        if kind == "line":
            dash = ' stroke-dasharray="5 3"' if dashed else ""
            out.append(f'<line x1="{lx}" y1="{ly - 4}" x2="{lx + 16}" y2="{ly - 4}" stroke="{color}" '
                       f'stroke-width="2.5"{dash}/>')
        elif kind == "pin":
            out.append(f'<path d="M{lx + 2},{ly} L{lx + 14},{ly} L{lx + 8},{ly - 10} Z" fill="{color}"/>')
        else:
            out.append(f'<circle cx="{lx + 8}" cy="{ly - 4}" r="4" fill="{color}"/>')
        out.append(f'<text x="{lx + 22}" y="{ly}" fill="currentColor">{escape(label)}</text>')
    out.append("</svg>")
    return "".join(out)


def caption(chart: Chart) -> str:
    """The chart in one line of words, for where the SVG is not drawn: each line's highest value and each
    marker's label (a point with its x)."""
    parts = [chart.title] if chart.title else []
    unit = chart.x_label or ""
    for s in chart.series:
        if s.points:
            parts.append(f"{s.label}: up to {compact_bytes(max(y for _, y in s.points))}")
    for m in chart.markers:
        at = f" at {_num(m.x, 2)}{' ' + unit if unit else ''}" if m.x is not None and unit else ""
        parts.append(m.label + at)
    return "Chart: " + "; ".join(parts) if parts else ""


def _marker(m: Marker, pinned: bool, px, py, plot: tuple, pin_y: float) -> list[str]:
    """A line across the plot with its label above it; a point; a point above the scale as a triangle on
    the plot's top edge with its label beside it, in the row above the plot."""
    left, plot_w, at_right = plot
    title = f"<title>{escape(m.label)}</title>"
    if m.x is None:
        tx, anchor = (left + plot_w, "end") if at_right else (left + 4, "start")
        return [f'<line x1="{left}" y1="{py(m.y)}" x2="{left + plot_w}" y2="{py(m.y)}" stroke="{m.color}" '
                f'stroke-width="1.5" stroke-dasharray="6 3">{title}</line>',
                f'<text x="{tx}" y="{py(m.y) - 4}" text-anchor="{anchor}" fill="currentColor">'
                f'{escape(m.label)}</text>']
    x, out = px(m.x), []
    if m.base is not None and m.base < m.y:
        out.append(f'<line x1="{x}" y1="{py(m.base)}" x2="{x}" y2="{py(m.y)}" stroke="{m.color}" '
                   f'stroke-width="2"/>')
    if not pinned:
        return out + [f'<circle cx="{x}" cy="{py(m.y)}" r="4" fill="{m.color}">{title}</circle>']
    top = py(m.y)
    anchor, tx = ("end", x - 9) if x > left + plot_w / 2 else ("start", x + 9)
    return out + [f'<path d="M{x - 6},{top + 1} L{x + 6},{top + 1} L{x},{top - 9} Z" fill="{m.color}" '
                  f'class="cuda-magic-off-scale">{title}</path>',
                  f'<text x="{tx}" y="{pin_y}" text-anchor="{anchor}" fill="currentColor">'
                  f'{escape(m.label)} (off the scale)</text>']


def _num(x: float, decimals: int) -> str:
    """x with `decimals` decimals, without trailing zeros."""
    text = f"{x:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if decimals else text
