"""The ranks of a torch.distributed process group agreeing on a retry (SPEC: "Under torch.distributed").

Imported only inside a process group of more than one rank (recover/retry_loop.py checks that without
importing anything). Every rank meets the others with one small `all_gather_object` on a group of its own
(gloo, with the timeout of `oomguard(timeout=...)`), made once by every rank: after each forward pass of a
DistributedDataParallel module the guarded call reaches (a forward hook, during attempts only) and at the
end of each attempt. A rank that fails meets the others at its next meeting, so that every rank learns at
the same point of the step that some rank failed: those still running stop (`PeerStopped`), those blocked
in DDP's gradient all-reduce wake at their process group's timeout with a collective error. Then every
rank undoes its attempt; DDP modules are reset (`_update_process_group`), on a fresh group where a
collective failed or the ranks' groups went out of step. What cannot be recovered (an error that is not
out of memory, a rank that does not come) stops every rank with the same `RankError`.

Checked against torch 2.2's torch/distributed (new_group(timeout=, backend=), all_gather_object, gloo's
timeout raising RuntimeError and closing the group's pairs, DistributedDataParallel._update_process_group
resetting the reducer) and torch 2.13. FSDP is not covered: its collectives are not reset.
"""
from __future__ import annotations

import datetime

COLLECTIVE_WORDS = ("gloo", "nccl", "timed out", "timeout", "connection closed", "connection reset",
                    "pair closure", "watchdog", "processgroup", "broken pipe")
DEFAULT_SLACK = 60.0     # seconds the agreement waits beyond the process group's own timeout
_groups: list = []       # (the default group, timeout, the agreement group made for them)


class RankError(RuntimeError):
    """Raised on every rank, with the same words, where the ranks cannot retry together."""


class PeerStopped(Exception):
    """Raised inside a rank's attempt when another rank failed: its attempt ends at the same point."""


def _dist():
    import torch.distributed as dist

    return dist


def is_collective_error(text: str) -> bool:
    lowered = text.lower()
    return any(word in lowered for word in COLLECTIVE_WORDS)


def group_timeout(group) -> float | None:
    """The timeout in seconds of a process group, where torch says it (its backend's options)."""
    import torch

    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout.total_seconds()
        except Exception:  # noqa: BLE001 - no backend for that device, or a torch without these
            continue
    return None


def sequence_of(group) -> int | None:
    try:
        return int(group._get_sequence_number_for_group())
    except Exception:  # noqa: BLE001 - not every backend counts its collectives
        return None


class Ranks:
    """This rank's view of the process group for one guarded call."""

    def __init__(self, timeout: float | None = None):
        dist = _dist()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        default = dist.distributed_c10d._get_default_group()
        if timeout is None:
            own = group_timeout(default)
            timeout = (own if own is not None else 1800.0) + DEFAULT_SLACK
        self.timeout = float(timeout)
        made = [g for d, t, g in _groups if d is default and t == self.timeout]
        if not made:                 # every rank enters the guarded call: new_group is reached by all
            made = [dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout))]
            _groups[:] = [item for item in _groups if item[0] is default] + [(default, self.timeout, made[0])]
        self.group = made[0]
        self.ddps: list = []
        self.meetings = 0
        self.stopped_with: list[dict] | None = None   # what the meeting that stopped this attempt said

    def attach(self, objects) -> None:
        """The DistributedDataParallel modules among the objects the rollback keeps, in the same order on
        every rank (the same code found them)."""
        from torch.nn.parallel import DistributedDataParallel

        seen: set[int] = set()
        self.ddps = [o for o in objects if isinstance(o, DistributedDataParallel)
                     and not (id(o) in seen or seen.add(id(o)))]

    # meetings -----------------------------------------------------------------------------------
    def meet(self, entry: dict) -> list[dict]:
        """Every rank's entry, in rank order; RankError, the same on every rank, where one does not come."""
        dist = _dist()
        entry = dict(entry, rank=self.rank, seq=[sequence_of(d.process_group) for d in self.ddps])
        gathered: list = [None] * self.world
        self.meetings += 1
        try:
            dist.all_gather_object(gathered, entry, group=self.group)
        except Exception as exc:  # noqa: BLE001 - a rank that never came, or a group that broke
            kind = type(exc).__name__
            raise RankError(f"cuda_magic: the {self.world} ranks did not all reach the retry's agreement within "
                            f"{self.timeout:g} s ({kind}); a rank is stuck or gone, so no rank retries "
                            "(oomguard(timeout=...) sets the bound)") from None
        return gathered

    def hook(self) -> list:
        """A meeting after each forward pass of the DDP modules: where another rank has failed, this rank's
        attempt stops there (PeerStopped). Returns the hooks' handles, to remove when the attempt ends."""
        self.stopped_with = None

        def after_forward(module, inputs, output):
            entries = self.meet({"state": "ok", "at": "forward"})
            if any(e["state"] != "ok" for e in entries):
                self.stopped_with = entries
                raise PeerStopped(f"rank {first_failed(entries)} failed in this step; this rank stops with it")

        return [d.register_forward_hook(after_forward) for d in self.ddps]

    def watching(self, call):
        """`call` with the meetings of `hook()` while it runs."""

        def watched():
            handles = self.hook()
            try:
                return call()
            finally:
                for handle in handles:
                    handle.remove()

        watched.is_async = getattr(call, "is_async", False)
        return watched

    # after a failed attempt -----------------------------------------------------------------------
    def reset_ddps(self, entries: list[dict]) -> bool:
        """Make the DDP modules usable again on every rank: their reducers reset, on a fresh group (same
        backend and timeout) where a collective failed or the ranks' groups counted different
        collectives. Returns whether fresh groups were made."""
        dist = _dist()
        seqs = [tuple(e.get("seq") or ()) for e in entries]
        broken = (any(e["state"] == "error" for e in entries) or len(set(seqs)) > 1
                  or any(s is None for s in seqs[0]))
        for ddp in self.ddps:
            if not hasattr(ddp, "_update_process_group"):
                raise RankError("cuda_magic: this torch's DistributedDataParallel cannot be reset after a "
                                "failed step, so no rank retries")
            group = ddp.process_group
            if broken:
                seconds = group_timeout(group)
                group = dist.new_group(backend=dist.get_backend(group),
                                       timeout=None if seconds is None else datetime.timedelta(seconds=seconds))
            ddp._update_process_group(group)
        return broken and bool(self.ddps)


