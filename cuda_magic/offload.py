"""Moving what a variable holds to the CPU, keeping the data: `%freecuda NAME --offload`.

Modules move in place (their parameters keep their identity, so an optimizer keyed by them still
works); optimizer state moves in place; lists, dicts and sets are updated in place, tuples rebuilt.
Tensors are detached before they move: the data is kept, an autograd graph (which would pin device
memory) is not. A leaf that required grad still does.
"""
from __future__ import annotations

import sys


def offload(obj, device="cpu", *, _memo: dict | None = None):
    """Move the tensors in obj to `device` (default the CPU) and return the moved object; rebind the
    variable to it. Handles tensors, nn.Modules, optimizers (state and param groups) and containers of
    these; other objects are returned unchanged."""
    torch = sys.modules.get("torch")
    if torch is None:
        return obj
    memo = {} if _memo is None else _memo
    if id(obj) in memo:
        return memo[id(obj)][1]
    moved = _offload(obj, torch, device, memo)
    memo[id(obj)] = (obj, moved)  # keeps obj alive during the walk, so ids are not reused
    return moved


def _offload(obj, torch, device, memo):
    if issubclass(type(obj), torch.Tensor):
        return _move_tensor(obj, torch, device)
    if isinstance(obj, torch.nn.Module):
        return obj.to(device)
    if isinstance(obj, torch.optim.Optimizer):
        _move_optimizer(obj, torch, device, memo)
        return obj
    if isinstance(obj, list):
        memo[id(obj)] = (obj, obj)  # a list that contains itself
        obj[:] = [offload(x, device, _memo=memo) for x in obj]
        return obj
    if isinstance(obj, dict):
        memo[id(obj)] = (obj, obj)
        for key, value in list(obj.items()):
            obj[key] = offload(value, device, _memo=memo)
        return obj
    if isinstance(obj, tuple):
        items = [offload(x, device, _memo=memo) for x in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        return type(obj)(items)
    if isinstance(obj, set):
        items = [offload(x, device, _memo=memo) for x in obj]
        obj.clear()
        obj.update(items)
        return obj
    if isinstance(obj, frozenset):
        return type(obj)(offload(x, device, _memo=memo) for x in obj)
    return obj


def _move_tensor(t, torch, device):
    if t.device == torch.device(device):
        return t
    if isinstance(t, torch.nn.Parameter):
        # moved in place, as Module.to does: whoever holds this parameter (a module, an optimizer's
        # param groups and state keys) sees the moved data
        with torch.no_grad():
            t.data = t.data.to(device)
            if t.grad is not None:
                t.grad = t.grad.to(device)
        return t
    moved = t.detach().to(device)
    if t.is_leaf and t.requires_grad:
        moved.requires_grad_(True)
        if t.grad is not None:
            moved.grad = t.grad.detach().to(device)
    return moved


def _move_optimizer(opt, torch, device, memo):
    """Move the optimizer's state tensors; the state stays keyed by the same parameter objects. The
    parameters belong to the model and are not moved here: offload the model too (in the same call or
    another), its parameters keep their identity."""
    for param, state in list(opt.state.items()):
        if isinstance(state, dict):
            for key, value in list(state.items()):
                state[key] = offload(value, device, _memo=memo)
