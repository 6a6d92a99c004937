"""The advice for a diagnosed out-of-memory error: for each cause the remedies in order (`_PLAN`), each
a function of the diagnosis's Context that gives an Advice, or None where it cannot help this cell (it
already does it, the name is in use, the memory does not follow the batch). Swaps for a pass without
autograd, a pass that only evaluates and a transformers Trainer. Pure: the Context in, Advice out."""
from __future__ import annotations

import re
from cuda_magic.devices.allocator_conf import conf_value, expandable_segments_line, expandable_segments_on
from cuda_magic.memory.holders import Holder
from cuda_magic.oom.findings import Advice
from cuda_magic.units import format_bytes

HOLDER_SHARE = 0.05                   # a name holding this share of the device is worth naming
_GPU_BACKENDS = ("cuda", "hip", "cublas", "cudnn", "xpu")


_PLAN = {
    "cap_below_held": ("raise_cap", "delete", "freecuda"),
    "graphs_in_evaluation": ("no_grad", "batch", "amp"),
    "request_exceeds_capacity": ("split", "batch", "amp", "checkpoint"),
    "too_large": ("batch", "amp", "accumulate", "checkpoint", "freecuda"),
    "fragmentation": ("expandable", "freecuda", "batch"),
    "other_processes": ("processes",),
    "names_holding": ("detach", "cpu_metrics", "delete"),
    "free_reported": ("processes", "freecuda"),
    "unknown": ("contiguous", "freecuda", "batch", "amp"),
}
_TAIL = ("batch", "amp", "accumulate")
# Without an autograd graph (no_grad, inference_mode, generate) training advice does not apply.
_INFERENCE = {"batch": ("sequences", "generation", "kv_cache"), "accumulate": (), "checkpoint": ()}
# A pass that only evaluates has no effective batch to keep and no backward pass to checkpoint for.
_EVALUATION = {"batch": ("eval_batch",), "accumulate": (), "checkpoint": ()}
# A transformers Trainer ran it: its TrainingArguments, not lines the user never wrote.
_TRAINER = {"batch": ("trainer_batch",), "accumulate": (), "amp": ("trainer_amp",),
            "checkpoint": ("trainer_checkpoint",)}
SHOWN = 5                             # the display shows this many: advice that must be seen goes above


def advise(ctx) -> list[Advice]:
    """The advice for `ctx` (oom.diagnosis.Context), most useful first."""
    causes = ctx.causes
    if causes[0] == "request_exceeds_capacity":
        causes = causes[:1]        # no clean-up can make one allocation larger than the device fit
    advice, done = [], set()
    swap = (_INFERENCE if ctx.inference else _TRAINER if ctx.facts.cell.trainer is not None
            else _EVALUATION if ctx.evaluating else {})
    keys = [k2 for k in [k for c in causes for k in _PLAN[c]] + list(_TAIL) for k2 in swap.get(k, (k,))]
    items = {}
    for key in keys:
        if key not in items:
            items[key] = _ADVICE[key](ctx)
    # each cause named gets its first remedy among those shown (expandable_segments whenever
    # fragmentation is named, %gpumem --processes for memory outside PyTorch), then the rest in order
    firsts = []
    for c in causes:
        plan = [k2 for k in _PLAN[c] for k2 in swap.get(k, (k,))]
        first = next((k for k in plan if items.get(k) is not None), None)
        if first is not None and first not in firsts:
            firsts.append(first)
    for key in firsts[:SHOWN] + [k for k in items if k not in firsts]:
        if key in done or items[key] is None:
            continue
        done.add(key)
        advice.append(items[key])
    return advice


def variable(name: str) -> str | None:
    """The notebook variable a holder description starts with ('losses (list of ...)' -> 'losses')."""
    m = re.match(r"[A-Za-z_]\w*", name)
    if m is None or m.group(0).startswith("_") or m.group(0) in ("Out", "In"):
        return None
    return m.group(0)


