"""Diagnosis and advice (explain.py) and the allocator settings they paste (allocator_conf.py)."""
import pytest

from cuda_magic.devices.allocator_conf import (NEW_SETTER, OLD_SETTER, current_allocator_conf, enable_expandable_segments, expandable_segments_line, merge_conf, parse_conf, runtime_allocator_conf)
from cuda_magic.oom.diagnosis import CAUSE_LABELS, diagnose, explain
from cuda_magic.oom.messages import FATAL_NOTE
from cuda_magic.oom.findings import OomFields
from cuda_magic.units import format_bytes

from oom_messages import FATAL, MESSAGES

MiB, GiB = 1024**2, 1024**3


def _codes(d):
    return [a.code for a in d.advice if a.code]


def _entry(fragment):
    return next(e for e in MESSAGES if fragment in e["source"])


# -- allocator settings ---------------------------------------------------------------------------

def test_parse_conf_keeps_bracketed_lists_whole():
    conf = "max_split_size_mb:128, roundup_power2_divisions:[256:1,512:2,>:8],garbage_collection_threshold:0.6"
    assert parse_conf(conf) == [("max_split_size_mb", "128"),
                                ("roundup_power2_divisions", "[256:1,512:2,>:8]"),
                                ("garbage_collection_threshold", "0.6")]
    assert parse_conf("") == [] and parse_conf(",,") == []


def test_merge_conf_overrides_in_place_appends_and_removes():
    conf = "max_split_size_mb:128,expandable_segments:False,roundup_power2_divisions:[256:1,>:8]"
    assert merge_conf(conf, expandable_segments=True) == (
        "max_split_size_mb:128,expandable_segments:True,roundup_power2_divisions:[256:1,>:8]")
    assert merge_conf(conf, garbage_collection_threshold=0.8, max_split_size_mb=None) == (
        "expandable_segments:False,roundup_power2_divisions:[256:1,>:8],garbage_collection_threshold:0.8")
    assert merge_conf("", expandable_segments=True) == "expandable_segments:True"
    assert merge_conf("backend:cudaMallocAsync", expandable_segments=False) == (
        "backend:cudaMallocAsync,expandable_segments:False")


def test_expandable_segments_line_keeps_other_options():
    assert expandable_segments_line("max_split_size_mb:128", setter=NEW_SETTER) == (
        'import torch; torch._C._accelerator_setAllocatorSettings('
        '"max_split_size_mb:128,expandable_segments:True"); torch.cuda.empty_cache()')
    assert expandable_segments_line("", setter=OLD_SETTER) == (
        'import torch; torch.cuda.memory._set_allocator_settings("expandable_segments:True"); '
        'torch.cuda.empty_cache()')
    line = expandable_segments_line("expandable_segments:False,garbage_collection_threshold:0.6",
                                    setter=NEW_SETTER)
    assert '("expandable_segments:True,garbage_collection_threshold:0.6")' in line


@pytest.fixture
def restore_allocator_settings():
    torch = pytest.importorskip("torch")
    if not hasattr(torch._C, "_accelerator_getAllocatorSettings"):
        pytest.skip("the allocator settings getter is in torch 2.12+")
    from cuda_magic.devices import allocator_conf

    before, here = torch._C._accelerator_getAllocatorSettings(), allocator_conf._set_here
    yield torch
    torch._C._accelerator_setAllocatorSettings(before)
    allocator_conf._set_here = here      # what cuda_magic set: current_allocator_conf carries it over


def test_the_pasted_line_really_sets_the_settings(restore_allocator_settings):
    torch = restore_allocator_settings
    torch._C._accelerator_setAllocatorSettings("max_split_size_mb:256,garbage_collection_threshold:0.7")
    line = expandable_segments_line()            # the runtime settings, the installed torch's setter
    assert NEW_SETTER in line                    # torch 2.13 has the new setter
    exec(line, {})
    assert torch._C._accelerator_getAllocatorSettings() == (
        "max_split_size_mb:256,garbage_collection_threshold:0.7,expandable_segments:True")
    assert runtime_allocator_conf() == torch._C._accelerator_getAllocatorSettings()


