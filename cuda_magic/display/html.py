"""HTML forms of the records: for nbconvert, GitHub's viewer, and the text/html of widget outputs.

Self-contained: inline styles only (no <style> block, no script, nothing fetched), colours that read
on light and dark themes, every user string escaped. The class names (cuda-magic-bar,
cuda-magic-part-<part>, ...) are the same as the widget's, so one browser check finds both.
"""
from __future__ import annotations

from html import escape

from cuda_magic.devices.readings import PARTS
from cuda_magic.display import answer as A
from cuda_magic.display.blackbox_view import blackbox_html as box_html, by_line_html, by_line_title, timeline_html
from cuda_magic.display.blackbox_view import rows_shown
from cuda_magic.display.elements import (BAR, CHART_BOX, CODE, COLORS, KIND_COLORS, MUTED, OUTCOME_COLORS,
                                         PEAK_COLOR, box, html_table)
from cuda_magic.display.layout import approximate_note, kind_segments, shown_kinds
from cuda_magic.display.layout import folded_graphs
from cuda_magic.memory.kinds import IN_FAILING_OP, KIND_LABELS, UNSEEN
from cuda_magic.units import format_bytes, format_duration
from cuda_magic.display.layout import (UNKNOWN, BAR_PARTS, BAR_LABELS, MAX_ADVICE, bar_segments, bar_total,
                                       percentages, in_use, peak_words, tensor_name, short_dtype, shape_text,
                                       hidden_tensors, oom_items, oom_title, guard_title, value_words, value_reason,
                                       reclaimed_words, attempt_rows, attempt_headers, watch_line)

def swatch(part: str) -> str:
    return (f'<span style="display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:4px;'
            f'vertical-align:-1px;background:{COLORS[part]};border:1px solid rgba(128,128,128,.5)"></span>')


def segment_title(dev, part: str, nbytes: int) -> str:
    total = bar_total(dev)
    return f"{BAR_LABELS[part]}: {format_bytes(nbytes)} ({100.0 * nbytes / total:.1f}% of {dev.key})"


def bar_html(dev) -> str:
    """Stacked bar of the capacity; the segments' widths add up to 100%."""
    segments = bar_segments(dev)
    if not segments:
        return ""
    widths = percentages([b for _, b in segments])
    divs = "".join(
        f'<div class="cuda-magic-part-{part}" title="{escape(segment_title(dev, part, b))}" '
        f'style="width:{w}%;background:{COLORS[part]};height:100%"></div>'
        for (part, b), w in zip(segments, widths))
    return f'<div class="cuda-magic-bar" style="{BAR}">{divs}</div>'


def legend_html(dev) -> str:
    shown = dict(bar_segments(dev))
    total = bar_total(dev)
    items = []
    for part in BAR_PARTS:
        value = shown.get(part) if part in (UNKNOWN, "free") else getattr(dev, part)
        if part == UNKNOWN and value is None:
            continue
        share = f" {100.0 * value / total:.1f}%" if value and total else ""
        items.append(f'<span style="margin-right:14px;white-space:nowrap">{swatch(part)}{escape(BAR_LABELS[part])} '
                     f'<b>{format_bytes(value)}</b><span style="{MUTED}">{share}</span></span>')
    return f'<div class="cuda-magic-legend">{"".join(items)}</div>'


def device_html(dev) -> str:
    cap = format_bytes(dev.capacity) if dev.capacity is not None else "capacity not known"
    peak = escape(peak_words(dev.peak, dev.peak_exact))
    notes = "".join(f'<div style="{MUTED}">note: {escape(n)}</div>' for n in dev.notes)
    return (f'<div class="cuda-magic-device" style="margin:6px 0 10px 0">'
            f'<div><b>{escape(dev.key)}</b> {escape(dev.name)} <span style="{MUTED}">· {cap}</span></div>'
            f'{bar_html(dev)}{legend_html(dev)}<div class="cuda-magic-peak">{peak}</div>{notes}</div>')


def tensor_rows(records) -> list[list[str]]:
    return [[tensor_name(t), shape_text(t.shape), short_dtype(t.dtype), t.device, format_bytes(t.nbytes),
             "yes" if t.grad_fn else ""] for t in records]


def tensors_html(snap) -> str:
    shown = snap.tensor_list[: snap.top]
    count, nbytes = hidden_tensors(snap)
    if not shown:
        return "<div>No live tensors found.</div>" if count == 0 else ""
    head = f"<div><b>Top {len(shown)} tensors</b> <span style=\"{MUTED}\">of {len(shown) + count} storages</span></div>"
    more = f'<div style="{MUTED}">+{count} more ({format_bytes(nbytes)})</div>' if count else ""
    table = html_table(["names", "shape", "dtype", "device", "size", "grad_fn"],
                       tensor_rows(folded_graphs(shown)), {4}, cls="cuda-magic-tensors")
    return head + table + more


