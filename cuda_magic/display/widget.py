"""ipywidgets forms of the records, for notebooks whose frontend renders widgets.

Each class wraps an ipywidgets root (`.widget`; other attributes fall through to it, so `w.model_id`
and `w._dom_classes` work) and knows its own text and HTML forms, so that a displayed widget also
carries text/html and text/plain with the same facts. ipywidgets is imported when a widget is built.

CSS classes, a contract with the browser tests: the root has `cuda-magic-widget`; each memory bar
`cuda-magic-bar`; each of its segments `cuda-magic-part-<part>` (parts from devices/readings.PARTS, plus
`unknown`); the guard's sections `cuda-magic-guard`, `cuda-magic-attempts`, `cuda-magic-diagnosis`,
`cuda-magic-reclaimed`; the --watch rows `cuda-magic-watch`.
"""
from __future__ import annotations

from html import escape

from cuda_magic.display import answer as A
from cuda_magic.display import html as H
from cuda_magic.display.elements import BOX, COLORS, MUTED
from cuda_magic.display import layout as L
from cuda_magic.display import text as T
from cuda_magic.display.history import history_html, history_text

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def ipywidgets():
    try:
        import ipywidgets as widgets
    except ImportError as exc:
        raise ImportError("cuda_magic's notebook widgets need ipywidgets: pip install 'ipywidgets>=7.7'") from exc
    return widgets


def fragment(html: str) -> str:
    """An HTML widget's value: our own font and line height (the widget's default line height is 28px)."""
    return f'<div style="{BOX}">{html}</div>' if html else ""


def with_classes(w, *classes: str):
    for cls in classes:
        w.add_class(cls)
    return w


def finished_trying(report, attempt, trying):
    """What the header says is tried once `attempt` ended: in a retry, its value until the next value is
    set (answer.headline then says the attempt ended and the next value is being chosen); the first
    attempt runs at the cell's own value without a try_value before it."""
    if report.variable and attempt.value is not None and (trying is None or trying[0] != attempt.value):
        return (attempt.value, trying[1] if trying and trying[0] == attempt.value else None)
    return trying


class RecordWidget:
    """Base of the wrappers: the ipywidgets root plus the text and HTML forms of what it shows."""

    widget = None

    def __getattr__(self, name):
        return getattr(self.widget, name)

    def text(self) -> str:
        raise NotImplementedError

    def html(self) -> str:
        raise NotImplementedError

    def bundle(self) -> dict:
        """The output bundle: the widget view, and HTML and text for where widgets do not render."""
        return {
            WIDGET_MIME: {"model_id": self.widget.model_id, "version_major": 2, "version_minor": 0},
            "text/html": self.html(),
            "text/plain": self.text(),
        }

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs):
        return self.bundle()

    def close(self) -> None:
        """Close the root and every widget inside it (their models leave the kernel and the page): a
        finished view is replaced by static HTML (display/show.py), nothing of it is left to sync."""
        stack = [self.widget]
        while stack:
            w = stack.pop()
            stack.extend(getattr(w, "children", ()) or ())
            w.close()

    def __repr__(self) -> str:
        return self.text()


def bar_widget(dev):
    """An HBox of coloured segments whose widths (in %) add up to 100; empty when the capacity is unknown."""
    widgets = ipywidgets()
    segments = L.bar_segments(dev)
    widths = L.percentages([b for _, b in segments])
    children = []
    for (part, nbytes), width in zip(segments, widths):
        title = H.segment_title(dev, part, nbytes)
        seg = widgets.HTML(
            value=(f'<div title="{escape(title)}" style="width:100%;height:18px;'
                   f'background:{COLORS[part]}"></div>'),
            layout=widgets.Layout(width=f"{width}%", height="18px", margin="0", padding="0", min_width="0",
                                  overflow="hidden", flex="0 0 auto"),
        )
        # ipywidgets 8 traits; on 7 the inner div's title and colour carry the same.
        if seg.has_trait("tooltip"):
            seg.tooltip = title
        if seg.style.has_trait("background"):
            seg.style.background = COLORS[part]
        children.append(with_classes(seg, f"cuda-magic-part-{part}"))
    bar = widgets.HBox(children, layout=widgets.Layout(
        width="100%", height="20px", border="1px solid #9e9e9e", margin="3px 0", overflow="hidden"))
    return with_classes(bar, "cuda-magic-bar")


