"""The sizes of an op's fresh outputs, remembered by its arguments' metadata, so that a fake run's repeated
ops (a training step repeats the same ops on the same shapes) skip torch's FakeTensorMode.

FakeTensorMode (torch/_subclasses/fake_tensor.py) caches too, from 2.3 on, but its key (`_cache_key`,
`_prep_args_for_hash`, a `TensorMetadata` of twenty fields for every tensor argument) costs more than the
rest of a fake op; torch 2.2 has no cache at all. This one keys an op on what its meta kernel reads of its
arguments (a tensor's sizes, strides, offset, dtype, layout and device; every other argument as it is) and
the state that can change an output's metadata below autograd (the default dtype, inference mode), and
makes each output as FakeTensorMode's own cache does (`_get_output_tensor_from_cache_entry`: an
`empty_strided` on the meta device, wrapped in a FakeTensor of the fake device). What a key gives follows
from the key alone, so the fake runs of a process share the entries.

An in-place op that writes only its first argument and returns it (or nothing: the `_foreach_*_` ops)
changes no metadata (the ops that do, `resize_`, `set_` and those tagged `inplace_view`, are left out),
so once it ran cleanly on a key it gives its first argument back at once, as FakeTensorMode's own cache
does for in-place ops (`_get_output_tensor_from_cache_entry`: `args[entry.inplace_idx]`, 2.3 to 2.13).
Its key takes a float argument's type, not its value (an optimizer's step size changes every step; a
float's value changes what an in-place op writes, never what it checks or the tensor's metadata).

Ops are kept where the op takes no random seed (`nondeterministic_seeded`) and either every return is
fresh and no argument is an alias (no in-place, no out=), or every return is a view of its first argument,
which nothing writes (view, t, transpose, slice, expand, split: the views are most of a transformer's
ops). An entry is kept only where the op ran cleanly once and each output was a dense, plain FakeTensor,
with no constant value, either of a storage of its own, exactly the size `empty_strided` makes, or of the
first argument's storage (`_unsafe_view`, whose schema says fresh, too); every argument must be a fake
tensor of the run's mode (a real tensor is converted by FakeTensorMode, which must see it). A view is
made again as FakeTensorMode's cache makes one (`_get_output_tensor_from_cache_entry`, 2.3 to 2.13): an
`empty_strided` on the meta device set onto the first argument's storage at the output's offset, sizes
and strides, wrapped in a FakeTensor of the fake device; autograd's view bookkeeping (ADInplaceOrView)
runs above the fake run's modes on what they return, as for FakeTensorMode's own output.
"""
from __future__ import annotations

MAX_ENTRIES = 20_000           # keys kept (every fake run of the process shares them); past this: anew
_NO = object()                 # the key is known not to be kept
_ENTRIES: dict = {}            # key -> (the container of several outputs or None, each output's metadata,
                               # whether any is a view of the first argument)
_OPS: dict = {}                # op -> whether its kind may be kept
_IN_PLACE: dict = {}           # op -> whether it writes only its first argument, metadata unchanged
_DONE = True                   # an in-place key that ran cleanly
# alias-returning ops whose output is not a plain view of the first argument's storage: a tensor lifted
# into the fake mode (devices/simulated.py counts it as new), or one whose result depends on more than
# metadata
_NOT_VIEWS = frozenset({"aten::lift_fresh", "aten::lift_fresh_copy", "aten::set_", "aten::alias_copy"})


