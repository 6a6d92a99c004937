"""Where code lives: this package's folder, and whether a file belongs to a library rather than to the
user (the frames a report names are the user's own)."""
from __future__ import annotations

import os

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def is_library_file(filename: str) -> bool:
    """Files of installed packages (torch, numpy, ...) and of cuda_magic itself."""
    name = filename.replace("\\", "/")
    return (filename.startswith(PACKAGE_DIR) or "/site-packages/" in name or "/dist-packages/" in name
            or "/torch/" in name)
