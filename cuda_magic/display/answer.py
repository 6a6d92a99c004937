"""What a guard report leads with, in every form: the headline (what failed, where, asked against free,
what came back), the cause in one sentence, and the first things to do as lines to paste. Everything
else (the figures, the by-kind split, the whole diagnosis and advice, each attempt) is folded: `folds`
says whether a report has a folded part. The text, HTML and widget forms draw these words; none of them
decides them again.
"""
from __future__ import annotations

from dataclasses import dataclass

from cuda_magic.display.blackbox_view import line_label
from cuda_magic.display.layout import guard_title, point_words, shorten
from cuda_magic.units import format_bytes

STEPS = 3                 # things to do shown unfolded: the first in full, the next ones as short lines
TOP_LINES = 3             # rows of the black box's by-line table shown unfolded
CODE_WIDTH = 70           # the failing line's code in the headline, at most
LABEL_WIDTH = 80          # an "Or:" line's label, at most: cut at a word (the whole advice is folded)
MORE_TEXT = "%oomguard last"     # what the text form says shows the rest


@dataclass(frozen=True)
class Step:
    """One thing to do: a short label, its full words, and the line (or lines) to paste, where there is one."""

    label: str
    text: str
    code: str | None


def folds(report, running: bool = False) -> bool:
    """Whether the report has a folded part: an out-of-memory error was explained, and the run is over."""
    return report.oom is not None and not running


def where_words(report) -> str:
    """Where it ran out, at the line of code that asked: 'cell line 4 `y = f(x)`'; inside a function the
    black box saw, '`attn = q @ k` at model.py:42 (attend), cell line 4'; else the cell's line and the
    function it called ('cell line 4 `y = f(x)` inside attend')."""
    f = report.failure
    box = report.blackbox
    site = box.failure.site if box is not None and box.failure is not None else None
    if site is not None and site.filename is not None and site.code and not (site.in_cell and f is not None
                                                                              and site.line == f.line):
        return f"`{shorten(site.code, CODE_WIDTH)}` at {line_label(site)}"
    if f is None:
        return ""
    return point_words(f, CODE_WIDTH) or "code outside the cell"


def asked_words(oom, tensor: int | None = None) -> str:
    """'asked 300.00 MiB, 119.99 MiB free of 256.00 MiB'; '' where the message gives no figures. `tensor`: the
    tensor's own request where the black box saw it and the message gives the segment the allocator tried to
    reserve for it instead ('asked 5.38 MiB (a 20.00 MiB segment), ...')."""
    if oom is None or oom.requested is None:
        return ""
    words = f"asked {format_bytes(oom.requested)}"
    if tensor is not None and format_bytes(tensor) != format_bytes(oom.requested):
        words = f"asked {format_bytes(tensor)} (a {format_bytes(oom.requested)} segment)"
    if oom.free is not None:
        words += f", {format_bytes(oom.free)} free"
        if oom.capacity is not None:
            words += f" of {format_bytes(oom.capacity)}"
    elif oom.capacity is not None:
        words += f" on {format_bytes(oom.capacity)}"
    return words


def back_words(report) -> str:
    """'memory released: 16.00 MiB back, no restart needed' (the API's report leaves the restart out)."""
    back = sum(report.reclaimed.values()) if report.reclaimed else 0
    return f"memory released: {format_bytes(back)} back" + ("" if report.api else ", no restart needed")


def trying_words(report, trying) -> str:
    """While a retry runs: the value being tried ('batch_size = 2920, accum_steps = 6')."""
    if not trying or not report.variable:
        return ""
    value, accum = trying
    words = f"{report.variable} = {value}"
    if report.accumulate and accum is not None:
        words += f", {report.accumulate} = {accum}"
    return words


def headline(report, running: bool = False, trying=None) -> str:
    """The report's first line. Running: what runs (the attempt and the value being tried). After an OOM:
    where it failed, asked against free, and what came back; after a retry that fitted: the value."""
    src = report.source
    if running:
        last = report.attempts[-1] if report.attempts else None
        if trying and last is not None and report.variable and last.value == trying[0]:
            # between attempts: the failed one is undone and the model measured before the next value
            what = "ran out of memory" if last.outcome == "oom" else ("fitted as a probe" if last.probe else "fitted")
            then = "keeping it" if last.outcome == "ok" and not last.probe else "choosing the next value"
            return (f"{src}: running the cell; attempt {len(report.attempts)} {what} at "
                    f"{report.variable}={last.value}, {then}")
        attempt = f", attempt {len(report.attempts) + 1}" if report.attempts else ""
        value = trying_words(report, trying)
        return f"{src}: running the cell{attempt}" + (f" at {value}" if value else "")
    if report.outcome not in ("oom", "recovered") or report.oom is None:
        return guard_title(report)
    where = where_words(report)
    asked = asked_words(report.oom, tensor_asked(report))
    failed = "out of memory" + (f" at {where}" if where else "") + (f": {asked}" if asked else "")
    if report.outcome == "recovered":
        # the failure shown (its line, its sizes: the report's `oom` and `failure`) is the last attempt's that
        # ran out: name its value (the next line says what the value was at first)
        var = report.variable
        failed_values = [a.value for a in report.attempts if a.outcome == "oom" and a.value is not None]
        value = failed_values[-1] if failed_values else report.original_value
        return f"{src}: fits at {var}={report.final_value}; ran {failed} at {var}={value}"
    return f"{src}: {failed}; {back_words(report)}"


