"""Adagrad (Duchi et al., 2011): each coordinate's step divided by the root of the sum of its
squared gradients so far.

``adagrad`` takes optax's names and defaults (``optax.adagrad(learning_rate,
initial_accumulator_value=0.1, eps=1e-7)``) and computes ``torch.optim.Adagrad``'s arithmetic,
which is what DeepSpeed builds for ``{"optimizer": {"type": "Adagrad"}}`` (``torch.optim.Adagrad``,
or ``DeepSpeedCPUAdagrad`` with the same formula under optimizer offload). Where the two
libraries differ, see :func:`adagrad`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from fzero import tree
from fzero.optim._checks import check_lr, check_nonneg
from fzero.optim.base import GradientTransformation, ScalarOrSchedule, chain
from fzero.optim.transform import _state_leaves, add_decayed_weights, scale_by_learning_rate

__all__ = ["ScaleByRssState", "adagrad", "scale_by_rss"]


class ScaleByRssState(NamedTuple):
    """Adagrad's state: the running sum of squared updates, per leaf (optax's name)."""

    sum_of_squares: Any


def scale_by_rss(initial_accumulator_value: float = 0.1, eps: float = 1e-7, *,
                 where: str = "fzero.optim.scale_by_rss") -> GradientTransformation:
    """Rescale updates by the root of the sum of their squares so far::

        s   = s + g^2                     (s starts at initial_accumulator_value)
        out = g / (sqrt(s) + eps)

    ``eps`` sits outside the square root, where ``torch.optim.Adagrad`` puts it; optax's
    ``scale_by_rss`` computes ``g / sqrt(s + eps)`` (0 where ``s`` is 0) instead.

    Args:
        initial_accumulator_value: the sum's starting value, >= 0.
        eps: added to the root, >= 0.
        where: the name errors start with.

    Returns:
        A :class:`GradientTransformation` with state :class:`ScaleByRssState`.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> tx = optim.scale_by_rss(0.0, 0.0)
        >>> u, s = tx.update([torch.tensor([3.0, -4.0])], tx.init([torch.zeros(2)]))
        >>> u[0], s.sum_of_squares[0]
        (tensor([ 1., -1.]), tensor([ 9., 16.]))
    """
    init_value = check_nonneg(where, "initial_accumulator_value", initial_accumulator_value)
    eps = check_nonneg(where, "eps", eps)

    def init_fn(params):
        return ScaleByRssState(sum_of_squares=tree.map(lambda p: torch.full_like(p, init_value), params))

    @torch.no_grad()
    def update_fn(updates, state, params=None):
        del params
        g, s, spec = _state_leaves(where, state.sum_of_squares, updates, "sum_of_squares")
        if not g:
            return updates, state
        s = [x.clone() for x in s]
        torch._foreach_addcmul_(s, g, g, value=1.0)  # torch.optim.Adagrad: state_sum.addcmul_(g, g)
        denom = torch._foreach_sqrt(s)
        torch._foreach_add_(denom, eps)
        out = torch._foreach_div(g, denom)
        return tree.unflatten(spec, out), ScaleByRssState(tree.unflatten(spec, s))

    return GradientTransformation(init_fn, update_fn)


def adagrad(
    learning_rate: ScalarOrSchedule = 1e-2,
    initial_accumulator_value: float = 0.1,
    eps: float = 1e-7,
    *,
    weight_decay: float = 0.0,
    lr_decay: float = 0.0,
) -> GradientTransformation:
    """Adagrad with optax's names and defaults and ``torch.optim.Adagrad``'s arithmetic::

        g   = g + weight_decay * p                         (torch's L2 weight_decay)
        s   = s + g^2                                      (s starts at initial_accumulator_value)
        u   = -lr / (1 + count * lr_decay) * g / (sqrt(s) + eps)

    ``count`` is the 0-based index of the update. Where the libraries differ:

    * optax's ``adagrad`` has ``eps`` inside the root, ``g / sqrt(s + eps)``, and no
      ``weight_decay`` or ``lr_decay``; with the same values the two differ by where ``eps``
      goes (and only there).
    * ``torch.optim.Adagrad`` defaults to ``lr=1e-2, initial_accumulator_value=0,
      eps=1e-10``; pass those to get its defaults. With the same hyperparameters fzero's
      update equals torch's bit for bit (``tests/test_optim_adagrad.py``).

    Args:
        learning_rate: a float or a schedule ``fn(count) -> float``; ``lr_decay`` divides it.
        initial_accumulator_value: the starting value of every sum, >= 0.
        eps: added to the root, >= 0.
        weight_decay: L2 coefficient added to the gradient, >= 0.
        lr_decay: torch's learning-rate decay, >= 0.

    Returns:
        ``chain(add_decayed_weights(weight_decay), scale_by_rss(initial_accumulator_value,
        eps), scale_by_learning_rate(lr / (1 + count * lr_decay)))``.

    Raises:
        TypeError: a learning rate that is neither a number nor callable, or a non-number.
        ValueError: a negative value.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> tx = optim.adagrad(0.1, initial_accumulator_value=0.0, eps=0.0)
        >>> params = {"w": torch.zeros(2)}
        >>> updates, state = tx.update({"w": torch.tensor([2.0, -0.5])}, tx.init(params), params)
        >>> optim.apply_updates(params, updates)["w"]
        tensor([-0.1000,  0.1000])
    """
    where = "fzero.optim.adagrad"
    lr = check_lr(where, learning_rate)
    init_value = check_nonneg(where, "initial_accumulator_value", initial_accumulator_value)
    eps, wd = check_nonneg(where, "eps", eps), check_nonneg(where, "weight_decay", weight_decay)
    lr_decay = check_nonneg(where, "lr_decay", lr_decay)
    if lr_decay:
        base = lr

        def lr(count: int) -> float:  # torch: clr = lr / (1 + (step - 1) * lr_decay)
            value = base(count) if callable(base) else base
            return value / (1 + int(count) * lr_decay)

    return chain(add_decayed_weights(wd, where=where), scale_by_rss(init_value, eps, where=where),
                 scale_by_learning_rate(lr, where=where))
