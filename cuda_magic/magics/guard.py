"""`%%oomguard` (run a cell that may run out of memory) and `%oomguard on|off` (guard every cell).

An adapter over the core (recover/guarded.py): every option is checked (recover/options.py, each problem
a one-line UsageError) before anything changes, then one GuardedRun runs the cell and its result says what
to show and raise. `--predict` goes to the prediction core's adapter (magics/predict_cell.py)."""
from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import argument, magic_arguments

from cuda_magic.magics.args import asked_options, checked, expanded, parse_args
from cuda_magic.recover.options import OptionError, switch_expandable_segments
from cuda_magic.units import is_unit


@magics_class
class GuardMagics(Magics):
    @no_var_expand      # IPython's expansion copies the namespace for every cell: `expanded` only where needed
    @magic_arguments()
    @argument("-r", dest="retry", default=None, metavar="VAR", help="on OOM, undo the attempt and run the cell again with the integer VAR at a value predicted to fit")
    @argument("--min", dest="floor", default=None, metavar="N", help="with -r: never go below N (default 1)")
    @argument("--search", action="store_true", help="with -r: find the largest value that fits (probes, each undone), then run the cell once at it")
    @argument("-a", dest="accumulate", default=None, metavar="VAR2", help="with -r: scale VAR2 so that VAR x VAR2 (the effective batch) stays at least what it was")
    @argument("--exact", action="store_true", help="with -a: VAR only takes divisors of the effective batch, so that VAR x VAR2 equals it exactly")
    @argument("--predict", action="store_true", help="do not run the cell: predict its peak (and with -r the largest VAR that fits) from a run on fake tensors, touching nothing")
    @argument("--amp", choices=("bf16", "fp16"), default=None, help="run the cell under torch.autocast")
    @argument("-l", dest="limit", default=None, metavar="LIMIT", help="cap memory: 4GiB, 512MB, 64MiB, or a fraction of the capacity (0.25)")
    @argument("-d", dest="device", default=None, metavar="DEVICE", help="the device to measure and cap (0, cuda:1)")
    @argument("--expandable-segments", dest="expandable", action="store_true", help="switch the CUDA allocator's expandable_segments on first (against fragmentation), keeping its other options")
    @argument("--no-live", dest="no_live", action="store_true", help="no live gauge of the device while the cell runs (notebooks show one after about a second)")
    @argument("--timeline", dest="timeline", action="store_true", help="show the black box (memory over the run, alive at the peak by line) for a run that fits too")
    @argument("--no-timeline", dest="no_timeline", action="store_true", help="record nothing: no black box")
    @argument("--no-raise", dest="no_raise", action="store_true", help="after an OOM, return instead of raising")
    @argument("-q", dest="quiet", action="store_true", help="show only the OOM report, nothing for a cell that ran")
    @argument("-o", dest="output", action="store_true", help="return the report object")
    @argument("switch", nargs="?", default=None, help="line magic only: on, off, or nothing to say which is active")
    @line_cell_magic
    def oomguard(self, line="", cell=None):
        """Run a cell that may run out of memory: clean up and explain an OOM, optionally retry smaller.

        As a line magic: `%oomguard on` guards every cell, `%oomguard off` stops that."""
        __tracebackhide__ = True  # noqa: F841
        line = expanded(self.shell, line)
        if cell is None:
            return self._switch(line)
        args = self._parse(line)
        if args.predict:
            from cuda_magic.magics.predict_cell import predict_cell

            return predict_cell(self.shell, self.cuda_magic_state, asked_options(args), cell, quiet=args.quiet,
                                output=args.output)
        return self._guard_cell(args, cell)

    # %oomguard on|off ------------------------------------------------------------------------------
    def _switch(self, line: str):
        from cuda_magic.magics.guard_all import GuardAll

        word = line.strip().lower()
        state = self.cuda_magic_state
        active = state.guard_all is not None and state.guard_all.active
        if word == "":
            print("%oomguard is on: an out-of-memory error in any cell is cleaned up and explained."
                  if active else "%oomguard is off (`%oomguard on` guards every cell).")
            return None
        if word == "last":
            return self._last()
        if word not in ("on", "off"):
            raise UsageError(f"%oomguard takes on, off or last, not {line.strip()!r} (use %%oomguard for one cell)")
        if word == "on":
            if not active:
                state.guard_all = GuardAll(self.shell, state)
                state.guard_all.start()
            print("%oomguard on: an out-of-memory error in any cell is now cleaned up and explained.")
        else:
            if active:
                state.guard_all.stop()
            state.guard_all = None
            print("%oomguard off: IPython's usual error handling is back." if active else "%oomguard was not on.")
        return None

    def _last(self):
        """`%oomguard last`: the last guarded cell's report in full (its folded part open)."""
        from cuda_magic.display.show import show_full

        report = self.cuda_magic_state.last_report
        if report is None:
            print("No guarded cell has run yet in this session: %oomguard last shows the last report in full.")
            return None
        show_full(report)
        return None

    # %%oomguard ----------------------------------------------------------------------------------
    def _guard_cell(self, args, cell: str):
        __tracebackhide__ = True  # noqa: F841
        cell_run = self._prepare(args, cell, awaited=False)
        try:
            result = cell_run.run.run(cell_run.compiled)
        finally:
            self.cuda_magic_state.last_report = cell_run.run.report
            cell_run.shown()
        return cell_run.outcome(result)

    async def guard_cell_async(self, line: str, cell: str):
        """`%%oomguard` on a cell with top-level `await`, awaited by IPython's own async execution
        (magics/awaiting.py routes such cells here)."""
        __tracebackhide__ = True  # noqa: F841
        args = self._parse(line)
        if args.predict:
            from cuda_magic.magics.predict_cell import NO_AWAIT

            raise UsageError(NO_AWAIT)
        cell_run = self._prepare(args, cell, awaited=True)
        try:
            result = await cell_run.run.run_async(cell_run.compiled)
        finally:
            self.cuda_magic_state.last_report = cell_run.run.report
            cell_run.shown()
        return cell_run.outcome(result)

    def _parse(self, line: str):
        args = parse_args(self.oomguard, line)
        if args.switch is not None:
            hint = " (write a size without a space: -l 5GiB)" if is_unit(args.switch) else ""
            raise UsageError(f"%%oomguard takes options only, not {args.switch!r}{hint}; `%oomguard on|off` "
                             "is the line magic")
        return args

    def _prepare(self, args, cell: str, *, awaited: bool) -> GuardedCell:
        """Check every option (recover/options.py) and the cell (top-level `await` needs IPython's
        autoawait: `awaited`), then act: the allocator setting, the run (the core), its display and gauge."""
        import dataclasses

        from cuda_magic.display.show import show_guard
        from cuda_magic.magics.cell import CompiledCell
        from cuda_magic.recover.guarded import GuardedRun

        ns = self.shell.user_ns
        meter, options = checked(asked_options(args), ns)
        compiled = CompiledCell(self.shell, cell)   # a SyntaxError propagates: IPython shows it
        if compiled.is_async and not awaited:
            raise UsageError("top-level await in a guarded cell needs IPython's autoawait (%autoawait on)")
        options = dataclasses.replace(options, filename=compiled.filename, lines=tuple(compiled.lines),
                                      timed_lines=compiled.timed_lines)
        # every check has passed: from here on, things change
        if options.expandable:
            try:
                said = switch_expandable_segments(meter)
            except OptionError as exc:
                raise UsageError(str(exc)) from None
            if not args.quiet:
                print(said)
        run = GuardedRun(meter, options, values=ns, namespace=ns, shell=self.shell,
                         on_note=None if args.quiet else _print_note)
        run.start()                        # the device before, shown by the running view
        handle = show_guard(run.report, quiet=args.quiet)
        run.on_attempt = handle.add_attempt
        run.on_trying = handle.try_value
        if not args.no_live:
            from cuda_magic.display.gauge import start_guard_gauge

            start_guard_gauge(handle, meter)   # nothing where no gauge can be seen (terminal IPython)
        return GuardedCell(args, compiled, run, handle)


class GuardedCell:
    """One `%%oomguard` cell being run: its compiled body, its run (the core) and its display."""

    def __init__(self, args, compiled, run, handle):
        self.args, self.compiled, self.run, self.handle = args, compiled, run, handle

    def shown(self) -> None:
        """The final display, in place of the running view (also after Ctrl-C): the gauge is joined first."""
        from cuda_magic.display.show import show_guard

        self.compiled = None
        self.handle.stop_gauge()
        report = self.run.report
        if not self.args.quiet:
            self.handle.show_report(report)
        elif report.outcome == "oom":
            show_guard(report).show_report(report)

    def outcome(self, result):
        """Raise what the cell raised, or the short OOM error; else the report (`-o`) or None."""
        __tracebackhide__ = True  # noqa: F841
        self.run = self.handle = None
        if result.error is not None:
            error, result = result.error, None
            raise error
        if result.ran_out and not self.args.no_raise:
            error, result = result.short_error(), None
            raise error
        return result.report if self.args.output else None


def _print_note(text: str) -> None:
    print(f"[oomguard] note: {text}", flush=True)
