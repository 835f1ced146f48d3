"""The optimizers: chains of the transformations in :mod:`fzero.optim.transform`.

``adam``, ``adamw`` and ``sgd`` compute what ``torch.optim.Adam``, ``AdamW`` and ``SGD``
compute; ``lamb`` and ``lion`` what optax's ``lamb`` and ``lion`` compute, with optax's
defaults. Each is nothing but its chain: the lowering recognises the chain by its members
(:func:`~fzero.optim.fused_spec_of`) to run it as the fused kernels.

Every learning rate may be a float or a schedule ``fn(count) -> float`` with ``count`` the
0-based index of the update (``fzero.optim.schedules``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from fzero.optim._checks import check_lr, check_nonneg, check_unit
from fzero.optim.base import GradientTransformation, ScalarOrSchedule, chain, identity
from fzero.optim.transform import (
    add_decayed_weights,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_lion,
    scale_by_trust_ratio,
    trace,
)

__all__ = ["adam", "adamw", "lamb", "lion", "sgd"]


class _Adam(NamedTuple):
    where: str
    learning_rate: ScalarOrSchedule
    b1: float
    b2: float
    eps: float
    eps_root: float
    weight_decay: float


def _adam_args(kind: str, learning_rate: Any, b1: Any, b2: Any, eps: Any, eps_root: Any, weight_decay: Any) -> _Adam:
    """The Adam family's hyperparameters, checked in the order of the signature (the members
    check them again, in the chain's order)."""
    where = f"fzero.optim.{kind}"
    return _Adam(where, check_lr(where, learning_rate), check_unit(where, "b1", b1), check_unit(where, "b2", b2),
                 check_nonneg(where, "eps", eps), check_nonneg(where, "eps_root", eps_root),
                 check_nonneg(where, "weight_decay", weight_decay))


def sgd(
    learning_rate: ScalarOrSchedule,
    momentum: float | None = None,
    nesterov: bool = False,
    weight_decay: float = 0.0,
) -> GradientTransformation:
    """Stochastic gradient descent, as ``torch.optim.SGD`` (dampening 0)::

        g = g + weight_decay * p
        buf = momentum * buf + g          (buf = g at the first update)
        u = -lr * (g + momentum * buf if nesterov else buf)   (u = -lr * g without momentum)

    Args:
        learning_rate: a float or a schedule ``fn(count) -> float``.
        momentum: the momentum coefficient in [0, 1], or ``None`` (or 0) for none.
        nesterov: Nesterov momentum; needs ``momentum > 0``.
        weight_decay: L2 coefficient added to the gradient (torch's ``weight_decay``).

    Returns:
        ``chain(add_decayed_weights(weight_decay), trace(momentum, nesterov) or identity(),
        scale_by_learning_rate(learning_rate))``.

    Raises:
        TypeError: a learning rate that is neither a number nor callable, or a non-number.
        ValueError: a negative learning rate or weight decay, momentum outside [0, 1], or
            ``nesterov`` without momentum.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> tx = optim.sgd(0.1, momentum=0.9)
        >>> params = {"w": torch.ones(2)}
        >>> state = tx.init(params)
        >>> for _ in range(2):
        ...     updates, state = tx.update({"w": torch.ones(2)}, state, params)
        ...     params = optim.apply_updates(params, updates)
        >>> params["w"]
        tensor([0.7100, 0.7100])
    """
    where = "fzero.optim.sgd"
    lr = check_lr(where, learning_rate)
    wd = check_nonneg(where, "weight_decay", weight_decay)
    mom = None if momentum is None else check_unit(where, "momentum", momentum, closed=True)
    if nesterov and not mom:
        raise ValueError(f"{where}: nesterov=True needs a momentum > 0 (as torch.optim.SGD), got momentum={momentum!r}")
    return chain(
        add_decayed_weights(wd, where=where),
        trace(mom, nesterov, where=where) if mom else identity(),
        scale_by_learning_rate(lr, where=where),
    )


