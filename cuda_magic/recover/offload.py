"""Moving what a variable holds to the CPU, keeping the data: `%freecuda NAME --offload`.

Modules move in place (their parameters keep their identity, so an optimizer keyed by them still
works); optimizer state moves in place; lists, dicts and sets are updated in place, tuples rebuilt.
Tensors are detached before they move: the data is kept, an autograd graph (which would pin device
memory) is not. A leaf that required grad still does.
"""
from __future__ import annotations

import sys


class _Walk:
    """One offload call: objects already moved, parameters a module replaced, optimizers to do last."""

    def __init__(self, torch, device):
        self.torch = torch
        self.device = device
        self.moved: dict[int, tuple] = {}         # id -> (original, moved); keeps originals alive
        self.replaced: dict[int, tuple] = {}      # id(old param) -> (old, new) where Module.to swapped it
        self.optimizers: list = []


def offload(obj, device="cpu"):
    """Move the tensors in obj to `device` (default the CPU) and return the moved object; rebind the
    variable to it. Handles tensors, nn.Modules, optimizers (state and param groups) and containers of
    these; other objects are returned unchanged. Pass everything that belongs together in one call
    (`offload([model, opt])`): optimizers are done last, following any parameter a module replaced."""
    torch = sys.modules.get("torch")
    if torch is None:
        return obj
    walk = _Walk(torch, device)
    moved = _visit(obj, walk)
    for opt in walk.optimizers:
        _move_optimizer(opt, walk)
    if str(device) == "cpu":
        _leave_simulated_device(moved, torch)
    return moved


def _leave_simulated_device(obj, torch) -> int:
    """With a simulated GPU on, its tensors already live in CPU memory, so moving them to the CPU is a
    no-op: copy their data where the device does not count it instead (in place, so parameters and the
    optimizer state keyed by them keep their identity). Returns how many tensors were copied."""
    from cuda_magic.memory.reach import iter_tensors
    from cuda_magic.devices.simulated import active_device

    sim = active_device()
    if sim is None:
        return 0
    from torch.utils._python_dispatch import _disable_current_modes

    copied = 0
    with _disable_current_modes(), torch.no_grad():
        for t in list(iter_tensors(obj)):
            if t.device.type == "cpu" and sim.tracks(t) and (t.is_leaf or not t.requires_grad):
                t.data = t.data.clone()
                copied += 1
    return copied


def _visit(obj, walk):
    if id(obj) in walk.moved:
        return walk.moved[id(obj)][1]
    walk.moved[id(obj)] = (obj, obj)  # provisional: containers that contain themselves
    moved = _offload(obj, walk)
    walk.moved[id(obj)] = (obj, moved)
    return moved


def _offload(obj, walk):
    torch = walk.torch
    if issubclass(type(obj), torch.Tensor):
        if id(obj) in walk.replaced:  # a module moved earlier in this call swapped this parameter
            return walk.replaced[id(obj)][1]
        return _move_tensor(obj, torch, walk.device)
    if isinstance(obj, torch.nn.Module):
        before = list(obj.parameters())
        obj.to(walk.device)  # in place; parameters keep their identity where the tensor types allow
        for old, new in zip(before, obj.parameters()):
            if old is not new:
                walk.replaced[id(old)] = (old, new)
        return obj
    if isinstance(obj, torch.optim.Optimizer):
        walk.optimizers.append(obj)
        return obj
    if isinstance(obj, list):
        obj[:] = [_visit(x, walk) for x in obj]
        return obj
    if isinstance(obj, dict):
        for key, value in list(obj.items()):
            obj[key] = _visit(value, walk)
        return obj
    if isinstance(obj, tuple):
        items = [_visit(x, walk) for x in obj]
        if all(a is b for a, b in zip(items, obj)):
            return obj
        if hasattr(obj, "_fields"):  # namedtuple
            return type(obj)(*items)
        return type(obj)(items)
    if isinstance(obj, set):
        items = [_visit(x, walk) for x in obj]
        obj.clear()
        obj.update(items)
        return obj
    if isinstance(obj, frozenset):
        return type(obj)(_visit(x, walk) for x in obj)
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


def _move_optimizer(opt, walk):
    """Move the optimizer's state tensors; the state stays keyed by the same parameter objects (or by
    their replacements, where a module offloaded in the same call replaced them). The parameters belong
    to the model and are not moved here: offload the model too."""
    def current(p):
        return walk.replaced.get(id(p), (p, p))[1]

    for group in opt.param_groups:
        group["params"] = [current(p) for p in group["params"]]
    for param in list(opt.state.keys()):
        state = opt.state.pop(param) if current(param) is not param else opt.state[param]
        if isinstance(state, dict):
            for key, value in list(state.items()):
                state[key] = _visit(value, walk)
        opt.state[current(param)] = state
