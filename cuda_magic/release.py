"""Giving device memory back without a kernel restart: what `%freecuda` and the clean-up after an OOM do.

A failed cell's tensors stay alive through references that only the notebook machinery holds:
`sys.last_*`, IPython's stored traceback, the last `ExecutionResult`, the frames of the traceback (and
their cached `f_locals`), and the output cache (`_`, `__`, `___`, `_N`, `Out[N]`, the displayhook's own
attributes). This module drops those, never a user variable unless it is named, then collects garbage and
empties the allocator cache, in that order.

torch is never imported here: a tensor can only exist once the user imported torch, so the module is
looked up in `sys.modules`.
"""
from __future__ import annotations

import functools
import gc
import re
import sys
import types

from .report import ReleaseReport

#: Objects visited at most by one reachability walk, and how deep it goes.
DEFAULT_LIMIT = 100_000
DEFAULT_DEPTH = 8

_OUT_NAME = re.compile(r"_([0-9]+)")
_UNDERS = ("_", "__", "___")
_SYS_LAST = ("last_type", "last_value", "last_traceback", "last_exc")
_CO_OPTIMIZED = 0x0001
_SKIP_TYPES = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
               types.CodeType, types.FrameType, types.TracebackType, str, bytes, int, float, complex, bool,
               type(None))


class MissingNames(KeyError):
    """`%freecuda NAME ...` named variables that do not exist; nothing was changed."""

    def __init__(self, names):
        self.names = list(names)
        super().__init__(self.names)

    def __str__(self) -> str:
        listed = ", ".join(self.names)
        return f"no variable named {listed}: nothing was deleted"


# ----------------------------------------------------------------------------------------- devices

def _torch():
    return sys.modules.get("torch")


@functools.lru_cache(maxsize=None)
def has_gpu() -> bool:
    """Whether this process can use a GPU (CUDA/ROCm, MPS or XPU). Asked once, then cached."""
    torch = _torch()
    if torch is None:
        import torch  # only reached when asked directly; is_device_tensor never gets here without torch
    try:
        if torch.cuda.is_initialized() or torch.cuda.is_available():
            return True
    except (AssertionError, RuntimeError):
        pass
    mps = getattr(getattr(torch, "backends", None), "mps", None)
    if mps is not None and mps.is_available():
        return True
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and hasattr(xpu, "is_available") and xpu.is_available():
        return True
    return False


def device_kinds() -> tuple[str, ...]:
    """Device types whose tensors count as device tensors: the GPUs, or the CPU where there is no GPU."""
    return ("cuda", "mps", "xpu") if has_gpu() else ("cpu",)


def is_device_tensor(t) -> bool:
    """True for a tensor on a GPU; on a machine with no GPU at all, for a CPU tensor (SPEC: the CPU is
    the device there)."""
    torch = _torch()
    if torch is None or not issubclass(type(t), torch.Tensor):
        return False
    try:
        kind = t.device.type
    except Exception:  # exotic subclasses (fake/functional tensors) may refuse; they hold no memory here
        return False
    return kind in device_kinds()


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


# ------------------------------------------------------------------------------------ reachability

