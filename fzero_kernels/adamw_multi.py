"""Multi-tensor AdamW / Adam: one launch updates many separate tensors (each its own storage),
with :func:`fzero_kernels.adamw_`'s math bit for bit.

Where the tensors are not one flat shard (a model's own parameters, without ZeRO's flat
groups) a per-tensor ``adamw_`` pays a launch, its argument checks and a new flag tensor per
tensor: on a GPU that host time, not the update, bounds a training step (docs/performance.md,
"GPU"). Here a program table (:func:`fzero_kernels._common.tensor_table`: each program's
tensor addresses and ``[start, end)`` range of at most ``MULTI_CHUNK`` elements, as torch's
``multi_tensor_apply``) lets one launch cover them all, with one flag for the call.

If the compiled multi-tensor kernel fails to build (a Triton that refuses the int-to-pointer
cast it relies on), the call warns once (``RuntimeWarning``, with the error), remembers it, and this
call and every later one launch :mod:`fzero_kernels.adamw`'s kernel once per tensor instead.
"""
from __future__ import annotations

import warnings
from typing import Any, Sequence

import torch

from fzero_kernels import _common, adamw
from fzero_kernels.adamw import _launch, _reference, scalars

tl: Any = None  # bound to triton.language by _common.ensure_triton()

__all__ = ["adamw_multi_", "adamw_multi_reference", "adam_multi_", "adam_multi_reference"]

#: Why the multi-tensor kernel could not be built ([] while it can): set at its first failure.
BROKEN: list[str] = []


@_common.jit
def _adam_multi_kernel(
    table_ptr, flag_ptr, scale_ptr, grad_scale, sumsq_ptr, max_norm, found_inf_ptr,
    decay, weight_decay, lerp_weight, beta2, one_minus_beta2, neg_step_size, bias_correction2_sqrt, eps,
    DECOUPLED: tl.constexpr, LERP_LOW: tl.constexpr, SCALE_FROM_PTR: tl.constexpr, CLIP: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr, GRAD: tl.constexpr, LOWP: tl.constexpr, ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Row: param, grad, exp_avg, exp_avg_sq, lowp (0: none) addresses, then start, end.
    row = table_ptr + 7 * tl.program_id(0).to(tl.int64)
    param_ptr = _common.table_pointer(row, 0, tl.float32, ALIGNED)
    if GRAD == 1:
        grad_ptr = _common.table_pointer(row, 1, tl.bfloat16, ALIGNED)
    elif GRAD == 2:
        grad_ptr = _common.table_pointer(row, 1, tl.float16, ALIGNED)
    else:
        grad_ptr = _common.table_pointer(row, 1, tl.float32, ALIGNED)
    exp_avg_ptr = _common.table_pointer(row, 2, tl.float32, ALIGNED)
    exp_avg_sq_ptr = _common.table_pointer(row, 3, tl.float32, ALIGNED)
    if LOWP == 1:  # bf16, stored as its int16 bits (_common.store_lowp)
        lowp_ptr = _common.table_pointer(row, 4, tl.int16, ALIGNED)
    elif LOWP == 2:
        lowp_ptr = _common.table_pointer(row, 4, tl.float16, ALIGNED)
    else:
        lowp_ptr = param_ptr  # never written
    start = tl.load(row + 5)
    end = tl.load(row + 6)
    if ALIGNED:  # starts are multiples of the chunk; every length a multiple of 16
        start = tl.multiple_of(start, 16)
        end = tl.multiple_of(end, 16)
    # The opening of _common.update_block, per block of this program's range; the flag is
    # stored once, after the loop.
    coef = _common.grad_coef(flag_ptr, sumsq_ptr, max_norm, CLIP)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for block_start in range(start, end, BLOCK):
        offs = block_start + tl.arange(0, BLOCK)
        mask = offs < end
        g = _common.unscaled(grad_ptr, offs, mask, scale_ptr, grad_scale, coef, SCALE_FROM_PTR, CLIP)
        bad = tl.maximum(bad, _common.nonfinite_lanes(g))
        wmask = _common.write_mask(mask, found_inf_ptr, sumsq_ptr, HAS_FOUND_INF, CLIP)
        p = tl.load(param_ptr + offs, mask=wmask, other=0.0)
        m = tl.load(exp_avg_ptr + offs, mask=wmask, other=0.0)
        v = tl.load(exp_avg_sq_ptr + offs, mask=wmask, other=0.0)
        p, m, v = adamw.adam_math(p, g, m, v, decay, weight_decay, lerp_weight, beta2, one_minus_beta2, neg_step_size,
                                  bias_correction2_sqrt, eps, DECOUPLED, LERP_LOW)
        tl.store(param_ptr + offs, p, mask=wmask)
        tl.store(exp_avg_ptr + offs, m, mask=wmask)
        tl.store(exp_avg_sq_ptr + offs, v, mask=wmask)
        _common.store_lowp(lowp_ptr, offs, p, wmask, LOWP)
    _common.store_flag(flag_ptr, bad)


def _compiled() -> bool:
    """Whether launches build compiled kernels (the interpreter builds none, so there an
    error is the kernel's own and is raised)."""
    return not _common.triton_interpreted()


def _launch_multi(params, grads, exp_avgs, exp_avg_sqs, lowps, *, ga: _common.GradArgs, decoupled: bool,
                  **hyper) -> torch.Tensor:
    device = params[0].device
    flag = _common.new_flag(device)  # one for the call: the kernels only ever store 1.0 into it
    if not BROKEN:
        values, lerp_low = scalars(**hyper)
        lowp_code = _common.DTYPE_CODE[lowps[0].dtype] if lowps is not None else 0
        table, programs, aligned = _common.tensor_table(
            (params, grads, exp_avgs, exp_avg_sqs, lowps if lowps is not None else [None] * len(params)),
            _common.MULTI_CHUNK, device)
        block, warps = _common.elementwise_config(max(p.numel() for p in params))
        gargs, gconst = _common.grad_args(ga, params[0])
        try:
            _common.launch(_adam_multi_kernel, programs, table, flag, *gargs, *values, num_warps=warps,
                           DECOUPLED=decoupled, LERP_LOW=lerp_low, GRAD=_common.DTYPE_CODE[grads[0].dtype],
                           LOWP=lowp_code, ALIGNED=aligned, BLOCK=block, **gconst)
            return flag
        except Exception as e:  # a build failure: nothing was launched, nothing written
            if not _compiled():
                raise  # the interpreter builds nothing: an error there is the kernel's own bug
            BROKEN.append(f"{type(e).__name__}: {e}")
            warnings.warn(f"fzero_kernels: the multi-tensor AdamW kernel failed to build ({BROKEN[0]}); "
                          f"launching it once per tensor from now on", RuntimeWarning, stacklevel=4)
    for i in range(len(params)):
        _launch(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], ga=ga, decoupled=decoupled,
                lowp=lowps[i] if lowps is not None else None, flag=flag, **hyper)
    return flag


