"""A `with oomguard():` block inside a torch.distributed process group of more than one rank (api.py).

A block cannot run again, so nothing is retried or undone, as outside a group; what changes is that the
ranks end the block together (recover/ranks.py): the DistributedDataParallel modules among the names of
the frame that holds the `with` (its locals and globals, one level into containers) meet the other
ranks after each forward pass, and every rank meets the others as its block ends. Where a rank ran out of
memory, every rank learns it at the same point of the step (those still running stop there, those
blocked in DDP's gradient all-reduce wake at their group's timeout), frees what its block held, resets
its DDP modules, and ends with the same outcome: the report (every rank's figures; rank 0 shows it) and,
unless `raise_on_oom=False`, the same short error. Where a rank ran its block through while another ran
out (an out-of-memory error in the optimizer step), the ranks' parameters may differ: they are compared
and the report says so. An error that is not out of memory, or a rank that does not come, ends the
block on every rank with the same RankError.
"""
from __future__ import annotations

from cuda_magic.recover.ranks import (FRESH_GROUP_NOTE, PeerStopped, Ranks, error_words, failed_ranks,
                                      failure_line, fingerprint, is_collective_error, rank_words, settled,
                                      verdict)
from cuda_magic.recover.report import Outcome, RankFacts


class RankedBlock:
    def __init__(self, run, timeout: float | None, objects, what: str = "block"):
        from cuda_magic.recover.rollback import stateful_objects

        self.run = run
        self.ranks = Ranks(timeout)      # the first time: a group made by every rank, as each enters
        self.ranks.attach([obj for _, obj in stateful_objects([(str(i), v) for i, v in enumerate(objects)])])
        # what: 'block' (with oomguard()), 'call' (@oomguard() without retry=)
        run.report.ranks = RankFacts(self.ranks.rank, self.ranks.world, what=what)
        self._handles: list = []

    def begin(self) -> None:
        self._handles = self.ranks.hook()

    def end(self, exc: BaseException | None):
        """The block ended with `exc` (None: it ran through). Returns the GuardResult every rank agrees on;
        raises RankError (the same on every rank) where the ranks cannot end it together."""
        __tracebackhide__ = True  # noqa: F841
        for handle in self._handles:
            handle.remove()
        self._handles = []
        run, ranks = self.run, self.ranks
        stopped = isinstance(exc, PeerStopped)
        result = run.end(exc)
        attempt = run.report.attempts[-1]
        entry = {"value": None, "peak": attempt.peak, "requested": attempt.requested, "at": "end"}
        if result.error is not None:
            if not stopped:
                entry["state"], entry["error"] = "error", error_words(result.error)
            if stopped or is_collective_error(str(result.error)):
                run.let_go(result.error)           # its frames hold the block's tensors
                result.error = None
        elif result.failure is not None:
            entry["state"] = "oom"
            entry["line"], entry["in"] = failure_line(result.failure)
        else:
            entry["state"] = "ok"
        del exc
        entries = ranks.stopped_with if stopped else ranks.meet(entry)
        entries = settled(entries)
        run.report.ranks = run.report.ranks.added(entries)
        if verdict(entries) == "ok":          # raises RankError where a rank failed with another error
            return result
        report = run.report
        report.outcome, report.exception_text = Outcome.OOM, ""
        run.note(rank_words(entries, f"the {report.ranks.what}"))
        if ranks.reset_ddps(entries):
            run.note(FRESH_GROUP_NOTE)
        self._compare(entries)
        result.error = None
        return result

    def _compare(self, entries) -> None:
        """Where some rank ran its block through, whether the ranks' parameters still agree."""
        through = [e["rank"] for e in entries if e["state"] == "ok"]
        if not through or not self.ranks.ddps:
            return
        gathered = self.ranks.meet({"state": "ok", "at": "compare",
                                    "params": fingerprint([d.module for d in self.ranks.ddps])})
        if len({tuple(e["params"]) for e in gathered}) > 1:
            failed = ", ".join(map(str, failed_ranks(entries)))
            self.run.note(f"the ranks' parameters differ now: rank {', '.join(map(str, through))} ran the block "
                          f"through (its optimizer step stands) and rank {failed} did not; load them from a "
                          "checkpoint on every rank before going on, or guard the step with "
                          "@oomguard(retry=...), which undoes it on every rank")

