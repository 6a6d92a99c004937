"""`%oomguard on`: clean up and explain an out-of-memory error in any cell, through IPython's custom
exception handling. `stop()` puts back whatever handling was there before."""
from __future__ import annotations

import gc
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
        from cuda_magic.oom.classify import oom_kind

        kind = oom_kind(value)
        if kind not in ("oom", "possible"):
            if kind == "fatal" and hasattr(value, "add_note"):
                from cuda_magic.recover.engine import FATAL_NOTE

                value.add_note(FATAL_NOTE)
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
        from cuda_magic.devices.allocator_conf import current_allocator_conf
        from cuda_magic.devices.backends import read_devices
        from cuda_magic.oom.diagnosis import diagnose
        from cuda_magic.recover.engine import failure_point, short_oom_error
        from cuda_magic.oom.classify import oom_fields
        from cuda_magic.recover.notebook_refs import drop_exception, drop_exception_refs
        from cuda_magic.recover.cleanup import empty_caches, shared_holders
        from cuda_magic.recover.report import Attempt, GuardReport
        from cuda_magic.oom.records import OomFields

        shell = self.shell
        before = read_devices().devices
        key = before[0].key if before else "cpu"
        report = GuardReport(device=key, before=before[:1], source="%oomguard on")
        report.oom = oom_fields(value) or OomFields()
        report.failure = failure_point(value.__traceback__, _cell_filename(shell, value.__traceback__), None)
        allocated = before[0].torch_allocated if before else None
        report.attempts.append(Attempt(value=None, outcome="oom", requested=report.oom.requested,
                                       start_allocated=None))
        # The handler runs inside IPython's `except` block, but the failed cell's frames have finished:
        # clearing them drops their locals even though the exception object itself lives on.
        drop_exception(value, user_ns=shell.user_ns, sever=False)
        drop_exception_refs(shell)
        gc.collect()
        empty_caches()
        after = read_devices().devices
        report.after = after[:1]
        if before and after and allocated is not None and after[0].torch_allocated is not None:
            reserved_before = allocated + (before[0].torch_cached or 0)
            reserved_after = after[0].torch_allocated + (after[0].torch_cached or 0)
            report.reclaimed[key] = max(0, reserved_before - reserved_after)
        report.diagnosis = diagnose(report.oom, holders=shared_holders(shell),
                                    device_capacity=before[0].capacity if before else None,
                                    alloc_conf=current_allocator_conf())
        report.outcome = "oom"
        from cuda_magic.display.show import show_guard

        show_guard(report).finish(report)
        error = short_oom_error(report)
        shell.showtraceback((type(error), error, None))


def _cell_filename(shell, tb) -> str | None:
    """The filename IPython compiled the failing cell under: the first frame that is a cell."""
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if name.startswith("<ipython-input-") or "/ipykernel_" in name:
            return name
        tb = tb.tb_next
    return None
