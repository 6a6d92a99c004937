"""The running IPython shell, found without importing IPython where nothing imported it yet (a plain
script never pays for IPython)."""
from __future__ import annotations

import sys


def current_shell():
    """The running IPython shell, or None."""
    if "IPython" not in sys.modules:
        return None
    from IPython.core.getipython import get_ipython

    return get_ipython()


def shell_or_current(shell):
    """`shell` itself, or the running one where None was given."""
    return shell if shell is not None else current_shell()
