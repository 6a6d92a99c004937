"""Loading and unloading: register the magics once, and on unload remove every hook added."""
from __future__ import annotations

from cuda_magic.magics.state import drop_state, get_state


def load(shell) -> None:
    state = get_state(shell)
    if state is not None and state.magics:
        return  # loaded already: register nothing twice
    state = get_state(shell, create=True)
    from cuda_magic.magics.free import FreeMagics
    from cuda_magic.magics.gpumem import GpumemMagics
    from cuda_magic.magics.guard import GuardMagics

    for cls in (GpumemMagics, GuardMagics, FreeMagics):
        instance = cls(shell)
        shell.register_magics(instance)
        state.magics.append(instance)
    from cuda_magic.magics.freed import install

    install(shell)


def unload(shell) -> None:
    state = drop_state(shell)
    if state is None:
        return
    if state.watcher is not None:
        state.watcher.stop()
    if state.guard_all is not None:
        state.guard_all.stop()
    from cuda_magic.devices.simulated import stop_session
    from cuda_magic.magics.freed import uninstall

    stop_session()
    uninstall(shell)
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
