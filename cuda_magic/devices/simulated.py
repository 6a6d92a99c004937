"""The simulated device: a CPU stand-in for a GPU of a chosen size.

While active, every tensor storage created in this thread counts against the device's capacity (views
once, keyed by storage), freeing it gives the bytes back at once (a finalizer on the storage, no gc
needed), and an allocation that does not fit raises torch's OutOfMemoryError
(`devices.errors.oom_error_class`) with a CUDA-style message before the memory is really taken: each op's
output sizes are first computed on the meta device.

What fits is decided as on a GPU: with `allocator="caching"` (the default) each storage takes a block of a model
of torch's CUDA caching allocator (devices/caching_allocator.py: 512-byte rounding, 2 MiB small and 20 MiB
large segments, cached free blocks, best fit, splits and merges, `max_split_size_mb`,
`expandable_segments`), so `allocated` counts rounded blocks as torch's allocated_bytes does, `reserved`
the segments, and a request fails when no cached block fits and no new segment can be reserved within
the capacity - with reserved-but-unallocated memory (fragmentation) where the cache holds it. The
allocator settings are the process's (PYTORCH_CUDA_ALLOC_CONF and friends, or what was set at runtime:
`allocator_conf.current_allocator_conf`, or what cuda_magic switched for simulated devices:
`apply_allocator_settings`) unless a device is given its own. "caching" is the default
(`SimulatedDevice.default_allocator`); `allocator="plain"` counts the storages' bytes against the
capacity, nothing rounded and nothing cached.
"""
from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager

from cuda_magic.devices.op_metadata import call_key, op_facts
from cuda_magic.devices.probe import real_storage, subclasses
from cuda_magic.devices.readings import DeviceMemory

_active: list[SimulatedDevice] = []   # devices counting now, the latest started last (mirrors the modes entered)
_following: weakref.WeakSet = weakref.WeakSet()   # caching devices that follow the process's allocator settings
_settings_here: str | None = None     # the allocator settings cuda_magic set for simulated devices, if any
ALLOCATORS = ("caching", "plain")
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

    def to_meta(x):
        if isinstance(x, tensor_type):
            return x.to(meta) if x.device.type != "meta" else x
        if isinstance(x, torch.device):
            return meta
        return x

    class SimulatedMemoryMode(TorchDispatchMode):
        def __init__(self, device: SimulatedDevice):
            super().__init__()
            self.device = device
            # Bytes an op's fresh outputs take, by the call's key (devices/op_metadata.py): a training step
            # repeats the same ops on the same shapes, so the meta pass runs once per key, not once per call.
            self.predicted: dict = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            facts = op_facts(func)
            fresh, any_fresh, has_device, lifted = facts.fresh, facts.any_fresh, facts.has_device, facts.lifted
            # a view op (every return an alias that is not written: view, t, detach, expand) makes no
            # storage and resizes none: nothing to count after it
            views = facts.views
            if any_fresh and self.device.checks_before:
                needed = self._predict(func, fresh, has_device, args, kwargs)
                if needed:
                    self.device._check(needed)
            try:
                out = func(*args, **kwargs)
            except BaseException:
                if self.device._pending:          # blocks taken for outputs the op did not make
                    self.device._drop_pending()
                raise
            if not views or lifted:
                self.device.track_outputs(out, fresh, lifted)
            return out

        def _predict(self, func, fresh, has_device, args, kwargs):
            try:
                key = call_key(func, args, kwargs)
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
            outs = meta_out if isinstance(meta_out, tuple) else (meta_out,)   # (a list is one Tensor[] return)
            sizes, seen = [], set()
            for is_fresh, value in zip(fresh, outs):
                if not is_fresh:
                    continue
                for leaf in tree_flatten(value)[0]:
                    if isinstance(leaf, tensor_type):
                        storage = leaf.untyped_storage()
                        nbytes = storage.nbytes()
                        if nbytes and storage._cdata not in seen:
                            seen.add(storage._cdata)
                            sizes.append(nbytes)
            return tuple(sizes)       # the bytes of each fresh storage, in the order the op makes them

    global _tensor_type
    _tensor_type = tensor_type
    _mode_class = SimulatedMemoryMode
    return _mode_class


def counting_mode_class():
    """The dispatch mode class that counts a device's storages (built on first use): a fake run extends it."""
    return _get_mode_class()


