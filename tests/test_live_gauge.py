"""The live gauge: a daemon thread that reads counters and redraws a widget, joined when stopped; nothing
in terminal IPython. The kernel tests run it in a real Jupyter kernel (nbclient)."""
from __future__ import annotations

import re
import threading

import pytest
from conftest import run_ok
from IPython.core.error import UsageError

from cuda_magic.devices.gauge_reader import GaugeReader
from cuda_magic.devices.meter import SimMeter
from cuda_magic.devices.simulated import SimulatedDevice
from cuda_magic.display.gauge import THREAD_NAME, LiveGauge, WidgetView, gauge_html, gauge_text

MiB = 1 << 20


def gauge_threads():
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def test_the_gauge_follows_the_counters_and_leaves_no_thread(torch_warm):
    ipywidgets = pytest.importorskip("ipywidgets")
    torch = torch_warm
    w = ipywidgets.HTML()
    dev = SimulatedDevice(1 << 30)
    seen = []
    with dev:
        gauge = LiveGauge(GaugeReader(SimMeter(dev)), WidgetView(w), delay=0.05, interval=0.02).start()
        assert len(gauge_threads()) == 1
        keep = []
        for _ in range(40):
            keep.append(torch.zeros(MiB // 4))
            threading.Event().wait(0.01)
            if w.value and w.value not in seen:
                seen.append(w.value)
        gauge.stop()
    assert gauge_threads() == []
    assert gauge.updates >= 3 and len(seen) >= 2          # the figure changed while the loop allocated
    assert w.layout.display == "none"                      # hidden once stopped: the report takes its place
    assert "cuda-magic-gauge-allocated" in w.value and "capacity" in w.value
    reading = GaugeReader(SimMeter(dev)).read()
    assert (reading.allocated, reading.peak, reading.capacity) == (40 * MiB, 40 * MiB, 1 << 30)
    assert gauge_text(reading) == ("[live] sim:0: allocated 40.00 MiB, reserved 40.00 MiB, "
                                   "peak so far 40.00 MiB, capacity 1.00 GiB")
    assert 0 < gauge.cpu_seconds < 1.0


class Handle:
    """Keeps what IPython.display.DisplayHandle.update(obj, raw=True) would publish."""

    def __init__(self):
        self.bundles = []

    def update(self, obj, raw=False):
        assert raw
        self.bundles.append(obj)


def test_the_saved_output_follows_the_first_reading_then_every_save_every_seconds_and_the_last(torch_warm):
    # each display update renders the output again with a new widget view (the classic Notebook keeps
    # them all until the cell runs again): the redraws go through the widget's value alone
    ipywidgets = pytest.importorskip("ipywidgets")
    torch = torch_warm
    w, handle = ipywidgets.HTML(), Handle()
    view = WidgetView(w, handle, {"application/vnd.jupyter.widget-view+json": {"model_id": w.model_id}})
    dev = SimulatedDevice(1 << 30)
    values = []
    with dev:
        gauge = LiveGauge(GaugeReader(SimMeter(dev)), view, delay=0.0, interval=0.01).start()
        keep = []
        for _ in range(30):
            keep.append(torch.zeros(MiB // 4))
            for _ in range(500):                        # each new figure drawn before the next one (a
                if w.value and w.value not in values:   # loaded machine may be slow to run the thread)
                    break
                threading.Event().wait(0.01)
            values.append(w.value)
        gauge.stop(hide=False)
    assert gauge.updates >= 30 and len(set(values)) == 30             # each figure drawn, through the widget
    assert len(handle.bundles) == 2                                     # the first reading and the last
    first, last = handle.bundles
    assert last["text/html"] == w.value and "allocated 30.00 MiB" in last["text/plain"]
    assert first["text/html"] != last["text/html"]
    # while on, the output is the widget; the last state (--live off) static HTML and text (issue 37)
    assert "application/vnd.jupyter.widget-view+json" in first
    assert "application/vnd.jupyter.widget-view+json" not in last and w.comm is None

    view.SAVE_EVERY, handle.bundles = 0.0, []                          # an hour later: each reading saves
    view.show(GaugeReader(SimMeter(dev)).read())
    assert len(handle.bundles) == 1


def test_a_short_cell_pays_only_for_the_thread(torch_warm):
    ipywidgets = pytest.importorskip("ipywidgets")
    w = ipywidgets.HTML()
    dev = SimulatedDevice(1 << 30)
    gauge = LiveGauge(GaugeReader(SimMeter(dev)), WidgetView(w), delay=1.0).start()
    gauge.stop()
    assert gauge.readings == 0 and w.value == "" and gauge_threads() == []


def test_a_failing_reader_stops_the_gauge_with_a_warning_not_a_traceback(torch_warm):
    ipywidgets = pytest.importorskip("ipywidgets")

    class Gone:
        def read(self):
            raise OSError("the device went away")

    gauge = LiveGauge(Gone(), WidgetView(ipywidgets.HTML()), delay=0.0).start()
    threading.Event().wait(0.1)
    with pytest.warns(UserWarning, match="live gauge stopped: OSError: the device went away"):
        gauge.stop()
    assert gauge_threads() == []


def test_the_html_form_marks_the_peak_and_splits_the_capacity():
    from cuda_magic.devices.gauge_reader import GaugeReading

    html = gauge_html(GaugeReading("cuda:0", 2 * MiB, 3 * MiB, 5 * MiB, 10 * MiB, other_processes=MiB))
    assert 'cuda-magic-part-torch_allocated" style="width:20.0%' in html
    assert 'cuda-magic-part-torch_cached" style="width:10.0%' in html
    assert 'cuda-magic-part-other_processes" style="width:10.0%' in html
    assert 'title="peak so far 5.00 MiB" style="position:absolute;left:50.0%' in html
    assert "other processes <b" in html and "<script" not in html


def test_live_with_another_action_is_a_usage_error(ip):
    for other in ("--watch", "--history", "--diff", "-o"):
        with pytest.raises(UsageError, match="cannot go together"):
            ip.run_line_magic("gpumem", f"--live {other}")


def test_terminal_ipython_shows_no_gauge(ip, capsys):
    ip.run_line_magic("gpumem", "--live")
    assert "No live gauge here" in capsys.readouterr().out
    assert gauge_threads() == []
    ip.run_line_magic("gpumem", "--live off")
    assert "No live gauge was on" in capsys.readouterr().out
    with pytest.raises(UsageError, match="--live takes on or off"):
        ip.run_line_magic("gpumem", "--live sometimes")


# ---- in a real kernel ------------------------------------------------------------------------------

THREADS = "import threading\nprint(sorted(t.name for t in threading.enumerate()))"
ALLOCATE = """
keep = []
for i in range(25):                     # about 2.5 seconds, allocating as it goes
    keep.append(torch.zeros(2**18))      # 1 MiB
    time.sleep(0.1)
"""


def run_in_kernel(cells: list[str], env: dict | None = None):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    setup = "import os, time\n" + "".join(f"os.environ[{k!r}] = {v!r}\n" for k, v in (env or {}).items())
    setup += "os.environ.pop('CUDA_MAGIC_DISPLAY', None)\n" if not env or "CUDA_MAGIC_DISPLAY" not in env else ""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in [setup, *cells]])
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": root}},
                            record_timing=False).execute()
    return nb


def printed(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")


LIVE_VALUE = """
live = get_ipython().magics_manager.registry["GpumemMagics"].cuda_magic_state.live
print("updates", live.updates, "running", live.running)
print(live.view.widget.value)
"""


def test_gpumem_live_updates_across_cells_in_a_kernel_and_off_joins_its_thread():
    nb = run_in_kernel(["%load_ext cuda_magic\nimport torch\n%gpumem --simulate 256MiB -q",
                        "%gpumem --live", ALLOCATE, "time.sleep(0.5)", LIVE_VALUE, THREADS, "%gpumem --live off",
                        THREADS, "%gpumem --live\n%unload_ext cuda_magic", THREADS])
    shown = [o for o in nb.cells[2].outputs if o.get("output_type") == "display_data"]
    # the output a saved notebook keeps: the last state as static HTML and text once `--live off` ran
    assert len(shown) == 1 and set(shown[0]["data"]) == {"text/html", "text/plain"}
    assert "cuda-magic-gauge" in shown[0]["data"]["text/html"]
    # the widget the `--live` cell shows, as the gauge's thread left it after later cells ran (what the
    # frontend receives of it, through the widget's comm, the browser test checks)
    state = printed(nb.cells[5])
    assert "running True" in state and int(state.split()[1]) >= 3
    assert "cuda-magic-gauge" in state and "sim:0" in state
    assert re.search(r"cuda-magic-gauge-allocated\">([^<]*)<", state).group(1) == "25.00 MiB"  # what the allocating cell made
    assert THREAD_NAME in printed(nb.cells[6])                      # on across cells
    assert "Live gauge off." in printed(nb.cells[7])
    assert THREAD_NAME not in printed(nb.cells[8])                  # `off` joined it
    assert THREAD_NAME not in printed(nb.cells[10])                 # unloading joined it


def test_gpumem_live_in_html_sends_its_updates_as_part_of_the_running_cell():
    # nbclient, like a front end that drops what belongs to a finished request, takes a message only from
    # the cell it is running; a display_id update from the gauge's thread during cell 3 must come as part
    # of cell 3 to reach the gauge shown by cell 2 (no `--live off` here: it would draw a last reading)
    # the allocating cell waits 0.6 s (over two readings) after its last allocation: a reading taken
    # between two cells has no running cell to go with, and a gauge redraws only on a change
    nb = run_in_kernel(["%load_ext cuda_magic\nimport torch\n%gpumem --simulate 256MiB -q",
                        "%gpumem --live", ALLOCATE + "time.sleep(0.6)\n", "time.sleep(0.5)"],
                       env={"CUDA_MAGIC_DISPLAY": "html"})
    shown = [o for o in nb.cells[2].outputs if o.get("output_type") == "display_data"]
    assert len(shown) == 1
    html = shown[0]["data"]["text/html"]
    assert re.search(r"cuda-magic-gauge-allocated\">([^<]*)<", html).group(1) == "25.00 MiB"
    assert "allocated 25.00 MiB" in shown[0]["data"]["text/plain"]


GUARDED = """%%oomguard
keep = []
for i in range(25):                     # about 2.5 seconds, 1 MiB every 0.1 s
    keep.append(torch.zeros(2**18))
    time.sleep(0.1)
"""


def widget_models(nb) -> dict:
    return nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})


