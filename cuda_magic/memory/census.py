"""The census of live tensors: found by one pass over the garbage collector's objects, counted once per
storage, and named by a bounded walk of the user's namespace (module parameters, optimizer state, list
and dict items, attributes, the output cache, the last error's traceback). Holds no tensor afterwards.
"""
from __future__ import annotations

import gc
import os
import sys
from operator import attrgetter

from cuda_magic.devices.probe import real_storage, subclasses
from cuda_magic.memory.kinds import KindMarker
from cuda_magic.memory.snapshot import TensorRecord
from cuda_magic.paths import PACKAGE_DIR
from cuda_magic.memory.reach import saved_attrs
from cuda_magic.memory.naming import GRAPH_SUFFIX, MAX_VISITS, Namer, new_record, tensor_types


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
    optimizers = [o for o in found if type(o) in otypes]
    modules = [o for o in found if type(o) in mtypes]
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
    for t in tensors:
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
        namer = Namer(torch, by_id, names, records)
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
