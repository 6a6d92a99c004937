"""The one search for the largest value that fits: `-r` and `--search` (recover/retry.py, driven by the
retry loop of recover/retry_loop.py and recover/ranked_retry.py) and `--predict -r` (fakerun/planner.py).

Pure logic: no torch, no IPython. Values are ints, sizes int bytes.

Fitting is not monotone in the value on torch's caching allocator: a request takes a block rounded to
512 bytes of a 2 MiB or 20 MiB segment (or a segment of its own, rounded to 2 MiB), freed blocks stay
cached, so one value can fit where a smaller one runs out (a ResNet-18 on 128 MiB fits at 65-78 and 86,
runs out at 79-85), and a run's outcome depends on what earlier runs left cached. So:

- `next_value` brackets and bisects: the next value is where the line through the nearest levels on
  either side (a peak that fitted, what a failure needed at least) meets the capacity, kept within the
  middle half of the bracket, so that every probe narrows it by a quarter at least (a line through a
  lower bound, or through segment steps, would otherwise hug one end of the bracket run after run);
- `scan` finds the largest value that fits on a cheap verdict (the allocator model: a measured allocation
  pattern replayed at the value, or a fake run) without assuming it monotone: the top, a coarse grid
  below it, and bisection up from the highest grid value that fits to the next one that does not;
- `steady` prefers, within a margin below the value found, one whose neighbours fit too; `islands`
  says when the value sits among values that do not fit.
"""
from __future__ import annotations

from typing import Callable

GRID = 8          # scan: grid points below the top
BUDGET = 24       # scan: verdicts asked in all


