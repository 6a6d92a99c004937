"""The census of live tensors: found by one pass over the garbage collector's objects, counted once per
storage, and named by a bounded walk of the user's namespace (module parameters, optimizer state, list
and dict items, attributes, the output cache, the last error's traceback). Holds no tensor afterwards.
"""
from __future__ import annotations

import gc
import os
import sys
import types
from itertools import chain
from operator import attrgetter

from cuda_magic.devices.probe import real_storage, subclasses
from cuda_magic.memory.kinds import KindMarker
from cuda_magic.memory.snapshot import TensorRecord
from cuda_magic.paths import PACKAGE_DIR
from cuda_magic.memory.reach import REFUSING as _REFUSING, object_dict, saved_attrs

_ATOMIC = frozenset({int, float, complex, bool, str, bytes, bytearray, type(None), range, slice,
                     type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                     types.ModuleType, types.CodeType, property, staticmethod, classmethod,
                     type(Ellipsis), memoryview})
_LARGE = 64                 # containers longer than this are first probed by _holds_only_data
_PART = 2048                # objects per part of a level that _holds_only_data follows down at once
# The exact container types whose items the probe follows: a subtree of these and atoms holds no tensor.
_SEQUENCES = frozenset({list, tuple, set, frozenset})
_DICT = frozenset({dict})
_PLAIN = _SEQUENCES | _DICT
_ATOMIC_OR_PLAIN = _ATOMIC | _PLAIN
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


class _Namer:
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
        if cls in _ATOMIC or cls in _REFUSING:
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
            if len(obj) > _LARGE and cls in _PLAIN and self._named_in_bulk(obj, name, depth):
                return
            for i, item in enumerate(obj):
                self.walk(item, f"{name}[{i}]", depth + 1)
        elif issubclass(cls, dict):
            if len(obj) > _LARGE and cls is dict:
                level = list(filter(gc.is_tracked, obj.values()))
                if _holds_only_data(level, set(map(type, level)), MAX_DEPTH + 1 - depth):
                    return
            for k, v in list(obj.items()):
                self.walk(v, f"{name}[{_key_text(k)}]", depth + 1)
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
        as `add` names each), or only data (_holds_only_data).

        Where its first item is tracked by the garbage collector, its items' types are read part by part
        (_parts_hold_only_data): a sequence of tensors or of plain containers (rows of dicts, lists of
        lists) then needs no pass to leave out the untracked items (an untracked container holds only
        atoms, which the next level leaves out). Otherwise (strings, numbers, rows of untracked tuples)
        the tracked items are kept first, which leaves few or none.
        """
        levels = MAX_DEPTH + 1 - depth
        if gc.is_tracked(seq[0]):
            head = set(map(type, seq[:_PART]))
            if head <= self.ttypes and set(map(type, seq)) <= self.ttypes:
                self._add_all(seq, name)
                return True
            if head <= _PLAIN:
                return _parts_hold_only_data(seq, levels)
        level = list(filter(gc.is_tracked, seq))
        return _holds_only_data(level, set(map(type, level)), levels)

    def _add_all(self, tensors, name: str) -> None:
        """`add(t, f"{name}[{i}]")` for each tensor of a sequence, without a call per tensor where the
        tensor has no gradient and no graph."""
        by_id, names = self.by_id, self.names
        for i, t in enumerate(tensors):
            item = f"{name}[{i}]"
            key = by_id.get(id(t))
            if key is not None:
                known = names.get(key)
                if known is None:
                    names[key] = [item]
                elif item not in known:
                    known.append(item)
            if getattr(t, "is_leaf", True):
                grad = t.grad
                if grad is not None:
                    self.add(grad, f"{item}.grad")
            elif t.grad_fn is not None:
                self._name_graph(t.grad_fn, f"{item}{GRAPH_SUFFIX}")

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
                        self.walk(v, f"{name}.state[{pname}][{_key_text(k)}]", 1)
            for g, group in enumerate(opt.param_groups):
                for j, p in enumerate(group.get("params", ())):
                    if id(p) not in self.param_names:
                        self.add(p, f"{name}.param_groups[{g}]['params'][{j}]")


def _holds_only_data(level: list, kinds: set, levels: int) -> bool:
    """Whether a plain container's subtree, `levels` levels down, has only atoms and plain containers.

    `level` is the container's items that the garbage collector tracks (or a part of them), `kinds` their
    types (or more). Untracked objects are atoms, or tuples and dicts holding only atoms (that is when
    CPython untracks them); a tensor is always tracked. A subtree of atoms and plain containers has no
    tensor, module or object with attributes for the walk to name, so the walk skips it. Breadth first,
    one level at a time, the work done in C (chain, filter, set(map(type, ...))): a list of a million
    rows costs milliseconds instead of a million Python calls. A long level is taken in parts of _PART
    objects, each followed down before the next: the passes over a part's subtree (its items, their
    types, their items) then find it in the CPU's cache, where whole levels of a large heap would not.
    """
    try:
        return _only_data(level, kinds, levels)
    except RuntimeError:   # another thread changed a dict or set meanwhile: let the walk decide
        return False


def _only_data(level, kinds: set, levels: int) -> bool:
    if levels < 1 or not level:
        return True
    if not kinds <= _ATOMIC_OR_PLAIN:
        return False
    if not kinds <= _PLAIN:   # functions, classes, modules: atomic to the walk, not followed
        level = [o for o in level if type(o) in _PLAIN]
        kinds = kinds & _PLAIN
    if levels == 1:
        return True           # the walk would look no deeper
    for start in range(0, len(level), _PART):
        part = level[start:start + _PART] if len(level) > _PART else level
        if kinds <= _SEQUENCES:
            items = gc.get_referents(*part)   # exactly their items; faster than chaining them
        elif kinds == _DICT:
            # The walk names values, not keys. get_referents gives the values, and the keys of a dict
            # not keyed by strings alone: more than the values, so where that holds only data, so do
            # the values; otherwise the values alone decide.
            below = list(filter(gc.is_tracked, gc.get_referents(*part)))
            if _only_data(below, set(map(type, below)), levels - 1):
                continue
            items = chain.from_iterable(map(dict.values, part))
        else:
            items = chain.from_iterable(o.values() if type(o) is dict else o for o in part)
        below = list(filter(gc.is_tracked, items))
        if not _only_data(below, set(map(type, below)), levels - 1):
            return False
    return True


def _parts_hold_only_data(seq, levels: int) -> bool:
    """_holds_only_data for a long list or tuple, part by part, each part's types read with its subtree."""
    for start in range(0, len(seq), _PART):
        part = seq[start:start + _PART]
        kinds = set(map(type, part))
        if not kinds <= _PLAIN:
            part = list(filter(gc.is_tracked, part))
            kinds = set(map(type, part))
        if not _holds_only_data(part, kinds, levels):
            return False
    return True


