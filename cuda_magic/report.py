"""What `%%oomguard` and `%freecuda` report: plain records, no tensors, sizes in int bytes."""
from __future__ import annotations

from dataclasses import dataclass, field

from .model import DeviceMemory


@dataclass
class OomFields:
    """The figures an out-of-memory message states, in bytes; None where the message does not say."""

    backend: str = "cuda"                 # 'cuda', 'hip', 'mps', 'xpu', 'cpu', 'cublas', 'cudnn'
    device: str | None = None             # 'cuda:0' where the message names a GPU
    requested: int | None = None          # "Tried to allocate"
    capacity: int | None = None           # "total capacity"
    free: int | None = None
    this_process: int | None = None       # "this process has ... memory in use"
    other_processes: int | None = None    # capacity - free - this_process, where all three are known
    allocated_by_torch: int | None = None
    reserved_unallocated: int | None = None
    reserved_total: int | None = None     # older messages: "reserved in total by PyTorch"
    allowed: int | None = None            # "... allowed;": the cap a per-process memory fraction sets
    possible: bool = False                # True for cuDNN's CUDNN_STATUS_NOT_SUPPORTED: may be an OOM
    message: str = ""                     # the first line of the original message


@dataclass
class Advice:
    """One thing to try, most useful first; `code` is a line to paste, where there is one."""

    text: str
    code: str | None = None


@dataclass
class Diagnosis:
    """Why memory ran out: the causes found, most important first, and advice ranked for them."""

    causes: list[str]                     # keys: 'fragmentation', 'other_processes', 'names_holding',
                                          # 'too_large', 'request_exceeds_capacity', 'unknown'
    summary: str                          # one or two sentences for people
    advice: list[Advice] = field(default_factory=list)
    holders: list[tuple[str, int]] = field(default_factory=list)  # (name, bytes) kept alive by names


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


@dataclass
class GuardReport:
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

    def __repr__(self) -> str:
        from .display.text import guard_text

        return guard_text(self)

    def _repr_pretty_(self, p, cycle):
        p.text(repr(self))


@dataclass
class ReleaseReport:
    """What a release (`%freecuda`, the clean-up after an OOM) dropped and gave back."""

    dropped: list[str] = field(default_factory=list)      # notebook references dropped, by name
    deleted: list[str] = field(default_factory=list)      # user variables deleted (named or --all)
    offloaded: list[str] = field(default_factory=list)    # user variables moved to the CPU
    freed: dict[str, int] = field(default_factory=dict)   # bytes given back per device key
    still_held: list[tuple[str, int]] = field(default_factory=list)  # (variable, bytes) largest first
    dry_run: bool = False
    notes: list[str] = field(default_factory=list)

    def __repr__(self) -> str:
        from .display.text import release_text

        return release_text(self)

    def _repr_pretty_(self, p, cycle):
        p.text(repr(self))
