"""Undoing an attempt of a retried cell, so that the cell ends as if it had run once, at the final value.

A `Checkpoint` is taken before the first attempt; `restore()` puts back, after a failed attempt (or a
`--search` probe):
- the namespace's bindings: names the attempt bound are removed, names it rebound get their old objects
  back (so the attempt's tensors are freed and cannot skew the next attempt's peak);
- the state of every module, optimizer and other object with `state_dict` / `load_state_dict` (learning
  rate schedulers, gradient scalers) reachable from the namespace's values, one level into containers:
  a copy in host memory, taken only where it fits there. Modules also get back their gradients and their
  train/eval flags; parameters keep their identity (the state is copied into them), so an optimizer keyed
  by them still works;
- the random number generators: torch's CPU and device generators, `random`, numpy's global one.

What cannot be undone is named by `not_undone()`: containers of the namespace whose length an attempt
changed (a list appended to), and files it opened for writing: seen by wrapping `open` (builtins and
io), `os.open` and, where torch is loaded, `torch.save` (which opens its file in C++) while an attempt
runs; the originals are put back after each attempt, so nothing stays installed. Not seen: files opened
through a reference taken before the attempt (`from os import open`), `io.FileIO(...)` called directly, and
files opened by C extensions other than torch.save.
"""
from __future__ import annotations

import builtins
import copy
import io
import os
import random
import sys
from collections import OrderedDict

from cuda_magic.devices.probe import cuda_started, loaded_torch, mps_available
from cuda_magic.memory.reach import skipped
from cuda_magic.units import format_bytes

HOST_SHARE = 0.5           # a state copy may take at most this share of the host's available memory
_CONTAINERS = (list, dict, set, bytearray)
_MISSING = object()


_IPYTHON_NAMES = ("In", "Out")            # IPython's input and output history: its own, not the cell's


