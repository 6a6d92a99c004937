"""Why memory ran out, and what to do about it: a diagnosis from the figures of an OOM message.

Pure: works on `OomFields` and plain (name, bytes) pairs, so it is tested on real message texts
without a GPU. `explain(exc_or_text)` is the public entry point (`cuda_magic.oom.diagnosis`).
"""
from __future__ import annotations

import re

from cuda_magic.devices.allocator_conf import conf_value, expandable_segments_line, expandable_segments_on
from cuda_magic.oom.classify import FATAL_NOTE, message_kind, oom_fields, oom_kind, parse_oom_message
from cuda_magic.oom.records import Advice, Diagnosis, OomFields
from cuda_magic.units import format_bytes

CAUSE_LABELS = {
    "request_exceeds_capacity": "one allocation larger than the device",
    "too_large": "working set too large for the device",
    "fragmentation": "fragmentation of PyTorch's cache",
    "other_processes": "memory held by other processes",
    "names_holding": "tensors kept alive by notebook names",
    "unknown": "no clear cause in the figures",
}
_ORDER = tuple(CAUSE_LABELS)          # breaks ties between causes that explain as many bytes

_SHARE = 0.10                         # a part above this share of the device is significant
_HOLDER_SHARE = 0.05
_MINOR_SHARE = 0.02                   # below this share, "other processes" is driver rounding and noise
_FRAGMENT_FLOOR = 2 * 1024**2         # small blocks live in 2 MiB segments: cached bytes below are noise
_CONTEXT_ALLOWANCE = 1024**3          # old messages lump the CUDA context in with other processes
_TIGHT = 0.90                         # a working set above this share of what is left cannot grow
_GPU_BACKENDS = ("cuda", "hip", "cublas", "cudnn", "xpu")


def diagnose(fields: OomFields, *, holders=(), amp: bool = False, device_capacity: int | None = None,
             peak: int | None = None, alloc_conf: str = "", limit: int | None = None,
             batch_var: str | None = None, accum_var: str | None = None, api: bool = False) -> Diagnosis:
    """Causes of the OOM `fields` describes, ranked by the bytes each explains, and advice for them.

    holders: (description, bytes) of notebook names that still hold device memory, e.g.
    ("losses (list of 300 tensors with grad_fn)", 2_100_000_000). amp: whether the cell already ran
    under autocast. device_capacity: used where the message does not state one. peak: the exact peak
    of the failed run, used where the message states no allocation figures. alloc_conf: the allocator
    settings in force (kept in the expandable_segments line). limit: a cap on what the cell may use
    (`-l`), which counts as the capacity. batch_var / accum_var: the names to put in the
    `%%oomguard -r BATCH -a ACCUM` line. api: the run was guarded by the Python API, so the advice speaks
    of it (`oomguard(retry=...)`, `release()`), not of magics or a kernel.
    """
    device_cap = fields.capacity if fields.capacity is not None else device_capacity
    caps = [c for c in (device_cap, fields.allowed, limit) if c is not None]
    capacity = min(caps) if caps else None
    limited = capacity is not None and capacity != device_cap
    request, free = fields.requested, fields.free
    held = sorted(((str(n), int(b)) for n, b in holders if b and b > 0), key=lambda h: -h[1])
    held_total = sum(b for _, b in held)
    shortfall = max(0, request - free) if request is not None and free is not None else request
    # Plenty free and still out of memory: a limit or the driver, not what holds memory here. (A few
    # MiB free on a full device is no room: the allocator asks the driver for whole segments.)
    plenty_free = (shortfall == 0 and free is not None and capacity is not None
                   and free > _SHARE * capacity and not limited)

    found: dict[str, int] = {}
    if request is not None and capacity and request > capacity:
        found["request_exceeds_capacity"] = request

    cached = fields.reserved_unallocated or 0
    if cached and not plenty_free and (
            (request is not None and cached >= request and cached >= _FRAGMENT_FLOOR)
            or (capacity and cached > _SHARE * capacity)):
        found["fragmentation"] = cached

    others, estimated = _others(fields, device_cap)
    if others and not plenty_free and capacity:
        if estimated:
            significant = others > max(_SHARE * capacity, _CONTEXT_ALLOWANCE)
        else:
            significant = others > _SHARE * capacity or (
                request is not None and others > request and others > _MINOR_SHARE * capacity)
        if significant:
            found["other_processes"] = others

    if held_total and not plenty_free and (
            request is None or (shortfall and held_total >= shortfall)
            or (capacity and held_total > _HOLDER_SHARE * capacity)):
        found["names_holding"] = held_total

    # MPS counts its cached heaps in "other allocations": the process total is what hits the limit.
    sources = (fields.this_process, fields.allocated_by_torch, peak) if fields.backend == "mps" else (
        fields.allocated_by_torch, peak, fields.this_process)
    working = next((v for v in sources if v is not None), None)
    if request is not None and "request_exceeds_capacity" not in found:
        recoverable = sum(found.get(k, 0) for k in ("fragmentation", "other_processes", "names_holding"))
        kept = held_total if "names_holding" in found else 0
        too_large = free is not None and shortfall > recoverable
        if working is not None and capacity:
            room = capacity - found.get("other_processes", 0)
            too_large = too_large or max(0, working - kept) + request >= _TIGHT * room
        if too_large:
            found["too_large"] = max(0, (working or 0) - kept) + request

    causes = sorted(found, key=lambda c: (-found[c], _ORDER.index(c))) or ["unknown"]
    context = dict(fields=fields, capacity=capacity, limited=limited, peak=peak, held=held, found=found,
                   others_estimated=estimated, amp=amp, alloc_conf=alloc_conf,
                   batch=batch_var or "BATCH", accum=accum_var or "ACCUM", api=api)
    return Diagnosis(causes=causes, summary=_summary(causes, context), advice=_advice(causes, context),
                     holders=held)


