"""What every form draws with: the HTML styles (inline only: no <style> block, no script, nothing
fetched; colours that read on light and dark themes), boxes and tables with every user string escaped,
and the text tables and wrapping of the plain-text form."""
from __future__ import annotations

from html import escape

from cuda_magic.display.layout import UNKNOWN

# Marks (bar parts, chart lines and points): mid tones with 3:1 or more against white and against a dark
# theme's #111111 alike, one colour per meaning across every bar and chart (tests/test_chart_fit.py).
COLORS = {
    "torch_allocated": "#2f6fd6",      # blue
    "torch_cached": "#2894c8",         # sky blue
    "other_this_process": "#9b59d0",   # purple
    "other_processes": "#d9730d",      # orange
    "free": "rgba(128,128,128,.22)",   # a translucent grey: the background's own part, no glare in dark
    UNKNOWN: "#8c8c8c",                # mid grey: the backend does not say
}
# PyTorch's tensors by kind (memory/kinds.py): the same colour for a kind in every view (%gpumem's by-kind
# bar, a report's "at the failure", --predict's "at the peak"); marks like COLORS, none shared with it
KIND_COLORS = {
    "parameters": "#1a9494",       # teal
    "gradients": "#b58900",        # gold
    "optimizer_state": "#c2459b",  # magenta
    "activations": "#a0703c",      # brown
    "other": "#6f8796",            # slate
    "in_failing_op": "#e05a6a",    # coral
    "unseen": "#909080",           # khaki grey
}
PEAK_COLOR = "#6a5acd"                 # slate blue: a peak, in bars, gauges and charts
FAIL_COLOR = "#d93a3a"                 # red: the failing request and the attempts that ran out of memory
CAP_COLOR = "currentColor"             # the capacity or cap line: the text's own colour
# Outcomes are marks too (the headline's bar, a dot before an attempt's outcome, a tick before what came
# back): no one fixed colour has 4.5:1 as text on both white and #111111, and theme variables are not the
# theme's everywhere (ipywidgets 7 in the classic Notebook defines --jp-error-color1 as #F44336, 3.7:1 on
# white), so words keep the page's own text colour and the colour goes on a mark beside them.
OUTCOME_COLORS = {"ok": "#2e9d4a", "oom": FAIL_COLOR, "error": FAIL_COLOR, "interrupted": "#c77c02"}

BOX = ("font-family:system-ui,-apple-system,'Segoe UI',Roboto,sans-serif;font-size:13px;line-height:1.45;"
       "max-width:860px")
BAR = ("display:flex;width:100%;height:18px;border:1px solid rgba(128,128,128,.6);border-radius:3px;"
       "overflow:hidden;box-sizing:border-box;margin:3px 0")
TABLE = "border-collapse:collapse;margin:4px 0 6px 0;font-size:12.5px"
TH = "text-align:left;padding:2px 10px 2px 0;border-bottom:1px solid rgba(128,128,128,.5);font-weight:600"
# a long word (a line of code, a path) may break anywhere so that a table fits a narrow output; figures
# (NUM) never wrap
TD = "text-align:left;padding:2px 10px 2px 0;border-bottom:1px solid rgba(128,128,128,.18);overflow-wrap:anywhere"
NUM = ";text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap"   # figures never wrap
CODE = ("font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;background:rgba(128,128,128,.15);"
        "padding:1px 5px;border-radius:3px")
MUTED = "opacity:.72"
# The style of the element an <svg> goes in. A sanitiser that drops SVG (JupyterLab's for an untrusted
# notebook keeps no <svg>, <text> or <desc> but keeps their text) would leave the labels run
# together ("064 MiB128 MiB"): at font size 0 they take no room, and the chart's text line (chart.caption),
# inside the SVG's <desc> (never drawn where the SVG renders), is what stays, in its own font size.
CHART_BOX = "font-size:0;line-height:0"


def box(inner: str, cls: str = "") -> str:
    classes = f"cuda-magic {cls}".strip()
    return f'<div class="{classes}" style="{BOX}">{inner}</div>'


def html_table(headers: list[str], rows: list[list[str]], numeric: set[int] = frozenset(), cls: str = "",
               raw: set[int] = frozenset()) -> str:
    """A table; cells are escaped here, except those in the `raw` columns (already HTML)."""
    head = "".join(f'<th style="{TH}{NUM if i in numeric else ""}">{escape(h)}</th>' for i, h in enumerate(headers))
    body = "".join(
        "<tr>" + "".join(f'<td style="{TD}{NUM if i in numeric else ""}">{c if i in raw else escape(c)}</td>'
                         for i, c in enumerate(row)) + "</tr>"
        for row in rows)
    cls_attr = f' class="{cls}"' if cls else ""
    return f'<table{cls_attr} style="{TABLE}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


# ---- text -----------------------------------------------------------------------------------------

def table(headers: list[str], rows: list[list[str]], right: set[int] = frozenset(), indent: str = "  ") -> list[str]:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]

    def line(cells):
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return (indent + "  ".join(parts)).rstrip()

    return [line(headers)] + [line(r) for r in rows]


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
