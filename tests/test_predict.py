"""`%%oomguard --predict` in a real IPython shell with real torch: the cell runs on fake tensors, nothing
it does stays, the device is not touched, and the prediction is checked against a real run of the same
cell on the same (simulated) device."""
from __future__ import annotations

import pytest
from IPython.core.error import UsageError

from conftest import run_ok

MiB = 2**20

MLP = """
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.BatchNorm1d(1024), torch.nn.ReLU(),
                            torch.nn.Linear(1024, 10))
opt = torch.optim.Adam(model.parameters())
losses = []
"""
STEP = """for step in range(3):
    x = torch.randn(bs, 256)
    y = torch.randint(0, 10, (bs,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step(); opt.zero_grad()
    losses.append(loss.item())
"""


def predict(ip, flags: str, cell: str):
    result = ip.run_cell(f"%%oomguard --predict -q -o {flags}\n" + cell)
    if result.error_in_exec is not None:
        raise result.error_in_exec
    return result.result


def measured(ip, flags: str, cell: str):
    report = ip.run_cell(f"%%oomguard -q -o --no-raise {flags}\n" + cell).result
    return report


@pytest.fixture
def mlp(tip):
    run_ok(tip, "%gpumem --simulate 64MiB")
    run_ok(tip, MLP + "bs = 512")
    return tip


def test_the_predicted_peak_is_the_peak_of_a_real_run_on_the_same_device(mlp):
    p = predict(mlp, "", STEP)
    real = measured(mlp, "", STEP)
    assert real.outcome == "ok"
    assert p.complete and p.fits is True
    assert abs(p.peak - real.peaks["sim:0"]) <= 0.05 * real.peaks["sim:0"], (p.peak, real.peaks)
    assert p.capacity == 64 * MiB and p.device == "sim:0"
    assert set(p.by_kind) >= {"parameters", "gradients", "optimizer state"}
    assert abs(sum(p.by_kind.values()) - p.peak) <= 0.01 * p.peak     # (the allocator rounds each block)


def test_nothing_the_cell_does_stays_and_the_device_is_not_touched(mlp):
    ns = mlp.user_ns
    before = {k: ns[k] for k in ("model", "opt", "losses", "bs")}
    weights = [t.clone() for t in ns["model"].state_dict().values()]
    rng = ns["torch"].get_rng_state().clone()
    from cuda_magic.devices.simulated import active_device

    sim = active_device()
    allocated, peak = sim.allocated, sim.peak
    p = predict(mlp, "", STEP + "new_name = 1\nbs = 7\n")
    assert p.complete
    assert "new_name" not in ns and ns["bs"] == 512
    assert all(ns[k] is v for k, v in before.items())
    assert ns["losses"] == [] and ns["opt"].state == {}
    assert all(p.grad is None for p in ns["model"].parameters())
    import torch

    assert all(torch.equal(a, b) for a, b in zip(weights, ns["model"].state_dict().values()))
    assert torch.equal(rng, ns["torch"].get_rng_state())
    assert (sim.allocated, sim.peak) == (allocated, peak)
    assert "_cuda_magic_predict_loop" not in ns


def test_a_training_loop_is_predicted_from_its_first_two_steps(mlp):
    p = predict(mlp, "", STEP.replace("range(3)", "range(100000)"))
    assert p.complete and p.enough == "after 2 optimizer steps"
    assert p.seconds < 30
    text = str(p)
    assert "stopped after 2 optimizer steps" in text and "repeats once the optimizer state exists" in text


def test_a_top_level_loop_without_an_optimizer_stops_after_two_iterations(mlp):
    cell = "with torch.no_grad():\n    pass\nfor i in range(10**6):\n    out = model(torch.randn(bs, 256))\n"
    p = predict(mlp, "", cell)
    assert p.complete and p.enough == "after 2 iterations of the cell's loop"


def test_item_takes_a_stand_in_and_the_cell_prints_nothing(mlp, capsys):
    p = predict(mlp, "", STEP + "print('LOSS', loss.item())\n")
    assert p.complete
    assert any(line.startswith("line ") for line in p.stand_ins)
    assert "LOSS" not in capsys.readouterr().out


def test_a_data_dependent_op_stops_the_run_and_says_where_and_what_it_covers(mlp):
    cell = "x = torch.randn(bs, 256)\nkeep = x[x[:, 0] > 0]\ny = torch.randn(bs, 4096)\n"
    p = predict(mlp, "", cell)
    assert not p.complete and p.stop_line == 2 and p.stop_code == "keep = x[x[:, 0] > 0]"
    assert "depends on the data" in p.stop_reason
    text = str(p)
    assert "stopped at line 2" in text and "covers the cell up to there" in text
    assert p.fits is None                # never a silent "fits"
    assert "not known whether it fits" in text