class Checkpoint:
    """`take()` before the first attempt, `restore()` after each attempt to undo, `not_undone()` after."""

    def __init__(self, namespace: dict | None, *, roots=(), keep=(), available: int | None = None,
                 states: bool = True):
        self.namespace = namespace
        self.keep_states = states            # False: modules and optimizers are not copied (a fake run,
                                             # fakerun/, never writes them)
        self.roots = list(roots)
        self.keep = set(keep)                # names never restored: the retried variables
        self.available = available           # host bytes available for the copies; None: read /proc
        self.bindings: dict | None = None
        self.states: list[tuple[str, object, object]] = []     # (name, object, saved state)
        self.rng: dict = {}
        self.lengths: dict[str, tuple[int, int]] = {}          # name -> (id, len) of containers
        self.changed: dict[str, tuple[str, int, int]] = {}     # name -> (type, len before, len once undone)
        self.notes: list[str] = []
        self.files: list[str] = []                             # written by attempts that were undone
        self._attempt_files: list[str] = []                    # written by the attempt running now

    # taking -------------------------------------------------------------------------------------
    def take(self) -> list[str]:
        """Keep what is needed to undo an attempt. Returns notes to show before retrying (a state that
        does not fit in host memory, a state that cannot be read)."""
        ns = self.namespace
        if ns is not None:
            self.bindings = dict(ns)
            # exact types only: a subclass may raise from len(), a dead weakref.proxy from isinstance()
            self.lengths = {k: (id(v), len(v)) for k, v in ns.items()
                            if type(v) in _CONTAINERS and not k.startswith("_") and k not in self.keep
                            and k not in _IPYTHON_NAMES}
        found = stateful_objects(self._root_items()) if self.keep_states else []
        sizes = [(name, obj, state_bytes(obj)) for name, obj in found]
        total = sum(b for _, _, b in sizes)
        available = self.available if self.available is not None else _available_host()
        if total and available is not None and total > HOST_SHARE * available:
            names = ", ".join(n for n, _, _ in sizes)
            self.notes.append(f"the state of {names} ({format_bytes(total)}) does not fit in host memory "
                              f"({format_bytes(available)} available), so it is not kept: a failed attempt's "
                              "optimizer steps and buffer updates will stay in the model")
        else:
            for name, obj, _ in sizes:
                try:
                    self.states.append((name, obj, save_state(obj)))
                except Exception as exc:  # a third-party state_dict that fails must not stop the guard
                    self.notes.append(f"could not copy the state of {name} ({type(exc).__name__}: {exc}); "
                                      "a failed attempt's changes to it will stay")
        self.rng = rng_state()
        return list(self.notes)

    def _root_items(self):
        ns = self.namespace or {}
        items = [(k, v) for k, v in ns.items() if not k.startswith("_") and k not in self.keep]
        items += [(f"argument {i}", v) for i, v in enumerate(self.roots)]
        return items

    # restoring ----------------------------------------------------------------------------------
    def restore_bindings(self) -> None:
        """Put the namespace's names back as they were (which frees what the attempt bound): first, while
        a failure still holds its memory; `restore()` does the rest once it is given back."""
        ns = self.namespace
        if ns is not None and self.bindings is not None:
            for name in [k for k in ns if k not in self.bindings and k not in self.keep]:
                del ns[name]
            for name, value in self.bindings.items():
                if name not in self.keep and ns.get(name, _MISSING) is not value:
                    ns[name] = value

    def restore(self) -> None:
        """Undo what the attempt since `take()` did that can be undone. The states are loaded as fresh
        copies on the device: after a failure, call it once the failure's memory is given back."""
        self.restore_bindings()
        for name, obj, state in self.states:
            try:
                load_state(obj, state)
            except Exception as exc:
                note = f"could not restore the state of {name} ({type(exc).__name__}: {exc})"
                if note not in self.notes:
                    self.notes.append(note)
        set_rng_state(self.rng)
        self.files += self._attempt_files          # what an undone attempt wrote stays written
        self._attempt_files = []
        ns = self.namespace or {}
        for name, (ident, length) in self.lengths.items():   # what an undone attempt added stays added
            value = ns.get(name, _MISSING)
            if value is not _MISSING and id(value) == ident and len(value) != length:
                self.changed[name] = (type(value).__name__, length, len(value))

    def holds(self, module) -> bool:
        """Whether `restore()` puts back the state of `module` (kept itself, or inside a kept module)."""
        torch = loaded_torch()
        for _, obj, _ in self.states:
            if obj is module or (torch is not None and isinstance(obj, torch.nn.Module)
                                 and any(m is module for m in obj.modules())):
                return True
        return False

    def watching(self):
        """A context manager around one attempt: the files it opens for writing are noted, and named by
        `not_undone()` if the attempt is then undone (`restore()`); the run that stands is not named."""
        self._attempt_files = []
        return _WritesSeen(self._attempt_files, self.namespace)

    def not_undone(self) -> list[str]:
        """The effects of undone attempts that stayed: containers whose length changed, files written."""
        # as found when each attempt was undone: what the run that stands adds is its own
        out = [f"{name} (a {kind} changed in place: {before} item{'' if before == 1 else 's'} before, {after} "
               "after the undone attempts)" for name, (kind, before, after) in self.changed.items()]
        if self.files:
            shown = ", ".join(sorted(set(self.files))[:5])
            more = len(set(self.files)) - 5
            out.append(f"files written: {shown}" + (f" and {more} more" if more > 0 else ""))
        return out + [n for n in self.notes if n.startswith("could not restore")]


# ---- the state of modules, optimizers, schedulers ------------------------------------------------

def stateful_objects(items) -> list[tuple[str, object]]:
    """(name, object) for objects with state_dict/load_state_dict among `items` and, one level down,
    in their lists, tuples and dict values; each object once, modules before optimizers."""
    found: dict[int, tuple[str, object]] = {}

    def consider(name, obj):
        if skipped(obj) or id(obj) in found:
            return
        try:
            stateful = callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
        except Exception:  # noqa: BLE001 - a raising __getattr__: not something with a state to keep
            return
        if stateful:
            found[id(obj)] = (name, obj)

    for name, value in items:
        consider(name, value)
        cls = type(value)
        if issubclass(cls, (list, tuple)):
            for i, item in enumerate(list.__getitem__(value, slice(0, 1000)) if issubclass(cls, list)
                                     else tuple.__getitem__(value, slice(0, 1000))):
                consider(f"{name}[{i}]", item)
        elif issubclass(cls, dict):
            for key, item in list(dict.items(value))[:1000]:
                consider(f"{name}[{key!r}]", item)
    torch = loaded_torch()
    module = torch.nn.Module if torch is not None else ()
    return sorted(found.values(), key=lambda item: not issubclass(type(item[1]), module))


