"""Notebooks run in a real JupyterLab in headless Chromium.

The harness tests use a notebook built here with plain ipywidgets; `test_demo_renders_widgets`
runs the repository's demo.ipynb and saves the README figures when CUDA_MAGIC_SCREENSHOT=1.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

# The harness sits next to this file. (No conftest.py here: a second module named `conftest` would
# shadow tests/conftest.py, whose helpers the other test files import.)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab import CHROMIUM, error_outputs, run_notebook_in_lab, save_element_screenshot

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO = REPO_ROOT / "demo.ipynb"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} not installed (apt-get install chromium)"),
    pytest.mark.skipif(
        importlib.util.find_spec("jupyterlab") is None
        or importlib.util.find_spec("playwright") is None,
        reason="jupyterlab or playwright (python package) not installed",
    ),
]


def _screenshot_paths(name: str) -> dict[str, Path]:
    """README figures go to docs/ with CUDA_MAGIC_SCREENSHOT=1, else to an artifact folder
    (CUDA_MAGIC_ARTIFACTS, default artifacts/browser) so a CI run can be looked at."""
    if os.environ.get("CUDA_MAGIC_SCREENSHOT") == "1":
        return {"page": REPO_ROOT / "docs" / f"{name}-recovery.png",
                "widget": REPO_ROOT / "docs" / f"{name}.png"}
    folder = Path(os.environ.get("CUDA_MAGIC_ARTIFACTS", REPO_ROOT / "artifacts" / "browser"))
    return {"page": folder / f"{name}-recovery.png", "widget": folder / f"{name}.png"}


def _write_notebook(path: Path, sources: list[str]) -> Path:
    import nbformat

    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell(source) for source in sources]
    nbformat.write(notebook, path)
    return path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited all the same.
    status = Path(f"/proc/{pid}/status")
    return status.exists() and "zombie" not in status.read_text()


def test_harness_renders_widget_and_text_and_shuts_down(tmp_path):
    notebook = _write_notebook(tmp_path / "harness.ipynb", [
        "import ipywidgets as widgets\n"
        "box = widgets.HTML('<b>harness widget</b>')\n"
        "box.add_class('cuda-magic-widget')\n"
        "display(box)",
        "import os\nprint(f'kernel pid {os.getpid()}')",
        "import time\ntime.sleep(1)\nprint('slow cell done')",
    ])
    screenshot = tmp_path / "harness.png"

    with run_notebook_in_lab(notebook, screenshot=screenshot, timeout_s=90) as page:
        widget = page.locator(".jp-OutputArea-output .cuda-magic-widget")
        assert widget.count() == 1
        assert widget.inner_text().strip() == "harness widget"
        text = page.locator(".jp-OutputArea-output").all_inner_texts()
        # The last cell sleeps: the harness must have waited for it, not only for the first.
        assert any("slow cell done" in t for t in text)
        assert error_outputs(page) == []
        prompts = page.locator(".jp-CodeCell .jp-InputArea-prompt").all_inner_texts()
        assert [p.strip() for p in prompts] == ["[1]:", "[2]:", "[3]:"]
        kernel_pid = int(re.search(r"kernel pid (\d+)", "\n".join(text)).group(1))
        assert _pid_alive(kernel_pid)

    assert screenshot.stat().st_size > 10_000
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not _pid_alive(kernel_pid), "the kernel outlived the JupyterLab server"


def test_harness_reports_errors(tmp_path):
    notebook = _write_notebook(tmp_path / "failing.ipynb", [
        "print('before')",
        "raise ValueError('boom from the notebook')",
        "print('never runs')",
    ])
    with run_notebook_in_lab(notebook, timeout_s=90) as page:
        errors = error_outputs(page)
        texts = "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())
    assert len(errors) == 1
    assert "ValueError" in errors[0] and "boom from the notebook" in errors[0]
    assert "before" in texts
    assert "never runs" not in texts


@pytest.mark.skipif(not DEMO.exists(), reason="demo.ipynb not written yet")
def test_demo_renders_widgets():
    shots = _screenshot_paths("widget-oom")
    with run_notebook_in_lab(DEMO, screenshot=shots["page"], timeout_s=150) as page:
        assert error_outputs(page) == []
        # finished reports are static HTML (issue 37): no widget is left once every cell ran
        assert page.locator(".cuda-magic").count() >= 5 and page.locator(".cuda-magic-widget").count() == 0

        bar = page.locator(".cuda-magic-bar")
        assert bar.count() >= 1
        assert page.locator(".cuda-magic-bar .cuda-magic-part-torch_allocated").count() >= 1
        assert page.locator(".cuda-magic-bar .cuda-magic-part-free").count() >= 1

        diagnosis = page.locator(".cuda-magic-diagnosis")
        assert diagnosis.count() >= 1
        assert diagnosis.first.inner_text().strip()

        outputs = "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())
        assert "memory released" in outputs          # the headline: what came back (the rest is folded)

        # The README figure: the widget that explains the OOM (or, if the class sits on an
        # inner element, the whole output holding it), scrolled into view.
        widget = page.locator(".jp-OutputArea-output:has(.cuda-magic-diagnosis)")
        save_element_screenshot(widget.first, shots["widget"])

        # The black box of the attention cell: its inline SVG timeline and the by-line table, scrolled
        # into view; the README shows it.
        box_shots = _screenshot_paths("blackbox-oom")
        assert page.locator(".cuda-magic-timeline svg polyline").count() >= 1
        assert page.locator("script").filter(has_text="cuda-magic").count() == 0
        blackbox = page.locator('.jp-OutputArea-output:has(.cuda-magic-timeline):has-text("scores = q @ k")')
        assert blackbox.count() >= 1
        assert "Alive at the failure, by line" in blackbox.first.inner_text()
        save_element_screenshot(blackbox.first.locator(".cuda-magic-blackbox").first, box_shots["widget"])
        shots["blackbox"] = box_shots["widget"]

    for path in shots.values():
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 1_000
