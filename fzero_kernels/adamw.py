"""Fused AdamW / Adam over a flat fp32 shard: one launch reads param, grad and both moments
once, and writes param, both moments and (optionally) a bf16/fp16 copy of param.

Math is ``torch.optim.AdamW`` / ``torch.optim.Adam`` (single-tensor path), with the gradient
first divided by ``grad_scale`` (a loss scale, which may also carry a clip coefficient):

    g = grad.float() / grad_scale
    adamw: param *= 1 - lr * weight_decay          adam: g += weight_decay * param
    m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g * g
    param -= lr / (1 - beta1**step) * m / (sqrt(v) / sqrt(1 - beta2**step) + eps)

Scalar factors are computed on the host in float64 as torch does, then rounded to fp32.
"""
from __future__ import annotations

from typing import Any

import torch

from fzero_kernels import _common

tl: Any = None  # bound to triton.language by _common.ensure_triton()

__all__ = ["adamw_", "adamw_reference", "adam_", "adam_reference"]


@_common.jit
def adam_math(p, g, m, v, decay, weight_decay, lerp_weight, beta2, one_minus_beta2, neg_step_size,
              bias_correction2_sqrt, eps, DECOUPLED: tl.constexpr, LERP_LOW: tl.constexpr):
    """One Adam(W) step on a block: the new ``(param, exp_avg, exp_avg_sq)``. Shared by the
    per-shard and the multi-tensor kernels, so both round alike, bit for bit."""
    if DECOUPLED:
        p = p * decay
    else:
        g = g + weight_decay * p
    # torch's lerp: start + w * (end - start) for w < 0.5, else end - (end - start) * (1 - w)
    if LERP_LOW:
        m = m + lerp_weight * (g - m)
    else:
        m = g - (g - m) * (1.0 - lerp_weight)
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p + tl.div_rn(neg_step_size * m, denom)  # addcdiv: self + value * t1 / t2
    return p, m, v


@_common.jit
def _adam_kernel(
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, lowp_ptr, flag_ptr,
    scale_ptr, grad_scale, sumsq_ptr, max_norm, found_inf_ptr,
    n, decay, weight_decay, lerp_weight, beta2, one_minus_beta2, neg_step_size, bias_correction2_sqrt, eps,
    DECOUPLED: tl.constexpr, LERP_LOW: tl.constexpr, SCALE_FROM_PTR: tl.constexpr, CLIP: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr, LOWP: tl.constexpr, BLOCK: tl.constexpr,
):
    # found_inf (or a non-finite clip norm) masks every state load and store: a skipped
    # step moves no state.
    offs, wmask, g, p = _common.update_block(param_ptr, grad_ptr, flag_ptr, scale_ptr, grad_scale, sumsq_ptr,
                                             max_norm, found_inf_ptr, n, SCALE_FROM_PTR, CLIP, HAS_FOUND_INF, BLOCK)
    m = tl.load(exp_avg_ptr + offs, mask=wmask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offs, mask=wmask, other=0.0)
    p, m, v = adam_math(p, g, m, v, decay, weight_decay, lerp_weight, beta2, one_minus_beta2, neg_step_size,
                        bias_correction2_sqrt, eps, DECOUPLED, LERP_LOW)
    tl.store(param_ptr + offs, p, mask=wmask)
    tl.store(exp_avg_ptr + offs, m, mask=wmask)
    tl.store(exp_avg_sq_ptr + offs, v, mask=wmask)
    _common.store_lowp(lowp_ptr, offs, p, wmask, LOWP)


def scalars(*, lr, beta1, beta2, eps, weight_decay, step) -> tuple[tuple[float, ...], bool]:
    """The kernels' scalar arguments, from ``decay`` to ``eps`` (computed on the host in
    float64, as torch does), and ``LERP_LOW``."""
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    lerp_weight = 1 - beta1
    return ((1 - lr * weight_decay, weight_decay, lerp_weight, beta2, 1 - beta2,
             -(lr / bias_correction1), bias_correction2 ** 0.5, eps), abs(lerp_weight) < 0.5)


def _launch(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
            ga: _common.GradArgs, lowp, decoupled: bool, flag: torch.Tensor | None = None) -> torch.Tensor:
    values, lerp_low = scalars(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step)
    return _common.launch_update(_adam_kernel, (param, grad, exp_avg, exp_avg_sq), lowp, ga, values,
                                 flag=flag, DECOUPLED=decoupled, LERP_LOW=lerp_low)