def with_graph(name: str) -> bool:
    return "grad_fn" in name or "graph" in name.lower()


def _container(name: str) -> str | None:
    m = re.search(r"\b(list|dict|tuple|deque|set) of\b", name)
    return m.group(1) if m else None


def _batch(ctx):
    if ctx.retried or ctx.facts.independent:
        return None                   # a smaller batch already fitted, or the memory does not follow it
    if ctx.api:
        line = f"@oomguard(retry=\"{ctx.batch}\", accumulate=\"{ctx.accum}\")"
        return Advice(f"Use a smaller batch: `{line}` calls the function again with a smaller {ctx.batch} "
                      f"until it fits and raises {ctx.accum} so that the effective batch stays the same.", line)
    if ctx.facts.batch_var and not ctx.facts.accum_var:    # the cell's batch is known; it accumulates nothing
        line = f"%%oomguard -r {ctx.batch}"
        return Advice(f"Use a smaller batch: `{line}` reruns the cell with a smaller {ctx.batch} until it fits; "
                      f"to keep the effective batch too, let the cell run ACCUM micro-batches per step and add "
                      f"`-a ACCUM` (gradient accumulation, below).", line)
    line = f"%%oomguard -r {ctx.batch} -a {ctx.accum}"
    return Advice(f"Use a smaller batch: `{line}` reruns the cell with a smaller {ctx.batch} until it fits and raises "
                  f"{ctx.accum} so that the effective batch stays the same.", line)


def _eval_batch(ctx):
    if ctx.retried or ctx.facts.independent:
        return None
    line = f"@oomguard(retry=\"{ctx.batch}\")" if ctx.api else f"%%oomguard -r {ctx.batch}"
    return Advice(f"Evaluate a smaller batch at a time: `{line}` finds a {ctx.batch} that fits (an evaluation "
                  "takes no optimizer step, so there is no effective batch to keep).", line)


def _trainer_batch(ctx):
    if ctx.retried or ctx.facts.independent:
        return None
    t = ctx.facts.cell.trainer
    values = f" (set `bs = {t.batch}` and `acc = {t.accumulation}` first: the Trainer's own)" if t.batch else ""
    code = ("%%oomguard -r bs -a acc\n"
            "args = TrainingArguments(..., per_device_train_batch_size=bs, gradient_accumulation_steps=acc)\n"
            "Trainer(model=model, args=args, ...).train()")
    return Advice("Use a smaller batch: the Trainer reads its batch size when it is made, so make the "
                  "TrainingArguments and the Trainer in the cell from `bs` and `acc`; `%%oomguard -r bs -a acc` "
                  "reruns it with a smaller bs until it fits and raises acc so that the effective batch stays the "
                  f"same, the model rolled back between attempts{values}.", code)


def _trainer_amp(ctx):
    if ctx.amp or ctx.facts.cell.trainer.mixed:
        return None
    return Advice("Train in mixed precision: `bf16=True` in the TrainingArguments (`fp16=True` on a GPU without "
                  "bfloat16) runs the forward pass under autocast: activations take half the memory.",
                  "TrainingArguments(..., bf16=True)")


def _trainer_checkpoint(ctx):
    if ctx.facts.cell.trainer.checkpointing or ctx.facts.cell.checkpoints:
        return None
    return Advice("Trade compute for memory: `gradient_checkpointing=True` in the TrainingArguments recomputes "
                  "each layer's activations in the backward pass instead of keeping them.",
                  "TrainingArguments(..., gradient_checkpointing=True)")


