"""Fused Lion over a flat fp32 shard, one launch (optax's ``lion``).

optax: ``chain(scale_by_lion(b1, b2), add_decayed_weights(wd), scale_by_learning_rate(lr))``:

    g = grad / grad_scale
    u = sign((1 - b1) g + b1 m) + wd * param;  m = (1 - b2) g + b2 m;  param += -lr * u

optax's defaults are b1=0.9, b2=0.99, weight_decay=1e-3. ``sign`` maps 0 and nan to 0
(torch.sign on the CPU).
"""
from __future__ import annotations

from typing import Any

import torch

from fzero_kernels import _common

tl: Any = None  # bound to triton.language by _common.ensure_triton()

__all__ = ["lion_", "lion_reference"]


@_common.jit
def _lion_kernel(
    param_ptr, grad_ptr, exp_avg_ptr, lowp_ptr, flag_ptr, scale_ptr, grad_scale, sumsq_ptr, max_norm, found_inf_ptr,
    n, neg_lr, one_minus_beta1, beta1, one_minus_beta2, beta2, weight_decay,
    SCALE_FROM_PTR: tl.constexpr, CLIP: tl.constexpr, HAS_FOUND_INF: tl.constexpr, LOWP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs, wmask, g, p = _common.update_block(param_ptr, grad_ptr, flag_ptr, scale_ptr, grad_scale, sumsq_ptr,
                                             max_norm, found_inf_ptr, n, SCALE_FROM_PTR, CLIP, HAS_FOUND_INF, BLOCK)
    m = tl.load(exp_avg_ptr + offs, mask=wmask, other=0.0)
    c = one_minus_beta1 * g + beta1 * m
    u = tl.where(c > 0.0, 1.0, tl.where(c < 0.0, -1.0, 0.0)) + weight_decay * p
    m = one_minus_beta2 * g + beta2 * m
    p = p + neg_lr * u
    tl.store(param_ptr + offs, p, mask=wmask)
    tl.store(exp_avg_ptr + offs, m, mask=wmask)
    _common.store_lowp(lowp_ptr, offs, p, wmask, LOWP)


def _run(fn: str, reference: bool, param, grad, exp_avg, lr, beta1, beta2, weight_decay, grad_scale,
         lowp_param, found_inf, grad_sumsq, max_norm) -> torch.Tensor:
    _common.check_update(fn, param, grad, exp_avg=exp_avg)
    _common.check_hyper(fn, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay)
    ga = _common.check_grad_args(fn, param.device, grad_scale, grad_sumsq, max_norm, found_inf)
    lowp = _common.check_lowp(fn, lowp_param, param)
    if _common.runs_reference(fn, reference, param.device):
        g, flag, found = _common.reference_grad(grad, ga)
        mode = _common.skip_mode(found)
        if mode == "skip":
            return flag
        p, m = _common.reference_targets(mode, param, exp_avg)
        u = torch.mul(g, 1 - beta1).add_(torch.mul(m, beta1)).sign_().add_(torch.mul(p, weight_decay))
        m.mul_(beta2).add_(torch.mul(g, 1 - beta2))
        p.add_(u.mul_(-lr))
        _common.finish_reference(mode, found, (param, exp_avg), (p, m), lowp)
        return flag
    return _common.launch_update(_lion_kernel, (param, grad, exp_avg), lowp, ga,
                                 (-lr, 1 - beta1, beta1, 1 - beta2, beta2, weight_decay))


def lion_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, lr: float, beta1: float,
          beta2: float, weight_decay: float, grad_scale: float | torch.Tensor = 1.0,
          lowp_param: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
          grad_sumsq: torch.Tensor | None = None, max_norm: float | None = None) -> torch.Tensor:
    """One Lion step (optax's ``lion``) in place on a flat fp32 shard.

    Args:
        param, exp_avg: equal-length 1-D contiguous fp32, updated in place.
        grad: fp32, bf16 or fp16, same length. Read only.
        lr, beta1, beta2, weight_decay: optax's ``learning_rate``, ``b1``, ``b2``, ``weight_decay``.
        grad_scale, lowp_param, found_inf, grad_sumsq, max_norm: as :func:`fzero_kernels.adamw_`.

    Returns:
        The 0-dim fp32 non-finite flag of ``grad / grad_scale``.

    >>> import torch, fzero_kernels
    >>> p = torch.ones(2); m = torch.zeros(2)
    >>> _ = fzero_kernels.lion_(p, torch.tensor([0.5, -2.0]), m, lr=0.1, beta1=0.9, beta2=0.99,
    ...                         weight_decay=0.0)
    >>> p
    tensor([0.9000, 1.1000])
    """
    return _run("fzero_kernels.lion_", False, param, grad, exp_avg, lr, beta1, beta2, weight_decay, grad_scale,
                lowp_param, found_inf, grad_sumsq, max_norm)


def lion_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, *, lr: float, beta1: float,
                   beta2: float, weight_decay: float, grad_scale: float | torch.Tensor = 1.0,
                   lowp_param: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
          grad_sumsq: torch.Tensor | None = None, max_norm: float | None = None) -> torch.Tensor:
    """Pure-torch :func:`lion_`."""
    return _run("fzero_kernels.lion_reference", True, param, grad, exp_avg, lr, beta1, beta2, weight_decay,
                grad_scale, lowp_param, found_inf, grad_sumsq, max_norm)
