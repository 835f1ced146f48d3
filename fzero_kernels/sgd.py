"""Fused SGD (momentum, dampening, Nesterov, L2 weight decay) over a flat fp32 shard, one
launch. Math is ``torch.optim.SGD``'s single-tensor path, on ``g = grad / grad_scale``:

    g += weight_decay * param                        (when weight_decay != 0)
    buf = g at step 1, else momentum * buf + (1 - dampening) * g   (when momentum != 0)
    g = g + momentum * buf if nesterov else buf
    param += -lr * g
"""
from __future__ import annotations

from typing import Any

import torch

from fzero_kernels import _common

tl: Any = None  # bound to triton.language by _common.ensure_triton()

__all__ = ["sgd_", "sgd_reference"]


@_common.jit
def _sgd_kernel(
    param_ptr, grad_ptr, buf_ptr, lowp_ptr, flag_ptr, scale_ptr, grad_scale, sumsq_ptr, max_norm, found_inf_ptr,
    n, neg_lr, momentum, one_minus_dampening, weight_decay,
    HAS_WD: tl.constexpr, MOMENTUM: tl.constexpr, FIRST: tl.constexpr, NESTEROV: tl.constexpr,
    SCALE_FROM_PTR: tl.constexpr, CLIP: tl.constexpr, HAS_FOUND_INF: tl.constexpr, LOWP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs, wmask, g, p = _common.update_block(param_ptr, grad_ptr, flag_ptr, scale_ptr, grad_scale, sumsq_ptr,
                                             max_norm, found_inf_ptr, n, SCALE_FROM_PTR, CLIP, HAS_FOUND_INF, BLOCK)
    if HAS_WD:
        g = g + weight_decay * p
    if MOMENTUM:
        if FIRST:
            buf = g
        else:
            buf = tl.load(buf_ptr + offs, mask=wmask, other=0.0)
            buf = buf * momentum + one_minus_dampening * g
        tl.store(buf_ptr + offs, buf, mask=wmask)
        if NESTEROV:
            g = g + momentum * buf
        else:
            g = buf
    p = p + neg_lr * g
    tl.store(param_ptr + offs, p, mask=wmask)
    _common.store_lowp(lowp_ptr, offs, p, wmask, LOWP)


def _run(fn: str, reference: bool, param, grad, momentum_buffer, lr, momentum, dampening, nesterov,
         weight_decay, step, grad_scale, lowp_param, found_inf, grad_sumsq, max_norm) -> torch.Tensor:
    _common.check_update(fn, param, grad)
    _common.check_hyper(fn, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(f"{fn}: nesterov needs momentum > 0 and dampening == 0 (as torch.optim.SGD), "
                         f"got momentum={momentum}, dampening={dampening}")
    if momentum != 0:
        if momentum_buffer is None:
            raise ValueError(f"{fn}: momentum={momentum} needs a momentum_buffer (fp32, param's length)")
        _common.check_flat(fn, "momentum_buffer", momentum_buffer, dtypes=(torch.float32,), like=param)
        if step is None:
            raise ValueError(f"{fn}: momentum={momentum} needs step (1-based; at step 1 the buffer "
                             f"is set to the gradient, as torch.optim.SGD)")
        step = _common.check_step(fn, step)
    ga = _common.check_grad_args(fn, param.device, grad_scale, grad_sumsq, max_norm, found_inf)
    lowp = _common.check_lowp(fn, lowp_param, param)
    first = momentum != 0 and step == 1
    if _common.runs_reference(fn, reference, param.device):
        g, flag, found = _common.reference_grad(grad, ga)
        mode = _common.skip_mode(found)
        if mode == "skip":
            return flag
        if momentum != 0:
            p, buf = _common.reference_targets(mode, param, momentum_buffer)
        else:
            (p,), buf = _common.reference_targets(mode, param), None
        if weight_decay != 0:
            g = g.add(p, alpha=weight_decay)
        if buf is not None:
            if first:
                buf.copy_(g)
            else:
                buf.mul_(momentum).add_(g, alpha=1 - dampening)
            g = g.add(buf, alpha=momentum) if nesterov else buf
        p.add_(g, alpha=-lr)
        originals = (param, momentum_buffer) if buf is not None else (param,)
        results = (p, buf) if buf is not None else (p,)
        _common.finish_reference(mode, found, originals, results, lowp)
        return flag
    return _common.launch_update(_sgd_kernel, (param, grad, momentum_buffer if momentum != 0 else param), lowp, ga,
                                 (-lr, momentum, 1 - dampening, weight_decay), HAS_WD=weight_decay != 0,
                                 MOMENTUM=momentum != 0, FIRST=first, NESTEROV=bool(nesterov))


def sgd_(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor | None = None, *, lr: float,
         momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False, weight_decay: float = 0.0,
         step: int | None = None, grad_scale: float | torch.Tensor = 1.0,
         lowp_param: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
         grad_sumsq: torch.Tensor | None = None, max_norm: float | None = None) -> torch.Tensor:
    """One SGD step (``torch.optim.SGD``'s math) in place on a flat fp32 shard.

    Args:
        param: 1-D contiguous fp32, updated in place.
        grad: fp32, bf16 or fp16, same length. Read only.
        momentum_buffer: fp32, same length; required when ``momentum != 0``.
        lr, momentum, dampening, nesterov, weight_decay: as ``torch.optim.SGD`` (decay is L2).
        step: 1-based update count, required with momentum: at step 1 the buffer is set to
            the gradient (torch's "buffer is None" case), later it is decayed.
        grad_scale, lowp_param, found_inf, grad_sumsq, max_norm: as :func:`fzero_kernels.adamw_`.

    Returns:
        The 0-dim fp32 non-finite flag of ``grad / grad_scale``.

    >>> import torch, fzero_kernels
    >>> p = torch.ones(2); buf = torch.empty(2)
    >>> _ = fzero_kernels.sgd_(p, torch.tensor([1.0, -1.0]), buf, lr=0.5, momentum=0.9, step=1)
    >>> p, buf
    (tensor([0.5000, 1.5000]), tensor([ 1., -1.]))
    """
    return _run("fzero_kernels.sgd_", False, param, grad, momentum_buffer, lr, momentum, dampening, nesterov,
                weight_decay, step, grad_scale, lowp_param, found_inf, grad_sumsq, max_norm)


def sgd_reference(param: torch.Tensor, grad: torch.Tensor, momentum_buffer: torch.Tensor | None = None, *,
                  lr: float, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
                  weight_decay: float = 0.0, step: int | None = None, grad_scale: float | torch.Tensor = 1.0,
                  lowp_param: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
                  grad_sumsq: torch.Tensor | None = None, max_norm: float | None = None) -> torch.Tensor:
    """Pure-torch :func:`sgd_`."""
    return _run("fzero_kernels.sgd_reference", True, param, grad, momentum_buffer, lr, momentum, dampening,
                nesterov, weight_decay, step, grad_scale, lowp_param, found_inf, grad_sumsq, max_norm)
