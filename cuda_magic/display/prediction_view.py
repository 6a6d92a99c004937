"""A prediction (`%%oomguard --predict`) as text and HTML: the answer first (fits or not, against what,
by how much; with -r the largest value and the line to paste), then the peak by kind, the black box of the
fake run (its chart and top lines), and what the figure covers (where it stopped, the steps it stopped
after, the stand-in values, what it counts)."""
from __future__ import annotations

from html import escape

from cuda_magic.display.blackbox_view import timeline_html, timeline_text
from cuda_magic.display.elements import BAR, CODE, MUTED, OUTCOME_COLORS, box
from cuda_magic.display.elements import KIND_COLORS as ALL_KIND_COLORS
from cuda_magic.display.html import legend_items_html, rich
from cuda_magic.display.layout import percentages
from cuda_magic.fakerun.fake_device import KINDS
from cuda_magic.units import format_bytes

TOP_LINES = 3
# a fake run's kinds (fakerun/fake_device.py) in the colours %gpumem's by-kind bar gives the same kinds
# (elements.KIND_COLORS): one colour per kind in every view
KIND_COLORS = {k: ALL_KIND_COLORS[name] for k, name in (
    ("parameters", "parameters"), ("gradients", "gradients"), ("optimizer state", "optimizer_state"),
    ("activations", "activations"), ("the rest", "other"))}


def _on(p) -> str:
    name = f" ({p.device_name})" if p.device_name and p.device_name != p.device else ""
    return f"{p.device}{name}"


def _against(p) -> str:
    return f"the {format_bytes(p.capacity)} cap" if p.limited else format_bytes(p.capacity)


def _at(p) -> str:
    if p.variable is None:
        return ""
    acc = f", {p.accumulate} = {p.accumulation}" if p.accumulate is not None else ""
    return f" at {p.variable} = {p.value}{acc}"


def _reserved(p) -> str:
    """', reserving R' where the allocator reserves more than the tensors take."""
    extra = p.reserved - p.peak
    return f" (the allocator reserving {format_bytes(p.reserved)})" if extra > 0.005 * max(p.peak, 1) else ""


def headline(p) -> str:
    """One line: whether the cell fits, its predicted peak against the capacity, and by how much."""
    head = "Predicted"
    need = p.peak
    if not p.complete:
        covered = f"up to line {p.stop_line}" if p.stop_line else "up to where it stopped"
        if p.fits is False:
            return (f"{head}{_at(p)}: will not fit on {_on(p)}: at least {format_bytes(p.peak)}{_reserved(p)} "
                    f"of {_against(p)} {covered}")
        reached = "reached" if p.endless else "at least"
        return f"{head}{_at(p)}: not known whether it fits on {_on(p)}: {reached} {format_bytes(p.peak)} {covered}"
    if p.capacity is None:
        return f"{head}{_at(p)}: peak {format_bytes(p.peak)}{_reserved(p)} on {_on(p)}"
    if p.fits:
        return (f"{head}{_at(p)}: fits on {_on(p)}: peak {format_bytes(p.peak)}{_reserved(p)} of {_against(p)}, "
                f"{format_bytes(p.capacity - need)} to spare")
    if p.runs_out is not None and need <= p.capacity:
        asked, allocated, reserved = p.runs_out
        return (f"{head}{_at(p)}: will not fit on {_on(p)}: peak {format_bytes(p.peak)} of {_against(p)}, but "
                f"a request of {format_bytes(asked)} finds no free block with {format_bytes(reserved)} reserved "
                f"({format_bytes(reserved - allocated)} of it cached in pieces too small: fragmentation)")
    return (f"{head}{_at(p)}: will not fit on {_on(p)}: peak {format_bytes(p.peak)}{_reserved(p)} of "
            f"{_against(p)}, {format_bytes(need - p.capacity)} over")


def stop_words(p) -> str | None:
    if p.complete:
        return None
    where = f"line {p.stop_line}" if p.stop_line else "a line it could not place"
    code = f" `{p.stop_code}`" if p.stop_code else ""
    inner = f" (in {p.stop_where})" if p.stop_where else ""
    if p.endless:
        return (f"The fake run stopped at {where}{code}{inner}: {p.stop_reason}. Its figure is what it reached "
                "by then, more steps of that loop than a real run may take: it does not say whether the cell fits.")
    return (f"The fake run stopped at {where}{code}{inner}: {p.stop_reason}. The figure covers the cell up to "
            "there, not what comes after.")