class SimulatedDevice:
    """A device of `capacity` bytes. Use as a context manager, or `start()` / `stop()`.

    `allocated` and `peak` are exact: every storage created while active is counted when created and
    released when its last reference goes. With `allocator="caching"` (`default_allocator`)
    each storage holds a block of a model of torch's CUDA caching allocator (`model`), so `allocated` is
    the blocks' rounded sizes and `reserved` the segments the model reserved, with the allocator
    settings `conf` ("max_split_size_mb:128,expandable_segments:True"; None: the process's settings,
    followed when cuda_magic changes them). `allocator="plain"`: the storages' bytes, nothing reserved
    beyond them.
    """

    kind = "simulated"
    #: the storage a device counts under a tensor (None: nothing of its own); the prediction's meter
    #: (a device that counts fake tensors) overrides it
    storage_of = staticmethod(real_storage)
    #: whether an op's output sizes are found (on the meta device) and checked before it runs; the
    #: prediction's meter, which never runs out, counts after
    checks_before = True
    #: the allocator of a device made without `allocator=` (`%gpumem --simulate`'s, `-l`'s without CUDA):
    #: "caching" (torch's caching allocator, as a GPU reserves) or "plain" (the storages' bytes)
    default_allocator = "caching"
    #: bytes of the cuBLAS workspace a prediction for this device counts per thread that multiplies
    #: matrices (fakerun/cuda_autocast.py, cublas_workspace_size); 0: none (the device's own runs never
    #: take one)
    cublas_workspace = 0

    def __init__(self, capacity: int, *, index: int = 0, name: str = "simulated GPU",
                 allocator: str | None = None, conf: str | None = None):
        if int(capacity) <= 0:
            raise ValueError(f"a simulated device needs a capacity above 0 bytes, not {capacity}")
        allocator = allocator or self.default_allocator
        if allocator not in ALLOCATORS:
            raise ValueError(f"allocator is one of {', '.join(ALLOCATORS)}, not {allocator!r}")
        if conf is not None and allocator != "caching":
            raise ValueError("allocator settings (conf) are the caching allocator's; allocator='plain' has none")
        self._capacity = int(capacity)
        self.index = index
        self.name = name
        self.allocator = allocator
        self.allocated = 0
        self.peak = 0
        self._live: dict[int, int] = {}          # storage key -> the bytes it counts for (its block's size)
        self._finalizers: dict[int, weakref.finalize] = {}
        self._lock = threading.Lock()
        self._mode = None
        self.recorders: tuple = ()    # black boxes (devices/blackbox.py) recording now: `%oomguard on`'s
                                      # around a cell, a guarded run's inside it
        self.model = None             # the caching allocator's model (None: the plain count)
        self._blocks: dict = {}       # storage key -> its block of the model
        self._pending: list = []      # (bytes, block) taken before an op for the storages it makes
        self.follows_settings = False
        if allocator == "caching":
            from cuda_magic.devices.caching_allocator import CachingAllocatorModel

            self.follows_settings = conf is None
            self.model = CachingAllocatorModel.from_conf(
                self._capacity, allocator_settings() if conf is None else conf, strict=conf is not None)
            if self.follows_settings:
                _following.add(self)

    @property
    def capacity(self) -> int:
        return self._capacity

    @capacity.setter
    def capacity(self, value: int) -> None:
        self._capacity = int(value)
        if self.model is not None:
            self.model.capacity = self._capacity

    @property
    def key(self) -> str:
        return f"sim:{self.index}"

    @property
    def active(self) -> bool:
        return self._mode is not None

    @property
    def counting_mode(self):
        """The dispatch mode counting for this device now (None when stopped): a fake run's holds its
        stand-in values' lines."""
        return self._mode

    @property
    def live_storages(self) -> int:
        return len(self._live)

    @property
    def reserved(self) -> int:
        """Bytes the device has reserved: what is allocated and the cache (free blocks of the segments the
        caching allocator holds); with the plain count, what is allocated."""
        model = self.model
        if model is None:
            return self.allocated
        return self.allocated + model.reserved - model.allocated

    @property
    def peak_reserved(self) -> int:
        return self.model.peak_reserved if self.model is not None else self.peak

    @property
    def expandable_segments(self) -> bool:
        return self.model is not None and self.model.expandable_segments

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> SimulatedDevice:
        if self._mode is not None:
            raise RuntimeError("this simulated device is already active")
        if self.follows_settings:
            self.model.configure(_named(allocator_settings()), strict=False)
        self._mode = self._make_mode()
        self._mode.__enter__()
        _active.append(self)
        return self

    def _make_mode(self):
        """The dispatch mode that counts for this device (a subclass may extend it: fakerun/fake_run.py)."""
        return _get_mode_class()(self)

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
            if self.model is not None:
                self.model.reset_peak()

    @contextmanager
    def limited(self, capacity: int):
        """Lower the capacity for a block (the `-l` cap of `%%oomguard`); restored afterwards. The caching
        allocator's model takes it as a memory fraction of the device: its expandable segments still span
        the device, and the whole allocation size is checked against the cap before pages are mapped."""
        old = self.capacity
        model = self.model
        total = model.device_total if model is not None else None
        if model is not None:
            model.device_total = old
        self.capacity = min(old, int(capacity))
        try:
            yield self
        finally:
            self.capacity = old
            if model is not None:
                model.device_total = total

    def configure(self, conf: str) -> None:
        """Change this device's allocator settings now, as torch's setter does (options not named go back
        to their defaults, expandable_segments keeps its value); from now on the device keeps its own
        settings rather than the process's. Segments reserved before stay as they were."""
        if self.model is None:
            raise ValueError("allocator='plain' has no allocator settings")
        with self._lock:
            self.model.configure(conf)
            self.follows_settings = False
            _following.discard(self)

    def enable_expandable_segments(self) -> str:
        """Switch expandable_segments on for this device's caching allocator, keeping its other settings:
        for every simulated device that follows the process's settings, now and made later in this process
        (torch's setting is the process's), or for this device alone where it has settings of its own. As
        in torch it changes only what is reserved afterwards. Returns a sentence saying so; RuntimeError
        for allocator="plain", which has no allocator to switch."""
        from cuda_magic.devices.allocator_conf import merge_conf

        if self.model is None:
            raise RuntimeError(
                "cannot switch on expandable_segments: this simulated device counts the storages' bytes "
                "(allocator='plain'), with no caching allocator to switch.")
        if self.model.expandable_segments:
            return (f"expandable_segments is already on for the simulated device (allocator settings "
                    f"{self.model.settings()!r}); nothing changed.")
        if self.follows_settings:
            new = merge_conf(allocator_settings(), expandable_segments=True)
            apply_allocator_settings(new)
            scope = "simulated devices in this process"
        else:
            new = merge_conf(self.model.settings(), expandable_segments=True)
            self.configure(new)
            scope = "this simulated device (it has allocator settings of its own)"
        return (f"expandable_segments switched on for {scope} (allocator settings now {new!r}): the "
                "simulated caching allocator grows one segment per pool instead of reserving one per "
                "request. Segments reserved before stay as they were until the device's cache is emptied "
                "(cuda_magic.devices.simulated.empty_caches(), as torch.cuda.empty_cache() on a GPU).")

    def empty_cache(self) -> int:
        """Give the cached segments that hold no storage back to the device (torch.cuda.empty_cache()):
        the bytes given back (0 with the plain count)."""
        if self.model is None:
            return 0
        with self._lock:
            return self.model.empty_cache()

    # -- accounting --------------------------------------------------------------------------------
    def _check(self, needed) -> None:
        """Before an op runs: whether its fresh storages fit. `needed`: their sizes in bytes, in the order
        the op makes them (a tuple), or one size (an int). The caching allocator takes their blocks now
        (`_pending`, given to the storages as they appear, `track_outputs`); what does not fit raises
        the out-of-memory error before memory is really taken."""
        if not needed:
            return
        model = self.model
        if model is None:
            total = needed if isinstance(needed, int) else sum(needed)
            if self.allocated + total > self.capacity:
                for recorder in self.recorders:
                    recorder.oom(total, self.allocated)
                raise self.out_of_memory(total)
            return
        from cuda_magic.devices.caching_allocator import CannotReserve

        sizes = (needed,) if isinstance(needed, int) else needed
        failure = None
        with self._lock:
            taken = []
            try:
                for nbytes in sizes:
                    taken.append((nbytes, model.malloc(nbytes)))
            except CannotReserve as exc:
                failure = exc.with_traceback(None)   # no frames kept (they hold the op's tensors)
                for _, block in taken:
                    model.free(block)
            else:
                self._pending.extend(taken)
        if failure is not None:
            for recorder in self.recorders:
                recorder.oom(failure.size, self.allocated)
            raise self.out_of_memory(failure.requested, failure)

    def _drop_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            for _, block in pending:
                self.model.free(block)

    def _take(self, nbytes: int):
        """The block for a new storage of `nbytes`: the one taken for it before the op, else a new one
        (may raise CannotReserve)."""
        pending = self._pending
        for i, (size, block) in enumerate(pending):
            if size == nbytes:
                del pending[i]
                return block
        return self.model.malloc(nbytes)

    def requested_bytes(self, key: int, default: int = 0) -> int:
        """The bytes the storage `key` asked for when its block was taken (`default` where it has none).
        Takes no lock: recorders call it while the device holds its own."""
        block = self._blocks.get(key)
        return block.requested if block is not None else default

    def allocator_copy(self):
        """A copy of the caching allocator's model as it is now, block by block (its cache, its holes), to
        try requests on without touching the device (devices/allocator_replay.py); None with the plain
        count."""
        if self.model is None:
            return None
        with self._lock:
            return deep_copy(self.model, len(self._blocks))

    def allocator_snapshot(self):
        """The allocator as it is now, kept: a callable giving a fresh copy of it at each call (a replay
        changes the copy it is given), for a later question about this moment; None with the plain count."""
        model = self.allocator_copy()
        if model is None:
            return None
        blocks = len(self._blocks)
        return lambda: deep_copy(model, blocks)

    def copy_state(self):
        """(a copy of the caching allocator's model, real storage key -> the copy's block), taken together."""
        with self._lock:
            return deep_copy((self.model, dict(self._blocks)), len(self._blocks))

    def _requested(self, key: int, counted: int) -> int:
        """The bytes a counted storage had when its block was taken (to see it resized in place)."""
        block = self._blocks.get(key)
        return block.requested if block is not None else counted

    def attach_recorder(self, recorder) -> None:
        """Record allocations, frees and failing requests into `recorder` (a blackbox.Recorder), besides
        any recording already; the storages alive now are its starting set."""
        with self._lock:
            recorder.seed(dict(self._live), self.allocated)
            self.recorders = (*self.recorders, recorder)

    def detach_recorder(self, recorder) -> None:
        with self._lock:
            self.recorders = tuple(r for r in self.recorders if r is not recorder)

    def out_of_memory(self, requested: int, failure=None):
        """The out-of-memory error for a request of `requested` bytes. With the caching allocator the
        message is torch's: the segment it tried to reserve, the free memory, what is allocated and what is
        reserved but unallocated (`failure`: the model's CannotReserve, else its figures now)."""
        from cuda_magic.devices.errors import oom_error_class

        model = self.model
        if model is None:
            free = max(0, self.capacity - self.allocated)
            msg = (
                f"CUDA out of memory (simulated device). Tried to allocate {torch_size_text(requested)}. "
                f"GPU {self.index} has a total capacity of {torch_size_text(self.capacity)} of which "
                f"{torch_size_text(free)} is free. Including non-PyTorch memory, this process has "
                f"{torch_size_text(self.allocated)} memory in use. Of the allocated memory "
                f"{torch_size_text(self.allocated)} is allocated by PyTorch, and 0 bytes is reserved by "
                "PyTorch but unallocated.")
            return oom_error_class()(msg)
        if failure is not None:
            alloc_size, allocated, reserved = failure.alloc_size, failure.allocated, failure.reserved
        else:
            alloc_size = model.allocation_size(model.round_size(max(1, int(requested))))
            allocated, reserved = model.allocated, model.reserved
        msg = (
            f"CUDA out of memory (simulated device). Tried to allocate {torch_size_text(alloc_size)}. "
            f"GPU {self.index} has a total capacity of {torch_size_text(self.capacity)} of which "
            f"{torch_size_text(max(0, self.capacity - reserved))} is free. Including non-PyTorch memory, "
            f"this process has {torch_size_text(reserved)} memory in use. Of the allocated memory "
            f"{torch_size_text(allocated)} is allocated by PyTorch, and "
            f"{torch_size_text(max(0, reserved - allocated))} is reserved by PyTorch but unallocated. If "
            "reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF="
            "expandable_segments:True to avoid fragmentation.")
        return oom_error_class()(msg)

    def track_outputs(self, out, fresh, lifted: bool) -> None:
        """Count the storages an op made (`out`; `fresh`: per return, whether it is new, devices/op_metadata.py's
        OpFacts; `lifted`: storages made outside the dispatcher, counted as new): what a counting mode calls
        after each op."""
        tensor_type = _tensor_type
        # an op of several returns gives a tuple; a list is one return of type Tensor[] (the _foreach_ ops),
        # each of its tensors counted
        outs = out if isinstance(out, tuple) else (out,)
        model = self.model
        grown = 0
        failure = None
        for is_fresh, value in zip(fresh, outs):
            for leaf in (value if isinstance(value, (tuple, list)) else (value,)):
                if not isinstance(leaf, tensor_type):
                    continue
                storage = self.storage_of(leaf)     # fake, meta and wrapper tensors hold nothing of their own
                if storage is None:
                    continue
                key = storage._cdata
                nbytes = storage.nbytes()
                with self._lock:
                    known = self._live.get(key)
                    if known is None:
                        if not (is_fresh or lifted) or (lifted and key in _host_only):
                            continue  # a view or in-place result of a storage made before we started
                        if model is None:
                            counted = nbytes
                        else:
                            try:
                                block = self._take(nbytes)
                            except _cannot_reserve() as exc:   # no size known before the op ran
                                failure = exc.with_traceback(None)
                                continue
                            counted = 0
                            if block is not None:
                                self._blocks[key] = block
                                counted = block.size
                        self._live[key] = counted
                        self.allocated += counted
                        self._finalizers[key] = weakref.finalize(storage, self._release, key)
                        for recorder in self.recorders:
                            recorder.alloc(key, counted, self.allocated)
                    elif model is None and nbytes != known:    # resized in place (out= arguments, resize_)
                        delta = nbytes - known
                        grown += max(0, delta)
                        self._live[key] = nbytes
                        self.allocated += delta
                        for recorder in self.recorders:
                            recorder.resize(key, nbytes, self.allocated)
                    elif model is not None and nbytes != self._requested(key, known):
                        old = self._blocks.get(key)     # resized in place: a new block, then the old one
                        try:                            # given back, as on a GPU
                            block = model.malloc(nbytes)
                        except _cannot_reserve() as exc:
                            failure = exc.with_traceback(None)
                            continue
                        counted = block.size if block is not None else 0
                        model.free(old)
                        if block is None:
                            self._blocks.pop(key, None)
                        else:
                            self._blocks[key] = block
                        self._live[key] = counted
                        self.allocated += counted - known
                        for recorder in self.recorders:
                            recorder.resize(key, counted, self.allocated)
                    if self.allocated > self.peak:
                        self.peak = self.allocated
        if self._pending:
            self._drop_pending()          # the op made fewer or other storages than its meta pass said
        if failure is not None:
            for recorder in self.recorders:
                recorder.oom(failure.size, self.allocated)
            raise self.out_of_memory(failure.requested, failure)
        if grown and self.allocated > self.capacity:
            for recorder in self.recorders:
                recorder.oom(grown, self.allocated - grown)
            raise self.out_of_memory(grown)

    def _release(self, key: int) -> None:
        with self._lock:
            counted = self._live.pop(key, 0)    # the block's size (read before the free: a freed block
            self._finalizers.pop(key, None)     # merges with its neighbours), or the storage's bytes
            block = self._blocks.pop(key, None)
            self.allocated -= counted
            if block is not None:
                self.model.free(block)
            for recorder in self.recorders:
                recorder.free(key, self.allocated)

    def count_existing(self) -> int:
        """Count the CPU tensor storages that already exist (one gc scan), as a GPU counts what the notebook
        already holds: `-l` without CUDA then caps the whole, not only the cell's increase. Storages marked
        `host_only` (copies kept in host memory) are left out, and so are tensors that hold no memory of
        their own (meta tensors). With the caching allocator each takes a block, reserved even past the
        capacity (the memory exists). Returns the bytes added."""
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
                counted = nbytes
                if self.model is not None:
                    block = self.model.malloc(nbytes, force=True)
                    self._blocks[key] = block
                    counted = block.size
                self._live[key] = counted
                self.allocated += counted
                self._finalizers[key] = weakref.finalize(storage, self._release, key)
                added += counted
        with self._lock:
            self.peak = max(self.peak, self.allocated)
        return added

    def tracks(self, tensor) -> bool:
        """Whether this device counts the storage under `tensor`."""
        return self.counts(tensor.untyped_storage()._cdata)

    def counts(self, storage_key: int) -> bool:
        """Whether this device counts the storage whose `untyped_storage()._cdata` is `storage_key`."""
        return storage_key in self._live

    def counted(self, storage_key: int) -> int:
        """The bytes the storage whose `untyped_storage()._cdata` is `storage_key` counts for here (its
        block's size with the caching allocator), 0 where it is not counted."""
        return self._live.get(storage_key, 0)

    def forget(self) -> None:
        """Stop following the storages counted so far (a device that is switched off for good); the
        caching allocator gives back everything it reserved."""
        with self._lock:
            for fin in self._finalizers.values():
                fin.detach()
            self._finalizers.clear()
            self._live.clear()
            self.allocated = 0
            model = self.model
            if model is not None:
                blocks, self._blocks = self._blocks, {}
                pending, self._pending = self._pending, []
                for block in [*blocks.values(), *(b for _, b in pending)]:
                    if block is not None:
                        model.free(block)
                model.empty_cache()

    def memory(self) -> DeviceMemory:
        reserved = self.reserved
        notes = ["simulated device: counts tensors created in this thread"]
        if self.model is not None:
            notes.append("reserves as torch's CUDA caching allocator"
                         + (" with expandable segments" if self.model.expandable_segments else ""))
        return DeviceMemory(
            key=self.key, name=f"{self.name} ({torch_size_text(self.capacity)})", kind=self.kind,
            capacity=self.capacity, torch_allocated=self.allocated,
            torch_cached=max(0, reserved - self.allocated),
            other_this_process=0, other_processes=0, free=max(0, self.capacity - reserved),
            peak=self.peak, peak_exact=True, notes=notes)

    def __repr__(self) -> str:
        state = "active" if self.active else "inactive"
        reserved = f", {self.reserved} reserved" if self.model is not None else ""
        return (f"<SimulatedDevice {self.key} {state}: {self.allocated} of {self.capacity} bytes "
                f"allocated{reserved}, peak {self.peak}>")


