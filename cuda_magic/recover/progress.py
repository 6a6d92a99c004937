"""How far through the model's forward pass a failed run came: read from the failure's traceback, for the
retry's prediction (recover/retry.py).

One failure says how much memory the cell held when it failed, not how much of the cell was still to
come: a failure in the second layer and one in the fifth give the same kind of lower bound, but the first
is far further from the cell's peak. When the failure came inside a `torch.nn.Module` call, the
traceback's module calls name the model (the outermost module called) and the module that failed (the
innermost); the failing module's place among the model's leaf modules, in their registration order (the
order most models run them in), is the share of the forward pass done, its request included.
"""
from __future__ import annotations

from dataclasses import dataclass

from cuda_magic.devices.probe import loaded_torch

MAX_LEAVES = 10_000        # a model with more leaf modules is not walked (its share is not needed that fine)


@dataclass(frozen=True)
class Progress:
    """Where in the model's forward pass a failure came. Sizes are int bytes."""

    share: float                  # of the model's leaf modules run, the failing one counted: (0, 1]
    input_bytes: int = 0          # the tensors the model was called with (there before it ran)
    grads_to_come: int = 0        # a model in training whose trainable parameters have no gradient yet:
                                  # the backward pass still to come will allocate this much
    rest_bytes: int | None = None  # what the layers after the failing one will allocate, where the model
                                   # is a chain of layers whose output sizes are known (recover/shapes.py)


def forward_progress(tb) -> Progress | None:
    """How far through the outermost module called the traceback's failure came; None when the failure
    was not inside a module call (after the forward pass: the loss, backward, the optimizer step) or the
    module tree cannot tell. Call it inside the `except` block (the frames' locals are read; clearing them
    afterwards also resyncs what was read)."""
    torch = loaded_torch()
    if torch is None or tb is None:
        return None
    module_class = torch.nn.Module
    call_codes = {getattr(module_class, name).__code__ for name in ("_call_impl", "_wrapped_call_impl")
                  if hasattr(getattr(module_class, name, None), "__code__")}
    chain, inputs, first_arg = [], 0, None
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code in call_codes:
            local = frame.f_locals
            module = local.get("self")
            if isinstance(module, module_class) and (not chain or chain[-1] is not module):
                args = local.get("args", ())
                if not chain:
                    inputs = _tensor_bytes(torch, [*args, *local.get("kwargs", {}).values()])
                first_arg = args[0] if isinstance(args, tuple) and args else None
                chain.append(module)
        tb = tb.tb_next
    if not chain:
        return None
    root, failing = chain[0], chain[-1]
    leaves = []
    for module in root.modules():
        if next(iter(module.children()), None) is None:
            leaves.append(module)
            if len(leaves) > MAX_LEAVES:
                return None
    if len(leaves) < 2:
        return None
    ids = [id(m) for m in leaves]
    failing_leaves = [id(m) for m in failing.modules() if next(iter(m.children()), None) is None]
    if not failing_leaves or failing_leaves[-1] not in ids:
        return None
    # a container that failed between its children's calls: count its leaves as done (an upper bound)
    done = ids.index(failing_leaves[-1]) + 1
    grads = 0
    if root.training:
        grads = _tensor_bytes(torch, [p for p in root.parameters() if p.requires_grad and p.grad is None])
    rest = None
    if failing_leaves == [ids[done - 1]] and isinstance(first_arg, torch.Tensor):
        from cuda_magic.recover.shapes import rest_bytes, sequential_only

        try:
            if sequential_only(root, torch):
                rest = rest_bytes(leaves, done - 1, tuple(first_arg.shape), _element_size(first_arg, failing),
                                  torch)
        except (AttributeError, TypeError, ValueError, IndexError, ZeroDivisionError):
            rest = None      # a layer that only looks like a common one: the retry extrapolates instead
    return Progress(done / len(leaves), inputs, grads, rest)


def _element_size(tensor, module) -> int:
    """Bytes per element of the activations: the input's if it is floating point, else the layer's."""
    if tensor.is_floating_point():
        return tensor.element_size()
    for p in module.parameters():
        return p.element_size()
    return 4


def _tensor_bytes(torch, items) -> int:
    """Bytes of the distinct tensors among items and one level into their lists, tuples and dicts."""
    seen, total = set(), 0
    flat = []
    for item in items:
        if isinstance(item, (list, tuple)):
            flat.extend(item)
        elif isinstance(item, dict):
            flat.extend(item.values())
        else:
            flat.append(item)
    for t in flat:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key not in seen:
                seen.add(key)
                total += key[1]
    return total
