"""`%debug` and `%tb` after a guarded OOM: the failed run's frames were freed on purpose (they held the
memory), so there is nothing to step through. The short error raised after the clean-up says so when
shown again (`%tb`), and `%debug` (and `%pdb on`), through the shell's `debugger` method, says so
instead of failing on a traceback that holds nothing. `install` wraps that method on the shell instance,
`uninstall` removes exactly that wrapper."""
from __future__ import annotations

import sys

FREED_NOTE = ("cuda_magic: the failed run's frames were freed to give the memory back, so there is nothing "
              "to debug. To step through the failing line, run the cell again without %%oomguard (or after "
              "%oomguard off).")


def last_error_was_freed() -> bool:
    value = getattr(sys, "last_value", None)
    return bool(getattr(type(value), "frames_freed", False))


class FreedDebugger:
    """The shell's `debugger(force=False)`, saying FREED_NOTE after a guarded OOM."""

    def __init__(self, original):
        self.original = original

    def __call__(self, force: bool = False):
        if last_error_was_freed():
            if force:
                print(FREED_NOTE)
            return None
        return self.original(force)


def install(shell) -> None:
    if not isinstance(shell.__dict__.get("debugger"), FreedDebugger):
        shell.debugger = FreedDebugger(shell.debugger)


def uninstall(shell) -> None:
    if isinstance(shell.__dict__.get("debugger"), FreedDebugger):
        del shell.debugger
