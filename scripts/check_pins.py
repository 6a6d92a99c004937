"""Fail when installing the project would change a package that Colab pins.

    python scripts/check_pins.py PINS REPORT.json   # the report of `pip install --dry-run --report`
    python scripts/check_pins.py PINS --installed   # what this interpreter has installed now

PINS holds `name==version` lines (scripts/colab-pins.txt). From a dry-run report, every package pip would
install is listed; one that is pinned (a replacement of what Colab has) fails the check, and so does torch
(a torch requirement the environment's torch does not satisfy would pull a CUDA build of several GB).
With --installed, every pinned package must be installed at exactly its pinned version.
"""
from __future__ import annotations

import json
import re
import sys
from importlib import metadata


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: str) -> dict[str, str]:
    pins = {}
    for raw in open(path, encoding="utf-8"):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep:
            raise SystemExit(f"{path}: not a name==version pin: {line!r}")
        pins[canonical(name)] = version.strip()
    return pins


def problems_in_report(pins: dict[str, str], report: dict) -> tuple[list[str], list[str]]:
    """(what the install would change that must not change, everything it would install)."""
    bad, planned = [], []
    for item in report.get("install", []):
        meta = item.get("metadata", {})
        name, version = canonical(meta.get("name", "?")), meta.get("version", "?")
        planned.append(f"{name}=={version}")
        if name in pins:
            bad.append(f"{name}: pinned at {pins[name]}, the install would put {version}")
        elif name == "torch":
            bad.append(f"torch: the install would put {version} (the environment's torch must satisfy it)")
    return bad, planned


def problems_installed(pins: dict[str, str]) -> list[str]:
    bad = []
    for name, version in pins.items():
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            bad.append(f"{name}: pinned at {version}, not installed")
            continue
        if have != version:
            bad.append(f"{name}: pinned at {version}, installed {have}")
    return bad


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    pins = read_pins(argv[0])
    if argv[1] == "--installed":
        bad = problems_installed(pins)
        what = f"all {len(pins)} pinned packages installed at their pins"
    else:
        with open(argv[1], encoding="utf-8") as f:
            bad, planned = problems_in_report(pins, json.load(f))
        what = f"installing would add {', '.join(planned) or 'nothing'}; no pinned package changes"
    if bad:
        print("check_pins: FAILED", *bad, sep="\n  ", file=sys.stderr)
        return 1
    print(f"check_pins: {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
