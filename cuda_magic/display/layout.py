"""What the text, HTML and widget forms share: how a capacity splits into bar parts, the words for a
report's title, values and outcomes, the rows of its attempts, the names of a tensor. Each form draws
these; none of them decides them again.
"""
from __future__ import annotations

from cuda_magic.devices.readings import PART_LABELS, PARTS
from cuda_magic.memory.kinds import IN_FAILING_OP, KINDS, UNSEEN
from cuda_magic.units import format_bytes, format_duration

UNKNOWN = "unknown"          # the part of a capacity whose figures the backend does not give
BAR_PARTS = (*PARTS, UNKNOWN)
BAR_LABELS = {**PART_LABELS, UNKNOWN: "not known"}
OUTCOME_WORDS = {"ok": "fits", "oom": "out of memory", "error": "error", "interrupted": "interrupted"}
MAX_ADVICE = 5


def bar_segments(dev) -> list[tuple[str, int]]:
    """The device's capacity as (part, bytes) in display order; the bytes add up to `bar_total(dev)`.

    Parts the backend does not know (None) are merged into one 'unknown' remainder. Empty when the
    capacity itself is unknown.
    """
    if dev.capacity is None:
        return []
    known = [(p, getattr(dev, p)) for p in PARTS if getattr(dev, p) is not None]
    segments = [(p, max(0, int(b))) for p, b in known]
    rest = dev.capacity - sum(b for _, b in segments)
    if rest > 0:
        # the remainder is free memory when every part but free is known; otherwise nobody says
        free_known = dev.free is not None
        segments.append((UNKNOWN if free_known or len(known) < len(PARTS) - 1 else "free", rest))
    return [(p, b) for p, b in segments if b > 0]


def bar_total(dev) -> int:
    """What the bar spans: the capacity, or the parts' sum where the figures overshoot it."""
    return sum(b for _, b in bar_segments(dev))


def split_cells(values: list[int], width: int) -> list[int]:
    """Whole cells per value summing to `width`, proportional, a non-zero value getting at least one."""
    total = sum(values)
    if total <= 0 or width <= 0:
        return [0] * len(values)
    exact = [v * width / total for v in values]
    cells = [int(x) for x in exact]
    for i in sorted(range(len(values)), key=lambda i: exact[i] - cells[i], reverse=True):
        if sum(cells) >= width:
            break
        cells[i] += 1
    for i, v in enumerate(values):
        if v > 0 and cells[i] == 0:
            donor = max(range(len(cells)), key=lambda j: cells[j])
            if cells[donor] > 1:
                cells[donor] -= 1
                cells[i] = 1
    return cells


def percentages(values: list[int]) -> list[float]:
    """Percentages of the sum, rounded to 3 decimals, that add up to exactly 100 (last one absorbs)."""
    total = sum(values)
    if total <= 0:
        return [0.0] * len(values)
    out = [round(v * 100.0 / total, 3) for v in values]
    out[-1] = round(100.0 - sum(out[:-1]), 3)
    return out


def in_use(dev) -> int | None:
    """The figure a before/after comparison uses: PyTorch's allocated bytes, or the process's memory
    where PyTorch's allocator does not count (the CPU)."""
    return dev.torch_allocated if dev.torch_allocated is not None else dev.other_this_process


def approximate_note(records) -> str:
    """The footnote of a --watch table with approximate peaks ('' where all are exact): on the CPU the
    operating system's figure, on MPS (which keeps no peak counter) the higher of two readings."""
    kinds = {r.device.split(":")[0] for r in records if not r.peak_exact and r.peak is not None}
    said = []
    if kinds - {"mps"}:
        said.append("the operating system's figure" + (" (CPU)" if "mps" in kinds else ""))
    if "mps" in kinds:
        said.append("on MPS, which keeps no peak counter, the higher of the readings before and after the cell")
    return "~ approximate: " + "; ".join(said) if said else ""


def peak_words(peak: int | None, exact: bool) -> str:
    if peak is None:
        return "peak n/a"
    if exact:
        return f"peak {format_bytes(peak)} (exact)"
    return f"peak ~{format_bytes(peak)} (approximate: the operating system's figure)"


def tensor_name(t) -> str:
    names = ", ".join(t.names) if t.names else "(unnamed)"
    unnamed_views = t.views - max(1, len(t.names))
    if unnamed_views <= 0 or names.endswith(")"):   # "(unnamed)", "losses[0] (its graph)": no count
        return names
    return names + f" (+{unnamed_views} more views)"


