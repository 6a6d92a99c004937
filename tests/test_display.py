"""The display layer: text, HTML and widget forms of hand-built records, and how show() picks one."""
from __future__ import annotations

import re
import textwrap

import pytest

from cuda_magic.memory.holders import Holder

from cuda_magic.memory.snapshot import CellRecord, Snapshot, TensorRecord, diff

from cuda_magic.devices.readings import DeviceMemory, ProcessMemory
from cuda_magic.oom.findings import Advice, Diagnosis, OomFields
from cuda_magic.recover.report import Attempt, FailurePoint, GuardReport, ReleaseReport, Retry
from cuda_magic.units import format_bytes

GiB, MiB = 1024**3, 1024**2


def cuda_device():
    return DeviceMemory(
        key="cuda:0", name="NVIDIA H200", kind="cuda", capacity=80 * GiB,
        torch_allocated=12 * GiB, torch_cached=2 * GiB, other_this_process=512 * MiB,
        other_processes=20 * GiB, free=80 * GiB - 12 * GiB - 2 * GiB - 512 * MiB - 20 * GiB,
        peak=15 * GiB, peak_exact=True)


def simulated_device():
    return DeviceMemory(
        key="sim:0", name="simulated GPU", kind="simulated", capacity=4 * GiB,
        torch_allocated=3 * GiB, torch_cached=0, other_this_process=0, other_processes=0, free=1 * GiB,
        peak=int(3.5 * GiB), peak_exact=True, notes=["counts tensors created in the notebook's thread"])


def cpu_device():
    return DeviceMemory(
        key="cpu", name="CPU (no GPU)", kind="cpu", capacity=16 * GiB,
        torch_allocated=None, torch_cached=None, other_this_process=3 * GiB, other_processes=None,
        free=9 * GiB, peak=4 * GiB, peak_exact=False)


def tensors():
    records = [
        TensorRecord(1, ["model.fc.weight"], (4096, 4096), "torch.float32", "cuda:0", 64 * MiB, False),
        TensorRecord(2, ["<script>alert(1)</script>", "losses[3]"], (1024, 1024), "torch.float32", "cuda:0",
                     4 * MiB, True, views=3),
        TensorRecord(3, [], (10,), "torch.int64", "cuda:0", 80, False),
    ]
    records += [TensorRecord(10 + i, [f"cache[{i}]"], (256,), "torch.float16", "cuda:0", 512, False)
                for i in range(5)]
    return records


def snapshot(top=3):
    return Snapshot([cuda_device(), simulated_device(), cpu_device()], tensors(),
                    processes=[ProcessMemory("cuda:0", 4242, 20 * GiB, "python train.py", "alice"),
                               ProcessMemory("cuda:0", 17, 13 * GiB, "ipykernel", "me", this_process=True)],
                    notes=["NVML not available: other processes unknown"], tensor_count=8, top=top)


def guard_report():
    before = [DeviceMemory("cuda:0", "NVIDIA H200", "cuda", 8 * GiB, torch_allocated=1 * GiB, torch_cached=0,
                           other_this_process=300 * MiB, other_processes=0, free=8 * GiB - GiB - 300 * MiB)]
    after = [DeviceMemory("cuda:0", "NVIDIA H200", "cuda", 8 * GiB, torch_allocated=1 * GiB + 5 * MiB,
                          torch_cached=20 * MiB, other_this_process=300 * MiB, other_processes=0,
                          free=8 * GiB - GiB - 325 * MiB)]
    attempts = [
        Attempt(64, "oom", peak=int(7.5 * GiB), requested=2 * GiB, duration=1.25),
        Attempt(32, "oom", peak=int(7.9 * GiB), requested=1 * GiB, duration=0.75),
        Attempt(16, "ok", peak=int(5.25 * GiB), duration=0.5),
    ]
    oom = OomFields(device="cuda:0", requested=1 * GiB, capacity=8 * GiB, free=100 * MiB,
                    this_process=int(7.8 * GiB), other_processes=0, allocated_by_torch=7 * GiB,
                    reserved_unallocated=600 * MiB, message="CUDA out of memory. Tried to allocate 1.00 GiB.")
    diagnosis = Diagnosis(
        causes=["names_holding", "too_large"],
        summary="Names in the notebook keep 2.00 GiB alive, and the batch is too large for the device.",
        advice=[Advice("Use a smaller batch", "batch_size = 16"),
                Advice("Log losses with .item()", "losses.append(loss.item())"),
                Advice("Turn on expandable segments",
                       "%env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")],
        holders=[Holder("losses", 2 * GiB, shared=1 * GiB, kind="graph", what="list of 300 scalar tensors with grad_fn",
                        shared_with=("preds",)), Holder("<b>x</b>", 500 * MiB)])
    return GuardReport(
        device="cuda:0", before=before, after=after, peaks={"cuda:0": int(7.9 * GiB)}, attempts=attempts,
        retry=Retry("batch_size", 64, final=16), oom=oom, diagnosis=diagnosis,
        failure=FailurePoint(3, "out = model(x.expand(batch_size, -1))"), reclaimed={"cuda:0": int(6.5 * GiB)},
        outcome="recovered")


