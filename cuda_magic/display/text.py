"""Plain-text forms of the records: what terminal IPython, logs and `repr` show.

Terminal IPython keeps only text/plain, so every fact the HTML and widget forms show is here too. What
the forms share (bar parts, titles, attempt rows) is in layout.py; this module only draws it as text.
"""
from __future__ import annotations

import textwrap

from cuda_magic.devices.readings import PART_LABELS, PARTS
from cuda_magic.display.layout import (UNKNOWN, BAR_PARTS, BAR_LABELS, OUTCOME_WORDS, MAX_ADVICE,
                                       bar_segments, bar_total, split_cells, in_use, peak_words, tensor_name,
                                       short_dtype, shape_text, hidden_tensors, oom_items, oom_title,
                                       guard_title, value_words, value_reason, reclaimed_words, attempt_rows,
                                       attempt_headers)
from cuda_magic.display.layout import KIND_BAR_WIDTH, approximate_note, kind_segments, shown_kinds
from cuda_magic.display.layout import folded_graphs
from cuda_magic.memory.kinds import IN_FAILING_OP, KIND_LABELS, UNSEEN
from cuda_magic.display import answer as A
from cuda_magic.display.blackbox_view import by_line_text, by_line_title, rows_shown, timeline_text
from cuda_magic.display.elements import table, wrap_items
from cuda_magic.display.layout import shorten
from cuda_magic.units import format_bytes, format_duration

BAR_SYMBOLS = {
    "torch_allocated": "#", "torch_cached": "=", "other_this_process": "+",
    "other_processes": "@", "free": ".", UNKNOWN: "?",
}
BAR_WIDTH = 50


def _wrap(text: str, width: int = 100, **kw) -> list[str]:
    return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False, **kw)


def guard_line(report) -> str:
    """The report in one line: what `-o` shows as the cell's value (the full report is already shown)."""
    words = value_words(report)
    tried = len(report.attempts)
    extra = f", {tried} attempt{'s' if tried != 1 else ''}" if report.show_attempts else ""
    return f"<GuardReport {report.device}: {report.outcome}{extra}" + (f"; {words}" if words else "") + ">"


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
             format_bytes(t.nbytes), "yes" if t.grad_fn else ""] for t in folded_graphs(shown)]
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


KIND_SYMBOLS = {"parameters": "P", "gradients": "G", "optimizer_state": "O", "activations": "A", "other": "o",
                IN_FAILING_OP: "F", UNSEEN: "?"}


def kinds_text(key: str, kinds: dict[str, int], title: str = "By kind") -> list[str]:
    """PyTorch's tensors on one device by kind: a bar of symbols, then a table."""
    segments = kind_segments(kinds)
    if not segments:
        return []
    total = sum(b for _, b in segments)
    cells = split_cells([b for _, b in segments], KIND_BAR_WIDTH)
    lines = [f"{title} on {key} ({format_bytes(total)} in PyTorch's tensors)",
             "  [" + "".join(KIND_SYMBOLS[k] * n for (k, _), n in zip(segments, cells)) + "]"]
    rows = [[KIND_SYMBOLS[k], KIND_LABELS[k], format_bytes(b), f"{100.0 * b / total:.1f}%"] for k, b in segments]
    return lines + table(["", "kind", "size", "share"], rows, right={2, 3})


def snapshot_text(snap) -> str:
    lines = [f"note: {n}" for n in snap.notes]
    for dev in snap.device_list:
        lines += device_text(dev)
    if snap.device_list:
        used = set(PARTS) | {p for d in snap.device_list for p, _ in bar_segments(d)}
        legend = "  ".join(f"{BAR_SYMBOLS[p]} {BAR_LABELS[p]}" for p in BAR_PARTS if p in used)
        lines.append(f"legend: {legend}")
    for key, kinds in shown_kinds(snap):
        lines += kinds_text(key, kinds)
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


def holder_words(h) -> str:
    """'losses (91.00 MiB, list of 300 tensors with grad_fn; 109.00 MiB more shared with preds)': the
    first figure is what deleting the name gives back."""
    what = f", {h.what}" if h.what else ""
    shared = f"; {format_bytes(h.shared)} more shared with {', '.join(h.shared_with[:3])}" if h.shared else ""
    return f"{h.name} ({format_bytes(h.bytes)}{what}{shared})"


def attempt_line(attempt, number: int, variable: str | None) -> str:
    """One line per attempt of a retried cell, printed as it happens."""
    value = f" {variable}={attempt.value}" if variable else ""
    outcome = OUTCOME_WORDS.get(attempt.outcome, attempt.outcome)
    extra = [f"peak {format_bytes(attempt.peak)}"] if attempt.peak is not None else []
    if attempt.requested is not None and attempt.outcome == "oom":
        extra.append(f"tried to allocate {format_bytes(attempt.requested)}")
    extra.append(format_duration(attempt.duration))
    return f"[oomguard] attempt {number}:{value} -> {outcome} ({', '.join(extra)})"


