"""Whether a measured allocation timeline fits on a device's caching allocator at another size.

The retry's prediction from a model measured on two slices of the failing batch (recover/replay.py) adds
bytes: what the pass allocated at its peak, per row and fixed. On a GPU, and on the simulated device that
reserves as one (devices/caching_allocator.py), bytes are not the whole story: a request takes a rounded
block of a 2 MiB or 20 MiB segment (or a segment of its own, rounded to 2 MiB), freed blocks stay cached,
and a request fails when no cached block fits and no new segment can be reserved, with memory reserved
but unallocated. On the small devices a lab uses (tens of MiB) that costs up to a third of the capacity.

So the allocations and frees of each measured pass are recorded in order (`Timeline`, a recorder of the
simulated device, devices/recorder.py's interface), the two slices' timelines are matched event for event
into lines in the rows (`timeline_lines`), and `replay_fits` replays them at a candidate number of rows
through a copy of the device's allocator as it is now (its cache and its holes), after the blocks the cell
holds besides the pass (the batch, the optimizer's state): a request it could not reserve means the
candidate would not fit there, whatever the bytes add up to. Pure Python, no torch import.
"""
from __future__ import annotations

ALLOC, FREE = "alloc", "free"


class Timeline:
    """A recorder (devices/recorder.py's interface) of one pass on a simulated device: (ALLOC, bytes asked)
    and (FREE, index of the ALLOC event it gives back), in order. Storages made before the pass and freed
    in it are left out (the copy of the allocator replayed later may not hold them)."""

    def __init__(self, device):
        self.device = device
        self.events: list[tuple[str, int]] = []
        self._index: dict[int, int] = {}          # storage key -> its ALLOC event
        self.gradients: set[int] = set()          # the ALLOC events of what became the parameters' gradients
        self.backward_at: int | None = None       # the first event of the backward pass

    def seed(self, live, allocated=None) -> None:
        return None

    def alloc(self, key: int, nbytes: int, allocated: int, *_, **__) -> None:
        self._index[key] = len(self.events)
        self.events.append((ALLOC, self.device.requested_bytes(key, nbytes)))

    def free(self, key: int, allocated: int, *_, **__) -> None:
        i = self._index.pop(key, None)
        if i is not None:
            self.events.append((FREE, i))

    def resize(self, key: int, nbytes: int, allocated: int, *_, **__) -> None:
        """Resized in place: a new block, then the old one given back (as the simulated device does)."""
        old = self._index.get(key)
        self.alloc(key, nbytes, allocated)
        if old is not None:
            self.events.append((FREE, old))

    def oom(self, *_, **__) -> None:
        return None

    def mark_backward(self) -> None:
        """The backward pass starts now."""
        self.backward_at = len(self.events)

    def mark_gradients(self, keys) -> None:
        """The storages under the parameters' gradients at the end of the pass (storage keys)."""
        self.gradients.update(self._index[k] for k in keys if k in self._index)


def timeline_lines(small: Timeline, large: Timeline, rows: int) -> tuple | None:
    """The timelines of passes on `rows` and `2 * rows` rows, event for event: (ALLOC, fixed, per_row,
    gradient?) for each allocation (its bytes a line in the rows) and (FREE, index); None where the two
    passes did not make the same sequence of allocations and frees (then they cannot be told apart by
    rows)."""
    if (len(small.events) != len(large.events) or small.gradients != large.gradients
            or small.backward_at != large.backward_at or rows <= 0):
        return None
    out = []
    for i, ((kind, a), (other, b)) in enumerate(zip(small.events, large.events)):
        if kind != other:
            return None
        if kind == FREE:
            if a != b:
                return None
            out.append((FREE, a))
        else:
            per_row = (b - a) / rows
            out.append((ALLOC, a - per_row * rows, per_row, i in small.gradients))
    return tuple(out)


def replay_fits(model, lines: tuple, rows: float, *, before=(), grads=(), kept: bool = False,
                backward_at: int | None = None, state_after=(), carried: bool = True) -> bool:
    """Whether the allocator `model` (a copy: it is used up) can serve `before` (bytes of blocks taken
    first and held: what the cell holds besides the pass), `grads` (the gradients' bytes, there before the
    pass) and then the timeline `lines` at `rows` rows (`timeline_lines`) without failing to reserve
    memory. `kept`: the gradients stay through the pass, each one it computes accumulated into them and
    given back at once; else they are set to None when the backward pass starts (event `backward_at`)
    and the pass makes its own.

    `state_after`: the bytes of each buffer of the optimizer's state that the cell's first step makes
    after its pass: the timeline is then replayed as the cell's first two steps, that state taken between
    them where the allocator finds room then (in the cache the first pass's activations left, as on a GPU:
    a 64 MiB buffer split off a 392 MiB block leaves a hole that the next 392 MiB request cannot use), and
    the second pass with the gradients the first made held through its forward where `carried` (the cell
    zeroes them after its forward, or accumulates them: `kept`), else given back before it."""
    from cuda_magic.devices.caching_allocator import CannotReserve

    try:
        for nbytes in before:
            model.malloc(int(nbytes))
        held = [model.malloc(int(nbytes)) for nbytes in grads]
        held = _replay_pass(model, lines, rows, held, kept, backward_at)
        if state_after:
            for nbytes in state_after:
                model.malloc(int(nbytes))
            if not (carried or kept):
                for block in held:
                    model.free(block)
                held = []
            _replay_pass(model, lines, rows, held, kept, backward_at)
    except CannotReserve:
        return False
    return True


def _replay_pass(model, lines: tuple, rows: float, held: list, kept: bool, backward_at: int | None) -> list:
    """One pass of `replay_fits`, with `held` (gradient blocks there before it); the gradient blocks there
    after it: `held` where they are kept (each gradient computed accumulated into them), else those the
    pass made."""
    taken: dict[int, object] = {}
    made = []
    for i, event in enumerate(lines):
        if i == backward_at and not kept:
            for block in held:
                model.free(block)
            held = []
        if event[0] == ALLOC:
            block = model.malloc(max(0, int(event[1] + event[2] * rows)))
            if kept and held and event[3]:
                model.free(block)
            else:
                taken[i] = block
                if event[3]:
                    made.append(i)
        else:
            model.free(taken.pop(event[1], None))
    return held if kept and held else [taken[i] for i in made if i in taken]
