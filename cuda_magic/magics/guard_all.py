"""`%oomguard on`: clean up and explain an out-of-memory error in any cell, through IPython's custom
exception handling. `stop()` puts back whatever handling was there before.

Each cell is recorded by the black box (devices/recording.py) on the device it can run out of: the
session's simulated device, or CUDA once the notebook has started it (never started for this). A cell
that fits throws its recording away unread; one that runs out of memory gets the timeline and the
"alive at the failure, by line" table in its report, as a `%%oomguard` cell does."""
from __future__ import annotations

import sys


class GuardAll:
    def __init__(self, shell):
        self.shell = shell
        self.active = False
        self._saved = None
        self.box = None             # the black box recording the running cell (devices/recording.py)
        self.last_report = None     # the report of the last OOM explained (holds no tensor)

    def start(self) -> None:
        if self.active:
            return
        shell = self.shell
        self._saved = (shell.custom_exceptions, shell.CustomTB)
        # set_custom_exc matches classes only: message-based OOMs are RuntimeErrors; the rest is forwarded.
        # The classes a handler registered before us keep reaching it (through _forward) while we are on.
        earlier = tuple(shell.custom_exceptions or ())
        shell.set_custom_exc((RuntimeError, MemoryError) + earlier, self._handler)
        shell.events.register("pre_run_cell", self.pre_run_cell)
        shell.events.register("post_run_cell", self.post_run_cell)
        self.active = True

    def stop(self) -> None:
        if not self.active:
            return
        for name, callback in (("pre_run_cell", self.pre_run_cell), ("post_run_cell", self.post_run_cell)):
            try:
                self.shell.events.unregister(name, callback)
            except ValueError:
                pass
        self._drop_box()
        self.shell.custom_exceptions, self.shell.CustomTB = self._saved
        self._saved = None
        self.active = False

    # the black box around each cell ------------------------------------------------------------------
    def pre_run_cell(self, info=None) -> None:
        self._drop_box()
        raw = getattr(info, "raw_cell", None) or ""
        if raw.lstrip().startswith("%%oomguard"):
            return                  # the cell records itself, with its own options
        try:
            meter = _recordable_meter()
            if meter is not None:
                from cuda_magic.devices.recording import BlackBox

                self.box = BlackBox(meter, find_cell=True)
                self.box.start()
        except Exception as exc:  # a hook must never raise: the cell runs unrecorded
            self.box = None
            print(f"cuda_magic: the black box could not start ({type(exc).__name__}: {exc})", file=sys.stderr)

    def post_run_cell(self, result=None) -> None:
        self._drop_box()

    def _drop_box(self) -> None:
        box, self.box = self.box, None
        if box is not None:
            try:
                box.discard()
            except Exception:  # noqa: BLE001 - a hook must never raise; the recording is gone either way
                pass

    def _handler(self, shell, etype, value, tb, tb_offset=None):
        from cuda_magic.recover.failure import kind_of
        from cuda_magic.recover.report import Outcome

        if kind_of(value) is not Outcome.OOM:      # a fatal CUDA error gets its restart note here
            return self._forward(etype, value, tb, tb_offset)
        if getattr(value, "frames_freed", False):   # `%%oomguard`'s short error: explained already
            self._drop_box()
            return self._forward(etype, value, tb, tb_offset)
        try:
            self._explain(value)
        except Exception as exc:  # never lose the user's error because the report failed
            print(f"cuda_magic: could not explain this OOM ({type(exc).__name__}: {exc})", file=sys.stderr)
            return self._forward(etype, value, tb, tb_offset)
        return None

    def _forward(self, etype, value, tb, tb_offset):
        saved_types, saved_tb = self._saved or ((), None)
        if saved_tb is not None and saved_types and isinstance(value, saved_types):
            return saved_tb(etype, value, tb, tb_offset)
        self.shell.showtraceback((etype, value, tb), tb_offset=tb_offset)
        return None

    def _explain(self, value) -> None:
        """The one path after an OOM (recover/failure.py), on the device that ran out. The handler runs
        inside IPython's `except` block, but the failed cell's frames have finished: clearing them drops
        their locals even though the exception itself lives on (IPython still shows it: not severed)."""
        from cuda_magic.devices.meter import metered_devices
        from cuda_magic.display.show import show
        from cuda_magic.oom.classify import oom_fields
        from cuda_magic.oom.records import OomFields
        from cuda_magic.recover.failure import (conclude, meter_for_failure, read_failure, release_failure,
                                                short_oom_error)
        from cuda_magic.recover.report import Attempt, GuardReport, Outcome

        shell = self.shell
        meter = meter_for_failure(oom_fields(value) or OomFields())
        report = GuardReport(device=meter.key, source="%oomguard on", outcome=Outcome.OOM)
        report.before = metered_devices(meter)      # at the failure: the cell has already run
        box, self.box = self.box, None
        if box is not None and box.meter.key != meter.key:
            box.discard()           # it recorded another device than the one that ran out
            box = None
        if box is not None:
            box.failed()            # on CUDA: the history now, while the failed cell's tensors are alive
        filename = _cell_filename(value.__traceback__)
        failure = read_failure(value, meter, filename=filename)
        report.oom, report.failure = failure.oom, failure.point
        report.by_kind = failure.by_kind
        attempt = Attempt(None, Outcome.OOM, _peak(meter), failure.oom.requested, start_allocated=None)
        report.attempts.append(attempt)
        attempt.reclaimed = release_failure(value, failure, meter, user_ns=shell.user_ns, sever=False,
                                            shell=shell)
        if attempt.reclaimed is not None:
            report.reclaimed[meter.key] = attempt.reclaimed
        if box is not None:
            from cuda_magic.recover.engine import finish_blackbox

            box.pause()             # the clean-up's frees are not the cell's
            finish_blackbox(box, report, meter, None, None)
        conclude(report, meter, shell=shell)
        self.last_report = report
        show(report)
        error = short_oom_error(report)
        shell.showtraceback((type(error), error, None))


def _peak(meter) -> int | None:
    try:
        return meter.peak()
    except (AssertionError, RuntimeError, OSError):
        return None


def _cell_filename(tb) -> str | None:
    """The filename IPython compiled the failing cell under: the first frame that is a cell."""
    from cuda_magic.paths import is_cell_file

    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if is_cell_file(name):
            return name
        tb = tb.tb_next
    return None


def _recordable_meter():
    """The meter of the device a cell can run out of, where the black box records: the session's
    simulated device, or CUDA once started (asking never starts it); None elsewhere."""
    from cuda_magic.devices.probe import cuda_started
    from cuda_magic.devices.simulated import active_device

    if active_device() is not None or cuda_started():
        from cuda_magic.devices.meter import choose_meter

        meter, _ = choose_meter(None, None, None)
        if meter.key.startswith(("sim", "cuda")):
            return meter
    return None
