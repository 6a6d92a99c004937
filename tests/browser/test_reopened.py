"""Issue 37: a saved notebook reopened, as a user meets it: in JupyterLab without widget state (Lab does
not save it by default), untrusted (a downloaded notebook: Lab sanitises its HTML and drops inline SVG) and
trusted, at 1000 px, and in the classic Notebook (Colab's widget stack). The notebook is run once by
nbclient, its widget state removed, then opened without running anything; the checks are on what is
visible: no "model not found", chart text never run together, nothing wider than its output, a disclosure
marker, code after the sentence that introduces it. Screenshots go to docs/screenshots/ with
CUDA_MAGIC_SCREENSHOT=1, else to the artifacts folder.
"""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import classic  # noqa: E402
import lab  # noqa: E402
from lab import CHROMIUM, open_browser  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
WIDGET = "application/vnd.jupyter.widget-view+json"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} not installed (apt-get install chromium)"),
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None
                       or importlib.util.find_spec("nbclient") is None,
                       reason="playwright or nbclient (python packages) not installed"),
]

CELLS = [
    "%load_ext cuda_magic\nimport torch\nfrom torch import nn\n%gpumem --simulate 64MiB -q\n%gpumem --watch -q",
    # an evaluation that runs out of memory: the folded report, its chart, seven lines alive
    "model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 256))\n"
    "x = torch.randn(4096, 256)",
    "%%oomguard --no-raise\na = torch.zeros(2**20)\nb = torch.zeros(2**20)\nc = torch.zeros(2**20)\n"
    "d = torch.zeros(2**20)\ne = torch.zeros(2**20)\ny = model(x)",
    "del a, b, c, d, e\n%freecuda -q",
    # a retry: attempts, one chart trace each
    "batch = 8192",
    "%%oomguard -r batch\nout = model(torch.randn(batch, 256)).sum()",
    "%gpumem --live",
    "keep = torch.zeros(2**21)\nimport time; time.sleep(1.5)",
    "%gpumem --live off",
    "%gpumem --history",
    "%gpumem",
]

# What a reader sees of each element: the text nodes that are drawn (a box of some size), joined without a
# space where one ends right where the next begins on the same line (as they read), else with a space.
VISIBLE_JS = """
(sel) => {
  const out = [];
  for (const root of document.querySelectorAll(sel)) {
    const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
    let text = '', last = null;
    while (walker.nextNode()) {
      const node = walker.currentNode;
      if (!node.textContent.trim()) continue;
      const range = document.createRange();
      range.selectNodeContents(node);
      const rects = [...range.getClientRects()].filter(r => r.width > 0.5 && r.height > 0.5);
      if (!rects.length) continue;
      const first = rects[0];
      const touching = last && Math.abs(first.top - last.top) < 3 && first.left - last.right < 1.5
                       && first.left - last.right > -1.5;
      text += (last && !touching ? ' ' : '') + node.textContent;
      last = rects[rects.length - 1];
    }
    out.push(text);
  }
  return out;
}
"""

# Elements inside our reports that end past the right edge of their output (1 px of rounding allowed).
CLIPPED_JS = """
(sel) => {
  const out = [];
  for (const area of document.querySelectorAll(sel)) {
    const right = area.getBoundingClientRect().right;
    for (const el of area.querySelectorAll('.cuda-magic *, .cuda-magic-gauge *')) {
      const r = el.getBoundingClientRect();
      if (r.width > 0 && r.right > right + 1) out.push(el.tagName + ' ' + (el.className.baseVal ?? el.className)
        + ' ' + (el.textContent || '').slice(0, 40) + ' ' + Math.round(r.right - right) + 'px');
    }
  }
  return out;
}
"""

# For each drawn SVG chart: the legend and label texts whose box ends past the chart's own box.
SVG_OVERFLOW_JS = """
() => {
  const out = [];
  for (const svg of document.querySelectorAll('svg.cuda-magic-chart')) {
    const box = svg.getBoundingClientRect();
    for (const t of svg.querySelectorAll('text')) {
      const r = t.getBoundingClientRect();
      if (r.right > box.right + 0.5 || r.left < box.left - 0.5) out.push(t.textContent + ' ' + (r.right - box.right));
    }
  }
  return out;
}
"""

