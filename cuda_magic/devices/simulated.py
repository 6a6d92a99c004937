"""The simulated device: a CPU stand-in for a GPU of a chosen size.

While active, every tensor storage created in this thread counts against the device's capacity (views
once, keyed by storage), freeing it gives the bytes back at once (a finalizer on the storage, no gc
needed), and an allocation past the capacity raises torch's OutOfMemoryError (`devices.errors.oom_error_class`) with a CUDA-style message
before the memory is really taken: each op's output sizes are first computed on the meta device.
"""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager

from cuda_magic.devices.probe import real_storage, subclasses
from cuda_magic.devices.readings import DeviceMemory

_active: list[SimulatedDevice] = []   # devices counting now, the latest started last (mirrors the modes entered)
_host_only: set[int] = set()               # storages kept in host memory on purpose: never counted
_mode_class = None
_tensor_type = None
_MISSING = object()
PREDICTED_MAX = 20_000        # cached output sizes per device (a few MB); cleared when full


def torch_size_text(n: int) -> str:
    """Sizes the way torch's allocator writes them in its messages ('20.00 MiB', '512 bytes')."""
    if n <= 1024:
        return f"{n} bytes"
    for unit, scale in (("KiB", 1024), ("MiB", 1024**2), ("GiB", 1024**3)):
        if n <= scale * 1024 or unit == "GiB":
            return f"{n / scale:.2f} {unit}"
    raise AssertionError("unreachable")


def _get_mode_class():
    """The TorchDispatchMode subclass, built on first use so that importing this module stays cheap."""
    global _mode_class
    if _mode_class is not None:
        return _mode_class
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten, tree_map

    meta = torch.device("meta")
    tensor_type = torch.Tensor
    # tensors over a storage made outside the dispatcher: a tensor literal's data, lifted; a storage that
    # copy.deepcopy, torch.load or UntypedStorage(n) made, wrapped by set_ (a deep copy of a state dict
    # is device memory on a GPU too)
    lift_fresh = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default,
                  torch.ops.aten.set_.source_Storage, torch.ops.aten.set_.source_Storage_storage_offset}
    schemas: dict = {}      # op -> (fresh per return, any fresh, has a device argument, lifted)

    def to_meta(x):
        if isinstance(x, tensor_type):
            return x.to(meta) if x.device.type != "meta" else x
        if isinstance(x, torch.device):
            return meta
        return x

    def shape_key(x):
        """What an op's meta kernel sees of an argument: a tensor's metadata, never its values."""
        if isinstance(x, tensor_type):
            return (x.shape, x.dtype, x.stride(), x.storage_offset(), x.device.type, x.layout)
        if isinstance(x, (list, tuple)):
            return (type(x), *map(shape_key, x))
        if isinstance(x, dict):
            return (dict, *((k, shape_key(v)) for k, v in x.items()))
        hash(x)             # an unhashable argument: not cached (TypeError)
        return x

    class SimulatedMemoryMode(TorchDispatchMode):
        def __init__(self, device: SimulatedDevice):
            super().__init__()
            self.device = device
            # Bytes an op's fresh outputs take, by op and argument metadata: a training step repeats the
            # same ops on the same shapes, so the meta pass runs once per shape, not once per call.
            self.predicted: dict = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            info = schemas.get(func)
            if info is None:
                schema = func._schema
                fresh = tuple(r.alias_info is None for r in schema.returns)
                info = schemas[func] = (fresh, any(fresh), any(a.name == "device" for a in schema.arguments),
                                        func in lift_fresh)
            fresh, any_fresh, has_device, lifted = info
            if any_fresh:
                needed = self._predict(func, fresh, has_device, args, kwargs)
                if needed:
                    self.device._check(needed)
            out = func(*args, **kwargs)
            self.device._track_outputs(out, fresh, lifted)
            return out

        def _predict(self, func, fresh, has_device, args, kwargs):
            try:
                key = (func, shape_key(args), shape_key(kwargs))
                hash(key)
            except (TypeError, RuntimeError, NotImplementedError):   # unhashable, or no strides (sparse)
                key = None
            if key is not None:
                hit = self.predicted.get(key, _MISSING)
                if hit is not _MISSING:
                    return hit
            needed = self._meta_bytes(func, fresh, has_device, args, kwargs)
            if key is not None:
                if len(self.predicted) >= PREDICTED_MAX:
                    self.predicted.clear()
                self.predicted[key] = needed
            return needed

        def _meta_bytes(self, func, fresh, has_device, args, kwargs):
            meta_args = tree_map(to_meta, args)
            meta_kwargs = tree_map(to_meta, kwargs)
            if has_device:
                meta_kwargs["device"] = meta
            try:
                meta_out = func(*meta_args, **meta_kwargs)
            except Exception:
                return None  # no meta kernel (data-dependent shapes): counted after the op instead
            outs = meta_out if isinstance(meta_out, (tuple, list)) else (meta_out,)
            needed = 0
            for is_fresh, value in zip(fresh, outs):
                if not is_fresh:
                    continue
                for leaf in tree_flatten(value)[0]:
                    if isinstance(leaf, tensor_type):
                        needed += leaf.untyped_storage().nbytes()
            return needed

    global _tensor_type
    _tensor_type = tensor_type
    _mode_class = SimulatedMemoryMode
    return _mode_class