def _others(fields: OomFields, capacity: int | None) -> tuple[int | None, bool]:
    """Bytes held outside this process, and whether that is an estimate.

    Messages before torch 2.1 do not say what this process holds: capacity - free - reserved is then
    everything outside PyTorch, this process's CUDA context included.
    """
    if fields.other_processes is not None:
        return fields.other_processes, False
    if fields.this_process is None and None not in (capacity, fields.free, fields.reserved_total):
        return max(0, capacity - fields.free - fields.reserved_total), True
    return None, False


# -- summary --------------------------------------------------------------------------------------

def _where(fields: OomFields) -> str:
    if fields.backend == "cpu":
        return "the CPU (main memory)"
    return fields.device or {"mps": "mps", "simulated": "the simulated device"}.get(fields.backend, "the GPU")


def _summary(causes: list[str], ctx: dict) -> str:
    f: OomFields = ctx["fields"]
    cap = ctx["capacity"]
    head = "Possibly out of memory" if f.possible else "Out of memory"
    first = f"{head} on {_where(f)}"
    if f.requested is not None:
        first += f": tried to allocate {format_bytes(f.requested)}"
        if ctx["limited"]:
            first += f", with {format_bytes(cap)} allowed to this process"
        elif f.free is not None and cap is not None:
            first += f" with {format_bytes(f.free)} free of {format_bytes(cap)}"
        elif cap is not None:
            first += f" on a device of {format_bytes(cap)}"
    phrases = [_phrase(c, ctx) for c in causes]
    second = phrases[0] if phrases[0].startswith("cu") else phrases[0][:1].upper() + phrases[0][1:]
    if len(phrases) > 1:
        second += "; also " + "; ".join(phrases[1:])
    return f"{first}. {second}."


def _phrase(cause: str, ctx: dict) -> str:
    f: OomFields = ctx["fields"]
    cap, found = ctx["capacity"], ctx["found"]
    if cause == "request_exceeds_capacity":
        whole = "all this process may use" if ctx["limited"] else "the whole device"
        return (f"a single allocation of {format_bytes(f.requested)} is larger than {whole} "
                f"({format_bytes(cap)}), so no clean-up can make it fit")
    if cause == "too_large":
        if f.backend == "mps" and f.this_process is not None:
            return (f"the working set is too large: this process held {format_bytes(f.this_process)} "
                    f"({format_bytes(f.allocated_by_torch)} of it in tensors) and needed "
                    f"{format_bytes(f.requested)} more")
        if f.allocated_by_torch is not None:
            return (f"the working set is too large: PyTorch held {format_bytes(f.allocated_by_torch)} and "
                    f"needed {format_bytes(f.requested)} more")
        if ctx["peak"] is not None:
            return (f"the working set is too large: the run peaked at {format_bytes(ctx['peak'])} and "
                    f"needed {format_bytes(f.requested)} more")
        return f"the cell needs more memory than the {format_bytes(cap)} it may use"
    if cause == "fragmentation":
        return (f"{format_bytes(f.reserved_unallocated)} was cached by PyTorch but unallocated, in pieces "
                "too small to use (fragmentation)")
    if cause == "other_processes":
        if ctx["others_estimated"]:
            return (f"{format_bytes(found[cause])} is used outside PyTorch (other processes, or libraries "
                    "in this one)")
        return f"other processes hold {format_bytes(found[cause])} of the device"
    if cause == "names_holding":
        top = ", ".join(f"{n} ({format_bytes(b)})" for n, b in ctx["held"][:3])
        more = f" and {len(ctx['held']) - 3} more" if len(ctx["held"]) > 3 else ""
        names = "names" if ctx.get("api") else "notebook names"
        return f"{names} keep {format_bytes(found[cause])} alive: {top}{more}"
    return _unknown_phrase(f)


