"""A guarded cell with top-level `await`, run by IPython's own async execution.

IPython decides whether to run a cell asynchronously from the transformed cell (`should_run_async`): a
`%%oomguard` cell becomes `get_ipython().run_cell_magic(...)`, which has no `await`, so it would run
synchronously and its body's `await` would be a SyntaxError. `route` is an input transformer (added by
`%load_ext`, removed by `%unload_ext`) that rewrites such a cell, only when its body has a top-level
`await`, into one line that awaits the guard itself; IPython then runs it as it runs any cell with
`await` (its loop runner in a terminal, the kernel's event loop in Jupyter), and the guard awaits the
body inside its meter, retries and clean-up.
"""
from __future__ import annotations

MAGIC = "%%oomguard"


def route(lines: list[str]) -> list[str]:
    """Input transformer: `%%oomguard ...` with a body that awaits -> `await <the guard>(line, body)`."""
    if not lines:
        return lines
    head = lines[0].strip()
    if not (head == MAGIC or head.startswith(MAGIC + " ")):
        return lines
    body = "".join(lines[1:])
    from cuda_magic.ipython import current_shell
    from cuda_magic.magics.cell import has_top_level_await

    shell = current_shell()
    if shell is None or not getattr(shell, "autoawait", False) or not has_top_level_await(shell, body):
        return lines
    line = head[len(MAGIC):].strip()
    return [f"await __import__('cuda_magic.magics.awaiting', fromlist=['guard']).guard({line!r}, {body!r})\n"]


async def guard(line: str, body: str):
    """What a routed cell awaits: `%%oomguard line` on `body`."""
    __tracebackhide__ = True  # noqa: F841
    from cuda_magic.ipython import current_shell
    from cuda_magic.magics.guard import GuardMagics

    shell = current_shell()
    magics = shell.magics_manager.registry.get(GuardMagics.__name__)
    return await magics.guard_cell_async(line, body)


def install(shell) -> None:
    cleanup = shell.input_transformers_cleanup
    if route not in cleanup:
        cleanup.append(route)


def uninstall(shell) -> None:
    cleanup = shell.input_transformers_cleanup
    while route in cleanup:
        cleanup.remove(route)
