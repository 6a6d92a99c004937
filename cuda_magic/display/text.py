"""Plain-text forms of the records: what terminal IPython, logs and `repr` show.

Terminal IPython keeps only text/plain, so every fact the HTML and widget forms show is here too. The
helpers that split a capacity into bar parts live here and are shared with html.py and widget.py, so
that all three forms draw the same bars.
"""
from __future__ import annotations

import textwrap

from cuda_magic.devices.records import PART_LABELS, PARTS
from cuda_magic.units import format_bytes, format_duration

UNKNOWN = "unknown"          # the part of a capacity whose figures the backend does not give
BAR_PARTS = (*PARTS, UNKNOWN)
BAR_LABELS = {**PART_LABELS, UNKNOWN: "not known"}
BAR_SYMBOLS = {
    "torch_allocated": "#", "torch_cached": "=", "other_this_process": "+",
    "other_processes": "@", "free": ".", UNKNOWN: "?",
}
BAR_WIDTH = 50
OUTCOME_WORDS = {"ok": "fits", "oom": "out of memory", "error": "error", "interrupted": "interrupted"}
MAX_ADVICE = 5


# ---- shared helpers ---------------------------------------------------------------------------

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


def peak_words(peak: int | None, exact: bool) -> str:
    if peak is None:
        return "peak n/a"
    if exact:
        return f"peak {format_bytes(peak)} (exact)"
    return f"peak ~{format_bytes(peak)} (approximate: the operating system's figure)"


def shorten(text: str, width: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 1] + "…"


def table(headers: list[str], rows: list[list[str]], right: set[int] = frozenset(), indent: str = "  ") -> list[str]:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]

    def line(cells):
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return (indent + "  ".join(parts)).rstrip()

    return [line(headers)] + [line(r) for r in rows]


def tensor_name(t) -> str:
    names = ", ".join(t.names) if t.names else "(unnamed)"
    unnamed_views = t.views - max(1, len(t.names))
    if unnamed_views <= 0 or names.endswith(")"):   # "(unnamed)", "losses[0] (its graph)": no count
        return names
    return names + f" (+{unnamed_views} more views)"


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


def wrap_items(head: str, items: list[str], width: int = 100) -> list[str]:
    """`head item, item, ...` over as many lines as needed, never breaking inside an item."""
    lines, line = [], head
    for i, item in enumerate(items):
        piece = item + ("," if i < len(items) - 1 else "")
        if len(line) + 1 + len(piece) > width and line.strip():
            lines.append(line)
            line = "  " + piece
        else:
            line += " " + piece
    return lines + [line]


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


def guard_line(report) -> str:
    """The report in one line: what `-o` shows as the cell's value (the full report is already shown)."""
    words = value_words(report)
    tried = len(report.attempts)
    extra = f", {tried} attempt{'s' if tried != 1 else ''}" if report.show_attempts else ""
    return f"<GuardReport {report.device}: {report.outcome}{extra}" + (f"; {words}" if words else "") + ">"


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


def reclaimed_words(report) -> str:
    keep_going = "" if report.api else " The kernel can keep going: no restart needed."
    if not report.reclaimed:
        return "Nothing was left to reclaim." + keep_going
    per = ", ".join(f"{format_bytes(b)} on {k}" for k, b in report.reclaimed.items())
    return f"Memory reclaimed: {per}.{keep_going}"


def attempt_rows(rows, variable: str | None) -> list[list[str]]:
    """Table rows for (number, attempt) pairs; an int is the gap of a cut list (how many are left out)."""
    out = []
    width = 4 + (1 if variable else 0)
    for row in rows:
        if isinstance(row, int):
            out.append(["…"] + [""] * (width - 2) + [f"{row} more"])
            continue
        i, a = row
        outcome = OUTCOME_WORDS.get(a.outcome, str(a.outcome))
        if a.outcome == "oom" and a.requested is not None:
            outcome += f" (asked {format_bytes(a.requested)})"
        if a.probe:
            outcome += ", probe"
        line = [str(i)] + ([str(a.value)] if variable else [])
        out.append(line + [outcome, format_bytes(a.peak), format_duration(a.duration)])
    return out


def attempt_headers(variable: str | None) -> list[str]:
    return ["#"] + ([variable] if variable else []) + ["outcome", "peak", "duration"]


# ---- the forms --------------------------------------------------------------------------------

def bar_text(dev, width: int = BAR_WIDTH) -> str:
    segments = bar_segments(dev)
    if not segments:
        return ""
    cells = split_cells([b for _, b in segments], width)
    return "[" + "".join(BAR_SYMBOLS[p] * n for (p, _), n in zip(segments, cells)) + "]"