def _unknown_phrase(f: OomFields) -> str:
    if f.backend == "cudnn":
        return ("torch raises cuDNN's CUDNN_STATUS_NOT_SUPPORTED when cuDNN cannot get workspace memory, "
                "but also for inputs cuDNN does not support")
    if f.backend == "cpu":
        return ("the operating system could not provide it; the message does not say how much memory "
                "was in use")
    if f.backend == "cublas":
        return "cuBLAS could not allocate its workspace: the device was already (nearly) full"
    if f.requested is not None and f.free is not None and f.free >= f.requested:
        return (f"the device reported {format_bytes(f.free)} free, more than requested: a per-process "
                "memory limit, or free memory the driver could not hand out in one piece")
    return "the message states no figures that explain it"


# -- advice ---------------------------------------------------------------------------------------

_PLAN = {
    "request_exceeds_capacity": ("split", "batch", "amp", "checkpoint"),
    "too_large": ("batch", "amp", "accumulate", "checkpoint", "freecuda"),
    "fragmentation": ("expandable", "freecuda", "batch"),
    "other_processes": ("processes",),
    "names_holding": ("detach", "cpu_metrics", "delete"),
    "unknown": ("contiguous", "freecuda", "batch", "amp"),
}
_TAIL = ("batch", "amp", "accumulate")


def _advice(causes: list[str], ctx: dict) -> list[Advice]:
    advice, done = [], set()
    for key in [k for c in causes for k in _PLAN[c]] + list(_TAIL):
        if key in done:
            continue
        done.add(key)
        item = _ADVICE[key](ctx)
        if item is not None:
            advice.append(item)
    return advice


def _variable(name: str) -> str | None:
    """The notebook variable a holder description starts with ('losses (list of ...)' -> 'losses')."""
    m = re.match(r"[A-Za-z_]\w*", name)
    if m is None or m.group(0).startswith("_") or m.group(0) in ("Out", "In"):
        return None
    return m.group(0)


def _with_graph(name: str) -> bool:
    return "grad_fn" in name or "graph" in name.lower()


def _container(name: str) -> str | None:
    m = re.search(r"\b(list|dict|tuple|deque|set) of\b", name)
    return m.group(1) if m else None


def _batch(ctx):
    if ctx["api"]:
        line = f"@oomguard(retry=\"{ctx['batch']}\", accumulate=\"{ctx['accum']}\")"
        return Advice(f"Use a smaller batch: `{line}` calls the function again with a smaller {ctx['batch']} "
                      f"until it fits and raises {ctx['accum']} so that the effective batch stays the same.", line)
    line = f"%%oomguard -r {ctx['batch']} -a {ctx['accum']}"
    return Advice(f"Use a smaller batch: `{line}` reruns the cell with a smaller {ctx['batch']} until it fits and raises "
                  f"{ctx['accum']} so that the effective batch stays the same.", line)


def _amp(ctx):
    if ctx["amp"]:
        return None
    f = ctx["fields"]
    device_type = {"cpu": "cpu", "simulated": "cpu", "mps": "mps", "xpu": "xpu"}.get(f.backend, "cuda")
    return Advice("Run in mixed precision: activations take half the memory. In plain code: "
                  f"`with torch.autocast('{device_type}', dtype=torch.bfloat16):` around the forward pass "
                  "and the loss.", "oomguard(amp=\"bf16\")" if ctx["api"] else "%%oomguard --amp bf16")


def _accumulate(ctx):
    return Advice(f"Keep the effective batch with gradient accumulation: run {ctx['accum']} smaller "
                  f"batches, scale each loss by 1/{ctx['accum']}, and step the optimizer once after "
                  "them.", f"(loss / {ctx['accum']}).backward()")


def _checkpoint(ctx):
    return Advice("Trade compute for memory with gradient checkpointing: activations of a block are "
                  "recomputed in the backward pass instead of kept.",
                  "y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)")


def _split(ctx):
    return Advice("Process the input in pieces: one operation alone needs more than the device has "
                  "(a smaller batch or sequence length, or a loop over chunks).",
                  "out = torch.cat([f(chunk) for chunk in x.split(CHUNK)])")


def _expandable(ctx):
    f, conf = ctx["fields"], ctx["alloc_conf"] or ""
    if f.backend not in ("cuda", "hip", "cublas") or expandable_segments_on(conf):
        return None
    if (conf_value(conf, "backend") or "native").lower() != "native":
        return None
    for_you = "" if ctx["api"] else " (%%oomguard can do it for you)"
    return Advice("Switch on expandable_segments so that PyTorch's cache can grow segments instead of "
                  f"leaving unusable pieces; this line keeps your other allocator settings{for_you}.",
                  expandable_segments_line(conf))


