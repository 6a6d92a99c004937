"""Uniform fake tensors: a FakeTensor known to hold one value everywhere, so that `.item()` / `bool()` of it
gives that value instead of a stand-in (`fakerun/fake_run.py`).

A fake tensor is uniform where it was made with one Python number (`torch.full`, `ones`, `zeros`, their
`_like` and `new_` forms, `fill_`, `zero_`), from a constant whose elements are all equal (FakeTensorMode's
`.constant`), or by an op whose result is known from uniform inputs: a pointwise op of uniform inputs and
Python numbers (computed on one real element), the absorbing cases where one uniform input decides the
result whatever the other holds (`x & False`, `x | True`, `x * 0` on integers and bools), a view or copy of
a uniform tensor, and `max/min/amax/amin/all/any/mean` of a non-empty uniform tensor.

transformers' generate loop (generation/utils.py, 4.57 to 5.24) ends on `unfinished_sequences.max() == 0`
where `unfinished_sequences = unfinished_sequences & ~stopping_criteria(...)`; MaxLengthCriteria
(generation/stopping_criteria.py) returns `torch.full((B,), cur_len >= max_length)`, so at the maximum
length `criteria` is uniform True (`x | True`), `~` of it False, `unfinished & False` 0, and the loop ends
where the real one ends at the latest (an end-of-sequence token is not known: never finished).

A record is (value, the tensor's version counter then): an in-place op on the tensor or on any view of it
bumps the counter (shared by views), so a stale record is never read. torch bumps it in the
ADInplaceOrView kernel, after the Python dispatch mode returns (checked on torch 2.2.2 and 2.13), hence
`version + 1` for an in-place op's record. A tensor without a version counter (an inference tensor, made
under `torch.inference_mode`) is not recorded.
"""
from __future__ import annotations

ATTR = "_cuda_magic_uniform"


def _version(t):
    try:
        return t._version
    except (RuntimeError, AttributeError):
        return None


def value_of(t):
    """The one value `t` holds everywhere, or None where it is not known."""
    record = getattr(t, ATTR, None)
    if record is not None:
        value, version = record
        if version == _version(t):
            return value
        return None
    return None


def _set(t, value, inplace: bool = False) -> None:
    version = _version(t)
    if version is None:
        return
    try:
        setattr(t, ATTR, (value, version + 1 if inplace else version))
    except (AttributeError, RuntimeError):
        pass


def _clear(t) -> None:
    if getattr(t, ATTR, None) is not None:
        try:
            delattr(t, ATTR)
        except AttributeError:
            pass


def _constant_value(t, disabled):
    """A fake tensor made from real data (torch.tensor(...)) keeps it as `.constant`: uniform where all its
    elements are equal. Read outside the modes (torch 2.2's fake mode would fake the read)."""
    known = getattr(t, "constant", None)
    if known is None or getattr(known, "is_meta", True):
        return None
    with disabled():
        if known.numel() == 0 or known.numel() > 64:
            return None
        flat = known.reshape(-1).tolist()
    return flat[0] if all(v == flat[0] for v in flat) else None