class OpCache:
    def __init__(self, fake_mode):
        import torch
        from torch._subclasses.fake_tensor import FakeTensor

        self.torch, self.fake_type, self.mode = torch, FakeTensor, fake_mode
        self.tensor_type = torch.Tensor
        self.strided = torch.strided
        self.meta = torch.device("meta")
        self.no_dispatch = torch._C._DisableTorchDispatch
        seeded = getattr(torch.Tag, "nondeterministic_seeded", None)
        self._seeded = seeded
        self._ops = _OPS
        self._in_place = _IN_PLACE
        self._inplace_view = getattr(torch.Tag, "inplace_view", None)
        self.entries = _ENTRIES          # an output's metadata follows from the key alone: shared by runs
        self.hits = self.misses = 0

    # -- which ops --------------------------------------------------------------------------------------
    def keeps(self, func) -> bool:
        ok = self._ops.get(func)
        if ok is None:
            schema = func._schema
            returns, arguments = schema.returns, schema.arguments
            fresh = (all(r.alias_info is None for r in returns)
                     and all(a.alias_info is None for a in arguments))
            view = (bool(arguments) and arguments[0].alias_info is not None
                    and not arguments[0].alias_info.is_write
                    and all(a.alias_info is None for a in arguments[1:])
                    and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
                    and schema.name not in _NOT_VIEWS)
            ok = (bool(returns) and (fresh or view)
                  and (self._seeded is None or self._seeded not in func.tags)
                  and all(str(r.type) in ("Tensor", "Tensor[]", "List[Tensor]") for r in returns))
            self._ops[func] = ok
        return ok

    def writes_first(self, func) -> bool:
        """An in-place op that writes its first argument only, and returns it or nothing."""
        ok = self._in_place.get(func)
        if ok is None:
            schema = func._schema
            arguments, returns = schema.arguments, schema.returns
            first = arguments[0].alias_info if arguments else None
            name = schema.name
            ok = (first is not None and first.is_write
                  and not any(a.alias_info is not None and a.alias_info.is_write for a in arguments[1:])
                  and not any(getattr(a, "is_out", False) for a in arguments)
                  and (not returns or (len(returns) == 1 and returns[0].alias_info is not None
                                       and returns[0].alias_info.is_write
                                       and str(returns[0].type) == str(arguments[0].type)))
                  and (self._inplace_view is None or self._inplace_view not in func.tags)
                  and "resize" not in name and name not in ("aten::set_", "aten::detach_", "aten::swap_tensors"))
            self._in_place[func] = ok
        return ok

    def in_place_key(self, func, args, kwargs):
        """The key of an in-place call (floats by type), or None where it cannot be kept."""
        torch = self.torch
        try:
            key = (func, tuple(self._loose(a) for a in args),
                   tuple((k, self._loose(v)) for k, v in kwargs.items()) if kwargs else (),
                   torch.get_default_dtype(), torch.is_inference_mode_enabled())
            hash(key)
        except (_Skip, TypeError, RuntimeError, NotImplementedError, AttributeError):
            return None
        return key

    def ran_in_place(self, key) -> bool:
        done = self.entries.get(key) is _DONE
        if done:
            self.hits += 1
        return done

    def remember_in_place(self, key, args, out) -> None:
        """Keep an in-place call that gave its first argument back with its metadata as before."""
        self.misses += 1
        first = args[0]
        if out is not None and out is not first:
            return
        if isinstance(first, self.tensor_type) and self._arg(first) != key[1][0]:
            return
        if len(self.entries) >= MAX_ENTRIES:
            self.entries.clear()
        self.entries[key] = _DONE

    # -- the key ----------------------------------------------------------------------------------------
    def _loose(self, x):
        return float if type(x) is float else self._arg(x)

    def _arg(self, x):
        if isinstance(x, self.tensor_type):
            if type(x) is not self.fake_type or x.fake_mode is not self.mode or x.constant is not None:
                raise _Skip
            dtype = x.dtype
            if dtype.is_complex or x.layout is not self.strided:
                raise _Skip
            return (x.shape, x.stride(), x.storage_offset(), dtype, x.fake_device, x.requires_grad)
        if isinstance(x, (list, tuple)):
            return (type(x), *map(self._arg, x))
        if isinstance(x, dict):
            return (dict, *((k, self._arg(v)) for k, v in x.items()))
        hash(x)                         # unhashable: not kept (TypeError)
        return x

    def key(self, func, args, kwargs):
        """The key of this call, or None where it cannot be kept."""
        torch = self.torch
        try:
            key = (func, self._arg(args), self._arg(kwargs) if kwargs else (), torch.get_default_dtype(),
                   torch.is_inference_mode_enabled())
            hash(key)
        except (_Skip, TypeError, RuntimeError, NotImplementedError, AttributeError):
            return None
        return key

    # -- entries ----------------------------------------------------------------------------------------
    def outputs(self, key, args=()):
        """New fake outputs for a kept key (views of `args[0]`'s storage where the op made views), or None
        where it has none (yet, or ever)."""
        entry = self.entries.get(key)
        if entry is None or entry is _NO:
            return None
        many, metas, views = entry
        storage = args[0].untyped_storage() if views else None
        try:
            made = [self._make(m, storage) for m in metas]
        except RuntimeError:            # the storage cannot hold the view (as_strided past its end):
            return None                 # FakeTensorMode says so
        self.hits += 1
        if many is None:
            return made[0]
        return many(made)

    def _make(self, meta, storage):
        shape, stride, offset, dtype, device, requires_grad, view = meta
        with self.no_dispatch():
            empty = self.torch.empty_strided(shape, stride, dtype=dtype, device=self.meta,
                                             requires_grad=requires_grad)
            if view:
                empty.set_(storage, offset, shape, stride)
        return self.fake_type(self.mode, empty, device)

    def remember(self, key, args, kwargs, out) -> None:
        """Keep what the op made (`out`), where it can be made again as it was."""
        self.misses += 1
        if len(self.entries) >= MAX_ENTRIES:
            self.entries.clear()
        self.entries[key] = self._entry(args, kwargs, out)

    def _entry(self, args, kwargs, out):
        torch = self.torch
        many = None
        outs = (out,)
        if isinstance(out, (tuple, list)):
            many, outs = type(out), tuple(out)
        if not outs:
            return _NO
        arg_tensors = _tensors(args, self.tensor_type)
        seen = {a.untyped_storage()._cdata for a in arg_tensors + _tensors(kwargs, self.tensor_type)}
        inputs = {id(a) for a in arg_tensors}
        first = args[0] if args and type(args[0]) is self.fake_type else None
        base = first.untyped_storage()._cdata if first is not None else None
        metas = []
        for t in outs:
            if (type(t) is not self.fake_type or t.fake_mode is not self.mode or t.constant is not None
                    or t.layout is not torch.strided or t.dtype.is_complex
                    or t.is_conj() or t.is_neg() or id(t) in inputs):
                return _NO
            storage = t.untyped_storage()
            view = storage._cdata == base and base is not None
            if not view:
                if storage._cdata in seen or t.storage_offset() != 0:   # another input's storage, or an
                    return _NO                                          # output's, or part of one
                seen.add(storage._cdata)
            meta = (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.fake_device, t.requires_grad,
                    view)
            if not view:
                with self.no_dispatch():
                    probe = torch.empty_strided(meta[0], meta[1], dtype=meta[3], device=self.meta)
                if probe.untyped_storage().nbytes() != storage.nbytes():
                    return _NO
            metas.append(meta)
        return many, tuple(metas), any(m[-1] for m in metas)


class _Skip(Exception):
    pass


def _tensors(x, tensor_type) -> list:
    if isinstance(x, tensor_type):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v, tensor_type)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v, tensor_type)]
    return []
