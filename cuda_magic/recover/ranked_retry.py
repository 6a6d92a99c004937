"""What the ranks of a process group decide together in the retry of `oomguard(retry=...)` (recover/ranks.py):
the hooks of the one loop (recover/retry_loop.py `Alone`), overridden where the ranks decide.

An attempt fitted only where it fitted on every rank; after one that failed on some rank, every rank undoes
it and the next value is the smallest that the ranks that ran out of memory predict (each rank the same
value, so that with accumulate= the global batch, value x accumulation x world size, stays at least what it
was); with search=True, the next probe up is the smallest of the ranks' next values. A rank that ran out
inside the model measures it on slices of its batch, as a single process does (recover/replay.py measures
the module a DistributedDataParallel wraps, under no_sync: no collective runs), while the others wait at
the meeting. Every rank keeps the report, with every rank's figures (`report.ranks`); rank 0 shows it.
"""
from __future__ import annotations

from cuda_magic.recover.ranks import (FRESH_GROUP_NOTE, PeerStopped, RankError, Ranks, error_words, failure_line,
                                      rank_words, settled, verdict)
from cuda_magic.recover.report import Outcome, RankFacts

ABSTAIN = None


class Ranked:
    """The ranks deciding the retry together: each attempt ends with a meeting of every rank."""

    stops = (RankError,)
    found_note = "running at {}, the value found, on every rank"
    found_why = "the largest value the probes found to fit on every rank"
    where_failed = " on some rank"

    def __init__(self, run):
        self.ranks = Ranks(run.options.rank_timeout)
        self.entries: list[dict] = []    # every rank's entry at the end of the last attempt
        run.report.ranks = RankFacts(self.ranks.rank, self.ranks.world)

    def start(self, loop) -> None:
        """The DDP modules among what the checkpoint keeps: they meet the other ranks after each forward."""
        from cuda_magic.recover.rollback import stateful_objects

        run = loop.guarded
        self.ranks.attach([obj for _, obj in stateful_objects([(str(i), v) for i, v in enumerate(run.roots)]
                                                              + list((run.namespace or {}).items()))])

    def watching(self, call):
        return self.ranks.watching(call)

    async def attempt(self, loop, call, value, policy):
        """One attempt on every rank: (fitted on every rank, this rank's result). A rank that failed undoes its
        attempt and, with `policy`, records it and says what it predicts next; one that fitted or stopped
        while another failed undoes it the same way."""
        __tracebackhide__ = True  # noqa: F841
        run, ranks = loop.guarded, self.ranks
        result, error = await loop.attempt_here(call, value, policy)
        attempt, failure = result.attempt, result.failure
        entry = {"value": value, "peak": attempt.peak, "requested": attempt.requested, "at": "end"}
        if isinstance(error, PeerStopped):
            entries = ranks.stopped_with
        else:
            if error is not None:
                state, entry["error"] = "error", error_words(error)
            elif failure is not None:
                state = "oom"
                entry["line"], entry["in"] = failure_line(failure)
                if policy is not None:
                    entry["next"] = policy.next()
            else:
                state = "ok"
            entry["state"] = state
            entries = ranks.meet(entry)
        if error is not None:
            run.let_go(error)                # its frames hold the attempt's tensors: let them go
            del error
        self.entries = entries = settled(entries, value=value)
        run.report.ranks = run.report.ranks.added(entries)
        words = rank_words(entries, f"{loop.spec.variable}={value}")
        if verdict(entries) == "ok":         # raises RankError where a rank failed with another error
            if policy is not None:
                loop.record(policy, value, True, result, None)
            return True, result
        attempt.outcome = Outcome.OOM
        run.note(words)
        if failure is None:                  # fitted or stopped here, failed elsewhere: undone the same
            loop.undo_attempt()
            if policy is not None:
                policy.record(value, False)
        if ranks.reset_ddps(entries):
            run.note(FRESH_GROUP_NOTE)
        return False, result

    def next_up(self, loop, policy):
        """search=True after a value fitted everywhere: the smallest of the ranks' next values; none where
        any rank is done."""
        proposal = policy.next()
        if not loop.spec.search:
            return proposal
        entries = self.ranks.meet({"state": "ok", "at": "search", "next": proposal})
        proposals = [e["next"] for e in entries]
        agreed = None if None in proposals else min(proposals)
        policy.adopt(agreed, policy.reason if agreed == proposal else
                     f"the smallest of the ranks' next values ({agreed})")
        return agreed

    def next_down(self, loop, policy):
        """After an attempt that failed on some rank: the smallest value the ranks that ran out predict; none
        where any of them is done (then, after --search's probes, every rank runs the largest value that
        fitted on every rank: the same on each)."""
        proposals = [e["next"] for e in self.entries if e["state"] == "oom"]
        value = None if ABSTAIN in proposals else min(proposals)
        policy.adopt(value, policy.reason if value == self.entries[self.ranks.rank].get("next")
                     else f"the smallest value the ranks that ran out of memory predict ({value})")
        return value