def largest_words(p) -> tuple[str, str | None] | None:
    """(words, the line to paste) for -r; None without -r."""
    if p.variable is None:
        return None
    var = p.variable
    if p.independent:
        return (f"The peak does not change with {var}: its memory does not depend on {var}.", None)
    if p.largest is None:
        if not p.complete:
            return (f"No largest {var}: the fake run did not reach the end of the cell.", None)
        if p.capacity is None:
            return (f"No largest {var}: no capacity to fit in.", None)
        return (f"Even {var} = {min(r.value for r in p.runs if r.value is not None)} does not fit.", None)
    acc = ""
    eq, sep = ("=", ", ") if p.api else (" = ", "; ")       # a call's keywords, or a cell's assignments
    paste = f"{var}{eq}{p.largest}"
    if p.accumulate is not None and p.largest_accumulation is not None:
        acc = (f", with {p.accumulate} = {p.largest_accumulation} (effective batch "
               f"{p.largest * p.largest_accumulation}, was {p.value * p.accumulation})")
        paste += f"{sep}{p.accumulate}{eq}{p.largest_accumulation}"
    peak = f", predicted peak {format_bytes(p.largest_peak)}" if p.largest_peak is not None else ""
    return (f"Largest {var} that fits: {p.largest}{acc}{peak} (with the retry's margin)", paste)


def kinds_words(p) -> str:
    parts = [f"{k} {format_bytes(p.by_kind[k])}" for k in KINDS if p.by_kind.get(k)]
    return "At the peak: " + " · ".join(parts) if parts else ""


def cover_words(p) -> list[str]:
    """What the figure covers and how it was made."""
    out = []
    if p.enough:
        out.append(f"Predicted from the cell's first steps: it stopped {p.enough} (a training step's peak "
                   "repeats once the optimizer state exists); a cell whose memory grows step by step (a list of "
                   "losses kept with their graphs) grows past this.")
    if p.stand_ins:
        out.append(f"`.item()` took stand-in values at {', '.join(p.stand_ins[:4])} (so that logging goes on).")
    if p.amp:
        out.append(f"Under torch.autocast ({p.amp}).")
    out.append(f"Counts {p.allocator}.")
    out += list(p.notes)
    runs = len(p.runs)
    out.append(f"Nothing ran on the device: {runs} fake run{'s' if runs != 1 else ''} on fake tensors, "
               f"{p.seconds:.2f} s; nothing the cell did stays.")
    return out


# ---- text ------------------------------------------------------------------------------------------

def prediction_text(p) -> str:
    lines = [headline(p)]
    stop = stop_words(p)
    if stop:
        lines.append(stop)
    largest = largest_words(p)
    if largest:
        lines.append(largest[0])
        if largest[1]:
            lines.append(f"    {largest[1]}")
    kinds = kinds_words(p)
    if kinds:
        lines.append(kinds)
    if p.blackbox is not None and p.blackbox.by_line:
        lines.append(timeline_text(p.blackbox, rows=TOP_LINES, failing=False))
    lines += [f"note: {w}" for w in cover_words(p)]
    return "\n".join(lines)


# ---- HTML ------------------------------------------------------------------------------------------

def kinds_html(p) -> str:
    items = [(k, p.by_kind[k]) for k in KINDS if p.by_kind.get(k)]
    if not items:
        return ""
    divs = "".join(f'<div title="{escape(k)}: {format_bytes(b)}" style="width:{w}%;background:{KIND_COLORS[k]};'
                   f'height:100%"></div>' for (k, b), w in zip(items, percentages([b for _, b in items])))
    legend = legend_items_html([(k, KIND_COLORS[k], b) for k, b in items])
    return (f'<div class="cuda-magic-predicted-kinds" style="margin:6px 0"><b>At the peak</b>'
            f'<div style="{BAR}">{divs}</div><div>{legend}</div></div>')


def prediction_html(p) -> str:
    fits = p.fits
    mark = OUTCOME_COLORS["ok"] if fits else (OUTCOME_COLORS["oom"] if fits is False else OUTCOME_COLORS["interrupted"])
    parts = [f'<div class="cuda-magic-headline" style="font-weight:600;border-left:4px solid {mark};'
             f'padding-left:6px">{rich(headline(p))}</div>']
    stop = stop_words(p)
    if stop:
        parts.append(f"<div>{rich(stop)}</div>")
    largest = largest_words(p)
    if largest:
        paste = (f'<div><code style="{CODE}">{escape(largest[1])}</code></div>' if largest[1] else "")
        parts.append(f'<div style="margin-top:4px"><b>{escape(largest[0])}</b>{paste}</div>')
    parts.append(kinds_html(p))
    if p.blackbox is not None and p.blackbox.by_line:
        parts.append(timeline_html(p.blackbox, rows=TOP_LINES, failing=False))
    parts += [f'<div style="{MUTED}">{rich(w)}</div>' for w in cover_words(p)]
    return box("".join(parts), "cuda-magic-prediction")

