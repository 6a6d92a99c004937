"""`%%oomguard` in a real IPython shell, running out of memory for real on the simulated device (`-l`)."""
from __future__ import annotations

import sys

import IPython
import pytest
from conftest import run_ok, tensors_reachable
from IPython.core.error import UsageError

MiB = 2**20
IPYTHON_MAJOR = IPython.version_info[0]

STEP = """
refs = []
def step(n):
    act = torch.ones(n, 1024)             # n * 4 KiB, held by this frame when the next line fails
    refs.append(weakref.ref(act))
    big = torch.empty(n * 4096, 1024)     # n * 16 MiB: past any small limit
    return big
"""


@pytest.fixture
def gip(no_gpu, tip):
    run_ok(tip, STEP)
    return tip


def _alive(ip) -> list[bool]:
    return [ref() is not None for ref in ip.user_ns["refs"]]


def test_failed_cell_frames_are_freed_and_the_short_error_holds_nothing(gip, capsys):
    result = gip.run_cell("%%oomguard -l 64MiB\nbatch = 1024\nout = step(batch)\n", store_history=True)
    assert not result.success
    error = result.error_in_exec
    del result
    assert isinstance(error, gip.user_ns["torch"].cuda.OutOfMemoryError)
    assert _alive(gip) == [False]
    assert error.__context__ is None and error.__cause__ is None
    assert tensors_reachable(error, gip) == []
    assert "out" not in gip.user_ns
    out = capsys.readouterr().out
    assert "out of memory at" in out and "cell line 2" in out and "memory released" in out
    assert "reclaimed" in out.lower()
    gip.run_line_magic("oomguard", "last")       # the folded part, in full
    out = capsys.readouterr().out
    assert "Failed at cell line 2" in out and "out = step(batch)" in out and "Diagnosis:" in out


def test_reachability_walk_does_find_a_tensor_held_by_a_frame(gip):
    result = gip.run_cell("def hold():\n    kept = torch.ones(3)\n    raise ValueError('x')\nhold()")
    assert len(tensors_reachable(result.error_in_exec, gip)) == 1


def test_no_raise_returns_a_report_with_reclaimed_bytes(gip):
    from cuda_magic.recover.report import GuardReport

    result = gip.run_cell("%%oomguard -l 64MiB --no-raise -o -q\nout = step(512)\n", store_history=True)
    assert result.success
    report = result.result
    del result
    assert isinstance(report, GuardReport)
    assert report.outcome == "oom" and not report.succeeded
    # the 2 MiB of `act` is a large-pool request under 10 MiB: torch reserves a 20 MiB segment for it
    # (get_allocation_size: kLargeBuffer), which the clean-up's empty_cache gives back whole
    assert report.reclaimed == {"sim:0": 20 * MiB}
    assert report.failure.line == 1 and report.failure.text == "out = step(512)"
    assert report.failure.function == "step"
    assert report.oom.requested == 512 * 4096 * 1024 * 4
    assert report.oom.capacity == 64 * MiB
    assert [a.outcome for a in report.attempts] == ["oom"]
    assert report.attempts[0].peak == 512 * 1024 * 4
    assert _alive(gip) == [False]
    assert getattr(sys, "last_value", None) is None


def test_a_cell_that_fits_runs_and_reports(gip):
    result = gip.run_cell("%%oomguard -l 64MiB -o -q\nsmall = torch.ones(1024, 1024)\ntotal = small.sum().item()",
                          store_history=True)
    assert result.success
    report = result.result
    assert report.outcome == "ok"
    assert gip.user_ns["total"] == 1024 * 1024
    assert report.peaks["sim:0"] >= 4 * MiB


def test_non_oom_error_is_the_same_object_with_its_frames(gip):
    result = gip.run_cell("%%oomguard\nmarker = KeyError('mine')\ndef inner():\n    local_t = torch.ones(2)\n"
                          "    raise marker\ninner()\n", store_history=True)
    assert not result.success
    error = result.error_in_exec
    del result
    assert id(error) == id(gip.user_ns["marker"])
    assert sys.last_value is error
    frames = []
    tb = sys.last_traceback
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    names = [f.f_code.co_name for f in frames]
    assert names[-1] == "inner" and "<module>" in names
    cell_frame = frames[-1]
    assert cell_frame.f_code.co_filename.startswith("<ipython-input-")
    assert "local_t" in cell_frame.f_locals          # %debug would see the failing frame's locals
    assert error.__traceback__ is not None


def test_keyboard_interrupt_passes_through(gip):
    result = gip.run_cell("%%oomguard\nraise KeyboardInterrupt\n")
    assert isinstance(result.error_in_exec, KeyboardInterrupt)


def test_amp_runs_under_autocast(gip):
    # torch.is_autocast_enabled takes a device type from torch 2.4; before, the CPU has its own function
    run_ok(gip, "def cpu_autocast_on():\n    try:\n        return torch.is_autocast_enabled('cpu')\n"
                "    except TypeError:\n        return torch.is_autocast_cpu_enabled()\n")
    run_ok(gip, "%%oomguard --amp bf16 -q\non = cpu_autocast_on()\n"
                "y = torch.ones(4, 4) @ torch.ones(4, 4)\n")
    assert gip.user_ns["on"] is True
    assert str(gip.user_ns["y"].dtype) == "torch.bfloat16"
    run_ok(gip, "after = cpu_autocast_on()")
    assert gip.user_ns["after"] is False


