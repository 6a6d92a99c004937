"""Issue 21: the report is an answer. In a real shell on the simulated device, a real failing cell's report
leads with the line that failed (asked against free, what came back), the cause in one sentence, and the
first thing to do as a line to paste with the cell's own names; the rest is folded and `%oomguard last`
shows it."""
from __future__ import annotations

import re

import pytest

from conftest import run_ok

MODEL = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512))
opt = torch.optim.Adam(model.parameters())
"""
TRAIN = """
for step in range(accum_steps):
    x = torch.randn(batch_size, 512)
    loss = model(x).pow(2).mean() / accum_steps
    loss.backward()
opt.step(); opt.zero_grad()
"""


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_a_training_cell_gets_its_own_names_in_the_line_to_paste(tip, capsys):
    tip.run_line_magic("gpumem", "--simulate 256MiB -q")
    run_ok(tip, MODEL + "batch_size = 32768\naccum_steps = 1\nwidth = 512")
    capsys.readouterr()
    report = tip.run_cell("%%oomguard --no-raise -o" + TRAIN).result
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert report.outcome == "oom"
    flat = _flat(out)
    assert flat.startswith("%%oomguard: out of memory at cell line 3 `loss = model(x).pow(2).mean() / accum_steps`: "
                           "asked 256.00 MiB,")
    assert "free of 256.00 MiB; memory released:" in flat and "no restart needed" in flat
    assert lines[2].startswith("Cause: The working set is too large")
    do = next(i for i, line in enumerate(lines) if line.startswith("Do this: "))
    assert do <= 4 and "    %%oomguard -r batch_size -a accum_steps" in lines
    assert "BATCH" not in out and "ACCUM" not in out and "width" not in out
    assert lines[-2].startswith("More (") and lines[-2].endswith("%oomguard last")
    for folded in ("Diagnosis:", "reserved but unallocated", "At the failure, by kind", "Try, most useful first"):
        assert folded not in out, folded
    # the rest, in full
    tip.run_line_magic("oomguard", "last")
    full = capsys.readouterr().out
    assert "-- details --" in full and "Diagnosis:" in full and "reserved but unallocated" in full
    assert full.startswith(out.split("More (")[0].rstrip())
    assert str(report) == full.rstrip("\n")


def test_a_batch_named_without_accumulation_gets_retry_without_a(tip, capsys):
    """A cell with `bs` and no accumulation: `-r bs` alone (an `-a` with a name the cell lacks would be a
    UsageError when pasted)."""
    tip.run_line_magic("gpumem", "--simulate 256MiB -q")
    run_ok(tip, MODEL + "bs = 32768")
    capsys.readouterr()
    tip.run_cell("%%oomguard --no-raise\nx = torch.randn(bs, 512)\nloss = model(x).pow(2).mean()\nloss.backward()\n"
                 "opt.step()")
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "    %%oomguard -r bs" in lines and not [line for line in lines if "%%oomguard -r bs -a" in line]


def test_one_allocation_larger_than_the_device_comes_first(tip, capsys):
    """The issue's cell: 300 MiB asked on 256 MiB while names hold 64 MiB; the cause is the allocation, the
    first advice works in pieces (not `.detach()`, which frees nothing here), and nothing nests brackets."""
    tip.run_line_magic("gpumem", "--simulate 256MiB -q")
    run_ok(tip, MODEL + "h = torch.randn(4096, 4096, requires_grad=True) * 1\nlogged = [h.sum() for _ in range(3)]")
    capsys.readouterr()
    report = tip.run_cell("%%oomguard --no-raise -o\ny = torch.empty(300 * 2**20, dtype=torch.uint8)").result
    out = capsys.readouterr().out
    assert report.diagnosis.causes[0] == "request_exceeds_capacity"
    cause = next(line for line in out.splitlines() if line.startswith("Cause:"))
    assert cause.startswith("Cause: A single allocation of 300.00 MiB is larger than the whole device")
    do = out.split("Do this:")[1].split("Or:")[0]
    assert "detach" not in do and "pieces" in do
    assert not re.search(r"\([^()]*\([^()]*\)[^()]*\)[^()]*\(", report.diagnosis.summary)   # no (a (b)) (c)


def test_html_leads_with_the_answer_and_folds_the_rest(tip):
    from cuda_magic.display.html import guard_html

    tip.run_line_magic("gpumem", "--simulate 256MiB -q")
    run_ok(tip, MODEL + "batch_size = 32768\naccum_steps = 1")
    report = tip.run_cell("%%oomguard --no-raise -q -o" + TRAIN).result
    html = guard_html(report)
    head, folded = html.split('<details class="cuda-magic-details"', 1)
    assert "<details" not in head and " open" not in folded.split(">", 1)[0]
    assert head.index("cuda-magic-headline") < head.index("<b>Cause:</b>") < head.index("<b>Do this:</b>")
    assert head.index("<b>Do this:</b>") < head.index("cuda-magic-timeline")
    assert "%%oomguard -r batch_size -a accum_steps</code>" in head
    assert "`" not in re.sub(r"<code[^>]*>.*?</code>", "", head, flags=re.S)    # backticks drawn as code
    for facts in ("Diagnosis:", "reserved but unallocated", "At the failure, by kind"):
        assert facts not in head and facts in folded
    assert 'open>' in guard_html(report, full=True).split('<details class="cuda-magic-details"', 1)[1][:80]


def test_a_retry_says_the_value_it_tries_before_each_attempt(tip, capsys):
    tip.run_line_magic("gpumem", "--simulate 256MiB -q")
    run_ok(tip, MODEL + "batch_size = 32768\naccum_steps = 1")
    import importlib

    S = importlib.import_module("cuda_magic.display.show")

    tried, shown = [], []
    original = S.GuardHandle.try_value

    def spy(self, value, accumulate=None):
        tried.append((value, accumulate, len(self.attempts)))
        original(self, value, accumulate)
        if self.form == "html":
            shown.append(self.html_bundle(self.running(), running=True, trying=self.trying)["text/plain"])

    S.GuardHandle.try_value = spy
    try:
        report = tip.run_cell("%%oomguard -r batch_size -a accum_steps -o" + TRAIN).result
    finally:
        S.GuardHandle.try_value = original
    assert report.outcome == "recovered"
    values = [a.value for a in report.attempts]
    assert [v for v, _, _ in tried][: len(values)] == values
    assert [n for _, _, n in tried][: len(values)] == list(range(len(values)))    # before each attempt ran
    assert all(a * v == 32768 or a * v >= 32768 for v, a, _ in tried if a)         # the effective batch kept
    from cuda_magic.display.text import guard_text

    from dataclasses import replace

    first_done = replace(report, attempts=report.attempts[:1])       # as the header reads while attempt 2 runs
    running = guard_text(first_done, running=True, trying=(tried[1][0], tried[1][1]))
    assert running.startswith(f"%%oomguard: running the cell, attempt 2 at "
                              f"batch_size = {tried[1][0]}, accum_steps = {tried[1][1]}")


def test_last_without_a_report_says_so(ip, capsys):
    ip.run_line_magic("oomguard", "last")
    assert "No guarded cell has run yet" in capsys.readouterr().out


def test_a_running_cell_shows_no_empty_peak_and_after_bars():
    """While a cell runs its peak and after are not known yet: the running view draws the 'before' bar only
    (the live gauge shows the rest), the finished report all three."""
    from cuda_magic.devices.readings import DeviceMemory
    from cuda_magic.display.html import guard_html
    from cuda_magic.recover.report import GuardReport

    dev = DeviceMemory("sim:0", "simulated GPU", "simulated", 2**30, torch_allocated=2**20, torch_cached=0,
                       other_this_process=0, other_processes=0, free=2**30 - 2**20, peak=2**20)
    running = guard_html(GuardReport(device="sim:0", before=[dev]), running=True)
    assert ">before<" in running and ">peak<" not in running and ">after<" not in running and "n/a" not in running
    done = guard_html(GuardReport(device="sim:0", before=[dev], after=[dev], peaks={"sim:0": 2**21}))
    assert ">before<" in done and ">peak<" in done and ">after<" in done


def test_between_attempts_the_header_names_the_attempt_that_failed_not_a_next_one():
    """After attempt 1 fails the retry undoes it and measures the model before it sets the next value: the
    header says so, never 'attempt 2 at <the value that failed>'."""
    from cuda_magic.display.answer import headline
    from cuda_magic.recover.report import Attempt, GuardReport, Retry

    report = GuardReport(device="sim:0", retry=Retry("batch_size", 32768, accumulate="accum_steps",
                                                     original_accumulate=1),
                         attempts=[Attempt(32768, "oom", peak=2**20)])
    gap = headline(report, running=True, trying=(32768, 1))
    assert gap == ("%%oomguard: running the cell; attempt 1 ran out of memory at batch_size=32768, "
                   "choosing the next value")
    assert headline(report, running=True, trying=(5984, 6)) == (
        "%%oomguard: running the cell, attempt 2 at batch_size = 5984, accum_steps = 6")


def test_the_widget_puts_the_answer_before_the_black_box(tip):
    from cuda_magic.display.widget import GuardWidget

    tip.run_line_magic("gpumem", "--simulate 256MiB -q")
    run_ok(tip, MODEL + "batch_size = 32768\naccum_steps = 1")
    report = tip.run_cell("%%oomguard --no-raise -q -o" + TRAIN).result
    w = GuardWidget(report)
    shown = [c for c in w.widget.children if c.layout.display != "none"]
    assert shown[:4] == [w.title, w.diagnosis, w.blackbox, w.details]
    assert "Do this:" in w.diagnosis.value and "cuda-magic-timeline" in w.blackbox.value


# -- issue 36: the report after a retry, the request, the "Or:" lines ---------------------------------

TWO_LINES = """%%oomguard -r bs -o
a = torch.empty(bs, 2**20, dtype=torch.uint8)
b = torch.empty(200 * 2**20, dtype=torch.uint8)
"""


def test_after_a_retry_the_headline_names_one_attempt_its_value_its_line_its_sizes(tip, capsys):
    """Issue 36: bs=512 runs out at line 1 asking 512 MiB; the smaller values run out at line 2 asking 200 MiB.
    The headline joined line 2's request with 'at bs=512'; it names the attempt it explains (the last that ran
    out, as the cause and the black box do): its value, its line, its request."""
    tip.run_line_magic("gpumem", "--simulate 256MiB -q")
    run_ok(tip, "bs = 512")
    capsys.readouterr()
    report = tip.run_cell(TWO_LINES).result
    out = _flat(capsys.readouterr().out.split("%%oomguard: ")[1].split("\nbs = ")[0])
    failed = [a for a in report.attempts if a.outcome == "oom"]
    assert report.outcome == "recovered" and failed[0].value == 512 and failed[0].requested == 512 * 2**20
    last = failed[-1]
    assert last.requested == 200 * 2**20 and last.value != 512
    assert "cell line 2 `b = torch.empty(200 * 2**20, dtype=torch.uint8)`: asked 200.00 MiB" in out, out
    assert out.endswith(f"at bs={last.value}"), out
    assert "bs=512" not in out


def test_the_headline_gives_the_tensors_request_and_labels_the_segment(tip, capsys):
    """Issue 36: a 5.38 MiB tensor that does not fit: torch's message (and the simulated device's) states the
    20 MiB segment the allocator tried to reserve for it; the headline gives the tensor's request, and the
    segment only as such."""
    tip.run_line_magic("gpumem", "--simulate 64MiB -q")
    run_ok(tip, "held = torch.empty(56 * 2**20, dtype=torch.uint8)")
    capsys.readouterr()
    report = tip.run_cell("%%oomguard --no-raise -o\nsmall = torch.empty(int(5.38 * 2**20), dtype=torch.uint8)").result
    out = _flat(capsys.readouterr().out)
    assert report.oom.requested == 20 * 2**20
    assert int(5.38 * 2**20) <= report.blackbox.failure.requested < int(5.38 * 2**20) + 512     # its block
    assert ": asked 5.38 MiB (a 20.00 MiB segment), " in out, out
    assert "asked 20.00 MiB" not in out
    assert "tried to allocate 5.38 MiB (a 20.00 MiB segment)" in report.diagnosis.summary, report.diagnosis.summary


def test_or_lines_are_never_cut_inside_a_word():
    """Issue 36: the 'Or:' lines were cut at 80 characters ('(another notebo…'): each label ends at a word,
    at the end of a clause where one fits, and the whole advice stays in the folded part."""
    from cuda_magic.display.answer import steps
    from cuda_magic.oom.diagnosis import explain
    from cuda_magic.recover.report import GuardReport
    from oom_messages import MESSAGES

    seen = 0
    for entry in MESSAGES:
        report = GuardReport(device="cuda:0", outcome="oom", diagnosis=explain(entry["text"]))
        for step in steps(report, count=5):
            label = step.label.removesuffix(" …")
            words = " ".join(step.text.split())
            assert words.startswith(label), (label, words)
            assert len(label) == len(words) or words[len(label)] in " :;,(.", (label, words)
            seen += step.label != words.split(":", 1)[0].strip()
    assert seen        # some labels were shortened
    processes = next(s for e in MESSAGES for s in steps(GuardReport(device="cuda:0", outcome="oom",
                                                                    diagnosis=explain(e["text"])), count=5)
                     if s.code == "%gpumem --processes")
    assert processes.label == "See which processes use the GPU and close those you do not need"
    expandable = next(s for e in MESSAGES for s in steps(GuardReport(device="cuda:0", outcome="oom",
                                                                     diagnosis=explain(e["text"])), count=5)
                      if s.code and "expandable" in s.code)
    assert expandable.label == "Switch on expandable_segments", expandable.label   # its first clause, no " …"


def test_a_name_the_cell_only_rebinds_is_among_what_to_free(tip, capsys):
    """Issue 36: `big = torch.empty(...)` while the old `big` holds 300 MiB: the cell never reads the old
    value, it only replaces it, and deleting it first makes the new one fit: `%freecuda big` is the thing to
    do (the name dropped out of "free these" because the cell uses the name)."""
    tip.run_line_magic("gpumem", "--simulate 512MiB -q")
    run_ok(tip, "big = torch.empty(300 * 2**20, dtype=torch.uint8)")
    capsys.readouterr()
    report = tip.run_cell("%%oomguard --no-raise -o\nbig = torch.empty(300 * 2**20, dtype=torch.uint8)").result
    out = capsys.readouterr().out
    assert "big" in {h.name for h in report.diagnosis.holders}
    do = out.split("Do this:")[1].split("\nOr:")[0]
    assert "    %freecuda big" in do.splitlines(), out
    assert "big" in tip.user_ns            # named, never deleted


def test_a_name_the_cell_reads_first_is_not_advised_to_free(tip, capsys):
    """The other side: `big = big + 1` reads the old `big`: the cell needs it, it is not offered to delete."""
    tip.run_line_magic("gpumem", "--simulate 512MiB -q")
    run_ok(tip, "big = torch.zeros(300 * 2**20, dtype=torch.uint8)")
    report = tip.run_cell("%%oomguard --no-raise -q -o\nbig = big + 1").result
    assert not any("%freecuda big" in (a.code or "") for a in report.diagnosis.advice)


def test_a_list_the_cell_makes_and_fills_with_losses_is_still_the_leak(tip):
    """The other side of the step's own values: `losses = []` made by the cell and appended a loss with its
    graph at every step keeps them all; it stays named, with `.item()`."""
    tip.run_line_magic("gpumem", "--simulate 256MiB -q")
    run_ok(tip, MODEL)
    report = tip.run_cell("%%oomguard --no-raise -q -o\nlosses = []\nfor i in range(400):\n"
                          "    x = torch.randn(2048, 512)\n    loss = model(x).pow(2).mean()\n    losses.append(loss)\n"
                          ).result
    assert "losses" in {h.name for h in report.diagnosis.holders}
    assert any("losses.append(loss.item())" in (a.code or "") for a in report.diagnosis.advice)


def _lead(out: str) -> list[str]:
    """The "Do this" step's lines: its words and the lines to paste under it."""
    lines = out.splitlines()
    do = next(i for i, line in enumerate(lines) if line.startswith("Do this: "))
    end = next(i for i in range(do + 1, len(lines)) if lines[i].startswith(("Or: ", "Black box", "More (")))
    return lines[do:end]