def iter_tensors(obj, *, limit: int = DEFAULT_LIMIT, depth: int = DEFAULT_DEPTH):
    """Yield the tensors reachable from obj: itself, module parameters/grads/buffers, optimizer state,
    containers, objects' `__dict__`, and the tensors an autograd graph saved. Walks at most `limit`
    objects and `depth` levels; each object once."""
    torch = _torch()
    if torch is None:
        return
    tensor_type = torch.Tensor
    module_type = torch.nn.Module
    optimizer_type = torch.optim.Optimizer
    node_type = torch.autograd.graph.Node
    seen: set[int] = set()
    stack = [(obj, 0)]
    budget = limit
    while stack and budget > 0:
        item, level = stack.pop()
        if id(item) in seen or isinstance(item, _SKIP_TYPES):
            continue
        seen.add(id(item))
        budget -= 1
        if issubclass(type(item), tensor_type):
            yield item
            for extra in _tensor_extras(item):
                stack.append((extra, level + 1))
            continue
        if level >= depth:
            continue
        children = ()
        if isinstance(item, module_type):
            children = _module_children(item)
        elif isinstance(item, optimizer_type):
            children = [list(item.state.items()), item.param_groups]
        elif isinstance(item, dict):
            children = [c for kv in list(item.items()) for c in kv]
        elif isinstance(item, (list, tuple, set, frozenset)):
            children = list(item)
        elif isinstance(item, node_type):
            children = _graph_node_children(item)
        else:
            try:
                attrs = vars(item)
            except TypeError:  # no __dict__ (slots, C types)
                attrs = None
            if isinstance(attrs, dict):
                children = list(attrs.values())
        for child in children:
            stack.append((child, level + 1))


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
    torch = _torch()
    for sub in module.modules():  # plain tensor attributes, not registered as buffers
        children += [v for v in vars(sub).values() if issubclass(type(v), torch.Tensor)]
    return children


@functools.lru_cache(maxsize=512)
def _saved_attrs(node_type) -> tuple[str, ...]:
    return tuple(a for a in dir(node_type) if a.startswith("_saved_"))


def _graph_node_children(node):
    children = [fn for fn, _ in node.next_functions if fn is not None]
    for attr in _saved_attrs(type(node)):
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


# ------------------------------------------------------------------------------- exception refs

def _get_shell(shell):
    if shell is not None or "IPython" not in sys.modules:   # a plain script never imports IPython here
        return shell
    from IPython.core.getipython import get_ipython

    return get_ipython()


def _exception_family(exc) -> list[BaseException]:
    """exc and every exception chained to it (`__cause__`, `__context__`, group members), once each."""
    found: list[BaseException] = []
    seen: set[int] = set()
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen or not isinstance(e, BaseException):
            continue
        seen.add(id(e))
        found.append(e)
        stack += [e.__cause__, e.__context__]
        stack += list(getattr(e, "exceptions", ()) or ())
    return found


def _frames_of(tb) -> list:
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def clear_frame(frame, user_ns=None) -> bool:
    """Drop a finished frame's locals. Module-level frames (whose locals are a namespace) are left alone;
    executing frames cannot be cleared. Returns whether the frame was cleared."""
    optimized = bool(frame.f_code.co_flags & _CO_OPTIMIZED)
    if not optimized:
        f_locals = frame.f_locals
        if f_locals is frame.f_globals or (user_ns is not None and f_locals is user_ns):
            return False
    try:
        frame.clear()
    except RuntimeError:  # still executing (e.g. the caller's own frame)
        return False
    if optimized and sys.version_info < (3, 13):
        # 3.11/3.12: clear() leaves the cached f_locals dict (filled by any formatter that read it)
        # holding the old values; reading f_locals again resyncs it with the now empty fast locals.
        frame.f_locals
    return True


def clear_traceback_frames(tb, user_ns=None) -> int:
    """Clear every frame of a traceback; returns how many were cleared."""
    return sum(clear_frame(f, user_ns) for f in _frames_of(tb))


def drop_exception(exc, *, user_ns=None, sever: bool = True) -> int:
    """Make an exception hold nothing: clear the frames of its traceback and of every exception chained
    to it; with `sever`, also cut `__traceback__`, `__context__` and `__cause__`. Returns frames cleared.
    Call it outside the `except` block that caught exc (there the frames are still executing)."""
    cleared = 0
    family = _exception_family(exc)
    for e in family:
        cleared += clear_traceback_frames(e.__traceback__, user_ns)
    if sever:
        for e in family:
            e.__traceback__ = None
            e.__context__ = None
            e.__cause__ = None
    return cleared


