"""Loading and unloading: register the magics once, and on unload remove every hook added."""
from __future__ import annotations

from cuda_magic.magics.state import ExtensionState, get_state


def load(shell) -> None:
    if get_state(shell) is not None:
        return  # loaded already: register nothing twice
    from cuda_magic.magics.free import FreeMagics
    from cuda_magic.magics.gpumem import GpumemMagics
    from cuda_magic.magics.guard import GuardMagics

    state = ExtensionState(shell)
    for cls in (GpumemMagics, GuardMagics, FreeMagics):
        instance = cls(shell)
        instance.cuda_magic_state = state     # one state, shared by the three
        state.magics.append(instance)
    for instance in state.magics:
        shell.register_magics(instance)
    from cuda_magic.magics import awaiting, freed

    freed.install(shell)
    awaiting.install(shell)


def unload(shell) -> None:
    state = get_state(shell)
    if state is None:
        return
    state.stop_all()
    from cuda_magic.magics import awaiting, freed

    freed.uninstall(shell)
    awaiting.uninstall(shell)
    manager = shell.magics_manager
    for instance in state.magics:
        for kind, table in instance.magics.items():
            registered = manager.magics.get(kind, {})
            for name in table:
                bound = registered.get(name)
                if getattr(bound, "__self__", None) is instance:
                    del registered[name]
        for key, value in list(manager.registry.items()):
            if value is instance:
                del manager.registry[key]
        instance.cuda_magic_state = None
