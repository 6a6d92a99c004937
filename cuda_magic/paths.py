"""Where code lives: this package's folder, and whether a file belongs to a library rather than to the
user (the frames a report names are the user's own)."""
from __future__ import annotations

import os
import re
import sysconfig

_KERNEL_CELL = re.compile(r"[/\\]ipykernel_\d+[/\\][^/\\]+\.py$")

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
# Python's own library (threading, copy, ...): a frame there is not the user's line either
_STDLIB = tuple(dict.fromkeys(os.path.abspath(p) + os.sep for p in
                              (sysconfig.get_paths().get("stdlib"), sysconfig.get_paths().get("platstdlib")) if p))


def is_library_file(filename: str) -> bool:
    """Files of installed packages (torch, numpy, ...), of Python's standard library and of cuda_magic."""
    name = filename.replace("\\", "/")
    return (filename.startswith(PACKAGE_DIR) or "/site-packages/" in name or "/dist-packages/" in name
            or "/torch/" in name or filename.startswith(_STDLIB))


def is_torch_or_python_file(filename: str) -> bool:
    """Files of torch, of Python's standard library (not the packages installed under it) and of
    cuda_magic: the library frames that are not a framework's training loop."""
    name = filename.replace("\\", "/")
    installed = "/site-packages/" in name or "/dist-packages/" in name
    return (filename.startswith(PACKAGE_DIR) or "/torch/" in name
            or (filename.startswith(_STDLIB) and not installed))


def is_cell_file(filename: str) -> bool:
    """The file IPython compiled a cell under: `<ipython-input-N-...>` (IPython's terminal and IPython 7),
    `.../ipykernel_PID/HASH.py` (ipykernel: Jupyter, VS Code, Colab)."""
    return filename.startswith("<ipython-input-") or _KERNEL_CELL.search(filename) is not None


def is_cell_top_level(code_name: str | None) -> bool:
    """A cell's own top-level code: `<module>`; IPython 7.34 on Python 3.11+ names it `<cell line: N>`."""
    return bool(code_name) and code_name.startswith(("<module>", "<cell line"))