def device_text(dev) -> list[str]:
    cap = "capacity " + (format_bytes(dev.capacity) if dev.capacity is not None else "not known")
    lines = [f"{dev.key}  {dev.name}  {cap}"]
    bar = bar_text(dev)
    if bar:
        lines.append("  " + bar)
    total = bar_total(dev)
    shown = {p: b for p, b in bar_segments(dev)}
    for part in BAR_PARTS:
        value = getattr(dev, part, None) if part != UNKNOWN else shown.get(UNKNOWN)
        if part == UNKNOWN and value is None:
            continue
        if part == "free" and value is None and "free" in shown:
            value = shown["free"]
        share = f"{100.0 * value / total:5.1f}%" if value is not None and total else ""
        lines.append(f"  {BAR_SYMBOLS[part]} {BAR_LABELS[part]:<22}{format_bytes(value):>12}  {share}".rstrip())
    lines.append("  " + peak_words(dev.peak, dev.peak_exact))
    lines += [f"  note: {n}" for n in dev.notes]
    return lines


def tensors_text(snap) -> list[str]:
    shown = snap.tensor_list[: snap.top]
    count, nbytes = hidden_tensors(snap)
    if not shown:
        return ["No live tensors found."] if count == 0 else []
    total = len(shown) + count
    lines = [f"Top {len(shown)} tensors (of {total} storages, largest first)"]
    rows = [[shorten(tensor_name(t), 40), shape_text(t.shape), short_dtype(t.dtype), t.device,
             format_bytes(t.nbytes), "yes" if t.grad_fn else ""] for t in shown]
    lines += table(["names", "shape", "dtype", "device", "size", "grad_fn"], rows, right={4})
    if count:
        lines.append(f"  +{count} more ({format_bytes(nbytes)})")
    return lines


def processes_text(processes) -> str:
    if not processes:
        return "No GPU processes listed."
    rows = [[p.device, str(p.pid), p.user or "", shorten(p.name or "", 40), format_bytes(p.used),
             "<- this process" if p.this_process else ""] for p in processes]
    return "\n".join(["Processes using the GPUs"] + table(
        ["device", "pid", "user", "name", "memory", ""], rows, right={1, 4}))


def snapshot_text(snap) -> str:
    lines = [f"note: {n}" for n in snap.notes]
    for dev in snap.device_list:
        lines += device_text(dev)
    if snap.device_list:
        used = set(PARTS) | {p for d in snap.device_list for p, _ in bar_segments(d)}
        legend = "  ".join(f"{BAR_SYMBOLS[p]} {BAR_LABELS[p]}" for p in BAR_PARTS if p in used)
        lines.append(f"legend: {legend}")
    lines += tensors_text(snap)
    if snap.processes:
        lines.append(processes_text(snap.processes))
    return "\n".join(lines)


def diff_text(d) -> str:
    seconds = d.after.taken_at - d.before.taken_at
    lines = [f"Changes since the previous snapshot ({format_duration(max(0.0, seconds))} ago)"]
    for delta in d.device_deltas:
        changed = [f"{PART_LABELS[p]} {format_bytes(v, signed=True)}" for p, v in delta.changes.items() if v]
        lines.append(f"  {delta.key}: " + (", ".join(changed) if changed else "no change"))
    for title, records in (("appeared", d.appeared), ("went", d.went)):
        if not records:
            continue
        total = sum(t.nbytes for t in records)
        lines.append(f"Tensors {title}: {len(records)} ({format_bytes(total)})")
        top = sorted(records, key=lambda t: t.nbytes, reverse=True)
        rows = [[shorten(tensor_name(t), 40), shape_text(t.shape), short_dtype(t.dtype), t.device,
                 format_bytes(t.nbytes)] for t in top[:10]]
        lines += table(["names", "shape", "dtype", "device", "size"], rows, right={4})
        if len(top) > 10:
            lines.append(f"  +{len(top) - 10} more ({format_bytes(sum(t.nbytes for t in top[10:]))})")
    if not d.appeared and not d.went:
        lines.append("No tensors appeared or went.")
    return "\n".join(lines)


def guard_devices_text(report) -> list[str]:
    after = {d.key: d for d in report.after}
    keys = [d.key for d in report.before] + [k for k in after if k not in {d.key for d in report.before}]
    before = {d.key: d for d in report.before}
    rows = []
    for key in keys:
        b, a = before.get(key), after.get(key)
        vb = in_use(b) if b else None
        va = in_use(a) if a else None
        change = format_bytes(va - vb, signed=True) if va is not None and vb is not None else "n/a"
        cap = (a or b).capacity
        rows.append([key, format_bytes(vb), format_bytes(report.peaks.get(key)), format_bytes(va), change,
                     format_bytes(cap)])
    if not rows:
        return []
    headers = ["device", "before", "peak", "after", "change", "capacity"]
    return (["Memory in use (PyTorch allocated; the process's memory on the CPU)"]
            + table(headers, rows, right={1, 2, 3, 4, 5}))