def folded_graphs(records) -> list:
    """The tensor table's rows: storages that look the same (the same names, all of them a graph's, as
    `losses[0] (its graph)`, the same shape, dtype and device: two activations one logged loss keeps) are
    one row with their bytes added up and how many they are, not the same line twice. Largest first."""
    from dataclasses import replace

    from cuda_magic.memory.naming import GRAPH_SUFFIX

    rows, folded = [], {}
    for t in records:
        if not t.names or not all(n.endswith(GRAPH_SUFFIX) for n in t.names):
            rows.append(t)
            continue
        look = (tuple(t.names), tuple(t.shape), t.dtype, t.device)
        if look not in folded:
            folded[look] = [len(rows), 0]
            rows.append(t)
        at = folded[look]
        at[1] += 1
        if at[1] > 1:
            first = rows[at[0]]
            rows[at[0]] = replace(first, nbytes=first.nbytes + t.nbytes, views=first.views + t.views,
                                  grad_fn=first.grad_fn or t.grad_fn)
    for (names, *_), (i, n) in folded.items():
        if n > 1:
            owners = ", ".join(name.removesuffix(GRAPH_SUFFIX) for name in names)
            rows[i] = replace(rows[i], names=[f"{owners} ({'its graph' if len(names) == 1 else 'their graphs'}: "
                                              f"{n} storages)"])
    rows.sort(key=lambda r: -r.nbytes)      # still largest first
    return rows


def short_dtype(dtype: str) -> str:
    return str(dtype).removeprefix("torch.")


def shape_text(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")" if len(shape) != 1 else f"({shape[0]},)"


def hidden_tensors(snap) -> tuple[int, int]:
    """How many storages the display leaves out, and their bytes."""
    shown = snap.tensor_list[: snap.top]
    rest = snap.tensor_list[snap.top:]
    count, nbytes = len(rest), sum(t.nbytes for t in rest)
    if snap.tensor_count > len(snap.tensor_list):       # the list itself was cut by the backend
        count = snap.tensor_count - len(shown)
        if snap.tensor_bytes:
            nbytes = max(0, sum(snap.tensor_bytes.values()) - sum(t.nbytes for t in shown))
    return count, nbytes


def oom_items(oom) -> list[tuple[str, int]]:
    fields = [
        ("tried to allocate", oom.requested), ("capacity", oom.capacity), ("free", oom.free),
        ("this process", oom.this_process), ("other processes", oom.other_processes),
        ("allocated by PyTorch", oom.allocated_by_torch),
        ("reserved but unallocated", oom.reserved_unallocated),
        ("reserved in total", oom.reserved_total),
    ]
    return [(k, v) for k, v in fields if v is not None]


def oom_title(oom) -> str:
    where = f" on {oom.device}" if oom.device else ""
    title = f"{oom.backend.upper()} out of memory{where}"
    if oom.possible:
        title = f"possibly out of memory ({oom.backend}{where}: it says this for unsupported inputs too)"
    return title


def guard_title(report, running: bool = False) -> str:
    var = report.variable
    src = report.source
    if running:                                  # shown while the cell runs (display.show)
        return f"{src}: running the cell" + (f", attempt {len(report.attempts) + 1}" if report.attempts else "")
    if report.outcome == "ok":
        return f"{src}: the cell ran within memory"
    if report.outcome == "recovered":
        return (f"{src}: out of memory at {var}={report.original_value}; "
                f"fits at {var}={report.final_value}")
    if report.outcome == "oom":
        return f"{src}: out of memory; memory released" + ("" if report.api else ", no restart needed")
    if report.outcome == "interrupted":
        return f"{src}: interrupted; attempts stopped" + (f", {var} restored" if var else "")
    text = f"{src}: stopped by an error that is not out of memory"
    return text + (f": {report.exception_text}" if report.exception_text else "")


def value_words(report) -> str | None:
    """'batch_size = 16 (was 64), accum = 4 (was 1)' for a retried cell; None without -r."""
    if not report.variable:
        return None
    final = report.final_value if report.final_value is not None else report.original_value
    words = f"{report.variable} = {final}"
    if final != report.original_value:
        words += f" (was {report.original_value})"
    if report.accumulate:
        acc = report.final_accumulate if report.final_accumulate is not None else report.original_accumulate
        words += f", {report.accumulate} = {acc}"
        if acc != report.original_accumulate:
            words += f" (was {report.original_accumulate})"
    if report.values_restored:
        words += " (restored)"
    return words


def value_reason(report) -> str | None:
    """Why the retry tried the value it kept ('why bs = 2092: 95% of 2203, predicted from ...'); None without a
    retry that changed the value."""
    final = report.final_value
    if not report.variable or final is None or final == report.original_value:
        return None
    for attempt in reversed(report.attempts):
        if attempt.value == final and attempt.reason:
            return f"why {report.variable} = {final}: {attempt.reason}"
    return None


def reclaimed_words(report) -> str:
    keep_going = "" if report.api else " The kernel can keep going: no restart needed."
    if not report.reclaimed:
        return "Nothing was left to reclaim." + keep_going
    per = ", ".join(f"{format_bytes(b)} on {k}" for k, b in report.reclaimed.items())
    return f"Memory reclaimed: {per}.{keep_going}"


ATTEMPT_CODE_WIDTH = 32     # the failing line's code in an attempt's row, at most


def shorten(text: str, width: int) -> str:
    """`text` on one line, cut to `width` characters with an ellipsis where it is longer."""
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 1] + "…"


