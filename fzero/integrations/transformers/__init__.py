"""Hugging Face's ``Trainer``, run on fzero: ``Trainer`` -> :class:`FzeroTrainer` is the switch.

``FzeroTrainer`` keeps the Trainer's loop around the update -- its data loader, callbacks,
logging, evaluation, ``trainer_state.json`` and ``checkpoint-N`` folders -- and replaces the
update itself with one call of a compiled fzero step (``trainer.fzero_step``): the model's
loss, gradient accumulation, clipping, the optimizer and the learning-rate schedule the
Trainer would have built, on the ZeRO stage ``args.deepspeed`` (fzero's reading of a
DeepSpeed config) or ``fzero=`` asks for. See docs/huggingface.md.

``TrainingArguments`` is Hugging Face's, accepting ``deepspeed=`` when the deepspeed
package is absent (fzero reads the file; DeepSpeed is not needed).
"""

from fzero.integrations.transformers._args import TrainingArguments
from fzero.integrations.transformers._trainer import FzeroTrainer

__all__ = ["FzeroTrainer", "TrainingArguments"]
