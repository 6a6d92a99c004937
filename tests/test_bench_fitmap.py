"""bench/bench_fitmap.py's start state: every run of a fit map and every method starts with the simulated
device's cache emptied, as a retry's runs do (recover/retrying.py's clean-up). bench_retry_training.fresh
empties it before its `reset()` (the optimizer's state reloaded, a gc pass), so what that freed
stayed cached at the next run's start and whether a value fitted depended on the run before it (the 2 GiB
MLP: 97 and 98 fitted after 96, ran out as the first run; bench/README.md)."""
import os
import sys

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "bench")


@pytest.fixture
def fitmap(ip):
    sys.path.insert(0, BENCH)
    import bench_fitmap
    import bench_retry_training

    bench_fitmap.prepared(ip, "mlp", "small")       # the MLP on its 64 MiB simulated device
    yield bench_fitmap, bench_retry_training
    bench_retry_training.run(ip, "%gpumem --simulate off -q")
    sys.path.remove(BENCH)


@pytest.mark.parametrize("before", [4096, 64])      # after a run out of memory, after one that fitted
def test_each_start_has_nothing_cached(ip, fitmap, before):
    from cuda_magic.devices.simulated import active_device

    bench_fitmap, _ = fitmap
    seen: dict = {}
    assert bench_fitmap.fits(ip, before, seen) is (before == 64)
    bench_fitmap.fresh(ip, 64)
    model = active_device().model
    assert model.allocated > 0                        # the model's parameters stay
    # no segment without an allocated block: empty_cache released every cached one (what stays free is in
    # segments that hold the parameters too, as after torch.cuda.empty_cache())
    idle = [s["total_size"] for s in model.snapshot() if s["allocated_size"] == 0]
    assert idle == [], idle
