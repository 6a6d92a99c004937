"""The diagnosis without noise (issue 12, item 4): each rule with a message that exercises it."""
from __future__ import annotations

import copy

import pytest

from cuda_magic.memory.holders import Holder, name_holders
from cuda_magic.oom.messages import parse_oom_message
from cuda_magic.oom.diagnosis import SHOWN, diagnose, explain
from oom_messages import MESSAGES

GiB, MiB = 1 << 30, 1 << 20


def codes(d):
    return [a.code for a in d.advice if a.code]


def shown(d):
    return d.advice[:SHOWN]


def entry(fragment):
    return next(e for e in MESSAGES if fragment in e["source"])


# torch 2.4+: a cache of 1.95 GiB, more than the 1 GiB asked for, with 312 MiB free
FRAGMENTED_24 = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of "
    "15.77 GiB of which 312.00 MiB is free. Including non-PyTorch memory, this process has 15.46 GiB memory "
    "in use. Of the allocated memory 13.20 GiB is allocated by PyTorch, and 1.95 GiB is reserved by PyTorch "
    "but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.")
# torch 2.4+: nearly all of a 23.6 GiB card allocated by PyTorch
FULL_24 = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
    "23.64 GiB of which 1.12 GiB is free. Including non-PyTorch memory, this process has 22.50 GiB memory in "
    "use. Of the allocated memory 22.01 GiB is allocated by PyTorch, and 187.43 MiB is reserved by PyTorch "
    "but unallocated.")


def test_fragmentation_comes_first_when_the_cache_could_have_served_the_request():
    d = explain(FRAGMENTED_24)
    assert "too_large" in d.causes            # the working set explains more bytes ...
    assert d.causes[0] == "fragmentation"     # ... but the cache alone held more than the request
    assert "expandable_segments:True" in d.advice[0].code


def test_expandable_segments_is_shown_whenever_fragmentation_is_named():
    holders = [Holder("losses", 3 * GiB, kind="graph", what="list of 400 tensors with grad_fn")]
    d = explain(FRAGMENTED_24, holders=holders)
    assert d.causes[0] == "names_holding" and "fragmentation" in d.causes
    assert any("expandable_segments:True" in (a.code or "") for a in shown(d))


@pytest.mark.parametrize("fragment", ["pytorch/pytorch/issues/59778", "JDAI-CV/centerX"])
def test_old_messages_infer_memory_outside_pytorch(fragment):
    """torch 1.4 - 2.0 state allocated, free and reserved, not this process's total."""
    d = explain(entry(fragment)["text"])
    assert "other_processes" in d.causes
    assert "outside PyTorch (other processes, or libraries in this one)" in d.summary
    assert "%gpumem --processes" in [a.code for a in shown(d)]


def test_more_free_than_requested_is_not_the_headline_when_a_larger_cause_is_there():
    # 6 GiB card, 3.03 GiB free, 2.26 GiB asked: 1.73 GiB outside PyTorch is more than the 0.77 GiB slack
    d = explain(entry("pytorch/pytorch/issues/59778")["text"])
    assert d.causes == ["other_processes", "free_reported"]
    assert d.summary.index("outside PyTorch") < d.summary.index("more than requested")


def test_more_free_than_requested_alone_names_the_likely_reasons():
    d = explain(entry("pytorch/issues/16417 (title)")["text"])
    assert d.causes == ["free_reported"]
    assert "per-process memory fraction" in d.summary and "another process allocating at the same moment" in d.summary


@pytest.fixture
def training_namespace(torch_warm):
    """A model with BatchNorm trained a few steps with AdamW, then evaluated without torch.no_grad, its
    losses and predictions logged as tensors: each loss keeps its batch's graph and saved activations."""
    torch = torch_warm
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.BatchNorm1d(512), nn.ReLU(), nn.Linear(512, 256))
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(2):
        x = torch.randn(256, 256)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    losses, preds = [], []
    for _ in range(4):
        x = torch.randn(1024, 256)
        out = model(x)
        losses.append(out.pow(2).mean())      # the classic leak: no .item()
        preds.append(out)
    return {"model": model, "opt": opt, "losses": losses, "preds": preds}


def held_message(request: int, free: int = 1 * MiB, capacity: int = 96 * MiB) -> str:
    used = capacity - free
    return (f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {request / MiB:.2f} MiB. GPU 0 has a "
            f"total capacity of {capacity / GiB:.2f} GiB of which {free / MiB:.2f} MiB is free. Including "
            f"non-PyTorch memory, this process has {used / GiB:.2f} GiB memory in use. Of the allocated memory "
            f"{(used - 1 * MiB) / GiB:.2f} GiB is allocated by PyTorch, and 1.00 MiB is reserved by PyTorch "
            "but unallocated.")


