"""The demo notebook, executed headless in a real Jupyter kernel (nbclient), on the simulated device."""
from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WIDGET = "application/vnd.jupyter.widget-view+json"


@pytest.fixture(scope="module")
def executed():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from run_demo import execute
    finally:
        sys.path.pop(0)
    t0 = time.perf_counter()
    nb = execute(ROOT / "demo.ipynb", timeout=300)
    return nb, time.perf_counter() - t0


def _outputs(nb, startswith: str):
    cells = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith(startswith)]
    assert cells, f"no cell starts with {startswith!r}"
    return cells[0].outputs


def _text(outputs) -> str:
    parts = []
    for o in outputs:
        if o.get("output_type") == "stream":
            parts.append(o.get("text", ""))
        parts.append(o.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)


def test_demo_runs_without_errors_in_time(executed):
    nb, seconds = executed
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert errors == []
    assert seconds < 180, f"the demo took {seconds:.0f} s; it must run in under 3 minutes"


def test_demo_shows_widgets_with_text_and_html_forms(executed):
    nb, _ = executed
    bundles = [o.data for c in nb.cells if c.cell_type == "code" for o in c.outputs
               if o.output_type == "display_data" and WIDGET in o.data]
    assert len(bundles) >= 5
    for data in bundles:
        assert "text/plain" in data and "text/html" in data
    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    assert state, "the widget state is saved in the executed notebook"
    model_ids = {b[WIDGET]["model_id"] for b in bundles}
    assert model_ids <= set(state)


def test_demo_explains_the_oom_and_reclaims_memory(executed):
    nb, _ = executed
    text = _text(_outputs(nb, "%%oomguard --no-raise"))
    assert "out of memory" in text.lower()
    assert "Diagnosis" in text
    assert "Failed at cell line 1" in text
    assert "Try, most useful first" in text
    reclaimed = re.search(r"Memory reclaimed: ([0-9.]+) (KiB|MiB|GiB)", text)
    assert reclaimed and float(reclaimed.group(1)) > 0


def test_demo_retry_finds_a_batch_and_keeps_the_effective_batch(executed):
    nb, _ = executed
    text = _text(_outputs(nb, 'print(f"batch_size='))
    m = re.search(r"batch_size=(\d+), accum_steps=(\d+), effective batch=(\d+)", text)
    assert m, text
    batch, accum, effective = map(int, m.groups())
    assert 1 <= batch < 16384 and accum > 1
    assert effective >= 16384 and batch * accum == effective
    attempts = _text(_outputs(nb, "%%oomguard -r batch_size"))
    assert "fits" in attempts and "out of memory" in attempts


def test_demo_freecuda_deletes_the_leaking_names(executed):
    nb, _ = executed
    text = _text(_outputs(nb, "%freecuda losses"))
    assert "Deleted: losses, out, x" in text
    assert "model" in text and "opt" in text   # still held, and listed as such