def tensor_asked(report) -> int | None:
    """The failing tensor's own request, where the black box recorded the failure the message states and the
    message gives what the allocator tried to reserve for it (on CUDA, a whole segment: 20 MiB for a 5 MiB
    tensor), which the headline then labels as the segment."""
    from cuda_magic.oom.diagnosis import tensor_request

    box = report.blackbox
    failed = box.failure if box is not None else None
    return tensor_request(report.oom, failed.requested if failed is not None else None)


def cause(report) -> str:
    """The cause in one sentence (the diagnosis's first); '' without a diagnosis."""
    diag = report.diagnosis
    if diag is None:
        return ""
    return diag.cause or diag.summary


def _label(text: str) -> str:
    """A short label for an advice: its words up to the first colon, else up to the end of its first
    clause, never cut inside a word (the whole text is in the folded part)."""
    head = " ".join(text.split(":", 1)[0].split()).rstrip(".")
    if len(head) <= LABEL_WIDTH:
        return head
    for stop in (" (", "; ", ", ", " - ", " so that ", " instead of ", " because "):   # the first clause that fits
        cut = head.find(stop)
        if 0 < cut <= LABEL_WIDTH:
            clause = head[:cut].rstrip(" ,;")
            if len(clause) >= LABEL_WIDTH // 3:
                return clause
    cut = head.rfind(" ", 0, LABEL_WIDTH)
    return (head[:cut] if cut > 0 else head[:LABEL_WIDTH]).rstrip(" ,;(") + " …"


def kept_step(report) -> Step | None:
    """After a retry that fitted: what happened and what to keep, first (the diagnosis's advice, for the
    failure before it, comes after): 'bs=80 fits: keep it', with the line that sets it for the next runs."""
    var, final = report.variable, report.final_value
    if report.outcome != "recovered" or not var or final is None:
        return None
    failed = list(dict.fromkeys(a.value for a in report.attempts if a.outcome == "oom" and a.value is not None))
    ran_out = f"{var}={', '.join(str(v) for v in failed)} ran out of memory" if failed else ""
    code = f"{var} = {final}"
    text = f"{var}={final} fits: the cell ran once at it" + (f" ({ran_out})" if ran_out else "")
    acc, acc_final = report.accumulate, report.final_accumulate
    if acc and acc_final is not None:
        code += f"\n{acc} = {acc_final}"
        text += (f", and {acc}={acc_final} keeps the effective batch ({var} x {acc} = {final * acc_final}, "
                 f"{report.original_value} x {report.original_accumulate} before)")
    text += f". Both are set now; keep them in the cell that sets them for the next runs:" if acc else \
        f". {var} is set now; keep it in the cell that sets it for the next runs:"
    return Step(f"{var}={final} fits: keep it", text, code)


def steps(report, count: int = STEPS) -> list[Step]:
    """The first things to do, most useful first: after a retry that fitted, the value to keep; then the
    diagnosis's advice."""
    diag = report.diagnosis
    lead = kept_step(report)
    out = [lead] if lead is not None else []
    if diag is not None:
        out += [Step(_label(a.text), a.text, a.code) for a in diag.advice[:count - len(out)]]
    return out


def more_words(report) -> str:
    """The text form's last line: what is folded, and how to see it."""
    folded = ["the figures", "the split by kind", "the whole diagnosis and advice"]
    if report.show_attempts:
        folded.append("each attempt")
    how = "print(report) (a decorated function's is its .last_report)" if report.api else MORE_TEXT
    return f"More ({', '.join(folded)}): {how}"


def details_label(report) -> str:
    """The folded part's summary line in HTML and the widget."""
    parts = ["figures", "by kind", "full diagnosis and advice"]
    if report.show_attempts:
        parts.append(f"{len(report.attempts)} attempts")
    return "Details: " + ", ".join(parts)
