"""LAMB over a flat fp32 buffer of many tensors, in two launches (optax's ``lamb``).

optax: ``chain(scale_by_adam(b1, b2, eps, eps_root), add_decayed_weights(wd),
scale_by_trust_ratio(), scale_by_learning_rate(lr))``, i.e. per element

    g = grad / grad_scale;  m' = (1-b1) g + b1 m;  v' = (1-b2) g^2 + b2 v
    u = (m' / (1-b1^step)) / (sqrt(v' / (1-b2^step) + eps_root) + eps) + wd * param

and per *tensor* ``ratio = ||param|| / ||u||`` (1 where either norm is 0), then
``param += -lr * ratio * u``.

Launch 1 (:func:`lamb_partial_norms`) computes the per-segment sums of squares of param
and u; it writes no state. Launch 2 (:func:`lamb_apply_`) recomputes u and writes param,
both moments and the low-precision copy. Under ZeRO each rank holds slices of tensors:
give each local segment its global ``tensor_ids`` and ``num_tensors``, all-reduce (SUM)
the two float64 vectors between the launches, and every rank applies the global ratio.
Since launch 1 is pure, its non-finite flag can be passed to launch 2 as ``found_inf``.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from fzero_kernels import _common
from fzero_kernels.norm import segment_sumsq_torch

tl: Any = None  # bound to triton.language by _common.ensure_triton()

__all__ = ["LambNorms", "lamb_", "lamb_reference", "lamb_partial_norms", "lamb_partial_norms_reference",
           "lamb_apply_", "lamb_apply_reference"]


class LambNorms(NamedTuple):
    """Result of :func:`lamb_partial_norms`: float64 ``[num_tensors]`` sums of squares of the
    param and of the update, and the 0-dim non-finite flag of the gradient."""
    param_sq: torch.Tensor
    update_sq: torch.Tensor
    found_inf: torch.Tensor


@_common.jit
def _lamb_update(param_ptr, exp_avg_ptr, exp_avg_sq_ptr, offs, mask, g, one_minus_beta1, beta1, one_minus_beta2,
                 beta2, bias_correction1, bias_correction2, eps, eps_root, weight_decay):
    """Load param and both moments under ``mask``; return param, the new moments and the
    Adam-plus-decay update ``u``."""
    p = tl.load(param_ptr + offs, mask=mask, other=0.0)
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0)
    m = one_minus_beta1 * g + beta1 * m
    v = one_minus_beta2 * (g * g) + beta2 * v
    m_hat = tl.div_rn(m, bias_correction1)
    v_hat = tl.div_rn(v, bias_correction2)
    u = tl.div_rn(m_hat, tl.sqrt_rn(v_hat + eps_root) + eps) + weight_decay * p
    return p, m, v, u


@_common.jit
def _lamb_norms_kernel(
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, table_ptr, param_sq_ptr, update_sq_ptr, flag_ptr,
    scale_ptr, grad_scale, sumsq_ptr, max_norm, found_inf_ptr,
    one_minus_beta1, beta1, one_minus_beta2, beta2, bias_correction1, bias_correction2, eps, eps_root,
    weight_decay,
    SCALE_FROM_PTR: tl.constexpr, CLIP: tl.constexpr, HAS_FOUND_INF: tl.constexpr, ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # found_inf_ptr / HAS_FOUND_INF are unused: this launch writes no state.
    slot, start, end = _common.program_row(table_ptr, ALIGNED)
    coef = _common.grad_coef(flag_ptr, sumsq_ptr, max_norm, CLIP)
    psq = tl.zeros([BLOCK], dtype=tl.float32)
    usq = tl.zeros([BLOCK], dtype=tl.float32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for base in range(start, end, BLOCK):
        offs = base + tl.arange(0, BLOCK)
        mask = offs < end
        g = _common.unscaled(grad_ptr, offs, mask, scale_ptr, grad_scale, coef, SCALE_FROM_PTR, CLIP)
        bad = bad | _common.nonfinite_lanes(g)
        p, m, v, u = _lamb_update(param_ptr, exp_avg_ptr, exp_avg_sq_ptr, offs, mask, g, one_minus_beta1, beta1,
                                  one_minus_beta2, beta2, bias_correction1, bias_correction2, eps, eps_root,
                                  weight_decay)
        u = tl.where(mask, u, 0.0)  # padding lanes: 0 / (0 + eps) is nan when eps = 0
        psq += p * p
        usq += u * u
    tl.atomic_add(param_sq_ptr + slot, tl.sum(psq, axis=0).to(tl.float64))
    tl.atomic_add(update_sq_ptr + slot, tl.sum(usq, axis=0).to(tl.float64))
    _common.store_flag(flag_ptr, bad)


@_common.jit
def _lamb_apply_kernel(
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, lowp_ptr, table_ptr, param_sq_ptr, update_sq_ptr,
    flag_ptr, scale_ptr, grad_scale, sumsq_ptr, max_norm, found_inf_ptr,
    neg_lr, one_minus_beta1, beta1, one_minus_beta2, beta2, bias_correction1, bias_correction2, eps, eps_root,
    weight_decay,
    SCALE_FROM_PTR: tl.constexpr, CLIP: tl.constexpr, HAS_FOUND_INF: tl.constexpr, LOWP: tl.constexpr,
    ALIGNED: tl.constexpr, BLOCK: tl.constexpr,
):
    slot, start, end = _common.program_row(table_ptr, ALIGNED)
    coef = _common.grad_coef(flag_ptr, sumsq_ptr, max_norm, CLIP)
    # Trust ratio in float64 from the (all-reduced) sums; optax: 1 where either norm is 0.
    param_norm = tl.sqrt(tl.load(param_sq_ptr + slot))
    update_norm = tl.sqrt(tl.load(update_sq_ptr + slot))
    ratio = tl.where((param_norm == 0.0) | (update_norm == 0.0), 1.0, param_norm / update_norm)
    ratio = ratio.to(tl.float32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for base in range(start, end, BLOCK):
        offs = base + tl.arange(0, BLOCK)
        mask = offs < end
        g = _common.unscaled(grad_ptr, offs, mask, scale_ptr, grad_scale, coef, SCALE_FROM_PTR, CLIP)
        bad = bad | _common.nonfinite_lanes(g)
        wmask = _common.write_mask(mask, found_inf_ptr, sumsq_ptr, HAS_FOUND_INF, CLIP)
        p, m, v, u = _lamb_update(param_ptr, exp_avg_ptr, exp_avg_sq_ptr, offs, wmask, g, one_minus_beta1, beta1,
                                  one_minus_beta2, beta2, bias_correction1, bias_correction2, eps, eps_root,
                                  weight_decay)
        p = p + (u * ratio) * neg_lr
        tl.store(param_ptr + offs, p, mask=wmask)
        tl.store(exp_avg_ptr + offs, m, mask=wmask)
        tl.store(exp_avg_sq_ptr + offs, v, mask=wmask)
        _common.store_lowp(lowp_ptr, offs, p, wmask, LOWP)
    _common.store_flag(flag_ptr, bad)


# --------------------------------------------------------------------------- checks / scalars
class _Checked(NamedTuple):
    step: int
    ga: _common.GradArgs
    offsets: tuple[int, ...]
    ids: tuple[int, ...]
    slots: int


def _check(fn, param, grad, exp_avg, exp_avg_sq, segments, tensor_ids, num_tensors, beta1, beta2, eps,
           eps_root, weight_decay, step, grad_scale, grad_sumsq, max_norm, found_inf=None, lr=0.0) -> _Checked:
    _common.check_update(fn, param, grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    _common.check_hyper(fn, lr=lr, beta1=beta1, beta2=beta2, eps=eps, eps_root=eps_root,
                        weight_decay=weight_decay)
    step = _common.check_step(fn, step)
    ga = _common.check_grad_args(fn, param.device, grad_scale, grad_sumsq, max_norm, found_inf)
    offsets = _common.segment_offsets(fn, segments, param.numel())
    ids, slots = _common.segment_ids(fn, tensor_ids, num_tensors, len(offsets) - 1)
    return _Checked(step, ga, offsets, ids, slots)


def _scalars(beta1, beta2, eps, eps_root, weight_decay, step):
    return (1 - beta1, beta1, 1 - beta2, beta2, 1 - beta1 ** step, 1 - beta2 ** step, eps, eps_root,
            weight_decay)


def _update_torch(param, grad, exp_avg, exp_avg_sq, ga, beta1, beta2, eps, eps_root, weight_decay, step):
    """(g, flag, found, m', v', u) in pure torch, the kernel's op order."""
    omb1, b1, omb2, b2, bc1, bc2, eps, eps_root, wd = _scalars(beta1, beta2, eps, eps_root, weight_decay, step)
    g, flag, found = _common.reference_grad(grad, ga)
    m = torch.mul(g, omb1).add_(torch.mul(exp_avg, b1))
    v = torch.mul(g * g, omb2).add_(torch.mul(exp_avg_sq, b2))
    u = torch.div(m, bc1).div_(torch.div(v, bc2).add_(eps_root).sqrt_().add_(eps)).add_(torch.mul(param, wd))
    return g, flag, found, m, v, u


