"""The running IPython shell, found without importing IPython where nothing imported it yet (a plain
script never pays for IPython), and which of its names are the user's own."""
from __future__ import annotations

import re
import sys


def current_shell():
    """The running IPython shell, or None."""
    if "IPython" not in sys.modules:
        return None
    from IPython.core.getipython import get_ipython

    return get_ipython()


def cell_label(filename: str | None) -> str | None:
    """'In[3]' for a file IPython compiled a cell under (its CachingCompiler.format_code_name, IPython 8
    and later), else None."""
    shell = current_shell()
    name_of = getattr(getattr(shell, "compile", None), "format_code_name", None)
    if not filename or shell is None:
        return None
    if name_of is None:
        return _label_from_history(shell, filename)
    try:
        named = name_of(filename)
    except Exception:  # noqa: BLE001 - a label is a nicety; the file name is shown instead
        return None
    return named[1] if named else None


def _label_from_history(shell, filename: str) -> str | None:
    """IPython 7 names no cell files: find the input whose source the file holds (ipykernel caches each
    cell under a hash of its code), newest first."""
    import linecache

    entry = linecache.cache.get(filename)
    history = shell.user_ns.get("In") if isinstance(getattr(shell, "user_ns", None), dict) else None
    if not entry or not isinstance(history, list):
        return None
    source = "".join(entry[2]).rstrip()
    for n in range(len(history) - 1, 0, -1):
        if str(history[n]).rstrip() == source:
            return f"In[{n}]"
    return None


def shell_or_current(shell):
    """`shell` itself, or the running one where None was given."""
    return shell if shell is not None else current_shell()


# -- the output cache and the user's own variables ---------------------------------------------------
# IPython pushes its own names (`_`, `_7`, `_i7`, `In`, `Out`, ...) into user_ns and, with the same
# values, into user_ns_hidden. A name the user assigned afterwards holds another value: it is the user's,
# whatever it looks like. This is the one rule for "is it the notebook's or the user's" (the census
# names by it, `%freecuda` deletes by it).

_OUT_NAME = re.compile(r"_([0-9]+)")
UNDERSCORES = ("_", "__", "___")


def output_hist(shell) -> dict:
    """The output cache {execution count: value} (`Out`)."""
    hm = getattr(shell, "history_manager", None)
    hist = getattr(hm, "output_hist", None)
    if isinstance(hist, dict):
        return hist
    out = getattr(shell, "user_ns", {}).get("Out")
    return out if isinstance(out, dict) else {}


def output_cache_number(name: str) -> int | None:
    """7 for '_7' (a name shaped like an output-cache entry), else None."""
    match = _OUT_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def is_output_cache_name(shell, name: str, value) -> bool:
    """Whether user_ns[name] is the output-cache entry (`_`, `__`, `___`, `_N`), not a user's variable
    of the same name."""
    if name in UNDERSCORES:
        return value is getattr(getattr(shell, "displayhook", None), name, object())
    n = output_cache_number(name)
    if n is None:
        return False
    hist = output_hist(shell)
    if n in hist and hist[n] is value:
        return True
    hidden = getattr(shell, "user_ns_hidden", None) or {}
    return name in hidden and hidden[name] is value


def user_variables(shell) -> dict:
    """The user's variables: user_ns less what IPython put there itself (its hidden names while they
    still hold IPython's value, the output cache) and dunder names. Without a shell: __main__'s."""
    if shell is None:
        main = sys.modules.get("__main__")
        ns = dict(vars(main)) if main is not None else {}
        return {k: v for k, v in ns.items() if not (k.startswith("__") and k.endswith("__"))}
    hidden = getattr(shell, "user_ns_hidden", None) or {}
    found = {}
    for name, value in list(shell.user_ns.items()):
        if name.startswith("__") and name.endswith("__"):
            continue
        if name in hidden and hidden[name] is value:
            continue
        if name[:1] == "_" and is_output_cache_name(shell, name, value):
            continue
        found[name] = value
    return found
