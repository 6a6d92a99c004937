"""Charts as inline SVG (HTML and widget forms) and as a sparkline (text form).

No script, no style sheet, nothing fetched: the SVG is plain markup with inline attributes, so it survives
saving, nbconvert, GitHub, VS Code and Colab. Every series is drawn from int byte counts; the axis labels
are the only formatted text. The black box's timeline and `%gpumem --history` both draw through here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from html import escape

from cuda_magic.units import format_bytes

SPARK = "▁▂▃▄▅▆▇█"
MAX_COLUMNS = 1000                      # a series longer than this is bucketed (each bucket's maximum)
PALETTE = ("#1f5fbf", "#c62828", "#2e7d32", "#a15c00", "#8e5cc4", "#00838f")


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
    """A horizontal line across the chart (a capacity, a cap) or a point (a peak, a failing request)."""

    label: str
    y: int
    x: float | None = None              # None: a horizontal line; else a point at (x, y)
    color: str = "#555555"


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


def svg(chart: Chart, width: int = 640, height: int = 180) -> str:
    """The chart as one <svg> element: axes, series (steps or lines), markers, a legend."""
    left, right, top_pad, bottom = 64, 12, 14 + (14 if chart.title else 0), 30
    legend_h = 16
    plot_w, plot_h = width - left - right, height - top_pad - bottom - legend_h
    xs = [x for s in chart.series for x, _ in s.points] + [m.x for m in chart.markers if m.x is not None]
    ys = [y for s in chart.series for _, y in s.points] + [m.y for m in chart.markers]
    x0, x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
    if x1 <= x0:
        x1 = x0 + 1
    y1 = max(ys + [1])

    def px(x):
        return round(left + (x - x0) / (x1 - x0) * plot_w, 1)

    def py(y):
        return round(top_pad + plot_h - y / y1 * plot_h, 1)

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" class="cuda-magic-chart" '
           f'style="font-family:system-ui,sans-serif;font-size:10px">']
    if chart.title:
        out.append(f'<text x="{left}" y="12" font-weight="600" fill="currentColor">{escape(chart.title)}</text>')
    # axes and y labels (0, half, top)
    out.append(f'<line x1="{left}" y1="{py(0)}" x2="{left + plot_w}" y2="{py(0)}" stroke="#888" stroke-width="1"/>')
    out.append(f'<line x1="{left}" y1="{top_pad}" x2="{left}" y2="{py(0)}" stroke="#888" stroke-width="1"/>')
    for frac in (0.0, 0.5, 1.0):
        y = int(y1 * frac)
        out.append(f'<text x="{left - 4}" y="{py(y) + 3}" text-anchor="end" fill="currentColor">'
                   f'{escape(format_bytes(y))}</text>')
    ticks = chart.x_ticks if chart.x_ticks is not None else [(x0, _num(x0)), (x1, _num(x1))]
    for x, label in ticks:
        out.append(f'<text x="{px(x)}" y="{py(0) + 13}" text-anchor="middle" fill="currentColor">{escape(label)}</text>')
    if chart.x_label:
        out.append(f'<text x="{left + plot_w}" y="{py(0) + 25}" text-anchor="end" fill="currentColor" '
                   f'opacity=".75">{escape(chart.x_label)}</text>')
    for i, s in enumerate(chart.series):
        color = s.color or PALETTE[i % len(PALETTE)]
        pts = bucket_points(s.points)
        if not pts:
            continue
        coords = []
        for j, (x, y) in enumerate(pts):
            if s.step and j:
                coords.append(f"{px(x)},{py(pts[j - 1][1])}")
            coords.append(f"{px(x)},{py(y)}")
        dash = ' stroke-dasharray="4 3"' if s.dashed else ""
        out.append(f'<polyline points="{" ".join(coords)}" fill="none" stroke="{color}" stroke-width="1.5"{dash}>'
                   f'<title>{escape(s.label)}</title></polyline>')
    for m in chart.markers:
        if m.x is None:
            out.append(f'<line x1="{left}" y1="{py(m.y)}" x2="{left + plot_w}" y2="{py(m.y)}" stroke="{m.color}" '
                       f'stroke-width="1" stroke-dasharray="6 3"><title>{escape(m.label)}</title></line>')
            out.append(f'<text x="{left + plot_w}" y="{py(m.y) - 3}" text-anchor="end" fill="{m.color}">'
                       f'{escape(m.label)}</text>')
        else:
            out.append(f'<circle cx="{px(m.x)}" cy="{py(m.y)}" r="3.5" fill="{m.color}">'
                       f'<title>{escape(m.label)}</title></circle>')
    # legend
    lx, ly = left, height - 6
    for i, s in enumerate(chart.series):
        color = s.color or PALETTE[i % len(PALETTE)]
        out.append(f'<rect x="{lx}" y="{ly - 8}" width="10" height="3" fill="{color}"/>'
                   f'<text x="{lx + 14}" y="{ly - 4}" fill="currentColor">{escape(s.label)}</text>')
        lx += 24 + 6 * len(s.label)
    for m in chart.markers:
        if m.x is not None:
            out.append(f'<circle cx="{lx + 4}" cy="{ly - 7}" r="3" fill="{m.color}"/>'
                       f'<text x="{lx + 12}" y="{ly - 4}" fill="currentColor">{escape(m.label)}</text>')
            lx += 20 + 6 * len(m.label)
    out.append("</svg>")
    return "".join(out)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.2f}"