def test_current_allocator_conf_reads_the_variables_in_torchs_order(monkeypatch):
    # the installed torch's order (2.13, c10/core/AllocatorConfig.cpp: from 2.10 PYTORCH_CUDA_ALLOC_CONF,
    # then PYTORCH_HIP_ALLOC_CONF on every build, then PYTORCH_ALLOC_CONF; tests/test_device_details.py
    # checks the order of 2.2-2.9 and compares each case with torch's own getter)
    import torch

    from cuda_magic.devices.allocator_conf import installed_torch_version

    if installed_torch_version() < (2, 10):
        pytest.skip(f"torch {torch.__version__} reads another order (checked in tests/test_device_details.py)")
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    assert current_allocator_conf(runtime=False) == ""
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", " expandable_segments:True ")
    assert current_allocator_conf(runtime=False) == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_HIP_ALLOC_CONF", "max_split_size_mb:32")
    monkeypatch.setattr(torch.version, "hip", None)
    assert current_allocator_conf(runtime=False) == "max_split_size_mb:32"        # a CUDA build reads it too
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert current_allocator_conf(runtime=False) == "max_split_size_mb:32"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    assert current_allocator_conf(runtime=False) == "max_split_size_mb:64"


def test_current_allocator_conf_sees_runtime_changes(restore_allocator_settings):
    torch = restore_allocator_settings
    torch._C._accelerator_setAllocatorSettings("garbage_collection_threshold:0.5")
    assert current_allocator_conf() == "garbage_collection_threshold:0.5"


def test_enable_expandable_segments_says_why_it_cannot_without_cuda():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(RuntimeError, match="no CUDA device"):
        enable_expandable_segments()


def test_enable_expandable_segments_keeps_the_other_options(restore_allocator_settings, monkeypatch):
    torch = restore_allocator_settings
    # the allocator settings are shared by every backend: only the CUDA check needs standing in for
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    torch._C._accelerator_setAllocatorSettings("max_split_size_mb:512")
    said = enable_expandable_segments()
    assert torch._C._accelerator_getAllocatorSettings() == "max_split_size_mb:512,expandable_segments:True"
    assert "switched on" in said and "max_split_size_mb:512,expandable_segments:True" in said
    assert "already on" in enable_expandable_segments()
    torch._C._accelerator_setAllocatorSettings("backend:cudaMallocAsync")
    with pytest.raises(RuntimeError, match="cudaMallocAsync"):
        enable_expandable_segments()
    assert torch._C._accelerator_getAllocatorSettings() == "backend:cudaMallocAsync"


# -- causes on hand-made figures ------------------------------------------------------------------

def _fields(**kw):
    base = dict(backend="cuda", device="cuda:0")
    base.update(kw)
    return OomFields(**base)


FRAGMENTED = _fields(requested=1 * GiB, capacity=16 * GiB, free=100 * MiB, this_process=15 * GiB,
                     other_processes=16 * GiB - 100 * MiB - 15 * GiB, allocated_by_torch=5 * GiB,
                     reserved_unallocated=9 * GiB, reserved_total=14 * GiB)
CROWDED = _fields(requested=2 * GiB, capacity=24 * GiB, free=10 * MiB, this_process=8 * GiB,
                  other_processes=16 * GiB - 10 * MiB, allocated_by_torch=7 * GiB + 900 * MiB,
                  reserved_unallocated=20 * MiB, reserved_total=7 * GiB + 920 * MiB)
FULL = _fields(requested=512 * MiB, capacity=16 * GiB, free=20 * MiB, this_process=15 * GiB + 900 * MiB,
               other_processes=16 * GiB - 20 * MiB - (15 * GiB + 900 * MiB),
               allocated_by_torch=15 * GiB + 400 * MiB, reserved_unallocated=50 * MiB)
HUGE = _fields(requested=40 * GiB, capacity=24 * GiB, free=20 * GiB, allocated_by_torch=1 * GiB)
HELD = _fields(requested=1 * GiB, capacity=16 * GiB, free=50 * MiB, this_process=15 * GiB,
               allocated_by_torch=14 * GiB + 500 * MiB, reserved_unallocated=10 * MiB)
HOLDERS = [("preds (list of 50 tensors)", 1 * GiB), ("model", 2 * GiB),
           ("losses (list of 300 tensors with grad_fn)", 6 * GiB)]


def test_fragmentation_advises_expandable_segments_with_the_users_options():
    d = diagnose(FRAGMENTED, alloc_conf="max_split_size_mb:128")
    assert d.causes == ["fragmentation"]
    assert d.advice[0].code == expandable_segments_line("max_split_size_mb:128")
    assert "max_split_size_mb:128,expandable_segments:True" in d.advice[0].code
    assert format_bytes(9 * GiB) in d.summary and format_bytes(1 * GiB) in d.summary
    assert "%freecuda" in _codes(d)


