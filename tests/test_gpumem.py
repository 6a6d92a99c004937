"""`%gpumem` in a real IPython shell on a machine without a GPU (NVML faked absent where there is one)."""
from __future__ import annotations

import gc

import pytest
from conftest import run_ok
from IPython.core.error import UsageError

pytestmark = pytest.mark.usefixtures("no_gpu")


def _row(snap, name):
    """The tensor record one of whose names is exactly `name`."""
    found = [t for t in snap.tensor_list if name in t.names]
    assert len(found) == 1, (name, [t.names for t in snap.tensor_list])
    return found[0]


def test_cpu_only_prints_one_line_note_and_the_cpu_view(tip, capsys):
    capsys.readouterr()
    tip.run_line_magic("gpumem", "")
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if "No GPU found" in line]
    assert len(notes) == 1
    assert "CPU memory" in out
    assert "Traceback" not in out


def test_tensor_and_its_view_are_one_row_with_both_names(tip):
    run_ok(tip, "x = torch.zeros(1000, 250)\nv = x[:10]")
    snap = tip.run_line_magic("gpumem", "-o -q")
    row = _row(snap, "x")
    assert set(row.names) >= {"x", "v"}
    assert row.nbytes == 1000 * 250 * 4 and row.views == 2 and row.shape == (1000, 250)
    frame = snap.tensors
    line = frame[frame["names"].str.contains(r"\bx\b")]
    assert len(line) == 1 and "v" in line.iloc[0]["names"].split(", ")


def test_snapshot_holds_no_reference_to_tensors(tip):
    run_ok(tip, "x = torch.zeros(1000, 250)\nv = x[:10]\nwx = weakref.ref(x)\nws = weakref.ref(x.untyped_storage())")
    snap = tip.run_line_magic("gpumem", "-o -q")
    assert snap.tensor_count >= 1
    run_ok(tip, "del x, v")
    gc.collect()
    assert tip.user_ns["wx"]() is None
    assert tip.user_ns["ws"]() is None
    assert _row(snap, "x").nbytes == 1_000_000    # the snapshot itself still reads fine


def test_names_of_params_optimizer_state_and_list_items(tip):
    run_ok(tip, "model = torch.nn.Sequential()\nmodel.fc = torch.nn.Linear(16, 8)\n"
                "opt = torch.optim.Adam(model.parameters())\n"
                "model.fc(torch.ones(2, 16)).sum().backward()\nopt.step()\n"
                "losses = [torch.full((7 + i,), float(i)) for i in range(5)]")
    snap = tip.run_line_magic("gpumem", "-o -q")
    assert _row(snap, "model.fc.weight").shape == (8, 16)
    assert _row(snap, "model.fc.weight.grad").shape == (8, 16)
    state_names = [n for t in snap.tensor_list for n in t.names if n.startswith("opt.state[")]
    assert "opt.state[model.fc.weight]['exp_avg']" in state_names
    assert "opt.state[model.fc.bias]['exp_avg_sq']" in state_names
    assert _row(snap, "losses[3]").shape == (10,)


def test_output_cache_is_named_out_n(tip):
    result = run_ok(tip, "torch.full((33, 3), 2.0)", store_history=True)
    n = result.execution_count
    del result
    snap = tip.run_line_magic("gpumem", "-o -q")
    row = _row(snap, f"Out[{n}]")
    assert row.shape == (33, 3)


