"""Browser tests: JupyterLab in headless Chromium. Registers the `browser` marker."""

import sys
from pathlib import Path

# The harness module sits next to the tests; make it importable under any import mode.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "browser: runs a notebook in JupyterLab with headless Chromium"
    )
