"""The live gauge: the metered device (allocated, reserved, peak so far, capacity; on CUDA also what other
processes hold) redrawn a few times a second while a cell runs, in notebooks only.

One daemon thread per gauge. It first waits `delay` seconds (a cell that ends sooner shows nothing and
pays only for starting and joining the thread), then reads counters (devices.gauge_reader: ints, never an
allocation on the device) every `interval` seconds and redraws when a figure changed: an ipywidgets HTML
value (its comm message reaches the frontend whatever cell runs), or a display handle's update. `stop()`
joins it: no thread is left behind. Terminal IPython shows no gauge (`gauge_possible()`).

CSS classes, a contract with the browser tests: `cuda-magic-gauge` on the gauge, its figure
`cuda-magic-gauge-allocated`.
"""
from __future__ import annotations

import contextvars
import threading
import time
import warnings
from html import escape

from cuda_magic.display.elements import BAR, BOX, COLORS, MUTED, PEAK_COLOR
from cuda_magic.display.show import display_form, publish
from cuda_magic.ipython import current_shell
from cuda_magic.units import format_bytes

DELAY = 1.0          # seconds a cell runs before its gauge appears
INTERVAL = 0.25      # seconds between readings: 4 a second
THREAD_NAME = "cuda_magic live gauge"


def gauge_possible() -> bool:
    """Whether a gauge can be seen here: a Jupyter kernel (not terminal IPython), and not the text form."""
    shell = current_shell()
    return shell is not None and getattr(shell, "kernel", None) is not None and display_form() != "text"


# ---- the forms ---------------------------------------------------------------------------------

def _figures(r) -> list[tuple[str, str, int | None]]:
    items = [("allocated", "allocated", r.allocated), ("reserved", "reserved", r.reserved),
             ("peak", "peak so far" if r.peak_exact else "peak so far ~", r.peak),
             ("capacity", "capacity", r.capacity)]
    if r.other_processes is not None:
        items.append(("other", "other processes", r.other_processes))
    return [(cls, label, value) for cls, label, value in items if value is not None or cls == "allocated"]


def gauge_text(r) -> str:
    """`[live] sim:0: allocated 1.20 GiB, reserved 1.20 GiB, peak so far 1.50 GiB, capacity 8.00 GiB`"""
    return f"[live] {r.key}: " + ", ".join(f"{label} {format_bytes(v)}" for _, label, v in _figures(r))


def gauge_bar_html(r) -> str:
    """The capacity as a bar: allocated, reserved but unallocated, other processes, free; the peak a mark."""
    cap = r.capacity
    if not cap:
        return ""
    allocated = max(0, r.allocated or 0)
    cached = max(0, (r.reserved or allocated) - allocated)
    other = max(0, r.other_processes or 0)
    parts = [("torch_allocated", allocated), ("torch_cached", cached), ("other_processes", other)]
    divs = []
    for part, nbytes in parts:
        width = min(100.0, round(100.0 * nbytes / cap, 3))
        if width > 0:
            divs.append(f'<div class="cuda-magic-part-{part}" style="width:{width}%;background:{COLORS[part]};'
                        f'height:100%;flex:0 0 auto"></div>')
    mark = ""
    if r.peak:
        left = min(99.5, round(100.0 * r.peak / cap, 3))
        mark = (f'<div title="peak so far {format_bytes(r.peak)}" style="position:absolute;left:{left}%;top:0;'
                f'bottom:0;width:2px;background:{PEAK_COLOR}"></div>')
    return (f'<div class="cuda-magic-bar" style="{BAR};position:relative;background:{COLORS["free"]}">'
            f'{"".join(divs)}{mark}</div>')


def gauge_html(r) -> str:
    # spaces between the figures: the line wraps between them at a narrow width (each stays whole)
    figures = " ".join(
        f'<span style="margin-right:10px;white-space:nowrap;display:inline-block">{escape(label)} '
        f'<b class="cuda-magic-gauge-{cls}">{format_bytes(v)}</b></span>' for cls, label, v in _figures(r))
    return (f'<div class="cuda-magic-gauge" style="{BOX};margin:4px 0">'
            f'<div><b>live</b> {escape(r.key)} <span style="{MUTED}">· updated {1 / INTERVAL:.0f} times a second'
            f'</span></div>{gauge_bar_html(r)}<div>{figures}</div></div>')


# ---- where it is drawn -----------------------------------------------------------------------------

class WidgetView:
    """The gauge as an ipywidgets HTML (already displayed: on its own, or inside a guard's widget). A
    redraw sets the widget's value: one comm message, the view in the page follows.

    On its own, `handle` is its output's display handle and `view` the output's widget-view item; the
    output's text/html and text/plain (what a saved notebook shows through nbconvert, GitHub, or reopened
    without the widget state) follow the first reading, then one every SAVE_EVERY seconds, and the last
    (`final=True`, the reading `--live off` leaves, as static HTML and text without the widget, which is
    closed). Not each redraw: a display update makes the front end
    render the output again, with a new view of the widget, and the classic Notebook keeps every view of
    a cell's output until that cell runs again or is cleared (widgetsnbextension 3.x, extension.js: the
    `_jupyterWidgetViews` of the output area), each redrawn on every later value: at 4 a second, an hour of
    training would leave 14,400 views in the page."""

    SAVE_EVERY = 30.0

    def __init__(self, html_widget, handle=None, view: dict | None = None):
        self.widget = html_widget
        self.handle = handle
        self.view = view or {}
        self._saved_at: float | None = None

    def show(self, reading, *, final: bool = False) -> None:
        html = gauge_html(reading)
        self.widget.value = html
        if self.widget.layout.display == "none":
            self.widget.layout.display = None
        if self.handle is None:
            return
        now = time.monotonic()
        if final:
            # the last state stays as static HTML and text: no widget left for a reopened notebook to miss
            self.handle.update({"text/html": html, "text/plain": gauge_text(reading)}, raw=True)
            self.widget.close()
        elif self._saved_at is None or now - self._saved_at >= self.SAVE_EVERY:
            self._saved_at = now
            self.handle.update({**self.view, "text/html": html, "text/plain": gauge_text(reading)}, raw=True)

    def hide(self) -> None:
        self.widget.layout.display = "none"