def test_census_and_freecuda_follow_one_rule_for_names_like_the_output_cache(tip):
    """`_N` and `_` are the output cache while they hold its value; a user's own `_7` is a variable."""
    from cuda_magic.ipython import user_variables

    n = run_ok(tip, "torch.full((33, 3), 2.0)", store_history=True).execution_count
    mine = f"_{n + 50}"
    run_ok(tip, f"{mine} = torch.ones(7, 5)\n_ = torch.ones(11, 3)")
    assert mine in user_variables(tip) and "_" in user_variables(tip) and f"_{n}" not in user_variables(tip)
    snap = tip.run_line_magic("gpumem", "-o -q")
    cached = _row(snap, f"Out[{n}]")
    assert cached.shape == (33, 3) and f"_{n}" not in cached.names and "_" not in cached.names
    assert _row(snap, mine).shape == (7, 5)
    assert _row(snap, "_").shape == (11, 3)
    ids = {name: id(tip.user_ns[name]) for name in (mine, "_")}
    report = tip.run_line_magic("freecuda", "-q -o")
    assert f"Out[{n}]" in report.dropped and f"_{n}" in report.dropped
    assert mine not in report.dropped
    assert {name: id(tip.user_ns[name]) for name in (mine, "_")} == ids
    assert f"_{n}" not in tip.user_ns


def test_last_error_traceback_names_a_failed_functions_tensor(tip):
    result = tip.run_cell("def f():\n    held = torch.ones(321, 5)\n    raise ValueError('boom')\nf()",
                          store_history=True)
    assert not result.success
    del result
    snap = tip.run_line_magic("gpumem", "-o -q")
    rows = [t for t in snap.tensor_list if t.shape == (321, 5)]
    assert len(rows) == 1
    assert any(n.startswith("last error traceback") and "held" in n for n in rows[0].names)
    # only the user's frames are walked: IPython's machinery does not name anything
    assert not any("run_code" in n for t in snap.tensor_list for n in t.names)


def test_tables_are_dataframes_with_integer_bytes_and_parts_add_up(tip):
    run_ok(tip, "a = torch.zeros(100)")
    tip.run_line_magic("gpumem", "--simulate 64MiB -q")
    run_ok(tip, "b = torch.zeros(256, 256)")
    snap = tip.run_line_magic("gpumem", "-o -q")
    import pandas as pd

    devices, tensors = snap.devices, snap.tensors
    assert isinstance(devices, pd.DataFrame) and isinstance(tensors, pd.DataFrame)
    for col in ("capacity", "torch_allocated", "torch_cached", "other_this_process", "other_processes", "free"):
        assert devices[col].dtype.kind == "i", col
    assert tensors["bytes"].dtype.kind == "i"
    assert set(devices["device"]) == {"sim:0", "cpu"}
    for dev in snap.device_list:
        assert sum(dev.parts().values()) == dev.capacity, dev
    sim = snap.device("sim:0")
    assert sim.capacity == 64 * 2**20 and sim.torch_allocated == 256 * 256 * 4 and sim.peak_exact


def test_top_n(tip, capsys):
    run_ok(tip, "ts = [torch.zeros(1000 * (i + 1), dtype=torch.uint8) for i in range(5)]")
    capsys.readouterr()
    tip.run_line_magic("gpumem", "-n 0")
    out = capsys.readouterr().out
    assert "ts[" not in out and "Top " not in out
    tip.run_line_magic("gpumem", "-n 3")
    out = capsys.readouterr().out
    assert "Top 3 tensors" in out
    assert "ts[4]" in out and "ts[3]" in out and "ts[2]" in out
    assert "ts[1]" not in out and "ts[0]" not in out


def test_diff_shows_tensors_that_appeared_and_went(tip):
    run_ok(tip, "old = torch.zeros(300)")
    tip.run_line_magic("gpumem", "-q")
    run_ok(tip, "new = torch.zeros(500)\ndel old")
    change = tip.run_line_magic("gpumem", "--diff -o -q")
    assert [t.names for t in change.appeared if t.shape == (500,)] == [["new"]]
    assert [t.names for t in change.went if t.shape == (300,)] == [["old"]]
    cpu = [d for d in change.device_deltas if d.key == "cpu"]
    assert len(cpu) == 1 and "torch_allocated" in cpu[0].changes