def _amp(ctx):
    if ctx.amp or ctx.facts.cell.autocasts:
        return None                   # the cell already runs in mixed precision
    f = ctx.fields
    device_type = {"cpu": "cpu", "simulated": "cpu", "mps": "mps", "xpu": "xpu"}.get(f.backend, "cuda")
    return Advice("Run in mixed precision: activations take half the memory, but autocast also keeps a "
                  "half-precision copy of the weights it casts, so a small model with few activations can "
                  "peak higher under it. In plain code: "
                  f"`with torch.autocast('{device_type}', dtype=torch.bfloat16):` around the forward pass "
                  "and the loss.", "oomguard(amp=\"bf16\")" if ctx.api else "%%oomguard --amp bf16")


def _sequences(ctx):
    if ctx.retried or ctx.facts.independent:
        return None
    line = f"@oomguard(retry=\"{ctx.batch}\")" if ctx.api else f"%%oomguard -r {ctx.batch}"
    return Advice(f"Run fewer sequences per batch: without a graph, memory grows with the sequences in "
                  f"flight and their length (`{line}` finds a number that fits).", line)


def _generation(ctx):
    """Fewer new tokens than the cell asks for: half of its max_new_tokens, in its own `generate` line (or
    its name for it); never a number where the cell's is not known, which could be more than it asks."""
    text = "Generate fewer new tokens, or cut long prompts: every generated token adds to the attention and the cache."
    cell = ctx.facts.cell
    n = cell.new_tokens
    if n is None:
        return Advice(text + " Lower `max_new_tokens` in the `generate` call.", None)
    if n <= 1:
        return None
    fewer = n // 2
    if cell.new_tokens_name:
        return Advice(f"{text} The cell asks for {n}: half as many,", f"{cell.new_tokens_name} = {fewer}")
    call = re.sub(r"\b(max_new_tokens\s*=\s*)\d+", lambda m: f"{m.group(1)}{fewer}", cell.generate_call)
    call = re.sub(r"\b(min_new_tokens\s*=\s*)(\d+)",
                  lambda m: f"{m.group(1)}{min(int(m.group(2)), fewer)}", call)
    return Advice(f"{text} The cell asks for {n}: half as many,", call or f"max_new_tokens={fewer}")


def _kv_cache(ctx):
    return Advice("Shrink the KV cache: it grows with batch x sequence length x layers; a static or "
                  "quantized cache, or a shorter maximum length, bounds it.",
                  "model.generate(**inputs, cache_implementation='static')")


def _accumulate(ctx):
    if ctx.facts.independent:
        return None
    if ctx.retried and ctx.facts.accum_var:
        return None                   # `-r -a` fitted: the accumulation that keeps the effective batch is set
    return Advice(f"Keep the effective batch with gradient accumulation: run {ctx.accum} smaller "
                  f"batches, scale each loss by 1/{ctx.accum}, and step the optimizer once after "
                  "them.", f"(loss / {ctx.accum}).backward()")


def _checkpoint(ctx):
    if ctx.facts.cell.checkpoints:
        return None                   # the cell already checkpoints
    return Advice("Trade compute for memory with gradient checkpointing: activations of a block are "
                  "recomputed in the backward pass instead of kept.",
                  "y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)")


def _split(ctx):
    return Advice("Process the input in pieces: one operation alone needs more than the device has "
                  "(a smaller batch or sequence length, or a loop over chunks).",
                  "out = torch.cat([f(chunk) for chunk in x.split(CHUNK)])")


def _expandable(ctx):
    f, conf = ctx.fields, ctx.alloc_conf or ""
    if f.backend == "simulated":
        return _expandable_simulated(ctx)
    if f.backend not in ("cuda", "hip", "cublas") or expandable_segments_on(conf):
        return None
    if (conf_value(conf, "backend") or "native").lower() != "native":
        return None
    for_you = "" if ctx.api else " (%%oomguard can do it for you)"
    return Advice("Switch on expandable_segments so that PyTorch's cache can grow segments instead of "
                  f"leaving unusable pieces; this line keeps your other allocator settings{for_you}.",
                  expandable_segments_line(conf))


