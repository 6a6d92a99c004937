"""The classic Jupyter Notebook 6.5 with ipywidgets 7 (the Colab environment: scripts/setup_colab.sh), in
headless Chromium: the demo's widget outputs render as widgets, none as an error; and seeing memory
(tests/browser/seeing.py: the live gauges change while cells run, the by-kind bar renders) in the widget
and the HTML forms. Screenshots go to CUDA_MAGIC_ARTIFACTS (default artifacts/browser)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from classic import available as _classic_notebook  # noqa: E402
from lab import CHROMIUM  # noqa: E402
from seeing import check_seeing  # noqa: E402


REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO = REPO_ROOT / "demo.ipynb"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not CHROMIUM.exists(), reason=f"{CHROMIUM} not installed (apt-get install chromium)"),
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None, reason="playwright not installed"),
    pytest.mark.skipif(not _classic_notebook(),
                       reason="the classic Notebook 6 with widgetsnbextension 3 is not installed "
                              "(the Colab environment has them: scripts/setup_colab.sh)"),
]


def _artifact(name: str) -> Path:
    return Path(os.environ.get("CUDA_MAGIC_ARTIFACTS", REPO_ROOT / "artifacts" / "browser")) / name


def test_demo_renders_in_classic_notebook():
    from classic import error_outputs, run_notebook_in_classic

    shot, oom_shot = _artifact("notebook6-demo.png"), _artifact("notebook6-widget-oom.png")
    with run_notebook_in_classic(DEMO, screenshot=shot, timeout_s=180) as page:
        assert error_outputs(page) == []
        # finished reports are static HTML (issue 37): no output is left that needs a widget model
        widget_outputs = page.evaluate(f"""() => Jupyter.notebook.get_cells()
            .filter(c => c.cell_type === 'code')
            .flatMap(c => c.output_area.outputs)
            .filter(o => o.data && o.data['{WIDGET_MIME}']).length""")
        assert widget_outputs == 0 and page.locator(".output_area .cuda-magic").count() >= 5

        assert page.locator(".cuda-magic-bar .cuda-magic-part-torch_allocated").count() >= 1
        assert page.locator(".cuda-magic-bar .cuda-magic-part-free").count() >= 1
        diagnosis = page.locator(".cuda-magic-diagnosis")
        assert diagnosis.count() >= 1 and diagnosis.first.inner_text().strip()
        outputs = "\n".join(page.locator(".output_area").all_inner_texts())
        assert "memory released" in outputs          # the headline: what came back (the rest is folded)
        # The widget that explains the OOM, on its own.
        page.locator(".output_area:has(.cuda-magic-diagnosis)").first.screenshot(path=str(oom_shot))
    for path in (shot, oom_shot):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


@pytest.mark.parametrize("form", ["widget", "html"])
def test_gauge_changes_while_a_later_cell_runs_and_by_kind_bar_renders(form, tmp_path):
    import classic

    check_seeing(classic, form, tmp_path)
