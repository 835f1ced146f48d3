"""``TrainState``: everything a training step carries from one update to the next."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fzero import tree
from fzero.transforms._core import bind, register_primitive

__all__ = ["TrainState"]


@tree.dataclass
class TrainState:
    """A pytree of the training state, as flax's ``TrainState``.

    Attributes:
        step: 0-dim int64 CPU tensor, the number of updates applied (a skipped fp16
            update does not count).
        params: the parameter pytree (``functionalize``'s dict of tensors).
        opt_state: the optimizer state, ``tx.init(params)``.
        apply_fn: static; the model's pure apply function.
        tx: static; the ``fzero.optim`` gradient transformation.
        extra: per-transform state that must be saved with the rest, keyed by name; empty
            for a plain step. ``mixed_precision`` keeps ``"master"`` (the fp32 master
            weights, a pytree like ``params``; the optimizer state is built over them, and
            ``shard_state`` partitions them like optimizer state) and, for fp16,
            ``"loss_scale"``.

    Example:
        >>> import torch, fzero
        >>> from fzero import optim
        >>> apply, params = fzero.functionalize(torch.nn.Linear(2, 1))
        >>> state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
        >>> int(state.step)
        0
        >>> grads = fzero.tree.map(torch.ones_like, state.params)
        >>> int(state.apply_gradients(grads).step)
        1
    """

    step: torch.Tensor
    params: Any
    opt_state: Any
    apply_fn: Callable = tree.field(static=True)
    tx: Any = tree.field(static=True)
    extra: dict = tree.field(default_factory=dict)

    @classmethod
    def create(cls, *, apply_fn: Callable, params: Any, tx: Any, **extra) -> "TrainState":
        """A fresh state at step 0 with ``opt_state = tx.init(params)``.

        Raises:
            TypeError: ``tx`` is not an ``fzero.optim`` transformation.
        """
        if not (hasattr(tx, "init") and hasattr(tx, "update")):
            raise TypeError(
                "fzero.TrainState.create: tx must be an fzero.optim gradient transformation "
                f"(with init and update), got {type(tx).__name__}"
            )
        return cls(
            step=torch.zeros((), dtype=torch.int64),
            params=params,
            opt_state=tx.init(params),
            apply_fn=apply_fn,
            tx=tx,
            extra=dict(extra),
        )

    def apply_gradients(self, grads: Any) -> "TrainState":
        """The state after one update with ``grads`` (a pytree like ``params``).

        Under a transform the update may be deferred (``accumulate``), partitioned
        (``shard_state``) or skipped (fp16 overflow); the returned state is always the one
        to carry on with.

        Raises:
            fzero.tree.StructureError: ``grads`` does not have the structure of ``params``.
        """
        return bind("apply_gradients", self, grads)


@register_primitive("apply_gradients")
def _apply_gradients_base(state: TrainState, grads: Any) -> TrainState:

    tree.assert_same_structure(
        state.params, grads, what="fzero.TrainState.apply_gradients", names=("state.params", "grads")
    )
    master = state.extra.get("master")
    if master is None:
        params, opt_state = _update(state.tx, grads, state.opt_state, state.params)
        return state.replace(step=state.step + 1, params=params, opt_state=opt_state)
    # Mixed precision: the optimizer updates the fp32 masters; the parameters the model
    # uses are their low-precision copies.
    grads = tree.map(lambda g, m: g.to(m.dtype), grads, master)
    master, opt_state = _update(state.tx, grads, state.opt_state, master)
    params = tree.map(lambda m, p: m.to(p.dtype), master, state.params)
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                         extra={**state.extra, "master": master})


def _update(tx, grads, opt_state, params):
    """One optimizer update: the fused kernels where they apply (see fzero.optim.fused),
    else the transformation chain."""
    from fzero import optim
    from fzero.optim.fused import fused_update

    fused = fused_update(tx, grads, opt_state, params)
    if fused is not None:
        return fused
    updates, opt_state = tx.update(grads, opt_state, params)
    return optim.apply_updates(params, updates), opt_state