def release_report():
    return ReleaseReport(dropped=["last error traceback", "Out[7]"], deleted=["x"], freed={"cuda:0": 3 * GiB},
                         still_held=[("model", 1 * GiB), ("opt", 512 * MiB)])


def cell_records():
    return [CellRecord(12, 3 * GiB // 2, 3 * GiB, True, 2.31, "cuda:0"),
            CellRecord(13, -GiB, 2 * GiB, False, 0.02, "cpu")]


# ---- text ---------------------------------------------------------------------------------------

from cuda_magic.display import html as H  # noqa: E402
from cuda_magic.display import layout as L  # noqa: E402
from cuda_magic.display import text as T  # noqa: E402
from cuda_magic.devices.readings import PARTS  # noqa: E402


@pytest.mark.parametrize("make", [cuda_device, simulated_device, cpu_device])
def test_bar_parts_add_up_to_the_capacity(make):
    dev = make()
    segments = L.bar_segments(dev)
    assert sum(b for _, b in segments) == dev.capacity
    bar = T.bar_text(dev)
    assert bar.startswith("[") and bar.endswith("]") and len(bar) == T.BAR_WIDTH + 2
    for part, nbytes in segments:
        cells = bar.count(T.BAR_SYMBOLS[part])
        assert cells >= 1
        assert abs(cells - T.BAR_WIDTH * nbytes / dev.capacity) < 1.5   # a tiny part borrows one cell


def test_cpu_device_unknown_parts_become_one_remainder():
    segments = dict(L.bar_segments(cpu_device()))
    assert set(segments) == {"other_this_process", "free", "unknown"}
    assert segments["unknown"] == 16 * GiB - 3 * GiB - 9 * GiB
    # free not given but everything else is: the rest is free, not unknown
    dev = cuda_device()
    dev.free = None
    assert dict(L.bar_segments(dev))["free"] == 80 * GiB - 12 * GiB - 2 * GiB - 512 * MiB - 20 * GiB


def test_split_cells_sums_to_width_and_shows_small_parts():
    cells = L.split_cells([10**9, 1, 5 * 10**8], 40)
    assert sum(cells) == 40 and cells[1] == 1
    assert L.split_cells([0, 0], 10) == [0, 0]
    assert sum(L.percentages([1, 1, 1])) == pytest.approx(100.0, abs=1e-9)


def test_snapshot_text_shows_every_figure():
    text = T.snapshot_text(snapshot(top=3))
    for figure in ("capacity 80.00 GiB", "12.00 GiB", "2.00 GiB", "512.00 MiB", "20.00 GiB", "45.50 GiB",
                   "peak 15.00 GiB (exact)", "peak ~4.00 GiB (approximate", "not known", "n/a",
                   "NVML not available", "counts tensors created in the notebook's thread"):
        assert figure in text, figure
    # per-device shares add up to 100 %
    block = text.split("cuda:0  NVIDIA H200")[1].split("sim:0")[0]
    shares = [float(s) for s in re.findall(r"([0-9.]+)%", block)]
    assert sum(shares) == pytest.approx(100.0, abs=0.3)
    # the top 3 tensors, the rest summed
    assert "model.fc.weight" in text and "(4096, 4096)" in text and "float32" in text and "64.00 MiB" in text
    assert "losses[3]" in text and "(unnamed)" in text and "int64" in text
    assert "cache[0]" not in text
    assert f"+5 more ({format_bytes(5 * 512)})" in text
    row = next(line for line in text.splitlines() if "losses[3]" in line)
    assert row.rstrip().endswith("yes")                    # carries a graph
    assert "4242" in text and "<- this process" in text    # processes


def test_hidden_tensors_when_the_backend_cut_the_list():
    snap = Snapshot([cuda_device()], tensors()[:2], tensor_count=10, tensor_bytes={"cuda:0": 100 * MiB}, top=10)
    assert L.hidden_tensors(snap) == (8, 100 * MiB - 68 * MiB)
    assert "+8 more (32.00 MiB)" in T.snapshot_text(snap)


def test_guard_text_leads_with_the_answer_and_folds_the_rest():
    """Issue 21: the headline (the line that failed, asked against free), the cause in one sentence, the
    first thing to do as a line to paste, the next ones short; the figures are in the full report."""
    short = T.guard_text(guard_report())
    lines = short.splitlines()
    assert len(lines) <= 15 and max(map(len, lines)) <= 110
    assert " ".join(short.split()).startswith(
        "%%oomguard: fits at batch_size=16; ran out of memory at cell line 3 `out = model(x.expand(batch_size, -1))`: "
        "asked 1.00 GiB, 100.00 MiB free of 8.00 GiB at batch_size=32")   # 1 GiB: 32's failure, not 64's
    assert lines[2] == "batch_size = 16 (was 64)" and lines[3].startswith("Cause: ")
    assert next(i for i, l in enumerate(lines) if l.startswith("Do this: ")) < 8
    assert sum(l.startswith("Or: ") for l in lines) == 2
    assert lines[-1] == "More (the figures, the split by kind, the whole diagnosis and advice, each attempt): %oomguard last"
    for folded in ("reserved but unallocated", "Attempts", "Try, most useful first"):
        assert folded not in short
    text = T.guard_text(guard_report(), full=True)
    lines = text.splitlines()
    assert len(lines) <= 60 and max(map(len, lines)) <= 110
    assert re.search(r"cuda:0\s+1\.00 GiB\s+7\.90 GiB\s+1\.00 GiB\s+\+5\.00 MiB\s+8\.00 GiB", text)
    assert re.search(r"1\s+64\s+out of memory\s+2\.00 GiB\s+7\.50 GiB\s+1\.25 s", text)
    assert re.search(r"3\s+16\s+fitted\s+5\.25 GiB\s+500\.0 ms", text)
    assert "batch_size = 16 (was 64)" in text
    assert "line 3: out = model(x.expand(batch_size, -1))" in text
    for fact in ("tried to allocate 1.00 GiB", "free 100.00 MiB", "this process 7.80 GiB",
                 "allocated by PyTorch 7.00 GiB", "reserved but unallocated 600.00 MiB",
                 "Names in the notebook keep", "losses (2.00 GiB, list of 300 scalar tensors with grad_fn; 1.00 GiB more",
                 "shared with preds)", "1. Use a smaller batch",
                 "losses.append(loss.item())", "expandable_segments:True",
                 "Memory reclaimed: 6.50 GiB on cuda:0", "kernel can keep going"):
        assert fact in text, fact


def test_guard_text_many_attempts_stays_short():
    report = guard_report()
    report.attempts = [Attempt(1000 - i, "oom", peak=GiB, duration=0.1) for i in range(30)]
    report.diagnosis.advice *= 3
    assert len(T.guard_text(report).splitlines()) <= 15
    text = T.guard_text(report, full=True)
    assert len(text.splitlines()) <= 60
    assert "1000" in text and "971" in text and "18 more" in text


def test_guard_text_plain_run_and_error():
    report = GuardReport(device="cuda:0", before=[cuda_device()], after=[cuda_device()],
                         peaks={"cuda:0": 13 * GiB}, attempts=[Attempt(None, "ok", peak=13 * GiB, duration=0.2)])
    text = T.guard_text(report)
    assert text.startswith("%%oomguard: the cell ran within memory")
    assert "Attempts" not in text and "reclaimed" not in text and "13.00 GiB" in text
    report.outcome, report.exception_text = "error", "ValueError: bad shape"
    assert "not out of memory: ValueError: bad shape" in T.guard_text(report)


def test_release_text():
    text = T.release_text(release_report())
    assert "Freed 3.00 GiB on cuda:0" in text
    assert "Dropped: last error traceback, Out[7]" in text and "Deleted: x" in text
    assert re.search(r"model\s+1\.00 GiB", text) and re.search(r"opt\s+512\.00 MiB", text)
    dry = ReleaseReport(dropped=["_"], deleted=["a", "b"], dry_run=True)
    text = T.release_text(dry)
    assert "Dry run" in text and "Would delete: a, b" in text and "Deleted" not in text


def test_watch_line_and_history():
    first, second = cell_records()
    assert L.watch_line(first) == "[gpumem] cell 12 cuda:0: +1.50 GiB allocated, peak 3.00 GiB, 2.31 s"
    assert L.watch_line(second) == "[gpumem] cell 13 cpu: -1.00 GiB allocated, peak ~2.00 GiB, 20.0 ms"
    text = T.history_text([first, second])
    assert re.search(r"12\s+cuda:0\s+\+1\.50 GiB\s+3\.00 GiB\s+2\.31 s", text)
    assert "approximate" in text
    assert "--watch" in T.history_text([])


def test_the_watch_line_is_written_in_one_write(monkeypatch):
    """print() writes a line and its newline apart; IPython 9 passes each write of a cell's output through
    its history's tee (InteractiveShell._tee), so the line is written once, newline included."""
    import sys

    from cuda_magic.display.show import show_watch

    class Counted:
        def __init__(self):
            self.writes = []

        def write(self, text):
            self.writes.append(text)
            return len(text)

    first, _ = cell_records()
    out = Counted()
    monkeypatch.setattr(sys, "stdout", out)
    assert show_watch(first, form="text") is None
    assert out.writes == [L.watch_line(first) + "\n"]
    monkeypatch.setattr(sys, "stdout", None)          # pythonw, a closed console: nothing to print to
    assert show_watch(first, form="text") is None


def test_diff_text():
    before = snapshot(top=10)
    after = snapshot(top=10)
    after.device_list[0].torch_allocated += GiB
    after.device_list[0].free -= GiB
    after.tensor_list = after.tensor_list[1:] + [TensorRecord(99, ["y"], (8,), "torch.float32", "cuda:0", GiB, True)]
    text = T.diff_text(diff(before, after))
    assert "cuda:0: PyTorch allocated +1.00 GiB, free -1.00 GiB" in text
    assert "sim:0: no change" in text
    assert "Tensors appeared: 1 (1.00 GiB)" in text and "Tensors went: 1 (64.00 MiB)" in text


def test_records_repr_use_text_forms():
    assert str(guard_report()) == T.guard_text(guard_report(), full=True)   # print(report): all of it
    # `-o` returns the report as the cell's value: one line, the full report has been shown already
    assert repr(guard_report()) == "<GuardReport cuda:0: recovered, 3 attempts; batch_size = 16 (was 64)>"
    assert repr(snapshot()) == T.snapshot_text(snapshot())


def test_a_record_draws_itself_in_a_plain_process_that_never_imported_the_display():
    """The records reach their forms through the registry the display fills when the package loads
    (cuda_magic/reprs.py): importing a record's module alone is enough, and the forms themselves are
    loaded only when a record is first drawn."""
    import subprocess
    import sys

    code = textwrap.dedent("""
        import sys
        from cuda_magic.devices.readings import DeviceMemory
        from cuda_magic.memory.snapshot import Snapshot
        loaded_before = "cuda_magic.display.show" in sys.modules
        dev = DeviceMemory("cpu", "CPU", "cpu", 8 << 30, torch_allocated=1 << 30, torch_cached=0,
                           other_this_process=0, other_processes=0, free=7 << 30)
        snap = Snapshot([dev], [], tensor_count=0)
        text, html = repr(snap), snap._repr_html_()
        print(loaded_before, "cuda_magic.display.show" in sys.modules, "IPython" in sys.modules)
        from cuda_magic.display.html import snapshot_html
        from cuda_magic.display.text import snapshot_text
        print(text == snapshot_text(snap), html == snapshot_html(snap), "8.00 GiB" in text)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    loaded, drawn = out.stdout.splitlines()[-2:]
    assert loaded == "False True False"         # forms loaded on the first draw; IPython never
    assert drawn == "True True True"


# ---- HTML ---------------------------------------------------------------------------------------

def bar_widths(html: str) -> list[list[tuple[str, float]]]:
    """Per bar, its (part, width %) segments, read back from the HTML."""
    bars = re.findall(r'<div class="cuda-magic-bar"[^>]*>(.*?)</div></div>', html)
    return [[(p, float(w)) for p, w in re.findall(r'class="cuda-magic-part-(\w+)"[^>]*style="width:([0-9.]+)%', bar)]
            for bar in bars]


def test_snapshot_html_bars_add_up_and_carry_the_figures():
    html = H.snapshot_html(snapshot(top=3))
    bars = bar_widths(html)
    assert len(bars) == 3
    for segments in bars:
        assert sum(w for _, w in segments) == pytest.approx(100.0, abs=1e-6)
    assert [p for p, _ in bars[0]] == list(PARTS)
    assert [p for p, _ in bars[2]] == ["other_this_process", "free", "unknown"]
    assert dict(bars[0])["torch_allocated"] == pytest.approx(15.0)
    assert 'title="PyTorch allocated: 12.00 GiB (15.0% of cuda:0)"' in html
    for figure in ("12.00 GiB", "45.50 GiB", "peak 15.00 GiB (exact)", "model.fc.weight", "+5 more (2.50 KiB)",
                   "4242", "this process"):
        assert figure in html, figure


def test_html_escapes_user_strings_and_is_self_contained():
    report = guard_report()
    report.failure = FailurePoint(2, "y = f('<img src=x onerror=alert(1)>')")
    release = ReleaseReport(deleted=["<script>bad()</script>"], still_held=[("<i>big</i>", GiB)])
    pages = [H.snapshot_html(snapshot()), H.guard_html(report), H.release_html(release),
             H.diff_html(diff(snapshot(), Snapshot([], tensors())))]
    joined = "".join(pages)
    assert "<script" not in joined and "<img" not in joined and "<b>x</b>" not in joined and "<i>big" not in joined
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in pages[0]
    assert "&lt;img src=x onerror=alert(1)&gt;" in pages[1] and "&lt;b&gt;x&lt;/b&gt;" in pages[1]
    assert "&lt;script&gt;bad()&lt;/script&gt;" in pages[2]
    assert "<style" not in joined and "http" not in joined and "<link" not in joined
    for page in pages:
        assert page.startswith('<div class="cuda-magic') and page.count("<div") == page.count("</div>")


def every_html_form() -> dict[str, str]:
    """The HTML form of every kind of record show() displays, and of every widget's output bundle."""
    from cuda_magic.display.show import forms_of
    from cuda_magic.display import widget as W

    report = guard_report()
    report.failure = FailurePoint(2, "y = f('<img src=https://example.com/x onerror=alert(1)>')")
    records = {
        "snapshot": snapshot(), "diff": diff(snapshot(), Snapshot([], tensors())), "guard": report,
        "release": release_report(), "watch": cell_records()[0], "history": cell_records(),
        "processes": snapshot().processes, "devices": [cuda_device(), simulated_device(), cpu_device()],
    }
    forms = {name: forms_of(obj)[1]() for name, obj in records.items()}
    forms["widget bars"] = W.MemoryBarsWidget(records["devices"]).bundle()["text/html"]
    forms["widget snapshot"] = W.SnapshotWidget(snapshot()).bundle()["text/html"]
    forms["widget guard"] = W.GuardWidget(report).bundle()["text/html"]
    forms["widget history"] = W.WatchWidget(cell_records()).bundle()["text/html"]
    return forms


def test_every_html_form_needs_no_javascript_and_no_network():
    from static_html import problems

    for name, html in every_html_form().items():
        assert html.strip(), name
        assert problems(html) == [], name


def test_static_html_check_catches_what_it_is_for():
    from static_html import problems

    for bad in ('<script>x()</script>', '<div onclick="x()">', '<a href="https://a.b">', '<img src="x.png">',
                '<div style="background:url(x.png)">', "<iframe>", "<style>@import 'x.css';</style>",
                '<svg><use xlink:href="#a"/></svg>', '<span title="javascript:x()">'):
        assert problems(bad), bad
    assert problems('<svg viewBox="0 0 10 10"><rect width="5"/></svg><div style="width:5%">1/2</div>'
                    '<code>&lt;script src=https://cdn.example/x.js&gt;</code>') == []


def test_guard_html():
    html = H.guard_html(guard_report())
    assert "fits at batch_size=16" in html
    for label in ("before", "peak", "after"):
        assert f'<span style="width:44px">{label}</span>' in html
    assert "7.90 GiB" in html and "out of memory</td><td" in html and "2.00 GiB" in html and "fitted" in html
    assert "reserved but unallocated" in html and "600.00 MiB" in html
    assert "<li" in html and "batch_size = 16" in html
    assert "Memory reclaimed: 6.50 GiB on cuda:0. The kernel can keep going" in html
    # the peak bar is filled to peak / capacity
    assert f"width:{round(100 * 7.9 / 8, 3)}%" in html


# ---- widgets ------------------------------------------------------------------------------------

def width_percent(w) -> float:
    assert w.layout.width.endswith("%")
    return float(w.layout.width[:-1])


def test_memory_bars_widget_segments_add_up_to_100():
    from cuda_magic.display.widget import MemoryBarsWidget

    devices = [cuda_device(), simulated_device(), cpu_device()]
    w = MemoryBarsWidget(devices)
    assert "cuda-magic-widget" in w._dom_classes
    assert len(w.bars) == 3
    for dev, bar in zip(devices, w.bars):
        assert "cuda-magic-bar" in bar._dom_classes
        assert sum(width_percent(seg) for seg in bar.children) == pytest.approx(100.0, abs=1e-6)
        parts = [c for seg in bar.children for c in seg._dom_classes]
        assert parts == [f"cuda-magic-part-{p}" for p, _ in L.bar_segments(dev)]
        assert all(p.removeprefix("cuda-magic-part-") in (*PARTS, "unknown") for p in parts)
    first = w.bars[0].children[0]
    title = "PyTorch allocated: 12.00 GiB (15.0% of cuda:0)"
    assert f'title="{title}"' in first.value            # the hover text on ipywidgets 7 and 8
    if first.has_trait("tooltip"):                      # ipywidgets 8
        assert first.tooltip == title
    assert width_percent(first) == pytest.approx(15.0)
    visible = " ".join(c.value for box in w.children for c in box.children if hasattr(c, "value"))
    assert "12.00 GiB" in visible and "45.50 GiB" in visible and "peak 15.00 GiB" in visible
    w.update([simulated_device()])
    assert len(w.bars) == 1 and len(w.children) == 1


def test_snapshot_widget_bundle():
    from cuda_magic.display.widget import SnapshotWidget

    w = SnapshotWidget(snapshot(top=3))
    bundle = w._repr_mimebundle_()
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == w.model_id
    assert bundle["text/plain"] == T.snapshot_text(snapshot(top=3))
    assert "cuda-magic-bar" in bundle["text/html"]
    assert "cuda-magic-widget" in w._dom_classes and len(w.bars) == 3


def test_guard_widget_updates_live():
    from cuda_magic.display.widget import GuardWidget

    final = guard_report()
    start = GuardReport(device="cuda:0", before=final.before, retry=Retry("batch_size", 64))
    w = GuardWidget(start, running=True)
    assert "cuda-magic-widget" in w._dom_classes
    assert "cuda-magic-guard" in w.levels._dom_classes and "1.00 GiB" in w.levels.value
    assert "cuda-magic-attempts" in w.attempts._dom_classes and w.attempts.layout.display == "none"
    assert "cuda-magic-diagnosis" in w.diagnosis._dom_classes and w.diagnosis.layout.display == "none"
    assert "cuda-magic-reclaimed" in w.reclaimed._dom_classes and w.reclaimed.layout.display == "none"
    assert "running the cell" in w.title.value
    w.add_attempt(final.attempts[0])
    assert w.attempts.layout.display is None and "64" in w.attempts.value and "7.50 GiB" in w.attempts.value
    w.add_attempt(final.attempts[1])
    assert w.attempts.value.count("<tr>") == 3                    # header + 2 attempts
    # issue 37: the header changes with the table that shows attempt 2 ran out, in the same update: never
    # "running ... at 32" (the value that ran out) while the next one is chosen
    head = w.text().splitlines()[0]
    assert "attempt 2 ran out of memory at batch_size=32, choosing the next value" in head
    assert "attempt 2 ran out of memory at batch_size=32" in w.title.value
    w.try_value(8, 8)                                             # the header says what runs now
    assert "attempt 3 at batch_size = 8" in w.title.value
    w.update(final)
    # the answer unfolded; the attempts, the figures and the whole diagnosis in the folded details
    assert w.attempts.layout.display == "none" and w.reclaimed.layout.display == "none"
    assert w.diagnosis.layout.display is None and "Cause:" in w.diagnosis.value and "Do this:" in w.diagnosis.value
    assert "batch_size = 16" in w.title.value and "fits at batch_size=16" in w.title.value
    details = w.details.value
    assert "<details" in details and details.count("<tr>") >= 4 and "Names in the notebook keep" in details
    assert "6.50 GiB" in details
    assert w.text() == T.guard_text(final) and w.html() == H.guard_html(final)


def test_live_widget_follows_a_retry_set_after_it_was_built(shell, monkeypatch):
    """%%oomguard shows its widget before the retry loop sets report.retry: the attempts and the value tried
    still show while the cell runs; between attempts the header never says the next attempt runs at the
    value that just failed, nor, once a value fitted, that another attempt runs."""
    from IPython.utils.capture import capture_output

    from cuda_magic.display.show import show_guard

    monkeypatch.setenv("CUDA_MAGIC_DISPLAY", "widget")
    report = GuardReport(device="cuda:0")
    with capture_output():
        handle = show_guard(report)
    report.retry = Retry("batch_size", 64)              # as the retry loop does, once the widget is shown
    handle.try_value(64)
    first = guard_report().attempts[0]
    report.attempts.append(first)
    handle.add_attempt(first)
    assert "64" in handle.widget.attempts.value and "out of memory" in handle.widget.attempts.value
    assert "attempt 2" not in handle.widget.title.value             # not "attempt 2 at batch_size = 64"
    handle.try_value(16)
    assert "attempt 2 at batch_size = 16" in handle.widget.title.value
    fitted = guard_report().attempts[2]                 # 16 fits: the retry sets 16 again to keep it
    report.attempts.append(fitted)
    handle.add_attempt(fitted)
    handle.try_value(16)
    title = handle.widget.title.value
    # issue 37: with the row that says 16 fitted, the header says so, not that attempt 2 still runs
    assert "attempt 2 fitted at batch_size=16, keeping it" in title and "attempt 3" not in title


def test_watch_widget_rows():
    from cuda_magic.display.widget import WatchWidget

    first, second = cell_records()
    w = WatchWidget([first])
    assert "cuda-magic-watch" in w._dom_classes and "cuda-magic-widget" in w._dom_classes
    assert w.text() == L.watch_line(first) and "+1.50 GiB" in w.table.value
    w.add(second)
    assert w.table.value.count("<tr>") == 3 and "~2.00 GiB" in w.table.value


# ---- show ---------------------------------------------------------------------------------------

@pytest.fixture
def shell(monkeypatch):
    from IPython.testing.globalipapp import get_ipython

    monkeypatch.delenv("CUDA_MAGIC_DISPLAY", raising=False)
    return get_ipython()   # the one shell singleton every test file shares


def test_show_in_a_plain_shell_prints_text(shell, capsys):
    from cuda_magic.display.show import display_form, show

    assert getattr(shell, "kernel", None) is None
    assert display_form() == "text"
    assert show(snapshot()) is None
    assert capsys.readouterr().out == T.snapshot_text(snapshot()) + "\n"
    show(release_report(), quiet=True)
    assert capsys.readouterr().out == ""
    show(cell_records()[0])
    assert capsys.readouterr().out.startswith("[gpumem] cell 12 cuda:0: +1.50 GiB")
    with pytest.raises(TypeError):
        show(object())


def test_show_guard_text_prints_each_attempt_as_it_happens(shell, capsys):
    from cuda_magic.display.show import show_guard

    final = guard_report()
    handle = show_guard(GuardReport(device="cuda:0", retry=Retry("batch_size", 64)))
    assert capsys.readouterr().out == ""
    handle.add_attempt(final.attempts[0])
    assert capsys.readouterr().out == \
        "[oomguard] attempt 1: batch_size=64 -> out of memory (peak 7.50 GiB, tried to allocate 2.00 GiB, 1.25 s)\n"
    handle.add_attempt(final.attempts[1])
    assert capsys.readouterr().out.startswith("[oomguard] attempt 2: batch_size=32 -> out of memory")
    handle.show_report(final)
    assert capsys.readouterr().out == T.guard_text(final) + "\n"


def test_forced_forms_in_a_shell(shell, monkeypatch):
    from IPython.utils.capture import capture_output

    from cuda_magic.display.show import display_form, show, show_guard

    monkeypatch.setenv("CUDA_MAGIC_DISPLAY", "html")
    assert display_form() == "html"
    with capture_output() as cap:
        show(release_report())
    assert cap.outputs[0].data == {"text/html": H.release_html(release_report()),
                                   "text/plain": T.release_text(release_report())}
    monkeypatch.setenv("CUDA_MAGIC_DISPLAY", "widget")
    with capture_output() as cap:
        assert show(snapshot()) is None                             # no second display as Out[N]
        show(diff(snapshot(), snapshot()))                          # no widget for a diff: HTML
    data = cap.outputs[0].data
    # issue 37: a finished record is static HTML and text, no widget (a reopened notebook has no state)
    assert set(data) == {"text/html", "text/plain"}
    assert data["text/plain"] == T.snapshot_text(snapshot()) and "cuda-magic-bar" in data["text/html"]
    assert set(cap.outputs[1].data) == {"text/html", "text/plain"}
    with capture_output() as cap:
        handle = show_guard(GuardReport(device="cuda:0", retry=Retry("batch_size", 64)))
        handle.add_attempt(guard_report().attempts[0])
        running = handle.widget
        handle.show_report(guard_report())
    # the widget served while the cell ran; the report replaces it with static HTML and text, and is closed
    assert handle.widget is None and running.widget.comm is None
    assert "application/vnd.jupyter.widget-view+json" in cap.outputs[0].data
    assert cap.outputs[-1].data == {"text/html": H.guard_html(guard_report()),
                                    "text/plain": T.guard_text(guard_report())}
    assert "7.50 GiB" in cap.outputs[-1].data["text/html"] and "6.50 GiB" in cap.outputs[-1].data["text/html"]
    monkeypatch.setenv("CUDA_MAGIC_DISPLAY", "bogus")
    with pytest.warns(UserWarning, match="CUDA_MAGIC_DISPLAY"):
        assert display_form() == "text"


KERNEL_CELLS = [
    """
from cuda_magic.display.show import display_form, show, show_guard
from cuda_magic.devices.readings import DeviceMemory
from cuda_magic.memory.snapshot import Snapshot
from cuda_magic.recover.report import Attempt, GuardReport, Retry
GiB = 1024**3
dev = DeviceMemory('sim:0', 'simulated GPU', 'simulated', 8 * GiB, torch_allocated=GiB, torch_cached=0,
                   other_this_process=0, other_processes=0, free=7 * GiB, peak=2 * GiB)
print(display_form())
""",
    "show(Snapshot([dev], []))",
    """
handle = show_guard(GuardReport(device='sim:0', before=[dev], retry=Retry('bs', 8)))
first = Attempt(8, 'oom', peak=7 * GiB, duration=0.1)
handle.add_attempt(first)
handle.show_report(GuardReport(device='sim:0', before=[dev], after=[dev], peaks={'sim:0': 5 * GiB},
                          attempts=[first, Attempt(4, 'ok', peak=5 * GiB, duration=0.1)],
                          retry=Retry('bs', 8, final=4), reclaimed={'sim:0': GiB}, outcome='recovered'))
""",
]


def test_show_in_a_real_kernel_leaves_static_html_and_text(monkeypatch):
    # issue 37: what a saved notebook keeps needs no widget state (JupyterLab does not save it by default)
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    from pathlib import Path

    monkeypatch.delenv("CUDA_MAGIC_DISPLAY", raising=False)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(textwrap.dedent(c)) for c in KERNEL_CELLS])
    root = str(Path(__file__).resolve().parents[1])
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": root}}).execute()
    assert nb.cells[0].outputs[0]["text"].strip() == "widget"
    for cell, facts in ((nb.cells[1], ["sim:0", "1.00 GiB", "cuda-magic-bar"]),
                        (nb.cells[2], ["fits at bs=4", "Memory reclaimed: 1.00 GiB on sim:0"])):
        outputs = [o for o in cell.outputs if o["output_type"] == "display_data"]
        assert len(outputs) == 1, cell.outputs
        data = outputs[0]["data"]
        assert set(data) == {"text/html", "text/plain"}
        for fact in facts:
            assert fact in data["text/html"]
            if fact != "cuda-magic-bar":
                assert fact in data["text/plain"]