def _cannot_reserve():
    from cuda_magic.devices.caching_allocator import CannotReserve

    return CannotReserve


def allocator_settings() -> str:
    """The allocator settings simulated devices that follow the process's take: what cuda_magic set for
    them (`apply_allocator_settings`: `%%oomguard --expandable-segments` on a simulated device), else
    the process's (`allocator_conf.current_allocator_conf`: the environment's, or what was set at
    runtime)."""
    if _settings_here is not None:
        return _settings_here
    from cuda_magic.devices.allocator_conf import current_allocator_conf

    return current_allocator_conf()


def apply_allocator_settings(conf: str | None) -> None:
    """Use the allocator settings `conf` for simulated devices from now on: the caching devices that
    follow the process's settings take them now (as torch's setter: for what they reserve afterwards) and
    so do devices made later. None: back to the process's settings."""
    global _settings_here
    _settings_here = conf
    settings = _named(allocator_settings())
    for dev in list(_following):
        if dev.follows_settings and dev.model is not None:
            with dev._lock:
                dev.model.configure(settings, strict=False)


def _named(settings: str) -> str:
    """`settings` naming expandable_segments (off where they do not), so that applying them switches it
    off too: torch's setter keeps expandable_segments where a string does not name it."""
    from cuda_magic.devices.allocator_conf import conf_value, merge_conf

    if conf_value(settings, "expandable_segments") is None:
        return merge_conf(settings, expandable_segments=False)
    return settings


@contextmanager
def simulated_device(capacity, *, index: int = 0, allocator: str | None = None, conf: str | None = None):
    """`with simulated_device("8GiB") as dev:` - tensors created inside count against `dev`. `allocator`
    and `conf` as for SimulatedDevice ("plain": the storages' bytes; conf: its own allocator settings)."""
    from cuda_magic.units import parse_size

    nbytes = parse_size(capacity, allow_fraction=False) if isinstance(capacity, str) else int(capacity)
    dev = SimulatedDevice(nbytes, index=index, allocator=allocator, conf=conf)
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


def empty_caches() -> int:
    """Give back the cached segments of the simulated devices counting now, as torch.cuda.empty_cache()
    does on a GPU (the clean-up after an out-of-memory error calls both). Returns the bytes given back."""
    return sum(dev.empty_cache() for dev in list(_active))


def deep_copy(obj, blocks: int):
    """copy.deepcopy of an allocator's model (or of what holds it): its blocks link to their neighbours,
    so the recursion goes as deep as a segment has blocks."""
    import copy
    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20 * blocks + 10_000))
    try:
        return copy.deepcopy(obj)
    finally:
        sys.setrecursionlimit(limit)
