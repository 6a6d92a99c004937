"""`%gpumem`: where GPU memory is. A thin layer over snapshot, watch and the simulated device."""
from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from cuda_magic.magics.args import parse_args, parse_count, parse_device, parse_size_arg

# %gpumem is a snapshot by default, or one of these commands. Each takes only the flags listed for it:
# any other flag would be silently ignored, so giving it is a UsageError, raised before anything changes.
SNAPSHOT = "the snapshot"
COMMANDS = ("--watch", "--unwatch", "--history", "--live", "--snapshot")
TAKES = {
    SNAPSHOT: {"-n", "-d", "--processes", "--diff", "-o", "-q", "--simulate"},
    "--watch": {"-q", "--simulate"},
    "--unwatch": {"-q", "--simulate"},
    "--history": {"-o", "-q", "--simulate"},
    "--live": {"-d", "-q", "--simulate"},
    "--snapshot": {"-d", "-n", "-o", "-q", "--capacity", "--conf"},
}
WHAT = {
    "--watch": "--watch only switches the per-cell line on",
    "--unwatch": "--unwatch only switches the per-cell line off",
    "--history": "--history shows the --watch records of every device (-o: as a DataFrame)",
    "--live": "--live only switches the gauge on or off (-d: of that device)",
    "--snapshot": "--snapshot reads a file (-d N: its device N, -n N: rows, --capacity/--conf: a replay)",
}
# within the snapshot: --diff shows what changed, not the largest tensors nor the processes
APART = {("--diff", "-n"): "--diff lists the tensors that appeared and went, not the N largest",
         ("--diff", "--processes"): "--diff compares memory, not the process lists"}


def given_flags(args) -> list[str]:
    """The flags given on the line, in the order of the usage line."""
    given = {"-n": args.top is not None, "-d": args.device is not None, "--processes": args.processes,
             "--diff": args.diff, "--watch": args.watch, "--unwatch": args.unwatch,
             "--history": args.history, "--live": args.live is not None,
             "--simulate": args.simulate is not None, "--snapshot": args.snapshot is not None,
             "--capacity": args.capacity is not None, "--conf": args.conf is not None, "-o": args.output,
             "-q": args.quiet}
    return [flag for flag, on in given.items() if on]


def command_of(args) -> str:
    """Which of %gpumem's commands the line asks for; a UsageError for flags that cannot go together."""
    flags = given_flags(args)
    commands = [f for f in flags if f in COMMANDS]
    if len(commands) > 1:
        raise UsageError(f"{commands[0]} and {commands[1]} cannot go together: give one")
    command = commands[0] if commands else SNAPSHOT
    for flag in ("--capacity", "--conf"):
        if flag in flags and command != "--snapshot":
            raise UsageError(f"{flag} replays a recording: give it with --snapshot FILE")
    for flag in flags:
        if flag not in TAKES[command] and flag != command:
            raise UsageError(f"{command} and {flag} cannot go together: {WHAT[command]}")
    for (a, b), why in APART.items():
        if a in flags and b in flags:
            raise UsageError(f"{a} and {b} cannot go together: {why}")
    return command