def drop_exception_refs(shell=None, *, dry_run: bool = False) -> list[str]:
    """Drop the last exception everywhere the interpreter and IPython keep it, clearing its frames.
    Returns what was (or, with dry_run, would be) dropped, by name."""
    shell = _get_shell(shell)
    user_ns = getattr(shell, "user_ns", None)
    dropped: list[str] = []
    excs: list = []
    tbs: list = []

    for attr in ("last_value", "last_exc"):
        if getattr(sys, attr, None) is not None:
            excs.append(getattr(sys, attr))
    if getattr(sys, "last_traceback", None) is not None:
        tbs.append(sys.last_traceback)
    if any(getattr(sys, a, None) is not None for a in _SYS_LAST):
        dropped.append("sys.last_value")

    itb = getattr(shell, "InteractiveTB", None)
    if getattr(itb, "tb", None) is not None:
        tbs.append(itb.tb)
        dropped.append("IPython's stored traceback")

    result = getattr(shell, "last_execution_result", None)
    if getattr(result, "error_in_exec", None) is not None:
        excs.append(result.error_in_exec)
        dropped.append("IPython's last error")
    result_holds = result is not None and getattr(result, "result", None) is not None \
        and holds_device_memory(result.result) > 0
    if result_holds:
        dropped.append("IPython's last result")

    if dry_run:
        return dropped

    for exc in excs:
        drop_exception(exc, user_ns=user_ns, sever=False)
    for tb in tbs:
        clear_traceback_frames(tb, user_ns)
    for attr in _SYS_LAST:
        if hasattr(sys, attr):
            delattr(sys, attr)
    if itb is not None and getattr(itb, "tb", None) is not None:
        itb.tb = None
    if getattr(result, "error_in_exec", None) is not None:
        result.error_in_exec = None
    if result_holds:
        result.result = None
    return dropped


# ---------------------------------------------------------------------------------- output cache

def _is_output_cache_name(shell, name: str, value) -> bool:
    """Whether user_ns[name] is an output-cache entry (not a user variable of the same name)."""
    hidden = getattr(shell, "user_ns_hidden", {}) or {}
    if name in _UNDERS:
        return value is getattr(shell.displayhook, name, object())
    match = _OUT_NAME.fullmatch(name)
    if not match:
        return False
    output_hist = _output_hist(shell)
    n = int(match.group(1))
    if n in output_hist and output_hist[n] is value:
        return True
    return name in hidden and hidden[name] is value


def _output_hist(shell) -> dict:
    hm = getattr(shell, "history_manager", None)
    hist = getattr(hm, "output_hist", None)
    if isinstance(hist, dict):
        return hist
    out = shell.user_ns.get("Out")
    return out if isinstance(out, dict) else {}


def drop_output_cache(shell, *, only_device: bool = True, dry_run: bool = False) -> list[str]:
    """Drop output-cache entries (only those holding device tensors, by default) and name them:
    'Out[7]', '_7', '_'. A user variable is never touched, even one named `_x` or `_7`."""
    shell = _get_shell(shell)
    if shell is None:
        return []

    def wanted(value) -> bool:
        return not only_device or holds_device_memory(value) > 0

    user_ns = shell.user_ns
    hidden = getattr(shell, "user_ns_hidden", {}) or {}
    output_hist = _output_hist(shell)
    dropped: list[str] = []
    actions = []

    for n, value in list(output_hist.items()):
        if not wanted(value):
            continue
        dropped.append(f"Out[{n}]")
        actions.append(lambda n=n: output_hist.pop(n, None))
    for ns, where in ((user_ns, ""), (hidden, " (hidden)")):
        for name, value in list(ns.items()):
            match = _OUT_NAME.fullmatch(name)
            if not match or not wanted(value):
                continue
            n = int(match.group(1))
            is_cache = ns is hidden or (n in output_hist and output_hist[n] is value) \
                or (name in hidden and hidden[name] is value)
            if not is_cache:
                continue
            if not where:
                dropped.append(name)
            actions.append(lambda ns=ns, name=name: ns.pop(name, None))

    displayhook = getattr(shell, "displayhook", None)
    for name in _UNDERS:
        value = getattr(displayhook, name, None)
        if value is None or isinstance(value, str) or not wanted(value):
            continue
        dropped.append(name)
        for ns in (user_ns, hidden):
            if name in ns and ns[name] is value:
                actions.append(lambda ns=ns, name=name: ns.__setitem__(name, ""))
        actions.append(lambda name=name: setattr(displayhook, name, ""))

    if not dry_run:
        for act in actions:
            act()
    return dropped