def _reference(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
               ga: _common.GradArgs, lowp, decoupled: bool) -> torch.Tensor:
    # The same ops, in the same order, as torch.optim.adam._single_tensor_adam.
    g, flag, found = _common.reference_grad(grad, ga)
    mode = _common.skip_mode(found)
    if mode == "skip":
        return flag
    p, m, v = _common.reference_targets(mode, param, exp_avg, exp_avg_sq)
    if decoupled:
        p.mul_(1 - lr * weight_decay)
    else:
        g = g.add(p, alpha=weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    denom = (v.sqrt() / bias_correction2 ** 0.5).add_(eps)
    p.addcdiv_(m, denom, value=-(lr / bias_correction1))
    _common.finish_reference(mode, found, (param, exp_avg, exp_avg_sq), (p, m, v), lowp)
    return flag


def _adam(name: str, *, decoupled: bool, reference: bool, doc: str):
    """One of this module's four public functions -- AdamW (``decoupled``) or Adam, the kernel
    or its pure-torch reference (``reference``) -- each with the one signature written here."""
    fn = f"fzero_kernels.{name}"

    def adam(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
             lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
             grad_scale: float | torch.Tensor = 1.0, lowp_param: torch.Tensor | None = None,
             found_inf: torch.Tensor | None = None, grad_sumsq: torch.Tensor | None = None,
             max_norm: float | None = None) -> torch.Tensor:
        _common.check_update(fn, param, grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
        _common.check_hyper(fn, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
        kw = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                  step=_common.check_step(fn, step),
                  ga=_common.check_grad_args(fn, param.device, grad_scale, grad_sumsq, max_norm, found_inf),
                  lowp=_common.check_lowp(fn, lowp_param, param), decoupled=decoupled)
        run = _reference if _common.runs_reference(fn, reference, param.device) else _launch
        return run(param, grad, exp_avg, exp_avg_sq, **kw)

    adam.__name__ = adam.__qualname__ = name
    adam.__doc__ = doc
    return adam


adamw_ = _adam("adamw_", decoupled=True, reference=False, doc="""
    One AdamW step (``torch.optim.AdamW``'s math) in place on a flat fp32 shard.

    Args:
        param, exp_avg, exp_avg_sq: equal-length 1-D contiguous fp32 tensors on one device,
            updated in place.
        grad: same length; fp32, bf16 or fp16. Read only.
        lr, beta1, beta2, eps, weight_decay: as ``torch.optim.AdamW`` (decay is decoupled).
        step: 1-based update count, for bias correction.
        grad_scale: ``grad`` is divided by it first (the loss scale; it may also carry a
            clip coefficient). A float, or a 1-element tensor on the device (no host sync).
        lowp_param: optional bf16/fp16 tensor of the same length; receives
            ``param.to(dtype)`` of the new param (round to nearest even), in the same pass.
        found_inf: optional 1-element tensor on the device; when nonzero the step reads and
            writes no state (param, moments and lowp_param keep their bits), as torch's
            fused AdamW does with its ``found_inf``.
        grad_sumsq, max_norm: clip by global norm in the same pass. ``grad_sumsq`` is the
            1-element sum of squares of ``grad / grad_scale`` over all of the model's
            gradients (:func:`fzero_kernels.sum_of_squares`, all-reduced across ranks);
            the gradient is then multiplied by ``min(1, max_norm / (sqrt(grad_sumsq) + 1e-6))``,
            as ``torch.nn.utils.clip_grad_norm_``. A non-finite ``grad_sumsq`` (some gradient
            overflowed) skips the step as ``found_inf`` does, so one norm pass before the
            update gives unscale, clip and skip-on-overflow with no host sync.

    Returns:
        A 0-dim fp32 tensor on the device: 1.0 if any (unscaled, clipped) gradient, or
        ``grad_sumsq``, was inf or nan, else 0.0; produced without a host sync. Without
        ``found_inf`` or ``grad_sumsq`` the step is written even then (the kernel learns of
        the overflow as it writes): to skip, pass a check made first -- ``grad_sumsq``, or
        ``found_inf`` from :func:`fzero_kernels.nonfinite_check` / ``unscale_and_check_``.

    Raises:
        TypeError, ValueError: a wrong dtype, device, length, shape, contiguity or
        hyperparameter; the message starts with ``fzero_kernels.adamw_``.

    Runs the Triton kernel for CUDA tensors and for CPU tensors under ``TRITON_INTERPRET=1``,
    otherwise :func:`adamw_reference`.

    >>> import torch, fzero_kernels
    >>> p = torch.ones(4); m = torch.zeros(4); v = torch.zeros(4)
    >>> flag = fzero_kernels.adamw_(p, torch.full((4,), 0.5), m, v, lr=0.1, beta1=0.9,
    ...                             beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    >>> p, bool(flag)
    (tensor([0.9000, 0.9000, 0.9000, 0.9000]), False)
    """)

adamw_reference = _adam("adamw_reference", decoupled=True, reference=True,
                        doc="Pure-torch :func:`adamw_` (same signature, same result up to fp32 rounding).")

adam_ = _adam("adam_", decoupled=False, reference=False,
              doc="""One Adam step (``torch.optim.Adam``: weight decay is L2, ``g += weight_decay * param``
    before the moments). Same kernel, arguments and flag as :func:`adamw_`.""")

adam_reference = _adam("adam_reference", decoupled=False, reference=True, doc="Pure-torch :func:`adam_`.")
