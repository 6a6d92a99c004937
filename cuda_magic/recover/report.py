"""What `%%oomguard` and `%freecuda` report: plain records, no tensors, sizes in int bytes.

The report also decides what is worth showing (`show_attempts`, `show_reclaimed`, `holders_shown`, ...):
the text, HTML and widget forms in `display/` ask it, so that they cannot disagree.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import Enum

from cuda_magic.reprs import Rendered, render

from cuda_magic.devices.readings import DeviceMemory
from cuda_magic.memory.blackbox import BlackBox
from cuda_magic.oom.findings import Diagnosis, OomFields

HOLDERS_SHOWN = 6          # names kept alive, listed by name; the rest counted
HOLDER_SHARE_SHOWN = 0.02  # ... where they hold this share of the device, or enough to make the request fit
ATTEMPT_ROWS_SHOWN = 12    # attempts listed; beyond, the first and last half with a gap between


class Outcome(str, Enum):
    """How a guarded run (or one attempt of it) ended. A str, so `outcome == "ok"` reads naturally."""

    OK = "ok"                      # ran within memory
    RECOVERED = "recovered"        # a retry fitted at a smaller value (reports only)
    OOM = "oom"                    # out of memory (and, for a report, nothing fitted)
    ERROR = "error"                # an error that is not out of memory stopped it
    INTERRUPTED = "interrupted"    # KeyboardInterrupt

    def __str__(self) -> str:
        return self.value


@dataclass
class Attempt:
    """One run of a guarded cell."""

    value: int | None                     # the retried variable's value, None without -r
    outcome: Outcome                      # OK, OOM, ERROR or INTERRUPTED
    peak: int | None = None               # exact peak of allocated bytes during the run
    requested: int | None = None          # what the failing allocation asked for
    duration: float = 0.0                 # seconds
    start_allocated: int | None = None    # allocated bytes on the device when the attempt started
    reclaimed: int | None = None          # bytes the clean-up after this attempt gave back
    probe: bool = False                   # a --search probe: rolled back even though it fitted
    reason: str = ""                      # why this value was tried (the retry policy's words)
    where: FailurePoint | None = None     # the line where this attempt ran out (its own failure, not the last's)

    def __post_init__(self):
        self.outcome = Outcome(self.outcome)


@dataclass
class FailurePoint:
    """Where a cell failed: its line number in the cell (1-based) and that line's text."""

    line: int | None
    text: str
    function: str | None = None           # when it failed inside a function the cell called
    filename: str | None = None


@dataclass
class Retry:
    """The retried variable (`-r VAR`, `oomguard(retry=...)`) and the one scaled with it (`-a VAR2`)."""

    variable: str
    original: int
    final: int | None = None              # the value kept: the largest that ran; None if none did
    accumulate: str | None = None
    original_accumulate: int | None = None
    final_accumulate: int | None = None
    search: bool = False                  # --search: probes rolled back, then one real run
    independent: bool = False             # stopped: the cell's memory does not depend on the variable

    @property
    def restored(self) -> bool:
        """The variables are back at their original values (nothing fitted, or the attempts stopped)."""
        return self.final is None


@dataclass(frozen=True)
class RankFacts(Sequence):
    """Inside a torch.distributed process group of more than one rank (recover/ranks.py): this rank, the
    group's size, what the ranks ended together, and per attempt every rank's entry (its state, value,
    peak, failing request and line), in rank order. A sequence of those attempts: `report.ranks[-1]` is the
    last one's entries."""

    rank: int
    world: int
    what: str | None = None               # 'block' (`with oomguard()`), 'call' (`@oomguard()` without
                                          # retry=); None for a retry (the short error says 'call' or 'cell')
    attempts: tuple = ()                  # per attempt: a tuple of every rank's entry (a dict)

    def __getitem__(self, index):
        return self.attempts[index]

    def __len__(self) -> int:
        return len(self.attempts)

    def added(self, entries) -> RankFacts:
        """These facts with one more attempt's entries."""
        return replace(self, attempts=(*self.attempts, tuple(entries)))

    def failed(self) -> list[int]:
        """The ranks that ran out of memory in the last attempt."""
        return [e["rank"] for e in self.attempts[-1] if e["state"] == "oom"] if self.attempts else []