@pytest.mark.parametrize("conf", ["expandable_segments:True", "backend:cudaMallocAsync"])
def test_no_expandable_segments_advice_where_it_cannot_help(conf):
    d = diagnose(FRAGMENTED, alloc_conf=conf)
    assert d.causes[0] == "fragmentation"
    assert not any("expandable_segments" in c for c in _codes(d))


def test_other_processes_advise_gpumem_processes():
    d = diagnose(CROWDED)
    assert d.causes[0] == "other_processes"
    assert d.advice[0].code == "%gpumem --processes"
    assert "Other processes hold " + format_bytes(CROWDED.other_processes) in d.summary


def test_too_large_ranks_batch_amp_accumulation_checkpointing():
    d = diagnose(FULL)
    assert d.causes == ["too_large"]
    assert _codes(d)[:4] == ["%%oomguard -r BATCH -a ACCUM", "%%oomguard --amp bf16",
                             "(loss / ACCUM).backward()",
                             "y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)"]
    d = diagnose(FULL, amp=True, batch_var="bs", accum_var="acc")
    assert _codes(d)[:2] == ["%%oomguard -r bs -a acc", "(loss / acc).backward()"]
    assert not any("--amp" in c for c in _codes(d))


def test_request_larger_than_the_device():
    d = diagnose(HUGE)
    assert d.causes == ["request_exceeds_capacity"]
    assert "x.split(CHUNK)" in d.advice[0].code
    assert "40.00 GiB" in d.summary and "24.00 GiB" in d.summary


def test_names_holding_lists_them_and_advises_item_cpu_and_freecuda():
    d = diagnose(HELD, holders=HOLDERS)
    assert d.causes == ["names_holding"]
    assert [(h.name, h.bytes) for h in d.holders] == sorted(HOLDERS, key=lambda h: -h[1])
    assert d.advice[0].code == "losses.append(loss.item())  # not losses.append(loss)"
    assert "preds.append(out.detach().cpu())" in _codes(d)
    assert "%freecuda losses model preds" in _codes(d)
    assert "losses (6.00 GiB), model (2.00 GiB)" in d.summary      # what each is: d.holders and the report
    assert format_bytes(9 * GiB) in d.summary


def test_small_holders_are_listed_but_not_blamed():
    d = diagnose(FULL, holders=[("x", 1 * MiB)])
    assert "names_holding" not in d.causes and [(h.name, h.bytes) for h in d.holders] == [("x", 1 * MiB)]


def test_unknown_without_figures():
    d = diagnose(OomFields(message="CUDA error: out of memory"))
    assert d.causes == ["unknown"]
    assert "%freecuda" in _codes(d) and "%%oomguard -r BATCH -a ACCUM" in _codes(d)


def test_plenty_free_is_not_blamed_on_what_holds_memory():
    fields = _fields(requested=432 * MiB, capacity=16 * GiB, free=7 * GiB, allocated_by_torch=8 * GiB,
                     reserved_unallocated=2 * GiB, other_processes=0)
    d = diagnose(fields, holders=HOLDERS)
    assert d.causes == ["free_reported"]
    assert "more than requested" in d.summary


def test_ranking_follows_the_bytes_each_cause_explains():
    both = _fields(requested=1 * GiB, capacity=32 * GiB, free=10 * MiB, this_process=25 * GiB,
                   other_processes=7 * GiB - 10 * MiB, allocated_by_torch=10 * GiB,
                   reserved_unallocated=14 * GiB)
    d = diagnose(both)
    assert d.causes == ["fragmentation", "other_processes"]
    assert _codes(d)[0].startswith("import torch;") and "%gpumem --processes" in _codes(d)
    # a cache smaller than the request could not have served it: ranked by bytes, after the others
    both.requested, both.reserved_unallocated, both.other_processes = 5 * GiB, 4 * GiB, 16 * GiB
    d = diagnose(both)
    assert d.causes[0] == "other_processes" and d.causes[-1] == "fragmentation"
    assert _codes(d)[0] == "%gpumem --processes"


