"""The dependency ranges keep Colab's pinned notebook stack (scripts/colab-pins.txt), and the check that CI
runs on `pip install --dry-run --report` in that stack (scripts/check_pins.py) catches a replacement."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PINS = ROOT / "scripts" / "colab-pins.txt"
sys.path.insert(0, str(ROOT / "scripts"))
import check_pins  # noqa: E402

sys.path.pop(0)


def dependencies() -> list[str]:
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    return re.findall(r'"([^"]+)"', block)


def test_pins_are_colabs_notebook_stack():
    pins = check_pins.read_pins(str(PINS))
    for name, version in {"ipython": "7.34.0", "ipywidgets": "7.7.1", "ipykernel": "6.17.1",
                          "notebook": "6.5.7", "widgetsnbextension": "3.6.10", "pandas": "2.2.3"}.items():
        assert pins[name] == version
    assert "torch" not in pins     # CI's torch is the CPU build (Colab's is a CUDA build): not a pin


def test_every_dependency_accepts_colabs_pinned_version_and_declares_it_as_the_floor():
    from packaging.requirements import Requirement
    from packaging.version import Version

    pins = check_pins.read_pins(str(PINS))
    checked = set()
    for line in dependencies():
        req = Requirement(line)
        name = check_pins.canonical(req.name)
        if name not in pins:
            continue
        assert req.specifier.contains(pins[name]), f"{line} excludes Colab's {name}=={pins[name]}"
        checked.add(name)
        if name in ("ipython", "ipywidgets", "pandas"):
            # The oldest release declared is the one CI tests: 7.34 for the pin 7.34.0, 7.7 for 7.7.1.
            floor = [Version(s.version).release for s in req.specifier if s.operator == ">="]
            assert floor and Version(pins[name]).release[:len(floor[0])] == floor[0], line
    assert {"ipython", "ipywidgets", "pandas", "nvidia-ml-py"} <= checked


def _item(name, version):
    return {"metadata": {"name": name, "version": version}}


def test_a_report_that_replaces_a_pin_or_brings_torch_fails():
    pins = {"ipython": "7.34.0", "traitlets": "5.7.1"}
    bad, planned = check_pins.problems_in_report(pins, {"install": [
        _item("cuda-magic", "0.1.0"), _item("IPython", "9.18.1"), _item("traitlets", "5.16.1"),
        _item("torch", "2.15.0"), _item("comm", "0.2.3")]})
    assert planned == ["cuda-magic==0.1.0", "ipython==9.18.1", "traitlets==5.16.1", "torch==2.15.0",
                       "comm==0.2.3"]
    assert [b.split(":")[0] for b in bad] == ["ipython", "traitlets", "torch"]
    assert check_pins.problems_in_report(pins, {"install": [_item("cuda_magic", "0.1.0")]})[0] == []


def test_the_check_fails_from_the_command_line(tmp_path, capsys):
    import json

    report = tmp_path / "report.json"
    report.write_text(json.dumps({"install": [_item("ipywidgets", "8.1.9")]}))
    assert check_pins.main([str(PINS), str(report)]) == 1
    assert "ipywidgets: pinned at 7.7.1, the install would put 8.1.9" in capsys.readouterr().err
    report.write_text(json.dumps({"install": [_item("cuda-magic", "0.1.0")]}))
    assert check_pins.main([str(PINS), str(report)]) == 0
