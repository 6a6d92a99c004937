"""What a Python object keeps on a device: the tensors reachable from it (module parameters and grads,
optimizer state, containers, attributes, what an autograd graph saved), counted once per storage.
torch is looked up in sys.modules, never imported: a tensor exists only once the user imported torch."""
from __future__ import annotations

import functools
import types
import weakref

from cuda_magic.devices.probe import has_gpu, loaded_torch, real_storage

#: Objects visited at most by one reachability walk, and how deep it goes.
DEFAULT_LIMIT = 100_000
DEFAULT_DEPTH = 8

SKIP_TYPES = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
              types.CodeType, types.FrameType, types.TracebackType, str, bytes, int, float, complex, bool,
              type(None))
#: Weak references and proxies: a proxy forwards every attribute, `__class__` included, to its referent,
#: and raises ReferenceError once that is gone; they keep nothing alive, so the walks never follow them.
REFUSING = frozenset({weakref.ProxyType, weakref.CallableProxyType, weakref.ReferenceType})


def skipped(value) -> bool:
    """What the walks of the namespace do not follow, decided by the type alone (no `isinstance`, which
    a dead weakref.proxy answers with ReferenceError)."""
    cls = type(value)
    return cls in REFUSING or issubclass(cls, SKIP_TYPES)


def object_dict(obj) -> dict | None:
    """`vars(obj)`, or None where it has none or refuses to give it (a property or `__getattr__` that
    raises, a proxy whose referent is gone)."""
    try:
        attrs = vars(obj)
    except Exception:  # noqa: BLE001 - any object may refuse: nothing to walk
        return None
    return attrs if type(attrs) is dict else None


def device_kinds() -> tuple[str, ...]:
    """Device types whose tensors count as device tensors: the GPUs, or the CPU where there is no GPU."""
    return ("cuda", "mps", "xpu") if has_gpu() else ("cpu",)


def is_device_tensor(t) -> bool:
    """True for a tensor on a GPU; on a machine with no GPU at all, for a CPU tensor (SPEC: the CPU is
    the device there)."""
    torch = loaded_torch()
    if torch is None or not issubclass(type(t), torch.Tensor):
        return False
    try:
        kind = t.device.type
    except Exception:  # exotic subclasses (fake/functional tensors) may refuse; they hold no memory here
        return False
    return kind in device_kinds() and real_storage(t) is not None


def storage_key_and_bytes(t) -> tuple[int, int]:
    """(an id of the tensor's storage, the storage's bytes). Views of one storage give the same id."""
    try:
        storage = t.untyped_storage()
        return storage._cdata, storage.nbytes()
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        # sparse and some wrapper tensors have no single storage: count the tensor itself
        try:
            return id(t), t.element_size() * t.nelement()
        except Exception:
            return id(t), 0



def iter_tensors(obj, *, limit: int = DEFAULT_LIMIT, depth: int = DEFAULT_DEPTH):
    """Yield the tensors reachable from obj: itself, module parameters/grads/buffers, optimizer state,
    containers, objects' `__dict__`, and the tensors an autograd graph saved. Walks at most `limit`
    objects and `depth` levels; each object once."""
    torch = loaded_torch()
    if torch is None:
        return
    tensor_type = torch.Tensor
    module_type = torch.nn.Module
    optimizer_type = torch.optim.Optimizer
    node_type = torch.autograd.graph.Node
    # id -> the object itself: holding what was walked keeps its id from being reused during the walk
    # (a graph node's Python object is made on each access and dropped at once in torch 2.2)
    seen: dict[int, object] = {}
    stack = [(obj, 0)]
    budget = limit
    while stack and budget > 0:
        item, level = stack.pop()
        if id(item) in seen or skipped(item):
            continue
        seen[id(item)] = item
        budget -= 1
        cls = type(item)
        if issubclass(cls, tensor_type):
            yield item
            for extra in _tensor_extras(item):
                stack.append((extra, level + 1))
            continue
        # a graph's nodes do not count against the depth: a logged loss keeps a graph as deep as the
        # model, and what deleting the name gives back is all of it (the walk's budget still bounds it)
        if level >= depth and not issubclass(cls, node_type):
            continue
        try:
            children = _children(item, cls, module_type, optimizer_type, node_type)
        except Exception:  # noqa: BLE001 - a hostile object (its __getattr__ or __len__ raises): skipped
            continue
        child_level = level if issubclass(cls, node_type) else level + 1
        for child in children:
            stack.append((child, child_level))


def _children(item, cls, module_type, optimizer_type, node_type) -> list:
    if issubclass(cls, module_type):
        return _module_children(item)
    if issubclass(cls, optimizer_type):
        return [list(item.state.items()), item.param_groups]
    if issubclass(cls, dict):
        return [c for kv in list(item.items()) for c in kv]
    if issubclass(cls, (list, tuple, set, frozenset)):
        return list(item)
    if issubclass(cls, node_type):
        return _graph_node_children(item)
    attrs = object_dict(item)
    return list(attrs.values()) if attrs is not None else []


def _tensor_extras(t):
    """What a tensor keeps alive besides its storage: its grad (leaves) and its autograd graph."""
    extras = []
    try:
        if t.is_leaf:
            if t.grad is not None:
                extras.append(t.grad)
        elif t.grad_fn is not None:
            extras.append(t.grad_fn)
    except Exception:
        pass
    return extras


def _module_children(module):
    children = list(module.parameters())
    children += [p.grad for p in children if p.grad is not None]
    children += list(module.buffers())
    torch = loaded_torch()
    for sub in module.modules():  # plain tensor attributes, not registered as buffers
        children += [v for v in vars(sub).values() if issubclass(type(v), torch.Tensor)]
    return children


@functools.lru_cache(maxsize=512)
def saved_attrs(node_type) -> tuple[str, ...]:
    return tuple(a for a in dir(node_type) if a.startswith("_saved_"))


def _graph_node_children(node):
    children = [fn for fn, _ in node.next_functions if fn is not None]
    for attr in saved_attrs(type(node)):
        try:
            children.append(getattr(node, attr))
        except RuntimeError:  # freed by backward()
            pass
    return children


def device_storages(obj, limit: int = DEFAULT_LIMIT, *, depth: int = DEFAULT_DEPTH) -> dict[int, int]:
    """{storage id: bytes} of the distinct device storages reachable from obj."""
    storages: dict[int, int] = {}
    for t in iter_tensors(obj, limit=limit, depth=depth):
        if is_device_tensor(t):
            key, nbytes = storage_key_and_bytes(t)
            storages[key] = nbytes
    return storages


def holds_device_memory(obj, limit: int = DEFAULT_LIMIT, *, depth: int = DEFAULT_DEPTH) -> int:
    """Bytes of the distinct device storages reachable from obj (each storage counted once)."""
    storages = device_storages(obj, limit, depth=depth)
    return sum(storages.values())