def test_after_a_retry_that_fitted_the_lead_is_the_value_to_keep(tip, capsys):
    """Issue 36: after `-r` fitted, "Do this" was the diagnosis's first advice for the failure before it (mixed
    precision), as if nothing had been done. It says what happened and what to keep: the value that fitted
    (and the accumulation that keeps the effective batch), as lines to paste; the other advice follows."""
    tip.run_line_magic("gpumem", "--simulate 256MiB -q")
    run_ok(tip, MODEL + "batch_size = 32768\naccum_steps = 1")
    capsys.readouterr()
    report = tip.run_cell("%%oomguard -r batch_size -a accum_steps -o" + TRAIN).result
    out = capsys.readouterr().out
    assert report.outcome == "recovered"
    final, acc = report.final_value, report.final_accumulate
    assert final < 32768 and acc > 1
    lead = _lead(out)
    assert _flat(" ".join(lead)).startswith(f"Do this: batch_size={final} fits: the cell ran once at it "
                                     f"(batch_size=32768 ran out of memory), and accum_steps={acc} keeps the "
                                     "effective batch"), lead
    assert lead[-2:] == [f"    batch_size = {final}", f"    accum_steps = {acc}"], lead
    assert "mixed precision" not in " ".join(lead)
    assert any(line.startswith("Or: Run in mixed precision") for line in out.splitlines())
    # the accumulation is done (`-a` raised it): no advice to add it
    assert "gradient accumulation" not in out and "(loss / accum_steps).backward()" not in out
    from cuda_magic.display.html import guard_html

    html = guard_html(report)
    do = html.index("<b>Do this:</b>")
    assert html.index(f"batch_size={final} fits", do) < html.index("Or: ", do)
    assert f"batch_size = {final}\naccum_steps = {acc}" in html


