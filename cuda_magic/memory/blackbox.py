"""The black box's record: the device's allocated memory over a guarded run (one trace per attempt), and
what was alive at the failure (or at the peak), by line of code. Plain values, sizes in int bytes; built
from a `devices.recorder.Recorder` by `blackbox_from`, drawn by the display layer.
"""
from __future__ import annotations

import linecache
import os
import re
from dataclasses import dataclass, field

from cuda_magic.devices.recorder import BACKWARD_THREAD, BEFORE, NO_FRAMES, Recorder
from cuda_magic.ipython import cell_label
from cuda_magic.reprs import Rendered

BEFORE_TEXT = "(allocated before the run)"
NO_FRAMES_TEXT = "(no Python frames: autograd's backward pass, or another thread)"
BACKWARD_TEXT = "(backward pass)"


@dataclass
class LineUse:
    """Storages alive from one line of code: the innermost user frame that made them."""

    filename: str | None                  # None: storages that existed before the run
    line: int | None
    function: str | None
    code: str                             # the line's source, stripped
    bytes: int
    tensors: int                          # storages (views share one)
    cell_line: int | None = None          # the line of the cell that was running, where known
    in_cell: bool = False                 # the line is the cell's own
    label: str | None = None              # 'In[3]' where the file is an earlier cell of this notebook

    @property
    def where(self) -> str:
        """'model.py:42', 'cell line 3', or '' for memory from before the run."""
        if self.filename == NO_FRAMES:
            return "another thread"
        if self.filename == BACKWARD_THREAD:
            return "autograd's thread"
        if self.in_cell and self.line is not None:
            return f"cell line {self.line}"
        if self.filename is None:
            return f"cell line {self.cell_line}" if self.cell_line is not None else ""
        if self.label:
            return f"{self.label} line {self.line}"
        cell = re.match(r"<ipython-input-(\d+)-", self.filename)
        if cell:
            return f"In[{cell.group(1)}] line {self.line}"
        return f"{os.path.basename(self.filename)}:{self.line}"


@dataclass
class FailedRequest:
    """The allocation that did not fit."""

    requested: int
    seconds: float
    attempt: int
    allocated: int                        # allocated on the device when it was asked for
    site: LineUse | None = None           # the line that asked (bytes: the request)
    grad_enabled: bool | None = None      # False: no autograd graph was being built (inference)
    phase: str | None = None              # 'backward': in autograd's backward pass (on CUDA, its own thread)


@dataclass(repr=False)
class BlackBox(Rendered):
    """`report.blackbox`: what a guarded run did with memory, and which lines held it."""

    _html_repr = True
    device: str = ""
    points: list[tuple[float, int, int, str]] = field(default_factory=list)  # (seconds, allocated, attempt, event)
    capacity: int | None = None           # the device's, or the -l cap where one was set
    limited: bool = False                 # capacity is a -l cap
    peak: int = 0
    peak_seconds: float = 0.0
    peak_attempt: int = 0
    failure: FailedRequest | None = None  # the last request that did not fit
    by_line: list[LineUse] = field(default_factory=list)   # alive at the failure (or the peak), largest first
    at: str = "failure"                   # 'failure' or 'peak'
    dropped: int = 0                      # oldest events dropped from the ring
    notes: list[str] = field(default_factory=list)

    @property
    def attempts(self) -> list[int]:
        return sorted({a for _, _, a, _ in self.points})

    @property
    def total(self) -> int:
        return sum(u.bytes for u in self.by_line)

    @property
    def top(self) -> LineUse | None:
        """The line that held the most at the failure, not counting memory from before the run."""
        return next((u for u in self.by_line if u.filename is not None or u.cell_line is not None), None)

    def timeline_frame(self):
        """DataFrame: event, seconds, allocated (bytes), attempt."""
        import pandas as pd

        return pd.DataFrame([(e, s, a, n) for s, a, n, e in self.points],
                            columns=["event", "seconds", "allocated", "attempt"])

    def by_line_frame(self):
        """DataFrame: file, line, code, bytes, tensors (largest first)."""
        import pandas as pd

        frame = pd.DataFrame([(u.filename, u.line, u.code, u.bytes, u.tensors) for u in self.by_line],
                             columns=["file", "line", "code", "bytes", "tensors"])
        return frame.astype({"line": "Int64", "bytes": "int64", "tensors": "int64"})


TIMED = "<timed exec>"          # what IPython's %%time compiles a cell's body as


