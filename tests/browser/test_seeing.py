"""Seeing memory in JupyterLab: the live gauge (`%gpumem --live`, and a guarded cell's own) changes while a
cell allocates, and a guarded cell's gives way to its report; `%gpumem`'s by-kind bar renders. Screenshots go to CUDA_MAGIC_ARTIFACTS
(default artifacts/browser)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lab import (CHROMIUM, error_outputs, lab_server, open_browser, save_element_screenshot, start_all_cells,
                 wait_until_finished)

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} not installed (apt-get install chromium)"),
    pytest.mark.skipif(
        importlib.util.find_spec("jupyterlab") is None or importlib.util.find_spec("playwright") is None,
        reason="jupyterlab or playwright (python package) not installed",
    ),
]

CELLS = [
    "%load_ext cuda_magic\nimport time, torch\n%gpumem --simulate 512MiB -q\ntorch.zeros(1);",
    "%gpumem --live",
    # a cell that allocates 1 MiB every 0.1 s for about 6 seconds: the gauge above follows it
    "keep = []\nfor i in range(60):\n    keep.append(torch.zeros(2**18))\n    time.sleep(0.1)",
    "%gpumem --live off",
    # the same under %%oomguard: its own gauge after about a second, then the report in its place
    "%%oomguard\nfor i in range(40):\n    keep.append(torch.zeros(2**18))\n    time.sleep(0.1)",
    "del keep\n"
    "model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.BatchNorm1d(1024), torch.nn.ReLU(),\n"
    "                            torch.nn.Linear(1024, 10))\n"
    "opt = torch.optim.Adam(model.parameters())\n"
    "x = torch.randn(64, 256)\n"
    "for _ in range(3):\n"
    "    opt.zero_grad()\n"
    "    loss = model(x).square().mean()\n"
    "    loss.backward()\n"
    "    opt.step()\n"
    "kept = model(x).square().mean()\n"
    "%gpumem -n 3",
    "import threading\nprint('threads:', sorted(t.name for t in threading.enumerate()))",
]


def _artifacts() -> Path:
    folder = Path(os.environ.get("CUDA_MAGIC_ARTIFACTS", REPO_ROOT / "artifacts" / "browser"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def test_gauge_changes_while_the_cell_runs_and_by_kind_bar_renders(tmp_path):
    import nbformat

    notebook = tmp_path / "seeing.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS]), notebook)
    shots = _artifacts()
    with lab_server(notebook) as server, open_browser() as page:
        start_all_cells(page, server.notebook_url(notebook.name), timeout_s=120)
        figure = page.locator(".cuda-magic-gauge .cuda-magic-gauge-allocated").first
        figure.wait_for(state="visible", timeout=60_000)
        gauge = page.locator(".jp-OutputArea-output:has(.cuda-magic-gauge)").first
        first = figure.inner_text()
        save_element_screenshot(gauge, shots / "gauge-1.png")
        page.wait_for_timeout(1500)
        second = figure.inner_text()
        save_element_screenshot(gauge, shots / "gauge-2.png")
        assert first != second, f"the gauge did not change: {first!r}"

        guarded = page.locator(".cuda-magic-widget .cuda-magic-gauge-widget .cuda-magic-gauge-allocated").first
        guarded.wait_for(state="visible", timeout=60_000)
        guard_output = page.locator(".jp-OutputArea-output:has(.cuda-magic-guard)").first
        first = guarded.inner_text()
        save_element_screenshot(guard_output, shots / "guard-gauge-1.png")
        page.wait_for_timeout(1500)
        second = guarded.inner_text()
        save_element_screenshot(guard_output, shots / "guard-gauge-2.png")
        assert first != second, f"the guarded cell's gauge did not change: {first!r}"

        wait_until_finished(page, timeout_s=120)
        assert error_outputs(page) == []
        assert figure.inner_text() == "60.00 MiB"          # the last reading before `--live off`
        assert page.locator(".cuda-magic-widget .cuda-magic-gauge-widget").first.is_hidden()   # the report's turn
        save_element_screenshot(guard_output, shots / "guard-report.png")
        assert "the cell ran within memory" in guard_output.inner_text()

        kinds = page.locator(".cuda-magic-kinds").first
        for kind in ("parameters", "gradients", "optimizer_state", "activations", "other"):
            segment = page.locator(f".cuda-magic-kinds-bar .cuda-magic-kind-{kind}").first
            assert segment.bounding_box()["width"] > 0, kind
        save_element_screenshot(kinds, shots / "by-kind.png")
        texts = "\n".join(page.locator(".jp-OutputArea-output").all_inner_texts())
        assert "threads:" in texts and "cuda_magic live gauge" not in texts
