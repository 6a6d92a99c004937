"""The out-of-memory report as a person sees it in a real front end (JupyterLab: lab.py, the classic Notebook:
classic.py), for test_report_view.py (issue 21's browser acceptance).

One notebook (`cells`): a model and an optimizer on a 256 MiB simulated GPU, a `%%oomguard --no-raise`
training step that runs out of memory (its report), and the same step under `%%oomguard -r batch_size -a
accum_steps`, which recovers (attempt 1 fails in well under a second, attempt 2 runs several seconds).
`check_report_view` runs it once per theme and measures, in the page:

- while the retry runs attempt 2: the widget lists attempt 1 ("out of memory") and its header says
  "attempt 2 at batch_size = <the value attempt 2 ran at>", and no header names an attempt at a value it
  did not run at (polled in the DOM, every 50 ms, until the cell finishes);
- at each viewport width (1280 and 800 px, JupyterLab's file browser open): the report's height with its
  details folded, its first lines (headline, "Cause:", "Do this:" with the line to paste), that nothing
  reaches past its output area's right edge (every element; the output area does not scroll sideways),
  that the charts (inline SVG) are fully visible, and the WCAG contrast of the headline and of the
  timeline's lines against the background they are drawn on;
- a screenshot of the report's output per width and theme;
- for the record only (not checked): the same overflow figures with every report's details unfolded.

Every figure measured goes to `<artifacts>/report-view-<front>-<theme>.json`.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from lab import open_browser, save_element_screenshot, start_all_cells, wait_until_finished
from seeing import REPO_ROOT, artifacts, write_notebook

WIDTHS = (1280, 800)
HEIGHT = 900                     # the viewport's height at every width
MAX_REPORT_PX = 600              # the folded report's height at 1280 px, at most
HEADLINE = "out of memory at cell line 3"
PASTE = "%%oomguard -r batch_size -a accum_steps"
TEXT_CONTRAST, MARK_CONTRAST = 4.5, 3.0     # WCAG: normal text; graphical objects
THEMES = {"light": "JupyterLab Light", "dark": "JupyterLab Dark"}
NO_RAISE_CELL, RETRY_CELL = 3, 4            # code cells, from 0

STEP = ("for step in range(accum_steps):\n"
        "    x = torch.randn(batch_size, 512)\n"
        "    loss = model(x).pow(2).mean() / accum_steps\n"
        "    loss.backward()\n"
        "opt.step(); opt.zero_grad()")


def cells() -> list[str]:
    return [
        "%load_ext cuda_magic",
        "%gpumem --simulate 256MiB -q",
        "import torch\nfrom torch import nn\n"
        "model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512))\n"
        "opt = torch.optim.Adam(model.parameters())\n"
        "batch_size = 32768\naccum_steps = 1\ntorch.manual_seed(0)",
        "%%oomguard --no-raise\n" + STEP,           # out of memory: 256 MiB asked
        f"{PASTE}\n" + STEP,                       # attempt 1 out of memory, attempt 2 fits (several seconds)
        "print(batch_size, accum_steps)",
    ]


# Per front end: a code cell, and the box an output's content is drawn in (the one that would scroll).
FRONTS = {
    "JupyterLab": {"cell": ".jp-Notebook .jp-CodeCell", "area": ".jp-OutputArea-output"},
    "Notebook": {"cell": "#notebook .cell.code_cell", "area": ".output_subarea"},
}

# What the retry cell's widget shows now (polled while it runs): whether the cell still runs, the header,
# the attempts table's rows.
LIVE_JS = """
([cellSel, index]) => {
  const cell = document.querySelectorAll(cellSel)[index];
  if (!cell) return null;
  const prompt = cell.querySelector('.jp-InputArea-prompt, .input_prompt');
  const widget = cell.querySelector('.cuda-magic-widget');
  const headline = widget && widget.querySelector('.cuda-magic-headline');
  const rows = widget ? [...widget.querySelectorAll('.cuda-magic-attempts tbody tr')]
                          .filter(r => r.checkVisibility()).map(r => r.innerText.replace(/\\s+/g, ' ').trim()) : [];
  return {running: !!prompt && prompt.textContent.includes('*'),
          done: !!prompt && /\\[\\d+\\]/.test(prompt.textContent),
          prompt: prompt ? prompt.textContent.trim() : '',
          widget: !!widget,
          headline: headline && headline.checkVisibility() ? headline.innerText.trim() : null,
          rows};
}
"""

# Colours, as the browser computes them, and their WCAG contrast. A colour is composited over what is
# behind it: the ancestors' backgrounds up to the first opaque one (the page's white where none is), each
# element's opacity multiplied in.
COLOR_JS = r"""
window.__cmColor = (() => {
  const parse = s => {
    const m = /rgba?\(([^)]*)\)/.exec(s || '');
    if (!m) return null;
    const p = m[1].split(/[\s,\/]+/).filter(Boolean).map(v => v.endsWith('%') ? parseFloat(v) / 100 : Number(v));
    return {r: p[0], g: p[1], b: p[2], a: p.length > 3 ? p[3] : 1};
  };
  const over = (top, below) => {
    const a = top.a + below.a * (1 - top.a);
    if (a === 0) return {r: 0, g: 0, b: 0, a: 0};
    const mix = k => (top[k] * top.a + below[k] * below.a * (1 - top.a)) / a;
    return {r: mix('r'), g: mix('g'), b: mix('b'), a};
  };
  const background = el => {
    const layers = [];
    for (let node = el; node && node.nodeType === 1; node = node.parentElement) {
      const bg = parse(getComputedStyle(node).backgroundColor);
      if (bg && bg.a > 0) { layers.push({bg, node}); if (bg.a >= 1) break; }
    }
    let color = {r: 255, g: 255, b: 255, a: 1};
    for (const {bg} of layers.reverse()) color = over(bg, color);
    const first = layers.length ? layers[layers.length - 1].node : null;
    return {color, from: first ? (first.tagName.toLowerCase() + '.' + String(first.getAttribute('class') || '')
                                  .trim().split(/\s+/).slice(0, 2).join('.')) : 'none (white)'};
  };
  const opacity = el => {
    let o = 1;
    for (let node = el; node && node.nodeType === 1; node = node.parentElement) {
      o *= Number(getComputedStyle(node).opacity);
    }
    return o;
  };
  const lum = c => {
    const ch = v => { v /= 255; return v <= 0.04045 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); };
    return 0.2126 * ch(c.r) + 0.7152 * ch(c.g) + 0.0722 * ch(c.b);
  };
  const ratio = (a, b) => { const [x, y] = [lum(a), lum(b)].sort((p, q) => q - p); return (x + 0.05) / (y + 0.05); };
  const hex = c => '#' + [c.r, c.g, c.b].map(v => Math.round(v).toString(16).padStart(2, '0')).join('');
  // el's colour property `prop` ('color', 'stroke') against its background; `alphaProp` multiplies in too
  const contrast = (el, prop, alphaProp) => {
    const style = getComputedStyle(el);
    const fg = parse(style[prop]);
    const bg = background(el.parentElement || el);
    if (!fg) return {error: `cannot read ${prop}: ${style[prop]}`, background: hex(bg.color)};
    const alpha = fg.a * opacity(el) * (alphaProp ? Number(style[alphaProp]) : 1);
    const seen = over({...fg, a: alpha}, bg.color);
    return {color: style[prop], shown: hex(seen), background: hex(bg.color), background_from: bg.from,
            ratio: Math.round(ratio(seen, bg.color) * 100) / 100};
  };
  return {contrast};
})();
"""

# The report in code cell `index`: its output's size, first lines, whether its details are folded; the
# headline's contrast and each timeline line's.
REPORT_JS = """
([cellSel, areaSel, index]) => {
  const cell = document.querySelectorAll(cellSel)[index];
  const root = cell && cell.querySelector('.cuda-magic-widget, .cuda-magic-guard');
  if (!root) return null;
  const area = root.closest(areaSel);
  const details = [...root.querySelectorAll('details.cuda-magic-details')].filter(d => d.checkVisibility());
  const headline = root.querySelector('.cuda-magic-headline');
  const lines = root.innerText.split('\\n').map(l => l.trim()).filter(Boolean);
  const rect = area.getBoundingClientRect();
  const polylines = [...root.querySelectorAll('.cuda-magic-timeline svg polyline')];
  return {
    form: root.classList.contains('cuda-magic-widget') ? 'widget' : 'html',
    height: Math.round(area.getBoundingClientRect().height),
    root_height: Math.round(root.getBoundingClientRect().height),
    width: Math.round(rect.width),
    lines: lines.slice(0, 6),
    details: details.length, details_open: details.filter(d => d.open).length,
    headline: headline ? window.__cmColor.contrast(headline, 'color') : null,
    marks: polylines.map(p => ({label: p.textContent.trim(),
                                ...window.__cmColor.contrast(p, 'stroke', 'strokeOpacity')})),
  };
}
"""

# For every output area that shows something: its box, whether it scrolls sideways, every visible element
# whose right edge passes its right edge (the worst first), and each inline SVG chart's visibility (inside the
# area, not cut by an ancestor that clips).
OVERFLOW_JS = """
([areaSel]) => {
  const name = el => el.tagName.toLowerCase() + (el.getAttribute('class') ? '.' +
                     String(el.getAttribute('class')).trim().split(/\\s+/).slice(0, 2).join('.') : '');
  const out = [];
  for (const area of document.querySelectorAll(areaSel)) {
    const ar = area.getBoundingClientRect();
    if (ar.width === 0 || !area.checkVisibility()) continue;
    const over = [];
    let checked = 0;
    for (const el of area.querySelectorAll('*')) {
      if (!el.checkVisibility()) continue;
      const r = el.getBoundingClientRect();
      if (r.width === 0 && r.height === 0) continue;
      checked += 1;
      if (r.right > ar.right + 1) {
        over.push({el: name(el), right: Math.round(r.right), by: Math.round(r.right - ar.right)});
      }
    }
    // the worst first; of equals, the tables, charts and preformatted text (what widens the rest) first
    const shaping = o => /^(table|svg|pre)\\b/.test(o.el) ? 0 : 1;
    over.sort((a, b) => (b.by - a.by) || (shaping(a) - shaping(b)));
    const charts = [];
    for (const svg of area.querySelectorAll('svg.cuda-magic-chart')) {
      if (!svg.checkVisibility()) continue;
      const r = svg.getBoundingClientRect();
      let cut = null;
      for (let node = svg.parentElement; node && node !== area.parentElement; node = node.parentElement) {
        const s = getComputedStyle(node);
        if (s.overflowX === 'visible' && s.overflowY === 'visible') continue;
        const n = node.getBoundingClientRect();
        if (r.left < n.left - 1 || r.right > n.right + 1 || r.top < n.top - 1 || r.bottom > n.bottom + 1) {
          cut = name(node); break;
        }
      }
      charts.push({width: Math.round(r.width), height: Math.round(r.height), left: Math.round(r.left - ar.left),
                   right: Math.round(r.right - ar.right), cut});
    }
    out.push({text: area.innerText.trim().split('\\n')[0].slice(0, 60), width: Math.round(ar.width),
              right: Math.round(ar.right), scroll_width: area.scrollWidth, client_width: area.clientWidth,
              checked, over: over.slice(0, 40), over_count: over.length, charts});
  }
  return out;
}
"""

# JupyterLab: the file browser open on the left (as a fresh JupyterLab opens it), nothing on the right.
LAB_LAYOUT_JS = """
async () => {
  const app = window.jupyterapp;
  await app.commands.execute('filebrowser:activate');
  app.shell.expandLeft();
  app.shell.collapseRight();
  return {theme: document.body.dataset.jpThemeName, light: document.body.dataset.jpThemeLight,
          left: app.shell.leftCollapsed === false};
}
"""


def screenshot_path(front_name: str, width: int, theme: str) -> Path:
    """docs/screenshots/ with CUDA_MAGIC_SCREENSHOT=1 (the README's figures), else the artifacts folder."""
    name = f"report-{width}-{theme}.png" if front_name == "JupyterLab" else f"notebook6-report-{width}-{theme}.png"
    if os.environ.get("CUDA_MAGIC_SCREENSHOT") == "1":
        return REPO_ROOT / "docs" / "screenshots" / name
    return artifacts() / name


def watch_retry(page, front_name: str, timeout_s: float = 240) -> list[dict]:
    """Poll the retry cell's widget from the start of the run until the cell has finished: each change of
    what it shows (whether the cell runs, its header, the attempts table's rows), with the seconds since
    the widget first showed."""
    sel = FRONTS[front_name]["cell"]
    seen, shown_at = [], None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = page.evaluate(LIVE_JS, [sel, RETRY_CELL])
        if state is not None:
            if state["widget"] and shown_at is None:
                shown_at = time.monotonic()
            if not seen or {k: v for k, v in seen[-1].items() if k != "t"} != state:
                seen.append({**state, "t": round(time.monotonic() - shown_at, 2) if shown_at else None})
            if state["done"]:
                return seen
        page.wait_for_timeout(50)
    raise AssertionError(f"the retry cell did not finish within {timeout_s} s; what it showed, in turn: {seen}")


def live_attempt_2(history: list[dict], value: int) -> tuple[dict | None, list[dict]]:
    """In what the retry cell showed while it ran: the first state with attempt 1's row ("out of memory") and
    a header that says attempt 2 at `value` (the value attempt 2 ran at); and every running state whose
    header names an attempt that did not run, or a value that attempt did not run at (the attempts' rows
    say which ran at what)."""
    import re

    ran_at = {}
    for state in history:
        for row in state["rows"]:
            m = re.match(r"(\d+) (\d+) ", row)
            if m:
                ran_at[int(m.group(1))] = int(m.group(2))
    # the last attempt ends with the cell, so no running state lists its row: it is the one that fitted
    ran_at.setdefault(max(ran_at, default=0) + 1, value)
    good, wrong = None, []
    for state in history:
        if not state["running"] or not state["headline"]:
            continue
        head = state["headline"]
        m = re.search(r"attempt (\d+) at batch_size = (\d+)", head)
        if m and ran_at.get(int(m.group(1))) != int(m.group(2)):
            wrong.append({**state, "ran_at": ran_at})
        # issue 37: the header names the attempt running now, never one whose row says it ended ("running the
        # cell at batch_size = 16384" for seconds after the table showed 16384 ran out)
        running = re.search(r"running the cell(?:, attempt (\d+))? at ", head)
        ended = sum(1 for row in state["rows"] if re.match(r"\d+ \d+ ", row))
        if running and int(running.group(1) or 1) <= ended:
            wrong.append({**state, "ended": ended})
        if (good is None and f"attempt 2 at batch_size = {value}" in head
                and any(row.startswith("1 ") and "out of memory" in row for row in state["rows"])):
            good = state
    return good, wrong


def check_report_view(front, tmp_path: Path, theme: str = "light") -> dict:
    """Run cells() in `front` (the lab or classic module) in `theme`, watch the retry while it runs, then
    measure the reports at each width and screenshot them. Returns the figures (also written to the
    artifacts folder); `problems(figures)` says what in them is wrong."""
    name = front.NAME
    sel = FRONTS[name]
    notebook = write_notebook(tmp_path / "report-view.ipynb", cells())
    server = front.server(notebook, theme=THEMES[theme]) if name == "JupyterLab" else front.server(notebook)
    figures: dict = {"front": name, "theme": theme, "widths": {}}
    with server as srv, open_browser((WIDTHS[0], HEIGHT)) as page:
        began = time.monotonic()
        try:
            start_all_cells(page, srv.notebook_url(notebook.name), timeout_s=120, front=front)
            figures["live"] = watch_retry(page, name)
            wait_until_finished(page, timeout_s=120, front=front)
        except Exception as exc:
            raise AssertionError(f"{exc}\n--- {name} log ---\n{srv.log_tail()}") from exc
        figures["run_s"] = round(time.monotonic() - began, 1)
        figures["errors"] = front.error_outputs(page)
        figures["printed"] = page.locator(sel["cell"]).nth(RETRY_CELL + 1).inner_text()
        page.evaluate(COLOR_JS)
        for width in WIDTHS:
            page.set_viewport_size({"width": width, "height": HEIGHT})
            page.wait_for_timeout(300)
            if name == "JupyterLab":
                figures["layout"] = page.evaluate(LAB_LAYOUT_JS)
                page.wait_for_timeout(300)
            at = figures["widths"][str(width)] = {
                "report": page.evaluate(REPORT_JS, [sel["cell"], sel["area"], NO_RAISE_CELL]),
                "retry_report": page.evaluate(REPORT_JS, [sel["cell"], sel["area"], RETRY_CELL]),
                "areas": page.evaluate(OVERFLOW_JS, [sel["area"]]),
            }
            report = page.locator(sel["cell"]).nth(NO_RAISE_CELL).locator(sel["area"]).filter(
                has=page.locator(".cuda-magic-widget, .cuda-magic-guard")).first
            shot = save_element_screenshot(report, screenshot_path(name, width, theme))
            at["screenshot"] = {"path": str(shot), "bytes": shot.stat().st_size,
                                "png": shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"}
            # for the record, not checked: the same with every report's details unfolded
            page.evaluate("() => document.querySelectorAll('details.cuda-magic-details').forEach(d => d.open = true)")
            page.wait_for_timeout(200)
            at["unfolded_areas"] = page.evaluate(OVERFLOW_JS, [sel["area"]])
            page.evaluate("() => document.querySelectorAll('details.cuda-magic-details').forEach(d => d.open = false)")
            page.wait_for_timeout(200)
    out = artifacts() / f"report-view-{name.lower()}-{theme}.json"
    out.write_text(json.dumps(figures, indent=1))
    figures["json"] = str(out)
    return figures


def problems(figures: dict) -> list[str]:
    """Everything the figures show wrong, each in words with the figure measured."""
    import re

    found = []
    if figures["errors"]:
        found.append(f"error outputs: {figures['errors']}")
    if figures["theme"] == "dark" and figures.get("layout", {}).get("light") != "false":
        found.append(f"the dark theme did not apply: {figures.get('layout')}")
    final = figures["widths"][str(WIDTHS[0])]["retry_report"]
    m = re.search(r"fits at batch_size=(\d+)", (final or {}).get("lines", [""])[0]) if final else None
    if m is None:
        found.append(f"the retry did not end fitting: {final and final['lines'][:2]}")
    else:
        value = int(m.group(1))
        accum = -(-32768 // value)
        if f"{value} {accum}" not in figures["printed"]:
            found.append(f"after the retry the cell's names are not batch_size={value}, accum_steps={accum}: "
                         f"{figures['printed']!r}")
        good, wrong = live_attempt_2(figures["live"], value)
        if good is None:
            found.append("while the retry ran attempt 2, its widget never showed attempt 1's row ('out of memory') "
                         f"with a header 'attempt 2 at batch_size = {value}'; it showed, in turn: {figures['live']}")
        if wrong:
            found.append(f"while the retry ran, its header named a value that attempt did not run at: {wrong}")
    for width, at in figures["widths"].items():
        for which in ("report", "retry_report"):
            r = at[which]
            if r is None:
                found.append(f"{width} px: no {which} found")
                continue
            if which == "report":
                if r["details"] != 1 or r["details_open"] != 0:
                    found.append(f"{width} px: the report's details: {r['details']} shown, {r['details_open']} open "
                                 "(1 folded expected)")
                if int(width) == WIDTHS[0] and r["height"] > MAX_REPORT_PX:
                    found.append(f"{width} px: the folded report is {r['height']} px tall (at most {MAX_REPORT_PX})")
                lines = r["lines"] + ["", "", ""]
                if not (HEADLINE in lines[0] and lines[1].startswith("Cause:") and lines[2].startswith("Do this:")
                        and PASTE in lines[2]):
                    found.append(f"{width} px: the report's first three lines are not the headline, 'Cause:', "
                                 f"'Do this: ... {PASTE}': {lines[:3]}")
            head = r["headline"]
            if head is None or "ratio" not in head or head["ratio"] < TEXT_CONTRAST:
                found.append(f"{width} px: the {which}'s headline contrast {head} (at least {TEXT_CONTRAST})")
            if not r["marks"]:
                found.append(f"{width} px: the {which} has no timeline lines")
            for mark in r["marks"]:
                if "ratio" not in mark or mark["ratio"] < MARK_CONTRAST:
                    found.append(f"{width} px: the {which}'s timeline line {mark} (at least {MARK_CONTRAST})")
        for area in at["areas"]:
            where = f"{width} px, output {area['text']!r} ({area['width']} px wide)"
            if area["over_count"]:
                found.append(f"{where}: {area['over_count']} elements reach past its right edge, the worst: "
                             f"{area['over'][:5]}")
            if area["scroll_width"] > area["client_width"] + 1:
                found.append(f"{where}: scrolls sideways ({area['scroll_width']} > {area['client_width']})")
            for chart in area["charts"]:
                if chart["cut"] or chart["left"] < -1 or chart["right"] > 1:
                    found.append(f"{where}: a chart is not fully visible: {chart}")
        shot = at["screenshot"]
        if not shot["png"] or not 1_000 < shot["bytes"] < 400_000:
            found.append(f"{width} px: the screenshot {shot}")
    return found