@pytest.mark.parametrize("form", ["widget", "html"])
def test_a_guarded_cell_shows_the_gauge_while_it_runs_then_the_report_and_no_thread(form):
    env = {"CUDA_MAGIC_DISPLAY": "html"} if form == "html" else None
    nb = run_in_kernel(["%load_ext cuda_magic\nimport torch\n%gpumem --simulate 256MiB -q",
                        GUARDED, GUARDED.replace("%%oomguard", "%%oomguard --no-live"), THREADS], env=env)
    guarded, quiet = nb.cells[2], nb.cells[3]
    assert THREAD_NAME not in printed(nb.cells[4])
    for cell in (guarded, quiet):
        shown = [o for o in cell.outputs if o.get("output_type") == "display_data"]
        assert len(shown) == 1
        assert "the cell ran within memory" in shown[0]["data"]["text/plain"]
        assert "cuda-magic-gauge" not in shown[0]["data"]["text/html"]       # the report took its place
    if form == "widget":
        gauges = [m["state"] for m in widget_models(nb).values()
                  if "cuda-magic-gauge-widget" in m["state"].get("_dom_classes", [])]
        assert len(gauges) == 2
        drawn, not_drawn = gauges
        assert "cuda-magic-gauge-allocated" in drawn["value"] and "sim:0" in drawn["value"]
        assert not_drawn["value"] == ""                                      # --no-live: never drawn


