"""What `%%oomguard` and `%freecuda` report: plain records, no tensors, sizes in int bytes."""
from __future__ import annotations

from dataclasses import dataclass, field

from cuda_magic.reprs import Rendered

from cuda_magic.devices.records import DeviceMemory
from cuda_magic.oom.records import Diagnosis, OomFields


@dataclass
class Attempt:
    """One run of a guarded cell."""

    value: int | None                     # the retried variable's value, None without -r
    outcome: str                          # 'ok', 'oom', 'error', 'interrupted'
    peak: int | None = None               # exact peak of allocated bytes during the run
    requested: int | None = None          # what the failing allocation asked for
    duration: float = 0.0                 # seconds
    start_allocated: int | None = None    # allocated bytes on the device when the attempt started


@dataclass
class FailurePoint:
    """Where a cell failed: its line number in the cell (1-based) and that line's text."""

    line: int | None
    text: str
    function: str | None = None           # when it failed inside a function the cell called
    filename: str | None = None


@dataclass(repr=False)
class GuardReport(Rendered):
    _html_repr = False
    """The result of one `%%oomguard` cell; `-o` returns it."""

    device: str                           # device key the figures are for
    before: list[DeviceMemory] = field(default_factory=list)
    after: list[DeviceMemory] = field(default_factory=list)
    peaks: dict[str, int | None] = field(default_factory=dict)   # per device key
    attempts: list[Attempt] = field(default_factory=list)
    variable: str | None = None           # -r VAR
    accumulate: str | None = None         # -a VAR2
    original_value: int | None = None
    final_value: int | None = None        # largest value that ran, None if none did
    original_accumulate: int | None = None
    final_accumulate: int | None = None
    oom: OomFields | None = None          # parsed fields of the (last) OOM
    diagnosis: Diagnosis | None = None
    failure: FailurePoint | None = None
    reclaimed: dict[str, int] = field(default_factory=dict)      # bytes given back, per device key
    outcome: str = "ok"                   # 'ok', 'recovered' (retry fitted), 'oom', 'error', 'interrupted'
    limit: int | None = None              # -l cap in bytes
    warnings: list[str] = field(default_factory=list)
    exception_text: str = ""              # a non-OOM error's "Type: message", when one stopped the attempts
    source: str = "%%oomguard"            # what guarded the run: '%%oomguard', '%oomguard on', 'oomguard'

    @property
    def succeeded(self) -> bool:
        return self.outcome in ("ok", "recovered")


@dataclass(repr=False)
class ReleaseReport(Rendered):
    _html_repr = False
    """What a release (`%freecuda`, the clean-up after an OOM) dropped and gave back."""

    dropped: list[str] = field(default_factory=list)      # notebook references dropped, by name
    deleted: list[str] = field(default_factory=list)      # user variables deleted (named or --all)
    offloaded: list[str] = field(default_factory=list)    # user variables moved to the CPU
    freed: dict[str, int] = field(default_factory=dict)   # bytes given back per device key
    still_held: list[tuple[str, int]] = field(default_factory=list)  # (variable, bytes) largest first
    dry_run: bool = False
    notes: list[str] = field(default_factory=list)