def test_each_attempt_row_says_where_it_ran_out_what_it_asked_and_its_peak(tip, capsys):
    """Issue 36: the folded attempts table gave each attempt's request and peak but not where it ran out:
    bs=512 ran out at line 1 asking 512 MiB, the next value at line 2 asking 200 MiB; each row says its own
    line (not the last failure's), its request, its peak; the value that fitted says so."""
    tip.run_line_magic("gpumem", "--simulate 256MiB -q")
    run_ok(tip, "bs = 512")
    capsys.readouterr()
    report = tip.run_cell(TWO_LINES).result
    capsys.readouterr()
    tip.run_line_magic("oomguard", "last")
    full = capsys.readouterr().out
    rows = full.split("\nAttempts\n")[1].splitlines()
    assert rows[0].split() == ["#", "bs", "outcome", "asked", "peak", "duration"]
    from cuda_magic.units import format_bytes

    by_value = {a.value: (i, a) for i, a in enumerate(report.attempts, 1)}
    i, first = by_value[512]
    row = _flat(rows[i])
    assert re.match(rf"{i} 512 out of memory at cell line 1 `a = torch\.empty\(bs, 2\*\*20, dtyp…` 512\.00 MiB "
                    rf"{re.escape(format_bytes(first.peak))} ", row), row
    later = [(i, a) for i, a in enumerate(report.attempts, 1) if a.outcome == "oom" and a.value != 512]
    assert later
    for i, a in later:
        row = _flat(rows[i])
        assert f"{a.value} out of memory at cell line 2 `b = torch.empty(200 * 2**20, dt…` 200.00 MiB " in row, row

    i, kept = next((i, a) for i, a in enumerate(report.attempts, 1) if a.outcome == "ok")
    assert re.match(rf"{i}\s+{kept.value}\s+fitted\s+{re.escape(format_bytes(kept.peak))}\s", rows[i].strip()), rows[i]
    from cuda_magic.display.html import guard_html

    html = guard_html(report)
    table = html.split("<b>Attempts</b>")[1]
    assert "out of memory at cell line 1 `a = torch.empty(bs, 2**20, dtyp…`</td>" in table
    assert "out of memory at cell line 2" in table and "fitted</td>" in table


