"""Which notebook names hold device memory, and what deleting each would give back.

A model and its optimizer reach the same parameters; a list of logged losses reaches the graphs that
a list of predictions reaches too. So each name gets two figures: `bytes`, the storages only it reaches
(what `del name` frees), and `shared`, what it reaches together with other names. Each also gets a kind,
so that the diagnosis can tell what is expected (a model being trained, its optimizer) from what
surprises (graphs kept by logged losses, a second copy of a model, stale activations).

The notebook's holders (`notebook_holders`) are what the diagnosis reads at a failure; `%freecuda` lists
what still holds memory after its release in rows that add up (`held_rows`, `sharing_notes`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from cuda_magic.devices.probe import has_gpu, loaded_torch
from cuda_magic.devices.simulated import active_device
from cuda_magic.ipython import user_variables
from cuda_magic.memory.reach import device_storages, skipped


@dataclass(frozen=True)
class Holder:
    """A name that keeps device memory alive. Sizes in int bytes."""

    name: str
    bytes: int                            # what deleting this name alone gives back
    shared: int = 0                       # what it reaches together with other names
    kind: str = "tensor"                  # 'model', 'optimizer', 'graph', 'tensors', 'tensor', 'object'
    what: str = ""                        # 'list of 300 tensors with grad_fn', 'AdamW', ...
    training: bool = False                # a module an optimizer updates (or with gradients), an optimizer
    shared_with: tuple[str, ...] = ()
    reached: dict = field(default_factory=dict, repr=False, compare=False)   # storage id -> bytes

    @property
    def description(self) -> str:
        return f"{self.name} ({self.what})" if self.what else self.name


def _kind_and_what(value, torch) -> tuple[str, str]:
    cls = type(value)          # never isinstance: a dead weakref.proxy raises there (reach.skipped)
    if issubclass(cls, torch.nn.Module):
        return "model", cls.__name__
    if issubclass(cls, torch.optim.Optimizer):
        return "optimizer", cls.__name__
    if issubclass(cls, torch.Tensor):
        return ("graph", "tensor with grad_fn") if value.grad_fn is not None else ("tensor", "")
    if issubclass(cls, (list, tuple, dict, set)) or cls.__name__ == "deque":
        items = list(value.values()) if issubclass(cls, dict) else list(value)
        tensors = [v for v in items if issubclass(type(v), torch.Tensor)]
        if not tensors:
            return "tensors", ""
        graphs = sum(1 for t in tensors if t.grad_fn is not None)
        container = "dict" if issubclass(cls, dict) else cls.__name__
        with_graph = " with grad_fn" if graphs else ""
        scalar = " scalar" if all(t.dim() == 0 for t in tensors) else ""
        return ("graph" if graphs else "tensors"), f"{container} of {len(tensors)}{scalar} tensors{with_graph}"
    return "object", cls.__name__


def name_holders(variables: dict, storages_of=device_storages) -> list[Holder]:
    """Holders among `variables` (name -> value), the largest `bytes` first. `storages_of(value)`:
    {storage id: bytes} of the device memory a value reaches. A value that refuses to be looked at
    (a dead weakref.proxy, a raising `__getattr__`) is left out."""
    torch = loaded_torch()
    if torch is None:
        return []
    reached: dict[str, dict[int, int]] = {}
    for name, value in variables.items():
        if skipped(value):
            continue
        try:
            storages = storages_of(value)
        except Exception:  # noqa: BLE001 - a hostile object: it holds nothing we can name
            continue
        if storages:
            reached[name] = storages
    owners: dict[int, list[str]] = {}
    for name, storages in reached.items():
        for key in storages:
            owners.setdefault(key, []).append(name)
    trained = set()
    for value in variables.values():
        if issubclass(type(value), torch.optim.Optimizer):
            trained.update(id(p) for group in value.param_groups for p in group["params"])
    held = []
    for name, storages in reached.items():
        value = variables[name]
        own = sum(b for k, b in storages.items() if len(owners[k]) == 1)
        shared = sum(b for k, b in storages.items() if len(owners[k]) > 1)
        others = sorted({o for k in storages for o in owners[k] if o != name})
        try:
            kind, what = _kind_and_what(value, torch)
            training = kind == "optimizer" or (kind == "model" and any(
                id(p) in trained or p.grad is not None for p in value.parameters()))
        except Exception:  # noqa: BLE001 - it reached tensors, but will not say what it is
            kind, what, training = "object", type(value).__name__, False
        held.append(Holder(name, own, shared, kind, what, training, tuple(others), storages))
    held.sort(key=lambda h: (-h.bytes, -h.shared, h.name))
    return held


def union_bytes(holders, others=()) -> int:
    """What deleting all of `holders` together gives back: each storage they reach once (a pair of lists
    that keep the same graphs frees it only together), less what any of `others` still reaches (a
    logged loss's graph saved the model's weights: the model keeps them). Holders without their
    storages count their own bytes."""
    seen: dict[int, int] = {}
    alone = 0
    for h in holders:
        if h.reached:
            seen.update(h.reached)
        else:
            alone += h.bytes
    for h in others:
        for key in h.reached:
            seen.pop(key, None)
    return sum(seen.values()) + alone


# ---------------------------------------------------------------------------- the notebook's names

def held_storages(value) -> dict[int, int]:
    """{storage id: bytes} of the device memory `value` reaches. With a simulated device standing in for
    a GPU, only what it counts: a tensor offloaded off it no longer holds device memory."""
    storages = device_storages(value)
    sim = active_device()
    if sim is not None and storages and not has_gpu():
        storages = {k: b for k, b in storages.items() if sim.counts(k)}
    return storages


def holders_largest_first(shell, exclude=()) -> list[Holder]:
    """The user variables (but `exclude`) that reach device memory, as Holders, the largest first."""
    variables = {k: v for k, v in user_variables(shell).items() if k not in exclude}
    held = name_holders(variables, storages_of=held_storages)
    held.sort(key=lambda h: (-h.bytes, -h.shared, h.name))
    return held


def held_rows(holders) -> list[tuple[str, int]]:
    """What still holds device memory, in rows whose sizes add up to the union: each name with what deleting
    it alone gives back, and each group of names that reach the same memory ("model, opt": the parameters)
    with what only deleting all of them gives back. Largest first."""
    rows = [(h.name, h.bytes) for h in holders if h.bytes > 0]
    for group in sharing_groups(holders):
        members = [h for h in holders if h.name in group]
        together = union_bytes(members) - sum(h.bytes for h in members)
        if together > 0:
            rows.append((", ".join(sorted(group)), together))
    rows.sort(key=lambda row: (-row[1], row[0]))
    return rows


def sharing_groups(holders) -> list[set[str]]:
    """The names that reach the same device memory, grouped (what one shares with another, transitively)."""
    groups: list[set[str]] = []
    for h in holders:
        if not h.shared_with:
            continue
        linked = {h.name, *h.shared_with}
        touching = [g for g in groups if g & linked]
        for g in touching:
            linked |= g
            groups.remove(g)
        groups.append(linked)
    return groups


def sharing_notes(holders) -> list[str]:
    """One line per group of names that share device memory: deleting one of them alone gives none of it back."""
    return [f"{', '.join(sorted(g))} share memory: deleting one of them alone gives none of what they share back"
            for g in sharing_groups(holders)]


def notebook_holders(shell) -> list[Holder]:
    """The names holding device memory, as the diagnosis needs them: what deleting
    each gives back, what it shares with other names (a model and its optimizer share the parameters),
    and its kind (a model being trained and its optimizer are expected; logged graphs are not)."""
    return name_holders(user_variables(shell), storages_of=held_storages)