# --------------------------------------------------------------------------- phase 1
def _norms(fn, reference, param, grad, exp_avg, exp_avg_sq, *, segments, beta1, beta2, eps, eps_root,
           weight_decay, step, grad_scale, grad_sumsq, max_norm, tensor_ids, num_tensors) -> LambNorms:
    c = _check(fn, param, grad, exp_avg, exp_avg_sq, segments, tensor_ids, num_tensors, beta1, beta2, eps,
               eps_root, weight_decay, step, grad_scale, grad_sumsq, max_norm)
    dev = param.device
    if _common.runs_reference(fn, reference, dev):
        _, flag, _, _, _, u = _update_torch(param, grad, exp_avg, exp_avg_sq, c.ga, beta1, beta2, eps, eps_root,
                                            weight_decay, c.step)
        return LambNorms(segment_sumsq_torch(param, c.offsets, c.ids, c.slots),
                         segment_sumsq_torch(u, c.offsets, c.ids, c.slots), flag)
    param_sq = torch.zeros(c.slots, dtype=torch.float64, device=dev)
    update_sq = torch.zeros(c.slots, dtype=torch.float64, device=dev)
    flag = _common.new_flag(dev)
    block, warps, chunk = _common.reduction_config(param.numel())
    table, programs, aligned = _common.program_table(c.offsets, c.ids, chunk, dev)
    gargs, gconst = _common.grad_args(c.ga, param)
    _common.launch(_lamb_norms_kernel, programs, param, grad, exp_avg, exp_avg_sq, table, param_sq, update_sq,
                   flag, *gargs, *_scalars(beta1, beta2, eps, eps_root, weight_decay, c.step),
                   num_warps=warps, ALIGNED=aligned, BLOCK=block, **gconst)
    return LambNorms(param_sq, update_sq, flag)


