"""The prediction's meter: a simulated device that counts fake tensors (torch's FakeTensor: a tensor with
its sizes, dtype and device but a storage on the meta device) as the device would count real ones.

It counts the fresh outputs of every op on the metered device (the same rule as the simulated device,
`devices/simulated.py`, whose accounting it reuses: storages once, freed when the last reference goes)
and never runs out: a fake run measures the peak it would reach, and the capacity is compared after.
What it holds at the start stands for what the device holds now: the storages of the fake copies of the
namespace's modules and optimizers (`fakerun/fakes.py`), and a fixed part for the rest.

`KindTally`, attached as a recorder, says what each storage is (parameters, gradients, optimizer state,
activations, the rest) and keeps what was alive at the peak, so that the peak can be split by kind.
"""
from __future__ import annotations

from cuda_magic.devices.simulated import SimulatedDevice

NEVER = 1 << 62                      # the fake device's capacity: a fake run never runs out

PARAMETERS, GRADIENTS, OPTIMIZER, ACTIVATIONS, REST = (
    "parameters", "gradients", "optimizer state", "activations", "the rest")
KINDS = (PARAMETERS, GRADIENTS, OPTIMIZER, ACTIVATIONS, REST)


class FakeDevice(SimulatedDevice):
    """Counts the FakeTensors on `device` (a torch.device: cpu for the simulated device, cuda:N).

    allocator / conf: as the metered device reserves ('caching' with its settings: a GPU's, or the
    simulated device's; 'plain': tensors' bytes). capacity: what the cell must fit in. A request the
    caching allocator could not reserve there is noted (`runs_out`: the first one, with the figures then)
    and reserved anyway, so that the run goes on to its whole peak."""

    checks_before = False

    def __init__(self, device, *, key: str, fixed: int = 0, capacity: int | None = None,
                 allocator: str = "plain", conf: str | None = None, template=None):
        caching = allocator == "caching"
        super().__init__(capacity if (caching and capacity) else NEVER, name="predicted",
                         allocator="caching" if caching else "plain", conf=(conf or "") if caching else None)
        self.device = device
        self._key = key
        self.runs_out = None             # (requested, allocated, reserved) of the first request that failed
        self.fixed = int(fixed)          # bytes the device holds now besides the fake copies' storages
        self._fixed_block = None
        self._real_blocks: dict = {}     # real storage key -> its block in the copied allocator
        if caching and getattr(template, "model", None) is not None:
            # the simulated device's allocator as it is now, block by block (its cache, its holes): the
            # fake copies take over their real storages' blocks, and what else it holds stays held
            self.model, self._real_blocks = template.copy_state()
            # a cap below the device is a memory fraction: segments still span the device
            device = self.model.device_total or template.capacity
            self.model.capacity = capacity if capacity else NEVER
            self.model.device_total = device if capacity else None
            self.allocated = template.allocated
            self.fixed = 0
        elif self.model is not None and self.fixed:
            self._fixed_block = self.model.malloc(self.fixed, force=True)
            self.allocated = self._fixed_block.size
        else:
            self.allocated = self.fixed
        self.peak = self.allocated

    mode_factory = None                  # device -> its dispatch mode (the fake run's, fakerun/fake_run.py)

    def _make_mode(self):
        return self.mode_factory(self) if self.mode_factory is not None else super()._make_mode()

    @property
    def key(self) -> str:
        return self._key

    @property
    def peak_reserved(self) -> int:
        return self.model.peak_reserved if self.model is not None else self.peak

    def storage_of(self, tensor):
        from torch._subclasses.fake_tensor import FakeTensor

        if not isinstance(tensor, FakeTensor):
            return None
        device = tensor.device
        if device.type != self.device.type or (self.device.index is not None and device.index != self.device.index):
            return None
        return tensor.untyped_storage()

    def _take(self, nbytes: int):
        from cuda_magic.devices.caching_allocator import CannotReserve

        if self.runs_out is not None:          # past the capacity already: reserve on (no release path
            return self.model.malloc(nbytes, force=True)   # to walk at every request)
        try:
            return super()._take(nbytes)
        except CannotReserve:
            self.runs_out = (nbytes, self.allocated, self.model.reserved)
            return self.model.malloc(nbytes, force=True)

    def hold(self, tensor, real=None) -> int | None:
        """Count the storage of a fake copy as the device's from the start (it stands for `real`, which the
        device holds now). Returns its key, or None where it is not on this device or counted already."""
        import weakref

        storage = self.storage_of(tensor)
        if storage is None:
            return None
        key = storage._cdata
        with self._lock:
            if key in self._live:
                return None
            nbytes = storage.nbytes()
            counted = nbytes
            taken = self._real_blocks.pop(real.untyped_storage()._cdata, None) if real is not None else None
            if taken is not None:          # its real storage's block: already counted in `allocated`
                self._blocks[key] = taken
                self._live[key] = taken.size
                self._finalizers[key] = weakref.finalize(storage, self._release, key)
                return key
            if self._real_blocks or (self.model is not None and not nbytes):
                return None                # copied allocator: a storage without a block is not on it
            if self.model is not None and nbytes:
                block = self.model.malloc(nbytes, force=True)
                self._blocks[key] = block
                counted = block.size
            self._live[key] = counted
            self.allocated += counted
            self.peak = max(self.peak, self.allocated)
            self._finalizers[key] = weakref.finalize(storage, self._release, key)
        return key

    workspace = 0                        # bytes of one cuBLAS workspace (0: none counted)
    workspaces_pending = False           # whether a thread's workspace is still to be counted (read per op)

    def set_workspace(self, nbytes: int) -> None:
        self.workspace = int(nbytes)
        self.workspaces_pending = self.workspace > 0
        self._workspaces: dict = {}

    def take_workspace(self, thread: str) -> None:
        """Count a cuBLAS workspace for `thread` ('forward', 'backward') once: allocated through the caching
        allocator at the thread's first matrix product and kept for the process."""
        if thread in self._workspaces or not self.workspace:
            return
        with self._lock:
            block = self._take(self.workspace) if self.model is not None else None
            counted = block.size if block is not None else self.workspace
            self._workspaces[thread] = block
            self.allocated += counted
            self.peak = max(self.peak, self.allocated)
        self.workspaces_pending = len(self._workspaces) < 2

    def start_peaks(self) -> None:
        """The peaks start from what is held when the run starts."""
        self.peak = self.allocated
        if self.model is not None:
            self.model.reset_peak()


