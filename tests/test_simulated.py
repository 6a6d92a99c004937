"""The simulated device counts exactly what is alive: checked against the storages the garbage collector
finds, after sequences of real torch operations."""
from __future__ import annotations

import gc
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from cuda_magic.devices.simulated import SimulatedDevice, simulated_device  # noqa: E402

MiB = 2**20




def gpu(*sizes: int) -> int:
    """What torch's allocated_bytes counts for storages of these sizes (each at most 1 MiB: the small pool,
    where a block is the request rounded up to 512 bytes, `round_size` in c10/cuda/CUDACachingAllocator.cpp,
    torch 2.2 to 2.13); an empty storage takes no block."""
    return sum(0 if n == 0 else -(-n // 512) * 512 for n in sizes)


class Ledger:
    """The storages created while a device was active, as gc finds them (keyed by StorageImpl address).

    The tensors alive before are kept alive here, so that no new storage can take one of their addresses.
    """

    def __init__(self):
        gc.collect()
        self.before = [o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)]
        self.before_keys = {t.untyped_storage()._cdata for t in self.before if t.device.type == "cpu"}

    def live(self, collect: bool = True) -> dict[int, int]:
        if collect:
            gc.collect()
        found = {}
        for o in gc.get_objects():
            if issubclass(type(o), torch.Tensor) and o.device.type == "cpu":
                storage = o.untyped_storage()
                if storage._cdata not in self.before_keys:
                    found[storage._cdata] = storage.nbytes()
        return found

    def check(self, dev: SimulatedDevice, collect: bool = True) -> None:
        live = self.live(collect)
        # every live storage holds one block; these tests make storages of at most 1 MiB (the small pool)
        assert dev._live == {key: gpu(n) for key, n in live.items()}
        assert dev.allocated == gpu(*live.values()) == dev.model.allocated, (dev.allocated, live, dev._live)


@pytest.fixture
def ledger(torch_warm):
    book = Ledger()
    yield book
    book.before.clear()


def test_creates_views_inplace_out_and_deletes(ledger):
    with SimulatedDevice(1 << 30) as dev:
        a = torch.randn(100, 100)
        ledger.check(dev)
        v = a[:10]                       # a view: no new storage
        a.add_(1)                        # in place: nothing new
        a.t_()
        ledger.check(dev)
        b = torch.empty(0)
        torch.add(a, a, out=b)           # out= resizes an empty tensor
        assert b.untyped_storage().nbytes() == 40_000
        ledger.check(dev)
        c = torch.tensor([1.0, 2.0, 3.0])
        d = a.to(torch.float64)
        e = a.clone()
        f = torch.cat([a, a])
        ledger.check(dev)
        assert dev.allocated == gpu(40_000, 40_000, 12, 80_000, 40_000, 80_000)
        del v, a
        ledger.check(dev)                # `a` lives on through nothing: its storage is given back
        del b, c, d, e, f
        ledger.check(dev)
        assert dev.allocated == 0


def test_autograd_saved_activations_count_until_the_graph_is_freed(ledger):
    with SimulatedDevice(1 << 30) as dev:
        x = torch.randn(64, 32)
        w = torch.randn(32, 16, requires_grad=True)
        ledger.check(dev)
        loss = (x @ w).relu().sum()
        # relu saves its output (64 x 16 floats), alive only inside the graph; the matmul's output is gone
        assert dev.allocated == gpu(64 * 32 * 4, 32 * 16 * 4, 64 * 16 * 4, 4)
        ledger.check(dev)
        loss.backward()                  # frees the saved output, creates w.grad
        assert w.grad is not None
        assert dev.allocated == gpu(64 * 32 * 4, 32 * 16 * 4, 4, 32 * 16 * 4)
        ledger.check(dev)
        del loss
        ledger.check(dev)
        y = (x @ w).sigmoid()            # graph kept alive by y: sigmoid saves its output, which is y
        ledger.check(dev)
        del y
        ledger.check(dev)


def test_peak_is_exact(torch_warm):
    with SimulatedDevice(1 << 30) as dev:
        keep = torch.zeros(1000)                      # 4000 bytes
        dev.reset_peak()
        tmp = torch.empty(2**20, dtype=torch.uint8)
        del tmp
        small = torch.zeros(10)
        assert dev.peak == gpu(4000, 2**20)
        assert dev.allocated == gpu(4000, 40)
        del keep, small


def test_freed_bytes_come_back_at_once_without_gc(torch_warm):
    with SimulatedDevice(1 << 30) as dev:
        t = torch.zeros(1000)
        u = t.view(10, 100)
        gc.disable()
        try:
            del t
            assert dev.allocated == gpu(4000)     # a view still holds the storage
            del u
            assert dev.allocated == 0
        finally:
            gc.enable()


def _rss() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
def test_oom_is_raised_before_allocating(torch_warm):
    with simulated_device("16GiB") as dev:
        held = torch.zeros(256)
        rss = _rss()
        with pytest.raises(torch.cuda.OutOfMemoryError) as excinfo:
            torch.empty(100 * 2**30, dtype=torch.uint8)
        assert "CUDA out of memory" in str(excinfo.value)
        assert "Tried to allocate 100.00 GiB" in str(excinfo.value)
        # an allocation that would really touch its pages: 2 GiB of ones on a 1 GiB device
        with dev.limited(2**30):
            with pytest.raises(torch.cuda.OutOfMemoryError):
                torch.ones(2 * 2**30, dtype=torch.uint8)
        assert _rss() - rss < 256 * 2**20
        assert dev.allocated == 1024
        assert dev.capacity == 16 * 2**30
        del held


@pytest.mark.parametrize("allocator", ["caching", "plain"])
def test_oom_on_growth_of_an_out_tensor(torch_warm, allocator):
    if allocator == "plain":
        dev, n = SimulatedDevice(10_000, allocator="plain"), 1000   # 4000 bytes, 8000 more: past 10 000
    else:
        # 8 MiB in a 20 MiB segment; growing to 16 MiB needs a segment of its own: 36 MiB past 24
        dev, n = SimulatedDevice(24 * MiB), 2 * MiB
    with dev:
        a = torch.zeros(n)
        out = torch.empty(0)
        with pytest.raises(torch.cuda.OutOfMemoryError):
            torch.cat([a, a], out=out)
        del a, out
    assert dev.allocated == 0


def test_storages_made_before_are_not_counted(torch_warm):
    before = torch.zeros(1000)
    with SimulatedDevice(1 << 30) as dev:
        view = before[:10]
        before.mul_(2)
        assert dev.allocated == 0
        del view
    del before


def test_deep_copies_and_loaded_states_are_counted(ledger):
    """copy.deepcopy makes its storage outside the dispatcher (UntypedStorage(n), then set_): a copy of a
    model's or an optimizer's state is device memory on a GPU, and counts here too, until freed."""
    import copy

    with SimulatedDevice(1 << 30) as dev:
        model = torch.nn.Linear(256, 1024)
        opt = torch.optim.Adam(model.parameters())
        model(torch.randn(2, 256)).sum().backward()
        opt.step()
        before = dev.allocated
        saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
        # the weights, exp_avg and exp_avg_sq, and the two step counters (one-element tensors)
        assert dev.allocated == before + 3 * gpu(256 * 1024 * 4, 1024 * 4) + 2 * gpu(4)
        opt.load_state_dict(copy.deepcopy(saved[1]))
        ledger.check(dev)
        del saved
        ledger.check(dev)
        import io

        file = io.BytesIO()
        torch.save(model.state_dict(), file)
        file.seek(0)
        before = dev.allocated
        loaded = torch.load(file)                       # storages read from the file, then set_
        assert dev.allocated == before + gpu(256 * 1024 * 4, 1024 * 4)
        del loaded, model, opt
    gc.collect()


def test_stop_keeps_giving_back_and_inactive_creation_is_not_counted(torch_warm):
    dev = SimulatedDevice(1 << 30).start()
    t = torch.zeros(100)
    dev.stop()
    u = torch.zeros(100)
    assert dev.allocated == gpu(400) and not dev.active
    del t
    assert dev.allocated == 0
    del u


_OPS = st.lists(st.tuples(st.sampled_from(["new", "view", "inplace", "out", "clone", "cat", "to", "tensor",
                                           "del", "add"]),
                          st.integers(1, 64), st.integers(0, 100)), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_random_sequences_match_the_live_storages(ledger, ops):
    with SimulatedDevice(1 << 30) as dev:
        pool: list = []
        for op, n, pick in ops:
            target = pool[pick % len(pool)] if pool else None
            if op == "new" or target is None:
                pool.append(torch.zeros(n))
            elif op == "view":
                pool.append(target.view(-1)[: max(1, target.numel() // 2)])
            elif op == "inplace":
                target.add_(1)
            elif op == "out":
                pool.append(torch.empty(0))
                torch.mul(target, 2, out=pool[-1])
            elif op == "clone":
                pool.append(target.clone())
            elif op == "cat":
                pool.append(torch.cat([target, target]))
            elif op == "to":
                pool.append(target.to(torch.float64))
            elif op == "tensor":
                pool.append(torch.tensor([float(i) for i in range(n)]))
            elif op == "add":
                pool.append(target + 1)
            else:
                pool.pop(pick % len(pool))
            target = None
        ledger.check(dev, collect=False)   # these ops make no reference cycles: refcounts free at once
        peak = dev.peak
        pool.clear()
        assert dev.allocated == 0
        assert peak >= dev.allocated


def test_output_sizes_are_predicted_once_per_shape(torch_warm):
    """The meta pass runs once per op and argument shapes; a repeated op reuses the size it predicted,
    and a new shape or a new scalar argument is predicted afresh (and still fails before allocating)."""
    torch = torch_warm
    from cuda_magic.devices.simulated import SimulatedDevice

    dev = SimulatedDevice(40 << 20)
    with dev:
        a = torch.ones(256, 256)
        for _ in range(3):
            b = a @ a
        cached = len(dev.counting_mode.predicted)
        b = a @ a
        assert len(dev.counting_mode.predicted) == cached
        big = torch.ones(4096, 512)
        with pytest.raises(torch.cuda.OutOfMemoryError):
            big @ big.T             # 22 MiB reserved (a 2 MiB and a 20 MiB segment), 64 MiB more asked
        assert len(dev.counting_mode.predicted) > cached
        assert dev.allocated == (256 * 256 + 256 * 256 + 4096 * 512) * 4


def test_each_tensor_of_a_foreach_ops_list_is_counted():
    # `_foreach_add.Scalar(Tensor[] self, Scalar scalar) -> Tensor[]` (aten/src/ATen/native/native_functions.yaml,
    # torch 2.2 to 2.13): one return, a list; clip_grad_norm_ calls `_foreach_norm` on the CPU, and optimizers
    # with foreach=True (the default on CUDA) make every temporary so
    import torch

    from cuda_magic.devices.simulated import simulated_device

    for allocator, each in (("plain", 4000), ("caching", 4096)):
        with simulated_device(1 << 30, allocator=allocator) as device:
            xs = [torch.ones(1000) for _ in range(4)]
            before = device.allocated
            out = torch._foreach_add(xs, 1.0)
            assert device.allocated - before == 4 * each, allocator
            del xs, out


def test_a_remembered_size_is_not_used_after_the_default_dtype_changed():
    """The sizes the meta pass found are remembered by the call's key (devices/op_metadata.py), which holds
    the default dtype: `torch.zeros(n)` in float64 after the same call in float32 takes twice the bytes, and
    fails before allocating where they do not fit (the key had the arguments only: the plain count took
    110 MiB of 100 with no error, and the message said 30 MiB were asked)."""
    import torch

    from cuda_magic.devices.simulated import SimulatedDevice

    n = 30 * 2**20 // 4
    for allocator in ("plain", "caching"):
        with SimulatedDevice(100 << 20, allocator=allocator) as dev:
            a = torch.zeros(n)                        # 30 MiB in float32: its size remembered
            del a
            held = torch.empty(50 << 20, dtype=torch.uint8)
            old = torch.get_default_dtype()
            torch.set_default_dtype(torch.float64)
            try:
                with pytest.raises(torch.cuda.OutOfMemoryError, match="Tried to allocate 60.00 MiB"):
                    torch.zeros(n)                    # 60 MiB: 110 of 100
            finally:
                torch.set_default_dtype(old)
            assert dev.allocated <= dev.capacity and held.numel() == 50 << 20
