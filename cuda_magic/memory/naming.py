"""The census's names: a bounded walk of the user's namespace (module parameters, optimizer state, list and
dict items, attributes, what autograd graphs saved) that names each storage found by the gc pass.
"""
from __future__ import annotations

import gc

from cuda_magic.devices.probe import real_storage, subclasses
from cuda_magic.memory.data_only import ATOMIC, PART, PLAIN, holds_only_data, parts_hold_only_data
from cuda_magic.memory.reach import REFUSING as _REFUSING, object_dict, saved_attrs
from cuda_magic.memory.snapshot import TensorRecord

LARGE = 64                 # containers longer than this are first probed by holds_only_data
MAX_VISITS = 400_000        # the namespace walk stops here (names then may be incomplete)
MAX_DEPTH = 8
MAX_GRAPH_NODES = 20_000    # autograd nodes visited to name what graphs saved
GRAPH_SUFFIX = " (its graph)"


def tensor_types(torch) -> frozenset:
    return subclasses(torch.Tensor)


def new_record(t, storage, kind: str = "other") -> TensorRecord:
    """The record of a storage found through a tensor that the gc pass did not see."""
    return TensorRecord(storage._cdata, [], tuple(t.shape), str(t.dtype).replace("torch.", ""), str(t.device),
                        int(storage.nbytes()), False, 1, kind)