# ---- the peak so far, and what a saved notebook keeps (issue 21) -------------------------------------

class DrawnReadings:
    """A gauge view that keeps every reading it is asked to draw."""

    def __init__(self):
        self.readings = []

    def show(self, reading, *, final: bool = False) -> None:
        self.readings.append(reading)

    def hide(self) -> None:
        pass


def test_the_peak_so_far_never_goes_down_while_watch_resets_the_counter(tip, monkeypatch):
    # `%gpumem --watch` resets the device's peak counter as each cell starts: the gauge's peak must still
    # only rise, and end at least at the highest cell's own peak, also one that came and went between two
    # readings (the instant 40 MiB cell)
    import cuda_magic.display.gauge as gauge_module
    from cuda_magic.magics.state import get_state

    view = DrawnReadings()
    monkeypatch.setattr(gauge_module, "gauge_possible", lambda: True)       # the shell has no kernel
    monkeypatch.setattr(gauge_module, "own_view", lambda: view)
    tip.run_line_magic("gpumem", "--simulate 256MiB -q")
    run_ok(tip, "import time")
    tip.run_line_magic("gpumem", "--watch -q")
    tip.run_line_magic("gpumem", "--live")
    run_ok(tip, "x = torch.zeros(10 * 2**18)\ntime.sleep(0.6)\ndel x")            # 10 MiB, read a few times
    run_ok(tip, "y = torch.zeros(40 * 2**18)\ndel y")                           # 40 MiB for an instant
    run_ok(tip, "time.sleep(0.6)")
    tip.run_line_magic("gpumem", "--live off")
    assert gauge_threads() == []
    peaks = [r.peak for r in view.readings]
    assert len(peaks) >= 3 and None not in peaks
    assert peaks == sorted(peaks), [p / MiB for p in peaks]
    cells = get_state(tip).history
    assert [r.device for r in cells] == ["sim:0"] * 3
    assert peaks[-1] >= max(r.peak for r in cells) >= 40 * MiB


