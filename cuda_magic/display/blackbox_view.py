"""The black box drawn: the timeline as an inline SVG step chart (display/chart.py: no script, nothing
fetched) with the table "alive at the failure, by line" in HTML and widget forms, and a sparkline per
attempt with the same table in text. The guard report's forms (html.py, text.py) include them."""
from __future__ import annotations

from html import escape

from cuda_magic.display.chart import Chart, Marker, Series, sparkline, svg
from cuda_magic.display.elements import (CAP_COLOR, CHART_BOX, CODE, COLORS, FAIL_COLOR, MUTED, PEAK_COLOR, box,
                                         html_table)
from cuda_magic.display.elements import table
from cuda_magic.display.layout import shorten
from cuda_magic.paths import is_cell_top_level
from cuda_magic.units import format_bytes

MAX_LINES = 8             # rows of the by-line table; the rest are summed in one row
SPARK_WIDTH = 60


def attempt_series(tl) -> dict[int, list[tuple[float, int]]]:
    traces: dict[int, list[tuple[float, int]]] = {}
    for seconds, allocated, attempt, _ in tl.points:
        traces.setdefault(attempt, []).append((seconds, allocated))
    return traces


def trace_label(attempt: int, count: int) -> str:
    return "allocated" if count == 1 else f"attempt {attempt + 1}"


def headline(tl) -> str:
    """One sentence: the peak, the capacity, and the request that failed."""
    parts = [f"peak {format_bytes(tl.peak)}"]
    if tl.capacity is not None:
        parts.append(f"{'cap' if tl.limited else 'capacity'} {format_bytes(tl.capacity)}")
    if tl.failure is not None:
        parts.append(f"failed asking for {format_bytes(tl.failure.requested)} with "
                     f"{format_bytes(tl.failure.allocated)} allocated")
    return "; ".join(parts)


def line_label(use) -> str:
    """'cell line 3' / 'model.py:42 (attend)' / 'before the run'."""
    if use.filename is None and use.cell_line is None:
        return "before the run"
    where = use.where
    if use.function and not use.in_cell and not is_cell_top_level(use.function):
        where += f" ({use.function})"
    if use.cell_line is not None and not use.in_cell and use.filename is not None:
        where += f", cell line {use.cell_line}"
    return where


def rows_shown(tl, count: int = MAX_LINES, start: int = 0):
    """The rows shown from `start` and what the rest sum to; a rest of one line is shown as its own row
    (a "1 more lines" row would take the space of the row it hides)."""
    lines = tl.by_line[start:]
    if len(lines) == count + 1:
        count += 1
    rows, rest = lines[:count], lines[count:]
    return rows, (sum(u.bytes for u in rest), sum(u.tensors for u in rest), len(rest))


def by_line_title(tl) -> str:
    what = "Alive at the failure" if tl.at == "failure" else "Alive at the peak"
    count = sum(u.tensors for u in tl.by_line)
    return f"{what}, by line ({format_bytes(tl.total)} in {count} storage{'s' if count != 1 else ''})"


BACKWARD_WORDS = "in the backward pass"


def failing_words(tl) -> str | None:
    f = tl.failure
    if f is None:
        return None
    phase = f" {BACKWARD_WORDS}" if f.phase == "backward" else ""
    if f.site is None:
        return f"The failing request: {format_bytes(f.requested)}{phase}"
    code = f" `{f.site.code if len(f.site.code) <= 70 else f.site.code[:69] + '…'}`" if f.site.code else ""
    return f"The failing request: {format_bytes(f.requested)}{phase} of{code} at {line_label(f.site)}" if phase \
        else f"The failing request: {format_bytes(f.requested)} from{code} at {line_label(f.site)}"


# ---- the chart (HTML and widget forms) ----------------------------------------------------------

def attempt_failed(tl, attempt: int) -> bool:
    """Whether the attempt ran out of memory: a retry runs again only after one did, so every attempt up
    to the last failing request's did, and a later one did not."""
    return tl.failure is not None and attempt <= tl.failure.attempt


def trace_series(tl) -> list[Series]:
    """One trace per attempt: allocated memory's colour, red for the attempts that ran out of memory."""
    traces = attempt_series(tl)
    series = []
    for a, pts in sorted(traces.items()):
        label = trace_label(a, len(traces))
        failed = len(traces) > 1 and attempt_failed(tl, a)
        series.append(Series(label + (": out of memory" if failed else ""), pts,
                             color=FAIL_COLOR if failed else COLORS["torch_allocated"]))
    return series