def processes_html(processes) -> str:
    if not processes:
        return "<div>No GPU processes listed.</div>"
    rows = [[p.device, str(p.pid), p.user or "", p.name or "", format_bytes(p.used),
             "this process" if p.this_process else ""] for p in processes]
    return ("<div><b>Processes using the GPUs</b></div>"
            + html_table(["device", "pid", "user", "name", "memory", ""], rows, {1, 4}, cls="cuda-magic-processes"))




def _kinds_bar(segments: list[tuple[str, int]], total: int) -> str:
    """A stacked bar of PyTorch's tensors by kind (`kind_segments`); the segments' widths add up to 100%."""
    divs = "".join(
        f'<div class="cuda-magic-kind-{k}" title="{escape(KIND_LABELS[k])}: {format_bytes(b)} '
        f'({100.0 * b / total:.1f}%)" style="width:{w}%;background:{KIND_COLORS[k]};height:100%"></div>'
        for (k, b), w in zip(segments, percentages([b for _, b in segments])))
    return f'<div class="cuda-magic-kinds-bar" style="{BAR}">{divs}</div>'


def legend_items_html(entries: list[tuple[str, str, int]]) -> str:
    """A legend: a swatch, the label, the bytes and the share of the total, for each (label, colour, bytes)."""
    total = sum(b for _, _, b in entries) or 1
    return "".join(
        f'<span style="margin-right:14px;white-space:nowrap"><span style="display:inline-block;width:10px;'
        f'height:10px;border-radius:2px;margin-right:4px;vertical-align:-1px;background:{color}">'
        f'</span>{escape(label)} <b>{format_bytes(b)}</b><span style="{MUTED}"> '
        f'{100.0 * b / total:.1f}%</span></span>' for label, color, b in entries)


def kinds_html(key: str, kinds: dict[str, int], title: str = "By kind") -> str:
    """One device's tensors by kind: the stacked bar and a legend with each kind's bytes and share."""
    segments = kind_segments(kinds)
    if not segments:
        return ""
    total = sum(b for _, b in segments)
    items = legend_items_html([(KIND_LABELS[k], KIND_COLORS[k], b) for k, b in segments])
    return (f'<div class="cuda-magic-kinds" style="margin:6px 0 10px 0"><div><b>{escape(title)}</b> on '
            f'{escape(key)} <span style="{MUTED}">· {format_bytes(total)} in PyTorch\'s tensors</span></div>'
            f'{_kinds_bar(segments, total)}<div class="cuda-magic-kinds-legend">{items}</div></div>')


def snapshot_kinds_html(snap) -> str:
    return "".join(kinds_html(key, kinds) for key, kinds in shown_kinds(snap))


def snapshot_html(snap) -> str:
    notes = "".join(f'<div style="{MUTED}">note: {escape(n)}</div>' for n in snap.notes)
    devices = "".join(device_html(d) for d in snap.device_list)
    procs = processes_html(snap.processes) if snap.processes else ""
    return box(notes + devices + snapshot_kinds_html(snap) + tensors_html(snap) + procs, "cuda-magic-snapshot")


def diff_html(d) -> str:
    seconds = max(0.0, d.after.taken_at - d.before.taken_at)
    parts = [f"<div><b>Changes since the previous snapshot</b> <span style=\"{MUTED}\">"
             f"({format_duration(seconds)} ago)</span></div>"]
    rows = []
    for delta in d.device_deltas:
        for part in PARTS:
            if delta.changes.get(part):
                rows.append([delta.key, BAR_LABELS[part], format_bytes(delta.changes[part], signed=True)])
    parts.append(html_table(["device", "part", "change"], rows, {2}) if rows else "<div>No change per device.</div>")
    for title, records in (("appeared", d.appeared), ("went", d.went)):
        if records:
            top = sorted(records, key=lambda t: t.nbytes, reverse=True)
            parts.append(f"<div><b>Tensors {title}</b>: {len(records)} "
                         f"({format_bytes(sum(t.nbytes for t in records))})</div>")
            parts.append(html_table(["names", "shape", "dtype", "device", "size", "grad_fn"],
                                    tensor_rows(top[:10]), {4}))
            if len(top) > 10:
                parts.append(f'<div style="{MUTED}">+{len(top) - 10} more</div>')
    if not d.appeared and not d.went:
        parts.append("<div>No tensors appeared or went.</div>")
    return box("".join(parts), "cuda-magic-diff")