@magics_class
class GpumemMagics(Magics):
    @magic_arguments()
    @argument("-n", dest="top", default=None, metavar="N", help="how many of the largest tensors to list (default 10)")
    @argument("-d", "--device", default=None, metavar="DEVICE", help="only this device: 0, 1, cuda:1, sim, cpu")
    @argument("--processes", action="store_true", help="the processes using each GPU (pid, user, name, memory)")
    @argument("--diff", action="store_true", help="what changed since the previous %%gpumem")
    @argument("--watch", action="store_true", help="after every cell, one line: its change in allocated memory, exact peak, duration")
    @argument("--unwatch", action="store_true", help="stop --watch")
    @argument("--history", action="store_true", help="the per-cell records of --watch as a table and a chart of allocated-after and peak per cell")
    @argument("--live", nargs="?", const="on", default=None, metavar="on|off", help="a gauge of the device in its own output, updating across cells until --live off (notebooks only)")
    @argument("--simulate", default=None, metavar="SIZE|off", help="a simulated device of that capacity for the rest of the session, or off")
    @argument("--snapshot", default=None, metavar="FILE", help="read a memory snapshot torch.cuda.memory._dump_snapshot() wrote (gzip'd or not): the peak and its line, what held memory, what would fit")
    @argument("--capacity", default=None, metavar="SIZE", help="with --snapshot: replay the recording on a device of this size (48GiB)")
    @argument("--conf", default=None, metavar="SETTINGS", help="with --snapshot: replay it with these allocator settings laid over the recorded ones (expandable_segments:True)")
    @argument("-o", dest="output", action="store_true", help="return the snapshot object")
    @argument("-q", dest="quiet", action="store_true", help="display nothing")
    @line_magic
    def gpumem(self, line=""):
        """Show where GPU memory is: each device's capacity split into parts, then the largest tensors."""
        args = parse_args(self.gpumem, line)
        command = command_of(args)
        if args.live is not None and args.live.strip().lower() not in ("on", "off"):
            raise UsageError(f"--live takes on or off (or nothing: on), not {args.live!r}")
        top = parse_count(args.top) if args.top is not None else 10
        if command == "--snapshot":       # checked before anything acts (--simulate too)
            self._snapshot_args(args)
        simulate = None
        if args.simulate is not None:
            if args.simulate.strip().lower() != "off":
                simulate = parse_size_arg(args.simulate, "--simulate", allow_fraction=False)
        state = self.cuda_magic_state
        from cuda_magic.display.show import show

        if args.simulate is not None:
            self._simulate(state, simulate, args.quiet)
        if command == "--live":
            return self._live(state, args.live.strip().lower() == "on", args.device, args.quiet)
        if command in ("--watch", "--unwatch"):
            return self._watch(state, command == "--watch", args.quiet)
        if command == "--history":
            return self._history(state, args)
        if command == "--snapshot":
            return self._read_snapshot(args)

        from cuda_magic.memory.snapshot import diff
        from cuda_magic.memory.capture import snapshot

        snap = snapshot(self.shell, top=top)
        if args.device is not None:
            key = parse_device(args.device, [d.key for d in snap.device_list])
            snap.device_list = [d for d in snap.device_list if d.key == key]
            snap.processes = [p for p in snap.processes if p.device == key]
            snap.tensor_list = [t for t in snap.tensor_list if _on(t.device, key)]
        previous, state.last_snapshot = state.last_snapshot, snap
        if args.diff:
            if previous is None:
                snap.notes.insert(0, "--diff: no earlier %gpumem to compare with; this one is the baseline")
            else:
                change = diff(previous, snap)
                if not args.quiet:
                    show(change)
                return change if args.output else None
        if not args.quiet:
            from dataclasses import replace

            # the process list is what --processes asks for: without it, the snapshot is shown without it
            show(snap if args.processes else replace(snap, processes=[]))
            if args.processes and not snap.processes:
                print("No GPU processes listed" + ("." if any(d.kind == "cuda" for d in snap.device_list)
                                                   else ": no NVML GPU here."))
        return snap if args.output else None

    def _live(self, state, on: bool, device, quiet: bool):
        was_on = state.live is not None
        state.stop_live()
        if not on:
            if not quiet:
                print("Live gauge off." if was_on else "No live gauge was on.")
            return None
        from cuda_magic.devices.gauge_reader import GaugeReader
        from cuda_magic.devices.meter import choose_meter
        from cuda_magic.display.gauge import LiveGauge, gauge_possible, own_view

        if not gauge_possible():
            print("No live gauge here: it needs a notebook (a Jupyter kernel); terminal IPython shows none.")
            return None
        if device is not None:
            device = parse_device(device)
        meter, _ = choose_meter(device)
        state.live = LiveGauge(GaugeReader(meter), own_view(), delay=0.0, across_cells=True).start()
        return None

    def _simulate(self, state, capacity, quiet: bool) -> None:
        from cuda_magic.units import format_bytes

        if capacity is None:
            was_on = state.stop_simulated()
            if not quiet:
                print("Simulated device off." if was_on else "No simulated device was on.")
            return
        state.start_simulated(capacity)
        if not quiet:
            print(f"Simulated device on: a {format_bytes(capacity)} GPU. Tensors created from now on in "
                  "this thread count against it; `%gpumem --simulate off` ends it.")

    def _watch(self, state, on: bool, quiet: bool):
        from cuda_magic.display.show import show_watch
        from cuda_magic.memory.watch import CellWatcher

        if on:
            if state.watcher is None:
                state.watcher = CellWatcher(self.shell, on_record=show_watch)
            state.watcher.start()
            if not quiet:
                print("Watching: after every cell, its change in allocated memory, exact peak and duration. "
                      "`%gpumem --unwatch` stops.")
        else:
            was_on = state.watcher is not None and state.watcher.active
            if state.watcher is not None:
                state.watcher.stop()
            if not quiet:
                print("Stopped watching." if was_on else "--watch was not on.")
        return None

    def _history(self, state, args):
        import pandas as pd

        from cuda_magic.memory.snapshot import CELL_COLUMNS

        frame = pd.DataFrame([r.as_row() for r in state.history]) if state.history else \
            pd.DataFrame(columns=list(CELL_COLUMNS))
        if args.output:
            return frame
        if not args.quiet:
            from cuda_magic.display.show import show

            if state.history:
                show(list(state.history))
            else:
                print("No cells recorded yet: `%gpumem --watch` records every cell from then on.")
        return None


    def _snapshot_args(self, args) -> None:
        """--snapshot's arguments, checked: the file, -d N, --capacity, --conf (a UsageError each)."""
        import os

        path = os.path.expanduser(args.snapshot.strip().strip("'\""))
        if not os.path.isfile(path):
            raise UsageError(f"--snapshot: no file {path!r}: give the path of what "
                             "torch.cuda.memory._dump_snapshot() wrote")
        args.snapshot = path
        if args.device is not None:
            args.device = parse_count(args.device, "-d")
        args.capacity = (parse_size_arg(args.capacity, "--capacity", allow_fraction=False)
                         if args.capacity is not None else None)
        if args.conf is not None:
            from cuda_magic.devices.snapshot_replay import check_conf

            try:
                args.conf = check_conf(args.conf.strip().strip("'\""))
            except ValueError as exc:
                raise UsageError(f"--conf: {exc}") from None

    def _read_snapshot(self, args):
        from cuda_magic.oom.snapshot_reading import SnapshotError, read_snapshot

        try:
            reading = read_snapshot(args.snapshot, device=args.device)
        except SnapshotError as exc:
            raise UsageError(f"--snapshot {args.snapshot}: {exc}") from None
        except OSError as exc:
            raise UsageError(f"--snapshot: cannot read {args.snapshot!r} ({exc.strerror or exc})") from None
        if args.top is not None:
            reading.rows = parse_count(args.top)
        if args.capacity is not None or args.conf:
            if not reading.has_trace:
                reading.notes.append("--capacity/--conf: the replay needs a recording with history; this one "
                                     "has the state only")
            else:
                reading.what_ifs.append(reading.replay(args.capacity, args.conf))
        if not args.quiet:
            from cuda_magic.display.show import show

            show(reading)
        return reading if args.output else None


def _on(tensor_device: str, key: str) -> bool:
    if key.startswith("sim:"):
        return tensor_device == "cpu"
    if key in ("cpu", "mps"):
        return tensor_device.split(":")[0] == key
    kind, _, index = key.partition(":")
    return tensor_device == key or (tensor_device == kind and index == "0")
