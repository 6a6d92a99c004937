"""Memory by kind: parameters, gradients, optimizer state, activations kept by graphs, other tensors.
Exact on the simulated device: each kind is what the cell built, and nothing it counts goes unseen (its
allocated bytes add the caching allocator's rounding of each storage)."""
from __future__ import annotations

import pytest
from conftest import run_ok

pytestmark = pytest.mark.usefixtures("no_gpu")

BUILD = """
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
opt = torch.optim.Adam(model.parameters())
x = torch.randn(32, 64)
for _ in range(2):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
kept = model(x).square().mean()       # a loss kept with its graph
plain = torch.zeros(1000)             # another tensor
param_bytes = sum(p.untyped_storage().nbytes() for p in model.parameters())
n_params = len(list(model.parameters()))
"""


def kinds_of(snap, key):
    frame = snap.by_kind
    rows = frame[frame["device"] == key]
    return dict(zip(rows["kind"], rows["bytes"]))


def test_kinds_add_up_to_the_simulated_devices_allocated_bytes_each_as_built(tip):
    tip.run_line_magic("gpumem", "--simulate 64MiB -q")
    run_ok(tip, BUILD)
    snap = tip.run_line_magic("gpumem", "-o -q")
    sim = snap.device("sim:0")
    kinds = kinds_of(snap, "sim:0")
    p = tip.user_ns["param_bytes"]
    n = tip.user_ns["n_params"]
    assert kinds["parameters"] == p
    assert kinds["gradients"] == p                      # one .grad per parameter after backward()
    assert kinds["optimizer_state"] == 2 * p + 4 * n    # Adam's exp_avg, exp_avg_sq, and a float32 step each
    # what `kept`'s graph saved: x (32x64), ReLU's result (32x128), the last Linear's output (32x10) for
    # square(), and the loss itself; the weights it saved are parameters
    assert kinds["activations"] == 4 * (32 * 64 + 32 * 128 + 32 * 10 + 1)
    assert kinds["other"] == 4000                       # `plain`
    assert kinds.get("unseen", 0) == 0
    # the kinds are the storages' bytes; the device's allocated bytes are their blocks (rounded up to
    # 512 bytes each: round_size in c10/cuda/CUDACachingAllocator.cpp), what a GPU's memory_allocated says
    from cuda_magic.devices.simulated import active_device

    storages = active_device().live_storages
    assert sum(kinds.values()) <= sim.torch_allocated < sum(kinds.values()) + 512 * storages
    by_name = {n: t.kind for t in snap.tensor_list for n in t.names}
    assert by_name["model.0.weight"] == "parameters" and by_name["model.0.weight.grad"] == "gradients"
    assert by_name["plain"] == "other" and by_name["x"] == "activations"
    assert list(snap.tensors.columns)[-1] == "kind"


def test_backward_frees_the_activations_and_a_buffer_stays_model_state(tip):
    tip.run_line_magic("gpumem", "--simulate 64MiB -q")
    run_ok(tip, "bn = torch.nn.BatchNorm1d(128)\ny = bn(torch.randn(16, 128, requires_grad=True)).sum()")
    kinds = kinds_of(tip.run_line_magic("gpumem", "-o -q"), "sim:0")
    # the graph saved BatchNorm's running statistics, but they are the module's buffers: other, not activations
    assert kinds["other"] == 2 * 128 * 4 + 8           # running_mean, running_var, num_batches_tracked
    assert kinds["activations"] > 0
    run_ok(tip, "y.backward()\ndel y")
    kinds = kinds_of(tip.run_line_magic("gpumem", "-o -q"), "sim:0")
    assert kinds["activations"] == 0
    assert kinds["parameters"] == 2 * 128 * 4