# ---- %%oomguard ---------------------------------------------------------------------------------

def level_bar(value: int | None, capacity: int | None, color: str) -> str:
    """A bar filled to value/capacity: how before, peak and after compare on one device."""
    if value is None or not capacity:
        return f'<div class="cuda-magic-bar" style="{BAR};opacity:.4"></div>'
    filled = min(100.0, round(100.0 * value / capacity, 3))
    return (f'<div class="cuda-magic-bar" style="{BAR}">'
            f'<div style="width:{filled}%;background:{color};height:100%"></div>'
            f'<div style="width:{round(100.0 - filled, 3)}%;background:{COLORS["free"]};height:100%"></div></div>')


def guard_devices_html(report, running: bool = False) -> str:
    """Before, peak and after per device, as bars against the capacity; while the cell runs, before only
    (the live gauge shows the rest)."""
    before = {d.key: d for d in report.before}
    after = {d.key: d for d in report.after}
    keys = list(before) + [k for k in after if k not in before]
    blocks = []
    for key in keys:
        b, a = before.get(key), after.get(key)
        dev = a or b
        rows = []
        for label, value, color in (("before", in_use(b) if b else None, COLORS["torch_allocated"]),
                                    ("peak", report.peaks.get(key), PEAK_COLOR),
                                    ("after", in_use(a) if a else None, COLORS["torch_allocated"])):
            if running and label != "before":
                continue
            rows.append(
                f'<div style="display:flex;align-items:center;gap:8px">'
                f'<span style="width:44px">{label}</span>'
                f'<div style="flex:1">{level_bar(value, dev.capacity, color)}</div>'
                f'<span style="width:90px;text-align:right;font-variant-numeric:tabular-nums">'
                f'<b>{format_bytes(value)}</b></span></div>')
        cap = format_bytes(dev.capacity) if dev.capacity is not None else "capacity not known"
        measure = "PyTorch allocated" if dev.torch_allocated is not None else "the process's memory"
        blocks.append(f'<div style="margin:4px 0 8px 0"><div><b>{escape(key)}</b> {escape(dev.name)} '
                      f'<span style="{MUTED}">· {cap} · in use = {measure}</span></div>{"".join(rows)}</div>')
    return "".join(blocks)


def attempts_html(report) -> str:
    if not report.show_attempts:
        return ""
    shown = report.attempts_shown
    rows = attempt_rows(shown, report.variable)
    col = len(rows[0]) - 4                       # the outcome column
    for row, pair in zip(rows, shown):
        if isinstance(pair, int):
            continue
        color = OUTCOME_COLORS.get(pair[1].outcome, "currentColor")
        row[col] = f'<span style="color:{color}">●</span> {escape(row[col])}'
    table = html_table(attempt_headers(report.variable), rows, {0, col + 1, col + 2, col + 3},
                       cls="cuda-magic-attempts-table", raw={col})
    return '<div style="margin-top:6px"><b>Attempts</b></div>' + table


def diagnosis_html(report) -> str:
    out = []
    f = report.failure
    if f is not None:
        inside = f" (inside {escape(f.function)})" if f.function else ""
        code = f'<code style="{CODE}">{escape(f.text.strip())}</code>'
        if f.line is not None:
            out.append(f'<div style="margin-top:6px">Failed at cell line {f.line}{inside}: {code}</div>')
        else:
            where = escape(f.function or "code outside the cell") + (f" ({escape(f.filename)})" if f.filename else "")
            out.append(f'<div style="margin-top:6px">Failed in {where}</div>')
    if report.oom is not None:
        items = oom_items(report.oom)
        out.append(f"<div><b>{escape(oom_title(report.oom))}</b></div>")
        if items:
            # one figure a row: eight columns side by side do not fit a narrow output
            out.append(html_table(["figure", "size"], [[k, format_bytes(v)] for k, v in items], {1},
                                  cls="cuda-magic-oom"))
    if report.by_kind:
        out.append(kinds_html(report.device, report.by_kind, title="At the failure, by kind"))
    diag = report.diagnosis
    if diag is not None:
        out.append(f'<div style="margin-top:4px"><b>Diagnosis:</b> {rich(diag.summary)}</div>')
        if report.holders_shown:
            held = ", ".join(
                f'<code style="{CODE}">{escape(h.description)}</code> {format_bytes(h.bytes)}'
                + (f' <span style="{MUTED}">(+{format_bytes(h.shared)} shared with {escape(", ".join(h.shared_with[:3]))})</span>'
                   if h.shared else "") for h in report.holders_shown)
            more = f" and {report.holders_hidden} smaller" if report.holders_hidden else ""
            out.append(f"<div>Kept alive by names: {held}{more}</div>")
        if diag.advice:
            items = "".join(
                f'<li style="margin:2px 0">{rich(a.text)}'
                + (_code_html(a.code) if a.code else "") + "</li>"
                for a in diag.advice[:MAX_ADVICE])
            out.append(f'<div style="margin-top:4px"><b>Try, most useful first:</b></div>'
                       f'<ol style="margin:2px 0 4px 0;padding-left:22px">{items}</ol>')
    return "".join(out)