# Each multi-line code block starts at the left edge of the block that holds its sentence (a line of its own).
CODE_JS = """
() => [...document.querySelectorAll('.cuda-magic pre.cuda-magic-code')].map(pre => {
  const holder = pre.parentElement.getBoundingClientRect();
  const r = pre.getBoundingClientRect();
  return Math.abs(r.left - holder.left);
})
"""

SUMMARY_JS = """
() => [...document.querySelectorAll('.cuda-magic details > summary')].map(s => getComputedStyle(s).display)
"""


def artifact(name: str) -> Path:
    if os.environ.get("CUDA_MAGIC_SCREENSHOT") == "1":
        folder = REPO_ROOT / "docs" / "screenshots"
    else:
        folder = Path(os.environ.get("CUDA_MAGIC_ARTIFACTS", REPO_ROOT / "artifacts" / "browser"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The notebook run once, saved as JupyterLab saves it by default: without the widget state."""
    import nbclient
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    env_cell = "import os\nos.environ.pop('CUDA_MAGIC_DISPLAY', None)"
    nb.cells.insert(0, nbformat.v4.new_code_cell(env_cell))
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(REPO_ROOT)}}).execute()
    nb.metadata.pop("widgets", None)
    errors = [o for c in nb.cells for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    # what stays is static: not one output needs a widget model
    assert not [o for c in nb.cells for o in c.outputs if WIDGET in o.get("data", {})]
    path = tmp_path_factory.mktemp("reopened") / "reopened.ipynb"
    nbformat.write(nb, path)
    return path


def lab_server(notebook: Path, trusted: bool):
    """JupyterLab on a copy of the notebook; `trusted`: signed with the server's own notary first."""
    def sign(server, tmp):
        import nbformat
        from nbformat.sign import NotebookNotary

        copy = server.root_dir / notebook.name
        nb = nbformat.read(copy, as_version=4)
        NotebookNotary(data_dir=str(tmp / "data")).sign(nb)
        nbformat.write(nb, copy)

    return lab.server(notebook, prepare=sign if trusted else None)


def open_saved(page, url: str, output: str) -> None:
    page.goto(url, wait_until="domcontentloaded", timeout=120_000)
    page.wait_for_selector(f"{output} .cuda-magic-guard", timeout=120_000)
    page.wait_for_timeout(1500)


def check_reads(page, output: str, *, svg_drawn: bool) -> dict:
    text = page.evaluate("() => document.body.innerText")
    assert "model not found" not in text and "Error displaying widget" not in text
    assert page.locator(f"{output} .cuda-magic-guard").count() == 2
    seen = " ".join(page.evaluate(VISIBLE_JS, f"{output} .cuda-magic"))
    # labels of a chart run together where a sanitiser dropped the SVG: "064 MiB128 MiB", "0.51s"
    assert not re.search(r"(?:B|KiB|MiB|GiB)\d", seen), re.findall(r".{20}(?:B|KiB|MiB|GiB)\d.{20}", seen)
    assert "out of memory at cell line 6" in seen and "Do this:" in seen
    charts = page.locator(f"{output} svg.cuda-magic-chart").count()
    captions = [c for c in page.evaluate(VISIBLE_JS, f"{output} .cuda-magic-chart-text") if c]
    if svg_drawn:
        assert charts >= 3 and not captions                            # the words stay hidden under a chart
        assert page.evaluate(SVG_OVERFLOW_JS) == []                     # the legend inside the chart
    else:
        assert charts == 0 and len(captions) >= 3                       # the sanitiser kept the words
        assert all(c.startswith("Chart: ") for c in captions)
        assert any(re.search(r"peak [0-9.]+ MiB at [0-9.]+ seconds", c) for c in captions)
    assert page.evaluate(CLIPPED_JS, output) == []
    assert page.evaluate(CODE_JS) == [] or max(page.evaluate(CODE_JS)) < 1
    displays = page.evaluate(SUMMARY_JS)
    assert displays and all(d == "list-item" for d in displays)       # each with its disclosure marker
    gauge = page.evaluate(VISIBLE_JS, f"{output} .cuda-magic-gauge")      # --live off: its last state, static
    assert len(gauge) == 1 and re.search(r"allocated [0-9.]+ MiB .*capacity 64.00 MiB", gauge[0]), gauge
    return {"charts": charts, "captions": captions}


@pytest.mark.skipif(importlib.util.find_spec("jupyterlab") is None, reason="jupyterlab not installed")
@pytest.mark.parametrize("trusted", [False, True], ids=["untrusted", "trusted"])
def test_a_saved_report_reopened_in_lab_reads_without_widget_state(saved, trusted):
    name = "trusted" if trusted else "untrusted"
    with lab_server(saved, trusted) as server, open_browser(viewport=(1000, 900)) as page:
        open_saved(page, server.notebook_url(saved.name), lab.OUTPUT)
        check_reads(page, lab.OUTPUT, svg_drawn=trusted)
        lab.save_full_screenshot(page, artifact(f"reopened-lab-{name}-1000px.png"))


@pytest.mark.skipif(not classic.available(), reason="the classic Notebook 6 with widgetsnbextension 3 not installed")
def test_a_saved_report_reopened_in_the_classic_notebook_reads(saved):
    with classic.server(saved) as server, open_browser(viewport=(1000, 900)) as page:
        open_saved(page, server.notebook_url(saved.name), classic.OUTPUT)
        assert classic.error_outputs(page) == []
        # the classic Notebook sanitises an untrusted notebook's HTML too: drawn or not, it reads
        svg_drawn = page.locator(f"{classic.OUTPUT} svg.cuda-magic-chart").count() > 0
        check_reads(page, classic.OUTPUT, svg_drawn=svg_drawn)
        classic.save_full_screenshot(page, artifact("reopened-classic-1000px.png"))


GAUGE_CELLS = [
    "%load_ext cuda_magic\nimport torch\n%gpumem --simulate 25GiB -q",
    "%%oomguard\nx = torch.zeros(2**20)\nimport time\ntime.sleep(6)",
]

GAUGE_FITS_JS = """
(sel) => {
  const gauge = [...document.querySelectorAll(sel + ' .cuda-magic-gauge')]
    .find(g => g.getBoundingClientRect().width > 0);
  if (!gauge) return null;
  const area = gauge.closest(sel).getBoundingClientRect();
  const past = [...gauge.querySelectorAll('*')].filter(el => el.getBoundingClientRect().right > area.right + 1)
    .map(el => el.className + ' ' + el.textContent.slice(0, 30));
  const lines = new Set([...gauge.querySelectorAll('b[class^="cuda-magic-gauge-"]')]
    .map(b => Math.round(b.getBoundingClientRect().top))).size;
  return {past, lines, text: gauge.innerText};
}
"""


@pytest.mark.skipif(importlib.util.find_spec("jupyterlab") is None, reason="jupyterlab not installed")
def test_the_live_gauge_wraps_in_a_narrow_output(tmp_path):
    # issue 37: at 1000 px with the file browser open, "capacity 25..." was clipped and the widget's bar ran
    # off the edge (its figures joined without spaces could not wrap)
    import nbformat

    path = tmp_path / "gauge.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in GAUGE_CELLS]), path)
    with lab.server(path) as server, open_browser(viewport=(700, 900)) as page:
        lab.start_all_cells(page, server.notebook_url(path.name))
        page.wait_for_selector(f"{lab.OUTPUT} .cuda-magic-gauge", timeout=120_000)
        page.wait_for_timeout(500)
        seen = page.evaluate(GAUGE_FITS_JS, lab.OUTPUT)
        lab.save_element_screenshot(page.locator(f"{lab.OUTPUT} .cuda-magic-gauge").first,
                                    artifact("gauge-narrow.png"))
        lab.wait_until_finished(page)
    assert seen is not None and seen["past"] == [], seen
    assert seen["lines"] >= 2 and "capacity 25.00 GiB" in seen["text"], seen      # wrapped, whole