def test_largest_with_accumulation_keeps_the_effective_batch_and_fits_when_run(mlp):
    run_ok(mlp, "bs, acc = 4096, 2")
    cell = STEP.replace("for step in range(3):", "for step in range(3 * acc):").replace(
        "loss.backward()", "(loss / acc).backward()")
    p = predict(mlp, "-r bs -a acc", cell)
    assert p.fits is False and p.largest is not None
    assert p.largest * p.largest_accumulation >= 4096 * 2
    assert mlp.user_ns["bs"] == 4096 and mlp.user_ns["acc"] == 2
    run_ok(mlp, f"bs, acc = {p.largest}, {p.largest_accumulation}")
    assert measured(mlp, "", cell).outcome == "ok"
    run_ok(mlp, f"bs = {int(p.largest / 0.95) + 1}")    # 5% more does not fit: within 5% of the largest
    assert measured(mlp, "", cell).outcome == "oom"
    assert f"bs = {p.largest}; acc = {p.largest_accumulation}" in str(p)


def test_exact_takes_a_divisor_of_the_effective_batch(mlp):
    run_ok(mlp, "bs, acc = 4096, 3")
    p = predict(mlp, "-r bs -a acc --exact", STEP)
    assert (4096 * 3) % p.largest == 0 and p.largest * p.largest_accumulation == 4096 * 3


def test_a_cell_whose_memory_does_not_depend_on_the_variable_says_so(mlp):
    p = predict(mlp, "-r bs", "z = torch.randn(1024, 1024)\n")
    assert p.independent and p.largest is None
    assert "does not depend on bs" in str(p)


def test_a_laptop_plans_for_a_bigger_device_with_a_cap(tip, no_gpu):
    run_ok(tip, MLP + "bs = 512")
    p = predict(tip, "-l 16GiB -r bs", STEP)
    assert p.capacity == 16 * 2**30 and p.limited and p.fits is True
    assert p.largest > 512 * 100


def test_amp_predicts_smaller_activations(mlp):
    cell = "with torch.no_grad():\n    out = model[:3](torch.randn(bs, 256))\n"
    plain, amp = predict(mlp, "", cell), predict(mlp, "--amp bf16", cell)
    assert amp.peak < plain.peak


def test_the_object_has_peak_by_kind_by_line_and_largest(mlp):
    p = predict(mlp, "-r bs", STEP)
    assert isinstance(p.peak, int) and isinstance(p.largest, int)
    frame = p.by_line
    assert list(frame.columns) == ["file", "line", "code", "bytes", "tensors"]
    assert frame["bytes"].sum() <= p.peak
    assert repr(p).startswith("<Prediction sim:0: peak ")


def test_the_html_form_leads_with_the_answer_and_draws_inline_svg(mlp):
    from cuda_magic.display.prediction_view import prediction_html

    html = prediction_html(predict(mlp, "-r bs", STEP))
    assert html.index("cuda-magic-headline") < html.index("<svg")
    assert "Largest bs that fits" in html and "<script" not in html


@pytest.mark.parametrize("flag", ["--no-raise", "--timeline"])
def test_options_for_a_run_are_a_usage_error(mlp, flag):
    with pytest.raises(UsageError, match="--predict runs nothing"):
        mlp.run_cell_magic("oomguard", f"--predict {flag}", STEP)
    assert mlp.user_ns["bs"] == 512


def test_a_missing_variable_is_a_usage_error(mlp):
    with pytest.raises(UsageError, match="no variable 'batch'"):
        mlp.run_cell_magic("oomguard", "--predict -r batch", STEP)


def test_the_python_api_predicts_a_function_with_its_arguments_and_globals(tip):
    import cuda_magic

    run_ok(tip, MLP)
    ns = tip.user_ns

    def train(batch_size=256, steps=3):
        for _ in range(steps):
            loss = ns["torch"].nn.functional.cross_entropy(model(ns["torch"].randn(batch_size, 256)),
                                                           ns["torch"].randint(0, 10, (batch_size,)))
            loss.backward()
            opt.step()
            opt.zero_grad()

    train.__globals__["model"], train.__globals__["opt"] = ns["model"], ns["opt"]
    try:
        p = cuda_magic.predict(train, retry="batch_size", limit="64MiB")
    finally:
        del train.__globals__["model"], train.__globals__["opt"]
    assert p.complete and p.enough == "after 2 optimizer steps"
    assert p.largest is not None and p.largest > 256
    assert ns["opt"].state == {}
    assert "batch_size=" in str(p)


def test_a_loop_that_ends_on_a_tensors_value_stops_and_does_not_say_it_fits_or_not(mlp):
    """generate's loop ends when `unfinished_sequences.max() == 0`: on fakes that is a stand-in, so it
    would never end; the run stops after MAX_STAND_INS and the figure is no bound either way."""
    cell = ("def spin():\n    x = torch.randn(bs)\n    while not bool((x > 1).all()):\n        x = x + 1\n"
            "    return x\nout = spin()\n")
    p = predict(mlp, "", cell)
    assert not p.complete and p.endless and p.fits is None and p.stop_line == 3   # (the cell line running)
    text = str(p)
    assert "not known whether it fits" in text and "does not say whether the cell fits" in text


