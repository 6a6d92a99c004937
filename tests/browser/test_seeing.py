"""Seeing memory in JupyterLab (tests/browser/seeing.py): the live gauge (`%gpumem --live`, updating while a
later cell runs, and a guarded cell's own) changes while a cell allocates, a guarded cell's gives way to its
report, `%gpumem`'s by-kind bar renders; in the widget form and in the HTML form (no ipywidgets)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lab  # noqa: E402
from seeing import check_seeing  # noqa: E402

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not lab.CHROMIUM.exists(), reason=f"{lab.CHROMIUM} not installed (apt-get install chromium)"),
    pytest.mark.skipif(
        importlib.util.find_spec("jupyterlab") is None or importlib.util.find_spec("playwright") is None,
        reason="jupyterlab or playwright (python package) not installed",
    ),
]


@pytest.mark.parametrize("form", ["widget", "html"])
def test_gauge_changes_while_a_later_cell_runs_and_by_kind_bar_renders(form, tmp_path):
    if form == "widget" and importlib.util.find_spec("ipywidgets") is None:
        pytest.skip("ipywidgets not installed")
    check_seeing(lab, form, tmp_path)