def _code_html(code: str) -> str:
    """Advice's code: one line inline; several (a cell to type, an indented block) kept as lines."""
    # a block of its own, after the sentence that introduces it (an inline block sat mid-sentence where the
    # words wrapped around it)
    if "\n" not in code:
        return f'<div style="margin:2px 0"><code style="{CODE}">{escape(code)}</code></div>'
    return (f'<pre class="cuda-magic-code" style="{CODE};display:block;width:fit-content;max-width:100%;'
            f'box-sizing:border-box;margin:3px 0;white-space:pre-wrap"><code>{escape(code)}</code></pre>')


def reclaimed_html(report) -> str:
    return (f'<div style="font-weight:600"><span style="color:{OUTCOME_COLORS["ok"]}">✔</span> '
            f'{escape(reclaimed_words(report))}</div>')


def rich(text: str) -> str:
    """Words with `code` in backticks: escaped, the backticked parts as <code>."""
    parts = escape(text).split("`")
    if len(parts) % 2 == 0:                      # an odd backtick: leave them all as they are
        return escape(text)
    return "".join(f'<code style="{CODE}">{p}</code>' if i % 2 else p for i, p in enumerate(parts))


def guard_title_html(report, running: bool = False, trying=None) -> str:
    mark = "rgba(128,128,128,.6)" if running else OUTCOME_COLORS.get("ok" if report.outcome == "recovered" else report.outcome,
                                                                                    "currentColor")
    # while the cell runs the headline names the attempt running now and its value: the value line (the
    # original value until the run ends) would contradict it
    words = value_words(report) if not running else None
    limit = f' <span style="{MUTED}">limit {format_bytes(report.limit)}</span>' if report.limit is not None else ""
    sub = f'<div>{escape(words)}</div>' if words else ""
    why = value_reason(report)
    if why and not running and not A.folds(report):
        sub += f'<div style="{MUTED}">{escape(why)}</div>'
    head = rich(A.headline(report, running, trying))
    # the words in the page's own colour (contrast in every theme); the outcome's colour on the bar beside them
    return (f'<div class="cuda-magic-headline" style="font-weight:600;border-left:4px solid {mark};'
            f'padding-left:6px">{head}{limit}</div>{sub}')


def answer_html(report) -> str:
    """The cause in one sentence and the things to do, the first with its line to paste."""
    out = []
    reason = A.cause(report)
    if reason:
        out.append(f'<div style="margin-top:4px"><b>Cause:</b> {rich(reason)}</div>')
    for i, step in enumerate(A.steps(report)):
        if i == 0:
            out.append(f'<div style="margin-top:4px"><b>Do this:</b> {rich(step.text)}'
                       + (_code_html(step.code) if step.code else "") + "</div>")
        else:
            code = (f' <code style="{CODE}">{escape(step.code.splitlines()[0])}</code>' if step.code else "")
            out.append(f"<div>Or: {rich(step.label)}{code}</div>")
    return "".join(out)


def details_html(report, full: bool = False) -> str:
    """Everything the answer leaves out, folded in <details> (no script: it opens in every front end)."""
    why = value_reason(report)
    inner = [guard_devices_html(report), attempts_html(report),
             f'<div style="{MUTED}">{escape(why)}</div>' if why else "", diagnosis_html(report)]
    bb = report.blackbox
    shown = len(rows_shown(bb, A.TOP_LINES)[0]) if report.show_blackbox and bb is not None else 0
    if shown and shown < len(bb.by_line):
        # the lines the unfolded table left out, not the table again
        inner.append(f"<div><b>{escape(by_line_title(bb))}</b>, after the first {shown}</div>"
                     + by_line_html(bb, start=shown))
    if report.show_reclaimed:
        inner.append(reclaimed_html(report))
    return (f'<details class="cuda-magic-details" style="margin-top:6px"{" open" if full else ""}>'
            f'<summary style="{SUMMARY}">{escape(A.details_label(report))}</summary>'
            f'<div style="padding-left:12px">{"".join(inner)}</div></details>')


