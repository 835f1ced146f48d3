"""DeepSpeed's LAMB (``FusedLamb``), which is not optax's :func:`~fzero.optim.lamb`.

What ``deepspeed.initialize`` builds for ``{"optimizer": {"type": "Lamb"}}``, read from
``deepspeed/ops/lamb/fused_lamb.py`` and ``csrc/lamb/fused_lamb_cuda_kernel.cu`` (DeepSpeed
0.19.8); ``fzero.Config`` builds it for that section. It differs from the LAMB paper and
optax in three places: the direction uses the moments *without* bias correction, the trust
ratio is clamped to ``[min_coeff, max_coeff]``, and the bias corrections multiply the step.

It is written on the public contract (:class:`~fzero.optim.GradientTransformation`,
:func:`~fzero.optim.chain`, :func:`~fzero.optim.leaf_norms`), as a transformation of one's own
would be, with the argument checks and Adam's moment arithmetic that the other LAMBs share.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from fzero import tree
from fzero.optim._checks import check_adamw_args, check_coeff_bounds, check_update_args
from fzero.optim.base import GradientTransformation, ScalarOrSchedule, chain
from fzero.optim.clipping import leaf_norms
from fzero.optim.transform import _adam_moments, scale_by_learning_rate

__all__ = ["ScaleByDeepSpeedLambState", "deepspeed_lamb"]


class ScaleByDeepSpeedLambState(NamedTuple):
    """FusedLamb's state: the update count and the moments ``mu``, ``nu`` (no bias correction)."""

    count: torch.Tensor
    mu: Any
    nu: Any


def deepspeed_lamb(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    bias_correction: bool = True,
    eps_inside_sqrt: bool = False,
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
) -> GradientTransformation:
    """DeepSpeed's FusedLamb, with its defaults. Per tensor, with ``t`` the 1-based update index::

        mu = b1 * mu + (1 - b1) * g ;  nu = b2 * nu + (1 - b2) * g^2
        u = mu / (sqrt(nu) + eps) + weight_decay * p        (sqrt(nu + eps) if eps_inside_sqrt)
        ratio = clamp(||p|| / ||u||, min_coeff, max_coeff)  1 if a norm is 0
        p -= lr * sqrt(1 - b2^t) / (1 - b1^t) * ratio * u    (the factor is 1 without bias correction)

    The per-tensor norms are :func:`~fzero.optim.leaf_norms`, exact on ZeRO shards. It is never
    fused (``fused_spec_of(tx) is None``): ``fzero_kernels``' LAMB is optax's.

    Args:
        learning_rate: a float or a schedule ``fn(count) -> float``.
        b1, b2: the moment decay rates (DeepSpeed's ``betas``), in [0, 1).
        eps: the denominator's stabiliser, >= 0.
        weight_decay: the coefficient of ``p`` added to the direction, >= 0.
        bias_correction: multiply the step by ``sqrt(1 - b2^t) / (1 - b1^t)``.
        eps_inside_sqrt: ``sqrt(nu + eps)`` instead of ``sqrt(nu) + eps``.
        max_coeff, min_coeff: the bounds of the trust ratio, ``0 <= min_coeff <= max_coeff``.

    Returns:
        ``chain(the direction above, scale_by_learning_rate(learning_rate))``, with state
        ``(ScaleByDeepSpeedLambState(count, mu, nu), the learning rate's state)``; ``update``
        needs ``params``.

    Raises:
        TypeError: an argument is not a number, or a learning rate neither a number nor callable.
        ValueError: a rate outside [0, 1), a negative value, ``min_coeff > max_coeff``; at
            update time, no ``params``, or updates or params whose structure is not the state's.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> tx = optim.deepspeed_lamb(0.1)
        >>> params = {"w": torch.tensor([3.0, 4.0])}
        >>> updates, _ = tx.update({"w": torch.tensor([1.0, 0.0])}, tx.init(params), params)
        >>> updates["w"]
        tensor([-0.1581, -0.0000])
    """
    where = "fzero.optim.deepspeed_lamb"
    lr, b1, b2, eps, weight_decay = check_adamw_args(where, learning_rate, b1, b2, eps, weight_decay)
    max_coeff, min_coeff = check_coeff_bounds(where, max_coeff, min_coeff)

    def init_fn(params):
        return ScaleByDeepSpeedLambState(count=torch.zeros((), dtype=torch.int64),
                                         mu=tree.map(torch.zeros_like, params),
                                         nu=tree.map(torch.zeros_like, params))

    @torch.no_grad()
    def update_fn(updates, state, params=None):
        mu, spec, g, p = check_update_args(where, state.mu, updates, params)
        count = state.count + 1
        if not g:
            return updates, state._replace(count=count)
        mu, nu = _adam_moments(mu, tree.leaves(state.nu), g, b1, b2)
        if eps_inside_sqrt:
            denom = torch._foreach_add(nu, eps)
            torch._foreach_sqrt_(denom)
        else:
            denom = torch._foreach_sqrt(nu)
            torch._foreach_add_(denom, eps)
        u = torch._foreach_div(mu, denom)
        if weight_decay:
            torch._foreach_add_(u, [x.to(y.dtype) for x, y in zip(p, u)], alpha=weight_decay)
        # trees keyed by parameter, so that tensor_parallel can tell split leaves from whole ones
        w_norm, u_norm = leaf_norms(params, tree.unflatten(spec, u), device=u[0].device)
        ratio = torch.where((w_norm != 0) & (u_norm != 0),
                            (w_norm / u_norm).clamp(min_coeff, max_coeff), torch.ones_like(w_norm))
        t = int(count)
        if bias_correction:  # DeepSpeed folds both corrections into the step size
            ratio = ratio * (math.sqrt(1.0 - b2**t) / (1.0 - b1**t))
        out = torch._foreach_mul(u, [r.to(x.device) for r, x in zip(ratio.unbind(0), u)])
        return tree.unflatten(spec, out), ScaleByDeepSpeedLambState(
            count=count, mu=tree.unflatten(spec, mu), nu=tree.unflatten(spec, nu))

    return chain(GradientTransformation(init_fn, update_fn), scale_by_learning_rate(lr, where=where))