def point_words(point, code_width: int) -> str:
    """Where a run ran out, from its FailurePoint: 'cell line 4 `y = f(x)`', 'cell line 4 `y = f(x)` inside
    attend', 'attend (model.py)'; '' where nothing is known."""
    from cuda_magic.paths import is_cell_file

    if point is None:
        return ""
    code = f" `{shorten(point.text.strip(), code_width)}`" if point.text and point.text.strip() else ""
    shown_file = point.filename and not is_cell_file(point.filename)
    if point.line is not None:
        inside = (f" inside {point.function}" + (f" ({point.filename})" if shown_file else "")
                  if point.function else "")
        return f"cell line {point.line}{code}{inside}"
    if not (point.function or shown_file):
        return ""
    return (point.function or "code outside the cell") + (f" ({point.filename})" if shown_file else "")


def attempt_rows(rows, variable: str | None) -> list[list[str]]:
    """Table rows for (number, attempt) pairs; an int is the gap of a cut list (how many are left out). Each
    attempt says its own outcome: where it ran out (its line, not the last failure's) or that it fitted, what
    its failing allocation asked for, its peak."""
    out = []
    width = 5 + (1 if variable else 0)
    for row in rows:
        if isinstance(row, int):
            out.append(["…"] + [""] * (width - 2) + [f"{row} more"])
            continue
        i, a = row
        outcome = OUTCOME_WORDS.get(a.outcome, str(a.outcome))
        if a.outcome == "ok":
            outcome = "fitted, a probe (rolled back)" if a.probe else "fitted"
        elif a.outcome == "oom":
            where = point_words(a.where, ATTEMPT_CODE_WIDTH)
            outcome = "out of memory" + (f" at {where}" if where else "") + (", a probe" if a.probe else "")
        asked = format_bytes(a.requested) if a.outcome == "oom" and a.requested is not None else ""
        line = [str(i)] + ([str(a.value)] if variable else [])
        out.append(line + [outcome, asked, format_bytes(a.peak), format_duration(a.duration)])
    return out


def attempt_headers(variable: str | None) -> list[str]:
    return ["#"] + ([variable] if variable else []) + ["outcome", "asked", "peak", "duration"]


def watch_line(rec) -> str:
    """`[gpumem] cell 12 cuda:0: +1.50 GiB allocated, peak 3.00 GiB, 2.31 s`"""
    if rec.peak is None:
        peak = "peak n/a"
    else:
        peak = f"peak {'' if rec.peak_exact else '~'}{format_bytes(rec.peak)}"
    return (f"[gpumem] cell {rec.cell} {rec.device}: {format_bytes(rec.allocated_delta, signed=True)} "
            f"allocated, {peak}, {format_duration(rec.duration)}")


# ---- memory by kind (memory.kinds) ----------------------------------------------------------------

KIND_ORDER = (*KINDS, IN_FAILING_OP, UNSEEN)
KIND_BAR_WIDTH = 50


def kind_segments(kinds: dict[str, int]) -> list[tuple[str, int]]:
    """(kind, bytes) in display order, the kinds that hold nothing left out. With the 'unseen' rest they
    add up to the device's PyTorch allocated bytes."""
    return [(k, int(kinds[k])) for k in KIND_ORDER if kinds.get(k)]


def shown_kinds(snap) -> list[tuple[str, dict[str, int]]]:
    """(device key, {kind: bytes}) for the snapshot's devices whose tensors hold anything. A split equal to
    one already shown is left out: with the simulated device on, the CPU's tensors are the device's, and
    the same table twice says nothing more (`.by_kind` keeps both)."""
    out = []
    for dev in snap.device_list:
        kinds = snap.kind_bytes.get(dev.key) or {}
        if any(kinds.values()) and all(kinds != seen for _, seen in out):
            out.append((dev.key, kinds))
    return out
