"""The settings of a transformers `Trainer` found on the failing stack (its `self`), read while the
frames are alive, so that the advice speaks its language: TrainingArguments' batch, accumulation,
bf16 and gradient_checkpointing, not `loss.backward()` lines the user never wrote.

Read from transformers' trainer.py (4.57 and 5.24): the Trainer takes `_train_batch_size` from
`args.train_batch_size` when it is made and trains with it, so a smaller batch needs a new Trainer (or
its `auto_find_batch_size`); Seq2SeqTrainer and trl's trainers are subclasses. Never raises: an object
that refuses to say is no Trainer here.
"""
from __future__ import annotations

from cuda_magic.oom.cell_reading import TrainerSettings


def trainer_settings(obj) -> TrainerSettings | None:
    """The settings of `obj` where it is a transformers Trainer (by its class's lineage), else None."""
    try:
        lineage = type(obj).__mro__
        if not any(c.__name__ == "Trainer" and (c.__module__ or "").split(".")[0] == "transformers"
                   for c in lineage):
            return None
        args = obj.args
        batch = getattr(obj, "_train_batch_size", None) or getattr(args, "per_device_train_batch_size", None)
        return TrainerSettings(
            batch=int(batch) if isinstance(batch, int) and batch > 0 else None,
            accumulation=max(1, int(getattr(args, "gradient_accumulation_steps", 1) or 1)),
            mixed=bool(getattr(args, "bf16", False) or getattr(args, "fp16", False)),
            checkpointing=bool(getattr(args, "gradient_checkpointing", False)))
    except Exception:  # noqa: BLE001 - a hostile object, or a transformers that changed: no Trainer here
        return None
