"""Why memory ran out, and what to do about it: a diagnosis from the figures of an OOM message.

Pure: works on `OomFields` and plain (name, bytes) pairs, so it is tested on real message texts
without a GPU. `explain(exc_or_text)` is the public entry point (`cuda_magic.oom.diagnosis`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cuda_magic.memory.holders import Holder, union_bytes
from cuda_magic.oom.advice import HOLDER_SHARE, SHOWN, advise, expected, leaking, variable, with_graph  # noqa: F401
from cuda_magic.oom.cell_reading import CellReading
from cuda_magic.devices.errors import message_kind, oom_kind
from cuda_magic.oom.messages import FATAL_NOTE, oom_fields, parse_oom_message
from cuda_magic.oom.findings import Advice, Diagnosis, OomFields
from cuda_magic.units import format_bytes

CAUSE_LABELS = {
    "cap_below_held": "a cap below what the notebook already holds",
    "request_exceeds_capacity": "one allocation larger than the device",
    "graphs_in_evaluation": "autograd graphs kept by a pass that only evaluates",
    "too_large": "working set too large for the device",
    "fragmentation": "fragmentation of PyTorch's cache",
    "other_processes": "memory held by other processes",
    "names_holding": "tensors kept alive by notebook names",
    "free_reported": "the device reported enough free memory",
    "unknown": "no clear cause in the figures",
}
_ORDER = tuple(CAUSE_LABELS)          # breaks ties between causes that explain as many bytes

_SHARE = 0.10                         # a part above this share of the device is significant
_MINOR_SHARE = 0.02                   # below this share, "other processes" is driver rounding and noise
_FRAGMENT_FLOOR = 2 * 1024**2         # small blocks live in 2 MiB segments: cached bytes below are noise
_CONTEXT_ALLOWANCE = 1024**3          # old messages lump the CUDA context in with other processes
_TIGHT = 0.90                         # a working set above this share of what is left cannot grow


@dataclass(frozen=True)
class CellFacts:
    """What the caller knows of the run that ran out, besides the figures of its message.

    holders: the names that still hold device memory: `memory.holders.Holder` records (what deleting each
    name gives back, its kind) or (description, bytes) pairs. amp: the cell already ran under autocast.
    device_capacity: used where the message states none. peak: the exact peak of the failed run, used
    where the message states no allocation figures. alloc_conf: the allocator settings in force (kept in
    the expandable_segments line). limit: a cap on what the cell may use (`-l`), which counts as the
    capacity. batch_var / accum_var: the names for the `%%oomguard -r BATCH -a ACCUM` line. api: the run
    was guarded by the Python API, so the advice speaks of it (`oomguard(retry=...)`, `release()`).
    inference: no autograd graph was being built (no_grad, inference_mode, generate): advice about
    sequences and caches, not training. retried: a smaller batch already fitted (no "use a smaller
    batch"). top_line: (bytes, code, where) of the line that held the most at the failure (the black box),
    cited in the summary.
    """

    holders: tuple = ()
    amp: bool = False
    device_capacity: int | None = None
    peak: int | None = None
    alloc_conf: str = ""
    limit: int | None = None
    batch_var: str | None = None
    accum_var: str | None = None
    api: bool = False
    inference: bool = False
    retried: bool = False
    top_line: tuple[int, str, str] | None = None
    cell: CellReading = CellReading()     # what the failing cell's source (and its functions) already does
    in_use: frozenset = frozenset()       # names the failing cell uses: never advised to delete
    own: frozenset = frozenset()          # names the failing run bound itself: its working set, never a leak
    grown: frozenset | None = None        # containers that grew during the run; None: not known
    by_kind: dict = field(default_factory=dict)   # memory.kinds: the device's tensors by kind at the failure
    held_at_start: int | None = None      # allocated when the run began (a -l cap counts it too)
    independent: bool = False             # the retry found that the memory does not depend on batch_var
    backward: bool = False                # it ran out in the backward pass
    tensor_requested: int | None = None   # the failing tensor's own request, where the message states the
                                          # segment the allocator tried to reserve for it (`tensor_request`)


@dataclass(frozen=True)
class Context:
    """What the summary and every advice function read: the message's figures, the caller's facts, and
    what the diagnosis found in them."""

    fields: OomFields
    facts: CellFacts
    capacity: int | None                  # the smallest of the device's capacity, an "allowed" cap, -l
    limited: bool                         # that capacity is a cap, not the device's
    held: tuple[Holder, ...]              # the holders worth naming, largest first
    found: dict[str, int]                 # cause -> the bytes it explains
    others_estimated: bool                # "other processes" is an estimate (old messages)
    causes: tuple[str, ...] = ()          # ranked

    # the caller's facts, read the same way
    amp = property(lambda self: self.facts.amp)
    peak = property(lambda self: self.facts.peak)
    alloc_conf = property(lambda self: self.facts.alloc_conf)
    api = property(lambda self: self.facts.api)
    inference = property(lambda self: self.facts.inference)
    retried = property(lambda self: self.facts.retried)
    top_line = property(lambda self: self.facts.top_line)
    batch = property(lambda self: self.facts.batch_var or "BATCH")

    @property
    def evaluating(self) -> bool:
        """The failing code only evaluates: a forward pass recording graphs, no backward pass and no
        step in its source or on its stack (a message alone, with no source, says nothing of it)."""
        cell = self.facts.cell
        return "graphs_in_evaluation" in self.found or (
            bool(cell.names) and cell.evaluates and not self.facts.backward and not cell.generates)
    accum = property(lambda self: self.facts.accum_var or "ACCUM")


def diagnose(fields: OomFields, facts: CellFacts | None = None, **known) -> Diagnosis:
    """Causes of the OOM `fields` describes, ranked by the bytes each explains, and advice for them.
    `facts` (or its fields as keywords) says what is known of the run besides the message."""
    if facts is None:
        facts = CellFacts(**{k: tuple(v) if k == "holders" else v for k, v in known.items()})
    elif known:
        raise TypeError("diagnose() takes facts= or its fields as keywords, not both")
    holders, limit, peak = facts.holders, facts.limit, facts.peak
    device_capacity = facts.device_capacity
    device_cap = fields.capacity if fields.capacity is not None else device_capacity
    caps = [c for c in (device_cap, fields.allowed, limit) if c is not None]
    capacity = min(caps) if caps else None
    limited = capacity is not None and capacity != device_cap
    request, free = fields.requested, fields.free
    shortfall = max(0, request - free) if request is not None and free is not None else request
    held = _listed(holders, shortfall, facts)
    listed = {id(h) for h in held}
    held_total = union_bytes(held, [h for h in map(_as_holder, holders) if id(h) not in listed])
    # Plenty free and still out of memory: a limit or the driver, not what holds memory here. (A few
    # MiB free on a full device is no room: the allocator asks the driver for whole segments.)
    plenty_free = (shortfall == 0 and free is not None and capacity is not None
                   and free > _SHARE * capacity and not limited)

    found: dict[str, int] = {}
    held_at_start = facts.held_at_start
    if limit is not None and held_at_start and held_at_start >= limit:
        found["cap_below_held"] = held_at_start
    elif request is not None and capacity and request > capacity:
        found["request_exceeds_capacity"] = request
    activations = facts.by_kind.get("activations", 0)
    kinds_total = sum(facts.by_kind.values())
    if (not facts.inference and facts.cell.evaluates and not facts.backward and kinds_total
            and activations >= 0.5 * kinds_total):
        found["graphs_in_evaluation"] = activations

    # With plenty reported free, what holds memory here is no cause; memory held outside PyTorch and
    # fragmentation still are where they exceed what was free beyond the request (the free figure may
    # be stale), and they come before "the device reported enough free".
    slack = (free - request) if plenty_free else 0
    cached = fields.reserved_unallocated or 0
    if cached > slack and (
            (request is not None and cached >= request and cached >= _FRAGMENT_FLOOR)
            or (capacity and cached > _SHARE * capacity)):
        found["fragmentation"] = cached

    others, estimated = _others(fields, device_cap)
    if others and others > slack and capacity:
        if estimated:
            significant = others > max(_SHARE * capacity, _CONTEXT_ALLOWANCE)
        else:
            significant = others > _SHARE * capacity or (
                request is not None and others > request and others > _MINOR_SHARE * capacity)
        if significant:
            found["other_processes"] = others

    if held_total and not plenty_free and (
            request is None or (shortfall and held_total >= shortfall)
            or (capacity and held_total > HOLDER_SHARE * capacity)):
        found["names_holding"] = held_total

    # MPS counts its cached heaps in "other allocations": the process total is what hits the limit.
    sources = (fields.this_process, fields.allocated_by_torch, peak) if fields.backend == "mps" else (
        fields.allocated_by_torch, peak, fields.this_process)
    working = next((v for v in sources if v is not None), None)
    if request is not None and not {"request_exceeds_capacity", "cap_below_held"} & set(found):
        recoverable = sum(found.get(k, 0) for k in ("fragmentation", "other_processes", "names_holding"))
        kept = held_total if "names_holding" in found else 0
        too_large = free is not None and shortfall > recoverable
        if working is not None and capacity:
            too_large = too_large or max(0, working - kept) + request >= _TIGHT * _room(fields, capacity, found)
        # the cache stood in the way of a step still building its forward graph: what it needs at its peak
        # is more than it held, so the working set is named too (and the batch advised first)
        too_large = too_large or (working is not None and "fragmentation" in found and _building_forward(facts))
        if too_large:
            found["too_large"] = max(0, (working or 0) - kept) + request

    causes = sorted(found, key=lambda c: (-found[c], _ORDER.index(c)))
    leak = "names_holding" in found and any(leaking(h, shortfall, capacity) for h in held)
    if leak:                      # the classic leak (graphs kept by logged losses) comes first
        causes.remove("names_holding")
        causes.insert(0, "names_holding")
    elif ("fragmentation" in found and request is not None and cached >= request
          and (free is None or free < request) and _tensors_alone_fit(fields, facts, capacity, found, working)):
        causes.remove("fragmentation")        # the cache alone could have served the request
        causes.insert(0, "fragmentation")
    if plenty_free:
        causes.append("free_reported")
    # what no clean-up changes, then a pass that should not record graphs at all, come first
    for first in ("graphs_in_evaluation", "request_exceeds_capacity", "cap_below_held"):
        if first in causes:
            causes.remove(first)
            causes.insert(0, first)
    causes = causes or ["unknown"]
    ctx = Context(fields, facts, capacity, limited, tuple(held), found, estimated, tuple(causes))
    summary, cause = _summary(ctx)
    return Diagnosis(causes=causes, summary=summary, advice=advise(ctx), holders=held, cause=cause)


_SEGMENTED = ("cuda", "hip", "simulated")   # allocators whose message states the segment, not the tensor


def tensor_request(fields: OomFields | None, recorded: int | None) -> int | None:
    """The failing tensor's own request, where the black box `recorded` it and the message states instead
    the segment torch's caching allocator tried to reserve for it (20 MiB for a 5.38 MiB tensor); None
    where they are the same, or not the same failure."""
    from cuda_magic.devices.caching_allocator import segment_asked

    if fields is None or fields.requested is None or recorded is None or fields.backend not in _SEGMENTED:
        return None
    if recorded == fields.requested:
        return None
    # the message's figure has two decimals of its unit
    if abs(segment_asked(recorded) - fields.requested) <= max(10 * 1024, fields.requested // 1000):
        return recorded
    return None


def outside_torch(fields: OomFields) -> int | None:
    """What this process holds on the device outside PyTorch's cache (its CUDA context, cuBLAS and cuDNN
    workspaces, another library's memory), where the message states this process's total (torch 2.1+)."""
    if fields.backend == "mps" or None in (fields.this_process, fields.reserved_total):
        return None
    return max(0, fields.this_process - fields.reserved_total)


def _room(fields: OomFields, capacity: int, found: dict[str, int]) -> int:
    """What PyTorch's tensors can have of the capacity: less what other processes and this process outside
    PyTorch hold."""
    return capacity - found.get("other_processes", 0) - (outside_torch(fields) or 0)


def _tensors_alone_fit(fields: OomFields, facts: CellFacts, capacity, found, working) -> bool:
    """Whether the tensors alone (without the unusable cache) would have had room for the request, at the
    point where the step's memory stops growing: never said of a training step that failed while its forward
    pass was still building the graph it will go back through (the graph's activations hold most of the
    tensors, and it has not run backward): that step needs more than it held at the failure, and a batch
    several times too large fails there first."""
    if _building_forward(facts):
        return False
    if working is None or not capacity or fields.requested is None:
        return True
    return working + fields.requested <= _room(fields, capacity, found)


def _building_forward(facts: CellFacts) -> bool:
    """A training step that failed in its forward pass: the cell goes backward, it had not, and the graph's
    activations held most of the tensors at the failure."""
    kinds = sum(facts.by_kind.values())
    return bool(facts.cell.backward and not facts.backward and not facts.inference and kinds
                and facts.by_kind.get("activations", 0) >= 0.5 * kinds)


def _as_holder(h) -> Holder:
    if isinstance(h, Holder):
        return h
    name, nbytes = h
    name = str(name)
    return Holder(name, int(nbytes or 0), kind="graph" if with_graph(name) else "tensor")


def _listed(holders, shortfall: int | None, facts: CellFacts) -> list[Holder]:
    """The holders worth naming, largest first: what the cell needs (`_expected`) only where deleting
    it alone would make the request fit, and never a module or optimizer the cell uses."""
    out = []
    for h in map(_as_holder, holders):
        if h.name in facts.own:
            continue   # `out = model(x)` bound by the failing step: what it still needs, in its working set
        if h.bytes <= 0 and not (h.kind == "graph" and h.shared > 0):
            continue   # nothing of its own: unless it keeps graphs that other names keep too (logged losses
                       # and collected outputs of the same steps), which go only when all of them go
        if expected(h, facts):
            in_use_model = h.kind in ("model", "optimizer") and h.name in facts.in_use
            if in_use_model or not (shortfall and h.bytes >= shortfall):
                continue
        out.append(h)
    return sorted(out, key=lambda h: -h.bytes)


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


def _summary(ctx: Context) -> tuple[str, str]:
    """The summary (the figures, then every cause) and the first cause alone, as one sentence."""
    f: OomFields = ctx.fields
    cap = ctx.capacity
    head = "Possibly out of memory" if f.possible else "Out of memory"
    first = f"{head} on {_where(f)}"
    if f.requested is not None:
        tensor = ctx.facts.tensor_requested
        first += (f": tried to allocate {format_bytes(tensor)} (a {format_bytes(f.requested)} segment)" if tensor
                  else f": tried to allocate {format_bytes(f.requested)}")
        if ctx.limited:
            first += f", with {format_bytes(cap)} allowed to this process"
        elif f.free is not None and cap is not None:
            first += f" with {format_bytes(f.free)} free of {format_bytes(cap)}"
        elif cap is not None:
            first += f" on a device of {format_bytes(cap)}"
    phrases = [_phrase(c, ctx) for c in ctx.causes]
    top = ctx.top_line
    if top is not None:              # the black box: the line that held the most at the failure
        nbytes, code, where = top
        phrases[0] += f"; {format_bytes(nbytes)} was alive from `{code}` at {where}"
    second = phrases[0] if phrases[0].startswith("cu") else phrases[0][:1].upper() + phrases[0][1:]
    unnamed = _parts_unnamed(ctx, ctx.causes[:1])
    cause = second + (f"; {_parts_phrase(ctx, unnamed)}" if unnamed else "")
    if len(phrases) > 1:
        second += "; also " + "; ".join(phrases[1:])
    rest = _parts_unnamed(ctx, ctx.causes)
    if rest:
        second += f"; {_parts_phrase(ctx, rest)}"
    if ctx.facts.independent:
        what = (f"`{top[1]}` at {top[2]} ({format_bytes(top[0])})" if top is not None
                else "what the figures above name")
        second = (f"The cell's memory does not depend on {ctx.batch}: it failed on the same request at every "
                  f"value, and what fills the device is {what}. {second}")
        cause = second
    return f"{first}. {second}.", f"{cause}."


def _parts(ctx: Context) -> dict[str, int]:
    """What holds the device, by part, in bytes, where the message says: 'tensors' (PyTorch's tensors),
    'cache' (cached by PyTorch but unallocated), 'outside' (this process outside PyTorch), 'others' (other
    processes; for messages before torch 2.1, everything outside PyTorch)."""
    f = ctx.fields
    parts = {"tensors": f.allocated_by_torch, "cache": f.reserved_unallocated, "outside": outside_torch(f)}
    others, _ = _others(f, ctx.capacity if not ctx.limited else None)
    parts["others"] = others
    return {k: v for k, v in parts.items() if v}


# which parts a cause's phrase already names
_NAMES = {"too_large": ("tensors",), "fragmentation": ("cache",), "other_processes": ("others",),
          "names_holding": ("tensors",), "graphs_in_evaluation": ("tensors",)}


def _parts_unnamed(ctx: Context, causes) -> list[tuple[str, int]]:
    """The parts holding a material share of the device (a significant share of it, or enough that freeing
    them alone would make the request fit) that the phrases of `causes` do not name, largest first."""
    f, cap = ctx.fields, ctx.capacity or ctx.fields.this_process
    if not cap or "request_exceeds_capacity" in causes or "cap_below_held" in causes:
        return []
    shortfall = max(0, f.requested - f.free) if f.requested is not None and f.free is not None else None
    named = {p for c in causes for p in _NAMES.get(c, ())}
    if ctx.found.get("too_large") and "too_large" in causes and f.allocated_by_torch is None:
        named.add("tensors")
    out = [(k, v) for k, v in _parts(ctx).items() if k not in named
           and (v >= _SHARE * cap or (k != "tensors" and shortfall and v >= shortfall))]
    return sorted(out, key=lambda kv: -kv[1])


def _parts_phrase(ctx: Context, parts) -> str:
    words = {"tensors": "{} is in PyTorch's tensors",
             "cache": "{} is cached by PyTorch but unallocated",
             "outside": "{} is held by this process outside PyTorch (its CUDA context, cuBLAS/cuDNN workspaces, "
                        "other libraries)",
             "others": ("{} is used outside PyTorch (other processes, or libraries in this one)"
                        if ctx.others_estimated else "{} is held by other processes")}
    listed = [words[k].format(format_bytes(v)) for k, v in parts]
    joined = listed[0] if len(listed) == 1 else ", ".join(listed[:-1]) + " and " + listed[-1]
    if ctx.capacity:
        return f"of the {format_bytes(ctx.capacity)}, {joined}"
    return f"of the {format_bytes(ctx.fields.this_process)} this process holds, {joined}"


def _phrase(cause: str, ctx: Context) -> str:
    f: OomFields = ctx.fields
    cap, found = ctx.capacity, ctx.found
    if cause == "cap_below_held":
        return (f"the cap of {format_bytes(ctx.facts.limit)} is below what the notebook already held when the cell started "
                f"({format_bytes(found[cause])}), so the cell could allocate nothing new")
    if cause == "graphs_in_evaluation":
        total = sum(ctx.facts.by_kind.values())
        return (f"the cell only evaluates (it runs no backward pass), yet autograd keeps each forward pass's "
                f"activations for one: {format_bytes(found[cause])} of the {format_bytes(total)} at the failure")
    if cause == "request_exceeds_capacity":
        whole = "all this process may use" if ctx.limited else "the whole device"
        return (f"a single allocation of {format_bytes(f.requested)} is larger than {whole} "
                f"({format_bytes(cap)}), so no clean-up can make it fit")
    if cause == "too_large":
        if f.backend == "mps" and f.this_process is not None:
            return (f"the working set is too large: this process held {format_bytes(f.this_process)} "
                    f"({format_bytes(f.allocated_by_torch)} of it in tensors) and needed "
                    f"{format_bytes(f.requested)} more")
        tensor = ctx.facts.tensor_requested
        more = (f"{format_bytes(tensor)} more (a {format_bytes(f.requested)} segment)" if tensor
                else f"{format_bytes(f.requested)} more")
        if f.allocated_by_torch is not None:
            return (f"the working set is too large: PyTorch held {format_bytes(f.allocated_by_torch)} and "
                    f"needed {more}")
        if ctx.peak is not None:
            return f"the working set is too large: the run peaked at {format_bytes(ctx.peak)} and needed {more}"
        return f"the cell needs more memory than the {format_bytes(cap)} it may use"
    if cause == "fragmentation":
        return (f"{format_bytes(f.reserved_unallocated)} was cached by PyTorch but unallocated, in pieces "
                "too small to use (fragmentation)")
    if cause == "other_processes":
        if ctx.others_estimated:
            return (f"{format_bytes(found[cause])} is used outside PyTorch (other processes, or libraries "
                    "in this one)")
        return f"other processes hold {format_bytes(found[cause])} of the device"
    if cause == "free_reported":
        return _free_phrase(f)
    if cause == "names_holding":
        # the name alone where it is one: what it is comes with the names listed below the summary
        top = ", ".join(f"{variable(h.name) or h.description} ({format_bytes(h.bytes)})" for h in ctx.held[:3])
        more = f" and {len(ctx.held) - 3} more" if len(ctx.held) > 3 else ""
        names = "names" if ctx.api else "notebook names"
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
        return _free_phrase(f)
    return "the message states no figures that explain it"


def _free_phrase(f: OomFields) -> str:
    return (f"the device reported {format_bytes(f.free)} free, more than requested: likely a per-process "
            "memory fraction (torch.cuda.set_per_process_memory_fraction), or another process allocating "
            "at the same moment")


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
    if not isinstance(exc_or_text, str):
        raise TypeError("explain() takes an exception, the text of its message or OomFields, not "
                        f"{type(exc_or_text).__name__}")
    text = exc_or_text
    kind = message_kind(text)
    if kind == "fatal":
        return _fatal_diagnosis()
    fields = parse_oom_message(text)
    if kind is None and all(getattr(fields, f) is None for f in _FIGURES):
        return Diagnosis(causes=["unknown"], summary=(
            "This text is not an out-of-memory message and states no memory figure to explain: pass the "
            "error itself, or its whole message (\"CUDA out of memory. Tried to allocate ...\")."))
    return diagnose(fields, **kw)


_FIGURES = ("requested", "capacity", "free", "this_process", "allocated_by_torch", "reserved_unallocated",
            "reserved_total")
