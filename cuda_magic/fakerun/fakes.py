"""Fake copies of what a cell trains: the namespace's modules, optimizers, schedulers and gradient scalers,
and the objects that hold a module or an optimizer directly (a Trainer, a Learner), made in one deep copy
under torch's FakeCopyMode so that their tensors become FakeTensors (sizes, no storage) and what they
share stays shared: the copied optimizer steps the copied parameters.

torch/_subclasses/fake_tensor.py (2.2 to 2.13): `FakeCopyMode(fake_mode)` is a TorchFunctionMode that
turns `Tensor.__deepcopy__` and `Tensor.clone` (which `Parameter.__deepcopy__` calls) into
`fake_mode.from_tensor(t, static_shapes=True)`, memoised by the deep copy's memo; the real tensors are
only read for their metadata.
"""
from __future__ import annotations

import copy

from cuda_magic.fakerun.fake_device import GRADIENTS, OPTIMIZER, PARAMETERS, REST


def _trained_types():
    import torch

    types = [torch.nn.Module, torch.optim.Optimizer]
    scheduler = getattr(torch.optim.lr_scheduler, "LRScheduler", None) or getattr(
        torch.optim.lr_scheduler, "_LRScheduler", None)
    if scheduler is not None:
        types.append(scheduler)
    for where in (getattr(torch, "amp", None), getattr(torch.cuda, "amp", None)):
        scaler = getattr(where, "GradScaler", None)
        if isinstance(scaler, type):
            types.append(scaler)
    return tuple(types)


def _holds(value, trained) -> bool:
    """An object that holds a module or an optimizer as one of its attributes (one level)."""
    attrs = getattr(value, "__dict__", None)
    if not isinstance(attrs, dict) or isinstance(value, type):
        return False
    return any(isinstance(v, trained) for v in list(attrs.values())[:200])


def to_copy(items) -> list[tuple[str, object]]:
    """(name, value) of the values to copy among `items`: modules, optimizers, schedulers, scalers, their
    holders, and lists, tuples and dicts of them."""
    trained = _trained_types()
    out = []
    for name, value in items:
        if isinstance(value, trained) or _holds(value, trained):
            out.append((name, value))
        elif type(value) in (list, tuple) and value and any(isinstance(v, trained) for v in value[:50]):
            out.append((name, value))
        elif type(value) is dict and value and any(isinstance(v, trained) for v in list(value.values())[:50]):
            out.append((name, value))
    return out


class FakeCopies:
    """The fake copies of `items` ((name, value) pairs), made with `fake_mode`. `copies[name]` is the copy;
    `held(device, tally)` counts their storages on the fake device and labels them; `notes` says what
    could not be copied (it then runs on the real object, its state not stepped in the prediction)."""

    def __init__(self, items, fake_mode):
        import torch
        from torch._subclasses.fake_tensor import FakeCopyMode

        self.copies: dict[str, object] = {}
        self.notes: list[str] = []
        self.real_storages: dict[int, int] = {}     # real storage key -> bytes, of every tensor copied
        names = [n for n, _ in items]
        values = [v for _, v in items]
        memo: dict = {}
        with FakeCopyMode(fake_mode):
            try:
                copied = copy.deepcopy(values, memo)
            except Exception as exc:            # one of them cannot be deep-copied: copy one by one
                copied = []
                for name, value in items:
                    try:
                        copied.append(copy.deepcopy(value, memo))
                    except Exception as one:
                        copied.append(value)
                        shown = name[-1] if isinstance(name, tuple) else name
                        self.notes.append(f"{shown} could not be copied as fakes ({type(one).__name__}: {one}); "
                                          "the prediction uses it as it is")
                del exc
        for name, value, fake in zip(names, values, copied):
            if fake is not value:
                self.copies[name] = fake
        self._memo = memo
        self._grads = []
        # Parameter.__deepcopy__ copies the data, not `.grad`: the gradients the real parameters hold now
        # get fake copies too, so that a cell that sets them to None frees them as on the device
        for real, fake in list(self.pairs()):
            grad = getattr(real, "grad", None)
            if grad is not None and isinstance(fake, torch.Tensor) and fake.grad is None:
                try:
                    # a fresh fake, not from_tensor: torch 2.2's converter memo (FakeTensorConverter.
                    # tensor_memo, real -> fake) keeps a converted fake alive while the real gradient
                    # lives, so the cell's zero_grad(set_to_none=True) would not free its copy
                    with fake_mode:
                        fake.grad = torch.empty_strided(grad.shape, grad.stride(), dtype=grad.dtype,
                                                        device=grad.device)
                except Exception:                  # noqa: BLE001 - a gradient it cannot copy stays real
                    continue
                self._grads.append((grad, fake.grad))

    def pairs(self):
        """(real tensor, its fake copy) for every tensor copied: the deep copy's memo keeps the originals
        alive under id(memo) (copy._keep_alive) and maps id(original) to the copy."""
        import torch

        memo = self._memo
        for original in memo.get(id(memo), []):
            if isinstance(original, torch.Tensor):
                fake = memo.get(id(original))
                if isinstance(fake, torch.Tensor):
                    yield original, fake
        yield from getattr(self, "_grads", ())

    def real_bytes(self, counts) -> int:
        """Bytes of the real storages the copies stand for, where the metered device counts them
        (`counts(tensor)`), each storage once."""
        seen: dict[int, int] = {}
        for real, _ in self.pairs():
            if real.is_meta:
                continue
            try:
                storage = real.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if storage._cdata not in seen and counts(real):
                seen[storage._cdata] = storage.nbytes()
        return sum(seen.values())

    def hold(self, fake_device, counts) -> None:
        """Count on the fake device the copies of the real storages the metered device counts now
        (`counts(real tensor)`): a copy of a tensor the device does not hold (a model still in host memory)
        counts only once the cell moves it there (a fresh storage)."""
        self.values = {}
        for real, fake in self.pairs():
            if not real.is_meta and real.numel() == 1:
                self.values[id(fake)] = real.item()     # `.item()` on the copy: the real value
            if not real.is_meta and counts(real):
                fake_device.hold(fake, real)
        # the memo would keep every fake copy alive (a gradient set to None must free its storage)
        self._memo, self._grads = {}, []

    def label(self, tally) -> None:
        """Label the held copies: parameters, their gradients, the optimizers' state; the rest (buffers,
        other tensors) stays the rest."""
        import torch

        for obj in self.objects():
            if isinstance(obj, torch.nn.Module):
                for p in obj.parameters():
                    tally.label_tensor(p, PARAMETERS)
                    if p.grad is not None:
                        tally.label_tensor(p.grad, GRADIENTS)
            elif isinstance(obj, torch.optim.Optimizer):
                for state in obj.state.values():
                    for v in state.values():
                        if isinstance(v, torch.Tensor):
                            tally.label_tensor(v, OPTIMIZER)

    def objects(self):
        for fake in self.copies.values():
            yield from _objects_in(fake)

    def modules(self):
        import torch

        for obj in self.objects():
            if isinstance(obj, torch.nn.Module):
                yield obj


def _objects_in(value):
    """The value, its items (list, tuple, dict) and, for a holder, its attributes: one level."""
    yield value
    if type(value) in (list, tuple):
        yield from value
    elif type(value) is dict:
        yield from value.values()
    else:
        attrs = getattr(value, "__dict__", None)
        if isinstance(attrs, dict) and not _is_torch(value):
            yield from list(attrs.values())


def _is_torch(value) -> bool:
    return type(value).__module__.startswith("torch.")
