"""What an op's schema says, read once per op, and the one key of an op's call by its arguments' metadata.

Two caches remember what an op makes by its call's key: the simulated device the bytes of an op's fresh
outputs (devices/simulated.py: the meta pass runs once per key, not once per call), and the fake run the
outputs themselves (fakerun/op_cache.py: repeated ops skip FakeTensorMode). Both key a call here, on what
its meta kernel reads of the arguments (a tensor's sizes, strides, offset, dtype, device, layout and
whether it requires grad; every other argument as it is) and the state below autograd that changes an
output's metadata without being an argument (the default dtype of a factory op, inference mode); and
both read an op's schema from `op_facts`, the one table of it.

torch is never imported here: a call is keyed only where torch already runs it.
"""
from __future__ import annotations

import sys
from typing import NamedTuple

_FACTS: dict = {}        # op -> OpFacts: every op's schema read once, for every reader
# alias-returning ops whose output is not a plain view of the first argument's storage: a tensor lifted
# into a mode (the simulated device counts it as new), or one whose result depends on more than metadata
_NOT_VIEWS = frozenset({"aten::lift_fresh", "aten::lift_fresh_copy", "aten::set_", "aten::alias_copy"})
# a tensor over a storage made outside the dispatcher: a tensor literal's data, lifted; a storage that
# copy.deepcopy, torch.load or UntypedStorage(n) made, wrapped by set_ (counted as new where it appears)
_LIFTED = frozenset({("aten::lift_fresh", ""), ("aten::lift_fresh_copy", ""), ("aten::set_", "source_Storage"),
                     ("aten::set_", "source_Storage_storage_offset")})


class OpFacts(NamedTuple):
    """What one op's schema says, for counting its outputs and for caching them."""

    fresh: tuple            # per return: a new storage (no alias)
    any_fresh: bool         # some return is fresh: an op that makes storage
    has_device: bool        # it takes a `device` argument (a factory op)
    lifted: bool            # it wraps a storage made outside the dispatcher (lift_fresh, set_ with a storage)
    views: bool             # every return an alias that is not written (view, t, detach, expand): makes nothing
    cacheable: bool         # its outputs follow from its arguments' metadata: every return fresh (no alias
                            # in or out) or every return a view of the first argument, no random seed,
                            # only tensors returned
    writes_first: bool      # in-place on its first argument only, returning it or nothing, no metadata change


def op_facts(func) -> OpFacts:
    """The facts of `func`'s schema (an OpOverload), read on its first call."""
    facts = _FACTS.get(func)
    if facts is None:
        facts = _FACTS[func] = _read(func)
    return facts


def _read(func) -> OpFacts:
    torch = sys.modules["torch"]
    schema = func._schema
    returns, arguments, name = schema.returns, schema.arguments, schema.name
    fresh = tuple(r.alias_info is None for r in returns)
    views = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
    lifted = (name, schema.overload_name) in _LIFTED
    seeded = getattr(torch.Tag, "nondeterministic_seeded", None)
    all_fresh = all(fresh) and all(a.alias_info is None for a in arguments)
    view_of_first = (bool(arguments) and arguments[0].alias_info is not None
                     and not arguments[0].alias_info.is_write
                     and all(a.alias_info is None for a in arguments[1:])
                     and views and name not in _NOT_VIEWS)
    cacheable = (bool(returns) and (all_fresh or view_of_first)
                 and (seeded is None or seeded not in func.tags)
                 and all(str(r.type) in ("Tensor", "Tensor[]", "List[Tensor]") for r in returns))
    first = arguments[0].alias_info if arguments else None
    inplace_view = getattr(torch.Tag, "inplace_view", None)
    writes_first = (first is not None and first.is_write
                    and not any(a.alias_info is not None and a.alias_info.is_write for a in arguments[1:])
                    and not any(getattr(a, "is_out", False) for a in arguments)
                    and (not returns or (len(returns) == 1 and returns[0].alias_info is not None
                                         and returns[0].alias_info.is_write
                                         and str(returns[0].type) == str(arguments[0].type)))
                    and (inplace_view is None or inplace_view not in func.tags)
                    and "resize" not in name and name not in ("aten::set_", "aten::detach_", "aten::swap_tensors"))
    return OpFacts(fresh, any(fresh), any(a.name == "device" for a in arguments), lifted, views, cacheable,
                   writes_first)


def arg_key(x, check=None):
    """The metadata of an argument (a tensor, a list, tuple or dict of them, anything hashable) as the key
    has it; check(tensor) as for `call_key`."""
    if isinstance(x, sys.modules["torch"].Tensor):
        if check is not None:
            check(x)
        return (x.shape, x.stride(), x.storage_offset(), x.dtype, x.device, x.layout, x.requires_grad)
    if isinstance(x, (list, tuple)):
        return (type(x), *(arg_key(v, check) for v in x))
    if isinstance(x, dict):
        return (dict, *((k, arg_key(v, check)) for k, v in x.items()))
    hash(x)                         # unhashable: not keyed (TypeError)
    return x


def call_key(func, args, kwargs, *, check=None, floats_by_type: bool = False):
    """The key of a call of `func`: hashable, equal for calls whose outputs' metadata are equal.

    check(tensor): raises where a tensor argument must not be keyed. floats_by_type: a float argument
    (at the top level) keys by its type, not its value (an optimizer's step size changes every step; a
    float's value changes what an in-place op writes, never its outputs' metadata). Raises TypeError (an
    unhashable argument), RuntimeError or NotImplementedError (a tensor without strides: sparse) where the
    call cannot be keyed, and whatever `check` raises."""
    torch = sys.modules["torch"]
    if floats_by_type:
        def top(x):
            return float if type(x) is float else arg_key(x, check)
    else:
        def top(x):
            return arg_key(x, check)
    key = (func, tuple(map(top, args)), tuple((k, top(v)) for k, v in kwargs.items()) if kwargs else (),
           torch.get_default_dtype(), torch.is_inference_mode_enabled())
    hash(key)
    return key
