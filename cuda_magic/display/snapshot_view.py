"""A memory snapshot's reading drawn (`%gpumem --snapshot`, `read_snapshot`): answer first - the peak and
the line that asked for it, what held memory then (by line, by kind), then what would fit - as text with
sparklines, HTML with the inline SVG chart of display/chart.py (no script, nothing fetched), and a widget
that shows the HTML. A what-if (`reading.replay(...)`) is drawn the same way, on its own or in the
reading (`reading.what_ifs`, what the magic's --capacity/--conf asked for)."""
from __future__ import annotations

from html import escape

from cuda_magic.display.blackbox_view import line_label
from cuda_magic.display.chart import Chart, Marker, Series, sparkline, svg
from cuda_magic.display.elements import CODE, FAIL_COLOR, MUTED, PEAK_COLOR, box, html_table, table
from cuda_magic.display.html import KIND_COLORS, legend_items_html
from cuda_magic.memory.kinds import KIND_LABELS
from cuda_magic.units import format_bytes

ROWS = 8
SPARK_WIDTH = 60
RESERVED_COLOR = "#2894c8"
ALLOCATED_COLOR = "#2f6fd6"
BEFORE_COLOR = "#909080"
BEFORE_LABEL = "before the recording"


def where(use) -> str:
    if use is None:
        return "memory from before the recording"
    if use.filename is None and use.cell_line is None:
        return BEFORE_LABEL
    label = line_label(use)
    return f"{label}: {use.code}" if use.code and not use.code.startswith("(") else (
        use.code if use.code.startswith("(") else label)


def kind_label(kind: str) -> str:
    return BEFORE_LABEL if kind == BEFORE_LABEL else KIND_LABELS.get(kind, kind)


def _when(reading, seconds: float) -> str:
    return f"at {seconds:.2f} s" if reading.timed else f"at entry {int(seconds)}"


def headline(reading) -> list[str]:
    """The answer: the peaks and the lines that asked for them."""
    out = []
    if reading.has_trace:
        out.append(f"Peak allocated {format_bytes(reading.peak_allocated)} {_when(reading, reading.peak_allocated_seconds)}"
                   f", asked for by {where(reading.peak_allocated_line)}")
        if reading.peak_reserved_line is None:
            out.append(f"Peak reserved {format_bytes(reading.peak_reserved)} when the recording began (the cache "
                       "of what ran before it)")
        else:
            out.append(f"Peak reserved {format_bytes(reading.peak_reserved)} "
                       f"{_when(reading, reading.peak_reserved_seconds)}, asked for by {where(reading.peak_reserved_line)}")
    else:
        out.append(f"{format_bytes(reading.end_allocated)} allocated and {format_bytes(reading.end_reserved)} reserved "
                   "when the snapshot was taken")
    if reading.oom is not None:
        o = reading.oom
        out.append(f"Out of memory in the recording: {format_bytes(o.requested)} asked for by {where(o.line)} with "
                   f"{format_bytes(o.allocated)} allocated, {format_bytes(o.reserved)} reserved")
    return out


def recorded_with(reading) -> str:
    parts = [f"device {reading.device}" + (f" of {len(reading.devices)}" if len(reading.devices) > 1 else "")]
    if reading.era:
        parts.append(reading.era)
    parts.append(f"settings: {reading.settings or 'torch defaults'}")
    parts.append(f"{reading.events:,} entries" if reading.has_trace else "no history")
    return "; ".join(parts)


def fits_words(w) -> str:
    cap = format_bytes(w.capacity) if w.capacity is not None else "no limit"
    settings = w.settings or "torch defaults"
    if w.fits:
        head = f"On {cap} with {settings}: fits, peak reserved {format_bytes(w.peak_reserved)}"
    else:
        f = w.failure
        head = (f"On {cap} with {settings}: runs out at {where(f.line)}, asking for {format_bytes(f.requested)} "
                f"with {format_bytes(f.allocated)} allocated and {format_bytes(f.reserved)} reserved "
                "(after the allocator released what it could)")
    return head


