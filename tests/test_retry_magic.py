"""`%%oomguard -r` in a real IPython shell on the simulated device (`-l 64MiB`), and the same scenarios
through the Python API's decorator in a plain `python` process."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from IPython.core.error import UsageError

from conftest import run_ok

ROW = 65536 * 4          # bytes of one row of the cell below: bs x 65536 float32, max feasible bs = 256
CELL = "x = torch.ones(bs, 65536)\ndel x"


def guard(tip, flags: str, cell: str = CELL):
    return tip.run_cell(f"%%oomguard -l 64MiB -q -o {flags}\n{cell}")


def test_retry_predicts_from_the_failure_a_value_that_fits_at_once(tip):
    """Item 2: not halving (1024, 512, 256) but the failure's measure, less a margin: one retry, within
    15% of the largest value that fits (256)."""
    run_ok(tip, "bs = 1024")
    result = guard(tip, "-r bs")
    assert result.success
    report = result.result
    assert 0.85 * 256 <= tip.user_ns["bs"] <= 256
    assert [a.value for a in report.attempts] == [1024, tip.user_ns["bs"]]
    assert [a.outcome for a in report.attempts] == ["oom", "ok"]
    assert report.final_value == tip.user_ns["bs"] and report.outcome == "recovered"


def test_search_from_1000_finds_at_least_243_within_4_attempts(tip):
    run_ok(tip, "bs = 1000")
    report = guard(tip, "-r bs --search").result
    assert 243 <= tip.user_ns["bs"] <= 256
    assert len(report.attempts) <= 4
    assert report.attempts[-1].outcome == "ok" or report.final_value == tip.user_ns["bs"]


@pytest.mark.parametrize("start", [4096, 1000, 300])
def test_search_attempt_counts_on_the_simulated_device(tip, start):
    run_ok(tip, f"bs = {start}")
    report = guard(tip, "-r bs --search").result
    maximum = 64 * 2**20 // ROW
    assert len(report.attempts) <= 4, [(a.value, a.outcome) for a in report.attempts]
    assert 0.95 * maximum <= tip.user_ns["bs"] <= maximum


def test_accumulation_keeps_the_effective_batch(tip):
    run_ok(tip, "bs = 1024\naccum = 3")
    report = guard(tip, "-r bs -a accum").result
    bs, accum = tip.user_ns["bs"], tip.user_ns["accum"]
    assert bs * accum >= 1024 * 3
    assert bs * (accum - 1) < 1024 * 3          # the smallest such integer
    assert report.original_accumulate == 3 and report.final_accumulate == accum


def test_floor_that_still_fails_raises_and_restores(tip):
    run_ok(tip, "bs = 1024\naccum = 2")
    result = tip.run_cell("%%oomguard -l 64MiB -q -r bs -a accum --min 512\n" + CELL)
    assert not result.success
    assert isinstance(result.error_in_exec, tip.user_ns["torch"].cuda.OutOfMemoryError)
    assert tip.user_ns["bs"] == 1024 and tip.user_ns["accum"] == 2


def test_interrupt_during_attempts_restores_both(tip):
    run_ok(tip, "bs = 1024\naccum = 1")
    cell = "if bs < 1024:\n    raise KeyboardInterrupt\n" + CELL
    result = tip.run_cell("%%oomguard -l 64MiB -q -r bs -a accum\n" + cell)
    assert not result.success
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    assert tip.user_ns["bs"] == 1024 and tip.user_ns["accum"] == 1


def test_non_oom_error_stops_attempts_and_restores(tip):
    run_ok(tip, "bs = 1024\naccum = 1")
    cell = "if bs < 1024:\n    raise ValueError('broken data')\n" + CELL
    result = tip.run_cell("%%oomguard -l 64MiB -q -r bs -a accum\n" + cell)
    assert isinstance(result.error_in_exec, ValueError)
    assert tip.user_ns["bs"] == 1024 and tip.user_ns["accum"] == 1


def test_failed_attempt_is_released_before_the_next_one_starts(tip):
    """Each failed attempt's tensors are gone (weakref dead) and the device's counter is back at the
    baseline when the next attempt starts: the cache is emptied only after the release."""
    run_ok(tip, "bs = 1024\nrefs = []\nseen = []\n"
                "def attempt(bs):\n"
                "    keep = torch.ones(bs, 1024)\n"
                "    refs.append(weakref.ref(keep))\n"
                "    big = torch.ones(bs, 65536)\n")
    cell = "seen.append([r() is not None for r in refs])\nattempt(bs)"
    report = tip.run_cell("%%oomguard -l 64MiB -q -o -r bs\n" + cell).result
    seen = tip.user_ns["seen"]
    assert len(seen) == len(report.attempts) >= 2
    for alive in seen:
        assert not any(alive), "a failed attempt's tensor was still alive when the next attempt started"
    starts = [a.start_allocated for a in report.attempts]
    assert starts == [starts[0]] * len(starts), starts
    failed = report.attempts[0]
    assert failed.outcome == "oom" and failed.peak >= 1024 * 1024 * 4   # keep was counted, then freed
    assert report.reclaimed["sim:0"] >= 1024 * 1024 * 4


def test_a_failed_attempts_bindings_are_undone(tip):
    """Item 1: names the failed attempt bound or rebound get their old values back (the cell ends as if
    it had run once), and a tensor it bound before failing is freed, not carried into the next attempt."""
    run_ok(tip, "bs = 1024\ncounter = 0\nmodel_w = torch.zeros(4)")
    cell = "counter = counter + 1\nkeep = torch.ones(bs, 4096)\nmodel_w = model_w + 1\n" + CELL
    report = guard(tip, "-r bs", cell).result
    assert report.outcome == "recovered" and len(report.attempts) == 2
    assert tip.user_ns["counter"] == 1 and tip.user_ns["model_w"].tolist() == [1.0] * 4
    # the second attempt started from the baseline: the first one's `keep` was unbound and freed
    assert report.attempts[1].start_allocated == report.attempts[0].start_allocated
    assert not report.not_undone


def test_what_cannot_be_undone_is_named(tip, tmp_path):
    run_ok(tip, f"bs = 1024\nlosses = []\npath = {str(tmp_path / 'log.txt')!r}")
    cell = "losses.append(bs)\nopen(path, 'a').write('x')\n" + CELL
    report = guard(tip, "-r bs", cell).result
    assert tip.user_ns["losses"] == [1024, tip.user_ns["bs"]]
    assert any(n.startswith("losses (a list changed in place") for n in report.not_undone), report.not_undone
    assert any("log.txt" in n for n in report.not_undone)
    assert "not undone: losses" in str(report)
    assert "0 items before, 1 after the undone attempts" in str(report)   # the final run added the second


def test_what_the_run_that_stands_adds_is_not_called_undone(tip):
    """A list the failed attempt left alone and the final run appends to, and IPython's `Out` (the final
    run's value, shown): neither is an effect of an undone attempt."""
    from IPython.utils.capture import capture_output

    run_ok(tip, "bs = 1024\nlosses = []", store_history=True)
    with capture_output() as shown:
        result = tip.run_cell(f"%%oomguard -l 64MiB -r bs\n{CELL}\nlosses.append(bs)\nlen(losses)\n",
                              store_history=True)
    assert result.success and result.result == 1 and len(tip.user_ns["losses"]) == 1
    assert "recovered" in shown.stdout or "fits at" in shown.stdout, shown.stdout
    assert "not undone" not in shown.stdout, shown.stdout