def _reference_multi(params, grads, exp_avgs, exp_avg_sqs, lowps, *, ga: _common.GradArgs, decoupled: bool,
                     **hyper) -> torch.Tensor:
    flag = _common.new_flag(params[0].device)
    for i in range(len(params)):
        f = _reference(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], ga=ga, decoupled=decoupled,
                       lowp=lowps[i] if lowps is not None else None, **hyper)
        flag = torch.maximum(flag, f)
    return flag


def _check_list(fn: str, name: str, ts: Any, k: int | None) -> list:
    if isinstance(ts, torch.Tensor) or not isinstance(ts, Sequence):
        raise TypeError(f"{fn}: {name} must be a list or tuple of tensors, got {type(ts).__name__}")
    if k is not None and len(ts) != k:
        raise ValueError(f"{fn}: {name} has {len(ts)} tensors, params has {k}")
    return list(ts)


def _check_tensors(fn: str, name: str, ts: list, params: list | None, dtypes: Sequence[torch.dtype],
                   one_dtype: bool) -> None:
    """Each of ``ts`` as :func:`_common.check_flat` wants it (and all of ``ts[0]``'s dtype when
    ``one_dtype``: a kernel's constexpr); the fast loop only finds the first bad index, whose
    message check_flat then writes."""
    first = ts[0]
    for i, t in enumerate(ts):
        like = params[i] if params is not None else first
        if not (isinstance(t, torch.Tensor) and t.dtype in dtypes and t.dim() == 1 and t.is_contiguous()
                and t.device == like.device and (params is None or t.numel() == like.numel())):
            _common.check_flat(fn, f"{name}[{i}]", t, dtypes=dtypes, like=like if params is not None else None,
                               like_name=f"params[{i}]")
            if t.device != like.device:
                raise ValueError(f"{fn}: {name}[{i}] is on {t.device}, {name}[0] is on {like.device}")
        if one_dtype and t.dtype != first.dtype:
            raise TypeError(f"{fn}: {name}[{i}] has dtype {str(t.dtype).replace('torch.', '')}, {name}[0] has "
                            f"{str(first.dtype).replace('torch.', '')}: one launch takes one {name} dtype "
                            f"(group the tensors by it)")