class MemoryBarsWidget(RecordWidget):
    """One bar per device, its parts adding up to the capacity, with the figures under it."""

    def __init__(self, devices):
        widgets = ipywidgets()
        self.widget = with_classes(widgets.VBox(layout=widgets.Layout(max_width="860px")), "cuda-magic-widget")
        self.update(devices)

    def update(self, devices) -> None:
        widgets = ipywidgets()
        self.devices = list(devices)
        self.bars = []
        children = []
        for dev in self.devices:
            cap = T.format_bytes(dev.capacity) if dev.capacity is not None else "capacity not known"
            head = widgets.HTML(fragment(f'<b>{escape(dev.key)}</b> {escape(dev.name)} '
                                         f'<span style="{MUTED}">· {cap}</span>'))
            bar = bar_widget(dev)
            self.bars.append(bar)
            notes = "".join(f'<div style="{MUTED}">note: {escape(n)}</div>' for n in dev.notes)
            peak = f"<div>{escape(L.peak_words(dev.peak, dev.peak_exact))}</div>"
            figures = widgets.HTML(fragment(H.legend_html(dev) + peak + notes))
            device_box = widgets.VBox([head, bar, figures], layout=widgets.Layout(margin="0 0 8px 0"))
            children.append(with_classes(device_box, "cuda-magic-device"))
        self.widget.children = children

    def text(self) -> str:
        return "\n".join(line for dev in self.devices for line in T.device_text(dev))

    def html(self) -> str:
        return H.box("".join(H.device_html(d) for d in self.devices))


class SnapshotWidget(RecordWidget):
    """`%gpumem`: the memory bars, then the top tensors (and processes) as a table."""

    def __init__(self, snap):
        widgets = ipywidgets()
        self.snapshot = snap
        self.memory = MemoryBarsWidget(snap.device_list)
        notes = "".join(f'<div style="{MUTED}">note: {escape(n)}</div>' for n in snap.notes)
        notes = widgets.HTML(fragment(notes))
        procs = H.processes_html(snap.processes) if snap.processes else ""
        tables = widgets.HTML(fragment(H.tensors_html(snap) + procs))
        self.kinds = widgets.HTML(fragment(H.snapshot_kinds_html(snap)))
        self.memory.widget.remove_class("cuda-magic-widget")
        self.widget = with_classes(widgets.VBox([notes, self.memory.widget, self.kinds, tables]),
                                   "cuda-magic-widget", "cuda-magic-snapshot")
        self.bars = self.memory.bars

    def text(self) -> str:
        return T.snapshot_text(self.snapshot)

    def html(self) -> str:
        return H.snapshot_html(self.snapshot)