class Uniform:
    """Follows uniform values through the ops of a fake run: `after(func, args, kwargs, out)` once an op
    has run; `value(t)` reads one (None: not known)."""

    def __init__(self):
        import torch
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.utils._python_dispatch import _disable_current_modes

        self.torch, self.fake_type, self.disabled = torch, FakeTensor, _disable_current_modes
        aten = torch.ops.aten
        self.pointwise_tag = getattr(torch.Tag, "pointwise", None)
        self._kinds: dict = {}

        def ops(*names):
            out = set()
            for name in names:
                packet = getattr(aten, name, None)
                if packet is not None:
                    out.update(getattr(packet, o) for o in packet.overloads()
                               if "out" not in o and o not in ("other", "dim_max", "dim_min"))
            return out

        self.full = ops("full", "full_like", "new_full")
        self.fill = ops("fill_", "fill")
        self.ones = ops("ones", "ones_like", "new_ones")
        self.zeros = ops("zeros", "zeros_like", "new_zeros", "zero_", "zero")
        self.scalar = ops("scalar_tensor")
        self.same = ops("view", "_unsafe_view", "reshape", "expand", "slice", "select", "unsqueeze", "squeeze",
                        "t", "transpose", "permute", "clone", "alias", "detach", "lift_fresh", "contiguous",
                        "_to_copy", "to", "repeat", "flatten", "narrow", "unbind", "split", "chunk")
        self.copy = ops("copy_", "copy")
        self.reduce = ops("max", "min", "amax", "amin", "all", "any", "mean")
        self.bool_reduce = ops("all", "any")
        self.and_ = ops("bitwise_and", "bitwise_and_", "logical_and", "logical_and_")
        self.or_ = ops("bitwise_or", "bitwise_or_", "logical_or", "logical_or_")
        self.mul = ops("mul", "mul_")

    # -- reading ---------------------------------------------------------------------------------------
    def value(self, t):
        if not isinstance(t, self.torch.Tensor):
            return None
        v = value_of(t)
        if v is None and isinstance(t, self.fake_type):
            v = _constant_value(t, self.disabled)
        return v

    # -- following ---------------------------------------------------------------------------------------
    def _kind(self, func):
        kind = self._kinds.get(func)
        if kind is None:
            name = func._schema.name
            inplace = name.endswith("_") or any(a.alias_info is not None and a.alias_info.is_write
                                                for a in func._schema.arguments)
            if func in self.full or func in self.fill:
                kind = "fill"
            elif func in self.ones:
                kind = "one"
            elif func in self.zeros:
                kind = "zero"
            elif func in self.scalar:
                kind = "scalar"
            elif func in self.same:
                kind = "same"
            elif func in self.copy:
                kind = "copy"
            elif func in self.reduce:
                kind = "reduce"
            elif self.pointwise_tag is not None and self.pointwise_tag in func.tags:
                kind = "pointwise"
            else:
                kind = "other"
            kind = (kind, inplace)
            self._kinds[func] = kind
        return kind

    def after(self, func, args, kwargs, out) -> None:
        try:
            self._after(func, args, kwargs, out)
        except Exception:          # noqa: BLE001 - following values must never stop a fake run: not known
            for t in (out, args[0] if args else None):
                if isinstance(t, self.torch.Tensor):
                    _clear(t)

    def _after(self, func, args, kwargs, out) -> None:
        kind, inplace = self._kind(func)
        if kind == "other":      # (an in-place op's version bump makes the mutated tensor's record stale)
            return
        torch = self.torch
        target = args[0] if inplace and args and isinstance(args[0], torch.Tensor) else out
        if not isinstance(target, torch.Tensor):
            if kind == "same" and isinstance(out, (list, tuple)):   # unbind, split, chunk: each piece
                v = self.value(args[0]) if args else None
                if v is not None:
                    for piece in out:
                        if isinstance(piece, torch.Tensor):
                            _set(piece, _cast(v, piece.dtype))
            return
        value = self._result(kind, func, args, kwargs or {}, target)
        if value is not None:
            _set(target, _cast(value, target.dtype), inplace)
        elif inplace:
            _clear(target)

    def _result(self, kind, func, args, kwargs, out):
        if kind == "fill":
            v = kwargs.get("fill_value", kwargs.get("value", args[-1] if len(args) >= 2 else None))
            if isinstance(v, self.torch.Tensor):
                v = self.value(v)
            return v if isinstance(v, (bool, int, float)) else None
        if kind == "one":
            return 1
        if kind == "zero":
            return 0
        if kind == "scalar":
            v = args[0] if args else kwargs.get("s")
            return v if isinstance(v, (bool, int, float)) else None
        if kind == "same":
            return self.value(args[0]) if args else None
        if kind == "copy":               # copy_(self, src) / copy(self, src): src's value
            return self.value(args[1]) if len(args) >= 2 else None
        if kind == "reduce":
            source = args[0] if args else None
            if not isinstance(source, self.torch.Tensor) or source.numel() == 0:
                return None
            v = self.value(source)
            if v is None:
                return None
            return bool(v) if func in self.bool_reduce else v
        return self._pointwise(func, args, kwargs, out)

    def _pointwise(self, func, args, kwargs, out):
        torch = self.torch
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        tensors += [a for a in kwargs.values() if isinstance(a, torch.Tensor)]
        values = [self.value(a) for a in tensors]
        if values and all(v is not None for v in values):
            return self._compute(func, args, kwargs)
        # absorbing cases: one known input decides the result
        known = [v for v in values if v is not None]
        known += [a for a in args if isinstance(a, (bool, int)) and not isinstance(a, float)]
        if func in self.and_ and any(v is False or v == 0 for v in known if not isinstance(v, float)):
            return 0
        if func in self.or_ and out.dtype is torch.bool and any(v is True or (not isinstance(v, float) and v != 0)
                                                                for v in known):
            return True
        if (func in self.mul and not (out.dtype.is_floating_point or out.dtype.is_complex)
                and any(not isinstance(v, float) and v == 0 for v in known)):
            return 0
        return None

    def _compute(self, func, args, kwargs):
        """The op on one real element per uniform input (its dtype kept, 0-dim), outside the fake modes."""
        torch = self.torch

        def real(a):
            if isinstance(a, torch.Tensor):
                return torch.tensor(self.value(a), dtype=a.dtype)
            return a

        try:
            with self.disabled():
                result = func(*[real(a) for a in args], **{k: real(v) for k, v in kwargs.items()})
                if isinstance(result, torch.Tensor) and result.numel() == 1:
                    return result.item()
        except Exception:           # noqa: BLE001 - an op it cannot compute on one element: not known
            return None
        return None


def _cast(value, dtype):
    if dtype is None:
        return value
    if dtype.is_floating_point:
        return float(value)
    if dtype.is_complex:
        return complex(value)
    import torch

    if dtype is torch.bool:
        return bool(value)
    return int(value)