def test_why_the_value_kept_was_tried_is_said_in_both_forms():
    """The retry policy's reason for the value it kept (issue 9: the prediction is explained), under the
    value line; none while the cell runs, none without a changed value."""
    report = guard_report()
    report.attempts[2].reason = ("95% of 17, predicted from the model measured on 2 and 4 rows of the batch "
                                 "that failed at 32 (64.00 MiB a row at its peak, 0.05 s)")
    text = T.guard_text(report, full=True)
    assert "why batch_size = 16: 95% of 17, predicted from the model measured on 2 and 4 rows" in text
    assert max(map(len, text.splitlines())) <= 110
    html = H.guard_html(report)
    assert "why batch_size = 16: 95% of 17, predicted from the model measured" in html
    assert "why batch_size" not in T.guard_text(report, running=True)
    report.attempts[2].reason = ""
    assert "why batch_size" not in T.guard_text(report, full=True)


def test_the_approximate_peak_says_what_it_is_for_each_device():
    """A --watch table's '~' peaks: the CPU's is the operating system's figure, MPS's (torch.mps keeps no peak
    counter, backends.mps_device) the higher of two readings; exact peaks get no footnote."""
    exact = [CellRecord(1, 0, GiB, True, 0.1, "cuda:0")]
    mps = [CellRecord(2, 0, GiB, False, 0.1, "mps")]
    assert L.approximate_note(exact) == ""
    assert "~ approximate" not in T.history_text(exact) and "approximate" not in H.history_html(exact)
    cpu_note = L.approximate_note(cell_records())
    assert cpu_note == "~ approximate: the operating system's figure"
    mps_note = L.approximate_note(mps)
    assert "operating system" not in mps_note and "higher of the readings" in mps_note
    both = L.approximate_note(cell_records() + mps)
    assert "operating system's figure (CPU)" in both and "MPS" in both
    assert T.history_text(mps).endswith(mps_note) and mps_note in H.history_html(mps)


