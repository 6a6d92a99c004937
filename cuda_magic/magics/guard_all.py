"""`%oomguard on`: clean up and explain an out-of-memory error in any cell, through IPython's custom
exception handling. `stop()` puts back whatever handling was there before."""
from __future__ import annotations

import sys


class GuardAll:
    def __init__(self, shell):
        self.shell = shell
        self.active = False
        self._saved = None

    def start(self) -> None:
        if self.active:
            return
        shell = self.shell
        self._saved = (shell.custom_exceptions, shell.CustomTB)
        # set_custom_exc matches classes only: message-based OOMs are RuntimeErrors; the rest is forwarded.
        # The classes a handler registered before us keep reaching it (through _forward) while we are on.
        earlier = tuple(shell.custom_exceptions or ())
        shell.set_custom_exc((RuntimeError, MemoryError) + earlier, self._handler)
        self.active = True

    def stop(self) -> None:
        if not self.active:
            return
        self.shell.custom_exceptions, self.shell.CustomTB = self._saved
        self._saved = None
        self.active = False

    def _handler(self, shell, etype, value, tb, tb_offset=None):
        from cuda_magic.recover.failure import kind_of
        from cuda_magic.recover.report import Outcome

        if kind_of(value) is not Outcome.OOM:      # a fatal CUDA error gets its restart note here
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
        failure = read_failure(value, meter, filename=_cell_filename(shell, value.__traceback__))
        report.oom, report.failure = failure.oom, failure.point
        report.by_kind = failure.by_kind
        attempt = Attempt(None, Outcome.OOM, _peak(meter), failure.oom.requested, start_allocated=None)
        report.attempts.append(attempt)
        attempt.reclaimed = release_failure(value, failure, meter, user_ns=shell.user_ns, sever=False,
                                            shell=shell)
        if attempt.reclaimed is not None:
            report.reclaimed[meter.key] = attempt.reclaimed
        conclude(report, meter, shell=shell)
        show(report)
        error = short_oom_error(report)
        shell.showtraceback((type(error), error, None))


def _peak(meter) -> int | None:
    try:
        return meter.peak()
    except (AssertionError, RuntimeError, OSError):
        return None


def _cell_filename(shell, tb) -> str | None:
    """The filename IPython compiled the failing cell under: the first frame that is a cell."""
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if name.startswith("<ipython-input-") or "/ipykernel_" in name:
            return name
        tb = tb.tb_next
    return None