class HandleView:
    """The gauge drawn into a display handle (display_id): `frame(reading)` gives the whole bundle."""

    def __init__(self, handle, frame):
        self.handle = handle
        self.frame = frame

    def show(self, reading, *, final: bool = False) -> None:
        self.handle.update(self.frame(reading), raw=True)

    def hide(self) -> None:
        pass    # the handle's next update (the report) replaces the gauge


def own_view():
    """A gauge in an output of its own (`%gpumem --live`): a widget where ipywidgets is, else a handle."""
    if display_form() == "widget":
        try:
            from cuda_magic.display.widget import WIDGET_MIME, ipywidgets

            widgets = ipywidgets()
        except ImportError:
            pass
        else:
            w = widgets.HTML(value="")
            w.add_class("cuda-magic-gauge-widget")
            view = {WIDGET_MIME: {"model_id": w.model_id, "version_major": 2, "version_minor": 0}}
            handle = publish({**view, "text/plain": "[live] the gauge shows here while the kernel runs"},
                             display_id=True)
            return WidgetView(w, handle, view)
    handle = publish({"text/plain": "[live] the gauge shows here while the kernel runs"}, display_id=True)
    return HandleView(handle, lambda r: {"text/html": gauge_html(r), "text/plain": gauge_text(r)})


def start_guard_gauge(handle, meter, *, delay: float = DELAY, interval: float = INTERVAL):
    """A gauge of `meter`'s device inside a guarded cell's running view (show.GuardHandle), which stops it
    when it finishes. Returns the LiveGauge, or None where none can be seen (terminal IPython, text, -q)."""
    if handle.quiet or not gauge_possible():
        return None
    from cuda_magic.devices.gauge_reader import GaugeReader

    reader = GaugeReader(meter)
    if handle.form == "widget" and handle.widget is not None:
        view = WidgetView(handle.widget.gauge)
    elif handle.form == "html" and handle.display is not None:
        def frame(reading):
            bundle = handle.html_bundle(handle.running(), running=True)
            return {"text/html": bundle["text/html"] + gauge_html(reading),
                    "text/plain": bundle["text/plain"] + "\n" + gauge_text(reading)}

        view = HandleView(handle.display, frame)
    else:
        return None
    handle.gauge = LiveGauge(reader, view, delay=delay, interval=interval).start()
    return handle.gauge


# ---- the thread ---------------------------------------------------------------------------------

class LiveGauge:
    """Reads `reader` (a GaugeReader) and redraws `view` from a daemon thread until `stop()`."""

    def __init__(self, reader, view, *, delay: float = DELAY, interval: float = INTERVAL,
                 across_cells: bool = False):
        self.reader = reader
        self.view = view
        self.across_cells = across_cells
        self.delay = delay
        self.interval = interval
        self.readings = 0
        self.updates = 0
        self.cpu_seconds = 0.0            # the thread's own CPU time (time.thread_time), once stopped
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> LiveGauge:
        # A kernel that keeps the current request in a contextvar (ipykernel 7) sends what a thread displays
        # as part of the request in the thread's context, else of the latest request. A cell's own gauge
        # runs in a copy of the cell's context: its updates belong to that cell. `%gpumem --live` runs in
        # an empty context: its updates go out as part of whichever cell runs now, as a display update
        # that cell made would (front ends route it to the gauge's output by its display_id).
        context = contextvars.Context() if self.across_cells else contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._run,), name=THREAD_NAME, daemon=True)
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        t0 = time.thread_time()
        try:
            if self._stop.wait(self.delay):
                return
            last = None
            while True:
                reading = self.reader.read()
                self.readings += 1
                figures = reading.figures()
                if figures != last:
                    self.view.show(reading)
                    self.updates += 1
                    last = figures
                if self._stop.wait(self.interval):
                    return
        except Exception as exc:   # noqa: BLE001 - a gauge must not print into the cell; stop() says it
            self.error = exc
        finally:
            self.cpu_seconds = time.thread_time() - t0

    def stop(self, *, hide: bool = True) -> None:
        """Stop and join the thread; then hide the gauge (a report usually takes its place), or leave it
        showing one last reading, taken now."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        if self.error is None:
            if hide:
                if self.updates:
                    self.view.hide()
            else:       # the last state, drawn even where the gauge never drew (off at once)
                self.view.show(self.reader.read(), final=True)
        if self.error is not None:
            error, self.error = self.error, None
            warnings.warn(f"cuda_magic's live gauge stopped: {type(error).__name__}: {error}", stacklevel=2)