def test_diff_sees_a_new_storage_at_a_freed_ones_address(tip):
    run_ok(tip, "old = torch.zeros(300)")
    tip.run_line_magic("gpumem", "-q")
    run_ok(tip, "old_id = old.untyped_storage()._cdata\ndel old\nnew = torch.zeros(500)\n"
                "reused = new.untyped_storage()._cdata == old_id")
    if not tip.user_ns["reused"]:
        pytest.skip("the allocator did not reuse the address this time")
    change = tip.run_line_magic("gpumem", "--diff -o -q")
    assert [t.names for t in change.appeared if t.shape == (500,)] == [["new"]]


def test_watch_records_each_cell_with_the_exact_peak(tip, capsys):
    tip.run_line_magic("gpumem", "--simulate 64MiB -q")
    run_ok(tip, "base = torch.zeros(1000)")
    tip.run_line_magic("gpumem", "--watch -q")
    first = run_ok(tip, "t = torch.empty(2**20, dtype=torch.uint8)\ndel t", store_history=True)
    second = run_ok(tip, "kept = torch.zeros(256)", store_history=True)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[gpumem]")]
    assert len(lines) == 2
    tip.run_line_magic("gpumem", "--unwatch -q")
    run_ok(tip, "after = torch.zeros(10)")
    history = tip.run_line_magic("gpumem", "--history -o")
    import pandas as pd

    assert isinstance(history, pd.DataFrame)
    assert list(history["cell"]) == [first.execution_count, second.execution_count]
    assert list(history["device"]) == ["sim:0", "sim:0"]
    # torch's allocated_bytes counts each block's size (alloc_found_block): a request rounded up to 512 B
    # (round_size), so `base`'s 4000 bytes count 4096; 2**20 and 1024 are multiples of 512 already
    assert list(history["peak"]) == [4096 + 2**20, 4096 + 1024]
    assert list(history["allocated_delta"]) == [0, 1024]
    assert all(history["peak_exact"])
    from cuda_magic.memory.snapshot import CellRecord
    from cuda_magic.magics.state import get_state

    records = get_state(tip).history
    assert records is get_state(tip).watcher.records     # one list, one owner
    assert len(records) == 2 and all(type(r) is CellRecord for r in records)
    assert "[gpumem]" not in capsys.readouterr().out


def test_simulate_counts_tensors_of_later_cells_until_off(tip, capsys):
    tip.run_line_magic("gpumem", "--simulate 64MiB")
    assert "Simulated device on" in capsys.readouterr().out
    run_ok(tip, "w = torch.zeros(1024, 1024)")
    snap = tip.run_line_magic("gpumem", "-o")
    out = capsys.readouterr().out
    assert "sim:0" in out and "64.00 MiB" in out
    assert snap.device("sim:0").torch_allocated == 4 * 2**20
    tip.run_line_magic("gpumem", "--simulate off")
    assert "Simulated device off" in capsys.readouterr().out
    run_ok(tip, "w2 = torch.zeros(1024)")
    snap = tip.run_line_magic("gpumem", "-o -q")
    assert snap.device("sim:0") is None
    assert "sim:0" not in list(snap.devices["device"])


def test_device_filter(tip):
    tip.run_line_magic("gpumem", "--simulate 64MiB -q")
    snap = tip.run_line_magic("gpumem", "-d sim -o -q")
    assert [d.key for d in snap.device_list] == ["sim:0"]
    snap = tip.run_line_magic("gpumem", "-d 0 -o -q")     # index 0: the only GPU-like device here
    assert [d.key for d in snap.device_list] == ["sim:0"]
    snap = tip.run_line_magic("gpumem", "-d cpu -o -q")
    assert [d.key for d in snap.device_list] == ["cpu"]


def test_processes_runs_without_gpu(tip, capsys):
    capsys.readouterr()
    tip.run_line_magic("gpumem", "--processes")
    out = capsys.readouterr().out
    assert "No GPU processes listed" in out
    assert "Traceback" not in out