def test_sizes_are_what_deleting_a_name_gives_back(training_namespace):
    held = {h.name: h for h in name_holders(training_namespace)}
    model, opt, losses, preds = (held[n] for n in ("model", "opt", "losses", "preds"))
    params = sum(p.untyped_storage().nbytes() for p in training_namespace["model"].parameters())
    # model and optimizer no longer both claim the parameters: they share them
    assert model.bytes + opt.bytes < params + opt.bytes + model.shared
    assert model.shared >= params and "opt" in model.shared_with
    assert opt.bytes > 0 and opt.kind == "optimizer" and opt.training
    assert model.kind == "model" and model.training
    # the losses' graphs saved the predictions: shown apart, not claimed by both
    assert losses.kind == "graph" and losses.what == "list of 4 scalar tensors with grad_fn"
    assert losses.shared > 0 and "preds" in losses.shared_with
    assert preds.bytes + losses.bytes + preds.shared >= losses.shared


def test_a_trained_model_and_its_optimizer_are_not_blamed(training_namespace):
    holders = name_holders(training_namespace)
    d = explain(held_message(8 * MiB), holders=holders)
    names = [h.name for h in d.holders]
    assert "model" not in names and "opt" not in names
    assert "losses" in names
    assert not any(c.startswith("%freecuda") and ("model" in c or "opt" in c) for c in codes(d))


def test_a_trained_model_is_listed_only_where_deleting_it_would_fit_and_never_advised_for_deletion():
    model = Holder("model", 60 * MiB, kind="model", what="Transformer", training=True)
    d = explain(held_message(20 * MiB), holders=[model])
    assert [h.name for h in d.holders] == ["model"]
    assert not any(c.startswith("%freecuda") for c in codes(d) if "model" in c)