def state_bytes(obj) -> int:
    """Bytes of the tensors a state copy of `obj` would hold (its gradients included)."""
    torch = loaded_torch()
    if torch is None:
        return 0
    total = 0
    seen = set()
    tensors = list(_tensors_in(obj.state_dict()))
    if isinstance(obj, torch.nn.Module):
        tensors += [p.grad for p in obj.parameters() if p.grad is not None]
    for t in tensors:
        key = (t.data_ptr(), t.nbytes) if t.device.type != "meta" else id(t)
        if key not in seen:
            seen.add(key)
            total += t.nbytes
    return total


def save_state(obj):
    """A copy of obj's state in host memory, not counted by a simulated device."""
    torch = loaded_torch()
    with _uncounted():
        state = {"state": _to_host(obj.state_dict())}
        if torch is not None and isinstance(obj, torch.nn.Module):
            state["grads"] = {n: None if p.grad is None else _host_copy(p.grad) for n, p in obj.named_parameters()}
            state["training"] = [m.training for m in obj.modules()]
    return state


def load_state(obj, state) -> None:
    """Put a saved state back. Fresh copies are loaded each time (an optimizer would otherwise adopt the
    saved tensors and change them in place); they are made where the device counts them."""
    torch = loaded_torch()
    if torch is not None and isinstance(obj, torch.nn.Module):
        with torch.no_grad():
            obj.load_state_dict(state["state"])       # copied into the existing tensors
            for name, p in obj.named_parameters():
                saved = state["grads"].get(name, _MISSING)
                if saved is _MISSING:
                    continue
                p.grad = None if saved is None else saved.to(p.device, copy=True)
        for m, training in zip(obj.modules(), state["training"]):
            m.training = training
        return
    obj.load_state_dict(_copy_tree(state["state"]))


