"""``TrainingArguments`` that take ``deepspeed=`` without the deepspeed package.

transformers 5 builds DeepSpeed's plugin in ``TrainingArguments.__post_init__`` and fails
when the package is absent. fzero reads the config itself, so the subclass keeps the value
out of Hugging Face's way while the arguments are set up, and puts it back: ``args.deepspeed``
is what the user wrote, and ``FzeroTrainer`` reads it.
"""

from __future__ import annotations

import dataclasses

import transformers

__all__ = ["TrainingArguments"]


@dataclasses.dataclass
class TrainingArguments(transformers.TrainingArguments):
    """Hugging Face's ``TrainingArguments`` (every field, same defaults), plus ``fzero``:
    fzero's own options for :class:`FzeroTrainer` (``{"zero": 2, "jit": True, ...}``, the
    keywords of ``fzero.compile``). ``deepspeed`` (a path or a dict) is fzero's config; the
    deepspeed package is not needed.

    Example (skipped as a doctest: constructing the arguments needs accelerate, an optional
    dependency; ``tests/test_hf_trainer.py`` runs it):
        >>> from fzero.integrations.transformers import TrainingArguments
        >>> args = TrainingArguments("out", deepspeed={"zero_optimization": {"stage": 2}})  # doctest: +SKIP
        >>> args.deepspeed["zero_optimization"]["stage"], args.deepspeed_plugin is None  # doctest: +SKIP
        (2, True)
    """

    fzero: dict | None = dataclasses.field(
        default=None, metadata={"help": "fzero.compile's keyword options for FzeroTrainer, e.g. {'zero': 2}"})

    def __post_init__(self):
        config, self.deepspeed = self.deepspeed, None
        try:
            super().__post_init__()
        finally:
            self.deepspeed = config