def lamb_partial_norms(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                       *, segments: Sequence[int] | torch.Tensor, beta1: float, beta2: float, eps: float,
                       weight_decay: float, step: int, eps_root: float = 0.0,
                       grad_scale: float | torch.Tensor = 1.0, grad_sumsq: torch.Tensor | None = None,
                       max_norm: float | None = None, tensor_ids: Sequence[int] | None = None,
                       num_tensors: int | None = None) -> LambNorms:
    """LAMB launch 1: per-tensor sums of squares of param and of the Adam-plus-decay update.

    Reads param, grad and both moments; writes nothing. ``segments`` (offsets, length S+1,
    0 to ``param.numel()``; a tuple or CPU tensor avoids a device sync) says where each
    tensor's elements lie; ``tensor_ids`` / ``num_tensors`` map local segments to global
    tensors on a ZeRO shard (see :func:`fzero_kernels.segment_sum_of_squares`).
    ``grad_scale``, ``grad_sumsq``, ``max_norm`` treat the gradient as in
    :func:`fzero_kernels.adamw_` (pass the same to :func:`lamb_apply_`).

    Returns:
        :class:`LambNorms` ``(param_sq, update_sq, found_inf)``: two float64 ``[num_tensors]``
        tensors to all-reduce (SUM) across ranks, and the gradient's non-finite flag.
    """
    return _norms("fzero_kernels.lamb_partial_norms", False, param, grad, exp_avg, exp_avg_sq, segments=segments,
                  beta1=beta1, beta2=beta2, eps=eps, eps_root=eps_root, weight_decay=weight_decay, step=step,
                  grad_scale=grad_scale, grad_sumsq=grad_sumsq, max_norm=max_norm, tensor_ids=tensor_ids,
                  num_tensors=num_tensors)