@pytest.mark.parametrize("line", [
    "--bogus", "-n abc", "-n -5", "-d 3", "-d cuda:7", "--watch --unwatch", "--simulate 12XB",
    "--simulate 0", "--simulate -5GiB", "-d nonsense",
])
def test_bad_flags_are_one_line_usage_errors(ip, line):
    from cuda_magic.devices.simulated import active_device

    with pytest.raises(UsageError) as excinfo:
        ip.run_line_magic("gpumem", line)
    assert type(excinfo.value) is UsageError
    assert "\n" not in str(excinfo.value).strip()
    assert active_device() is None


FLAGS = {"-n": "-n 3", "-d": "-d cpu", "--processes": "--processes", "--diff": "--diff", "--watch": "--watch",
         "--unwatch": "--unwatch", "--history": "--history", "--simulate": "--simulate 64MiB", "-o": "-o",
         "-q": "-q"}
# Written out by hand (not derived from the magic's table): each pair here would leave one flag ignored.
IMPOSSIBLE = {
    ("--watch", "--unwatch"), ("--watch", "--history"), ("--unwatch", "--history"),
    *{(cmd, flag) for cmd in ("--watch", "--unwatch") for flag in ("-n", "-d", "--processes", "--diff", "-o")},
    *{("--history", flag) for flag in ("-n", "-d", "--processes", "--diff")},
    ("--diff", "-n"), ("--diff", "--processes"),
}
PAIRS = [(a, b) for i, a in enumerate(FLAGS) for b in list(FLAGS)[i + 1:]]


def _impossible(a, b):
    return (a, b) in IMPOSSIBLE or (b, a) in IMPOSSIBLE


@pytest.mark.parametrize("a, b", [p for p in PAIRS if _impossible(*p)])
def test_flags_that_cannot_go_together_are_one_line_usage_errors_that_change_nothing(tip, a, b):
    from cuda_magic.devices.simulated import active_device

    callbacks = {k: list(v) for k, v in tip.events.callbacks.items()}
    for line in (f"{FLAGS[a]} {FLAGS[b]}", f"{FLAGS[b]} {FLAGS[a]} --simulate 64MiB"):
        with pytest.raises(UsageError) as excinfo:
            tip.run_line_magic("gpumem", line)
        message = str(excinfo.value)
        assert type(excinfo.value) is UsageError and "\n" not in message.strip()
        assert f"{a} and {b}" in message or f"{b} and {a}" in message, message
        assert active_device() is None
        assert {k: list(v) for k, v in tip.events.callbacks.items()} == callbacks


@pytest.mark.parametrize("a, b", [p for p in PAIRS if not _impossible(*p)])
def test_flags_that_go_together_run(tip, capsys, a, b):
    """Each pair that may go together does what both flags say: -q shows nothing, -o returns the object
    (the snapshot, its diff, the --history frame), -d keeps that device, -n that many rows, --simulate
    switches the device on, --watch / --unwatch the per-cell line."""
    import pandas as pd

    from cuda_magic.devices.simulated import active_device
    from cuda_magic.magics.state import get_state
    from cuda_magic.memory.snapshot import Snapshot

    capsys.readouterr()
    value = tip.run_line_magic("gpumem", f"{FLAGS[a]} {FLAGS[b]} -q")
    assert capsys.readouterr().out == ""
    flags = {a, b}
    if "-o" not in flags:
        assert value is None
    elif "--history" in flags:
        assert isinstance(value, pd.DataFrame)
    else:
        assert isinstance(value, Snapshot)
        if "-d" in flags:
            assert [d.key for d in value.device_list] == ["cpu"]
        if "-n" in flags:
            assert value.top == 3
    device = active_device()
    assert (device is not None and device.capacity == 64 * 2**20) == ("--simulate" in flags)
    watcher = get_state(tip).watcher
    assert (watcher is not None and watcher.active) == ("--watch" in flags)


