"""The prediction core, beside the guard's (recover/guarded.py): one prediction of a call's memory, from
the meter and the `GuardOptions` its adapter checked (recover/options.py), as a `GuardedRun` is one
guarded call. It chooses what to predict on (the meter, or this machine's memory on a CPU:
`planner.prediction_meter`), the capacity (the -l cap, or the device's), the allocator's setting
(`--expandable-segments`, on that meter's simulated device where it is one) and autocast, and runs the
`Planner`. Its adapters: `%%oomguard --predict` (magics/predict_cell.py) and `cuda_magic.predict`
(api.py), which show or return its `Prediction`.

    run = PredictedRun(meter, options, call, bind=namespace, namespace=namespace)
    said = run.prepare()          # the one thing it changes before the fake runs: the allocator setting
    prediction = run.predict()
"""
from __future__ import annotations

from cuda_magic.fakerun.planner import Planner, prediction_meter
from cuda_magic.recover.guarded import GuardOptions


class PredictedRun:
    """One prediction of `call()`. bind: the mapping the call reads its names from (the namespace, or a
    function's arguments); more: further (mapping, names) whose values are copied too (a function's
    globals that it names); namespace: what each fake run is undone in (None: `bind`)."""

    def __init__(self, meter, options: GuardOptions, call, *, bind, more=(), namespace=None):
        self.options, self.call = options, call
        self.bind, self.more, self.namespace = bind, list(more), namespace
        self.meter, self.note = prediction_meter(meter)
        self._prepared = False

    def prepare(self) -> str | None:
        """What must be done before the fake runs (with `expandable`: the allocator's setting, on the
        simulated device predicted on where it is one, never CUDA's then); what it says, or None.
        recover/options.OptionError where it cannot (nothing changed)."""
        if self._prepared:
            return None
        self._prepared = True
        if not self.options.expandable:
            return None
        from cuda_magic.recover.options import switch_expandable_segments

        return switch_expandable_segments(self.meter)

    def planner(self) -> Planner:
        """The one place a Planner is built: capacity, autocast and the device's name from the meter."""
        from cuda_magic.devices.meter import capacity_of
        from cuda_magic.fakerun.cuda_autocast import prediction_autocast

        options, meter = self.options, self.meter
        limit = options.limit
        return Planner(meter, self.call, capacity=limit if limit is not None else capacity_of(meter),
                       limited=limit is not None, bind=self.bind, more=self.more, namespace=self.namespace,
                       retry=options.retry, amp=options.amp,
                       autocast=lambda: prediction_autocast(options.amp, meter),
                       cell_filename=options.filename, lines=options.lines, api=options.api,
                       device_name=meter.device.name if meter.key.startswith("sim") else "")

    def predict(self):
        """The `Prediction` (fakerun/prediction.py), with the note of what it was predicted on first."""
        self.prepare()
        prediction = self.planner().predict()
        if self.note:
            prediction.notes.insert(0, self.note)
        return prediction
