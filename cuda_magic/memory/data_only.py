"""Whether a plain container's subtree holds only data (atoms and plain containers): no tensor, module or
object with attributes for the census's namespace walk to name, so the walk can skip it. The work is done
in C where it can be (filter, map, gc.get_referents), a long level part by part.
"""
from __future__ import annotations

import gc
import types
from itertools import chain

ATOMIC = frozenset({int, float, complex, bool, str, bytes, bytearray, type(None), range, slice,
                    type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                    types.ModuleType, types.CodeType, property, staticmethod, classmethod,
                    type(Ellipsis), memoryview})
PART = 2048                # objects per part of a level that holds_only_data follows down at once
# The exact container types whose items the probe follows: a subtree of these and atoms holds no tensor.
SEQUENCES = frozenset({list, tuple, set, frozenset})
DICT = frozenset({dict})
PLAIN = SEQUENCES | DICT
ATOMIC_OR_PLAIN = ATOMIC | PLAIN


def holds_only_data(level: list, kinds: set, levels: int) -> bool:
    """Whether a plain container's subtree, `levels` levels down, has only atoms and plain containers.

    `level` is the container's items that the garbage collector tracks (or a part of them), `kinds` their
    types (or more). Untracked objects are atoms, or tuples and dicts holding only atoms (that is when
    CPython untracks them); a tensor is always tracked. A subtree of atoms and plain containers has no
    tensor, module or object with attributes for the walk to name, so the walk skips it. Breadth first,
    one level at a time, the work done in C (chain, filter, set(map(type, ...))): a list of a million
    rows costs milliseconds instead of a million Python calls. A long level is taken in parts of PART
    objects, each followed down before the next: the passes over a part's subtree (its items, their
    types, their items) then find it in the CPU's cache, where whole levels of a large heap would not.
    """
    try:
        return _only_data(level, kinds, levels)
    except RuntimeError:   # another thread changed a dict or set meanwhile: let the walk decide
        return False


def _only_data(level, kinds: set, levels: int) -> bool:
    if levels < 1 or not level:
        return True
    if not kinds <= ATOMIC_OR_PLAIN:
        return False
    if not kinds <= PLAIN:   # functions, classes, modules: atomic to the walk, not followed
        level = [o for o in level if type(o) in PLAIN]
        kinds = kinds & PLAIN
    if levels == 1:
        return True           # the walk would look no deeper
    for start in range(0, len(level), PART):
        part = level[start:start + PART] if len(level) > PART else level
        if kinds <= SEQUENCES:
            items = gc.get_referents(*part)   # exactly their items; faster than chaining them
        elif kinds == DICT:
            # The walk names values, not keys. get_referents gives the values, and the keys of a dict
            # not keyed by strings alone: more than the values, so where that holds only data, so do
            # the values; otherwise the values alone decide.
            below = list(filter(gc.is_tracked, gc.get_referents(*part)))
            if _only_data(below, set(map(type, below)), levels - 1):
                continue
            items = chain.from_iterable(map(dict.values, part))
        else:
            items = chain.from_iterable(o.values() if type(o) is dict else o for o in part)
        below = list(filter(gc.is_tracked, items))
        if not _only_data(below, set(map(type, below)), levels - 1):
            return False
    return True


def parts_hold_only_data(seq, levels: int) -> bool:
    """holds_only_data for a long list or tuple, part by part, each part's types read with its subtree."""
    for start in range(0, len(seq), PART):
        part = seq[start:start + PART]
        kinds = set(map(type, part))
        if not kinds <= PLAIN:
            part = list(filter(gc.is_tracked, part))
            kinds = set(map(type, part))
        if not holds_only_data(part, kinds, levels):
            return False
    return True