def _expandable_simulated(ctx):
    """The simulated device reserves as torch's caching allocator does: its expandable_segments are
    cuda_magic's to switch (for simulated devices; PYTORCH_CUDA_ALLOC_CONF set before Python starts, too)."""
    import json

    from cuda_magic.devices.allocator_conf import merge_conf
    from cuda_magic.devices.simulated import allocator_settings

    conf = allocator_settings()
    if expandable_segments_on(conf):
        return None
    text = ("Switch on expandable_segments so that the simulated device's caching allocator grows segments "
            "instead of leaving unusable pieces, as PyTorch's does on a GPU")
    if ctx.api:
        new = json.dumps(merge_conf(conf, expandable_segments=True))
        return Advice(text + "; the cached segments go back first.",
                      "from cuda_magic.devices import simulated; "
                      f"simulated.apply_allocator_settings({new}); simulated.empty_caches()")
    return Advice(text + " (after the clean-up, which emptied the cache).", "%%oomguard --expandable-segments")


def _freecuda(ctx):
    if ctx.api:
        return Advice("Give back what the failed run and the cache hold.", "cuda_magic.release()")
    return Advice("Give back what the failed run and the cache hold (the kernel keeps running).",
                  "%freecuda")


def _processes(ctx):
    if ctx.fields.backend not in _GPU_BACKENDS:
        return None
    return Advice("See which processes use the GPU and close those you do not need (another notebook's "
                  "kernel, a finished training run, a data-loader still holding the device).",
                  "nvidia-smi" if ctx.api else "%gpumem --processes")


def _holders_where(ctx, test):
    return [(h.description, v) for h in ctx.held if test(h) and (v := variable(h.name))]


def _detach(ctx):
    need = ctx.fields.requested if ctx.fields.free is None or ctx.fields.requested is None else max(
        0, ctx.fields.requested - ctx.fields.free)
    graphs = [h for h in ctx.held if leaking(h, need, ctx.capacity) and variable(h.name)]
    if not graphs:
        return None
    # logged losses (scalars) are the classic case: name them before collected outputs
    holder = sorted(graphs, key=lambda h: " scalar " not in h.what)[0]
    name, var = holder.description, variable(holder.name)
    if _container(name):
        if holder.what and " scalar " not in holder.what and _container(name) == "list":
            code = f"{var}.append(out.detach())  # not {var}.append(out)"
        else:
            code = (f"{var}.append(loss.item())  # not {var}.append(loss)" if _container(name) == "list"
                    else "loss.item()  # keep this float, not the tensor")
        what = f" ({holder.what})" if holder.what else ""
        return Advice(f"`{var}`{what} keeps the autograd graph of every step alive: log numbers with "
                      "`.item()`, or tensors with `.detach()`.", code)
    return Advice(f"`{var}` is a tensor with grad_fn: it keeps its autograd graph (and what the graph saved) "
                  f"alive; keep a number with `.item()`, or a tensor with `.detach()`.",
                  f"{var} = {var}.detach()  # or {var}.item() for a number")


def _cpu_metrics(ctx):
    grown = ctx.facts.grown       # collected outputs grow as the cell runs; a batch dict does not
    # logged losses with their graphs are the `.item()` advice's; outputs with graphs still move to the CPU
    kept = [h for h in ctx.held if _container(h.description) is not None and variable(h.name)
            and (grown is None or h.name in grown) and not (with_graph(h.description) and " scalar " in h.what)]
    if not kept:
        return None
    holder = next((h for h in kept if not with_graph(h.description)), kept[0])
    var = variable(holder.name)
    what = f" ({holder.what})" if holder.what else ""
    code = (f"{var}.append(out.detach().cpu())" if _container(holder.description) == "list"
            else "out.detach().cpu()")
    return Advice(f"Keep collected outputs and metrics on the CPU: `{var}`{what} holds them on the "
                  "device.", code)