def guard_text(report, running: bool = False, *, full: bool = False, trying=None) -> str:
    """The report as text. After an OOM it leads with the answer (display/answer.py) and ends with how to
    see the rest; `full` (`%oomguard last`, `print(report)`) adds the rest."""
    lines = _wrap(A.headline(report, running, trying), 100, subsequent_indent="  ")
    if not A.folds(report, running):
        if report.limit is not None:
            lines.append(f"limit: {format_bytes(report.limit)}")
        lines += guard_devices_text(report)
        # while the cell runs the headline names the attempt running now and its value; the value line
        # (the original value until the run ends) would contradict it (issue 37)
        lines += _attempts_text(report) + ([] if running else _value_text(report, running))
        lines += _notes_text(report)
        if report.show_blackbox and not running:
            lines.append(timeline_text(report.blackbox))
        if report.show_reclaimed and not running:
            lines.append(reclaimed_words(report))
        return "\n".join(lines)
    lines += _value_text(report, running=True)
    reason = A.cause(report)
    if reason:
        lines += _wrap(f"Cause: {reason}", 100, subsequent_indent="  ")
    for i, step in enumerate(A.steps(report)):
        if i == 0:
            lines += _wrap(f"Do this: {step.text}", 100, subsequent_indent="  ")
            lines += [f"    {c}" for c in (step.code or "").splitlines()[:3]]
        else:
            lines.append(f"Or: {step.label}" + (f": {step.code.splitlines()[0]}" if step.code else ""))
    if report.show_blackbox:
        lines.append(timeline_text(report.blackbox, rows=A.TOP_LINES, failing=False))
    lines += _notes_text(report)
    if not full:
        lines.append(A.more_words(report))
        return "\n".join(lines)
    lines.append("-- details --")
    if report.limit is not None:
        lines.append(f"limit: {format_bytes(report.limit)}")
    lines += guard_devices_text(report) + _attempts_text(report)
    why = value_reason(report)
    if why:
        lines += _wrap(why, 100, subsequent_indent="  ")
    lines += _failure_text(report)
    bb = report.blackbox if report.show_blackbox else None
    shown = len(rows_shown(bb, A.TOP_LINES)[0]) if bb is not None else 0
    if shown and shown < len(bb.by_line):          # the lines the answer's table left out, not it again
        lines.append(f"{by_line_title(bb)}, after the first {shown}")
        lines += by_line_text(bb, start=shown)
    lines += _diagnosis_text(report)
    if report.show_reclaimed:
        lines.append(reclaimed_words(report))
    return "\n".join(lines)


def _attempts_text(report) -> list[str]:
    if not report.show_attempts:
        return []
    rows = attempt_rows(report.attempts_shown, report.variable)
    return ["Attempts"] + table(attempt_headers(report.variable), rows,
                                right={0, len(rows[0]) - 3, len(rows[0]) - 2, len(rows[0]) - 1})


def _value_text(report, running: bool) -> list[str]:
    words = value_words(report)
    lines = [words] if words else []
    why = value_reason(report)
    if why and not running:
        lines += _wrap(why, 100, subsequent_indent="  ")
    return lines


def _notes_text(report) -> list[str]:
    return [f"not undone: {w}" for w in report.not_undone] + [f"warning: {w}" for w in report.warnings_shown]


def _failure_text(report) -> list[str]:
    lines = []
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
    if report.by_kind:
        lines += kinds_text(report.device, report.by_kind, title="At the failure, by kind")
    return lines


def _diagnosis_text(report) -> list[str]:
    diag = report.diagnosis
    if diag is None:
        return []
    lines = _wrap(f"Diagnosis: {diag.summary}", 100, subsequent_indent="  ")
    if report.holders_shown:
        held = ", ".join(holder_words(h) for h in report.holders_shown)
        more = f" and {report.holders_hidden} smaller" if report.holders_hidden else ""
        lines += _wrap(f"  kept alive by names: {held}{more}", 100, subsequent_indent="    ")
    if diag.advice:
        lines.append("Try, most useful first:")
        for i, adv in enumerate(diag.advice[:MAX_ADVICE], 1):
            lines += _wrap(f"  {i}. {adv.text}", 100, subsequent_indent="     ")
            if adv.code:
                lines += [f"       {c}" for c in adv.code.splitlines()[:3]]
    return lines


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
        if len(r.still_held) > 15:
            rest = r.still_held[15:]
            rows.append([f"+{len(rest)} more", format_bytes(sum(b for _, b in rest))])
        if len(r.still_held) > 1:     # the rows add up to it: names that share memory have a row of their own
            rows.append(["total (each storage once)", format_bytes(sum(b for _, b in r.still_held))])
        lines += table(["variable", "size"], rows, right={1})
    lines += [f"note: {n}" for n in r.notes]
    return "\n".join(lines)


def history_text(records) -> str:
    if not records:
        return "No cells recorded: turn recording on with %gpumem --watch."
    rows = [[str(r.cell), r.device, format_bytes(r.allocated_delta, signed=True),
             ("" if r.peak_exact or r.peak is None else "~") + format_bytes(r.peak),
             format_duration(r.duration)] for r in records]
    lines = ["Per-cell memory (%gpumem --watch)"]
    lines += table(["cell", "device", "allocated change", "peak", "duration"], rows, right={0, 2, 3, 4})
    note = approximate_note(records)
    if note:
        lines.append(note)
    return "\n".join(lines)