def test_a_real_model_far_too_large_leads_with_the_batch(tip, capsys):
    """Issue 36's report item 2 on a real cell: a transformers Llama trained at 17 times the largest batch
    that fits (85 on 64 MiB), after a run at 80 left the cache holding more than the failing request, led
    with "Switch on expandable_segments" (pasted, it runs out again at the same line); it leads with the
    batch (`-r bs`), expandable_segments after it (the figures-only test is tests/test_diagnosis_rules.py's)."""
    pytest.importorskip("transformers")
    from model_cells import LLAMA, LLAMA_CELL

    tip.run_line_magic("gpumem", "--simulate 64MiB -q")
    run_ok(tip, LLAMA)
    run_ok(tip, "reset()\nbs = 80\n" + LLAMA_CELL)            # fits: its segments stay cached
    run_ok(tip, f"reset()\nbs = {17 * 85}")
    capsys.readouterr()
    report = tip.run_cell("%%oomguard --no-raise -o\n" + LLAMA_CELL).result
    out = capsys.readouterr().out
    assert report.outcome == "oom"
    assert report.oom.reserved_unallocated > report.oom.requested      # the cache could have served it
    assert "fragmentation" in report.diagnosis.causes
    lead = _lead(out)
    assert lead[0].startswith("Do this: Use a smaller batch"), lead
    assert lead[-1] == "    %%oomguard -r bs", lead
    assert "expandable" not in " ".join(lead)
    run_ok(tip, "reset()")


