"""Options are checked in one place (recover/options.py) and before anything acts (issue 40, item 3): a bad
option, or a guarded cell with top-level `await` under `%autoawait off`, is a one-line UsageError before the
black box records, the running view shows, the gauge's thread starts or the allocator's setting changes.
Each test first shows, on the same shell, that a cell that passes the checks does start those things: what
the checks look at can be seen."""
from __future__ import annotations

import threading

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from conftest import run_ok


def gauge_threads() -> list:
    from cuda_magic.display.gauge import THREAD_NAME

    return [t for t in threading.enumerate() if t.name == THREAD_NAME and t.is_alive()]


@pytest.fixture
def watched(tip, monkeypatch):
    """A shell on a 256 MiB simulated device where a guarded cell shows its running view in HTML and starts
    the live gauge (display/gauge.py starts none in a terminal shell: told it can be seen, as
    tests/test_live_gauge.py does); the simulated devices' allocator settings put back afterwards."""
    import cuda_magic.display.gauge as gauge_module
    from cuda_magic.devices import simulated

    monkeypatch.setenv("CUDA_MAGIC_DISPLAY", "html")
    monkeypatch.setattr(gauge_module, "gauge_possible", lambda: True)       # the shell has no kernel
    tip.run_line_magic("gpumem", "--simulate 256MiB -q")
    run_ok(tip, "import asyncio, threading, time\nbs = 64\naccum = 2\n"
                "from cuda_magic.devices.simulated import active_device as _device")
    yield tip
    simulated.apply_allocator_settings(None)


def what_started(shell) -> dict:
    """What a guarded cell starts, read now: recorders on the device, the gauge's threads, the allocator
    settings of simulated devices."""
    from cuda_magic.devices.simulated import active_device, allocator_settings

    return {"recorders": len(active_device().recorders), "gauges": len(gauge_threads()),
            "settings": allocator_settings()}


def control(shell) -> None:
    """A guarded cell that passes every check starts each thing what_started reads: inside it, the black
    box records and the gauge's thread runs; after it, expandable_segments is on."""
    before = what_started(shell)
    with capture_output(display=True) as shown:
        run_ok(shell, "%%oomguard --expandable-segments\n"
                      "inside = (len(_device().recorders), [t.name for t in threading.enumerate()])\n")
    recorders, threads = shell.user_ns.pop("inside")
    from cuda_magic.display.gauge import THREAD_NAME

    assert recorders == 1 and THREAD_NAME in threads
    assert shown.outputs and "expandable_segments" in shown.stdout
    after = what_started(shell)
    assert after["settings"] != before["settings"] and "expandable_segments:True" in after["settings"]
    assert after["recorders"] == after["gauges"] == 0          # the run stopped both
    from cuda_magic.devices import simulated

    simulated.apply_allocator_settings(None)


def refused(shell, line: str, cell: str, match: str) -> None:
    """`%%oomguard line` on `cell` is the one-line UsageError saying `match`, and nothing started or
    changed: no recorder, no gauge thread, the same allocator settings, no output, the same namespace and
    the same last report."""
    from cuda_magic.magics.state import get_state

    before = what_started(shell)
    names = dict(shell.user_ns)
    last = get_state(shell).last_report, get_state(shell).last_prediction
    with capture_output(display=True) as shown, pytest.raises(UsageError) as err:
        shell.run_cell_magic("oomguard", line, cell)
    assert type(err.value) is UsageError and "\n" not in str(err.value)
    assert match in str(err.value), str(err.value)
    assert what_started(shell) == before
    assert not shown.outputs and shown.stdout == "", (shown.stdout, shown.outputs)
    assert {k: v for k, v in shell.user_ns.items() if not k.startswith("_")} == \
        {k: v for k, v in names.items() if not k.startswith("_")}
    assert (get_state(shell).last_report, get_state(shell).last_prediction) == last


def test_an_await_cell_under_autoawait_off_starts_nothing_before_its_usage_error(watched):
    # before the fix the black box, the running view and the gauge's thread had started (and were never
    # stopped) when the error came; the allocator's setting had been switched
    control(watched)
    watched.run_line_magic("autoawait", "off")
    try:
        refused(watched, "--expandable-segments", "await asyncio.sleep(0)\nx = torch.ones(4)",
                "needs IPython's autoawait (%autoawait on)")
        refused(watched, "--predict --expandable-segments", "await asyncio.sleep(0)\nx = torch.ones(4)",
                "--predict cannot run a cell with top-level await")
    finally:
        watched.run_line_magic("autoawait", "on")