@dataclass(repr=False)
class GuardReport(Rendered):
    """The result of one `%%oomguard` cell; `-o` returns it (shown as one line: it has been displayed)."""

    _html_repr = False

    device: str                           # device key the figures are for
    before: list[DeviceMemory] = field(default_factory=list)
    after: list[DeviceMemory] = field(default_factory=list)
    peaks: dict[str, int | None] = field(default_factory=dict)   # per device key
    attempts: list[Attempt] = field(default_factory=list)
    retry: Retry | None = None            # with -r only
    oom: OomFields | None = None          # parsed fields of the (last) OOM
    by_kind: dict[str, int] | None = None  # PyTorch's tensors on the device by kind when it failed (memory.kinds)
    diagnosis: Diagnosis | None = None
    failure: FailurePoint | None = None
    reclaimed: dict[str, int] = field(default_factory=dict)      # bytes the last clean-up gave back, per device
    outcome: Outcome = Outcome.OK
    limit: int | None = None              # -l cap in bytes
    warnings: list[str] = field(default_factory=list)
    said: list[str] = field(default_factory=list)        # of the warnings, those shown as they came up
    not_undone: list[str] = field(default_factory=list)  # effects of failed attempts a rollback could not undo
    exception_text: str = ""              # a non-OOM error's "Type: message", when one stopped the run
    source: str = "%%oomguard"            # what guarded the run: '%%oomguard', '%oomguard on', 'oomguard'
    api: bool = False                     # run through the Python API: advice speaks of it, not of magics
    blackbox: BlackBox | None = None      # what the run did with memory, by line (None: not recorded)
    timeline_requested: bool = False      # --timeline / timeline=True: show it for a run that fitted too
    ranks: RankFacts | None = None        # inside a process group of more than one rank: every rank's figures

    def __post_init__(self):
        self.outcome = Outcome(self.outcome)

    # the retried variable, read through the record ----------------------------------------------
    @property
    def variable(self) -> str | None:
        return self.retry.variable if self.retry else None

    @property
    def accumulate(self) -> str | None:
        return self.retry.accumulate if self.retry else None

    @property
    def original_value(self) -> int | None:
        return self.retry.original if self.retry else None

    @property
    def final_value(self) -> int | None:
        return self.retry.final if self.retry else None

    @property
    def original_accumulate(self) -> int | None:
        return self.retry.original_accumulate if self.retry else None

    @property
    def final_accumulate(self) -> int | None:
        return self.retry.final_accumulate if self.retry else None

    # the black box as DataFrames (`-o`) ----------------------------------------------------------
    @property
    def timeline(self):
        """DataFrame: event, seconds, allocated (bytes), attempt; None where nothing was recorded."""
        return self.blackbox.timeline_frame() if self.blackbox is not None else None

    @property
    def by_line(self):
        """DataFrame: file, line, code, bytes, tensors alive at the failure (or the peak), largest first."""
        return self.blackbox.by_line_frame() if self.blackbox is not None else None

    # what to show: decided here, drawn by each form ----------------------------------------------
    @property
    def show_blackbox(self) -> bool:
        """The timeline and the by-line table: after an OOM (also one a retry recovered from), or when
        asked for; its notes (no black box on this device) only when asked for or after an OOM."""
        bb = self.blackbox
        if bb is None:
            return False
        ran_out = any(a.outcome == Outcome.OOM for a in self.attempts)
        return (ran_out or self.timeline_requested) and (bool(bb.points) or bool(bb.notes))

    @property
    def succeeded(self) -> bool:
        return self.outcome in (Outcome.OK, Outcome.RECOVERED)

    @property
    def show_attempts(self) -> bool:
        """A table of attempts: for a retried run, or whenever there was more than one."""
        return len(self.attempts) > 1 or (bool(self.attempts) and self.retry is not None)

    @property
    def attempts_shown(self) -> list[tuple[int, Attempt] | int]:
        """(number, attempt) rows to list; where a long list is cut, an int in between: how many are not."""
        rows: list = list(enumerate(self.attempts, 1))
        if len(rows) > ATTEMPT_ROWS_SHOWN:
            half = ATTEMPT_ROWS_SHOWN // 2
            rows = rows[:half] + [len(rows) - 2 * half] + rows[-half:]
        return rows

    @property
    def show_reclaimed(self) -> bool:
        """Whether to say how much the clean-up gave back (after any OOM)."""
        return self.outcome in (Outcome.OOM, Outcome.RECOVERED) or bool(self.reclaimed)

    @property
    def values_restored(self) -> bool:
        """The retried variables were put back to what they were."""
        return self.retry is not None and self.outcome in (Outcome.OOM, Outcome.ERROR, Outcome.INTERRUPTED)

    @property
    def holders_shown(self) -> list[tuple[str, int]]:
        """The names kept alive worth a line: those holding a share of the device, or enough to make the
        failed request fit (the rest are in diagnosis.holders and %gpumem; the line counts them)."""
        holders = self.diagnosis.holders if self.diagnosis is not None else []
        oom = self.oom
        capacity = oom.capacity if oom is not None else None
        short = (max(0, oom.requested - oom.free) if oom is not None and oom.requested is not None
                 and oom.free is not None else None)

        def worth(h) -> bool:
            size = h.bytes + getattr(h, "shared", 0)
            return not capacity or size >= HOLDER_SHARE_SHOWN * capacity or bool(short and h.bytes >= short)

        return [h for h in holders if worth(h)][:HOLDERS_SHOWN]

    @property
    def holders_hidden(self) -> int:
        holders = self.diagnosis.holders if self.diagnosis is not None else []
        return max(0, len(holders) - len(self.holders_shown))

    @property
    def warnings_shown(self) -> list[str]:
        """The warnings the report itself says: those not already shown as they came up."""
        return [w for w in self.warnings if w not in self.said]

    @property
    def probe_time(self) -> float:
        """Seconds spent in --search probes (the cost of searching)."""
        return sum(a.duration for a in self.attempts if a.probe)

    def __repr__(self) -> str:
        return render(self, "line")

    def __str__(self) -> str:
        return render(self, "full")


@dataclass(repr=False)
class ReleaseReport(Rendered):
    """What a release (`%freecuda`, the clean-up after an OOM) dropped and gave back."""

    _html_repr = False

    dropped: list[str] = field(default_factory=list)      # notebook references dropped, by name
    deleted: list[str] = field(default_factory=list)      # user variables deleted (named or --all)
    offloaded: list[str] = field(default_factory=list)    # user variables moved to the CPU
    freed: dict[str, int] = field(default_factory=dict)   # bytes given back per device key
    still_held: list[tuple[str, int]] = field(default_factory=list)  # (variable, bytes) largest first
    dry_run: bool = False
    notes: list[str] = field(default_factory=list)