def test_a_cell_the_cache_stands_in_the_way_of_leads_with_expandable_segments(tip, capsys):
    """Issue 36's report item 2, the other side, on a real cell: a 60 MiB tensor freed leaves its segment
    holding `b` (30 MiB) and a 30 MiB hole; `c` (40 MiB) does not fit though the tensors alone (70 MiB) would
    on 80 MiB: the cache stands between the request and fitting, so expandable_segments leads."""
    tip.run_line_magic("gpumem", "--simulate 80MiB -q")
    run_ok(tip, "bs = 30")
    capsys.readouterr()
    report = tip.run_cell("%%oomguard --no-raise -o\nb = c = None\na = torch.empty(60 * 2**20, dtype=torch.uint8)\n"
                          "del a\nb = torch.empty(bs * 2**20, dtype=torch.uint8)\n"
                          "c = torch.empty(40 * 2**20, dtype=torch.uint8)\n").result
    out = capsys.readouterr().out
    assert report.oom.reserved_unallocated == 30 * 2**20 and report.oom.allocated_by_torch == 30 * 2**20
    lead = _lead(out)
    assert lead[0].startswith("Do this: Switch on expandable_segments"), lead
    assert any("--expandable-segments" in line for line in lead), lead
    run_ok(tip, "b = c = None")