def test_limit_as_a_fraction_of_the_simulated_session(gip):
    gip.run_line_magic("gpumem", "--simulate 64MiB -q")
    result = gip.run_cell("%%oomguard -l 0.5 --no-raise -o -q\nt = torch.empty(40 * 2**20, dtype=torch.uint8)")
    report = result.result
    assert report.outcome == "oom" and report.limit == 32 * MiB
    assert "t" not in gip.user_ns
    result = gip.run_cell("%%oomguard -l 0.5 -o -q\nt = torch.empty(20 * 2**20, dtype=torch.uint8)")
    assert result.success and result.result.outcome == "ok"
    assert gip.user_ns["t"].numel() == 20 * MiB


def test_limit_as_a_fraction_of_available_memory_without_a_session(gip):
    from cuda_magic.devices.proc import meminfo

    result = gip.run_cell("%%oomguard -l 0.5 -o -q\nz = torch.zeros(10)")
    capacity = result.result.before[0].capacity
    available = meminfo()["MemAvailable"]
    assert 0.35 * available < capacity < 0.65 * available


def test_retry_reduces_the_variable_until_it_fits(gip):
    run_ok(gip, "batch = 64\naccum = 1")
    result = gip.run_cell("%%oomguard -l 16MiB -r batch -a accum -o -q\n"
                          "x = torch.empty(batch * 2**20, dtype=torch.uint8)\n")
    assert result.success
    report = result.result
    assert [a.value for a in report.attempts] == [64, report.final_value]
    assert gip.user_ns["batch"] == report.final_value and 13 <= report.final_value <= 16
    assert gip.user_ns["batch"] * gip.user_ns["accum"] >= 64


BAD = ["-l 12XB", "-l -5GiB", "-l 0", "-l 1.5", "-l abc", "--amp fp8", "-r missing", "-r text",
       "-r zero", "-r negative", "-r flag", "-a accum", "--min 0", "--min abc", "-r batch --min 0",
       "-r batch --min abc", "-d 9", "-d cuda:3", "--bogus", "-r 3x", "on"]


@pytest.mark.parametrize("line", BAD)
def test_bad_input_is_a_one_line_usage_error_and_changes_nothing(gip, line):
    run_ok(gip, "batch = 8\naccum = 2\ntext = 'abc'\nzero = 0\nnegative = -3\nflag = True")
    before = dict(gip.user_ns)
    with pytest.raises(UsageError) as excinfo:
        gip.run_cell_magic("oomguard", line, "body_ran = True\nbatch = 1\n")
    assert type(excinfo.value) is UsageError
    assert "\n" not in str(excinfo.value).strip()
    after = dict(gip.user_ns)
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)


def test_bad_switch_of_the_line_magic(ip):
    with pytest.raises(UsageError) as excinfo:
        ip.run_line_magic("oomguard", "maybe")
    assert type(excinfo.value) is UsageError
    assert "maybe" in str(excinfo.value)


def test_debug_opens_on_the_failing_frame_of_a_guarded_cell(gip, monkeypatch, capsys):
    import io

    from IPython.core.debugger import Pdb

    gip.run_cell("%%oomguard -q\ndef inner():\n    local_t = torch.ones(2, 3)\n    raise KeyError('x')\ninner()\n",
                 store_history=True)
    monkeypatch.setattr(gip.InteractiveTB, "debugger_cls", Pdb)   # the terminal one needs a tty
    monkeypatch.setattr(sys, "stdin", io.StringIO("p tuple(local_t.shape)\nq\n"))
    capsys.readouterr()
    gip.run_line_magic("debug", "")
    out = capsys.readouterr().out
    assert "inner()" in out and "(2, 3)" in out


def test_traceback_names_the_cell_by_its_own_number(gip, capsys):
    result = gip.run_cell("%%oomguard -q\nfirst = 1\nraise KeyError('which cell')\n", store_history=True)
    n = result.execution_count
    out = capsys.readouterr().out
    if IPYTHON_MAJOR >= 8:
        assert f"Cell In[{n}], line 2" in out        # the body's frame (the magic's call is line 1)
        assert f"Cell In[{n + 1}]" not in out
    else:                                            # IPython 7 names a cell <ipython-input-N-hash>
        assert f"<ipython-input-{n}-" in out and "----> 2 raise KeyError" in out
        assert f"<ipython-input-{n + 1}-" not in out


def test_expandable_segments_without_cuda_is_a_one_line_usage_error(tip, monkeypatch):
    from IPython.core.error import UsageError

    monkeypatch.setattr(tip.user_ns["torch"].cuda, "is_available", lambda: False)
    tip.run_cell("marker = 1")
    with pytest.raises(UsageError) as err:
        tip.run_cell_magic("oomguard", "--expandable-segments", "marker = 2")
    assert type(err.value) is UsageError and "\n" not in str(err.value)
    assert "no CUDA device" in str(err.value)
    assert tip.user_ns["marker"] == 1


def test_quoted_sizes_are_read_and_a_split_size_gets_a_hint(tip):
    from IPython.core.error import UsageError

    report = tip.run_cell_magic("oomguard", "-q -o -l '64 MiB'", "y = 1")
    assert report.limit is None or report.limit == 64 * 2**20   # the run's own simulated device has that size
    assert report.before[0].capacity == 64 * 2**20
    with pytest.raises(UsageError) as err:
        tip.run_cell_magic("oomguard", "-l 5 GiB", "y = 2")
    assert type(err.value) is UsageError and "-l 5GiB" in str(err.value)