def _key_text(k) -> str:
    if type(k) in (str, int, float, bool) or k is None:
        return repr(k)
    return f"<{type(k).__name__}>"


def last_error_traceback():
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    tb = getattr(exc, "__traceback__", None) if exc is not None else None
    return tb or getattr(sys, "last_traceback", None)


def _machinery_dirs() -> tuple[str, ...]:
    """Folders of IPython and of this package: their frames in a traceback (the shell's `self` in
    run_code) reach everything, so walking them would name tensors by IPython's internals."""
    dirs = [PACKAGE_DIR]
    ipython = sys.modules.get("IPython")
    if getattr(ipython, "__file__", None):
        dirs.append(os.path.dirname(os.path.abspath(ipython.__file__)))
    return tuple(d + os.sep for d in dirs)


def take_census(namespace: dict | None = None, *, traceback=None, out_cache: dict | None = None,
                with_names: bool = True):
    """Live storages (largest first) with the names that reach them, and bytes per device.

    `with_names=False`: find and class the storages (by kind), but look up no names.

    `namespace`: the user's own variables (`ipython.user_variables`: IPython's names left out by the one
    rule that `%freecuda` follows too); `out_cache`: the output cache, whose entries are named `Out[N]`.

    Returns (records, bytes_per_device, notes). Without torch imported there are no tensors.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return [], {}, []
    ttypes = tensor_types(torch)
    otypes = subclasses(torch.optim.Optimizer)
    mtypes = subclasses(torch.nn.Module)
    wanted = ttypes | otypes | mtypes
    found = [o for o in gc.get_objects() if type(o) in wanted]
    tensors = [o for o in found if type(o) in ttypes]
    if len(tensors) < len(found):
        optimizers = [o for o in found if type(o) in otypes]
        modules = [o for o in found if type(o) in mtypes]
    else:
        optimizers, modules = [], []
    del found
    ptypes = frozenset(t for t in ttypes if issubclass(t, torch.nn.Parameter))
    params: list[int] = []       # storage keys under nn.Parameter objects
    leaves: list = []            # leaf tensors that require grad: their .grad is a gradient
    roots: list = []             # grad_fn of tensors that carry a graph
    graph_keys: list[int] = []
    by_id: dict[int, int] = {}
    records: dict[int, TensorRecord] = {}
    strided = torch.strided
    dtype_texts: dict = {}     # torch.float32 -> 'float32', computed once per dtype, not per tensor
    device_texts: dict = {}
    plain = (torch.Tensor, torch.nn.Parameter)
    for t in tensors:
        if type(t) in plain:           # real_storage's common case, without a call per tensor
            try:
                if t.layout != strided or t.is_meta:
                    continue
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError, AttributeError):
                continue
        else:
            try:
                if t.layout != strided:
                    continue   # sparse, nested and other tensors without one plain storage
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            storage = real_storage(t)      # fake (torch.compile's), meta and wrapper tensors hold nothing
            if storage is None:
                continue
        key = storage._cdata
        by_id[id(t)] = key
        if type(t) in ptypes:
            params.append(key)
        graph = False                  # whether this tensor makes its storage's row carry a graph
        if t.requires_grad:
            grad_fn = t.grad_fn
            if grad_fn is None:
                leaves.append(t)
            else:
                roots.append(grad_fn)
                graph_keys.append(key)
                # a view of a leaf (`w.T` of a parameter) has a grad_fn, but the storage is the leaf's
                base = t._base
                graph = base is None or not base.is_leaf
        rec = records.get(key)
        if rec is None:
            dtype, dev = t.dtype, t.device
            dtype_text = dtype_texts.get(dtype)
            if dtype_text is None:
                dtype_text = dtype_texts[dtype] = str(dtype).replace("torch.", "")
            dev_text = device_texts.get(dev)
            if dev_text is None:
                dev_text = device_texts[dev] = str(dev)
            records[key] = TensorRecord(key, [], tuple(t.shape), dtype_text, dev_text,
                                        int(storage.nbytes()), graph, 1)
        else:
            rec.views += 1
            rec.grad_fn = rec.grad_fn or graph
            if t._base is None:
                rec.shape = tuple(t.shape)
    del tensors
    notes: list[str] = []
    marker = KindMarker(torch, records, new_record, saved_attrs)
    for key in params:
        marker.parameter(key)
    for t in leaves:
        marker.leaf(t)
    for opt in optimizers:
        marker.optimizer(opt)
    for mod in modules:
        marker.module(mod)
    for key in graph_keys:
        marker.carries_graph(key)
    marker.graphs(roots)
    del leaves, optimizers, modules, roots
    if marker.truncated:
        notes.append("by kind: the walk of autograd graphs stopped after "
                     f"{marker.graph_nodes} nodes; some activations may count as other tensors")
    names: dict[int, list[str]] = {}
    graphed: set[int] = set()
    if records and with_names:
        namer = _Namer(torch, by_id, names, records)
        if namespace is not None:
            for var, value in list(namespace.items()):
                if var.startswith("__"):
                    continue
                namer.walk(value, var)
            namer.walk_optimizers()
        if out_cache:
            for n, value in list(out_cache.items()):
                namer.walk(value, f"Out[{n}]")
        tb = traceback if traceback is not None else last_error_traceback()
        machinery = _machinery_dirs()
        while tb is not None:
            frame = tb.tb_frame
            if (namespace is None or frame.f_globals is not frame.f_locals) \
                    and not frame.f_code.co_filename.startswith(machinery):
                for var, value in list(frame.f_locals.items()):
                    namer.walk(value, f"last error traceback ({var} in {frame.f_code.co_name})")
            tb = tb.tb_next
        if namer.truncated:
            notes.append(f"names: the namespace walk stopped after {MAX_VISITS} objects; some names are missing")
        graphed = namer.graphed
    marker.apply()
    per_device: dict[str, int] = {}
    result = []
    for key, rec in records.items():
        found = names.get(key) or []
        if key in graphed:           # a graph is named only for what nothing else names
            found = [n for n in found if not n.endswith(GRAPH_SUFFIX)] or found
        rec.names = found
        per_device[rec.device] = per_device.get(rec.device, 0) + rec.nbytes
        result.append(rec)
    result.sort(key=attrgetter("nbytes"), reverse=True)
    return result, per_device, notes
