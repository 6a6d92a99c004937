"""A prediction from start to end: fake runs of the call (`fakerun/fake_run.py`) at its value now and,
with -r, at the values needed to find the largest that fits; each run undone afterwards, as a retry's
attempt is (`recover/rollback.py`: names bound or rebound, the random generators, files written), and
the lists, dicts and sets of the namespace given back their items, so that nothing the cell did stays.

The largest value: the peak of a run is close to linear in the batch (the model's state is fixed, the
activations grow with it), so two runs give a line; the value where the line meets the capacity is run,
and the bounds narrow (the line through the nearest runs on either side) until the largest value that
fits is known to within 0.5%, each next value kept within the middle half of the bounds (the one search
of `-r`, `--search` and this: recover/largest.py). A fake run costs Python time only, whatever the value.
The value given is then that one less the retry's margin (`recover/retry.MARGIN`), or a little below it
where its neighbours run out (fitting is not monotone on a caching allocator: `largest.steady`), the
accumulation scaled to keep the effective batch (`-a`, and with `--exact` a divisor of it).
"""
from __future__ import annotations

import time

from cuda_magic.memory.blackbox import blackbox_from
from cuda_magic.fakerun.fake_run import FakeRunner
from cuda_magic.fakerun.fakes import to_copy
from cuda_magic.fakerun.prediction import Prediction, Run
from cuda_magic.recover.largest import FitMap, islands, next_value, steady
from cuda_magic.recover.retry import MARGIN, divisors, scale_accumulation
from cuda_magic.recover.rollback import Checkpoint

MAX_RUNS = 14              # fake runs in all, with -r
CLOSE = 0.005              # settle once the bounds on the largest value are this close
ACCUM_RUNS = 2             # micro-batches the runs at other values take, where the accumulation grows
_ACCUM_NOTE = "the runs at other values took "
FLAT = 0.001               # peaks that differ by less than this share do not depend on VAR
_CONTAINERS = (list, dict, set, bytearray)


def prediction_meter(meter):
    """(meter, note): the meter to predict on. On the CPU (no GPU, no simulated device, no cap) a simulated
    device of this machine's available memory, counting what exists, with a note that says so."""
    if meter.key != "cpu":
        return meter, None
    from cuda_magic.devices.meter import SimMeter, available_memory
    from cuda_magic.devices.simulated import SimulatedDevice

    device = SimulatedDevice(available_memory() or (1 << 40), name="this machine's memory")
    return SimMeter(device, temporary=True), (
        "no GPU and no simulated device here: predicted against this machine's available memory (plan for a "
        "GPU with -l 16GiB, or %gpumem --simulate 16GiB)")


def target_of(meter):
    """(torch.device the meter counts, counts(tensor): whether it counts that real tensor's storage)."""
    import torch

    key = meter.key
    if key.startswith("sim"):
        device = meter.device
        return torch.device("cpu"), lambda t: t.device.type == "cpu" and device.tracks(t)
    kind, _, index = key.partition(":")
    target = torch.device(kind, int(index)) if index.isdigit() else torch.device(kind)

    def counts(t):
        return t.device.type == target.type and (target.index is None or t.device.index == target.index)

    return target, counts