def lamb_partial_norms_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                                 exp_avg_sq: torch.Tensor, *, segments: Sequence[int] | torch.Tensor,
                                 beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                                 eps_root: float = 0.0, grad_scale: float | torch.Tensor = 1.0,
                                 grad_sumsq: torch.Tensor | None = None, max_norm: float | None = None,
                                 tensor_ids: Sequence[int] | None = None,
                                 num_tensors: int | None = None) -> LambNorms:
    """Pure-torch :func:`lamb_partial_norms`."""
    return _norms("fzero_kernels.lamb_partial_norms_reference", True, param, grad, exp_avg, exp_avg_sq,
                  segments=segments, beta1=beta1, beta2=beta2, eps=eps, eps_root=eps_root, weight_decay=weight_decay,
                  step=step, grad_scale=grad_scale, grad_sumsq=grad_sumsq, max_norm=max_norm, tensor_ids=tensor_ids,
                  num_tensors=num_tensors)


# --------------------------------------------------------------------------- phase 2
def _apply(fn, reference, param, grad, exp_avg, exp_avg_sq, *, segments, param_sq, update_sq, lr, beta1, beta2,
           eps, eps_root, weight_decay, step, grad_scale, lowp_param, found_inf, grad_sumsq, max_norm, tensor_ids,
           num_tensors):
    if num_tensors is None and tensor_ids is not None and isinstance(param_sq, torch.Tensor):
        num_tensors = param_sq.numel()
    c = _check(fn, param, grad, exp_avg, exp_avg_sq, segments, tensor_ids, num_tensors, beta1, beta2, eps,
               eps_root, weight_decay, step, grad_scale, grad_sumsq, max_norm, found_inf, lr=lr)
    dev = param.device
    sums = []
    for name, t in (("param_sq", param_sq), ("update_sq", update_sq)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != c.slots or not t.is_floating_point():
            got = f"shape {tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{fn}: {name} must be a 1-D float tensor of {c.slots} sums (one per tensor), got {got}")
        if t.device != dev:
            raise ValueError(f"{fn}: {name} is on {t.device}, param is on {dev}")
        sums.append(t.to(torch.float64).contiguous())
    lowp = _common.check_lowp(fn, lowp_param, param)
    if _common.runs_reference(fn, reference, dev):
        g, flag, found, m, v, u = _update_torch(param, grad, exp_avg, exp_avg_sq, c.ga, beta1, beta2, eps,
                                                eps_root, weight_decay, c.step)
        mode = _common.skip_mode(found)
        if mode == "skip":
            return flag
        pn, un = sums[0].sqrt(), sums[1].sqrt()
        ratio = torch.where((pn == 0) | (un == 0), 1.0, pn / un).to(torch.float32)
        lengths = torch.tensor([b - a for a, b in zip(c.offsets[:-1], c.offsets[1:])], dtype=torch.int64,
                               device=dev)
        per_elem = torch.repeat_interleave(ratio[torch.tensor(c.ids, dtype=torch.int64, device=dev)], lengths,
                                           output_size=param.numel())
        p = param.clone() if mode == "blend" else param
        p.add_(u.mul_(per_elem).mul_(-lr))
        if mode == "blend":
            _common.finish_reference(mode, found, (param, exp_avg, exp_avg_sq), (p, m, v), lowp)
        else:
            exp_avg.copy_(m)
            exp_avg_sq.copy_(v)
            _common.finish_reference(mode, found, (param,), (p,), lowp)
        return flag
    flag = _common.new_flag(dev)
    block, warps, chunk = _common.reduction_config(param.numel())
    table, programs, aligned = _common.program_table(c.offsets, c.ids, chunk, dev)
    lowp_ptr, lowp_code = _common.lowp_arg(lowp, param)
    gargs, gconst = _common.grad_args(c.ga, param)
    _common.launch(_lamb_apply_kernel, programs, param, grad, exp_avg, exp_avg_sq, lowp_ptr, table, sums[0],
                   sums[1], flag, *gargs, -lr, *_scalars(beta1, beta2, eps, eps_root, weight_decay, c.step),
                   num_warps=warps, LOWP=lowp_code, ALIGNED=aligned, BLOCK=block, **gconst)
    return flag


