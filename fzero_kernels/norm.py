"""Norms and checks of gradients: the global L2 norm for clipping (over one flat buffer or
many tensors), per-tensor sums of squares over a segment table, and a fused in-place
unscale + non-finite check.

Sums of squares are float64 tensors so that ZeRO ranks can all-reduce partial sums before
the square root without losing precision; each program sums its chunk in fp32 and adds it
to a float64 accumulator (an atomic per chunk of ``BLOCK * REDUCTION_BLOCKS`` elements).
The order of those float64 additions varies run to run; at float64 precision that never
shows in the fp32 norm a caller uses, in practice.

A norm is inf or nan exactly when some gradient is (or when squares overflow fp32), so
``found_inf = ~torch.isfinite(l2_norm(grads))`` comes with the clipping pass for free.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from fzero_kernels import _common

tl: Any = None  # bound to triton.language by _common.ensure_triton()

__all__ = [
    "sum_of_squares", "sum_of_squares_reference", "l2_norm", "l2_norm_reference",
    "segment_sum_of_squares", "segment_sum_of_squares_reference",
    "unscale_and_check_", "unscale_and_check_reference", "nonfinite_check", "nonfinite_check_reference",
]

@_common.jit
def _sumsq_kernel(x_ptr, table_ptr, out_ptr, scale_ptr, grad_scale,
                  SCALE_FROM_PTR: tl.constexpr, ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
    slot, start, end = _common.program_row(table_ptr, ALIGNED)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for base in range(start, end, BLOCK):
        offs = base + tl.arange(0, BLOCK)
        x = _common.unscaled(x_ptr, offs, offs < end, scale_ptr, grad_scale, 1.0, SCALE_FROM_PTR, False)
        acc += x * x
    tl.atomic_add(out_ptr + slot, tl.sum(acc, axis=0).to(tl.float64))


@_common.jit
def _unscale_kernel(x_ptr, out_ptr, flag_ptr, scale_ptr, n, grad_scale,
                    XDTYPE: tl.constexpr, WRITE: tl.constexpr, SCALE_FROM_PTR: tl.constexpr,
                    BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = _common.unscaled(x_ptr, offs, mask, scale_ptr, grad_scale, 1.0, SCALE_FROM_PTR, False)
    if WRITE:
        # Check the value as stored: dividing by a scale < 1 can overflow bf16/fp16.
        if XDTYPE == 1:
            bits = _common.bf16_bits(g)
            tl.store(out_ptr + offs, bits, mask=mask)
            g = (bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        elif XDTYPE == 2:
            h = g.to(tl.float16)
            tl.store(out_ptr + offs, h, mask=mask)
            g = h.to(tl.float32)
        else:
            tl.store(out_ptr + offs, g, mask=mask)
    _common.store_flag(flag_ptr, _common.nonfinite_lanes(g))


# --------------------------------------------------------------------------- helpers
def _as_list(fn: str, tensors: Any) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        items = [tensors]
    else:
        try:
            items = list(tensors)
        except TypeError:
            raise TypeError(f"{fn}: expected a tensor or a sequence of tensors, got "
                            f"{type(tensors).__name__}") from None
    if not items:
        raise ValueError(f"{fn}: got an empty sequence of tensors")
    flat = [_common.check_contiguous(fn, f"tensors[{i}]", t, dtypes=_common.FLOAT_GRAD_DTYPES)
            for i, t in enumerate(items)]
    dev = flat[0].device
    for i, t in enumerate(flat):
        if t.device != dev:
            raise ValueError(f"{fn}: tensors[{i}] is on {t.device}, tensors[0] is on {dev}")
    return flat


def _sumsq_launch(x: torch.Tensor, out: torch.Tensor, offsets: tuple[int, ...], ids: tuple[int, ...],
                  scale: float | torch.Tensor) -> None:
    block, warps, chunk = _common.reduction_config(x.numel())
    if x.element_size() == 2:  # 16-bit input: two 16-byte loads per thread and iteration, as fp32
        block, chunk = 2 * block, 2 * chunk
    table, programs, aligned = _common.program_table(offsets, ids, chunk, x.device)
    scale_ptr, scale_val, from_ptr = _common.scale_args(scale, out)
    _common.launch(_sumsq_kernel, programs, x, table, out, scale_ptr, scale_val,
                   num_warps=warps, SCALE_FROM_PTR=from_ptr, ALIGNED=aligned, BLOCK=block)


def _squares_torch(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """``(x / scale)**2`` in fp32, as the kernel computes each element."""
    return torch.div(x.to(torch.float32), scale).square_()


def segment_sumsq_torch(x: torch.Tensor, offsets: tuple[int, ...], ids: tuple[int, ...], slots: int,
                        scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """float64 [slots]: per segment, the float64 sum of ``(x[seg] / scale)**2`` (squares in
    fp32, as the kernel), added into the segment's slot. Pure torch."""
    out = torch.zeros(slots, dtype=torch.float64, device=x.device)
    if len(offsets) < 2:
        return out
    sq = _squares_torch(x, scale)
    sums = torch.stack([sq[a:b].sum(dtype=torch.float64) for a, b in zip(offsets[:-1], offsets[1:])])
    return out.index_add_(0, torch.tensor(ids, dtype=torch.int64, device=x.device), sums)