def _delete(ctx):
    if "request_exceeds_capacity" in ctx.causes:
        return None                   # no clean-up makes one allocation larger than the device fit
    names = list(dict.fromkeys(v for _, v in _holders_where(
        ctx, lambda h: not expected(h, ctx.facts) and h.name not in ctx.facts.in_use)))
    if not names:
        return None
    joined = " ".join(names)
    verb = "holds" if len(names) == 1 else "hold"
    if ctx.api:
        return Advice(f"Free what {', '.join(f'`{n}`' for n in names)} {verb}: delete them, then release the "
                      "cache.", f"del {', '.join(names)}; cuda_magic.release()")
    return Advice(f"Free what {', '.join(f'`{n}`' for n in names)} {verb}: `del {', '.join(names)}` and "
                  f"then `%freecuda`, or in one step (`--offload` moves them to the CPU instead).",
                  f"%freecuda {joined}")


def _raise_cap(ctx):
    held = ctx.found.get("cap_below_held") or 0
    needed = held + (ctx.fields.requested or 0)
    size = _round_up(needed * 5 // 4)
    line = f'oomguard(limit="{size}")' if ctx.api else f"%%oomguard -l {size}"
    return Advice(f"Set the cap above what is already held: {format_bytes(held)} was allocated before the cell "
                  "started, and the cap counts it (on a GPU the memory fraction caps all that PyTorch reserves); "
                  "or free what the notebook holds first.", line)


def _round_up(nbytes: int) -> str:
    """A size to type, at least `nbytes`: whole MiB below 1 GiB, else GiB to a tenth."""
    if nbytes < 1024**3:
        return f"{-(-nbytes // 1024**2)}MiB"
    return f"{-(-nbytes * 10 // 1024**3) / 10:g}GiB"


def _no_grad(ctx):
    return Advice("Evaluate without autograd: under `torch.no_grad()` (or `torch.inference_mode()`) the forward "
                  "pass keeps no activations for a backward pass that never comes.",
                  "with torch.no_grad():\n    out = model(x)")


def _contiguous(ctx):
    if ctx.fields.backend != "cudnn":
        return None
    return Advice("If it still fails at a small batch it is not memory: cuDNN does not support the input. "
                  "Make it contiguous, or switch cuDNN off for that call.", "x = x.contiguous()")


_ADVICE = {
    "batch": _batch, "amp": _amp, "accumulate": _accumulate, "checkpoint": _checkpoint, "split": _split,
    "expandable": _expandable, "freecuda": _freecuda, "processes": _processes, "detach": _detach,
    "cpu_metrics": _cpu_metrics, "delete": _delete, "contiguous": _contiguous,
    "sequences": _sequences, "generation": _generation, "kv_cache": _kv_cache, "raise_cap": _raise_cap,
    "no_grad": _no_grad, "eval_batch": _eval_batch, "trainer_batch": _trainer_batch,
    "trainer_amp": _trainer_amp, "trainer_checkpoint": _trainer_checkpoint,
}


def leaking(h: Holder, shortfall: int | None, capacity: int | None) -> bool:
    """A name that keeps an autograd graph, large enough to matter (the classic leak). What it shares
    counts: logged losses and collected outputs keep the same graphs, and either list alone keeps them."""
    if not (h.kind == "graph" or with_graph(h.description)):
        return False
    reached = h.bytes + h.shared
    return bool((shortfall and reached >= shortfall) or (capacity and reached > HOLDER_SHARE * capacity))


def expected(h: Holder, facts) -> bool:
    """Memory the cell needs, not a surprise: a model being trained and its optimizer, a model or
    optimizer the failing cell uses, and anything else it uses that did not grow while it ran (its input,
    a batch dict: the cell makes them again). What the cell appends to as it runs is the classic leak."""
    if h.kind in ("model", "optimizer"):
        return h.training or h.name in facts.in_use
    grew = facts.grown is not None and h.name in facts.grown
    return h.name in facts.in_use and not grew and not (facts.grown is None and h.kind == "graph")