def smallest_words(reading) -> list[str]:
    """What would fit, at the recorded settings and with expandable_segments:True."""
    if not reading.has_trace:
        return []
    out = [f"Smallest capacity that fits: {format_bytes(reading.smallest_capacity)} at the recorded settings"]
    if "expandable_segments:True" not in reading.settings:
        exp = reading.replay(None, "expandable_segments:True")
        out[0] += f", {format_bytes(exp.smallest_capacity)} with expandable_segments:True"
    return out


def what_if_lines(reading) -> list[str]:
    whats = list(getattr(reading, "what_ifs", []) or [])
    if not whats:
        return smallest_words(reading)
    out = []
    for w in whats:
        out.append(fits_words(w))
        out.append(f"  smallest capacity that fits with these settings: {format_bytes(w.smallest_capacity)}")
        out += [f"  note: {n}" for n in w.notes]
    return out


def _rows(uses, rows: int = ROWS):
    shown, rest = uses[:rows], uses[rows:]
    body = [[format_bytes(u.bytes), "" if u.filename is None and u.cell_line is None else str(u.tensors), where(u)]
            for u in shown]          # memory from before the recording is one row, its blocks not counted
    if rest:
        body.append([format_bytes(sum(u.bytes for u in rest)), str(sum(u.tensors for u in rest)),
                     f"{len(rest)} more lines"])
    return body


def _kinds_words(kinds: dict) -> str:
    return ", ".join(f"{kind_label(k)} {format_bytes(b)}" for k, b in kinds.items())


# ---- text ----------------------------------------------------------------------------------------

def reading_text(reading) -> str:
    lines = [f"Memory snapshot{' ' + reading.source if reading.source else ''} ({recorded_with(reading)})"]
    lines += headline(reading)
    if reading.has_trace and reading.timeline:
        top = max(reading.peak_reserved, 1)
        lines.append(f"  {sparkline([a for _, a, _ in reading.timeline], SPARK_WIDTH, top=top)}  allocated")
        lines.append(f"  {sparkline([r for _, _, r in reading.timeline], SPARK_WIDTH, top=top)}  reserved")
    if reading.oom is not None and reading.oom_by_line:
        lines.append("Alive at the out-of-memory error, by line:")
        lines += table(["bytes", "blocks", "where"], _rows(reading.oom_by_line, reading.rows), right={0, 1})
    lines.append("Alive at the peak, by line:" if reading.has_trace else "Alive in the snapshot, by line:")
    lines += table(["bytes", "blocks", "where"], _rows(reading.by_line, reading.rows), right={0, 1})
    if reading.by_kind:
        lines.append(f"By kind: {_kinds_words(reading.by_kind)}")
    if reading.has_trace and reading.by_kind_end:
        lines.append(f"At the end: {format_bytes(reading.end_allocated)} allocated ({_kinds_words(reading.by_kind_end)})")
    lines.append(f"Fragmentation: {format_bytes(reading.fragmentation)} reserved but unallocated at the peak reserved; "
                 f"{format_bytes(reading.inactive_split)} in free pieces of partly used segments at the end")
    if reading.diagnosis is not None:
        lines.append(f"Why: {reading.diagnosis.summary}")
        lines += [f"  - {a.text}" + (f"  {a.code}" if a.code else "") for a in reading.diagnosis.advice[:3]]
    lines += what_if_lines(reading)
    lines += [f"note: {n}" for n in reading.notes]
    return "\n".join(lines)


def what_if_text(w) -> str:
    lines = [fits_words(w)]
    if w.smallest_capacity is not None:
        lines.append(f"Smallest capacity that fits with these settings: {format_bytes(w.smallest_capacity)}")
    lines.append(f"Peak reserved {format_bytes(w.peak_reserved)} (recorded: {format_bytes(w.recorded_peak_reserved)})")
    lines += [f"note: {n}" for n in w.notes]
    return "\n".join(lines)


# ---- HTML ----------------------------------------------------------------------------------------

