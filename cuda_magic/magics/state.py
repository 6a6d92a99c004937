"""Per-shell state of the extension: what it registered, so that unloading removes exactly that."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ExtensionState:
    shell: object
    magics: list = field(default_factory=list)          # Magics instances registered
    watcher: object = None                               # watch.CellWatcher while --watch is on
    last_snapshot: object = None                         # for --diff
    guard_all: object = None                             # guard_all.GuardAll while `%oomguard on`
    history: list = field(default_factory=list)          # CellRecords kept after --unwatch


_states: dict[int, ExtensionState] = {}


def get_state(shell, create: bool = False) -> ExtensionState | None:
    state = _states.get(id(shell))
    if state is None and create:
        state = _states[id(shell)] = ExtensionState(shell)
    return state


def drop_state(shell) -> ExtensionState | None:
    return _states.pop(id(shell), None)