def adam(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    bias_correction: bool = True,
) -> GradientTransformation:
    """Adam, as ``torch.optim.Adam``, with torch's L2 weight decay (added to the gradient)::

        g = g + weight_decay * p
        mu = b1 * mu + (1 - b1) * g ;  nu = b2 * nu + (1 - b2) * g^2
        u = -lr / (1 - b1^t) * mu / (sqrt(nu) / sqrt(1 - b2^t) + eps)

    Args:
        learning_rate: a float or a schedule ``fn(count) -> float``.
        b1, b2: the moment decay rates, in [0, 1).
        eps: added to the denominator after the square root, >= 0.
        weight_decay: L2 coefficient (torch's ``weight_decay``; optax's ``adam`` has none).
        bias_correction: ``False`` drops the ``1 - b^t`` factors (DeepSpeed's
            ``FusedAdam(bias_correction=False)``): ``u = -lr * mu / (sqrt(nu) + eps)``. Such a
            chain is not fused; it runs as itself.

    Returns:
        ``chain(add_decayed_weights(weight_decay), scale_by_adam(b1, b2, eps),
        scale_by_learning_rate(learning_rate))``.

    Raises:
        TypeError: a learning rate that is neither a number nor callable, or a non-number.
        ValueError: a rate outside [0, 1), a negative learning rate, ``eps`` or weight decay.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> tx = optim.adam(0.1)
        >>> params = {"w": torch.zeros(2)}
        >>> updates, state = tx.update({"w": torch.tensor([1.0, -1.0])}, tx.init(params), params)
        >>> optim.apply_updates(params, updates)["w"]
        tensor([-0.1000,  0.1000])
    """
    a = _adam_args("adam", learning_rate, b1, b2, eps, 0.0, weight_decay)
    return chain(
        add_decayed_weights(a.weight_decay, where=a.where),
        scale_by_adam(a.b1, a.b2, a.eps, bias_correction=bias_correction, where=a.where),
        scale_by_learning_rate(a.learning_rate, where=a.where),
    )


def adamw(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    mask: Any = None,
    *,
    bias_correction: bool = True,
) -> GradientTransformation:
    """AdamW, as ``torch.optim.AdamW`` (decoupled weight decay, scaled by the learning rate)::

        p = p * (1 - lr * weight_decay)       (masked-in leaves only)
        p = p - lr / (1 - b1^t) * mu / (sqrt(nu) / sqrt(1 - b2^t) + eps)

    computed, as optax's ``adamw``, as the update ``-lr * (adam(g) + weight_decay * p)``.

    Args:
        learning_rate: a float or a schedule ``fn(count) -> float``.
        b1, b2: the moment decay rates, in [0, 1).
        eps: added to the denominator after the square root, >= 0.
        weight_decay: the decoupled decay coefficient, >= 0. The default 1e-2 is
            ``torch.optim.AdamW``'s (optax's ``adamw`` defaults to 1e-4).
        mask: which leaves are decayed: ``None`` (all), a pytree of bools with the params'
            structure, or a callable ``params -> such a pytree``. The Adam step applies to all.
            Like optax's, the mask is the optimizer's, fixed when it is made: the optimizer
            reads a pytree mask once for each structure of the parameters (change it by
            making a new optimizer), and calls a callable at every update.
        bias_correction: ``False`` drops the ``1 - b^t`` factors (DeepSpeed's
            ``FusedAdam(bias_correction=False)`` in AdamW mode):
            ``u = -lr * (mu / (sqrt(nu) + eps) + weight_decay * p)``. Not fused.

    Returns:
        ``chain(scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate))``.

    Raises:
        TypeError: a learning rate that is neither a number nor callable, or a non-number;
            (at init) a mask leaf that is not a bool.
        ValueError: a rate outside [0, 1), a negative learning rate, ``eps`` or weight decay;
            (at init/update) a mask whose structure is not the params', naming the key paths.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> tx = optim.adamw(0.1, weight_decay=0.5, mask={"w": True, "b": False})
        >>> params = {"w": torch.ones(1), "b": torch.ones(1)}
        >>> grads = {"w": torch.zeros(1), "b": torch.zeros(1)}
        >>> updates, state = tx.update(grads, tx.init(params), params)
        >>> optim.apply_updates(params, updates)
        {'w': tensor([0.9500]), 'b': tensor([1.])}
    """
    a = _adam_args("adamw", learning_rate, b1, b2, eps, 0.0, weight_decay)
    return chain(
        scale_by_adam(a.b1, a.b2, a.eps, bias_correction=bias_correction, where=a.where),
        add_decayed_weights(a.weight_decay, mask, where=a.where),
        scale_by_learning_rate(a.learning_rate, where=a.where),
    )