class GuardWidget(RecordWidget):
    """`%%oomguard`: before / peak / after per device, the attempts as they happen, then the diagnosis."""

    def __init__(self, report, running: bool = False):
        widgets = ipywidgets()
        self.title = widgets.HTML()
        self.levels = with_classes(widgets.HTML(), "cuda-magic-guard")
        self.attempts = with_classes(widgets.HTML(), "cuda-magic-attempts")
        self.diagnosis = with_classes(widgets.HTML(), "cuda-magic-diagnosis")
        self.blackbox = with_classes(widgets.HTML(), "cuda-magic-blackbox")
        self.reclaimed = with_classes(widgets.HTML(), "cuda-magic-reclaimed")
        self.warnings = widgets.HTML()
        self.details = with_classes(widgets.HTML(), "cuda-magic-details-widget")
        self.trying = None              # (value, accumulation) being tried, while a retry runs
        # the live gauge (display.gauge) draws here while the cell runs; hidden until it first draws
        self.gauge = with_classes(widgets.HTML(layout=widgets.Layout(display="none")), "cuda-magic-gauge-widget")
        self.widget = with_classes(
            # after an OOM: the headline, the answer (in `diagnosis`), the black box, the folded rest
            widgets.VBox([self.title, self.levels, self.gauge, self.attempts, self.diagnosis, self.blackbox,
                          self.reclaimed,
                          self.warnings, self.details],
                         layout=widgets.Layout(max_width="860px")),
            "cuda-magic-widget")
        self.update(report, running)

    @staticmethod
    def _show(w, value: str) -> None:
        w.value = fragment(value)
        w.layout.display = None if value else "none"

    def add_attempt(self, attempt, report=None) -> None:
        """Show one more finished attempt (the report's own list is left alone), and the header with it
        (in a retry, with the next attempt: try_value). `report`: the run's report as it now stands (a
        retry sets its `retry` after the widget was built, and the attempts table and the value in the
        header need it); default: the one shown so far."""
        if report is not None:
            self.report = report
        self.attempt_list.append(attempt)
        self.trying = finished_trying(self.current(), attempt, self.trying)
        current = self.current()
        # the header with the table, in the same update: "attempt N ran out at <value>, choosing the next
        # value" (or, where it fitted, "keeping it") until the next attempt starts (try_value), never the
        # attempt that just ended as running
        self._show(self.title, H.guard_title_html(current, self.running, self.trying))
        self._show(self.attempts, H.attempts_html(current))

    def try_value(self, value, accumulate=None, report=None) -> None:
        """A retry is about to run the cell at `value`: the header says so (`report`: as add_attempt's)."""
        if report is not None:
            self.report = report
        self.trying = (value, accumulate)
        self._show(self.title, H.guard_title_html(self.current(), self.running, self.trying))

    def update(self, report, running: bool = False) -> None:
        """Show the report as it now stands (while the cell runs, or once it is done): after an OOM the
        answer (display/answer.py) unfolded and the rest in `details`."""
        self.report = report
        self.running = running
        self.attempt_list = list(report.attempts)
        if not running:
            self.trying = None
        self._show(self.title, H.guard_title_html(report, running, self.trying))
        self._show(self.blackbox, H.blackbox_html(report, running))
        self._show(self.warnings, H.notes_html(report))
        if A.folds(report, running):
            for w in (self.levels, self.attempts, self.reclaimed):
                self._show(w, "")
            self._show(self.diagnosis, H.answer_html(report))
            self._show(self.details, H.details_html(report))
            return
        self._show(self.levels, H.guard_devices_html(report, running))
        self._show(self.attempts, H.attempts_html(report))
        self._show(self.diagnosis, H.diagnosis_html(report))
        self._show(self.reclaimed, H.reclaimed_html(report) if report.show_reclaimed and not running else "")
        self._show(self.details, "")

    def current(self):
        """The report with the attempts shown so far."""
        from dataclasses import replace

        return replace(self.report, attempts=list(self.attempt_list))

    def text(self) -> str:
        return T.guard_text(self.current(), self.running, trying=self.trying)

    def html(self) -> str:
        return H.guard_html(self.current(), self.running, trying=self.trying)


class WatchWidget(RecordWidget):
    """`%gpumem --watch` / `--history`: one row per cell."""

    def __init__(self, records=()):
        widgets = ipywidgets()
        self.records = list(records)
        self.table = widgets.HTML()
        self.widget = with_classes(widgets.VBox([self.table]), "cuda-magic-widget", "cuda-magic-watch")
        self._render()

    def add(self, record) -> None:
        self.records.append(record)
        self._render()

    def _render(self) -> None:
        if len(self.records) == 1:
            line = escape(L.watch_line(self.records[0]))
            self.table.value = fragment(f'<div style="font-size:12.5px">{line}</div>')
            return
        self.table.value = fragment(history_html(self.records))

    def text(self) -> str:
        if len(self.records) == 1:
            return L.watch_line(self.records[0])
        return history_text(self.records)

    def html(self) -> str:
        # one cell's record is the one line the widget shows, in a saved notebook too (not a table of one)
        if len(self.records) == 1:
            return H.watch_html(self.records[0])
        return history_html(self.records)