FRESH_GROUP_NOTE = ("a collective failed while a rank was out of memory: DistributedDataParallel continues on a "
                    "fresh process group (same ranks, backend and timeout); the old group is not usable")


def error_words(error: BaseException) -> str:
    """What a rank's entry says of an error that is not out of memory: the same on every rank that reads it."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"


def settled(entries: list[dict], **more) -> list[dict]:
    """Every rank's entry at the end of an attempt: a rank that met the others after a forward pass and was
    told to stop reads "stopped"; `more` is set on each (the attempt's value)."""
    return [dict(e, **more, state="stopped" if e["at"] == "forward" and e["state"] == "ok" else e["state"])
            for e in entries]


def first_failed(entries: list[dict]) -> int:
    failed = [e["rank"] for e in entries if e["state"] == "oom"] or [e["rank"] for e in entries
                                                                    if e["state"] != "ok"]
    return failed[0] if failed else -1


def verdict(entries: list[dict]) -> str:
    """'ok' (every rank fitted), 'oom' (some rank ran out of memory and the rest can follow), or raises
    RankError with words that are the same on every rank."""
    states = [e["state"] for e in entries]
    if all(s == "ok" for s in states):
        return "ok"
    errors = [e for e in entries if e["state"] == "error"]
    ooms = [e for e in entries if e["state"] == "oom"]
    real = [e for e in errors if not (ooms and is_collective_error(e.get("error", "")))]
    if real:
        first = real[0]
        raise RankError(f"cuda_magic: rank {first['rank']} of {len(entries)} stopped with {first['error']}, "
                        "which is not out of memory, so no rank retries")
    if not ooms:
        raise RankError("cuda_magic: the ranks stopped without any of them running out of memory, so no rank "
                        "retries")
    return "oom"


def rank_words(entries: list[dict], label: str) -> str:
    """One line of the report: what each rank did at `label` ("batch_size=64", "the block"), with its
    figures and, for a rank that ran out of memory, the line that asked."""
    from cuda_magic.units import format_bytes

    def one(e):
        peak = format_bytes(e["peak"]) if e.get("peak") is not None else "?"
        if e["state"] == "oom":
            asked = format_bytes(e["requested"]) if e.get("requested") is not None else "?"
            line = f" at `{e['line']}`" if e.get("line") else ""
            line += e.get("in") or ""
            return f"rank {e['rank']} out of memory{line} (asked for {asked}, peak {peak})"
        if e["state"] == "ok":
            return f"rank {e['rank']} fitted (peak {peak})"
        if e["state"] == "error":
            return f"rank {e['rank']} waited in a collective for the failed rank"
        return f"rank {e['rank']} stopped with it"

    return f"{label} on {len(entries)} ranks: " + "; ".join(one(e) for e in entries)


def failure_line(failure) -> tuple[str | None, str]:
    """The line of the user's code that asked for the memory, shortened for the line of every rank, and
    where it is when it is not in the cell or block itself (" in loss_of() (train.py:12)")."""
    import linecache
    import os

    point = getattr(failure, "point", None)
    if point is None:
        return None, ""
    text, where = (point.text or "").strip(), ""
    if point.filename:                     # the deepest line of the user's own code (a script's function)
        path, _, number = point.filename.rpartition(":")
        if number.isdigit():
            text = linecache.getline(path, int(number)).strip() or text
            where = f" in {point.function}() ({os.path.basename(path)}:{number})" if point.function else ""
    if not text:
        return None, ""
    return (text[:77] + "...") if len(text) > 80 else text, where


def failed_ranks(entries: list[dict]) -> list[int]:
    return [e["rank"] for e in entries if e["state"] == "oom"]


def fingerprint(modules) -> list[float]:
    """A sum per parameter of the modules, in float64 (no copy of a parameter is made): equal on ranks
    whose parameters are equal, since they run the same reduction."""
    import torch

    with torch.no_grad():
        return [float(p.detach().sum(dtype=torch.float64)) for m in modules for p in m.parameters()]