SAVED_GAUGE = """
live = get_ipython().magics_manager.registry["GpumemMagics"].cuda_magic_state.live
"""


def test_a_saved_live_gauge_carries_its_last_reading_as_html_and_text():
    # what nbconvert, GitHub and a notebook reopened without its widget state show is the output's
    # text/html and text/plain: the last reading (the widget, through its comm, shows the same)
    nb = run_in_kernel(["%load_ext cuda_magic\nimport torch\n%gpumem --simulate 256MiB -q",
                        "%gpumem --watch -q\n%gpumem --live", ALLOCATE + "del keep\n", "time.sleep(0.6)",
                        SAVED_GAUGE, "%gpumem --live off", "print(live.view.widget.value)"])
    gauge = [o for o in nb.cells[2].outputs if o.get("output_type") == "display_data"
             and o["data"].get("text/plain", "").startswith("[live]")]
    assert len(gauge) == 1
    data = gauge[0]["data"]
    assert "application/vnd.jupyter.widget-view+json" not in data      # static: no widget state needed
    last = printed(nb.cells[7]).strip()
    assert data["text/html"] == last                      # the last reading drawn, not a placeholder
    assert re.search(r"cuda-magic-gauge-allocated\">([^<]*)<", last).group(1) == "0 B"     # `keep` went
    # the allocating cell peaked at 25 MiB; --watch reset the counter when the next cells started
    assert re.search(r"cuda-magic-gauge-peak\">([^<]*)<", last).group(1) == "25.00 MiB"
    assert "allocated 0 B" in data["text/plain"] and "peak so far 25.00 MiB" in data["text/plain"]
