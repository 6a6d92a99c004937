"""How far through the model's forward pass a failed run came: read from the failure's traceback, for the
retry's prediction (recover/retry.py).

One failure says how much memory the cell held when it failed, not how much of the cell was still to
come: a failure in the second layer and one in the fifth give the same kind of lower bound, but the first
is far further from the cell's peak. When the failure came inside a `torch.nn.Module` call, the
traceback's module calls name the model (the outermost module called) and the module that failed (the
innermost); the failing module's place among the model's leaf modules, in their registration order (the
order most models run them in), is the share of the forward pass done, its request included.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cuda_magic.devices.caching_allocator import segment_asked

MAX_LEAVES = 10_000        # a model with more leaf modules is not walked (its share is not needed that fine)


@dataclass(frozen=True)
class Progress:
    """Where in the model's forward pass a failure came. Sizes are int bytes."""

    share: float                  # of the model's leaf modules run, the failing one counted: (0, 1]
    input_bytes: int = 0          # the tensors the model was called with (there before it ran)
    grads_to_come: int = 0        # a model in training whose trainable parameters have no gradient yet:
                                  # the backward pass still to come will allocate this much
    rest_bytes: int | None = None  # what the layers after the failing one will allocate, where the model
                                   # is a chain of layers whose output sizes are known (recover/shapes.py)
    cost: ModelCost | None = None  # the model's memory measured on slices of its input (recover/replay.py)
    growth: float | None = None   # in a generation loop: how much longer the sequence gets after the step
                                  # that failed (its final length over its length then) ...
    cache_to_come: int | None = None   # ... and what the key/value cache adds by the end, per row, where
                                       # the model's config says its size (layers, heads, head size)