def next_value(fit: dict[int, float], fail: dict[int, float], capacity: float | None, lo: int | None,
               hi: int | None, floor: int = 1, *, up_to: int = 16) -> int | None:
    """The next value to run, from the levels (bytes that must fit) at values that fitted (`fit`) and ran
    out (`fail`, at least the level given); `lo` the largest value that fitted, `hi` the smallest that ran
    out above it (None: none yet). Strictly between `lo` and `hi`, within the middle half of the bracket;
    above `lo` at most `up_to` times it when nothing above failed; with nothing fitted, where the line
    meets the capacity but at least a quarter of the smallest failure. None where nothing is left open."""
    if lo is not None and hi is not None and hi - lo <= 1:
        return None
    guess = _secant(fit, fail, capacity, lo, hi)
    if lo is not None and hi is not None:
        guess = within_bracket((lo + hi) // 2 if guess is None else guess, lo, hi)
        return guess if lo < guess < hi else None
    if lo is not None:
        return None if guess is None else min(max(guess, lo + 1), lo * up_to)
    if hi is None or hi <= floor:
        return None
    if guess is None:
        return max(floor, hi // 2)
    return max(floor, min(guess, hi - 1), hi // 4)


def within_bracket(value: int, lo: int, hi: int) -> int:
    """`value` kept within the middle half of the bracket (`lo` fits, `hi` does not)."""
    quarter = (hi - lo) // 4
    return max(lo + 1, min(max(value, lo + quarter), hi - quarter))


def _secant(fit, fail, capacity, lo, hi) -> int | None:
    if capacity is None:
        return None
    if lo is not None and hi is not None and lo in fit and hi in fail:
        (x0, y0), (x1, y1) = (lo, fit[lo]), (hi, fail[hi])
    else:
        points = sorted({**fit, **fail}.items())
        if len(points) < 2:
            return None
        (x0, y0), (x1, y1) = points[-2:] if lo is not None else points[:2]
    if x1 == x0 or y1 <= y0:
        return None
    return int(x0 + (capacity - y0) * (x1 - x0) / (y1 - y0))


class FitMap:
    """Verdicts by value (True fits, False runs out) from one source: the allocator model, fake runs, or
    runs of the cell."""

    def __init__(self, verdicts: dict[int, bool] | None = None):
        self.verdicts: dict[int, bool] = dict(verdicts or {})

    def __setitem__(self, value: int, ok: bool) -> None:
        self.verdicts[value] = bool(ok)

    def largest(self) -> int | None:
        fitted = [v for v, ok in self.verdicts.items() if ok]
        return max(fitted) if fitted else None

    def failing_below(self, value: int) -> list[int]:
        """The values below `value` known to run out, smallest first."""
        return sorted(v for v, ok in self.verdicts.items() if not ok and v < value)

    def ranges(self) -> str:
        """`2-32 fit, 40-48 do not, ...`: the values asked, in runs of one verdict."""
        parts, run = [], None
        for v in sorted(self.verdicts):
            ok = self.verdicts[v]
            if run is not None and run[2] == ok:
                run[1] = v
            else:
                if run is not None:
                    parts.append(run)
                run = [v, v, ok]
        if run is not None:
            parts.append(run)
        return ", ".join(f"{a}" + (f"-{b}" if b != a else "") + (" fit" if ok else " do not")
                         for a, b, ok in parts)


def scan(fits: Callable[[int], bool | None], lo: int, hi: int, *, budget: int = BUDGET,
         grid: int = GRID, below: int = 3) -> tuple[int | None, FitMap]:
    """The largest value in [lo, hi] that `fits` (a cheap verdict; None: it cannot tell, the scan stops),
    not assuming fitting is monotone: `hi`, then `grid` values evenly below it, then bisection from the
    highest that fits up to the next grid value that does not, and `below` grid values under it (those
    that do not fit are named by `islands`). (largest or None, the verdicts asked)."""
    seen = FitMap()

    def ask(v: int) -> bool | None:
        if v not in seen.verdicts:
            if len(seen.verdicts) >= budget:
                return None
            ok = fits(v)
            if ok is None:
                return None
            seen[v] = ok
        return seen.verdicts[v]

    if hi < lo:
        return None, seen
    top = ask(hi)
    if top is None:
        return None, seen
    if top:
        return hi, seen
    points = sorted({max(lo, lo + (hi - lo) * i // (grid + 1)) for i in range(grid + 1)} - {hi}, reverse=True)
    above, best = hi, None
    for v in points:
        ok = ask(v)
        if ok is None:
            break
        if ok:
            best = v
            break
        above = v
    if best is None:
        return seen.largest(), seen
    a, b = best, above        # a fits, b does not: bisect (the largest that fits between them)
    while b - a > 1:
        mid = (a + b) // 2
        ok = ask(mid)
        if ok is None:
            break
        a, b = (mid, b) if ok else (a, mid)
    # the next grid values below, down to half of it: whether it sits above values that do not fit
    for v in [p for p in points if best / 2 <= p < best][:below]:
        if ask(v) is None:
            break
    return max(v for v, ok in seen.verdicts.items() if ok), seen


def steady(value: int, fits: Callable[[int], bool | None], margin: float, seen: FitMap | None = None,
           *, floor: int = 1, budget: int = 16) -> int:
    """Within `margin` below `value` (a value found to fit), the largest that fits with both neighbours
    fitting too (v - step and v + step, step 1% of v and at least 1), so that a little change in what is
    cached does not turn it into a failure; `value` where none is found within the budget."""
    seen = seen if seen is not None else FitMap()
    step = max(1, value // 100)
    low = max(floor, int(value * (1 - margin)))
    asked = 0

    def ok(v: int) -> bool:
        nonlocal asked
        if v in seen.verdicts:
            return seen.verdicts[v]
        if asked >= budget:
            return False
        asked += 1
        got = fits(v)
        if got is None:
            return False
        seen[v] = got
        return got

    v = value
    while v >= low and asked < budget:
        if ok(v) and ok(v - step) and ok(v + step):
            return v
        v -= step
    return value


def islands(value: int, seen: FitMap, *, within: float = 0.5) -> str:
    """Words where values below `value`, down to `within` of it, are known not to fit: "fits at 68; 54-64
    do not: a change in what is cached can run out"; "" where none is known."""
    below = [v for v in seen.failing_below(value) if v >= value * within]
    if not below:
        return ""
    runs = []
    for v in below:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    span = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
    verb = "does" if len(below) == 1 else "do"
    return (f"fits at {value}; {span} {verb} not: the caching allocator's fitting is not monotone, and a change "
            "in what is cached can run out")