def _line_use(recorder: Recorder, site: int, nbytes: int, count: int, lines: list[str] | None,
              timed: tuple | None = None) -> LineUse:
    filename, line, function, cell_line = recorder.sites[site]
    if site == BEFORE:
        return LineUse(None, None, None, BEFORE_TEXT, nbytes, count)
    if filename == NO_FRAMES:
        return LineUse(NO_FRAMES, None, None, NO_FRAMES_TEXT, nbytes, count)
    if filename == BACKWARD_THREAD:
        return LineUse(BACKWARD_THREAD, None, None, BACKWARD_TEXT, nbytes, count)
    if filename == TIMED and timed is not None and line:   # a `%%time` cell: its line k is the cell's k + 1
        code = _COMMENT.sub("", timed[line - 1].strip()) if line <= len(timed) else ""
        return LineUse(recorder.cell_filename, line + 1, function, code, nbytes, count, cell_line=line + 1,
                       in_cell=True)
    in_cell = filename is not None and filename == recorder.cell_filename
    if filename is None:      # only the cell's line is known
        return LineUse(None, None, None, _source(recorder.cell_filename, cell_line, lines), nbytes, count,
                       cell_line=cell_line)
    code = _source(filename, line, lines if in_cell else None)
    return LineUse(filename, line, function, code, nbytes, count, cell_line=cell_line, in_cell=in_cell,
                   label=None if in_cell else cell_label(filename))


_COMMENT = re.compile(r"\s{2,}#[^'\"]*$")     # an inline comment after two spaces (PEP 8), no quote in it


def _source(filename: str | None, line: int | None, lines: list[str] | None) -> str:
    """The line's source, stripped, without its inline comment."""
    if line is None:
        return ""
    if lines is not None and 0 < line <= len(lines):
        text = lines[line - 1]
    else:
        text = linecache.getline(filename, line) if filename else ""
    return _COMMENT.sub("", text.strip())


def _merge(uses: list[LineUse]) -> list[LineUse]:
    """One row per line of code (a function's line reached from several lines of the cell is one row;
    the cell line is kept where all agree), largest first."""
    rows: dict[tuple, LineUse] = {}
    for u in uses:
        key = (u.filename, u.line) if u.filename is not None else (None, u.cell_line)
        row = rows.get(key)
        if row is None:
            rows[key] = LineUse(**vars(u))
        else:
            row.bytes += u.bytes
            row.tensors += u.tensors
            if row.cell_line != u.cell_line:
                row.cell_line = None
    return sorted(rows.values(), key=lambda u: -u.bytes)


def lines_of(recorder: Recorder, sites: dict[int, tuple[int, int]]) -> list[LineUse]:
    """The rows of `sites` ({site: (bytes, storages)}, what a Recorder keeps), one per line, largest first."""
    return _merge([_line_use(recorder, s, b, n, None) for s, (b, n) in sites.items() if n > 0 or b > 0])


def blackbox_from(recorder: Recorder, *, device: str = "", capacity: int | None = None, limited: bool = False,
                  lines: list[str] | None = None, failed: bool = True, timed: tuple | None = None) -> BlackBox:
    """The record of a recording. `lines`: the cell's source lines (for lines of the cell itself).
    `failed`: the run ended in an out-of-memory error (by line at the failure), else at the peak.
    `timed`: a cell that starts with `%%time`: its lines after that one (run as "<timed exec>")."""
    points = [(s, a, n, kind) for s, kind, _, a, _, n in recorder.events]
    failure = recorder.failures[-1] if failed and recorder.failures else None
    if failure is not None:
        sites, at = failure.by_site, "failure"
    else:
        sites, at = recorder.at_peak(), "peak"
    by_line = _merge([_line_use(recorder, s, b, n, lines, timed) for s, (b, n) in sites.items() if n > 0 or b > 0])
    request = None
    if failure is not None:
        where = _line_use(recorder, failure.site, failure.requested, 1, lines, timed) if failure.site != BEFORE else None
        request = FailedRequest(failure.requested, failure.seconds, failure.attempt, failure.allocated, where,
                                failure.grad_enabled, failure.phase)
    return BlackBox(device=device, points=points, capacity=capacity, limited=limited, peak=recorder.peak,
                    peak_seconds=recorder.peak_seconds, peak_attempt=recorder.peak_attempt, failure=request,
                    by_line=by_line, at=at, dropped=recorder.dropped, notes=list(recorder.notes))