# ----------------------------------------------------------------------------------- measurement

def _device_usage() -> dict[str, int]:
    """Bytes in use per device key, as the allocators see them (reserved, i.e. what the device lost)."""
    torch = _torch()
    usage: dict[str, int] = {}
    if torch is None:
        return usage
    if torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            usage[f"cuda:{i}"] = torch.cuda.memory_reserved(i)
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and getattr(xpu, "is_initialized", lambda: False)():
        for i in range(xpu.device_count()):
            usage[f"xpu:{i}"] = xpu.memory_reserved(i)
    mps = getattr(torch, "mps", None)
    if mps is not None and torch.backends.mps.is_available():
        usage["mps"] = mps.driver_allocated_memory()
    if not has_gpu():
        usage["cpu"] = cpu_tensor_bytes()
    sim = _simulated_device()
    if sim is not None:
        usage[sim.key] = int(sim.allocated)
    return usage


def cpu_tensor_bytes() -> int:
    """Bytes of the distinct CPU tensor storages alive in this process (a gc scan)."""
    torch = _torch()
    if torch is None:
        return 0
    storages: dict[int, int] = {}
    for o in gc.get_objects():
        if issubclass(type(o), torch.Tensor):
            try:
                if o.device.type != "cpu":
                    continue
            except Exception:
                continue
            key, nbytes = storage_key_and_bytes(o)
            storages[key] = nbytes
    return sum(storages.values())


def _simulated_device():
    try:
        from .simulated import active_device
        return active_device()
    except (ImportError, AttributeError):
        return None


def empty_caches() -> None:
    """Give the allocators' cached, unused blocks back to the devices. Creates no CUDA context."""
    torch = _torch()
    if torch is None:
        return
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and getattr(xpu, "is_initialized", lambda: False)():
        xpu.empty_cache()
    mps = getattr(torch, "mps", None)
    if mps is not None and hasattr(mps, "empty_cache") and torch.backends.mps.is_available():
        mps.empty_cache()


# ------------------------------------------------------------------------------ user variables

def user_variables(shell) -> dict:
    """The user's variables: user_ns less IPython's hidden names, the output cache and dunder names."""
    if shell is None:
        main = sys.modules.get("__main__")
        ns = dict(vars(main)) if main is not None else {}
        return {k: v for k, v in ns.items() if not (k.startswith("__") and k.endswith("__"))}
    hidden = getattr(shell, "user_ns_hidden", {}) or {}
    found = {}
    for name, value in shell.user_ns.items():
        if name.startswith("__") and name.endswith("__"):
            continue
        if name in hidden and hidden[name] is value:
            continue
        if _is_output_cache_name(shell, name, value):
            continue
        found[name] = value
    return found


def device_holders(shell, exclude=()) -> list[tuple[str, int]]:
    """(variable, bytes) for user variables holding device memory, largest first."""
    held = []
    for name, value in user_variables(shell).items():
        if name in exclude or isinstance(value, _SKIP_TYPES):
            continue
        nbytes = holds_device_memory(value)
        if nbytes > 0:
            held.append((name, nbytes))
    held.sort(key=lambda item: (-item[1], item[0]))
    return held