@dataclass(frozen=True)
class ModelCost:
    """What the model's forward and backward pass take, measured after the failure on two slices of the
    failing batch (recover/replay.py), and the optimizer state and gradients around it. Int bytes; a
    quantity per row is a float (the fit of two measured sizes)."""

    rows: int                     # rows of the batch the model failed on
    lines: tuple                  # (fixed, per_row): the memory in use at the moments of the pass that can
                                  # be its peak, each a line in the rows (a moment in the backward pass
                                  # holds the gradients whatever the batch, the end of the forward pass
                                  # mostly rows); the pass's peak above its start is their maximum
    forward_lines: tuple = ()     # (fixed, per_row) of the moments of the forward pass, measured without
                                  # gradients: ...
    grads_in_forward: int = 0     # ... which a cell may keep through it (zeroed between the forward and
                                  # the backward pass, or accumulated): these bytes are added to them
    kept_lines: tuple = ()        # the backward pass's moments with all the gradients there from its
                                  # start (accumulated over micro-batches, or never set to None), not only
                                  # those computed so far; used with `kept=True`
    grads: int = 0                # what the gradients of the trainable parameters take
    entries: tuple = ()           # (fixed, per_row) allocated from the model's call to each call of the
                                  # failing module: what the failure held of the model's own memory
    fixed_held: int = 0           # gradients and optimizer state the attempt had allocated when it failed
    state_to_come: int = 0        # optimizer state the optimizer's first step will allocate
    grads_at_start: int = 0       # the parameters' gradients there when the cell starts (before its first pass)
    probe_rows: tuple = ()        # the slices measured (rows)
    seconds: float = 0.0          # what measuring them took
    forward_moments: tuple = ()   # (fixed, per_row) after each operation of the forward pass
    entry_samples: tuple = ()     # the operations done when the failing module was entered, each time
    whole_call: bool = False      # the lines cover all that the failing call holds (a generation loop's)
    timeline: tuple = ()          # the pass's allocations and frees in order, each allocation's bytes a line
                                  # in the rows (devices/allocator_replay.py), where the device reserves as
                                  # torch's caching allocator ...
    param_bytes: tuple = ()       # ... the bytes of each trainable parameter (its gradient, its state) ...
    segments: bool = False        # measured on a device that reserves segments (torch's caching allocator)
    backward_event: int | None = None   # the timeline's first event of the backward pass
    allocator: object = field(default=None, compare=False, repr=False)   # ... and a callable giving a copy
                                  # of that device's allocator as it is now (SimulatedDevice.allocator_copy)

    def fits_allocator(self, rows: int, kept: bool, besides: float) -> bool | None:
        """Whether a training step at `rows` fits on a copy of the device's caching allocator as it is now:
        `besides` (the rest the cell holds: its batch, labels) taken first, with the gradients there before
        the pass where the cost counts them in the forward pass (set to None when the backward pass starts)
        or `kept` (through the pass: each gradient it computes a temporary, accumulated into them), then the
        pass's measured allocations and frees at `rows`: as `peak` counts them, in the allocator's blocks
        and segments. Where the optimizer's first step has state still to allocate, the cell's first two
        steps are replayed (devices/allocator_replay.replay_fits, `state_after`): the first pass with the
        gradients the cell starts with, that state made after it (where the first pass's activations left
        room in the cache: split off their large blocks, it leaves holes that the second pass's activations
        cannot use; the 2 GiB MLP's state, taken before the pass, said 104 rows fit where 93 is the
        largest), then the second pass; else the state is there before the pass. None where there is no
        allocator to ask (the plain count, a GPU) or no timeline."""
        from cuda_magic.devices.allocator_replay import replay_fits

        if not self.timeline or self.allocator is None:
            return None
        model = self.allocator()
        if model is None:
            return None
        state = []
        total = sum(self.param_bytes)
        if total and self.state_to_come:
            copies, rest = divmod(int(self.state_to_come), total)
            state = list(self.param_bytes) * copies + ([rest] if rest else [])
        before = [int(besides)] if besides > 0 else []
        carried = kept or self.grads_in_forward > 0
        grads = self.param_bytes if carried else ()
        if state:
            first = self.param_bytes if carried and self.grads_at_start > 0 else ()
            return replay_fits(model, self.timeline, rows, before=before, grads=first, kept=kept,
                               backward_at=self.backward_event, state_after=state, carried=carried)
        return replay_fits(model, self.timeline, rows, before=before, grads=grads, kept=kept,
                           backward_at=self.backward_event)

    def peak(self, rows: float, kept: bool = False) -> float:
        """The pass's peak above what was allocated before it, for a batch of `rows`; `kept`: with the
        gradients there through the whole pass (gradient accumulation)."""
        return max(f + r * rows for f, r in self._all_lines(kept))

    def per_row(self, rows: float, kept: bool = False) -> float:
        """The bytes a row adds at the moment that is the peak for a batch of `rows`."""
        return max(self._all_lines(kept), key=lambda line: line[0] + line[1] * rows)[1]

    def _before_failing_op(self, rows: int, held: int, requested: int | None) -> int | None:
        moments = self.forward_moments
        if not requested or not moments or not self.entry_samples:
            return None
        slack = max(4096, 0.02 * requested)

        def at(k):
            return 0.0 if k < 0 else moments[k][0] + moments[k][1] * rows

        def asks(jump: float) -> bool:
            # on a device that reserves segments, torch's message names the segment it could not reserve
            # (a request of 1 to 10 MiB asks for 20 MiB), not the request
            return abs(jump - requested) <= slack or (
                self.segments and jump > 0 and abs(segment_asked(int(jump)) - requested) <= slack)

        candidates = [at(k - 1) for start in self.entry_samples for k in range(start, len(moments))
                      if asks(at(k) - at(k - 1)) and at(k - 1) <= held]
        return int(max(candidates)) if candidates else None

    def _all_lines(self, kept: bool) -> list:
        grads = self.grads if kept else self.grads_in_forward
        return [*self.lines, *((f + grads, r) for f, r in self.forward_lines),
                *(self.kept_lines if kept else ())]

    def held_by_model(self, rows: int, held: int, requested: int | None = None) -> int:
        """Of `held` bytes at the failure, the model's own activations. Where the failing operation can be
        found in the measured pass (from an entry into the failing module, an operation that allocates
        what the failure asked for, at `rows`), what the model held just before it, the latest consistent
        with what was held; else the latest call of the failing module consistent with it, and where even
        its first call would hold more, all of it (it failed early in that call)."""
        if self.whole_call:
            return held
        found = self._before_failing_op(rows, held, requested)
        if found is not None:
            return found
        at_calls = [int(f + r * rows) for f, r in self.entries]
        fits = [b for b in at_calls if 0 <= b <= held]
        if not fits and at_calls and min(at_calls) > held:
            return held
        return max(fits, default=0)


@dataclass
class ModuleCalls:
    """The module calls a traceback went through, outermost first, and what the outermost (the model)
    and the innermost (the failing module) were called with. Holds the frames' objects: read it inside
    the `except` block and drop it there, or keep only what a replay needs (recover/replay.py)."""

    chain: list
    args: tuple
    kwargs: dict
    first_arg: object = None        # the failing module's first argument
    frames: list = None             # the traceback's frames, outermost first

    @property
    def root(self):
        return self.chain[0]

    @property
    def failing(self):
        return self.chain[-1]


def module_calls(tb, torch) -> ModuleCalls | None:
    """The `torch.nn.Module` calls on the traceback's frames; None when it went through none."""
    module_class = torch.nn.Module
    call_codes = {getattr(module_class, name).__code__ for name in ("_call_impl", "_wrapped_call_impl")
                  if hasattr(getattr(module_class, name, None), "__code__")}
    chain, root_args, root_kwargs, first_args, frames = [], (), {}, [], []
    while tb is not None:
        frame = tb.tb_frame
        frames.append(frame)
        if frame.f_code in call_codes:
            local = frame.f_locals
            module = local.get("self")
            if isinstance(module, module_class) and (not chain or chain[-1] is not module):
                args = local.get("args", ())
                args = args if isinstance(args, tuple) else ()
                if not chain:
                    root_args, root_kwargs = args, dict(local.get("kwargs", None) or {})
                first_args.append(args[0] if args else None)
                chain.append(module)
        tb = tb.tb_next
    if not chain:
        return None
    # a module called from the model's forward that is not one of its modules (transformers 5 with
    # `kernels` installed: apply_rotary_pos_emb made a module by use_kernel_forward_from_hub and attached
    # as a plain attribute, kernels/_internals/layer/layer.py use_kernelized_func): the failure is placed
    # at the innermost module of the model's own tree that called it
    inside = {id(m) for m in chain[0].modules()}
    kept = [i for i, m in enumerate(chain) if id(m) in inside]
    chain = [chain[i] for i in kept]
    return ModuleCalls(chain, root_args, root_kwargs, first_args[kept[-1]], frames)


