"""Measuring the model after a failure inside its forward pass, for `-r`'s prediction (recover/retry.py).

One failure says what the cell held when it failed, not how much more its model would have taken. When
the failure came inside a model call whose batch (the first dimension of its input) is the value retried,
the model is run again, after the failure's memory is given back, on two small slices of that same batch
(a thirty-second and a sixteenth of its rows), forward and backward as in training (the loss a log-softmax
of its outputs, as a classification or language-model loss takes, or its own scalar loss where it returns
one), and the device's exact peak is read for each: two points of a line that gives the model's memory per
row and the part that does not grow with the batch (the parameter gradients). A hook on the failing
module reads what the model had allocated when it got there, so that the rest of what the failure held
(the batch itself, labels, what earlier steps left) is known too. The optimizers that hold the model's
parameters (found in the failing frames' namespaces) say what state their first step will allocate.

These runs are not runs of the cell and change nothing that stays: the parameters' gradients are put
aside and back, and the guard restores the model's state (BatchNorm's statistics) and the random
generators from its checkpoint afterwards (recover/rollback.py); it replays only a model that checkpoint
holds. Not replayed: a model compiled with `torch.compile` or wrapped for several devices or processes.
"""
from __future__ import annotations

import contextlib

import gc
import time
from dataclasses import dataclass, field

from cuda_magic.devices.probe import loaded_torch
from cuda_magic.devices.errors import oom_kind
from cuda_magic.recover.probe_timeline import reserves_segments, timeline_of
from cuda_magic.recover.progress import cache_bytes_per_token, generation_growth, ModelCost, Progress, flat_items, module_calls, progress_of

SLICE = 32         # the smaller slice is this fraction of the failing batch's rows; the larger twice it
MIN_ROWS = 2       # BatchNorm in training needs more than one value per channel
#: optimizer state per parameter byte, by optimizer class (the buffers its first step allocates); a
#: momentum adds one more; an optimizer not named here is taken to keep two
STATE_PER_PARAMETER = {"SGD": 0, "LBFGS": 0, "Adagrad": 1, "RMSprop": 1, "ASGD": 1, "Adafactor": 1,
                       "Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adadelta": 2,
                       "Rprop": 2, "SparseAdam": 2}
_WRAPPERS = ("torch.nn.parallel", "torch.distributed", "torch._dynamo")


