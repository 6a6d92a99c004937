"""The user's containers a run may grow (logged losses, collected outputs): their lengths before it.

Only the names the run's code reaches are read (the cell's names, and the globals of the functions those
name, followed through their code), so the cost follows the code, not the size of the namespace.
"""
from __future__ import annotations

import types

_FOLLOWED = 2_000     # code objects followed at most (a cell naming a large library stays cheap)
_MISSING = object()


def reached_names(namespace, source: str = "", codes=()) -> set[str]:
    """The names `source` and the code objects `codes` read, with the globals of every function they
    name in `namespace`, followed through those functions' own code (nested functions and lambdas too)."""
    from cuda_magic.oom.cell_reading import names_in

    names = set(names_in(source)) if source else set()
    pending = list(codes)
    for name in list(names):
        pending.extend(_code_of(namespace.get(name)))
    seen: set[int] = set()
    while pending and len(seen) < _FOLLOWED:
        code = pending.pop()
        if id(code) in seen:
            continue
        seen.add(id(code))
        for name in code.co_names:
            if name not in names:
                names.add(name)
                pending.extend(_code_of(namespace.get(name)))
        pending.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return names


def _code_of(value) -> list:
    """The code objects a name's value runs when called: a function's, a bound method's. Asked of the exact
    type only: a user's value is never asked an attribute (a dead weak proxy raises on any)."""
    if type(value) is types.MethodType:
        value = value.__func__
    return [value.__code__] if type(value) is types.FunctionType else []


def container_lengths(shell, names=None) -> dict[str, tuple[int, int]]:
    """(id, length) of the lists, dicts, sets and deques among the user's names (only `names`, where
    given), where there is a shell: what grows during a run is then known."""
    if shell is None:
        return {}
    from cuda_magic.ipython import is_output_cache_name, user_variables

    if names is None:
        return {n: (id(v), container_length(v)) for n, v in user_variables(shell).items() if container_length(v) is not None}
    namespace = shell.user_ns
    hidden = getattr(shell, "user_ns_hidden", None) or {}
    found = {}
    for name in names:
        value = namespace.get(name, _MISSING)
        length = container_length(value)
        if length is None or (name.startswith("__") and name.endswith("__")):
            continue
        if (name in hidden and hidden[name] is value) or (name[:1] == "_" and is_output_cache_name(shell, name, value)):
            continue
        found[name] = (id(value), length)
    return found


def value_ids(shell, names=None) -> dict[str, int] | None:
    """The id of each user name's value (only `names`, where given; None without a shell): at a failure,
    which names the run bound."""
    if shell is None:
        return None
    from cuda_magic.ipython import user_variables

    if names is None:
        return {n: id(v) for n, v in user_variables(shell).items()}
    namespace = shell.user_ns
    return {n: id(namespace[n]) for n in names if n in namespace}


def container_length(value) -> int | None:
    """The length of a list, dict, set or deque; None for anything else."""
    if type(value) in (list, dict, set) or type(value).__name__ == "deque":
        return len(value)
    return None
