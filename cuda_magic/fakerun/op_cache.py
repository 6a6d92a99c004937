"""The sizes of an op's fresh outputs, remembered by its arguments' metadata, so that a fake run's repeated
ops (a training step repeats the same ops on the same shapes) skip torch's FakeTensorMode.

FakeTensorMode (torch/_subclasses/fake_tensor.py) caches too, from 2.3 on, but its key (`_cache_key`,
`_prep_args_for_hash`, a `TensorMetadata` of twenty fields for every tensor argument) costs more than the rest
of a fake op; torch 2.2 has no cache at all. This one keys a call as the simulated device's count does
(devices/op_metadata.py's `call_key`: what its meta kernel reads of its arguments, and the state that can
change an output's metadata below autograd, the default dtype and inference mode), reads an op's schema from
the same table (`op_facts`), and makes each output as FakeTensorMode's own cache does
(`_get_output_tensor_from_cache_entry`: an `empty_strided` on the meta device, wrapped in a FakeTensor of the
fake device). What a key gives follows from the key alone, so the fake runs of a process share the entries.

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

from cuda_magic.devices.op_metadata import arg_key, call_key, op_facts

MAX_ENTRIES = 20_000           # keys kept (every fake run of the process shares them); past this: anew
_NO = object()                 # the key is known not to be kept
_ENTRIES: dict = {}            # key -> (the container of several outputs or None, each output's metadata,
                               # whether any is a view of the first argument)
_DONE = True                   # an in-place key that ran cleanly


class OpCache:
    def __init__(self, fake_mode):
        import torch
        from torch._subclasses.fake_tensor import FakeTensor

        self.torch, self.fake_type, self.mode = torch, FakeTensor, fake_mode
        self.tensor_type = torch.Tensor
        self.strided = torch.strided
        self.meta = torch.device("meta")
        self.no_dispatch = torch._C._DisableTorchDispatch
        self.entries = _ENTRIES          # an output's metadata follows from the key alone: shared by runs
        self.hits = self.misses = 0

    # -- which ops (devices/op_metadata.py's OpFacts) ---------------------------------------------------
    def keeps(self, func) -> bool:
        """An op whose outputs follow from its arguments' metadata (fresh, or views of its first argument)."""
        return op_facts(func).cacheable

    def writes_first(self, func) -> bool:
        """An in-place op that writes its first argument only, and returns it or nothing."""
        return op_facts(func).writes_first

    def in_place_key(self, func, args, kwargs):
        """The key of an in-place call (floats by type), or None where it cannot be kept."""
        try:
            key = call_key(func, args, kwargs, check=self._check, floats_by_type=True)
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
        if isinstance(first, self.tensor_type) and arg_key(first) != key[1][0]:
            return
        if len(self.entries) >= MAX_ENTRIES:
            self.entries.clear()
        self.entries[key] = _DONE

    # -- the key (devices/op_metadata.py's call_key), for this run's fake tensors only -------------------
    def _check(self, x) -> None:
        if type(x) is not self.fake_type or x.fake_mode is not self.mode or x.constant is not None:
            raise _Skip
        if x.dtype.is_complex or x.layout is not self.strided:
            raise _Skip

    def key(self, func, args, kwargs):
        """The key of this call, or None where it cannot be kept."""
        try:
            return call_key(func, args, kwargs, check=self._check)
        except (_Skip, TypeError, RuntimeError, NotImplementedError, AttributeError):
            return None

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