def lamb_apply_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                segments: Sequence[int] | torch.Tensor, param_sq: torch.Tensor, update_sq: torch.Tensor,
                lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                eps_root: float = 0.0, grad_scale: float | torch.Tensor = 1.0,
                lowp_param: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
                grad_sumsq: torch.Tensor | None = None, max_norm: float | None = None,
                tensor_ids: Sequence[int] | None = None, num_tensors: int | None = None) -> torch.Tensor:
    """LAMB launch 2: the update, in place, with the trust ratio of each tensor taken from
    the (all-reduced) ``param_sq`` / ``update_sq`` of :func:`lamb_partial_norms`.

    Pass the same segments, ids, hyperparameters and gradient treatment as to launch 1.
    ``lowp_param``, ``found_inf``, ``grad_sumsq`` and ``max_norm`` behave as in
    :func:`fzero_kernels.adamw_`. Returns the non-finite flag.
    """
    return _apply("fzero_kernels.lamb_apply_", False, param, grad, exp_avg, exp_avg_sq, segments=segments,
                  param_sq=param_sq, update_sq=update_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                  eps_root=eps_root, weight_decay=weight_decay, step=step, grad_scale=grad_scale,
                  lowp_param=lowp_param, found_inf=found_inf, grad_sumsq=grad_sumsq, max_norm=max_norm,
                  tensor_ids=tensor_ids, num_tensors=num_tensors)


def lamb_apply_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                         *, segments: Sequence[int] | torch.Tensor, param_sq: torch.Tensor,
                         update_sq: torch.Tensor, lr: float, beta1: float, beta2: float, eps: float,
                         weight_decay: float, step: int, eps_root: float = 0.0,
                         grad_scale: float | torch.Tensor = 1.0, lowp_param: torch.Tensor | None = None,
                         found_inf: torch.Tensor | None = None, grad_sumsq: torch.Tensor | None = None,
                         max_norm: float | None = None, tensor_ids: Sequence[int] | None = None,
                         num_tensors: int | None = None) -> torch.Tensor:
    """Pure-torch :func:`lamb_apply_`."""
    return _apply("fzero_kernels.lamb_apply_reference", True, param, grad, exp_avg, exp_avg_sq, segments=segments,
                  param_sq=param_sq, update_sq=update_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                  eps_root=eps_root, weight_decay=weight_decay, step=step, grad_scale=grad_scale,
                  lowp_param=lowp_param, found_inf=found_inf, grad_sumsq=grad_sumsq, max_norm=max_norm,
                  tensor_ids=tensor_ids, num_tensors=num_tensors)