def timeline_chart(reading) -> str:
    pts = reading.timeline
    series = [Series("reserved", [(s, r) for s, _, r in pts], RESERVED_COLOR, dashed=True),
              Series("allocated", [(s, a) for s, a, _ in pts], ALLOCATED_COLOR)]
    markers = [Marker(f"peak {format_bytes(reading.peak_allocated)}", reading.peak_allocated,
                      reading.peak_allocated_seconds, PEAK_COLOR)]
    if reading.oom is not None:
        markers.append(Marker("out of memory", reading.oom.allocated + reading.oom.requested, reading.oom.seconds,
                              FAIL_COLOR, scale=False, base=reading.oom.allocated))
    return svg(Chart(series, markers, x_label="seconds" if reading.timed else "entries"))


def _table_html(uses, rows: int = ROWS) -> str:
    return html_table(["bytes", "blocks", "where"], _rows(uses, rows), {0, 1}, cls="cuda-magic-by-line")


def _kinds_html(kinds: dict) -> str:
    entries = [(kind_label(k), KIND_COLORS.get(k, BEFORE_COLOR), b) for k, b in kinds.items()]
    return f'<div class="cuda-magic-kinds-legend"><b>By kind</b> {legend_items_html(entries)}</div>'


def reading_html(reading) -> str:
    out = [f'<div><b>Memory snapshot</b> {escape(reading.source)} <span style="{MUTED}">· '
           f'{escape(recorded_with(reading))}</span></div>']
    out += [f'<div class="cuda-magic-answer">{escape(line)}</div>' for line in headline(reading)]
    if reading.has_trace and reading.timeline:
        out.append(f'<div class="cuda-magic-timeline">{timeline_chart(reading)}</div>')
    if reading.oom is not None and reading.oom_by_line:
        out.append("<div><b>Alive at the out-of-memory error, by line</b></div>" + _table_html(reading.oom_by_line, reading.rows))
    title = "Alive at the peak, by line" if reading.has_trace else "Alive in the snapshot, by line"
    out.append(f"<div><b>{title}</b></div>" + _table_html(reading.by_line, reading.rows))
    if reading.by_kind:
        out.append(_kinds_html(reading.by_kind))
    out.append(f'<div>Fragmentation: <b>{format_bytes(reading.fragmentation)}</b> reserved but unallocated at the '
               f'peak reserved; {format_bytes(reading.inactive_split)} in free pieces of partly used segments at '
               "the end</div>")
    if reading.diagnosis is not None:
        out.append(f"<div><b>Why:</b> {escape(reading.diagnosis.summary)}</div><ul>" + "".join(
            f"<li>{escape(a.text)}" + (f' <code style="{CODE}">{escape(a.code)}</code>' if a.code else "") + "</li>"
            for a in reading.diagnosis.advice[:3]) + "</ul>")
    out += [f'<div class="cuda-magic-what-if"><b>{escape(line)}</b></div>' if i == 0 else
            f'<div class="cuda-magic-what-if">{escape(line.strip())}</div>'
            for i, line in enumerate(what_if_lines(reading))]
    out += [f'<div style="{MUTED}">note: {escape(n)}</div>' for n in reading.notes]
    return box("".join(out), "cuda-magic-snapshot-reading")


def what_if_html(w) -> str:
    return box("".join(f"<div>{escape(line)}</div>" for line in what_if_text(w).splitlines()),
               "cuda-magic-what-if")


def reading_widget(reading):
    from cuda_magic.display.widget import RecordWidget, ipywidgets

    class SnapshotReadingWidget(RecordWidget):
        def __init__(self, r):
            self.reading = r
            self._html = reading_html(r)
            self.widget = ipywidgets().HTML(self._html)

        def text(self) -> str:
            return reading_text(self.reading)

        def html(self) -> str:
            return self._html

    return SnapshotReadingWidget(reading)


def forms(obj):
    """(text, html, widget) builders for a reading or a what-if (display/show.py's `forms_of`)."""
    from cuda_magic.oom.snapshot_reading import SnapshotReading

    if isinstance(obj, SnapshotReading):
        return (lambda: reading_text(obj), lambda: reading_html(obj), lambda: reading_widget(obj))
    return (lambda: what_if_text(obj), lambda: what_if_html(obj), None)
