"""bench/bench_fitmap.py's start state: every run of a fit map and every method starts with the simulated
device's cache emptied, as a retry's runs do (recover/retrying.py's clean-up). bench_retry_training.fresh
empties it before its `reset()` (the optimizer's state reloaded, a gc pass), so what that freed
stayed cached at the next run's start and whether a value fitted depended on the run before it (the 2 GiB
MLP: 97 and 98 fitted after 96, ran out as the first run; bench/README.md)."""
import json
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


def test_islands_are_the_values_that_run_out_below_the_largest():
    sys.path.insert(0, BENCH)
    try:
        import bench_fitmap
    finally:
        sys.path.remove(BENCH)
    seen = {1: True, 2: False, 3: False, 4: True, 5: False, 6: True, 7: False, 8: False}
    assert bench_fitmap.islands(seen) == [(2, 3), (5, 5)]       # 7-8 are above the largest (6): not islands
    assert bench_fitmap.islands({v: v <= 9 for v in range(1, 12)}) == []
    # consecutive among the values run: 2 and 4 with 3 not run make one range
    assert bench_fitmap.islands({1: True, 2: False, 4: False, 5: True}) == [(2, 4)]


@pytest.mark.parametrize("earlier, flags, says", [
    ({}, [], "needs its largest"),
    # a windowed map's runs (made before the cache was emptied at each start) are not resumed from
    ({"mlp": {"largest": 1706, "seen": {"1706": True}}}, ["--resume"], "reads only a --map-only JSON"),
])
def test_map_only_refuses_before_running(tmp_path, monkeypatch, earlier, flags, says):
    sys.path.insert(0, BENCH)
    try:
        import bench_fitmap
        import bench_retry_training
    finally:
        sys.path.remove(BENCH)
    maps = tmp_path / "maps.json"
    maps.write_text(json.dumps(earlier))
    ran = []
    monkeypatch.setattr(bench_retry_training, "shell", lambda: ran.append("shell"))
    with pytest.raises(SystemExit, match=says):
        bench_fitmap.main(["--cells", "mlp", "--map-only", "--maps", str(maps)] + flags)
    assert ran == []


def test_map_only_runs_every_value_past_the_first_window_and_every_nth_below(ip, fitmap, tmp_path):
    """The MLP's largest on its 64 MiB device is 1706 (bench/README.md, "Small devices: every value"):
    asked around 1700 with a window of 0.1%, the window (1698-1702) is raised while a value above it fits,
    up to 0.1% above 1706; under it every 700th value. Then resumed with every 350th: only the new ones."""
    bench_fitmap, _ = fitmap
    out = tmp_path / "map.json"
    bench_fitmap.main(["--cells", "mlp", "--map-only", "--estimate", "mlp=1700", "--window", "0.001",
                       "--below-every", "700", "--json", str(out)])
    r = json.loads(out.read_text())["mlp"]
    assert r["largest"] == 1706 and r["first_largest"] == 1700
    assert sorted(map(int, r["seen"])) == [298, 998] + list(range(1698, 1709))
    assert r["map"] == "298-1706 fit, 1707-1708 do not" and r["islands"] == []
    again = tmp_path / "again.json"
    bench_fitmap.main(["--cells", "mlp", "--map-only", "--maps", str(out), "--resume", "--window", "0.001",
                       "--below-every", "350", "--json", str(again)])
    r2 = json.loads(again.read_text())["mlp"]
    assert r2["first_largest"] == 1700 and r2["largest"] == 1706
    assert sorted(map(int, r2["seen"])) == [298, 648, 998, 1348] + list(range(1698, 1709))
