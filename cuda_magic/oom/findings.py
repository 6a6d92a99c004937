"""What an out-of-memory error says and why it happened: the parsed figures, the diagnosis, the advice.
Plain records, sizes in int bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field


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
    processes: list[tuple[int, int]] = field(default_factory=list)   # "Process N has ... memory in use":
                                          # (pid, bytes) as NVML listed them (this process may be among them)
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
                                          # 'too_large', 'request_exceeds_capacity', 'free_reported', 'unknown'
    summary: str                          # one or two sentences for people
    advice: list[Advice] = field(default_factory=list)
    holders: list = field(default_factory=list)   # memory.holders.Holder: names worth naming, largest first
    cause: str = ""                       # the first cause in one sentence: what the report leads with