def _tensors_in(tree):
    torch = loaded_torch()
    if torch is not None and isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors_in(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors_in(v)


def _host_copy(t):
    from cuda_magic.devices.simulated import mark_host_only

    copy_ = t.detach().to("cpu", copy=True)
    mark_host_only(copy_)
    return copy_


def _to_host(tree):
    torch = loaded_torch()
    if torch is not None and isinstance(tree, torch.Tensor):
        return _host_copy(tree)
    if isinstance(tree, dict):
        out = type(tree)() if type(tree) in (dict, OrderedDict) else {}
        for k, v in tree.items():
            out[k] = _to_host(v)
        if getattr(tree, "_metadata", None) is not None:     # a module's versions, for load_state_dict
            out._metadata = copy.deepcopy(tree._metadata)
        return out
    if isinstance(tree, list):
        return [_to_host(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_to_host(v) for v in tree)
    return copy.deepcopy(tree)


def _copy_tree(tree):
    torch = loaded_torch()
    if torch is not None and isinstance(tree, torch.Tensor):
        return tree.clone()
    if isinstance(tree, dict):
        out = type(tree)() if type(tree) in (dict, OrderedDict) else {}
        for k, v in tree.items():
            out[k] = _copy_tree(v)
        if getattr(tree, "_metadata", None) is not None:
            out._metadata = tree._metadata
        return out
    if isinstance(tree, list):
        return [_copy_tree(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(_copy_tree(v) for v in tree)
    return copy.deepcopy(tree)


class _uncounted:
    """Host copies are not device memory: no simulated device counts what is made inside."""

    def __enter__(self):
        self._ctx = None
        from cuda_magic.devices.simulated import active_device

        torch = loaded_torch()
        if torch is not None and (active_device() is not None or _dispatch_mode_on(torch)):
            from torch.utils._python_dispatch import _disable_current_modes

            self._ctx = _disable_current_modes()
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self._ctx is not None:
            self._ctx.__exit__(*exc)


def _dispatch_mode_on(torch) -> bool:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    return _get_current_dispatch_mode() is not None


# ---- random number generators ---------------------------------------------------------------------

def rng_state() -> dict:
    """The generators' states: torch CPU, CUDA and XPU (where started: reading them starts nothing),
    MPS, `random`, numpy's global one."""
    state: dict = {"random": random.getstate()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    torch = loaded_torch()
    if torch is not None:
        from cuda_magic.devices.simulated import mark_host_only

        with _uncounted():
            state["torch"] = torch.get_rng_state()
            mark_host_only(state["torch"])
            if cuda_started():
                state["cuda"] = torch.cuda.get_rng_state_all()
            # torch.xpu.get_rng_state_all: torch 2.3+ (torch/xpu/random.py); it starts the XPU runtime
            # (_lazy_init), so only once torch has
            from cuda_magic.devices.probe import xpu_started

            if xpu_started() and hasattr(torch.xpu, "get_rng_state_all"):
                state["xpu"] = torch.xpu.get_rng_state_all()
            if hasattr(getattr(torch, "mps", None), "get_rng_state") and mps_available():
                state["mps"] = torch.mps.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    if "random" in state:
        random.setstate(state["random"])
    if "numpy" in state and sys.modules.get("numpy") is not None:
        sys.modules["numpy"].random.set_state(state["numpy"])
    torch = loaded_torch()
    if torch is None:
        return
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "xpu" in state:
        torch.xpu.set_rng_state_all(state["xpu"])
    if "mps" in state:
        torch.mps.set_rng_state(state["mps"])


# ---- files written during an attempt ----------------------------------------------------------------

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT


def _path_text(file) -> str | None:
    if isinstance(file, (str, bytes, os.PathLike)):
        try:
            return os.fsdecode(file)
        except TypeError:
            return None
    return None


def _writes(mode) -> bool:
    """Whether an `open` mode opens for writing (w, a, x or +)."""
    return isinstance(mode, str) and any(c in mode for c in "wax+")


class _WritesSeen:
    """While inside: `builtins.open` / `io.open`, `os.open` and `torch.save` are wrapped to note the paths
    opened for writing into `files`; on leaving (an exception and Ctrl-C included) the originals are put
    back, the very same objects. A wrapper that something else replaced meanwhile is left where it is,
    inert (putting ours back would undo the other change)."""

    def __init__(self, files: list, namespace: dict | None = None):
        self.files = files
        self.namespace = namespace
        self.active = False
        self._installed: list[tuple[object, str, object, object]] = []   # (owner, name, original, wrapper)

    def _note(self, file) -> None:
        path = _path_text(file)
        if self.active and path is not None:
            self.files.append(path)

    def __enter__(self):
        seen = self
        original_open, original_os_open = builtins.open, os.open

        def open(file, mode="r", *args, **kwargs):  # noqa: A001 - stands in for the builtin
            if _writes(mode):
                seen._note(file)
            return original_open(file, mode, *args, **kwargs)

        def os_open(path, flags, *args, **kwargs):
            if flags & _WRITE_FLAGS:
                seen._note(path)
            return original_os_open(path, flags, *args, **kwargs)

        targets = [(builtins, "open", open), (io, "open", open), (os, "open", os_open)]
        ns = self.namespace
        shell_open = None if ns is None else ns.get("open")
        if shell_open is not None and getattr(shell_open, "__wrapped__", None) is original_open:
            # IPython's own `open` in the user namespace (it refuses fds 0-2), bound to the original io.open
            def ipython_open(file, *args, **kwargs):
                mode = kwargs.get("mode", args[0] if args else "r")
                if _writes(mode):
                    seen._note(file)
                return shell_open(file, *args, **kwargs)

            targets.append((_Namespace(ns), "open", ipython_open))
        torch = loaded_torch()
        if torch is not None and callable(getattr(torch, "save", None)):
            original_save = torch.save

            def save(obj, f, *args, **kwargs):
                seen._note(f)
                return original_save(obj, f, *args, **kwargs)

            targets.append((torch, "save", save))
        self.active = True
        for owner, name, wrapper in targets:
            self._installed.append((owner, name, getattr(owner, name), wrapper))
            setattr(owner, name, wrapper)
        return self

    def __exit__(self, *exc):
        self.active = False
        for owner, name, original, wrapper in reversed(self._installed):
            if getattr(owner, name, None) is wrapper:
                setattr(owner, name, original)
        self._installed.clear()


class _Namespace:
    """A dict seen as an object, so that its "open" is replaced and put back like a module attribute."""

    def __init__(self, ns: dict):
        self.__dict__["_ns"] = ns

    def __getattr__(self, name):
        return self._ns.get(name)

    def __setattr__(self, name, value):
        self._ns[name] = value


def _available_host() -> int | None:
    from cuda_magic.devices.meter import available_memory

    return available_memory()
