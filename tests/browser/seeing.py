"""Seeing memory in a real front end (JupyterLab: lab.py, the classic Notebook: classic.py), one notebook and
one set of checks for both, in the widget form and in the HTML form (what a kernel without ipywidgets shows):

- `%gpumem --live` puts a gauge in its own output; a LATER cell allocates in a loop and the gauge's figure
  changes between two screenshots taken while that cell runs (display updates across cells);
- a guarded cell that allocates for a few seconds shows its own gauge, which changes, then gives way to its
  report;
- `%gpumem` after a model, an optimizer, a backward pass and a graph kept alive shows the by-kind bar with
  every kind;
- `%gpumem --history` draws its chart (an inline SVG) of the cells `--watch` saw;
- no live gauge thread is left once the cells have run.

Screenshots go to CUDA_MAGIC_ARTIFACTS (default artifacts/browser), named `<front>-<form>-...png`.
"""
from __future__ import annotations

import os
from pathlib import Path

from lab import open_browser, save_element_screenshot, start_all_cells, wait_until_finished

REPO_ROOT = Path(__file__).resolve().parents[2]
KINDS = ("parameters", "gradients", "optimizer_state", "activations", "other")


def cells(form: str) -> list[str]:
    """The notebook; `form` is 'widget' (ipywidgets where the environment has it) or 'html' (forced, as a
    kernel without ipywidgets would show it)."""
    force = f"import os\nos.environ['CUDA_MAGIC_DISPLAY'] = {form!r}\n" if form == "html" else ""
    return [
        force + "%load_ext cuda_magic\nimport time, torch\n%gpumem --simulate 512MiB -q\ntorch.zeros(1);",
        "%gpumem --live",
        # a later cell that allocates 1 MiB every 0.1 s for about 6 seconds: the gauge above follows it
        "keep = []\nfor i in range(60):\n    keep.append(torch.zeros(2**18))\n    time.sleep(0.1)",
        "%gpumem --live off\n%gpumem --watch",
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
        "%gpumem --history",
        "import threading\nprint('threads:', sorted(t.name for t in threading.enumerate()))",
    ]


def artifacts() -> Path:
    folder = Path(os.environ.get("CUDA_MAGIC_ARTIFACTS", REPO_ROOT / "artifacts" / "browser"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def write_notebook(path: Path, sources: list[str]) -> Path:
    import nbformat

    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources]), path)
    return path


def expect_change(page, figure, output, shot: Path, what: str) -> str:
    """`figure` (a locator) shows a new value 1.5 s after it first appears; `output` is screenshot both
    times (`shot` with -1 and -2). Returns the output's text when the figure first showed."""
    figure.wait_for(state="visible", timeout=60_000)
    first, text = figure.inner_text(), output.inner_text()
    save_element_screenshot(output, shot.with_name(shot.stem + "-1.png"))
    page.wait_for_timeout(1500)
    second = figure.inner_text()
    save_element_screenshot(output, shot.with_name(shot.stem + "-2.png"))
    assert first != second, f"{what} did not change: {first!r}"
    return text


def check_seeing(front, form: str, tmp_path: Path) -> None:
    """Run cells(form) in `front` (the lab or classic module) and check what is seen, as it runs."""
    notebook = write_notebook(tmp_path / f"seeing-{form}.ipynb", cells(form))
    shots = artifacts() / f"{front.NAME.lower()}-{form}"
    output = front.OUTPUT
    with front.server(notebook) as server, open_browser() as page:
        start_all_cells(page, server.notebook_url(notebook.name), timeout_s=120, front=front)
        # `%gpumem --live`'s gauge, while the next cell allocates
        live_output = page.locator(f"{output}:has(.cuda-magic-gauge)").first
        live = live_output.locator(".cuda-magic-gauge-allocated").first
        expect_change(page, live, live_output, Path(f"{shots}-live.png"), "the --live gauge")
        # the guarded cell's gauge
        guard_output = page.locator(f"{output}:has(.cuda-magic-guard)").first
        running = expect_change(page, guard_output.locator(".cuda-magic-gauge-allocated").first, guard_output,
                                Path(f"{shots}-guard-gauge.png"), "the guarded cell's gauge")
        assert "running the cell" in running and "ran within memory" not in running

        wait_until_finished(page, timeout_s=120, front=front)
        assert front.error_outputs(page) == []
        assert live.inner_text() == "60.00 MiB"             # the last reading, taken by `--live off`
        assert guard_output.locator(".cuda-magic-gauge >> visible=true").count() == 0   # the report's turn
        assert "the cell ran within memory" in guard_output.inner_text()
        save_element_screenshot(guard_output, Path(f"{shots}-guard-report.png"))

        kinds = page.locator(".cuda-magic-kinds").first
        for kind in KINDS:
            segment = kinds.locator(f".cuda-magic-kinds-bar .cuda-magic-kind-{kind}").first
            assert segment.bounding_box()["width"] > 0, kind
        save_element_screenshot(kinds, Path(f"{shots}-by-kind.png"))
        # the history of the two cells --watch saw (the guarded cell, the model's): allocated-after and peak
        chart = page.locator(".cuda-magic-history-chart svg").last
        lines = chart.locator("polyline")
        assert lines.count() == 2 and all(lines.nth(i).bounding_box()["width"] > 0 for i in range(2))
        save_element_screenshot(chart, Path(f"{shots}-history.png"))
        texts = "\n".join(page.locator(output).all_inner_texts())
        assert "threads:" in texts and "cuda_magic live gauge" not in texts