def shared_holders(shell) -> list[tuple[str, int]]:
    """Like device_holders, but storages shared by several variables (a tensor and its view, a model
    and its parameter) are counted once: such variables are listed together ("a, b"), largest first."""
    groups: list[tuple[list[str], dict[int, int]]] = []
    for name, value in user_variables(shell).items():
        if isinstance(value, _SKIP_TYPES):
            continue
        storages = device_storages(value)
        if not storages:
            continue
        overlapping = [g for g in groups if g[1].keys() & storages.keys()]
        names, merged = [name], dict(storages)
        for g in overlapping:
            names = g[0] + names
            merged.update(g[1])
            groups.remove(g)
        groups.append((names, merged))
    held = [(", ".join(names), sum(storages.values())) for names, storages in groups]
    held.sort(key=lambda item: (-item[1], item[0]))
    return held


def all_device_variables(shell) -> list[str]:
    """The user variables `%freecuda --all` deletes: those holding device tensors, largest first."""
    return [name for name, _ in device_holders(_get_shell(shell))]


# -------------------------------------------------------------------------------------- release

def release(shell=None, *, dry_run: bool = False) -> ReleaseReport:
    """The clean-up of `%freecuda` without namespace changes: drop the last exception's references
    and output-cache entries holding device tensors, collect garbage, empty the allocator cache."""
    return _release(_get_shell(shell), dry_run=dry_run)


def _release(shell, *, dry_run: bool, change_namespace=None, report: ReleaseReport | None = None,
             exclude=()) -> ReleaseReport:
    report = report or ReleaseReport()
    report.dry_run = dry_run
    if dry_run:
        report.dropped += drop_exception_refs(shell, dry_run=True)
        report.dropped += drop_output_cache(shell, dry_run=True) if shell is not None else []
        report.still_held = device_holders(shell, exclude=exclude)
        report.notes.append("dry run: nothing was changed")
        return report

    before = _device_usage()
    if change_namespace is not None:
        change_namespace()
    # References first, then a gc pass (they form cycles), then the cache: in this order, and never
    # inside an `except` block, where the live traceback would keep everything.
    report.dropped += drop_exception_refs(shell)
    if shell is not None:
        report.dropped += drop_output_cache(shell)
    gc.collect()
    empty_caches()
    after = _device_usage()
    for key, used in before.items():
        report.freed[key] = max(0, used - after.get(key, used))
    if not has_gpu():
        report.notes.append("no GPU: the CPU is the device (CPU tensors are counted)")
    report.still_held = device_holders(shell)
    return report


def free_variables(shell, names, *, offload: bool = False, dry_run: bool = False) -> ReleaseReport:
    """`%freecuda NAME ...`: delete (or, with offload, move to the CPU) the named variables, then
    release. If any name does not exist, raise MissingNames before changing anything."""
    shell = _get_shell(shell)
    names = list(dict.fromkeys(names))
    missing = [n for n in names if n not in shell.user_ns]
    if missing:
        raise MissingNames(missing)
    report = ReleaseReport()
    if offload:
        report.offloaded = list(names)
        if not has_gpu():
            if _simulated_device() is not None:
                report.notes.append("no GPU: offloading copies the tensors off the simulated device into "
                                    "CPU memory it does not count")
            else:
                report.notes.append("no GPU: the CPU is the device, so offloading moves nothing")
    else:
        report.deleted = list(names)
    if dry_run:
        return _release(shell, dry_run=True, report=report, exclude=() if offload else names)

    def change_namespace():
        hidden = getattr(shell, "user_ns_hidden", {}) or {}
        if offload:
            from .offload import offload as move
            # one call, so that a model and its optimizer are moved together
            moved = move([shell.user_ns[name] for name in names])
            for name, value in zip(names, moved):
                shell.user_ns[name] = value
            return
        for name in names:
            value = shell.user_ns.pop(name)
            if name in hidden and hidden[name] is value:
                del hidden[name]
            del value

    return _release(shell, dry_run=False, change_namespace=change_namespace, report=report)