def test_by_kind_in_text_html_and_the_widget(tip, capsys):
    from cuda_magic.display.html import snapshot_html
    from cuda_magic.display.widget import SnapshotWidget

    tip.run_line_magic("gpumem", "--simulate 64MiB -q")
    run_ok(tip, BUILD)
    capsys.readouterr()
    tip.run_line_magic("gpumem", "")
    out = capsys.readouterr().out
    assert "By kind on sim:0" in out and "optimizer state" in out and "activations kept by graphs" in out
    snap = tip.run_line_magic("gpumem", "-o -q")
    html = snapshot_html(snap)
    for kind in ("parameters", "gradients", "optimizer_state", "activations", "other"):
        assert f"cuda-magic-kind-{kind}" in html
    assert 'class="cuda-magic-kinds-bar"' in html
    w = SnapshotWidget(snap)
    assert "cuda-magic-kinds-bar" in w.kinds.value


def test_a_parameter_reached_otherwise_is_a_parameter(tip):
    tip.run_line_magic("gpumem", "--simulate 64MiB -q")
    run_ok(tip, "lin = torch.nn.Linear(8, 8)\nalias = lin.weight[:2]\nsaved = (alias * alias).sum()")
    snap = tip.run_line_magic("gpumem", "-o -q")
    kinds = kinds_of(snap, "sim:0")
    assert kinds["parameters"] == (64 + 8) * 4    # a view of it, saved by a graph twice: still parameters
    assert kinds["activations"] == 4              # only `saved` itself


def test_the_oom_report_has_the_split_at_the_failure(tip, capsys):
    tip.run_line_magic("gpumem", "--simulate 64MiB -q")
    run_ok(tip, BUILD)
    capsys.readouterr()
    run_ok(tip, "%%oomguard --no-raise -o\n"
                "acts = [model(x).square().mean() for _ in range(3)]   # three losses with their graphs\n"
                "huge = torch.empty(2**26)                              # 256 MiB: out of memory")
    assert "At the failure, by kind" not in capsys.readouterr().out      # folded: `%oomguard last` shows it
    tip.run_line_magic("oomguard", "last")
    out = capsys.readouterr().out
    assert "At the failure, by kind on sim:0" in out and "activations kept by graphs" in out
    report = tip.run_cell("%%oomguard --no-raise -o\nacts = [model(x).square().mean() for _ in range(3)]\n"
                          "huge = torch.empty(2**26)").result
    p = tip.user_ns["param_bytes"]
    kinds = report.by_kind
    assert kinds["parameters"] == p and kinds["gradients"] == p
    # `kept`'s graph (as in the first test) and the three graphs of `acts`: ReLU's result, the output and
    # the loss each (x itself counted once, with `kept`'s)
    assert kinds["activations"] == 4 * (32 * 64 + 32 * 128 + 32 * 10 + 1) + 3 * 4 * (32 * 128 + 32 * 10 + 1)
    # nothing the failed run made was freed (`huge` was never allocated): allocated at the failure = after,
    # the kinds' storages in blocks rounded up to 512 bytes each (the caching allocator's round_size)
    from cuda_magic.devices.simulated import active_device

    storages = active_device().live_storages
    assert sum(kinds.values()) <= report.after[0].torch_allocated < sum(kinds.values()) + 512 * storages


def test_the_cpu_split_is_not_repeated_when_the_simulated_device_holds_the_same(tip, capsys):
    from cuda_magic.display.html import snapshot_html

    tip.run_line_magic("gpumem", "--simulate 64MiB -q")
    run_ok(tip, BUILD)
    snap = tip.run_line_magic("gpumem", "-o -q")
    assert kinds_of(snap, "sim:0") == kinds_of(snap, "cpu")      # the data keeps both
    capsys.readouterr()
    tip.run_line_magic("gpumem", "")
    out = capsys.readouterr().out
    assert out.count("By kind on") == 1 and "By kind on sim:0" in out
    assert snapshot_html(snap).count('class="cuda-magic-kinds-bar"') == 1
    # a CPU tensor made before the session is the CPU's alone: the two splits differ, both are shown
    snap.kind_bytes["cpu"] = dict(snap.kind_bytes["cpu"], other=snap.kind_bytes["cpu"]["other"] + 4096)
    assert snapshot_html(snap).count('class="cuda-magic-kinds-bar"') == 2
