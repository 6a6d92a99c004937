"""Memory by kind: each live storage classed once as a parameter, a gradient, optimizer state, an
activation kept by an autograd graph, or another tensor, from what reaches it.

A storage reached in several ways takes the first kind of KINDS that reaches it (a parameter's storage
saved by a graph for backward is a parameter). A module's buffer (BatchNorm's running statistics) is
model state, not an activation, even when a graph saved it: it counts as other, ahead of activations.
The census (census.py) calls `KindMarker` with what its one gc pass found; `bytes_by_kind` adds the
classed storages up per device. No torch import here.
"""
from __future__ import annotations

from cuda_magic.devices.probe import real_storage

#: The kinds, strongest first: a storage reached as several kinds is the first of them.
KINDS = ("parameters", "gradients", "optimizer_state", "activations", "other")
#: What PyTorch's allocator holds that the census did not find as a storage (allocator rounding,
#: buffers held only by C++): the rest of the device's allocated bytes, where there is a rest.
UNSEEN = "unseen"
#: At an out-of-memory error: what the failing operation held when it ran out and let go of as the error
#: unwound (its intermediate results, which no Python object names): the figure the message states
#: less what was allocated once the error reached the guard.
IN_FAILING_OP = "in_failing_op"
KIND_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations kept by graphs",
    "other": "other tensors",
    UNSEEN: "not seen by the census",
    IN_FAILING_OP: "held by the failing operation",
}
#: The ranks, strongest first: KINDS with module buffers (shown as 'other') placed before activations.
_RANKED = ("parameters", "gradients", "optimizer_state", "other", "activations", "other")
_RANK = {"parameters": 0, "gradients": 1, "optimizer_state": 2, "buffers": 3, "activations": 4, "other": 5}
_OTHER = _RANK["other"]
MAX_GRAPH_NODES = 50_000    # autograd nodes visited, all graphs together, to find the activations they keep


class KindMarker:
    """Classes storages by what reaches them. `records` maps storage keys to TensorRecords; a storage that
    only a gradient, an optimizer or a graph holds (no Python object for the gc pass to find) gets a record
    from `new_record(tensor, storage)`."""

    def __init__(self, torch, records: dict, new_record, saved_attrs):
        self.torch = torch
        self.records = records
        self.new_record = new_record
        self.saved_attrs = saved_attrs
        self.ranks: dict[int, int] = {}
        self.graph_nodes = 0
        self._graph_seen: set[int] = set()
        # The nodes walked, kept while the walk lasts: torch before 2.3 makes a new Python object for a node
        # on each access and drops it at once, so an id() alone could be reused by the next node.
        self._graph_held: list = []
        self.truncated = False

    def _mark(self, t, kind: int) -> None:
        try:
            if t.layout != self.torch.strided:
                return
        except (RuntimeError, NotImplementedError, TypeError):
            return
        storage = real_storage(t)        # fake, meta and wrapper tensors hold nothing of their own
        if storage is None:
            return
        key = storage._cdata
        if key not in self.records:
            self.records[key] = self.new_record(t, storage)
        if kind < self.ranks.get(key, _OTHER + 1):
            self.ranks[key] = kind

    def parameter(self, key: int) -> None:
        """A storage the gc pass found under an nn.Parameter."""
        self.ranks[key] = 0

    def leaf(self, t) -> None:
        """A leaf tensor that requires grad: its `.grad` is a gradient."""
        grad = t.grad
        if grad is not None:
            self._mark(grad, _RANK["gradients"])

    def module(self, mod) -> None:
        """A module: its buffers are model state."""
        rank = _RANK["buffers"]
        for b in list(mod._buffers.values()):
            if b is not None:
                self._mark(b, rank)

    def optimizer(self, opt) -> None:
        rank = _RANK["optimizer_state"]
        ttype = self.torch.Tensor
        for state in list(opt.state.values()):
            if not isinstance(state, dict):
                continue
            for value in list(state.values()):
                for v in (value if isinstance(value, (list, tuple)) else (value,)):
                    if issubclass(type(v), ttype):
                        self._mark(v, rank)

    def graphs(self, roots) -> None:
        """The tensors the graphs under `roots` (grad_fn nodes) saved for backward: activations."""
        try:
            self._walk_graphs(roots)
        finally:
            self._graph_held.clear()      # the walk is over: hold no node (nor what it saved)

    def _walk_graphs(self, roots) -> None:
        rank = _RANK["activations"]
        ttype = self.torch.Tensor
        stack = list(roots)
        while stack:
            node = stack.pop()
            if node is None or id(node) in self._graph_seen:
                continue
            if self.graph_nodes >= MAX_GRAPH_NODES:
                self.truncated = True
                return
            self._graph_seen.add(id(node))
            self._graph_held.append(node)
            self.graph_nodes += 1
            for attr in self.saved_attrs(type(node)):
                try:
                    saved = getattr(node, attr)
                except (RuntimeError, AttributeError):   # freed by backward()
                    continue
                for t in (saved if isinstance(saved, (tuple, list)) else (saved,)):
                    if issubclass(type(t), ttype):
                        self._mark(t, rank)
            stack.extend(fn for fn, _ in getattr(node, "next_functions", ()))

    def carries_graph(self, key: int) -> None:
        """A storage under a tensor with a grad_fn (an output of the graph, such as a kept loss)."""
        rank = _RANK["activations"]
        if rank < self.ranks.get(key, _OTHER + 1):
            self.ranks[key] = rank

    def apply(self) -> None:
        """Write each record's kind."""
        for key, rank in self.ranks.items():
            rec = self.records.get(key)
            if rec is not None:
                rec.kind = _RANKED[rank]


def device_of_record(tensor_device: str) -> str:
    """The device key ('cuda:0', 'mps', 'cpu') of a tensor's device text ('cuda:0', 'mps:0', 'cpu')."""
    kind, _, index = tensor_device.partition(":")
    if kind in ("cpu", "mps"):
        return kind
    return f"{kind}:{index or 0}"


def bytes_by_kind(records, allocated: dict[str, int | None], simulated=None) -> dict[str, dict[str, int]]:
    """{device key: {kind: bytes}} for the devices keyed in `allocated` (device key -> PyTorch's allocated
    bytes there, None where unknown): each storage once per device, every kind present (0 where none), and
    UNSEEN where the allocated bytes exceed what was found.

    `simulated`: a SimulatedDevice, whose key counts the storages it tracks (CPU storages, which the CPU's
    key counts too). It knows what each storage holds there (its caching allocator's block): its UNSEEN is
    the blocks of the storages the census did not find, not the rounding of those it found, so that its
    split is the CPU's where they are the same storages.
    """
    out = {key: dict.fromkeys(KINDS, 0) for key in allocated}
    sim_key = simulated.key if simulated is not None else None
    sim_found = 0
    keys: dict[str, str] = {}       # tensor device text -> device key, worked out once per device
    for rec in records:
        key = keys.get(rec.device)
        if key is None:
            key = keys[rec.device] = device_of_record(rec.device)
        if key in out:
            out[key][rec.kind] += rec.nbytes
        if sim_key in out and simulated.counts(rec.storage_id):
            out[sim_key][rec.kind] += rec.nbytes
            sim_found += simulated.counted(rec.storage_id)
    for key, total in allocated.items():
        found = sim_found if key == sim_key else sum(out[key].values())
        if total is not None and total > found:
            out[key][UNSEEN] = total - found
    return out