def test_names_too_small_to_matter_are_counted_not_listed():
    """The report's "kept alive by names" line lists the names holding a share of the device (2%) or enough to
    make the request fit; a 5 MiB name on an 8 GiB device is counted ("and 1 smaller"), still in the diagnosis."""
    report = guard_report()
    report.diagnosis.holders.append(Holder("tiny", 5 * MiB))
    assert [h.name for h in report.holders_shown] == ["losses", "<b>x</b>"] and report.holders_hidden == 1
    assert "and 1 smaller" in T.guard_text(report, full=True) and "and 1 smaller" in H.guard_html(report)
    report.oom.free = 1 * GiB - 4 * MiB          # 4 MiB short: the 5 MiB name alone would make it fit
    assert "tiny" in [h.name for h in report.holders_shown]


def test_advice_of_several_lines_keeps_its_lines_in_html():
    """A cell to type (`%%oomguard -r bs -a acc` over the Trainer's lines) or an indented block stays lines in
    the HTML form, as in the text form."""
    report = guard_report()
    report.outcome = "oom"              # after a retry that fitted, the value to keep comes first
    report.diagnosis.advice.insert(0, Advice("Evaluate without autograd", "with torch.no_grad():\n    out = model(x)"))
    html = H.guard_html(report)
    assert "white-space:pre-wrap" in html and "<code>with torch.no_grad():\n    out = model(x)</code>" in html
    assert "    with torch.no_grad():\n        out = model(x)" in T.guard_text(report)          # the first: unfolded
    assert "       with torch.no_grad():\n           out = model(x)" in T.guard_text(report, full=True)