GENERATION_CALLS = {"generate", "_sample", "_prefill", "_greedy_search", "greedy_search", "sample",
                    "_beam_search", "beam_search", "_assisted_decoding", "_contrastive_search"}


def generation_growth(frames) -> tuple[int, int] | None:
    """Where the model was called by a generation loop (transformers' `generate`: the frames of its
    generation utilities), the length of the failing step's input and the sequence's final length (the
    generation config's max_length). None outside one, or where the loop does not say."""
    for frame in frames or ():
        code = frame.f_code
        if code.co_name not in GENERATION_CALLS or "generation" not in code.co_filename.replace("\\", "/"):
            continue
        local = frame.f_locals
        ids, config = local.get("input_ids"), local.get("generation_config")
        final = getattr(config, "max_length", None)
        length = ids.shape[-1] if getattr(ids, "dim", lambda: 0)() >= 2 else None
        if isinstance(final, int) and length:
            return int(length), max(int(length), final)
    return None


def cache_bytes_per_token(root) -> int | None:
    """The key/value cache a decoder adds per token and row, from its config (transformers' names):
    keys and values for every layer, kv heads x head size, in the model's dtype. None where not said."""
    config = getattr(root, "config", None)
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (
        getattr(config, "hidden_size", 0) // heads if heads else None)
    if not (isinstance(layers, int) and isinstance(kv_heads, int) and isinstance(head_dim, int) and head_dim):
        return None
    size = next((p.element_size() for p in root.parameters() if p.is_floating_point()), 4)
    return 2 * layers * kv_heads * head_dim * size


def leaf_modules(root) -> list | None:
    """The model's leaf modules in registration order; None past MAX_LEAVES."""
    leaves = []
    for module in root.modules():
        if next(iter(module.children()), None) is None:
            leaves.append(module)
            if len(leaves) > MAX_LEAVES:
                return None
    return leaves


def progress_of(calls: ModuleCalls, torch) -> Progress | None:
    """How far through the outermost module called the failure came; None when the module tree cannot
    tell (recover/replay.py's `read_model_calls` reads the calls from a traceback)."""
    root, failing, first_arg = calls.root, calls.failing, calls.first_arg
    leaves = leaf_modules(root)
    if leaves is None or len(leaves) < 2:
        return None
    ids = [id(m) for m in leaves]
    failing_leaves = [id(m) for m in failing.modules() if next(iter(m.children()), None) is None]
    if not failing_leaves or failing_leaves[-1] not in ids:
        return None
    # a container that failed between its children's calls: count its leaves as done (an upper bound)
    done = ids.index(failing_leaves[-1]) + 1
    inputs = _tensor_bytes(torch, [*calls.args, *calls.kwargs.values()])
    grads = 0
    if root.training:
        grads = _tensor_bytes(torch, [p for p in root.parameters() if p.requires_grad and p.grad is None])
    rest = None
    if failing_leaves == [ids[done - 1]] and isinstance(first_arg, torch.Tensor):
        from cuda_magic.recover.shapes import rest_bytes, sequential_only

        try:
            if sequential_only(root, torch):
                rest = rest_bytes(leaves, done - 1, tuple(first_arg.shape), _element_size(first_arg, failing),
                                  torch)
        except (AttributeError, TypeError, ValueError, IndexError, ZeroDivisionError):
            rest = None      # a layer that only looks like a common one: the retry extrapolates instead
    return Progress(done / len(leaves), inputs, grads, rest)


def _element_size(tensor, module) -> int:
    """Bytes per element of the activations: the input's if it is floating point, else the layer's."""
    if tensor.is_floating_point():
        return tensor.element_size()
    for p in module.parameters():
        return p.element_size()
    return 4


def flat_items(items) -> list:
    """The items, with their lists, tuples and dicts opened one level (a model's arguments)."""
    flat = []
    for item in items:
        if isinstance(item, (list, tuple)):
            flat.extend(item)
        elif isinstance(item, dict):
            flat.extend(item.values())
        else:
            flat.append(item)
    return flat


def _tensor_bytes(torch, items) -> int:
    """Bytes of the distinct tensors among items and one level into their lists, tuples and dicts."""
    seen, total = set(), 0
    for t in flat_items(items):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key not in seen:
                seen.add(key)
                total += key[1]
    return total
