"""The retry of `oomguard(retry=...)` across the ranks of a process group (recover/ranks.py).

The same loop as recover/retrying.py, with every decision taken from what all ranks said: an attempt
fitted only where it fitted on every rank; after one that failed on some rank, every rank undoes it and
the next value is the smallest that the ranks that ran out of memory predict (each rank the same value,
so that with accumulate= the global batch, value x accumulation x world size, stays at least what it
was). A rank that ran out inside the model measures it on slices of its batch, as a single process does
(recover/replay.py measures the module a DistributedDataParallel wraps, under no_sync: no collective
runs), while the others wait at the meeting. Every rank keeps the report, with every rank's figures; rank
0 shows it.
"""
from __future__ import annotations

from cuda_magic.devices.meter import capacity_of
from cuda_magic.recover.ranks import (FRESH_GROUP_NOTE, PeerStopped, RankError, Ranks, error_words, failure_line,
                                      rank_words, settled, verdict)
from cuda_magic.recover.report import Outcome
from cuda_magic.recover.retrying import RetryLoop

ABSTAIN = None


class RankedRetryLoop(RetryLoop):
    def __init__(self, run):
        super().__init__(run)
        self.ranks = Ranks(getattr(run.options, "rank_timeout", None))
        run.report.rank, run.report.world = self.ranks.rank, self.ranks.world
        run.report.ranks = []            # per attempt: every rank's entry (state, value, figures)

    async def attempts(self, call):
        __tracebackhide__ = True  # noqa: F841
        from cuda_magic.recover.retry import BatchSearch, divisors
        from cuda_magic.recover.rollback import Checkpoint, stateful_objects

        run, spec, retry, report, ranks = self.guarded, self.spec, self.retry, self.guarded.report, self.ranks
        keep = {spec.variable, spec.accumulate} - {None}
        self.checkpoint = checkpoint = Checkpoint(run.namespace, roots=run.roots, keep=keep)
        for note in checkpoint.take():
            run.note(note)
        ranks.attach([obj for _, obj in stateful_objects([(str(i), v) for i, v in enumerate(run.roots)]
                                                         + list((run.namespace or {}).items()))])
        allowed = divisors(retry.original * retry.original_accumulate) if spec.exact and spec.accumulate else None
        policy = BatchSearch(retry.original, spec.floor, spec.search,
                             capacity=run.options.limit or capacity_of(run.meter), allowed=allowed,
                             accumulating=spec.accumulate is not None,
                             allocator=getattr(getattr(run.meter, "device", None), "allocator_copy", None))
        self._policy = policy
        value, kept, watched = policy.first(), None, ranks.watching(call)
        try:
            while value is not None:
                self._apply(value)
                run.why = policy.reason
                ok, result, entries = await self._everywhere(watched, value, policy)
                if ok:
                    following = self._agree_up(policy.next()) if spec.search else policy.next()
                    if following is None and policy.best == value:
                        kept = (value, result.value)
                        break
                    result.attempt.probe = True
                    self._restore()
                    if following is None and policy.best is not None:
                        following = policy.best
                        run.on_note(f"running at {spec.variable}={following}, the value found, on every rank")
                        self._apply(following)
                        run.why = "the largest value the probes found to fit on every rank"
                        ok, result, _ = await self._everywhere(watched, following, None)
                        if ok:
                            kept = (following, result.value)
                        else:
                            report.warnings.append(f"{spec.variable}={following} fitted as a probe but ran out "
                                                   "of memory on some rank when run for real")
                        break
                    value = following
                    continue
                proposals = [e["next"] for e in entries if e["state"] == "oom"]
                value = None if ABSTAIN in proposals else min(proposals)
                if value is not None:
                    policy.adopt(value, policy.reason if value == entries[self.ranks.rank].get("next")
                                 else f"the smallest value the ranks that ran out of memory predict ({value})")
        except KeyboardInterrupt:
            self._restore_values()
            report.outcome = Outcome.INTERRUPTED
            report.warnings.append(f"interrupted: {self._restored_words()}")
            raise
        except RankError as error:
            return self._stopped_by(error, words=False)
        report.not_undone = checkpoint.not_undone()
        if kept is None:
            self._restore_values()
            report.outcome = Outcome.OOM
            last = report.attempts[-1].value
            report.warnings.append(f"even {spec.variable}={last} ran out of memory on some rank (the floor is "
                                   f"{spec.floor}); {self._restored_words()}")
            return None, None
        if policy.islands and kept[0] == policy.best:
            run.note(policy.islands)        # the value found sits above values that ran out
        return self._kept(kept), None

    async def _everywhere(self, watched, value, policy):
        """One attempt on every rank: (fitted on every rank, this rank's result, every rank's entry). A rank
        that failed undoes its attempt and, with `policy`, records it and says what it predicts next."""
        run, ranks = self.guarded, self.ranks
        with self.checkpoint.watching():
            result = await run.attempt(watched, value, undo=self.checkpoint.restore_bindings)
        error, result.error = result.error, None
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
                progress = self._undo_failed(failure, value)
                if policy is not None:
                    self._record(policy, value, False, result, progress)
                    entry["next"] = policy.next()
            else:
                state = "ok"
            entry["state"] = state
            entries = ranks.meet(entry)
        if error is not None:
            run.let_go(error)                # its frames hold the attempt's tensors: let them go
            del error
        entries = settled(entries, value=value)
        run.report.ranks.append(entries)
        words = rank_words(entries, f"{self.spec.variable}={value}")
        fitted = verdict(entries) == "ok"
        if fitted:
            if policy is not None:
                self._record(policy, value, True, result, None)
            return True, result, entries
        attempt.outcome = Outcome.OOM
        run.note(words)
        if failure is None:                  # fitted or stopped here, failed elsewhere: undone the same
            self._restore()
            if policy is not None:
                policy.record(value, False)
        if ranks.reset_ddps(entries):
            run.note(FRESH_GROUP_NOTE)
        return False, result, entries

    def _record(self, policy, value, ok, result, progress):
        failure, attempt = result.failure, result.attempt
        policy.record(value, ok, peak=attempt.peak, requested=attempt.requested, baseline=attempt.start_allocated,
                      allocated_at_failure=failure.allocated if failure else None, progress=progress,
                      capacity=failure.oom.capacity if failure and not self.guarded.options.limit else None)

    def _agree_up(self, proposal):
        """search=True after a value fitted everywhere: the smallest of the ranks' next values; none where
        any rank is done."""
        entries = self.ranks.meet({"state": "ok", "at": "search", "next": proposal})
        proposals = [e["next"] for e in entries]
        agreed = None if None in proposals else min(proposals)
        self._policy.adopt(agreed, self._policy.reason if agreed == proposal else
                           f"the smallest of the ranks' next values ({agreed})")
        return agreed
