"""`%gpumem --history`: the --watch records as a table (text.py, html.py) with a chart of allocated-after
and peak per cell across the session, cell numbers on the x axis (an inline SVG through chart.py for HTML
and widgets, two sparklines for text). A leak that grows a little every cell shows as a rising line."""
from __future__ import annotations

from cuda_magic.display import html as H
from cuda_magic.display import text as T
from cuda_magic.display.chart import Chart, Marker, Series, sparkline, svg
from cuda_magic.display.elements import CAP_COLOR, COLORS, FAIL_COLOR, PEAK_COLOR
from cuda_magic.units import format_bytes

MAX_TICKS = 12
AFTER_COLOR = COLORS["torch_allocated"]      # the level of allocated memory, as in the device bars
OOM_LABEL = "ran out of memory"


def _points(records, attr: str) -> list[tuple[float, int]]:
    return [(float(r.cell), int(getattr(r, attr))) for r in records if getattr(r, attr) is not None]


def _ticks(cells: list[int]) -> list[tuple[float, str]]:
    """At most MAX_TICKS cell numbers, evenly picked, the first and last always."""
    if len(cells) <= MAX_TICKS:
        picked = cells
    else:
        step = (len(cells) - 1) / (MAX_TICKS - 1)
        picked = sorted({cells[round(i * step)] for i in range(MAX_TICKS)})
    return [(float(c), str(c)) for c in picked]


def history_chart(records) -> Chart | None:
    """The chart of a device's records; None with fewer than two cells that have figures."""
    after, peak = _points(records, "allocated_after"), _points(records, "peak")
    if max(len(after), len(peak)) < 2:
        return None
    approx = any(not r.peak_exact for r in records)
    series = [Series("allocated after the cell", after, color=AFTER_COLOR, step=False),
              Series("peak during the cell" + (" (~ approximate)" if approx else ""), peak, color=PEAK_COLOR,
                     step=False, dashed=True)]
    cells = sorted({r.cell for r in records})
    return Chart(series=[s for s in series if s.points], markers=history_markers(records), x_label="cell",
                 x_ticks=_ticks(cells), title=f"Memory per cell on {records[0].device}")


def history_markers(records) -> list[Marker]:
    """The device's capacity as a line where the records know it (the last one they give), and a red
    point at each cell that ran out of memory, at its peak (or what it left allocated)."""
    markers = []
    capacity = next((r.capacity for r in reversed(records) if r.capacity), None)
    if capacity:
        markers.append(Marker(f"capacity {format_bytes(capacity)}", capacity, color=CAP_COLOR))
    for r in records:
        y = r.peak if r.peak is not None else r.allocated_after
        if r.outcome == "oom" and y is not None:
            markers.append(Marker(OOM_LABEL, y, x=float(r.cell), color=FAIL_COLOR))
    return markers


def by_device(records) -> list[list]:
    """The records split per device, in the order devices first appear."""
    groups: dict[str, list] = {}
    for r in records:
        groups.setdefault(r.device, []).append(r)
    return list(groups.values())


def history_svg(records) -> str:
    """One SVG chart per device with at least two cells recorded; empty when there is none."""
    return "".join(svg(chart) for chart in map(history_chart, by_device(records)) if chart is not None)


def history_sparklines(records, width: int = 40) -> list[str]:
    """Per device: allocated-after and peak as sparklines on one scale, from the lowest figure of either to
    the highest (so that a slow leak still climbs), with the first and last figures."""
    lines = []
    for group in by_device(records):
        after = [r.allocated_after for r in group if r.allocated_after is not None]
        peak = [r.peak for r in group if r.peak is not None]
        if max(len(after), len(peak)) < 2:
            continue
        low, top = min(after + peak), max(after + peak)
        span = f"cells {group[0].cell}..{group[-1].cell}"
        lines.append(f"{group[0].device}, {span}, scale {format_bytes(low)}..{format_bytes(top)}:")
        if after:
            spark = sparkline([v - low for v in after], width, top - low)
            lines.append(f"  after {spark}  {format_bytes(after[0])} -> {format_bytes(after[-1])}")
        if peak:
            spark = sparkline([v - low for v in peak], width, top - low)
            lines.append(f"  peak  {spark}  max {format_bytes(max(peak))}")
    return lines


def history_text(records) -> str:
    lines = history_sparklines(records)
    return T.history_text(records) + ("\n" + "\n".join(lines) if lines and records else "")


def history_html(records) -> str:
    return H.history_html(records, chart=history_svg(records))
