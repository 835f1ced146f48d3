"""DeepSpeed's 1-bit Adam: Adam whose momentum, not its gradient, crosses the data-parallel
ranks, compressed to one bit per element after a warm-up (Tang et al., 2021,
<https://arxiv.org/abs/2102.02888>; DeepSpeed's ``OnebitAdam``, ``runtime/fp16/onebit/adam.py``).

Such an optimizer does its own data-parallel exchange, and says so by a type
(:class:`DataParallelExchange`, from :func:`exchange_of`): ``shard_state`` asks before each
update whether the optimizer takes this rank's local gradients, and at ZeRO stage 0 then hands
them over unreduced; the optimizer averages its momentum through the ``compressed_pmean``
primitive (:func:`fzero.core.compressed_pmean`), which ``shard_state`` answers with the
compressed collectives of :mod:`fzero.distributed.compressed`. In a world of one it is Adam
with its variance frozen after the warm-up.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch

from fzero import tree
from fzero.core import compressed_pmean
from fzero.optim import _known
from fzero.optim._checks import check_lr, check_nonneg, check_unit
from fzero.optim._known import record
from fzero.optim.base import GradientTransformation, ScalarOrSchedule, chain
from fzero.optim.transform import (ScaleByAdamState, _moment_leaves, add_decayed_weights, scale_by_adam,
                                   scale_by_learning_rate)

__all__ = ["DataParallelExchange", "exchange_of", "onebit_adam", "scale_by_onebit_adam"]


@dataclasses.dataclass(frozen=True)
class ScaleByOnebitAdam(_known.Known):
    """The record of :func:`scale_by_onebit_adam` (see :mod:`fzero.optim._known`)."""

    b1: float
    b2: float
    eps: float
    freeze_step: int
    where: str
    output = "new"


class DataParallelExchange(NamedTuple):
    """What an optimizer that exchanges across the data-parallel ranks itself declares for its
    next update.

    Attributes:
        optimizer: its public name (for errors: ``"fzero.optim.onebit_adam"``).
        local_gradients: the next update takes this rank's own gradients, unreduced (the
            optimizer averages what it needs itself); ``False`` during a warm-up that wants
            the averaged gradients.
        stages: the ZeRO stages it runs at (``(0,)``: DeepSpeed's 1-bit optimizers refuse
            ZeRO).
    """

    optimizer: str
    local_gradients: bool
    stages: tuple[int, ...] = (0,)


def exchange_of(tx: Any, opt_state: Any = None) -> DataParallelExchange | None:
    """The :class:`DataParallelExchange` of ``tx`` (found in nested chains) at ``opt_state``,
    or ``None`` for an optimizer that leaves the exchange to the transforms (every other one).
    Without ``opt_state``, ``local_gradients`` is ``False``.

    Example:
        >>> from fzero import optim
        >>> tx = optim.onebit_adam(1e-3, freeze_step=2)
        >>> state = tx.init({"w": torch.zeros(3)})
        >>> optim.exchange_of(tx, state), optim.exchange_of(optim.adam(1e-3)) is None
        (DataParallelExchange(optimizer='fzero.optim.onebit_adam', local_gradients=False, stages=(0,)), True)
    """
    what = _known.known(tx)
    if isinstance(what, _known.Chain):
        states = opt_state if isinstance(opt_state, tuple) else (None,) * len(what.transforms)
        for t, s in zip(what.transforms, states):
            if (found := exchange_of(t, s)) is not None:
                return found
        return None
    if isinstance(what, ScaleByOnebitAdam):
        local = opt_state is not None and int(opt_state.count) >= what.freeze_step
        return DataParallelExchange(what.where, local)
    return None


def scale_by_onebit_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *, freeze_step: int = 100000,
                         where: str = "fzero.optim.scale_by_onebit_adam") -> GradientTransformation:
    """1-bit Adam's direction, with DeepSpeed's arithmetic (no bias correction). With ``k`` the
    0-based index of the update::

        k <  freeze_step (warm-up; g averaged over the ranks, as for Adam):
            mu = b1 * mu + (1 - b1) * g ;  nu = b2 * nu + (1 - b2) * g^2
        k >= freeze_step (g this rank's own):
            mu = compressed_pmean(b1 * mu + (1 - b1) * g)      nu frozen
        out = mu / (sqrt(nu) + eps)

    The warm-up is ``scale_by_adam(b1, b2, eps, bias_correction=False)``, bit for bit.

    Args:
        b1, b2: the moment decay rates, in [0, 1).
        eps: added to the root, >= 0.
        freeze_step: the number of warm-up updates (DeepSpeed's ``freeze_step``), >= 0.
        where: the name errors start with.

    Returns:
        A :class:`GradientTransformation` with state :class:`~fzero.optim.ScaleByAdamState`.
    """
    b1, b2 = check_unit(where, "b1", b1), check_unit(where, "b2", b2)
    eps = check_nonneg(where, "eps", eps)
    if isinstance(freeze_step, bool) or not isinstance(freeze_step, int) or freeze_step < 0:
        raise TypeError(f"{where}: freeze_step must be an int >= 0, got {freeze_step!r}")
    adam = scale_by_adam(b1, b2, eps, bias_correction=False, where=where)

    @torch.no_grad()
    def update_fn(updates, state, params=None):
        if int(state.count) < freeze_step:
            return adam.update(updates, state, params)
        g, mu, spec, count = _moment_leaves(where, state, updates)
        if not g:
            return updates, state._replace(count=count)
        mu = torch._foreach_lerp(mu, g, 1.0 - b1)  # scale_by_adam's arithmetic
        mu = [m.to(x.dtype) for m, x in zip(compressed_pmean(mu, where), mu)]
        denom = torch._foreach_sqrt(tree.leaves(state.nu))
        torch._foreach_add_(denom, eps)
        out = torch._foreach_div(mu, denom)
        return tree.unflatten(spec, out), ScaleByAdamState(count=count, mu=tree.unflatten(spec, mu), nu=state.nu)

    return record(GradientTransformation(adam.init, update_fn), ScaleByOnebitAdam(b1, b2, eps, freeze_step, where))


def onebit_adam(
    learning_rate: ScalarOrSchedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    freeze_step: int = 100000,
) -> GradientTransformation:
    """1-bit Adam, DeepSpeed's ``OnebitAdam`` (its defaults)::

        warm-up (the first freeze_step updates), on the averaged gradient:
            mu = b1 * mu + (1 - b1) * g ;  nu = b2 * nu + (1 - b2) * g^2
        then, on this rank's gradient, nu frozen:
            mu = compressed_pmean(b1 * mu + (1 - b1) * g)
        u = -lr * (mu / (sqrt(nu) + eps) + weight_decay * p)

    No bias correction (DeepSpeed's OnebitAdam accepts ``bias_correction`` and does not use
    it), decoupled weight decay scaled by the learning rate. The warm-up is
    ``adamw(learning_rate, b1, b2, eps, weight_decay, bias_correction=False)`` bit for bit.
    After it, gradients are not averaged: the momentum is, 1-bit compressed with error
    feedback (:mod:`fzero.distributed.compressed`), about 1/32 of the bytes. ZeRO stage 0 only.

    Args:
        learning_rate: a float or a schedule ``fn(count) -> float``.
        b1, b2: DeepSpeed's ``betas``, in [0, 1).
        eps: added to the root, >= 0.
        weight_decay: decoupled decay, >= 0.
        freeze_step: the number of uncompressed warm-up updates.

    Returns:
        ``chain(scale_by_onebit_adam(b1, b2, eps, freeze_step=freeze_step),
        add_decayed_weights(weight_decay), scale_by_learning_rate(learning_rate))``.

    Raises:
        TypeError, ValueError: an argument out of range, named.

    Example:
        >>> from fzero import optim
        >>> tx = optim.onebit_adam(0.1, freeze_step=1)
        >>> params = {"w": torch.zeros(2)}
        >>> updates, state = tx.update({"w": torch.tensor([1.0, -1.0])}, tx.init(params), params)
        >>> optim.apply_updates(params, updates)["w"]     # mu / sqrt(nu) = sqrt(10) * sign(g)
        tensor([-0.3162,  0.3162])
    """
    where = "fzero.optim.onebit_adam"
    lr = check_lr(where, learning_rate)
    wd = check_nonneg(where, "weight_decay", weight_decay)
    return chain(scale_by_onebit_adam(b1, b2, eps, freeze_step=freeze_step, where=where),
                 add_decayed_weights(wd, where=where), scale_by_learning_rate(lr, where=where))