# --------------------------------------------------------------------------- sums of squares
def _sum_of_squares(fn: str, tensors, grad_scale, reference: bool) -> torch.Tensor:
    xs = _as_list(fn, tensors)
    dev = xs[0].device
    scale = _common.check_scale(fn, grad_scale, dev)
    if _common.runs_reference(fn, reference, dev):
        return torch.stack([_squares_torch(x, scale).sum(dtype=torch.float64) for x in xs]).sum()
    out = torch.zeros(1, dtype=torch.float64, device=dev)
    for x in xs:  # one launch per tensor; a flat buffer is one launch
        _sumsq_launch(x, out, (0, x.numel()), (0,), scale)
    return out.reshape(())


def sum_of_squares(tensors: torch.Tensor | Sequence[torch.Tensor], *,
                   grad_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Sum of ``(x / grad_scale)**2`` over every element of a tensor or a list of tensors.

    Args:
        tensors: a contiguous fp32/bf16/fp16 tensor (a flat shard: one launch) or a
            sequence of them on one device (one launch each).
        grad_scale: float or 1-element device tensor the values are divided by first.

    Returns:
        A 0-dim float64 tensor on the device. All-reduce it across ranks before the sqrt.

    >>> import torch, fzero_kernels
    >>> fzero_kernels.sum_of_squares([torch.tensor([3.0]), torch.tensor([4.0])])
    tensor(25., dtype=torch.float64)
    """
    return _sum_of_squares("fzero_kernels.sum_of_squares", tensors, grad_scale, reference=False)


def sum_of_squares_reference(tensors: torch.Tensor | Sequence[torch.Tensor], *,
                             grad_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Pure-torch :func:`sum_of_squares` (fp32 squares, float64 sum)."""
    return _sum_of_squares("fzero_kernels.sum_of_squares_reference", tensors, grad_scale, reference=True)


def l2_norm(tensors: torch.Tensor | Sequence[torch.Tensor], *,
            grad_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Global L2 norm of ``x / grad_scale`` over a flat buffer or a list of tensors, as a 0-dim
    fp32 tensor on the device (no host sync): the norm ``clip_by_global_norm`` compares.

    >>> import torch, fzero_kernels
    >>> fzero_kernels.l2_norm(torch.tensor([3.0, 4.0]))
    tensor(5.)
    """
    return _sum_of_squares("fzero_kernels.l2_norm", tensors, grad_scale, reference=False).sqrt().to(torch.float32)


def l2_norm_reference(tensors: torch.Tensor | Sequence[torch.Tensor], *,
                      grad_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Pure-torch :func:`l2_norm`."""
    return _sum_of_squares("fzero_kernels.l2_norm_reference", tensors, grad_scale,
                           reference=True).sqrt().to(torch.float32)


def _segment(fn: str, flat, segments, grad_scale, tensor_ids, num_tensors, reference: bool) -> torch.Tensor:
    x = _common.check_flat(fn, "flat", flat, dtypes=_common.FLOAT_GRAD_DTYPES)
    offsets = _common.segment_offsets(fn, segments, x.numel())
    ids, slots = _common.segment_ids(fn, tensor_ids, num_tensors, len(offsets) - 1)
    scale = _common.check_scale(fn, grad_scale, x.device)
    if _common.runs_reference(fn, reference, x.device):
        return segment_sumsq_torch(x, offsets, ids, slots, scale)
    out = torch.zeros(slots, dtype=torch.float64, device=x.device)
    _sumsq_launch(x, out, offsets, ids, scale)
    return out


def segment_sum_of_squares(flat: torch.Tensor, *, segments: Sequence[int] | torch.Tensor,
                           grad_scale: float | torch.Tensor = 1.0, tensor_ids: Sequence[int] | None = None,
                           num_tensors: int | None = None) -> torch.Tensor:
    """Per-tensor sums of squares of a flat buffer holding many tensors (one launch).

    Args:
        flat: 1-D contiguous fp32/bf16/fp16 buffer.
        segments: offsets, length S+1, from 0 to ``flat.numel()``: segment i is
            ``flat[segments[i]:segments[i+1]]``. A tuple or CPU tensor avoids a device sync.
        grad_scale: values are divided by it first.
        tensor_ids, num_tensors: for a ZeRO shard holding slices of tensors, the global
            tensor index of each local segment and the number of tensors; the result then
            has one slot per tensor (zeros for tensors not on this rank), ready to all-reduce.

    Returns:
        float64 tensor of shape ``[num_tensors]`` (``[S]`` without tensor_ids).

    >>> import torch, fzero_kernels
    >>> fzero_kernels.segment_sum_of_squares(torch.tensor([1., 2., 2.]), segments=(0, 1, 3))
    tensor([1., 8.], dtype=torch.float64)
    """
    return _segment("fzero_kernels.segment_sum_of_squares", flat, segments, grad_scale, tensor_ids,
                    num_tensors, reference=False)


def segment_sum_of_squares_reference(flat: torch.Tensor, *, segments: Sequence[int] | torch.Tensor,
                                     grad_scale: float | torch.Tensor = 1.0,
                                     tensor_ids: Sequence[int] | None = None,
                                     num_tensors: int | None = None) -> torch.Tensor:
    """Pure-torch :func:`segment_sum_of_squares`."""
    return _segment("fzero_kernels.segment_sum_of_squares_reference", flat, segments, grad_scale,
                    tensor_ids, num_tensors, reference=True)


# --------------------------------------------------------------------------- unscale + check
def _unscale(fn: str, grad, grad_scale, write: bool, reference: bool) -> torch.Tensor:
    x = _common.check_contiguous(fn, "grad", grad, dtypes=_common.FLOAT_GRAD_DTYPES)
    scale = _common.check_scale(fn, grad_scale, x.device)
    if _common.runs_reference(fn, reference, x.device):
        if write:
            x.div_(scale)  # computed in fp32, rounded to nearest even into grad's dtype
            return _common.nonfinite_flag(x)
        return _common.nonfinite_flag(torch.div(x.to(torch.float32), scale))
    flag = _common.new_flag(x.device)
    n = x.numel()
    block, warps = _common.elementwise_config(n)
    if x.element_size() == 2:
        block *= 2  # two 16-byte accesses per thread, as the fp32 kernels
    code = _common.DTYPE_CODE[x.dtype]
    out = x.view(torch.int16) if code == 1 else x
    scale_ptr, scale_val, from_ptr = _common.scale_args(scale, flag)
    _common.launch(_unscale_kernel, -(-n // block), x, out, flag, scale_ptr, n, scale_val,
                   num_warps=warps, XDTYPE=code, WRITE=write, SCALE_FROM_PTR=from_ptr, BLOCK=block)
    return flag


def unscale_and_check_(grad: torch.Tensor, grad_scale: float | torch.Tensor) -> torch.Tensor:
    """``grad /= grad_scale`` in place (one pass) and report non-finite results.

    Args:
        grad: contiguous fp32/bf16/fp16 tensor; the quotient is computed in fp32 and
            rounded to nearest even into ``grad``'s dtype, as ``grad.div_(grad_scale)``.
        grad_scale: float or 1-element device tensor.

    Returns:
        0-dim fp32 tensor on the device: 1.0 if any stored value is inf or nan (including
        an overflow of bf16/fp16 caused by the division), else 0.0. No host sync.

    >>> import torch, fzero_kernels
    >>> g = torch.tensor([2.0, float("inf")])
    >>> flag = fzero_kernels.unscale_and_check_(g, 2.0)
    >>> g, bool(flag)
    (tensor([1., inf]), True)
    """
    return _unscale("fzero_kernels.unscale_and_check_", grad, grad_scale, write=True, reference=False)


def unscale_and_check_reference(grad: torch.Tensor, grad_scale: float | torch.Tensor) -> torch.Tensor:
    """Pure-torch :func:`unscale_and_check_`."""
    return _unscale("fzero_kernels.unscale_and_check_reference", grad, grad_scale, write=True, reference=True)


def nonfinite_check(grad: torch.Tensor, *, grad_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """0-dim fp32 flag: is any ``grad / grad_scale`` inf or nan. Reads ``grad`` only; pass the
    flag as ``found_inf`` to an update to skip it with the state untouched.

    >>> import torch, fzero_kernels
    >>> bool(fzero_kernels.nonfinite_check(torch.tensor([1.0, float("nan")])))
    True
    """
    return _unscale("fzero_kernels.nonfinite_check", grad, grad_scale, write=False, reference=False)


def nonfinite_check_reference(grad: torch.Tensor, *, grad_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Pure-torch :func:`nonfinite_check`."""
    return _unscale("fzero_kernels.nonfinite_check_reference", grad, grad_scale, write=False, reference=True)