def test_activations_a_logged_loss_keeps_are_named_by_its_graph(tip):
    run_ok(tip, "lin = torch.nn.Linear(64, 256)\nlosses = []\n"
                "for _ in range(2):\n    losses.append(lin(torch.randn(128, 64)).relu().sum())\n")
    snap = tip.run_line_magic("gpumem", "-q -o -n 50")
    by_name = {}
    for rec in snap.tensor_list:
        for name in rec.names:
            by_name.setdefault(name, []).append(rec)
    # the ReLU output each graph saved (128 x 256 float32) is named by the list item that keeps it
    for i in (0, 1):
        saved = [r for r in by_name.get(f"losses[{i}] (its graph)", []) if r.shape == (128, 256)]
        assert saved and saved[0].nbytes == 128 * 256 * 4
    # storages with plain names keep only those: the weight is `lin.weight`, not a graph's
    weight = [r for r in snap.tensor_list if "lin.weight" in r.names]
    assert weight and all("(its graph)" not in n for n in weight[0].names)


# ---- what the tables say (issue 21) -------------------------------------------------------------------

@pytest.mark.parametrize("form", ["widget", "html"])
def test_a_watch_line_stays_one_line_in_what_a_saved_notebook_keeps(tip, monkeypatch, form):
    # nbconvert, GitHub's viewer and a notebook reopened without widget state show the output's text/html:
    # one cell's record is the line the widget shows, not a one-row table with its own header
    from IPython.utils.capture import capture_output

    from cuda_magic.display.html import watch_html
    from cuda_magic.display.layout import watch_line
    from cuda_magic.magics.state import get_state

    monkeypatch.setenv("CUDA_MAGIC_DISPLAY", form)
    tip.run_line_magic("gpumem", "--simulate 64MiB -q")
    tip.run_line_magic("gpumem", "--watch -q")
    with capture_output() as cap:
        run_ok(tip, "t = torch.zeros(2**18)", store_history=True)
    record, = get_state(tip).history
    data, = [o.data for o in cap.outputs]
    assert "application/vnd.jupyter.widget-view+json" not in data      # a finished record is static
    assert data["text/html"] == watch_html(record)
    assert "<table" not in data["text/html"] and "+1.00 MiB allocated" in data["text/html"]
    assert data["text/plain"] == watch_line(record)


def test_a_parameter_that_a_view_carries_into_a_graph_carries_no_graph_itself(tip, capsys):
    run_ok(tip, "lin = torch.nn.Linear(64, 256)\nwt = lin.weight.T\nleaf = torch.ones(300, requires_grad=True)\n"
                "half = leaf[:150]\nout = lin(torch.randn(8, 64))")
    capsys.readouterr()
    snap = tip.run_line_magic("gpumem", "-n 50 -o")
    text = capsys.readouterr().out
    weight, leaf, out = _row(snap, "lin.weight"), _row(snap, "leaf"), _row(snap, "out")
    assert "wt" in weight.names and not weight.grad_fn          # `wt` has a grad_fn (TBackward0): a view's
    assert "half" in leaf.names and not leaf.grad_fn
    assert out.grad_fn                                          # the result of a forward pass does
    line, = [row for row in text.splitlines() if row.lstrip().startswith("lin.weight")]
    assert not line.rstrip().endswith("yes")


def test_two_activations_one_graph_keeps_are_one_row_not_the_same_line_twice(tip, capsys):
    from cuda_magic.display.html import snapshot_html

    run_ok(tip, "net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),"
                " torch.nn.ReLU(), torch.nn.Linear(256, 1))\nlosses = [net(torch.randn(128, 64)).sum()]")
    capsys.readouterr()
    snap = tip.run_line_magic("gpumem", "-n 50 -o")
    out = capsys.readouterr().out
    # the two ReLU outputs the graph saved: two storages in the data, one row in the table
    saved = [r for r in snap.tensor_list if r.names == ["losses[0] (its graph)"] and r.shape == (128, 256)]
    assert len(saved) == 2
    rows = [line for line in out.splitlines() if "losses[0]" in line and "(128, 256)" in line]
    assert len(rows) == 1, rows
    assert "losses[0] (its graph: 2 storages)" in rows[0] and "256.00 KiB" in rows[0]
    html = snapshot_html(snap)
    assert html.count("losses[0] (its graph: 2 storages)") == 1
