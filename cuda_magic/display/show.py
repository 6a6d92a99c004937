"""Showing a record in the best form the frontend can render.

- In a Jupyter kernel: HTML with a text/plain twin. A finished record is static: what stays in the
  notebook needs no widget state (JupyterLab does not save it by default: a widget output reopened there
  reads "Error displaying widget: model not found"), and reads untrusted too (the sanitiser's copy).
  Widgets serve only while a cell runs (a guarded cell's attempts and gauge, `%gpumem --live`); when it
  ends, its output is replaced by the HTML and text of its last state.
- In a kernel without ipywidgets: the same HTML; the live views are display updates.
- Elsewhere (terminal IPython, plain python): plain text, printed.

The environment variable CUDA_MAGIC_DISPLAY=text|html|widget forces a form.
"""
from __future__ import annotations

import os
import sys
import warnings
from dataclasses import replace

from cuda_magic.display.layout import watch_line
from cuda_magic.ipython import current_shell

ENV_VAR = "CUDA_MAGIC_DISPLAY"
FORMS = ("text", "html", "widget")


def have_ipywidgets() -> bool:
    from importlib.util import find_spec

    return find_spec("ipywidgets") is not None


def display_form() -> str:
    """'widget', 'html' or 'text': what show() uses here and now."""
    forced = os.environ.get(ENV_VAR, "").strip().lower()
    if forced in FORMS:
        return forced
    if forced:
        warnings.warn(f"{ENV_VAR}={forced!r} is not one of text, html, widget: choosing the form automatically",
                      stacklevel=2)
    shell = current_shell()
    if shell is None or getattr(shell, "kernel", None) is None:
        return "text"
    return "widget" if have_ipywidgets() else "html"


def forms_of(obj):
    """(text, html, widget) builders for a record; widget is None where a record has no widget."""
    from cuda_magic.memory.snapshot import CellRecord, Snapshot, SnapshotDiff
    from cuda_magic.devices.readings import DeviceMemory, ProcessMemory
    from cuda_magic.recover.report import GuardReport, ReleaseReport
    from cuda_magic.memory.blackbox import BlackBox
    from cuda_magic.display import html as H
    from cuda_magic.display import layout as L
    from cuda_magic.display import text as T
    from cuda_magic.display import widget as W

    from cuda_magic.oom.snapshot_reading import SnapshotReading, WhatIf

    if isinstance(obj, (SnapshotReading, WhatIf)):       # %gpumem --snapshot (display/snapshot_view.py)
        from cuda_magic.display.snapshot_view import forms

        return forms(obj)
    if isinstance(obj, Snapshot):
        return (lambda: T.snapshot_text(obj), lambda: H.snapshot_html(obj), lambda: W.SnapshotWidget(obj))
    if isinstance(obj, SnapshotDiff):
        return (lambda: T.diff_text(obj), lambda: H.diff_html(obj), None)
    if isinstance(obj, GuardReport):
        return (lambda: T.guard_text(obj), lambda: H.guard_html(obj), lambda: W.GuardWidget(obj))
    if isinstance(obj, BlackBox):
        from cuda_magic.display import blackbox_view as TL

        return (lambda: TL.timeline_text(obj), lambda: TL.blackbox_html(obj), None)
    from cuda_magic.fakerun.prediction import Prediction

    if isinstance(obj, Prediction):
        from cuda_magic.display import prediction_view as PV

        return (lambda: PV.prediction_text(obj), lambda: PV.prediction_html(obj), None)
    if isinstance(obj, ReleaseReport):
        return (lambda: T.release_text(obj), lambda: H.release_html(obj), None)
    if isinstance(obj, CellRecord):
        return (lambda: L.watch_line(obj), lambda: H.watch_html(obj), lambda: W.WatchWidget([obj]))
    if isinstance(obj, (list, tuple)) and all(isinstance(o, CellRecord) for o in obj):
        from cuda_magic.display.history import history_html, history_text

        return (lambda: history_text(obj), lambda: history_html(obj), lambda: W.WatchWidget(obj))
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(o, ProcessMemory) for o in obj):
        return (lambda: T.processes_text(obj), lambda: H.processes_html(obj), None)
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(o, DeviceMemory) for o in obj):
        return (lambda: "\n".join(line for d in obj for line in T.device_text(d)),
                lambda: H.box("".join(H.device_html(d) for d in obj)), lambda: W.MemoryBarsWidget(obj))
    raise TypeError(f"cuda_magic cannot display a {type(obj).__name__}")


def publish(bundle: dict, display_id: bool = False):
    from IPython.display import display

    return display(bundle, raw=True, display_id=display_id or None)


def show(obj, *, quiet: bool = False, form: str | None = None):
    """Display a record (snapshot, diff, guard or release report, --watch records, processes).

    Returns None (so that `show(x)` as a cell's last line does not display it twice); `quiet` shows
    nothing. For a live view use show_guard, or build a widget from display.widget and update it.
    """
    if quiet:
        return None
    text, html, _ = forms_of(obj)
    form = form or display_form()
    # a record shown once is finished: static HTML and text, never a widget (module docstring)
    if form in ("widget", "html") and current_shell() is not None:
        publish({"text/html": html(), "text/plain": text()})
        return None
    print(text())
    return None