class Namer:
    def __init__(self, torch, by_id: dict[int, int], names: dict[int, list[str]], records: dict | None = None):
        self.torch = torch
        self.by_id = by_id
        self.names = names
        self.ttypes = tensor_types(torch)
        self.module_type = torch.nn.Module
        self.optim_type = torch.optim.Optimizer
        self.seen: set[int] = set()
        self.visits = 0
        self.param_names: dict[int, str] = {}
        self.optimizers: list[tuple[str, object]] = []
        self.truncated = False
        self.records = records if records is not None else {}
        # the storages found: by_id's have their records
        self.keys: set[int] = set(self.records) if records is not None else set(by_id.values())
        # id -> node: held so that its id is not reused (torch 2.2 makes a node's Python object on each access)
        self.graph_seen: dict[int, object] = {}
        self.graph_nodes = 0
        self.graphed: set[int] = set()      # the storages named through a graph (GRAPH_SUFFIX)

    def add(self, obj, name: str) -> None:
        key = self.by_id.get(id(obj))
        if key is not None:                     # (_name, inlined: called once per tensor found)
            known = self.names.get(key)
            if known is None:
                self.names[key] = [name]
            elif name not in known:
                known.append(name)
        if getattr(obj, "is_leaf", True):
            grad = obj.grad
            if grad is not None:
                self.add(grad, f"{name}.grad")
        elif obj.grad_fn is not None:
            self._name_graph(obj.grad_fn, f"{name}{GRAPH_SUFFIX}")

    def _name(self, key: int, name: str) -> None:
        lst = self.names.setdefault(key, [])
        if name not in lst:
            lst.append(name)

    def _name_graph(self, root, name: str) -> None:
        """Name the tensors an autograd graph saved for backward (activations a logged loss keeps)."""
        stack = [root]
        while stack and self.graph_nodes < MAX_GRAPH_NODES:
            node = stack.pop()
            if node is None or id(node) in self.graph_seen:
                continue
            self.graph_seen[id(node)] = node
            self.graph_nodes += 1
            for attr in saved_attrs(type(node)):
                try:
                    saved = getattr(node, attr)
                except (RuntimeError, AttributeError):   # freed by backward()
                    continue
                for t in (saved if isinstance(saved, (tuple, list)) else (saved,)):
                    storage = real_storage(t) if type(t) in self.ttypes and t.layout == self.torch.strided else None
                    if storage is not None:
                        key = storage._cdata
                        if key not in self.keys:
                            # held only inside the graph (no Python object for the gc scan to find)
                            self.keys.add(key)
                            self.records[key] = new_record(t, storage, kind="activations")
                        self._name(key, name)
                        self.graphed.add(key)
            stack.extend(fn for fn, _ in getattr(node, "next_functions", ()))

    def walk(self, obj, name: str, depth: int = 0) -> None:
        """Name what `obj` reaches. Decided by `type(obj)` alone, never `isinstance` (a dead weakref.proxy
        raises ReferenceError there); an object that refuses to be looked at is skipped."""
        cls = type(obj)
        if cls in ATOMIC or cls in _REFUSING:
            return
        if cls in self.ttypes:
            self.add(obj, name)
            return
        oid = id(obj)
        if oid in self.seen or depth > MAX_DEPTH:
            return
        self.visits += 1
        if self.visits > MAX_VISITS:
            self.truncated = True
            return
        self.seen.add(oid)
        try:
            self._walk_children(obj, cls, name, depth)
        except Exception:  # noqa: BLE001 - a hostile object (its __getattr__ or __len__ raises): not named
            return

    def _walk_children(self, obj, cls, name: str, depth: int) -> None:
        if issubclass(cls, self.module_type):
            self._walk_module(obj, name, depth)
        elif issubclass(cls, self.optim_type):
            self.optimizers.append((name, obj))
        elif issubclass(cls, (list, tuple)):
            if len(obj) > LARGE and cls in PLAIN and self._named_in_bulk(obj, name, depth):
                return
            for i, item in enumerate(obj):
                self.walk(item, f"{name}[{i}]", depth + 1)
        elif issubclass(cls, dict):
            if len(obj) > LARGE and cls is dict:
                level = list(filter(gc.is_tracked, obj.values()))
                if holds_only_data(level, set(map(type, level)), MAX_DEPTH + 1 - depth):
                    return
            for k, v in list(obj.items()):
                self.walk(v, f"{name}[{key_text(k)}]", depth + 1)
        elif issubclass(cls, (set, frozenset)):
            for item in obj:
                self.walk(item, f"{name}{{...}}", depth + 1)
        elif not issubclass(cls, type):
            attrs = object_dict(obj)
            if attrs is not None:
                for k, v in list(attrs.items()):
                    self.walk(v, f"{name}.{k}", depth + 1)

    def _named_in_bulk(self, seq, name: str, depth: int) -> bool:
        """Whether a long list or tuple needs no walk call per item: it holds only tensors (named here,
        as `add` names each), or only data (holds_only_data).

        Where its first item is tracked by the garbage collector, its items' types are read part by part
        (parts_hold_only_data): a sequence of tensors or of plain containers (rows of dicts, lists of
        lists) then needs no pass to leave out the untracked items (an untracked container holds only
        atoms, which the next level leaves out). Otherwise (strings, numbers, rows of untracked tuples)
        the tracked items are kept first, which leaves few or none.
        """
        levels = MAX_DEPTH + 1 - depth
        if gc.is_tracked(seq[0]):
            head = set(map(type, seq[:PART]))
            if head <= self.ttypes and set(map(type, seq)) <= self.ttypes:
                self._add_all(seq, name)
                return True
            if head <= PLAIN:
                return parts_hold_only_data(seq, levels)
        level = list(filter(gc.is_tracked, seq))
        return holds_only_data(level, set(map(type, level)), levels)

    def _add_all(self, tensors, name: str) -> None:
        """`add(t, f"{name}[{i}]")` for each tensor of a sequence."""
        add = self.add
        for i, t in enumerate(tensors):
            add(t, f"{name}[{i}]")

    def _walk_module(self, mod, name: str, depth: int) -> None:
        for pname, p in mod._parameters.items():
            if p is not None:
                self.param_names.setdefault(id(p), f"{name}.{pname}")
                self.add(p, f"{name}.{pname}")
        for bname, b in mod._buffers.items():
            if b is not None:
                self.add(b, f"{name}.{bname}")
        for mname, sub in mod._modules.items():
            if sub is not None:
                self.walk(sub, f"{name}.{mname}", depth + 1)
        for k, v in list(vars(mod).items()):
            if k[:1] != "_" and not issubclass(type(v), self.module_type):
                self.walk(v, f"{name}.{k}", depth + 1)

    def walk_optimizers(self) -> None:
        for name, opt in self.optimizers:
            for i, (param, state) in enumerate(list(opt.state.items())):
                pname = self.param_names.get(id(param), str(i))
                if isinstance(state, dict):
                    for k, v in state.items():
                        self.walk(v, f"{name}.state[{pname}][{key_text(k)}]", 1)
            for g, group in enumerate(opt.param_groups):
                for j, p in enumerate(group.get("params", ())):
                    if id(p) not in self.param_names:
                        self.add(p, f"{name}.param_groups[{g}]['params'][{j}]")


def key_text(k) -> str:
    if type(k) in (str, int, float, bool) or k is None:
        return repr(k)
    return f"<{type(k).__name__}>"
