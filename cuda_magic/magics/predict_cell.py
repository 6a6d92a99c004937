"""`%%oomguard --predict`: the cell's memory predicted before it runs, from fake runs (fakerun/), with the
cell's usual options: -r VAR [--min N] [-a VAR2 [--exact]] for the largest value that fits, --amp, -l and
-d for the device to plan for, -o for the prediction object. The cell is not run for real.

An adapter over the prediction core (fakerun/predicting.py): the options are checked first
(recover/options.py, each problem a one-line UsageError), then the core predicts and this shows."""
from __future__ import annotations

import dataclasses

from IPython.core.error import UsageError

from cuda_magic.magics.args import checked
from cuda_magic.recover.options import OptionError

NO_AWAIT = ("--predict cannot run a cell with top-level await; predict the function it awaits with "
            "cuda_magic.predict(...)")


def predict_cell(shell, state, asked, cell: str, *, quiet: bool = False, output: bool = False):
    """Check the options (`asked`: recover/options.AskedOptions), run the prediction, show it; the
    Prediction with -o, else None. Nothing is changed before every check has passed."""
    from cuda_magic.display.show import show
    from cuda_magic.fakerun.fake_run import add_loop_ticks
    from cuda_magic.fakerun.predicting import PredictedRun
    from cuda_magic.magics.cell import CompiledCell

    ns = shell.user_ns
    meter, options = checked(asked, ns)
    compiled = CompiledCell(shell, cell, transform=add_loop_ticks, display_last=False)
    if compiled.is_async:
        raise UsageError(NO_AWAIT)
    options = dataclasses.replace(options, filename=compiled.filename, lines=tuple(compiled.lines))
    run = PredictedRun(meter, options, compiled, bind=ns, namespace=ns)
    try:
        said = run.prepare()
    except OptionError as exc:
        raise UsageError(str(exc)) from None
    if said and not quiet:
        print(said)
    from IPython.utils.capture import capture_output
    from cuda_magic.display.waiting import Waiting

    # past a second, a line says the prediction runs (display/waiting.py); the prediction takes its place
    with Waiting("%%oomguard --predict: predicting the cell's memory with fake runs") as waiting, \
            capture_output(display=True):     # what the fake run prints or displays is not the cell's
        prediction = run.predict()
    state.last_prediction = prediction
    shown = not quiet or prediction.fits is False
    if not waiting.finish(prediction if shown else None) and shown:
        show(prediction)
    return prediction if output else None