# the disclosure marker in every front end: the classic Notebook's style sheet (Bootstrap 3's normalize)
# makes <summary> a block, which has no marker; a list item has one
SUMMARY = "display:list-item;cursor:pointer"


def notes_html(report) -> str:
    """What a rollback could not undo, and the warnings."""
    sign = f'<span style="color:{OUTCOME_COLORS["interrupted"]}">⚠</span>'
    return "".join([f"<div>{sign} not undone: {escape(w)}</div>" for w in report.not_undone]
                   + [f"<div>{sign} warning: {escape(w)}</div>" for w in report.warnings_shown])


def blackbox_html(report, running: bool = False) -> str:
    """The report's black box (display/blackbox_view.py), where the report says to show it: after an OOM
    its chart and first lines (the headline names the failing line), else all of it."""
    if not report.show_blackbox or running:
        return ""
    if A.folds(report):
        return box(timeline_html(report.blackbox, rows=A.TOP_LINES, failing=False), "cuda-magic-blackbox")
    return box_html(report.blackbox)


def guard_html(report, running: bool = False, *, full: bool = False, trying=None) -> str:
    title = guard_title_html(report, running, trying)
    if not A.folds(report, running):
        parts = [title, guard_devices_html(report, running), attempts_html(report), blackbox_html(report, running),
                 diagnosis_html(report)]
        if report.show_reclaimed and not running:
            parts.append(reclaimed_html(report))
        parts.append(notes_html(report))
        return box("".join(parts), "cuda-magic-guard")
    parts = [title, f'<div class="cuda-magic-diagnosis">{answer_html(report)}</div>', blackbox_html(report),
             notes_html(report), details_html(report, full)]
    return box("".join(parts), "cuda-magic-guard")


# ---- %freecuda and --watch --------------------------------------------------------------------

def release_html(r) -> str:
    parts = ["<div><b>Dry run:</b> nothing was changed.</div>"] if r.dry_run else []
    if r.freed:
        verb = "Would free" if r.dry_run else "Freed"
        freed = ", ".join(f"<b>{format_bytes(b)}</b> on {escape(k)}" for k, b in r.freed.items())
        parts.append(f"<div>{verb} {freed}</div>")
    elif not r.dry_run:
        parts.append("<div>Freed nothing.</div>")
    for (done, would), names in ((("Dropped", "Would drop"), r.dropped), (("Deleted", "Would delete"), r.deleted),
                                 (("Moved to the CPU", "Would move to the CPU"), r.offloaded)):
        if names:
            listed = ", ".join(f'<code style="{CODE}">{escape(n)}</code>' for n in names)
            parts.append(f"<div>{would if r.dry_run else done}: {listed}</div>")
    if r.still_held:
        parts.append("<div><b>Still holding device memory</b> (largest first)</div>")
        rows = [[n, format_bytes(b)] for n, b in r.still_held]
        if len(r.still_held) > 1:     # the rows add up to it: names that share memory have a row of their own
            rows.append(["total (each storage once)", format_bytes(sum(b for _, b in r.still_held))])
        parts.append(html_table(["variable", "size"], rows, {1}))
    parts += [f'<div style="{MUTED}">note: {escape(n)}</div>' for n in r.notes]
    return box("".join(parts), "cuda-magic-release")


def watch_rows(records) -> list[list[str]]:
    return [[str(r.cell), r.device, format_bytes(r.allocated_delta, signed=True),
             ("" if r.peak_exact or r.peak is None else "~") + format_bytes(r.peak), format_duration(r.duration)]
            for r in records]


def history_html(records, chart: str = "") -> str:
    """The --watch records as a table, under `chart` (an SVG of them, display.history) when given."""
    if not records:
        return box("<div>No cells recorded: turn recording on with <code>%gpumem --watch</code>.</div>")
    table = html_table(["cell", "device", "allocated change", "peak", "duration"], watch_rows(records), {0, 2, 3, 4})
    note = approximate_note(records)
    approx = f'<div style="{MUTED}">{escape(note)}</div>' if note else ""
    chart = f'<div class="cuda-magic-history-chart" style="{CHART_BOX}">{chart}</div>' if chart else ""
    return box(chart + table + approx, "cuda-magic-watch")


def watch_html(record) -> str:
    """One --watch line, for a single cell."""
    return box(f'<div style="font-size:12.5px">{escape(watch_line(record))}</div>', "cuda-magic-watch")