# --------------------------------------------------------------------------- both phases
def _lamb(norms_fn, apply_fn, param, grad, exp_avg, exp_avg_sq, segments, lr, beta1, beta2, eps, weight_decay,
          step, eps_root, grad_scale, lowp_param, found_inf, grad_sumsq, max_norm) -> torch.Tensor:
    kw = dict(segments=segments, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
              eps_root=eps_root, grad_scale=grad_scale, grad_sumsq=grad_sumsq, max_norm=max_norm)
    norms = norms_fn(param, grad, exp_avg, exp_avg_sq, **kw)
    return apply_fn(param, grad, exp_avg, exp_avg_sq, param_sq=norms.param_sq, update_sq=norms.update_sq, lr=lr,
                    lowp_param=lowp_param, found_inf=found_inf, **kw)


def lamb_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
          segments: Sequence[int] | torch.Tensor, lr: float, beta1: float, beta2: float, eps: float,
          weight_decay: float, step: int, eps_root: float = 0.0, grad_scale: float | torch.Tensor = 1.0,
          lowp_param: torch.Tensor | None = None, found_inf: torch.Tensor | None = None,
          grad_sumsq: torch.Tensor | None = None, max_norm: float | None = None) -> torch.Tensor:
    """One LAMB step of a single process over a flat buffer of tensors (both launches).

    Args:
        param, exp_avg, exp_avg_sq: equal-length 1-D contiguous fp32, updated in place.
        grad: fp32, bf16 or fp16, same length. Read only.
        segments: offsets (length S+1, 0 to ``param.numel()``) of the tensors in the buffer;
            the trust ratio is per segment.
        lr, beta1, beta2, eps, eps_root, weight_decay: optax's ``lamb`` (its defaults are
            b1=0.9, b2=0.999, eps=1e-6, eps_root=0, weight_decay=0).
        step: 1-based update count, for bias correction.
        grad_scale, lowp_param, found_inf, grad_sumsq, max_norm: as :func:`fzero_kernels.adamw_`.

    Returns:
        The 0-dim fp32 non-finite flag of ``grad / grad_scale``.

    >>> import torch, fzero_kernels
    >>> p = torch.tensor([3.0, 4.0, 1.0]); m = torch.zeros(3); v = torch.zeros(3)
    >>> _ = fzero_kernels.lamb_(p, torch.tensor([1.0, 1.0, -1.0]), m, v, segments=(0, 2, 3),
    ...                         lr=0.1, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0, step=1)
    >>> p  # ratio 5/sqrt(2) on the first tensor, 1/1 on the second
    tensor([2.6464, 3.6464, 1.1000])
    """
    return _lamb(lamb_partial_norms, lamb_apply_, param, grad, exp_avg, exp_avg_sq, segments, lr, beta1, beta2,
                 eps, weight_decay, step, eps_root, grad_scale, lowp_param, found_inf, grad_sumsq, max_norm)


def lamb_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
                   segments: Sequence[int] | torch.Tensor, lr: float, beta1: float, beta2: float, eps: float,
                   weight_decay: float, step: int, eps_root: float = 0.0,
                   grad_scale: float | torch.Tensor = 1.0, lowp_param: torch.Tensor | None = None,
                   found_inf: torch.Tensor | None = None, grad_sumsq: torch.Tensor | None = None,
                   max_norm: float | None = None) -> torch.Tensor:
    """Pure-torch :func:`lamb_`."""
    return _lamb(lamb_partial_norms_reference, lamb_apply_reference, param, grad, exp_avg, exp_avg_sq, segments,
                 lr, beta1, beta2, eps, weight_decay, step, eps_root, grad_scale, lowp_param, found_inf, grad_sumsq,
                 max_norm)