def show_full(report, *, form: str | None = None) -> None:
    """A guard report in full: the answer, then the part the report folds, open (`%oomguard last`)."""
    from cuda_magic.display.html import guard_html
    from cuda_magic.display.text import guard_text

    form = form or display_form()
    if form in ("widget", "html") and current_shell() is not None:
        publish({"text/html": guard_html(report, full=True), "text/plain": guard_text(report, full=True)})
        return
    print(guard_text(report, full=True))


class GuardHandle:
    """What show_guard returns: shows each attempt as it happens, then the final report."""

    def __init__(self, report, *, quiet: bool = False, form: str | None = None):
        self.report = report
        self.quiet = quiet
        self.form = form or display_form()
        self.attempts = list(report.attempts)
        self.widget = None
        self.display = None
        self.trying = None           # (value, accumulation) a retry is about to run
        self.gauge = None            # a display.gauge.LiveGauge while the cell runs, if one was started
        if quiet:
            return
        if current_shell() is None:
            self.form = "text"
        if self.form == "widget":
            from cuda_magic.display.widget import GuardWidget

            try:
                self.widget = GuardWidget(self.running(), running=True)
            except ImportError as exc:
                warnings.warn(f"{exc}; showing HTML instead", stacklevel=3)
                self.form = "html"
            else:
                self.display = publish(self.widget.bundle(), display_id=True)
        if self.form == "html":
            self.display = publish(self.html_bundle(self.running(), running=True), display_id=True)

    def running(self):
        """The report with the attempts shown so far (drawn with running=True: the cell is not done)."""
        return replace(self.report, attempts=list(self.attempts))

    @staticmethod
    def html_bundle(report, running: bool = False, trying=None) -> dict:
        from cuda_magic.display.html import guard_html
        from cuda_magic.display.text import guard_text

        return {"text/html": guard_html(report, running, trying=trying),
                "text/plain": guard_text(report, running, trying=trying)}

    def try_value(self, value, accumulate=None) -> None:
        """A retry is about to run the cell at `value` (and `accumulate`): the header says so at once."""
        self.trying = (value, accumulate)
        last = self.attempts[-1] if self.attempts else None
        if last is not None and last.outcome == "ok" and not last.probe and last.value == value:
            return      # the retry sets the value that fitted, to keep it (recover/retry_loop.py): no attempt follows
        if self.quiet:
            return
        if self.form == "widget":
            self.widget.try_value(value, accumulate, report=self.report)   # the live report: its retry is set
        elif self.form == "html":
            self.display.update(self.html_bundle(self.running(), running=True, trying=self.trying), raw=True)

    def add_attempt(self, attempt) -> None:
        """One attempt has finished: show it now."""
        self.attempts.append(attempt)
        if self.quiet:
            return
        from cuda_magic.display.widget import finished_trying

        self.trying = finished_trying(self.running(), attempt, self.trying)
        if self.form == "widget":
            # the live view updates (from the live report, whose retry the widget's copy lacks); the fallback
            # forms at finish
            self.widget.add_attempt(attempt, report=self.report)
        elif self.form == "html":
            self.display.update(self.html_bundle(self.running(), running=True, trying=self.trying), raw=True)
        elif self.report.variable:
            from cuda_magic.display.text import attempt_line

            print(attempt_line(attempt, len(self.attempts), self.report.variable), flush=True)

    def show_report(self, report) -> None:
        """The cell is done: show the whole report in place of the running view."""
        self.stop_gauge()
        self.report = report
        self.attempts = list(report.attempts)
        if self.quiet:
            return
        if self.form == "widget":
            # the widget served while the cell ran; what stays is static HTML and text (module docstring)
            widget, self.widget = self.widget, None
            self.display.update(self.html_bundle(report), raw=True)
            widget.close()
        elif self.form == "html":
            self.display.update(self.html_bundle(report), raw=True)
        else:
            from cuda_magic.display.text import guard_text

            print(guard_text(report), flush=True)

    def stop_gauge(self) -> None:
        """Stop and join the live gauge's thread, if one runs."""
        gauge, self.gauge = self.gauge, None
        if gauge is not None:
            gauge.stop()


def show_guard(report, *, quiet: bool = False, form: str | None = None) -> GuardHandle:
    """Start showing a guarded cell: `h = show_guard(r); h.add_attempt(a); ...; h.show_report(r)`."""
    return GuardHandle(report, quiet=quiet, form=form)


def show_watch(record, *, quiet: bool = False, form: str | None = None):
    """After a cell under `%gpumem --watch`: one compact line (or a widget row)."""
    if quiet:
        return None
    form = form or display_form()
    if form == "text":   # the common terminal case, after every cell: skip building the other forms
        out = sys.stdout                 # print() in one write: IPython 9 tees each write into its history
        if out is not None:              # (layout imported with this module: an import statement here cost
            out.write(watch_line(record) + "\n")   # 3-7 us a cell after a real cell, bench_watch --against)
        return None
    return show(record, form=form)