@pytest.mark.parametrize("line, match", [
    ("--timeline --no-timeline", "exclude each other"),
    ("-r missing", "no variable 'missing'"),
    ("-r bs --min 0", "--min must be at least 1"),
    ("-r bs --min abc", "--min takes a whole number"),
    ("-r bs --min 128", "already below --min 128"),
    ("--min 4", "--min needs -r VAR"),
    ("--search", "--search needs -r VAR"),
    ("-a accum", "-a VAR2 needs -r VAR"),
    ("-r bs --exact", "--exact needs -a VAR2"),
    ("-r bs -a bs", "-a must name another variable than -r"),
    ("-r 2x", "-r takes a variable name"),
    ("-d cuda:9", "no such device"),
    ("-l 5XB", "-l: "),
    ("--predict --no-raise", "--predict runs nothing"),
    ("--predict --timeline", "--predict runs nothing"),
    ("--predict -r missing", "no variable 'missing'"),
    ("--predict -l 3", "-l: "),
])
def test_each_bad_option_is_a_usage_error_before_anything_acts(watched, line, match):
    control(watched)
    refused(watched, f"--expandable-segments {line}", "x = torch.ones(4)", match)


def test_predict_switches_expandable_segments_on_the_simulated_device_not_cuda(watched):
    # before, `--predict --expandable-segments` took the CUDA path whatever the meter: on this machine
    # without CUDA, a UsageError "no CUDA device" for a prediction on a simulated device
    from cuda_magic.devices.simulated import active_device, allocator_settings

    with capture_output() as shown:
        prediction = watched.run_cell_magic("oomguard", "--predict --expandable-segments -o",
                                            "x = torch.ones(1024, 1024)")
    assert "expandable_segments" in shown.stdout and "no CUDA" not in shown.stdout
    assert "expandable_segments:True" in allocator_settings() and active_device().expandable_segments
    assert prediction.device == "sim:0" and prediction.peak >= 4 * 2**20


def test_the_checks_speak_each_forms_words():
    """One place, two vocabularies: the magic's flags and the API's keywords, for the same problem."""
    from cuda_magic.recover.options import AskedOptions, OptionError

    cases = [
        (AskedOptions(accumulate="a"), "-a VAR2 needs -r VAR"),
        (AskedOptions(api=True, accumulate="a"), "accumulate= needs retry="),
        (AskedOptions(retry="b", floor="0"), "--min must be at least 1"),
        (AskedOptions(api=True, retry="b", floor=0), "min must be an int of at least 1, not 0"),
        (AskedOptions(limit="5XB"), "-l: "),
    ]
    for asked, match in cases:
        with pytest.raises(OptionError, match=match) as err:
            asked.check_form()
        assert err.value.kind is ValueError
    with pytest.raises(OptionError) as err:
        AskedOptions(api=True, retry="b").check_block()
    assert err.value.kind is TypeError and isinstance(err.value.as_api_error(), TypeError)
    with pytest.raises(OptionError, match=r"train\(\) has no argument 'b' to retry"):
        AskedOptions(api=True, retry="b").check({"a": 1}, function="train")
    with pytest.raises(OptionError, match=r"-r b: b must hold a positive int, not 0"):
        AskedOptions(retry="b").check({"b": 0})
    meter, options = AskedOptions(retry="b", floor="2", limit="64MiB").check({"b": 8})
    assert options.retry.variable == "b" and options.retry.floor == 2 and options.limit == 64 * 2**20
    assert options.source == "%%oomguard" and not options.api


def test_the_api_checks_before_the_function_or_the_prediction_runs():
    import cuda_magic as cm

    calls = []

    def train(bs=0):
        calls.append(bs)

    with pytest.raises(ValueError, match="bs must be a positive int to be retried, not 0"):
        cm.predict(train, retry="bs")
    with pytest.raises(ValueError, match=r"device='cuda:9': no such device"):
        cm.predict(train, device="cuda:9")
    with pytest.raises(ValueError, match="amp must be 'bf16' or 'fp16'"):
        cm.predict(train, amp="fp8")
    with pytest.raises(TypeError, match="retry= needs a function to call again"):
        with cm.oomguard(retry="bs"):
            calls.append("block")
    assert calls == []
