"""`%oomguard on`: clean up and explain an out-of-memory error in any cell, through IPython's custom
exception handling. `stop()` puts back whatever handling was there before.

An adapter over the core (recover/guarded.py): each cell is a GuardedRun that only records (the black
box, devices/recording.py, on the device it can run out of: the session's simulated device, or CUDA
once the notebook has started it, never started for this) while IPython runs the cell itself. A cell
that fits throws its recording away unread; one that runs out of memory is ended through the run with
its error: the clean-up, the timeline, "alive at the failure, by line" and the diagnosis, as a
`%%oomguard` cell gets."""
from __future__ import annotations

import sys


class GuardAll:
    def __init__(self, shell, state=None):
        self.shell = shell
        self.state = state          # the extension's state: its last_report is `%oomguard last`'s
        self.active = False
        self._saved = None
        self.run = None             # the core's GuardedRun recording the running cell (recover/guarded.py)
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
        self._discard()
        self.shell.custom_exceptions, self.shell.CustomTB = self._saved
        self._saved = None
        self.active = False

    # the black box around each cell ------------------------------------------------------------------
    def pre_run_cell(self, info=None) -> None:
        self._discard()
        raw = getattr(info, "raw_cell", None) or ""
        if raw.lstrip().startswith("%%oomguard"):
            return                  # the cell records itself, with its own options
        try:
            meter = _recordable_meter()
            if meter is not None:
                self.run = self._guarded(meter)
                self.run.record(raw)
        except Exception as exc:  # a hook must never raise: the cell runs unrecorded
            self.run = None
            print(f"cuda_magic: the black box could not start ({type(exc).__name__}: {exc})", file=sys.stderr)

    def post_run_cell(self, result=None) -> None:
        self._discard()

    def _guarded(self, meter):
        from cuda_magic.recover.guarded import GuardedRun, GuardOptions

        return GuardedRun(meter, GuardOptions(source="%oomguard on", shown_by_ipython=True),
                          namespace=self.shell.user_ns, shell=self.shell)

    def _discard(self) -> None:
        run, self.run = self.run, None
        if run is not None:
            try:
                run.discard()
            except Exception as exc:  # noqa: BLE001 - a hook must never raise; the recording is gone either way
                print(f"cuda_magic: the black box could not stop ({type(exc).__name__}: {exc})", file=sys.stderr)

    def _handler(self, shell, etype, value, tb, tb_offset=None):
        from cuda_magic.recover.failure import kind_of
        from cuda_magic.recover.report import Outcome

        if kind_of(value) is not Outcome.OOM:      # a fatal CUDA error gets its restart note here
            return self._forward(etype, value, tb, tb_offset)
        if getattr(value, "frames_freed", False):   # `%%oomguard`'s short error: explained already
            self._discard()
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
        """The core's path after an OOM, on the device that ran out (the one the cell was recorded on, or
        another the message names). The handler runs inside IPython's `except` block, but the failed cell's
        frames have finished: clearing them drops their locals even though the exception itself lives on
        (IPython still shows it)."""
        from cuda_magic.display.show import show
        from cuda_magic.oom.messages import oom_fields
        from cuda_magic.oom.findings import OomFields
        from cuda_magic.recover.failure import meter_for_failure

        meter = meter_for_failure(oom_fields(value) or OomFields())
        run, self.run = self.run, None
        if run is None or run.meter.key != meter.key:
            if run is not None:
                run.discard()       # it recorded another device than the one that ran out
            run = self._guarded(meter)
        result = run.end(value)
        self.last_report = result.report
        if self.state is not None:
            self.state.last_report = result.report
        show(result.report)
        error = result.short_error()
        del result
        self.shell.showtraceback((type(error), error, None))


def _recordable_meter():
    """The meter of the device a cell can run out of, where the black box records: the session's
    simulated device, or CUDA once started (asking never starts it); None elsewhere."""
    from cuda_magic.devices.probe import cuda_started
    from cuda_magic.devices.simulated import active_device

    if active_device() is not None or cuda_started():
        from cuda_magic.devices.meter import choose_meter

        meter, _ = choose_meter()
        if meter.key.startswith(("sim", "cuda")):
            return meter
    return None