def test_a_cell_through_a_shuffling_dataloader_is_predicted_to_the_byte(mlp):
    """RandomSampler's `torch.randperm(n).tolist()` is an order, not memory: it runs for real, so the
    loop goes on (with stand-ins it would take thousands and never end)."""
    run_ok(mlp, "from torch.utils.data import DataLoader, TensorDataset\n"
                "data = TensorDataset(torch.randn(4096, 256), torch.randint(0, 10, (4096,)))")
    cell = ("loader = DataLoader(data, batch_size=bs, shuffle=True)\nfor xb, yb in loader:\n"
            "    loss = torch.nn.functional.cross_entropy(model(xb), yb)\n    loss.backward()\n"
            "    opt.step(); opt.zero_grad()\n")
    p = predict(mlp, "", cell)
    assert p.complete and p.enough == "after 2 optimizer steps"
    real = measured(mlp, "", cell)
    assert abs(p.peak - real.peaks["sim:0"]) <= 0.05 * real.peaks["sim:0"], (p.peak, real.peaks)


TRAIN_STEP = """
def train_step(batch_size, accum_steps=1):
    opt.zero_grad(set_to_none=True)
    for _ in range(accum_steps):
        x = torch.randn(batch_size, 256)
        y = torch.randint(0, 10, (batch_size,))
        (torch.nn.functional.cross_entropy(model(x), y) / accum_steps).backward()
    opt.step()
train_step(64)             # the gradients and Adam's state exist before the prediction
"""


def test_gradients_held_before_are_freed_by_set_to_none_and_micro_batches_stay_few(mlp):
    """The fake copies' gradients die with zero_grad(set_to_none=True) (on torch 2.2 the converter's memo
    kept them alive, counting the gradients twice and making every value look too large), and the runs
    at other values take 2 micro-batches, not the whole effective batch one row at a time."""
    run_ok(mlp, TRAIN_STEP + "bs, acc = 4096, 4")
    param_bytes = sum(t.nbytes for t in mlp.user_ns["model"].parameters())
    p = predict(mlp, "-r bs -a acc -l 24MiB", "train_step(bs, acc)")
    assert abs(p.by_kind["gradients"] - param_bytes) <= 0.01 * param_bytes, (p.by_kind, param_bytes)
    assert p.largest is not None and p.largest * p.largest_accumulation >= 4096 * 4
    assert p.largest_accumulation > 4 and all(r.accumulation <= 4 for r in p.runs), p.runs
    assert any("took acc = " in n for n in p.notes), p.notes
    run_ok(mlp, f"bs, acc = {p.largest}, {p.largest_accumulation}")
    assert measured(mlp, "-l 24MiB", "train_step(bs, acc)").outcome == "ok"
    run_ok(mlp, f"bs = {int(p.largest / 0.95) + 1}")
    assert measured(mlp, "-l 24MiB", "train_step(bs, acc)").outcome == "oom"


def test_generate_is_predicted_to_its_max_new_tokens_and_its_largest_batch_fits(tip):
    """transformers' generate loop (generation/utils.py `_sample`, 4.57.6 and 5.24.0) ends on
    `unfinished_sequences.max() == 0`, with `unfinished_sequences & ~stopping_criteria(...)` and
    MaxLengthCriteria's `torch.full((B,), cur_len >= max_length)` (generation/stopping_criteria.py): a
    uniform fake (fakerun/uniform.py) that is True at the maximum length, so the fake run ends there, as the
    real one does with no end-of-sequence token (here: random weights, min_new_tokens = max_new_tokens)."""
    pytest.importorskip("transformers")
    try:
        from transformers import LlamaForCausalLM  # noqa: F401
    except ImportError:
        pytest.skip("transformers gives no models with this torch")
    from model_cells import GENERATE, GENERATE_CAP, GENERATE_CELL

    run_ok(tip, f"%gpumem --simulate {GENERATE_CAP}")
    run_ok(tip, GENERATE + "reset()\nbs = 64")
    p = predict(tip, "", GENERATE_CELL)
    real = measured(tip, "", GENERATE_CELL)
    assert real.outcome == "ok"
    run_ok(tip, "assert out.shape == (64, 16 + 48), out.shape")
    assert p.complete and not p.endless, (p.stop_reason, p.stop_line)
    assert abs(p.peak - real.peaks["sim:0"]) <= 0.05 * real.peaks["sim:0"], (p.peak, real.peaks)
    run_ok(tip, "reset()")
    p = predict(tip, "-r bs", GENERATE_CELL)
    assert p.largest is not None and p.largest > 64, p.largest
    run_ok(tip, f"reset()\nbs = {p.largest}")
    assert measured(tip, "", GENERATE_CELL).outcome == "ok"