def _freecuda(ctx):
    if ctx["api"]:
        return Advice("Give back what the failed run and the cache hold.", "cuda_magic.release()")
    return Advice("Give back what the failed run and the cache hold (the kernel keeps running).",
                  "%freecuda")


def _processes(ctx):
    if ctx["fields"].backend not in _GPU_BACKENDS:
        return None
    return Advice("See which processes use the GPU and close those you do not need (another notebook's "
                  "kernel, a finished training run, a data-loader still holding the device).",
                  "nvidia-smi" if ctx["api"] else "%gpumem --processes")


def _holders_where(ctx, test):
    return [(n, v) for n, _ in ctx["held"] if test(n) and (v := _variable(n))]


def _detach(ctx):
    graphs = _holders_where(ctx, lambda n: _with_graph(n) and _container(n))
    if not graphs:
        return None
    name, var = graphs[0]
    code = (f"{var}.append(loss.item())  # not {var}.append(loss)" if _container(name) == "list"
            else "loss.item()  # keep this float, not the tensor")
    return Advice(f"`{var}` keeps the autograd graph of every step alive ({name}): log numbers with "
                  "`.item()`, or tensors with `.detach()`.", code)


def _cpu_metrics(ctx):
    kept = _holders_where(ctx, lambda n: _container(n) is not None)
    if not kept:
        return None
    # a container of graphs is the `.detach()` advice's; prefer one that only holds outputs
    name, var = next(((n, v) for n, v in kept if not _with_graph(n)), kept[0])
    code = (f"{var}.append(out.detach().cpu())" if _container(name) == "list" else "out.detach().cpu()")
    return Advice(f"Keep collected outputs and metrics on the CPU: `{var}` ({name}) holds them on the "
                  "device.", code)


def _delete(ctx):
    names = list(dict.fromkeys(v for _, v in _holders_where(ctx, lambda n: True)))
    if not names:
        return None
    joined = " ".join(names)
    verb = "holds" if len(names) == 1 else "hold"
    if ctx["api"]:
        return Advice(f"Free what {', '.join(f'`{n}`' for n in names)} {verb}: delete them, then release the "
                      "cache.", f"del {', '.join(names)}; cuda_magic.release()")
    return Advice(f"Free what {', '.join(f'`{n}`' for n in names)} {verb}: `del {', '.join(names)}` and "
                  f"then `%freecuda`, or in one step (`--offload` moves them to the CPU instead).",
                  f"%freecuda {joined}")


def _contiguous(ctx):
    if ctx["fields"].backend != "cudnn":
        return None
    return Advice("If it still fails at a small batch it is not memory: cuDNN does not support the input. "
                  "Make it contiguous, or switch cuDNN off for that call.", "x = x.contiguous()")


_ADVICE = {
    "batch": _batch, "amp": _amp, "accumulate": _accumulate, "checkpoint": _checkpoint, "split": _split,
    "expandable": _expandable, "freecuda": _freecuda, "processes": _processes, "detach": _detach,
    "cpu_metrics": _cpu_metrics, "delete": _delete, "contiguous": _contiguous,
}


# -- entry point ----------------------------------------------------------------------------------

def _fatal_diagnosis() -> Diagnosis:
    return Diagnosis(causes=["unknown"], summary=FATAL_NOTE, advice=[
        Advice("Restart the kernel, then run again with CUDA_LAUNCH_BLOCKING=1 set before torch starts, "
               "to see the operation that failed (often an index out of range).",
               "%env CUDA_LAUNCH_BLOCKING=1")])


def explain(exc_or_text, **kw) -> Diagnosis:
    """Diagnose an out-of-memory error: an exception (its cause/context chain is searched), the text of
    its message, or already parsed OomFields. Keywords go to `diagnose`.

    A fatal CUDA error (device-side assert, illegal memory access) gets a diagnosis saying it needs a
    kernel restart; an exception that is not an OOM at all gets one saying so.
    """
    if isinstance(exc_or_text, OomFields):
        return diagnose(exc_or_text, **kw)
    if isinstance(exc_or_text, BaseException):
        kind = oom_kind(exc_or_text)
        if kind == "fatal":
            return _fatal_diagnosis()
        fields = oom_fields(exc_or_text)
        if fields is None:
            return Diagnosis(causes=["unknown"], summary=(
                f"{type(exc_or_text).__name__} is not an out-of-memory error: there is no memory "
                "figure to explain."))
        return diagnose(fields, **kw)
    text = "" if exc_or_text is None else str(exc_or_text)
    if message_kind(text) == "fatal":
        return _fatal_diagnosis()
    return diagnose(parse_oom_message(text), **kw)
