"""The largest value at which a cell fits, for the retry tests: checked at a pinned value (it fits, one
more does not: two runs of the cell), and where this torch (or library) differs, found from the pin
outward, so that the answer is the true largest either way."""
from __future__ import annotations

from conftest import run_ok


def fits(ip, cell: str, value: int, *, guard: str = "") -> bool:
    """Whether the cell runs at bs=value from the start state (`reset()` in the namespace). `guard`: the
    options of a %%oomguard line to run it under (its cap), else it runs bare."""
    from cuda_magic import release

    run_ok(ip, f"reset()\nbs = {value}")
    if guard:
        result = ip.run_cell(f"%%oomguard -q -o --no-raise {guard}\n" + cell)
        ok = result.success and result.result.outcome == "ok"
    else:
        result = ip.run_cell(cell)
        ok = result.success
    del result
    release(ip)
    return ok


def largest(ip, cell: str, pinned: int, *, guard: str = "") -> int:
    up = fits(ip, cell, pinned, guard=guard)
    if up and not fits(ip, cell, pinned + 1, guard=guard):
        return pinned
    lo, hi, step = (pinned + 1, None, 1) if up else (None, pinned, 1)
    while lo is None or hi is None:
        if hi is None:
            probe = lo + 2 * step
            lo, hi = (probe, None) if fits(ip, cell, probe, guard=guard) else (lo, probe)
        else:
            probe = max(1, hi - 2 * step)
            lo, hi = (probe, hi) if fits(ip, cell, probe, guard=guard) else (None, probe)
            if lo is None and probe == 1:
                raise AssertionError("the cell does not fit even at bs=1")
        step *= 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(ip, cell, mid, guard=guard) else (lo, mid)
    return lo
