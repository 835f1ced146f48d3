"""The optimizer and learning-rate schedule Hugging Face's ``Trainer`` builds from its
arguments, as fzero gradient transformations.

The Trainer builds ``torch.optim.AdamW`` over two parameter groups (weight decay on the
names ``Trainer.get_decay_parameter_names`` gives, none on biases and norms) and a
``LambdaLR`` from ``transformers.get_scheduler``. fzero takes the same pieces from the same
functions: the optimizer class and keywords from ``Trainer.get_optimizer_cls_and_kwargs``,
the decayed names from the trainer, and the schedule's own multiplier function, so the
learning rate at update ``count`` is what ``LambdaLR`` sets for it (``base_lr *
lr_lambda(count)``, the same float arithmetic).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from fzero import optim

__all__ = ["hf_optimizer", "hf_schedule"]

WHERE = "FzeroTrainer"

# torch.optim.AdamW keywords that change how it runs, not what it computes.
_ADAMW_RUNTIME = frozenset({"fused", "foreach", "capturable", "differentiable"})


def hf_schedule(args: Any, max_steps: int) -> Callable[[int], float]:
    """The learning rate ``transformers.get_scheduler`` gives for ``args`` at each update.

    Raises:
        NotImplementedError: a scheduler that is not a ``LambdaLR`` (``reduce_lr_on_plateau``
            and the like depend on evaluation metrics, which a pure schedule cannot see).
    """
    import transformers

    probe = torch.optim.SGD([torch.nn.Parameter(torch.zeros(()))], lr=args.learning_rate)
    sched = transformers.get_scheduler(args.lr_scheduler_type, optimizer=probe,
                                       num_warmup_steps=args.get_warmup_steps(max_steps),
                                       num_training_steps=max_steps,
                                       scheduler_specific_kwargs=args.lr_scheduler_kwargs)
    if not isinstance(sched, torch.optim.lr_scheduler.LambdaLR):
        raise NotImplementedError(
            f"{WHERE}: lr_scheduler_type={_name(args.lr_scheduler_type)!r} builds a {type(sched).__name__}, whose "
            "rate is not a function of the update count; fzero runs schedules of the count (every "
            "LambdaLR-based type: linear, cosine, constant_with_warmup, ...), or a DeepSpeed scheduler section "
            "in args.deepspeed")
    base, fn = sched.base_lrs[0], sched.lr_lambdas[0]

    def schedule(count: int) -> float:
        return base * fn(int(count))

    return schedule


def hf_optimizer(args: Any, decay_names: set[str], params: Mapping[str, Any],
                 schedule: Callable[[int], float]) -> optim.GradientTransformation:
    """``args.optim`` as an fzero optimizer with the Trainer's weight-decay groups.

    Raises:
        NotImplementedError: an optimizer fzero has no exact counterpart of, named.
    """
    import transformers

    name = _name(args.optim)
    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args)
    if cls is not torch.optim.AdamW:
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
            # Any other torch optimizer the Trainer builds (sgd, adagrad, rmsprop, Hugging Face's
            # Adafactor, ...) runs as itself, with the Trainer's two groups: weight decay on the
            # decayed names, none on the rest.
            hp = {k: v for k, v in kwargs.items() if k != "lr" and k not in _ADAMW_RUNTIME}
            no_decay = {k: k not in decay_names for k in params}
            return optim.from_torch(cls, lr=schedule, weight_decay=args.weight_decay, **hp,
                                    param_groups=[{"mask": no_decay, "weight_decay": 0.0}])
        raise NotImplementedError(
            f"{WHERE}: optim={name!r} ({getattr(cls, '__qualname__', cls)}) is not a torch.optim.Optimizer; "
            "FzeroTrainer runs the Trainer's torch optimizers (adamw_torch as fzero.optim.adamw, the others "
            "through fzero.optim.from_torch), or the optimizer section of args.deepspeed")
    extra = sorted(set(kwargs) - {"lr", "betas", "eps"} - _ADAMW_RUNTIME)
    if extra or kwargs.get("capturable") or kwargs.get("differentiable"):
        raise NotImplementedError(f"{WHERE}: optim={name!r} with {extra or kwargs}: only lr, betas and eps "
                                  "(optim_args) are carried over to fzero.optim.adamw")
    b1, b2 = kwargs.get("betas", (0.9, 0.999))
    mask = {k: k in decay_names for k in params}
    return optim.adamw(schedule, b1=b1, b2=b2, eps=kwargs.get("eps", 1e-8), weight_decay=args.weight_decay,
                       mask=mask)


def _name(value: Any) -> str:
    return getattr(value, "value", value)