@pytest.mark.parametrize("flags, value", [
    ("-r bs", "0"), ("-r bs", "-3"), ("-r bs", "True"), ("-r bs", "'big'"), ("-r bs", "2.5"),
    ("-r missing", "4"), ("-a accum", "4"), ("-r bs --min 0", "4"), ("-r bs --min abc", "4"),
    ("-r bs -a bs", "4"), ("--search", "4"), ("-r bs --min 8", "4"),
])
def test_bad_retry_options_are_one_line_usage_errors_and_change_nothing(tip, flags, value):
    run_ok(tip, f"bs = {value}\naccum = 2")
    before = (tip.user_ns["bs"], tip.user_ns["accum"])
    with pytest.raises(UsageError) as err:
        tip.run_cell_magic("oomguard", f"-l 64MiB {flags}", CELL)
    assert type(err.value) is UsageError and "\n" not in str(err.value)
    assert (tip.user_ns["bs"], tip.user_ns["accum"]) == before


SCRIPT = textwrap.dedent("""
    import sys, torch
    from cuda_magic import oomguard

    @oomguard(retry="bs", accumulate="accum", limit="64MiB", search=SEARCH, min=FLOOR, quiet=True)
    def step(bs=START, accum=2):
        if STOP_EARLY and bs < START:
            raise KeyboardInterrupt
        x = torch.ones(bs, 65536)
        return bs, accum

    try:
        print("RESULT", step())
    except torch.cuda.OutOfMemoryError as exc:
        print("OOM", exc)
    except KeyboardInterrupt:
        print("INTERRUPTED")
    r = step.last_report
    print("ATTEMPTS", [(a.value, str(a.outcome)) for a in (r.attempts if r else [])])
    print("IPYTHON", "IPython" in sys.modules)
""")


def run_script(start=1024, search=False, floor=1, interrupt=False):
    code = (SCRIPT.replace("SEARCH", str(search)).replace("FLOOR", str(floor))
            .replace("START", str(start)).replace("STOP_EARLY", str(interrupt)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_decorator_in_a_plain_script_retries_searches_and_accumulates():
    out = run_script(1024)
    result = eval(out.split("RESULT ", 1)[1].splitlines()[0])
    assert 0.85 * 256 <= result[0] <= 256 and result[0] * result[1] >= 1024 * 2
    assert "IPYTHON False" in out
    out = run_script(1000, search=True)
    bs, accum = eval(out.split("RESULT ", 1)[1].splitlines()[0])
    attempts = eval(out.split("ATTEMPTS ", 1)[1].splitlines()[0])
    assert bs >= 243 and len(attempts) <= 4 and bs * accum >= 2000


def test_decorator_floor_raises_the_oom_and_interrupt_stops():
    out = run_script(1024, floor=512)
    assert "OOM" in out and "RESULT" not in out
    assert "ATTEMPTS [(1024, 'oom'), (512, 'oom')]" in out
    out = run_script(1024, interrupt=True)
    assert "INTERRUPTED" in out
