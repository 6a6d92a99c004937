"""The out-of-memory report as a person sees it (issue 21), in a real browser: JupyterLab 4 in its light and
dark themes, and the classic Notebook 6.5 (the Colab environment's front end, which has no JupyterLab), at
1280 and 800 px (JupyterLab's file browser open). tests/browser/report_view.py runs the notebook and
measures; here each front end and theme is one run, and every problem found is listed at once.

- while `%%oomguard -r batch_size -a accum_steps` runs attempt 2, its widget lists attempt 1 ("out of
  memory") and its header says "attempt 2 at batch_size = <the value attempt 2 ran at>" (and never names a
  value an attempt did not run at);
- the folded report is at most 600 px tall at 1280 px, and reads headline, "Cause:", "Do this: ... %%oomguard
  -r batch_size -a accum_steps" first; its details are folded;
- nothing in any output reaches past the output's right edge, no output scrolls sideways, the charts (inline
  SVG) are fully visible;
- WCAG contrast against the background drawn on: the headline at least 4.5, the timeline's lines at least 3;
- screenshots of the report: docs/screenshots/report-<width>-<theme>.png with CUDA_MAGIC_SCREENSHOT=1, else in
  CUDA_MAGIC_ARTIFACTS (default artifacts/browser), with the figures measured (report-view-<front>-<theme>.json).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lab  # noqa: E402
from classic import available as _classic_notebook  # noqa: E402
from report_view import check_report_view, problems  # noqa: E402


def _no_lab() -> bool:
    return importlib.util.find_spec("jupyterlab") is None


pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not lab.CHROMIUM.exists(), reason=f"{lab.CHROMIUM} not installed (apt-get install chromium)"),
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None, reason="playwright not installed"),
    pytest.mark.skipif(importlib.util.find_spec("ipywidgets") is None, reason="ipywidgets not installed"),
]

LAB = pytest.mark.skipif(_no_lab(), reason="jupyterlab not installed (the Colab environment has none)")
CLASSIC = pytest.mark.skipif(not _classic_notebook(),
                             reason="the classic Notebook 6 with widgetsnbextension 3 is not installed "
                                    "(the Colab environment has them: scripts/setup_colab.sh)")


@pytest.mark.parametrize("front_name, theme", [
    pytest.param("lab", "light", marks=LAB, id="lab-light"),
    pytest.param("lab", "dark", marks=LAB, id="lab-dark"),
    pytest.param("classic", "light", marks=CLASSIC, id="classic"),     # the classic Notebook has no dark theme
])
def test_report_as_seen(front_name, theme, tmp_path):
    if front_name == "lab":
        front = lab
    else:
        import classic as front
    figures = check_report_view(front, tmp_path, theme)
    found = problems(figures)
    assert not found, (f"{len(found)} problems in {front.NAME} ({theme}); figures in {figures['json']}:\n- "
                       + "\n- ".join(found))