def test_capacity_peak_and_limit_fill_in_what_the_message_lacks():
    cpu = OomFields(backend="cpu", device="cpu", requested=20 * GiB)
    assert diagnose(cpu).causes == ["unknown"]
    assert diagnose(cpu, device_capacity=16 * GiB).causes == ["request_exceeds_capacity"]
    small = OomFields(backend="cpu", device="cpu", requested=4 * GiB)
    d = diagnose(small, device_capacity=16 * GiB, peak=14 * GiB)
    assert d.causes == ["too_large"] and "peaked at 14.00 GiB" in d.summary
    plenty = _fields(requested=2 * GiB, capacity=80 * GiB, free=70 * GiB, allocated_by_torch=3 * GiB)
    assert diagnose(plenty).causes == ["free_reported"]
    d = diagnose(plenty, limit=4 * GiB)
    assert d.causes == ["too_large"] and "4.00 GiB allowed" in d.summary


def test_allowed_figure_in_the_message_counts_as_capacity():
    d = explain("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 15.78 GiB total capacity; 3.50 GiB "
                "already allocated; 10.00 GiB free; 4.00 GiB allowed; 3.60 GiB reserved in total by "
                "PyTorch)")
    assert d.causes[0] == "too_large" and "4.00 GiB allowed" in d.summary


def test_every_cause_is_reachable():
    reached = set()
    plenty = _fields(requested=2 * GiB, capacity=80 * GiB, free=70 * GiB, allocated_by_torch=3 * GiB)
    from cuda_magic.oom.cell_reading import read_cell

    evaluating = dict(cell=read_cell("out = model(x)"), by_kind={"activations": 30 * GiB, "parameters": GiB})
    capped = dict(limit=4 * GiB, held_at_start=5 * GiB)
    for fields, kw in [(FRAGMENTED, {}), (CROWDED, {}), (FULL, {}), (HUGE, {}), (HELD, {"holders": HOLDERS}),
                       (OomFields(), {}), (plenty, {}), (FULL, evaluating), (FULL, capped)]:
        reached.update(diagnose(fields, **kw).causes)
    assert reached == set(CAUSE_LABELS)


# -- the corpus and explain() ---------------------------------------------------------------------

@pytest.mark.parametrize("entry", MESSAGES, ids=[e["source"].split("github.com/")[-1][:50] for e in MESSAGES])
def test_every_corpus_message_gets_a_short_summary_and_advice(entry):
    d = explain(entry["text"])
    assert d.causes and set(d.causes) <= set(CAUSE_LABELS)
    assert d.summary.endswith(".") and d.summary.count(". ") <= 1
    if entry["fields"].get("requested") is not None:
        assert format_bytes(entry["fields"]["requested"]) in d.summary
    assert d.advice and all(a.text for a in d.advice)
    assert len({a.text for a in d.advice}) == len(d.advice)


@pytest.mark.parametrize("fragment, first, also", [
    ("murong-xu/CADS", "too_large", "fragmentation"),
    ("carolchenyx/MGFN", "fragmentation", None),
    ("awslabs/keys_values", "too_large", "other_processes"),
    ("ROCm/TheRock", "request_exceeds_capacity", None),
    ("pytorch/issues/16417 (title)", "free_reported", None),
    ("Comfy-Org/ComfyUI/issues/7440", "too_large", None),
])
def test_corpus_diagnoses(fragment, first, also):
    d = explain(_entry(fragment)["text"])
    assert d.causes[0] == first
    if also:
        assert also in d.causes


def test_cudnn_possible_oom_advises_contiguous_first():
    d = explain(_entry("pytorch/pytorch/issues/11065")["text"])
    assert d.summary.startswith("Possibly out of memory")
    assert d.advice[0].code == "x = x.contiguous()"


def test_explain_takes_exceptions_text_or_fields():
    torch = pytest.importorskip("torch")
    text = _entry("murong-xu/CADS")["text"]
    from_text = explain(text, holders=HOLDERS)
    try:
        try:
            raise torch.cuda.OutOfMemoryError(text)
        except torch.cuda.OutOfMemoryError as inner:
            raise ValueError("logging failed") from inner
    except ValueError as outer:
        from_exc = explain(outer, holders=HOLDERS)
    assert from_exc == from_text
    assert explain(OomFields(**vars(FULL))).causes == ["too_large"]


@pytest.mark.parametrize("text", FATAL)
def test_fatal_errors_say_a_restart_is_needed(text):
    assert explain(RuntimeError(text)).summary == FATAL_NOTE
    assert explain(text).summary == FATAL_NOTE


def test_not_an_oom():
    d = explain(ValueError("shapes do not match"))
    assert d.causes == ["unknown"] and "not an out-of-memory error" in d.summary