def _adam_multi(name: str, *, decoupled: bool, reference: bool, doc: str):
    """One of this module's four public functions, as :func:`fzero_kernels.adamw._adam`."""
    fn = f"fzero_kernels.{name}"

    def adam_multi(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                   exp_avgs: Sequence[torch.Tensor], exp_avg_sqs: Sequence[torch.Tensor], *,
                   lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                   grad_scale: float | torch.Tensor = 1.0, lowp_params: Sequence[torch.Tensor] | None = None,
                   found_inf: torch.Tensor | None = None, grad_sumsq: torch.Tensor | None = None,
                   max_norm: float | None = None) -> torch.Tensor:
        params = _check_list(fn, "params", params, None)
        if not params:
            raise ValueError(f"{fn}: params is empty (at least one tensor is needed)")
        grads = _check_list(fn, "grads", grads, len(params))
        exp_avgs = _check_list(fn, "exp_avgs", exp_avgs, len(params))
        exp_avg_sqs = _check_list(fn, "exp_avg_sqs", exp_avg_sqs, len(params))
        _check_tensors(fn, "params", params, None, (torch.float32,), False)
        _check_tensors(fn, "grads", grads, params, _common.FLOAT_GRAD_DTYPES, True)
        _check_tensors(fn, "exp_avgs", exp_avgs, params, (torch.float32,), False)
        _check_tensors(fn, "exp_avg_sqs", exp_avg_sqs, params, (torch.float32,), False)
        if lowp_params is not None:
            lowp_params = _check_list(fn, "lowp_params", lowp_params, len(params))
            _check_tensors(fn, "lowp_params", lowp_params, params, _common.LOWP_DTYPES, True)
        _common.check_hyper(fn, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
        kw = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                  step=_common.check_step(fn, step),
                  ga=_common.check_grad_args(fn, params[0].device, grad_scale, grad_sumsq, max_norm, found_inf),
                  decoupled=decoupled)
        run = _reference_multi if _common.runs_reference(fn, reference, params[0].device) else _launch_multi
        return run(params, grads, exp_avgs, exp_avg_sqs, lowp_params, **kw)

    adam_multi.__name__ = adam_multi.__qualname__ = name
    adam_multi.__doc__ = doc
    return adam_multi


adamw_multi_ = _adam_multi("adamw_multi_", decoupled=True, reference=False, doc="""
    :func:`fzero_kernels.adamw_` on many tensors in one launch: ``params[i]``, ``grads[i]``,
    ``exp_avgs[i]``, ``exp_avg_sqs[i]`` (and ``lowp_params[i]``) are updated as
    ``adamw_`` would update them, bit for bit.

    Args:
        params, exp_avgs, exp_avg_sqs: equal-length lists of 1-D contiguous fp32 tensors on
            one device; the i-th of each have one length. Updated in place.
        grads: the gradients, read only; one dtype for all (fp32, bf16 or fp16: the kernel
            is specialised on it).
        lowp_params: optional list of bf16 or fp16 tensors (one dtype), each receiving
            ``params[i].to(dtype)`` of the new values in the same pass.
        lr, beta1, beta2, eps, weight_decay, step, grad_scale, found_inf, grad_sumsq,
            max_norm: as :func:`fzero_kernels.adamw_`, one value for every tensor
            (``grad_sumsq`` is the global sum of squares of all the model's gradients).

    Returns:
        One 0-dim fp32 flag on the device: 1.0 if any gradient of any tensor (unscaled,
        clipped), or ``grad_sumsq``, was inf or nan; no host sync.

    Raises:
        TypeError, ValueError: as ``adamw_``'s, naming the index of the bad tensor
        (``grads[3]``), or lists of different lengths, or mixed grad dtypes; the message
        starts with ``fzero_kernels.adamw_multi_``.

    Runs one Triton launch for CUDA tensors and for CPU tensors under ``TRITON_INTERPRET=1``
    (one per tensor if the multi-tensor kernel failed to build, see the module), otherwise
    :func:`adamw_multi_reference`.

    >>> import torch, fzero_kernels
    >>> ps = [torch.ones(3), torch.ones(2)]
    >>> flag = fzero_kernels.adamw_multi_(ps, [torch.full((3,), 0.5), torch.full((2,), -0.5)],
    ...                                   [torch.zeros(3), torch.zeros(2)], [torch.zeros(3), torch.zeros(2)],
    ...                                   lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    >>> ps, bool(flag)
    ([tensor([0.9000, 0.9000, 0.9000]), tensor([1.1000, 1.1000])], False)
    """)

adamw_multi_reference = _adam_multi(
    "adamw_multi_reference", decoupled=True, reference=True,
    doc="Pure-torch :func:`adamw_multi_`: :func:`fzero_kernels.adamw_reference` on each tensor, flags or'ed.")

adam_multi_ = _adam_multi("adam_multi_", decoupled=False, reference=False,
                          doc=":func:`fzero_kernels.adam_` on many tensors in one launch, as :func:`adamw_multi_`.")

adam_multi_reference = _adam_multi("adam_multi_reference", decoupled=False, reference=True,
                                   doc="Pure-torch :func:`adam_multi_`.")