def test_a_second_copy_of_a_model_is_a_surprise(training_namespace):
    ns = dict(training_namespace, backup=copy.deepcopy(training_namespace["model"]))
    for p in ns["backup"].parameters():
        p.grad = None
    held = {h.name: h for h in name_holders(ns)}
    assert held["backup"].kind == "model" and not held["backup"].training
    d = explain(held_message(held["backup"].bytes // 2, capacity=16 * MiB, free=0), holders=list(held.values()))
    assert "backup" in [h.name for h in d.holders]
    assert any(c.startswith("%freecuda") and "backup" in c for c in codes(d))


def test_the_classic_leak_comes_first_with_the_item_fix(training_namespace):
    d = explain(held_message(40 * MiB), holders=name_holders(training_namespace))
    assert "too_large" in d.causes and d.causes[0] == "names_holding"
    assert d.advice[0].code == "losses.append(loss.item())  # not losses.append(loss)"
    total = [Holder("total_loss", 3 * GiB, kind="graph", what="tensor with grad_fn")]
    d = explain(held_message(40 * MiB, capacity=4 * GiB), holders=total)
    assert d.causes[0] == "names_holding" and d.advice[0].code.startswith("total_loss = total_loss.detach()")


def test_inference_advice_is_about_sequences_and_caches():
    d = explain(FULL_24, inference=True, batch_var="batch")
    joined = " ".join(a.text for a in d.advice)
    assert "sequences per batch" in joined and "KV cache" in joined and "new tokens" in joined
    assert "accumulation" not in joined and "checkpointing" not in joined
    trained = explain(FULL_24, batch_var="batch")
    assert any("accumulation" in a.text for a in trained.advice)


def test_amp_advice_says_what_it_saves_and_what_it_costs():
    amp = next(a for a in explain(FULL_24).advice if a.code == "%%oomguard --amp bf16")
    assert "activations" in amp.text and "copy of the weights" in amp.text and "peak higher" in amp.text


def test_advice_already_followed_is_not_repeated():
    assert not any("-r BATCH" in c for c in codes(explain(FULL_24, retried=True)))
    assert not any("--amp" in c for c in codes(explain(FULL_24, amp=True)))
    huge = entry("ROCm/TheRock")["text"]
    holders = [Holder("cache", 2 * GiB, what="dict of 12 tensors")]
    d = explain(huge, holders=holders)
    assert d.causes[0] == "request_exceeds_capacity"
    assert not any(c.startswith("%freecuda cache") for c in codes(d))


def test_the_summary_cites_the_line_that_held_the_most():
    d = diagnose(parse_oom_message(FULL_24),
                 top_line=(int(1.2 * GiB), "attn = q @ k.transpose(-1, -2)", "model.py:42"))
    assert "1.20 GiB was alive from `attn = q @ k.transpose(-1, -2)` at model.py:42" in d.summary


# -- issue 36: the cause names what holds the device; the lead is what helps most --------------------

def _size(nbytes):
    from cuda_magic.units import format_bytes

    return format_bytes(nbytes)


def test_the_cause_names_memory_outside_pytorch_on_an_old_message():
    """Issue 36: a torch 1.1 message on a 22.37 GiB card: 15.87 GiB in tensors, 787.74 MiB cached, and the
    5.73 GiB the message leaves to the rest is outside PyTorch: the cause sentence says so (it said only
    'PyTorch held 15.87 GiB')."""
    e = entry("5.73 GiB outside PyTorch")
    f = e["fields"]
    d = explain(e["text"])
    outside = f["capacity"] - f["free"] - f["reserved_total"]
    assert _size(outside) == "5.73 GiB"
    assert "15.87 GiB" in d.cause and f"{_size(outside)} is used outside PyTorch" in d.cause, d.cause
    assert d.advice[0].code.startswith("%%oomguard -r")
    assert "%gpumem --processes" in codes(d)[:3]


def test_the_cause_names_tensors_and_this_process_outside_pytorch():
    """Issue 36: 132 MiB asked with 18.70 GiB in tensors, 353.02 MiB cached and 22.90 GiB in this process:
    the cause named only the 353 MiB of fragmentation; it names the 18.70 GiB of tensors and the 3.85 GiB
    this process holds outside PyTorch, and a smaller batch is among the three things shown."""
    e = entry("3.85 GiB of this process outside PyTorch")
    f = e["fields"]
    d = explain(e["text"])
    outside = f["this_process"] - f["reserved_total"]
    assert _size(outside) in ("3.85 GiB", "3.86 GiB")       # the message's figures are rounded to 10 MiB
    assert "18.70 GiB is in PyTorch's tensors" in d.cause, d.cause
    assert f"{_size(outside)} is held by this process outside PyTorch" in d.cause, d.cause
    assert any((c or "").startswith("%%oomguard -r") for c in codes(d)[:3]), codes(d)


def test_memory_outside_pytorch_in_this_process_leaves_less_room_for_the_working_set():
    """With the card's figures (23.65 GiB, 70.56 MiB free) the 3.85 GiB outside PyTorch leaves 19.1 GiB to
    the tensors: 18.70 GiB and 132 MiB more is a working set too large, named with the cache."""
    text = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 132.00 MiB. GPU 0 has a total capacity "
            "of 23.65 GiB of which 70.56 MiB is free. Including non-PyTorch memory, this process has 22.90 GiB "
            "memory in use. Of the allocated memory 18.70 GiB is allocated by PyTorch, and 353.02 MiB is reserved "
            "by PyTorch but unallocated.")
    d = explain(text)
    assert "too_large" in d.causes and "fragmentation" in d.causes
    assert "18.70 GiB" in d.cause and "held by this process outside PyTorch" in d.cause
    assert any((c or "").startswith("%%oomguard -r") for c in codes(d)[:3]), codes(d)


def test_a_small_cache_part_is_not_named_in_the_cause():
    """Only material parts: 187 MiB cached of a 23.64 GiB card (0.8%, less than the request) is left out."""
    d = explain(FULL_24)
    assert "cached" not in d.cause and "22.01 GiB" in d.cause


def test_fragmentation_does_not_lead_for_a_training_step_still_building_its_forward_graph():
    """Issue 36: the cache could serve the request, but the step failed in its forward pass with the graph's
    activations holding the tensors: it needs more than it held, and a batch far too large fails there
    first. The batch leads; expandable_segments follows."""
    from cuda_magic.oom.cell_reading import read_cell
    from cuda_magic.oom.diagnosis import CellFacts

    fields = parse_oom_message(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
        "64.00 MiB of which 0 bytes is free. Including non-PyTorch memory, this process has 64.00 MiB memory in "
        "use. Of the allocated memory 36.72 MiB is allocated by PyTorch, and 27.28 MiB is reserved by PyTorch "
        "but unallocated.")
    cell = read_cell("out = model(input_ids=ids, labels=ids)\nout.loss.backward()\nopt.step()")
    forward = CellFacts(cell=cell, batch_var="bs", by_kind={"activations": 35 * MiB, "other": MiB})
    d = diagnose(fields, forward)
    assert d.causes[0] != "fragmentation" and d.advice[0].code.startswith("%%oomguard -r bs"), codes(d)
    assert any("expandable" in (c or "") for c in codes(d)[:3])
    # the same figures in the backward pass (the step's peak): the cache stands in the way, it leads
    backward = CellFacts(cell=cell, batch_var="bs", backward=True, by_kind={"gradients": 36 * MiB})
    assert diagnose(fields, backward).causes[0] == "fragmentation"