def attempt_line(attempt, number: int, variable: str | None) -> str:
    """One line per attempt of a retried cell, printed as it happens."""
    value = f" {variable}={attempt.value}" if variable else ""
    outcome = OUTCOME_WORDS.get(attempt.outcome, attempt.outcome)
    extra = [f"peak {format_bytes(attempt.peak)}"] if attempt.peak is not None else []
    if attempt.requested is not None and attempt.outcome == "oom":
        extra.append(f"tried to allocate {format_bytes(attempt.requested)}")
    extra.append(format_duration(attempt.duration))
    return f"[oomguard] attempt {number}:{value} -> {outcome} ({', '.join(extra)})"


def guard_text(report, running: bool = False) -> str:
    lines = [guard_title(report, running)]
    if report.limit is not None:
        lines.append(f"limit: {format_bytes(report.limit)}")
    lines += guard_devices_text(report)
    if report.show_attempts:
        rows = attempt_rows(report.attempts_shown, report.variable)
        lines.append("Attempts")
        lines += table(attempt_headers(report.variable), rows, right={0, len(rows[0]) - 2, len(rows[0]) - 1})
    words = value_words(report)
    if words:
        lines.append(words)
    if report.failure is not None:
        f = report.failure
        inside = f" (inside {f.function}" + (f" in {f.filename}" if f.filename else "") + ")" if f.function else ""
        if f.line is not None:
            lines.append(f"Failed at cell line {f.line}{inside}: {shorten(f.text, 80)}")
        else:
            lines.append(f"Failed in {f.function or 'code outside the cell'}"
                         + (f" ({f.filename})" if f.filename else ""))
    if report.oom is not None:
        items = [f"{k} {format_bytes(v)}" for k, v in oom_items(report.oom)]
        lines += wrap_items(oom_title(report.oom) + (":" if items else ""), items)
    diag = report.diagnosis
    if diag is not None:
        lines += textwrap.wrap(f"Diagnosis: {diag.summary}", 100, subsequent_indent="  ")
        if report.holders_shown:
            held = ", ".join(f"{n} ({format_bytes(b)})" for n, b in report.holders_shown)
            more = f" and {report.holders_hidden} more" if report.holders_hidden else ""
            lines.append(f"  kept alive by names: {held}{more}")
        if diag.advice:
            lines.append("Try, most useful first:")
            for i, adv in enumerate(diag.advice[:MAX_ADVICE], 1):
                lines.append(f"  {i}. {adv.text}")
                if adv.code:
                    lines += [f"       {c}" for c in adv.code.splitlines()[:3]]
    if report.show_reclaimed and not running:
        lines.append(reclaimed_words(report))
    lines += [f"not undone: {w}" for w in report.not_undone]
    lines += [f"warning: {w}" for w in report.warnings]
    return "\n".join(lines)


def release_text(r) -> str:
    lines = ["Dry run: nothing was changed."] if r.dry_run else []
    if r.freed:
        freed = ", ".join(f"{format_bytes(b)} on {k}" for k, b in r.freed.items())
        lines.append(("Would free " if r.dry_run else "Freed ") + freed)
    elif not r.dry_run:
        lines.append("Freed nothing.")
    for (done, would), names in ((("Dropped", "Would drop"), r.dropped), (("Deleted", "Would delete"), r.deleted),
                                 (("Moved to the CPU", "Would move to the CPU"), r.offloaded)):
        if names:
            lines.append(f"{would if r.dry_run else done}: {', '.join(names)}")
    if r.still_held:
        lines.append("Still holding device memory (largest first):")
        rows = [[name, format_bytes(b)] for name, b in r.still_held[:15]]
        lines += table(["variable", "size"], rows, right={1})
        if len(r.still_held) > 15:
            rest = r.still_held[15:]
            lines.append(f"  +{len(rest)} more ({format_bytes(sum(b for _, b in rest))})")
    lines += [f"note: {n}" for n in r.notes]
    return "\n".join(lines)


def watch_line(rec) -> str:
    """`[gpumem] cell 12 cuda:0: +1.50 GiB allocated, peak 3.00 GiB, 2.31 s`"""
    if rec.peak is None:
        peak = "peak n/a"
    else:
        peak = f"peak {'' if rec.peak_exact else '~'}{format_bytes(rec.peak)}"
    return (f"[gpumem] cell {rec.cell} {rec.device}: {format_bytes(rec.allocated_delta, signed=True)} "
            f"allocated, {peak}, {format_duration(rec.duration)}")


def history_text(records) -> str:
    if not records:
        return "No cells recorded: turn recording on with %gpumem --watch."
    rows = [[str(r.cell), r.device, format_bytes(r.allocated_delta, signed=True),
             ("" if r.peak_exact or r.peak is None else "~") + format_bytes(r.peak),
             format_duration(r.duration)] for r in records]
    lines = ["Per-cell memory (%gpumem --watch)"]
    lines += table(["cell", "device", "allocated", "peak", "duration"], rows, right={0, 2, 3, 4})
    if any(not r.peak_exact for r in records):
        lines.append("~ approximate: the operating system's figure")
    return "\n".join(lines)