def lamb(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    eps_root: float = 0.0,
    weight_decay: float = 0.0,
    mask: Any = None,
) -> GradientTransformation:
    """LAMB (You et al., 2020), as optax's ``lamb``::

        a = mu_hat / (sqrt(nu_hat + eps_root) + eps) + weight_decay * p   (adam, then decay)
        u = -lr * a * ||p|| / ||a||      per leaf (ratio 1 where either norm is 0)

    The per-leaf norms sum local squares through ``psum``, so they are exact on shards.

    Args:
        learning_rate: a float or a schedule ``fn(count) -> float``.
        b1, b2: the moment decay rates, in [0, 1).
        eps: added to the denominator after the square root, >= 0.
        eps_root: added inside the square root, >= 0.
        weight_decay: the coefficient of ``p`` added to the Adam direction, >= 0.
        mask: which leaves get weight decay (see :func:`adamw`).

    Returns:
        ``chain(scale_by_adam(b1, b2, eps, eps_root), add_decayed_weights(weight_decay, mask),
        scale_by_trust_ratio(), scale_by_learning_rate(learning_rate))``.

    Raises:
        TypeError, ValueError: as :func:`adamw`.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> tx = optim.lamb(0.1)
        >>> params = {"w": torch.tensor([3.0, 4.0])}
        >>> updates, _ = tx.update({"w": torch.tensor([1.0, 0.0])}, tx.init(params), params)
        >>> updates["w"]
        tensor([-0.5000, -0.0000])
    """
    a = _adam_args("lamb", learning_rate, b1, b2, eps, eps_root, weight_decay)
    return chain(
        scale_by_adam(a.b1, a.b2, a.eps, a.eps_root, where=a.where),
        add_decayed_weights(a.weight_decay, mask, where=a.where),
        scale_by_trust_ratio(where=a.where),
        scale_by_learning_rate(a.learning_rate, where=a.where),
    )


def lion(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.99,
    weight_decay: float = 1e-3,
    mask: Any = None,
) -> GradientTransformation:
    """Lion (Chen et al., 2023), as optax's ``lion``::

        u = -lr * (sign(b1 * mu + (1 - b1) * g) + weight_decay * p)
        mu = b2 * mu + (1 - b2) * g

    Args:
        learning_rate: a float or a schedule ``fn(count) -> float``.
        b1: interpolation rate of momentum and gradient for the update, in [0, 1].
        b2: decay rate of the momentum, in [0, 1].
        weight_decay: the decoupled decay coefficient, >= 0.
        mask: which leaves get weight decay (see :func:`adamw`).

    Returns:
        ``chain(scale_by_lion(b1, b2), add_decayed_weights(weight_decay, mask),
        scale_by_learning_rate(learning_rate))``.

    Raises:
        TypeError, ValueError: as :func:`adamw`.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> tx = optim.lion(0.1, weight_decay=0.0)
        >>> params = {"w": torch.zeros(2)}
        >>> updates, _ = tx.update({"w": torch.tensor([0.2, -5.0])}, tx.init(params), params)
        >>> updates["w"]
        tensor([-0.1000,  0.1000])
    """
    where = "fzero.optim.lion"
    lr = check_lr(where, learning_rate)
    b1, b2 = check_unit(where, "b1", b1, closed=True), check_unit(where, "b2", b2, closed=True)
    return chain(
        scale_by_lion(b1, b2, where=where),
        add_decayed_weights(check_nonneg(where, "weight_decay", weight_decay), mask, where=where),
        scale_by_learning_rate(lr, where=where),
    )
