"""The tolerances fzero's tests compare with, in one table, keyed by what is compared.

A row is ``(rtol, atol, why)``: ``actual`` passes where ``|actual - expected| <= atol +
rtol * |expected|`` elementwise (as ``torch.testing.assert_close``). A test names the row
it compares by, so a tolerance is loosened in one place, with its reason beside it:

    >>> import torch
    >>> import fzero.testing as ft
    >>> ft.TOLERANCES["fp32"].rtol
    1e-05
    >>> torch.testing.assert_close(torch.tensor(1.0), torch.tensor(1.0 + 1e-7), **ft.tolerance("fp32"))
    >>> ft.assert_trees_close(torch.tensor(1.0), torch.tensor(1.001), tol="fp16")

``assert_trees_close`` with no ``tol=`` uses the row of the leaves' dtype (``"fp64"``,
``"fp32"``, ``"bf16"``, ``"fp16"``; the looser of the two sides), and ``"exact"`` for other
dtypes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["TOLERANCES", "Tolerance", "tolerance"]


class Tolerance(NamedTuple):
    """One row of :data:`TOLERANCES`."""

    rtol: float
    atol: float
    why: str


TOLERANCES: dict[str, Tolerance] = {
    # ---- a transformed step against the plain one, values in one dtype (assert_trees_close's
    # default by the leaves' dtype)
    "exact": Tolerance(0.0, 0.0, "the same operations in the same order: bit for bit"),
    "fp64": Tolerance(1e-10, 1e-12, "fp64 reduction-order error over a few steps"),
    "fp32": Tolerance(1e-5, 1e-6, "fp32 reduction-order error over a few steps of training (SPEC: relative 1e-5)"),
    "fp32 small values": Tolerance(
        1e-5, 1e-7, "fp32 reduction order, with an atol that does not hide an error in values near zero: "
                    "input gradients of a mean loss, losses after resuming on another world size"),
    "bf16": Tolerance(2e-2, 1e-2, "a few units in the last place of bf16's 8-bit mantissa"),
    "fp16": Tolerance(2e-3, 1e-3, "a few units in the last place of fp16's 11-bit mantissa"),
    "recorded losses": Tolerance(
        1e-5, 0.0, "the example's losses against the recorded curve: the same kernels in the same order "
                   "are bit-identical; the slack is for a CPU with another vector width"),
    # ---- low precision against the fp32 trajectory
    "bf16 vs fp32": Tolerance(
        5e-2, 2e-2, "a bf16 mixed-precision trajectory (fp32 masters and losses) against the plain fp32 "
                    "one, 4 steps, in any composition with shard_state and accumulate"),
    "bf16 params vs fp32": Tolerance(
        5e-2, 5e-2, "bf16 parameters (rounded to 8 bits each step) against the fp32 trajectory, 5 steps of SGD"),
    "fp16 vs fp32": Tolerance(
        1e-2, 2e-3, "an fp16 mixed-precision trajectory (fixed loss scale, fp32 masters) against the plain "
                    "fp32 one, 4 steps"),
    "bf16 reduction vs fp32": Tolerance(
        2e-2, 2e-3, "gradients summed across ranks in bf16 (8 bits of mantissa) against the fp32 trajectory"),
    # ---- optimizers
    "optimizer fp64 vs torch.optim": Tolerance(
        1e-12, 1e-12, "adam / adamw / sgd against torch.optim, 50 updates: same math, fp64 rounding order"),
    "optimizer fp32 vs torch.optim": Tolerance(
        1e-6, 1e-6, "adam / adamw / sgd against torch.optim, 50 updates, plus a slack of twice torch's own "
                    "fp32 rounding (its fp32 - fp64 difference): AdamW's fl32(1 - lr*wd) factor alone "
                    "drifts 1.5e-6"),
    "fp64 vs numpy reference": Tolerance(
        1e-10, 1e-12, "lamb / lion run in fp64 against a numpy fp64 reference written from optax"),
    "lamb fp64 vs kernel formula": Tolerance(
        1e-12, 1e-14, "DeepSpeed's Lamb (config) against a reference written from its CUDA kernel, fp64, "
                      "4 updates: same formula, another operation order"),
    "norm": Tolerance(
        1e-6, 1e-7, "one fp32 reduction summed in another order: clip_by_global_norm against torch's "
                    "clip_grad_norm_, norms and trust ratios on two shards (psum) against unsharded"),
    # ---- fzero_kernels against their torch references (fp32 shards)
    "kernel state": Tolerance(
        1e-6, 1e-7, "fp32 state after one update: torch's CPU lerp / addcmul fuse a multiply-add where the "
                    "kernel rounds twice (measured <= 2.4e-7 absolute on values of order 1)"),
    "kernel lamb": Tolerance(
        1e-5, 1e-6, "lamb's update scales by a ratio of per-tensor norms, each summed in another order "
                    "than the by-hand reference's"),
    "kernel sumsq": Tolerance(
        1e-5, 0.0, "sums of squares: the kernel adds fp32 partial sums of BLOCK * REDUCTION_BLOCKS "
                   "elements, the reference adds in fp64 (measured ~1e-7)"),
    "kernel norm": Tolerance(1e-5, 0.0, "the square root of a kernel sum of squares"),
}

_BY_DTYPE = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def tolerance(what: str) -> dict[str, float]:
    """The row ``what`` of :data:`TOLERANCES` as keywords for ``torch.testing.assert_close``.

    Raises:
        KeyError: ``what`` is not a row; the message lists the rows.
    """
    row = _row(what)
    return {"rtol": row.rtol, "atol": row.atol}


def _row(what: str) -> Tolerance:
    try:
        return TOLERANCES[what]
    except KeyError:
        raise KeyError(f"fzero.testing.tolerance: no row {what!r}; the rows: {', '.join(map(repr, TOLERANCES))}") \
            from None


def _for_dtypes(*dts: torch.dtype) -> tuple[float, float]:
    """The looser of the rows of these dtypes (``"exact"`` for a dtype without one)."""
    rows = [TOLERANCES[_BY_DTYPE.get(d, "exact")] for d in dts]
    return max(r.rtol for r in rows), max(r.atol for r in rows)