class KindTally:
    """A recorder (the interface of devices/recorder.py's) that labels each storage with a kind when it is
    made, from what is running then: an optimizer's step (optimizer state), a module's forward pass or
    autograd's backward pass (activations), else the rest. `label()` changes a storage's kind once more
    is known (a gradient once autograd has accumulated it into `.grad`). The alive set at the peak is kept
    (copied at the first free after a new peak) and split by kind at the end, with the labels known then.
    Each storage made gets a serial number, and labels go by it: a storage's key (its address) is reused
    once it is freed, and a label given to the new one must not reach the old one at the peak."""

    def __init__(self):
        import torch

        self._graph_task = getattr(torch._C, "_current_graph_task_id", None)   # -1 outside backward
        self.kind: dict[int, str] = {}             # serial -> kind
        self.alive: dict[int, tuple[int, int]] = {}   # key -> (bytes, serial)
        self.serial = 0
        self.fixed = 0
        self.allocated = self.peak = 0
        self.at_peak: dict[int, tuple[int, int]] = {}
        self._stale = False
        self.in_step = 0                 # depth of optimizer steps running
        self.in_module = 0               # depth of module forward calls running

    def _new(self, nbytes: int, kind: str) -> tuple[int, int]:
        self.serial += 1
        self.kind[self.serial] = kind
        return nbytes, self.serial

    def seed(self, live: dict[int, int], allocated: int | None = None) -> None:
        self.alive = {key: self._new(nbytes, REST) for key, nbytes in live.items()}
        self.allocated = self.peak = allocated if allocated is not None else sum(live.values())
        self.fixed = self.allocated - sum(live.values())
        self.at_peak = dict(self.alive)

    def _now(self) -> str:
        if self.in_step:
            return OPTIMIZER
        if self.in_module or (self._graph_task is not None and self._graph_task() != -1):
            return ACTIVATIONS
        return REST

    def _take_peak(self) -> None:
        if self._stale:
            self.at_peak, self._stale = dict(self.alive), False

    def alloc(self, key: int, nbytes: int, allocated: int, *_, **__) -> None:
        self.alive[key] = self._new(nbytes, self._now())
        self.allocated = allocated
        if allocated > self.peak:
            self.peak, self._stale = allocated, True

    def free(self, key: int, allocated: int, *_, **__) -> None:
        self._take_peak()
        self.alive.pop(key, None)
        self.allocated = allocated

    def resize(self, key: int, nbytes: int, allocated: int, *_, **__) -> None:
        entry = self.alive.get(key)
        if entry is not None:
            if nbytes < entry[0]:
                self._take_peak()
            self.alive[key] = (nbytes, entry[1])
        self.allocated = allocated
        if allocated > self.peak:
            self.peak, self._stale = allocated, True

    def oom(self, *_, **__) -> None:
        return None

    def label(self, key: int | None, kind: str) -> None:
        entry = self.alive.get(key) if key is not None else None
        if entry is not None:
            self.kind[entry[1]] = kind

    def label_tensor(self, tensor, kind: str) -> None:
        try:
            key = tensor.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError, AttributeError):
            return
        self.label(key, kind)

    def peak_by_kind(self) -> dict[str, int]:
        """Bytes of each kind alive at the peak; the fixed part (what the device held besides the fake
        copies) is the rest."""
        self._take_peak()
        out = dict.fromkeys(KINDS, 0)
        out[REST] += self.fixed
        for nbytes, serial in self.at_peak.values():
            out[self.kind.get(serial, REST)] += nbytes
        return {k: v for k, v in out.items() if v}