def timeline_markers(tl) -> list[Marker]:
    """The capacity or cap line, the peak, and the failing request as a bar on top of what was allocated,
    which does not set the scale: one larger than the device is pinned to the top edge."""
    markers = []
    if tl.capacity is not None:
        markers.append(Marker(f"{'cap' if tl.limited else 'capacity'} {format_bytes(tl.capacity)}", tl.capacity,
                              color=CAP_COLOR))
    markers.append(Marker(f"peak {format_bytes(tl.peak)}", tl.peak, x=tl.peak_seconds, color=PEAK_COLOR))
    if tl.failure is not None:
        f = tl.failure
        markers.append(Marker(f"failed request +{format_bytes(f.requested)}", f.allocated + f.requested,
                              x=f.seconds, color=FAIL_COLOR, scale=False, base=f.allocated))
    return markers


def timeline_chart(tl) -> str:
    return svg(Chart(trace_series(tl), timeline_markers(tl), x_label="seconds"))


# ---- text ----------------------------------------------------------------------------------------

def timeline_text(tl, rows: int = MAX_LINES, failing: bool = True) -> str:
    """The sparkline per attempt and the by-line table's first `rows`; `failing`: the failing request's
    line too (a report whose headline names it leaves it out)."""
    lines = [f"Black box: allocated memory over the run ({headline(tl)})"]
    traces = attempt_series(tl)
    top = max(tl.capacity or 0, tl.peak)     # as the chart: the failing request does not flatten the trace
    for attempt, pts in sorted(traces.items()):
        spark = sparkline([a for _, a in pts], SPARK_WIDTH, top=top)
        peak = max(a for _, a in pts)
        lines.append(f"  {spark}  {trace_label(attempt, len(traces))}: peak {format_bytes(peak)}")
    if tl.by_line:
        lines.append(by_line_title(tl))
        lines += by_line_text(tl, rows)
    words = failing_words(tl) if failing else None
    if words:
        lines.append(words)
    lines += [f"note: {n}" for n in tl.notes]
    if tl.dropped:
        lines.append(f"note: the oldest {tl.dropped} events were dropped from the timeline; the table is exact")
    return "\n".join(lines)


def by_line_text(tl, rows: int = MAX_LINES, start: int = 0) -> list[str]:
    """The by-line table's lines: `rows` rows from `start`, the rest summed in one row."""
    shown, (rest_bytes, rest_tensors, rest_n) = rows_shown(tl, rows, start)
    body = [[format_bytes(u.bytes), str(u.tensors), line_label(u), shorten(u.code, 60)] for u in shown]
    if rest_n:
        body.append([format_bytes(rest_bytes), str(rest_tensors), f"{rest_n} more lines", ""])
    return table(["bytes", "tensors", "where", "code"], body, right={0, 1})


# ---- HTML (also the widget's) --------------------------------------------------------------------

def by_line_html(tl, rows: int = MAX_LINES, start: int = 0) -> str:
    """The by-line table: `rows` rows from `start`, the rest summed in one row."""
    shown, (rest_bytes, rest_tensors, rest_n) = rows_shown(tl, rows, start)
    body = [[format_bytes(u.bytes), str(u.tensors), escape(line_label(u)),
             f'<code style="{CODE}">{escape(shorten(u.code, 90))}</code>' if u.code else ""] for u in shown]
    if rest_n:
        body.append([format_bytes(rest_bytes), str(rest_tensors), f"{rest_n} more lines", ""])
    return html_table(["bytes", "tensors", "where", "code"], body, {0, 1}, cls="cuda-magic-by-line", raw={2, 3})


def timeline_html(tl, rows: int = MAX_LINES, failing: bool = True) -> str:
    out = [f'<div style="margin-top:6px"><b>Black box:</b> <span style="{MUTED}">{escape(headline(tl))}</span></div>',
           f'<div class="cuda-magic-timeline" style="{CHART_BOX}">{timeline_chart(tl)}</div>']
    if tl.by_line:
        out.append(f"<div><b>{escape(by_line_title(tl))}</b></div>")
        out.append(by_line_html(tl, rows))
    f = tl.failure if failing else None
    if f is not None:
        phase = f" {BACKWARD_WORDS} of" if f.phase == "backward" else " from"
        if f.site is not None:
            code = f' <code style="{CODE}">{escape(shorten(f.site.code, 90))}</code>' if f.site.code else ""
            out.append(f"<div>The failing request: <b>{format_bytes(f.requested)}</b>{phase}{code} at "
                       f"{escape(line_label(f.site))}</div>")
        else:
            out.append(f"<div>The failing request: <b>{format_bytes(f.requested)}</b>"
                       f"{' ' + BACKWARD_WORDS if f.phase == 'backward' else ''}</div>")
    out += [f'<div style="{MUTED}">note: {escape(n)}</div>' for n in tl.notes]
    if tl.dropped:
        out.append(f'<div style="{MUTED}">note: the oldest {tl.dropped} events were dropped from the timeline; '
                   "the table is exact</div>")
    return "".join(out)


def blackbox_html(tl) -> str:
    """The black box as one self-contained HTML block: what a report and the record's own repr show."""
    return box(timeline_html(tl), "cuda-magic-blackbox")