@dataclass
class Replay:
    """What the failed attempt called its model with, kept from the traceback until measured; holds the
    model's input (not what the model allocated): drop it after `measure`."""

    root: object
    failing: object
    args: tuple
    kwargs: dict
    rows: int                   # the batch's rows: the first dimension of the model's first input tensor
    optimizers: list
    grads_at_failure: int       # bytes of the model's parameter gradients when it failed
    state_at_failure: int       # bytes of its optimizers' state then
    keep_output: bool = False   # the cell binds the model's output (`out = model(x)`): it lives through
                                # the backward pass (a language model's logits are per row too)
    quiet: object = None        # a DistributedDataParallel's no_sync: the module it wraps is measured

    def measure(self, meter) -> ModelCost | None:
        """Run the model on two slices of the batch and fit its memory; None where it cannot be measured
        (a slice ran out of memory down to MIN_ROWS, or the model did not take a slice)."""
        torch = loaded_torch()
        grads_start = _grad_bytes(self.root)
        rows = max(MIN_ROWS, self.rows // SLICE)
        t0 = time.perf_counter()
        while 2 * rows < self.rows:
            try:
                small = self._run(rows, meter, torch)
                large = self._run(2 * rows, meter, torch)
            except Exception as exc:  # noqa: BLE001 - the model may raise anything on a slice
                if oom_kind(exc) not in ("oom", "possible"):
                    return None        # a model that needs its whole batch (a fixed shape): not measured
                del exc
                gc.collect()
                rows //= 4
                if rows < MIN_ROWS:
                    return None
                continue
            break
        else:
            return None
        per_row = (large.peak - small.peak) / rows
        lines = [(small.peak - per_row * rows, per_row)]          # the peaks' own line
        forward_lines, kept_lines, moments = [], [], []
        grads = _trainable_bytes(self.root)
        if len(small.samples) == len(large.samples) and small.backward_from == large.backward_from:
            moments = [(a - (b - a), (b - a) / rows) for a, b in zip(small.samples, large.samples)]
            lines += envelope(moments[small.backward_from:], self.rows)
            forward_lines = envelope(moments[:small.backward_from], self.rows)
            # the same moments with all the gradients there, not only those the pass had made by then
            kept_lines = envelope([(f - g + grads, r) for (f, r), g in
                                   zip(moments[small.backward_from:], large.grads[small.backward_from:])],
                                  self.rows)
        entries, forward_moments, entry_samples = (), (), ()
        if len(small.entries) == len(large.entries):
            entries = tuple((a - (b - a), (b - a) / rows) for a, b in zip(small.entries, large.entries))
            if small.entry_samples == large.entry_samples and len(small.samples) == len(large.samples):
                forward_moments = tuple(moments[:small.backward_from])
                entry_samples = tuple(small.entry_samples)
        timeline, allocator, backward_event = (), None, None
        if small.timeline is not None and large.timeline is not None:
            from cuda_magic.devices.allocator_replay import timeline_lines

            timeline = timeline_lines(small.timeline, large.timeline, rows) or ()
            allocator = meter.device.allocator_copy if timeline else None
            backward_event = small.timeline.backward_at
        device = _device_of(self.root)
        state_now = _state_bytes(self.optimizers, device, torch)
        fixed_held = (max(0, self.grads_at_failure - grads_start)
                      + max(0, self.state_at_failure - state_now))
        # the gradients are alive in the forward pass where they were when it failed, and unless the
        # optimizer has stepped in this attempt with none left (zeroed before the forward pass), may be
        stepped_without = self.grads_at_failure == 0 and self.state_at_failure > state_now
        full = _full_state(self.optimizers, device, torch)
        return ModelCost(rows=self.rows, lines=tuple(lines), forward_lines=tuple(forward_lines),
                         grads_in_forward=0 if stepped_without else grads, kept_lines=tuple(kept_lines),
                         grads=grads,
                         entries=entries, fixed_held=fixed_held, forward_moments=forward_moments,
                         entry_samples=entry_samples,
                         state_to_come=max(0, max(full, self.state_at_failure) - state_now),
                         grads_at_start=grads_start,
                         probe_rows=(rows, 2 * rows), seconds=time.perf_counter() - t0,
                         timeline=timeline, allocator=allocator, segments=reserves_segments(meter),
                         backward_event=backward_event,
                         param_bytes=tuple(p.numel() * p.element_size() for p in self.root.parameters()
                                           if p.requires_grad))

    def _run(self, rows: int, meter, torch) -> Pass:
        """One pass on the first `rows` rows, measured above what was allocated before it."""
        params = list(self.root.parameters())
        kept = [p.grad for p in params]
        done = Pass()
        before = meter.allocated() or 0

        def at_entry(module, args):
            done.entries.append((meter.allocated() or 0) - before)
            done.entry_samples.append(len(done.samples))

        args, kwargs = _sliced(self.args, rows, self.rows, torch), _sliced(self.kwargs, rows, self.rows, torch)
        handle = self.failing.register_forward_pre_hook(at_entry)
        recording = timeline_of(meter)
        try:
            for p in params:
                p.grad = None          # as after zero_grad(): the pass allocates the gradients
            meter.reset_peak()
            before = meter.allocated() or 0
            training = self.root.training
            with (torch.enable_grad() if training else torch.no_grad(),
                  self.quiet() if self.quiet is not None else contextlib.nullcontext(),
                  _sampling(meter, before, done, [p for p in params if p.requires_grad])):
                out = self.root(*args, **kwargs)
                loss = _loss(out, torch) if training else None
                if not self.keep_output:
                    del out
                    out = None
                done.backward_from = len(done.samples)
                if recording is not None:
                    recording.mark_backward()
                if loss is not None:
                    loss.backward()
                del loss, out
            done.peak = (meter.peak() or 0) - before
            if recording is not None:
                recording.mark_gradients(p.grad.untyped_storage()._cdata for p in params if p.grad is not None)
                done.timeline = recording
            return done
        finally:
            handle.remove()
            if recording is not None:
                meter.device.detach_recorder(recording)
            for p, grad in zip(params, kept):
                p.grad = grad


@dataclass
class Pass:
    """One measured pass: bytes above what was allocated before it."""

    peak: int = 0
    samples: list = field(default_factory=list)     # after each operation
    grads: list = field(default_factory=list)       # ... of which the parameters' gradients
    backward_from: int = 0                          # the first sample of the backward pass
    entries: list = field(default_factory=list)     # at each entry into the failing module
    entry_samples: list = field(default_factory=list)   # ... the number of samples taken by then
    timeline: object = None     # its allocations and frees (devices/allocator_replay.Timeline), where the
                                # device reserves as torch's caching allocator


def envelope(lines, rows: int, points: int = 64) -> list:
    """Of (fixed, per_row) lines, those that are the highest somewhere between no rows and twice `rows`:
    the moments that can be the pass's peak."""
    chosen = {}
    if not lines:
        return []
    for j in range(points + 1):
        x = 2 * rows * j / points
        best = max(lines, key=lambda line: line[0] + line[1] * x)
        chosen[best] = None
    return list(chosen)


def _sampling(meter, before: int, done: Pass, params: list):
    """A dispatch mode that notes the memory allocated after each operation (forward and backward), and the
    parameters' gradients in it: two slices' notes, side by side, give each moment's memory as a line in
    the rows."""
    from torch.utils._python_dispatch import TorchDispatchMode

    samples, grads = done.samples, done.grads

    class Sampling(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            samples.append((meter.allocated() or 0) - before)
            grads.append(sum(p.grad.untyped_storage().nbytes() for p in params if p.grad is not None))
            return out

    return Sampling()


def read_model_calls(tb) -> tuple[Progress | None, Replay | None]:
    """Inside the `except` block of an OOM (the frames' locals are read): how far through the model's
    forward pass it came (recover/progress.py) and what to replay the model with; (None, None) when it
    was not inside a module call (after the forward pass: the loss, backward, the optimizer step)."""
    torch = loaded_torch()
    if torch is None or tb is None:
        return None, None
    calls = module_calls(tb, torch)
    if calls is None:
        return None, None
    lengths = generation_growth(calls.frames)
    if lengths is not None:
        # a generation loop fails late: the step that failed is one of many, on a growing sequence; one
        # forward pass measured on a slice says nothing of the steps to come
        from cuda_magic.recover.generation import generation_replay

        replay = generation_replay(calls.frames, torch)
        calls.frames = None
        length, final = lengths
        per_token = cache_bytes_per_token(calls.root)
        return Progress(1.0, growth=final / length,
                        cache_to_come=None if per_token is None else per_token * (final - length)), replay
    progress = progress_of(calls, torch)
    replay = replay_of(calls, torch) if progress is not None else None
    calls.frames = None
    return progress, replay


def replay_of(calls, torch) -> Replay | None:
    root, quiet = calls.root, None
    ddp = getattr(getattr(torch.nn, "parallel", None), "DistributedDataParallel", None)
    if ddp is not None and isinstance(root, ddp):
        # the module DDP wraps, measured alone: its gradient hooks stay inert without DDP's forward
        # (Reducer::autograd_hook returns until prepare_for_backward), and no_sync() besides, so that
        # measuring on the rank that failed runs no collective the other ranks would have to join
        root, quiet = root.module, root.no_sync
    if type(root).__module__.startswith(_WRAPPERS) or type(root).__name__ == "OptimizedModule":
        return None
    rows = _rows([*calls.args, *calls.kwargs.values()], torch)
    if rows is None or rows < 4 * MIN_ROWS:
        return None
    optimizers = _optimizers(calls.frames or [], root, torch)
    device = _device_of(root)
    return Replay(root, calls.failing, calls.args, calls.kwargs, rows, optimizers, _grad_bytes(root),
                  _state_bytes(optimizers, device, torch), quiet=quiet)


def _device_of(root):
    """The device of the model's first parameter (where its gradients and optimizer state live)."""
    return next((p.device for p in root.parameters()), None)


def _rows(items, torch) -> int | None:
    for t in flat_items(items):
        if isinstance(t, torch.Tensor) and t.dim() >= 1:
            return int(t.shape[0])
    return None


def _sliced(tree, rows: int, total: int, torch):
    """The first `rows` rows of every tensor whose first dimension is the batch, one level into lists,
    tuples and dicts (views: no new memory; detached, so that no backward pass reaches the graph that made
    them); other values as they are."""
    def cut(v):
        if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == total:
            return v[:rows].detach()
        return v

    if isinstance(tree, dict):
        return {k: (type(v)(cut(x) for x in v) if isinstance(v, (list, tuple)) else cut(v)) for k, v in tree.items()}
    return tuple(type(v)(cut(x) for x in v) if isinstance(v, (list, tuple)) else cut(v) for v in tree)


def _loss(out, torch):
    """A scalar to run backward from: the model's own scalar loss where it returns one (a language model
    given labels), else a log-softmax of each output that needs gradients, with the memory a
    classification loss (cross-entropy) takes in both passes."""
    tensors = []
    items = [out]
    for _ in range(3):            # a tensor, a tuple of them, a dict or ModelOutput of them
        nxt = []
        for item in items:
            if isinstance(item, torch.Tensor):
                tensors.append(item)
            elif isinstance(item, dict):
                nxt.extend(item.values())
            elif isinstance(item, (list, tuple)):
                nxt.extend(item)
        items = nxt
    grads = [t for t in tensors if t.requires_grad and t.is_floating_point()]
    for t in grads:
        if t.numel() == 1:
            return t.reshape(())
    loss = None
    for t in grads:
        if t.dim() >= 1:
            scores = torch.log_softmax(t, dim=-1)
            # a classification loss's backward pass gives the log-probabilities a gradient as large as
            # they are (a sum's is one number, broadcast): made so here
            scores.register_hook(lambda grad: grad.contiguous())
            part = scores.sum()
        else:
            part = t.sum()
        loss = part if loss is None else loss + part
    return loss


def _grad_bytes(root) -> int:
    return sum(p.grad.untyped_storage().nbytes() for p in root.parameters() if p.grad is not None)


def _trainable_bytes(root) -> int:
    """What the gradients of the model's trainable parameters take."""
    return sum(p.numel() * p.element_size() for p in root.parameters() if p.requires_grad)


def _optimizers(frames, root, torch) -> list:
    """The optimizers over the model's parameters bound to a name in the failing frames' namespaces."""
    ids = {id(p) for p in root.parameters()}
    found, seen_ns = {}, set()
    for frame in frames:
        for ns in (frame.f_globals, frame.f_locals):
            if id(ns) in seen_ns:
                continue
            seen_ns.add(id(ns))
            for value in list(ns.values()):
                if (isinstance(value, torch.optim.Optimizer) and id(value) not in found
                        and any(id(p) in ids for g in value.param_groups for p in g["params"])):
                    found[id(value)] = value
    return list(found.values())


def _state_bytes(optimizers, device, torch) -> int:
    seen, total = set(), 0
    for opt in optimizers:
        for state in opt.state.values():
            for t in state.values():
                if isinstance(t, torch.Tensor) and t.numel() > 1 and (device is None or t.device == device):
                    key = t.untyped_storage().data_ptr()
                    if key not in seen:
                        seen.add(key)
                        total += t.untyped_storage().nbytes()
    return total


def _full_state(optimizers, device, torch) -> int:
    """What the optimizers' state will take once they have stepped: STATE_PER_PARAMETER times the bytes of
    the parameters they train (those on the model's device)."""
    total = 0
    for opt in optimizers:
        groups = opt.param_groups
        per = STATE_PER_PARAMETER.get(type(opt).__name__, 2)
        if any(g.get("momentum") for g in groups) and type(opt).__name__ in ("SGD", "RMSprop"):
            per += 1
        if any(g.get("amsgrad") for g in groups):
            per += 1
        total += per * sum(p.numel() * p.element_size() for g in groups for p in g["params"]
                           if p.requires_grad and (device is None or p.device == device))
    return total


def output_kept(line: str) -> bool:
    """Whether a cell's line binds a model call's result to a name (`out = model(x)`, `logits, h = m(x)`),
    so that the output lives on; not where the call is an argument (`loss = f(model(x), y)`)."""
    import ast

    try:
        tree = ast.parse(line.strip())
    except SyntaxError:
        return False
    node = tree.body[0] if tree.body else None
    return isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Call)
