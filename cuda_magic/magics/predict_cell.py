"""`%%oomguard --predict`: the cell's memory predicted before it runs, from fake runs (fakerun/), with the
cell's usual options: -r VAR [--min N] [-a VAR2 [--exact]] for the largest value that fits, --amp, -l and
-d for the device to plan for, -o for the prediction object. The cell is not run for real."""
from __future__ import annotations

from IPython.core.error import UsageError


def predict_cell(magics, args, cell: str):
    """Check the options, run the prediction, show it; the Prediction with -o, else None."""
    from cuda_magic.devices.meter import capacity_of
    from cuda_magic.fakerun.cuda_autocast import prediction_autocast
    from cuda_magic.display.show import show
    from cuda_magic.magics.cell import CompiledCell
    from cuda_magic.fakerun.fake_run import add_loop_ticks
    from cuda_magic.fakerun.planner import Planner, prediction_meter

    if args.no_raise or args.timeline or args.no_timeline:
        flag = "--no-raise" if args.no_raise else ("--timeline" if args.timeline else "--no-timeline")
        raise UsageError(f"{flag} is for a cell that runs; --predict runs nothing on the device (drop {flag})")
    shell = magics.shell
    ns = shell.user_ns
    retry = magics._retry_options(args, ns)
    meter, limit = magics._meter(args)
    meter, note = prediction_meter(meter)
    if args.expandable:
        magics._expandable_segments(args.quiet)
    capacity = limit if limit is not None else capacity_of(meter)
    compiled = CompiledCell(shell, cell, transform=add_loop_ticks, display_last=False)
    if compiled.is_async:
        raise UsageError("--predict cannot run a cell with top-level await; predict the function it awaits "
                         "with cuda_magic.predict(...)")
    name = meter.device.name if meter.key.startswith("sim") else ""
    planner = Planner(meter, compiled, capacity=capacity, limited=limit is not None, bind=ns, namespace=ns,
                      retry=retry, amp=args.amp, autocast=lambda: prediction_autocast(args.amp, meter),
                      cell_filename=compiled.filename, lines=tuple(compiled.lines), device_name=name)
    from IPython.utils.capture import capture_output
    from cuda_magic.display.waiting import Waiting

    # past a second, a line says the prediction runs (display/waiting.py); the prediction takes its place
    with Waiting("%%oomguard --predict: predicting the cell's memory with fake runs") as waiting, \
            capture_output(display=True):     # what the fake run prints or displays is not the cell's
        prediction = planner.predict()
    if note:
        prediction.notes.insert(0, note)
    magics.cuda_magic_state.last_prediction = prediction
    shown = not args.quiet or prediction.fits is False
    if not waiting.finish(prediction if shown else None) and shown:
        show(prediction)
    return prediction if args.output else None