class SimulatedDevice:
    """A device of `capacity` bytes. Use as a context manager, or `start()` / `stop()`.

    `allocated` and `peak` are exact: every storage created while active is counted when created and
    released when its last reference goes.
    """

    kind = "simulated"

    def __init__(self, capacity: int, *, index: int = 0, name: str = "simulated GPU"):
        if int(capacity) <= 0:
            raise ValueError(f"a simulated device needs a capacity above 0 bytes, not {capacity}")
        self.capacity = int(capacity)
        self.index = index
        self.name = name
        self.allocated = 0
        self.peak = 0
        self._live: dict[int, int] = {}
        self._finalizers: dict[int, weakref.finalize] = {}
        self._lock = threading.Lock()
        self._mode = None
        self.recorders: tuple = ()    # black boxes (devices/blackbox.py) recording now: `%oomguard on`'s
                                      # around a cell, a guarded run's inside it

    @property
    def key(self) -> str:
        return f"sim:{self.index}"

    @property
    def active(self) -> bool:
        return self._mode is not None

    @property
    def live_storages(self) -> int:
        return len(self._live)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> SimulatedDevice:
        if self._mode is not None:
            raise RuntimeError("this simulated device is already active")
        self._mode = _get_mode_class()(self)
        self._mode.__enter__()
        _active.append(self)
        return self

    def stop(self) -> None:
        """Stop counting new storages. Storages already counted keep being given back when freed."""
        if self._mode is None:
            return
        mode, self._mode = self._mode, None
        if self in _active:
            _active.remove(self)
        mode.__exit__(None, None, None)

    def __enter__(self) -> SimulatedDevice:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.allocated

    @contextmanager
    def limited(self, capacity: int):
        """Lower the capacity for a block (the `-l` cap of `%%oomguard`); restored afterwards."""
        old = self.capacity
        self.capacity = min(old, int(capacity))
        try:
            yield self
        finally:
            self.capacity = old

    # -- accounting --------------------------------------------------------------------------------
    def _check(self, needed: int) -> None:
        if needed and self.allocated + needed > self.capacity:
            for recorder in self.recorders:
                recorder.oom(needed, self.allocated)
            raise self.out_of_memory(needed)

    def attach_recorder(self, recorder) -> None:
        """Record allocations, frees and failing requests into `recorder` (a blackbox.Recorder), besides
        any recording already; the storages alive now are its starting set."""
        with self._lock:
            recorder.seed(dict(self._live), self.allocated)
            self.recorders = (*self.recorders, recorder)

    def detach_recorder(self, recorder) -> None:
        with self._lock:
            self.recorders = tuple(r for r in self.recorders if r is not recorder)

    def out_of_memory(self, requested: int):
        from cuda_magic.devices.errors import oom_error_class

        free = max(0, self.capacity - self.allocated)
        msg = (
            f"CUDA out of memory (simulated device). Tried to allocate {torch_size_text(requested)}. "
            f"GPU {self.index} has a total capacity of {torch_size_text(self.capacity)} of which "
            f"{torch_size_text(free)} is free. Including non-PyTorch memory, this process has "
            f"{torch_size_text(self.allocated)} memory in use. Of the allocated memory "
            f"{torch_size_text(self.allocated)} is allocated by PyTorch, and 0 bytes is reserved by "
            "PyTorch but unallocated.")
        return oom_error_class()(msg)

    def _track_outputs(self, out, fresh, lifted: bool) -> None:
        tensor_type = _tensor_type
        outs = out if isinstance(out, (tuple, list)) else (out,)
        grown = 0
        for is_fresh, value in zip(fresh, outs):
            for leaf in (value if isinstance(value, (tuple, list)) else (value,)):
                if not isinstance(leaf, tensor_type):
                    continue
                storage = real_storage(leaf)     # fake, meta and wrapper tensors hold nothing of their own
                if storage is None:
                    continue
                key = storage._cdata
                nbytes = storage.nbytes()
                with self._lock:
                    known = self._live.get(key)
                    if known is None:
                        if not (is_fresh or lifted) or (lifted and key in _host_only):
                            continue  # a view or in-place result of a storage made before we started
                        self._live[key] = nbytes
                        self.allocated += nbytes
                        self._finalizers[key] = weakref.finalize(storage, self._release, key)
                        for recorder in self.recorders:
                            recorder.alloc(key, nbytes, self.allocated)
                    elif nbytes != known:          # resized in place (out= arguments, resize_)
                        self._live[key] = nbytes
                        self.allocated += nbytes - known
                        grown += max(0, nbytes - known)
                        for recorder in self.recorders:
                            recorder.resize(key, nbytes, self.allocated)
                    if self.allocated > self.peak:
                        self.peak = self.allocated
        if grown and self.allocated > self.capacity:
            for recorder in self.recorders:
                recorder.oom(grown, self.allocated - grown)
            raise self.out_of_memory(grown)

    def _release(self, key: int) -> None:
        with self._lock:
            nbytes = self._live.pop(key, 0)
            self._finalizers.pop(key, None)
            self.allocated -= nbytes
            for recorder in self.recorders:
                recorder.free(key, self.allocated)

    def count_existing(self) -> int:
        """Count the CPU tensor storages that already exist (one gc scan), as a GPU counts what the notebook
        already holds: `-l` without CUDA then caps the whole, not only the cell's increase. Storages marked
        `host_only` (copies kept in host memory) are left out, and so are tensors that hold no memory of
        their own (meta tensors). Returns the bytes added."""
        import gc

        import torch

        ttypes = subclasses(torch.Tensor)
        added = 0
        for obj in [o for o in gc.get_objects() if type(o) in ttypes]:
            try:
                if obj.device.type != "cpu" or obj.is_sparse:
                    continue
                storage = real_storage(obj)
                if storage is None:
                    continue
                key, nbytes = storage._cdata, storage.nbytes()
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            with self._lock:
                if key in self._live or key in _host_only or not nbytes:
                    continue
                self._live[key] = nbytes
                self.allocated += nbytes
                self._finalizers[key] = weakref.finalize(storage, self._release, key)
                added += nbytes
        with self._lock:
            self.peak = max(self.peak, self.allocated)
        return added

    def tracks(self, tensor) -> bool:
        """Whether this device counts the storage under `tensor`."""
        return self.counts(tensor.untyped_storage()._cdata)

    def counts(self, storage_key: int) -> bool:
        """Whether this device counts the storage whose `untyped_storage()._cdata` is `storage_key`."""
        return storage_key in self._live

    def forget(self) -> None:
        """Stop following the storages counted so far (a device that is switched off for good)."""
        with self._lock:
            for fin in self._finalizers.values():
                fin.detach()
            self._finalizers.clear()
            self._live.clear()
            self.allocated = 0

    def memory(self) -> DeviceMemory:
        return DeviceMemory(
            key=self.key, name=f"{self.name} ({torch_size_text(self.capacity)})", kind=self.kind,
            capacity=self.capacity, torch_allocated=self.allocated, torch_cached=0,
            other_this_process=0, other_processes=0, free=max(0, self.capacity - self.allocated),
            peak=self.peak, peak_exact=True,
            notes=["simulated device: counts tensors created in this thread"])

    def __repr__(self) -> str:
        state = "active" if self.active else "inactive"
        return (f"<SimulatedDevice {self.key} {state}: {self.allocated} of {self.capacity} bytes "
                f"allocated, peak {self.peak}>")


@contextmanager
def simulated_device(capacity, *, index: int = 0):
    """`with simulated_device("8GiB") as dev:` - tensors created inside count against `dev`."""
    from cuda_magic.units import parse_size

    nbytes = parse_size(capacity, allow_fraction=False) if isinstance(capacity, str) else int(capacity)
    dev = SimulatedDevice(nbytes, index=index)
    with dev:
        yield dev


def mark_host_only(tensor) -> None:
    """A copy kept in host memory (a rollback's saved state): no simulated device counts its storage."""
    storage = tensor.untyped_storage()
    key = storage._cdata
    _host_only.add(key)
    weakref.finalize(storage, _host_only.discard, key)


def active_device() -> SimulatedDevice | None:
    """The simulated device counting tensors now (the latest started: `%gpumem --simulate`'s, or one a
    `with simulated_device(...)` block or a guarded run's `-l` started), or None."""
    return _active[-1] if _active else None
