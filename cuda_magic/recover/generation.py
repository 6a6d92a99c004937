"""Measuring a generation loop after it ran out of memory, for `-r`'s prediction (recover/retry.py).

A loop that calls the model once per new token on a growing sequence (transformers' `generate`) fails
late: the step that failed is one of many, and its share of one forward pass says nothing of the steps
to come. When the failure came inside such a loop whose prompts' rows are the value retried, the whole
call is run again, once the failure's memory is given back, on two small slices of the prompts (a
thirty-second and a sixteenth of the rows) with the same generation settings, and the device's exact peak
of each is read: two points of a line that gives the call's memory per row of the batch and the part that
does not grow with it. What the failure held was the call's own (the prompts are a sliver of it).

These runs change nothing that stays: generation records no gradients, and the guard restores the random
generators (sampling consumes them) and the model's state from its checkpoint afterwards.
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass

from cuda_magic.devices.errors import oom_kind
from cuda_magic.recover.progress import ModelCost
from cuda_magic.recover.probe_timeline import reserves_segments, timeline_of

SLICE = 32
MIN_ROWS = 1
GENERATE_FILE_PART = "generation"     # transformers/generation/utils.py


@dataclass
class GenerationReplay:
    """The generation call that failed: the model, its prompts and settings (holds the prompts: drop it
    after `measure`)."""

    root: object                       # the model (its `generate` was called)
    prompts: object                    # the tensor of prompts: rows x tokens
    kwargs: dict                       # what else `generate` was given
    rows: int

    def measure(self, meter) -> ModelCost | None:
        """Generate on two slices of the prompts and fit the peaks; None where it cannot (a slice ran out
        of memory down to one row, or the call would not take a slice)."""
        import torch

        rows = max(MIN_ROWS, self.rows // SLICE)
        t0 = time.perf_counter()
        while 2 * rows < self.rows:
            try:
                small, large = self._peak(rows, meter, torch), self._peak(2 * rows, meter, torch)
            except Exception as exc:  # noqa: BLE001 - a generation call may raise anything on a slice
                if oom_kind(exc) not in ("oom", "possible"):
                    return None
                del exc
                gc.collect()
                rows //= 4
                if rows < MIN_ROWS:
                    return None
                continue
            break
        else:
            return None
        (small, small_events), (large, large_events) = small, large
        per_row = (large - small) / rows
        timeline, allocator = (), None
        if small_events is not None and large_events is not None:
            from cuda_magic.devices.allocator_replay import timeline_lines

            # the call's allocations and frees, a line in the rows each: -r and --search replay them at a
            # candidate on the allocator model (on a 32 MiB device a 20 MiB segment, not the bytes, is
            # what runs out: the bytes said 377 rows fit where 218 do)
            timeline = timeline_lines(small_events, large_events, rows) or ()
            allocator = meter.device.allocator_copy if timeline else None
        return ModelCost(rows=self.rows, lines=((small - per_row * rows, per_row),), probe_rows=(rows, 2 * rows),
                         seconds=time.perf_counter() - t0, whole_call=True, timeline=timeline,
                         allocator=allocator, segments=reserves_segments(meter))

    def _peak(self, rows: int, meter, torch) -> tuple[int, object]:
        """The call's peak on `rows` rows above what was allocated before it, and its allocations and frees
        (devices/allocator_replay.Timeline) where the device models torch's caching allocator, else None."""
        def cut(v):
            if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == self.rows:
                return v[:rows]
            return v

        kwargs = {k: cut(v) for k, v in self.kwargs.items()}
        meter.reset_peak()
        before = meter.allocated() or 0
        recording = timeline_of(meter)
        try:
            with torch.no_grad(), _quiet_transformers():
                out = self.root.generate(self.prompts[:rows], **kwargs)
            del out
        finally:
            if recording is not None:
                meter.device.detach_recorder(recording)
        return (meter.peak() or 0) - before, recording


class _quiet_transformers:
    """transformers warns, through its logger, when a prepared generation config and the call's own
    arguments both set a length: true and of no use to the user here, whose cell did not do that."""

    def __enter__(self):
        import logging

        self.logger = logging.getLogger("transformers")
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        self.logger.setLevel(self.level)


def generation_replay(frames, torch) -> GenerationReplay | None:
    """The outermost `generate` call of transformers among the failing frames, as a replay; None where
    there is none, or its prompts are not a tensor of rows."""
    for frame in frames or ():
        code = frame.f_code
        if code.co_name != "generate" or GENERATE_FILE_PART not in code.co_filename.replace("\\", "/"):
            continue
        local = frame.f_locals
        model, prompts = local.get("self"), local.get("inputs")
        if prompts is None:
            prompts = (local.get("kwargs") or {}).get("input_ids")
        if not isinstance(model, torch.nn.Module) or not isinstance(prompts, torch.Tensor) or prompts.dim() < 2:
            return None
        kwargs = dict(local.get("kwargs") or {})
        kwargs.pop("input_ids", None)
        config = local.get("generation_config")
        if config is not None:
            kwargs["generation_config"] = config
        return GenerationReplay(model, prompts, kwargs, int(prompts.shape[0]))
    return None