class Planner:
    """Predicts `call()` on `meter` against `capacity` (the -l cap, or the device's; None: unknown).

    bind: the mapping the call reads its names from, where VAR's values and the fake copies are bound (the
    user namespace, or a function's arguments); more: further (mapping, names) whose values are copied
    and bound too (a function's globals that it names); namespace: the user namespace (or the function's
    globals) to undo; retry: a RetrySpec or None."""

    def __init__(self, meter, call, *, capacity=None, limited=False, bind, more=(), namespace=None, retry=None,
                 amp=None, autocast=None, cell_filename=None, lines=None, api=False, device_name=""):
        self.meter, self.call = meter, call
        self.capacity, self.limited = capacity, limited
        self.bind, self.more, self.namespace, self.retry = bind, list(more), namespace, retry
        self.amp, self.autocast = amp, autocast
        self.cell_filename, self.lines, self.api = cell_filename, lines, api
        self.device_name = device_name
        self.results = {}
        self.accum_notes: list[str] = []
        self.levels: dict[int, int] = {}    # value -> the peak that must fit (allocated or reserved)

    # -- one run, undone -----------------------------------------------------------------------------
    def run_at(self, value=None, accumulation=None):
        key = (value, accumulation)
        if key in self.results:
            return self.results[key]
        target, counts = target_of(self.meter)
        bind = self.bind
        undo = Checkpoint(self.namespace if self.namespace is not None else bind, states=False)
        undo.take()
        contents = _contents(self.namespace)
        saved = [(m, dict(m)) for m in [bind, *(m for m, _ in self.more)] if m is not self.namespace]
        if value is not None:
            bind[self.retry.variable] = value
            if self.retry.accumulate is not None and accumulation is not None:
                bind[self.retry.accumulate] = accumulation
        sources = [(bind, None), *self.more]
        items = [((i, n), v) for i, (m, names) in enumerate(sources) for n, v in list(m.items())
                 if not n.startswith("_") and (names is None or n in names)]
        runner = FakeRunner(self.call, device=target, key=self.meter.key, real_allocated=int(self.meter.allocated() or 0),
                            counts=counts, items=to_copy(items), binds=[m for m, _ in sources],
                            autocast=self.autocast, cell_filename=self.cell_filename, lines=self.lines,
                            capacity=self.capacity, **_allocator_of(self.meter))
        try:
            with _quiet_device(self.meter), undo.watching():
                result = runner.run(value)
        finally:
            undo.restore()
            _give_back(self.namespace, contents)
            for mapping, before in saved:
                mapping.clear()
                mapping.update(before)
        if undo.files:
            result.notes.append("the fake run wrote " + ", ".join(sorted(set(undo.files))[:3])
                                + ": files written stay written")
        self.results[key] = result
        return result

    # -- the prediction -------------------------------------------------------------------------------
    def predict(self) -> Prediction:
        t0 = time.perf_counter()
        retry = self.retry
        value = accumulation = None
        if retry is not None:
            value = self.bind[retry.variable]
            if retry.accumulate is not None:
                accumulation = self.bind[retry.accumulate]
        first = self.run_at(value, accumulation)
        pred = self._record(first, value, accumulation)
        if retry is not None and first.complete:
            self._largest(pred, value, accumulation)
            pred.notes.extend(self.accum_notes)
        pred.runs = [Run(v, r.peak, r.complete, r.seconds, a) for (v, a), r in self.results.items()]
        pred.seconds = time.perf_counter() - t0
        return pred

    def _record(self, result, value, accumulation) -> Prediction:
        stop = result.stop
        box = blackbox_from(result.recorder, device=self.meter.key, capacity=self.capacity, limited=self.limited,
                            lines=list(self.lines) if self.lines is not None else None, failed=False)
        retry = self.retry
        return Prediction(
            device=self.meter.key, device_name=self.device_name, capacity=self.capacity, limited=self.limited,
            start=result.start, peak=result.peak, by_kind=result.by_kind, blackbox=box,
            complete=result.complete, stop_line=stop.line if stop else None, stop_code=stop.code if stop else "",
            stop_where=stop.where if stop else "", stop_reason=stop.reason if stop else "",
            endless=bool(stop and stop.endless),
            enough=result.enough, stand_ins=result.stand_ins,
            variable=retry.variable if retry else None, accumulate=retry.accumulate if retry else None,
            value=value, accumulation=accumulation, amp=self.amp, allocator=_allocator_words(self.meter),
            notes=list(result.notes), api=self.api, reserved=result.reserved, runs_out=result.runs_out)

    def _peak(self, value: int) -> tuple[int, bool, bool]:
        """(peak allocated, complete, fits) of a fake run at `value`: the line through the peaks guides the
        search (what is reserved grows in whole segments), the allocator says whether it fits."""
        retry = self.retry
        acc = None
        if retry.accumulate is not None:
            v0, a0 = self.bind[retry.variable], self.bind[retry.accumulate]
            acc = scale_accumulation(v0, a0, value)
            if acc > ACCUM_RUNS:
                # an accumulation loop's peak repeats from its second micro-batch on (the gradients
                # exist then), and a fake micro-batch costs Python time: at batch 1 the loop would be
                # the whole effective batch long
                acc = max(ACCUM_RUNS, min(acc, a0))
                if not any(n.startswith(_ACCUM_NOTE) for n in self.accum_notes):
                    self.accum_notes.append(f"{_ACCUM_NOTE}{retry.accumulate} = {acc} at most (an accumulation "
                                            "loop's peak repeats from its second micro-batch on)")
        result = self.run_at(value, acc)
        self.levels[value] = max(result.peak, result.reserved)    # what must fit: the reserved peak
        return result.peak, result.complete, result.fits(self.capacity)

    def _largest(self, pred: Prediction, v0: int, a0: int | None) -> None:
        """The largest value that fits (pred.largest), found from fake runs; None where even --min does
        not fit or no capacity is known."""
        cap, floor = self.capacity, self.retry.floor
        if cap is None:
            pred.notes.append("no capacity to fit in: give -l (a size) or `%gpumem --simulate SIZE` to plan "
                              "for a device")
            return
        fit: dict[int, int] = {}
        fail: dict[int, int] = {}
        (fit if pred.fits else fail)[v0] = pred.peak
        self.levels.setdefault(v0, max(pred.peak, pred.reserved or 0))
        other = v0 * 2 if v0 in fit else max(floor, v0 // 2)
        if other == v0:
            other = v0 + 1
        peak, complete, fits = self._peak(other)
        if not complete:
            pred.notes.append(f"the fake run at {self.retry.variable} = {other} stopped early: no largest value")
            return
        (fit if fits else fail)[other] = peak
        if abs(peak - pred.peak) <= FLAT * max(peak, pred.peak, 1):
            pred.independent = True
            return
        for _ in range(MAX_RUNS - 2):
            lo = max(fit) if fit else None
            hi = min((v for v in fail if lo is None or v > lo), default=None)
            if lo is not None and hi is not None and hi - lo <= max(1, int(lo * CLOSE)):
                break
            if lo is None and min(fail) <= floor:
                break                       # even the floor does not fit
            # the line goes through what the allocator reserved (on a caching device, segments more than
            # the tensors' bytes), so that it meets the capacity where the device runs out
            guess = next_value({v: self.levels[v] for v in fit}, {v: self.levels[v] for v in fail},
                           cap, lo, hi, floor)
            if guess is None or guess in fit or guess in fail:     # flat in segments: the tensors' line
                guess = next_value(fit, fail, cap, lo, hi, floor)
            if (guess is None or guess in fit or guess in fail) and lo is None:
                guess = max(floor, min(fail) // 2)      # nothing fits yet: halve
            if guess is None or guess in fit or guess in fail:
                break
            peak, complete, fits = self._peak(guess)
            if not complete:
                break
            (fit if fits else fail)[guess] = peak
        if not fit:
            return
        best = max(fit)
        hi = min((v for v in fail if v > best), default=None)
        if hi is None:
            pred.notes.append(f"every value tried fits, up to {self.retry.variable} = {best}")
        chosen = max(floor, int(best * (1 - MARGIN)))
        acc = None
        if self.retry.accumulate is not None:
            effective = v0 * a0
            if self.retry.exact:
                allowed = [d for d in divisors(effective) if floor <= d <= chosen]
                if not allowed:
                    return
                chosen = allowed[-1]
            acc = scale_accumulation(v0, a0, chosen)
        if acc is None:
            # fitting is not monotone on a caching allocator: the largest at or below the margin whose
            # neighbours fit too (recover/largest.steady), from a few more fake runs
            seen = FitMap({**{v: True for v in fit}, **{v: False for v in fail}})

            def fake_fits(v: int) -> bool | None:
                if v < floor:
                    return False
                p, complete, ok = self._peak(v)
                if not complete:
                    return None
                (fit if ok else fail)[v] = p
                return ok

            chosen = steady(chosen, fake_fits, MARGIN, seen, floor=floor, budget=4)
            words = islands(chosen, seen)
            if words:
                pred.notes.append(f"{self.retry.variable}: {words}")
        pred.largest, pred.largest_accumulation = chosen, acc
        peak, _, fits = self._peak(chosen) if chosen not in fit else (fit[chosen], True, True)
        if not fits:                    # (the allocator's rounding is not monotonic): the value that fitted
            chosen = max(v for v in fit if v <= chosen) if any(v <= chosen for v in fit) else None
            if chosen is None:
                pred.largest = pred.largest_accumulation = None
                return
            pred.largest = chosen
            pred.largest_accumulation = scale_accumulation(v0, a0, chosen) if acc is not None else None
            peak = fit[chosen]
        pred.largest_peak = peak


def _allocator_of(meter) -> dict:
    """How the metered device reserves: the simulated device's own allocator and settings; torch's caching
    allocator with the process's settings on CUDA; tensors' bytes elsewhere."""
    if meter.key.startswith("sim"):
        device = meter.device
        model = getattr(device, "model", None)
        return {"allocator": "caching" if model is not None else "plain",
                "conf": model.settings() if model is not None else None, "template": device}
    if meter.key.startswith("cuda"):
        from cuda_magic.devices.allocator_conf import current_allocator_conf

        return {"allocator": "caching", "conf": current_allocator_conf()}
    return {"allocator": "plain", "conf": None}


def _allocator_words(meter) -> str:
    caching = _allocator_of(meter)["allocator"] == "caching"
    if meter.key.startswith("cuda"):
        return ("what torch's caching allocator reserves (its block rounding, segments and cache, modelled), "
                "starting from what the device holds now packed together; the CUDA context and cuBLAS/cuDNN "
                "workspaces are not predicted")
    if caching:
        return "what the simulated device reserves, as torch's caching allocator does"
    return "tensors' bytes, as the simulated device counts them"


def _contents(namespace) -> dict:
    """The items of the namespace's lists, dicts, sets and bytearrays (one level): a fake run's appends
    are taken out again."""
    if namespace is None:
        return {}
    out = {}
    for name, value in list(namespace.items()):
        if type(value) in _CONTAINERS and not name.startswith("_") and name not in ("In", "Out"):
            out[name] = (value, value.copy() if not isinstance(value, bytearray) else bytearray(value))
    return out


def _give_back(namespace, contents) -> None:
    for name, (container, items) in contents.items():
        if container == items:
            continue
        if isinstance(container, dict):
            container.clear()
            container.update(items)
        elif isinstance(container, set):
            container.clear()
            container.update(items)
        else:
            container[:] = items


class _quiet_device:
    """While a fake run goes: the session's simulated device stops counting (the fake run's meta work
    beneath torch's fake mode must not count on it or run out there), and starts again after."""

    def __init__(self, meter):
        self.device = getattr(meter, "device", None) if meter.key.startswith("sim") else None
        self.was_active = False

    def __enter__(self):
        if self.device is not None and self.device.active:
            self.was_active = True
            self.device.stop()
        return self

    def __exit__(self, *exc):
        if self.was_active:
            self.device.start()
        return False
