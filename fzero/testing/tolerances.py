"""The tolerances fzero's tests compare with, in one table."""

from __future__ import annotations

import torch

__all__ = ["TOLERANCES"]

# (rtol, atol) by the dtype compared.
# fp32: reduction-order error over a few steps of training (SPEC: relative 1e-5).
# bf16 / fp16: a few units in the last place of their 8 / 11-bit mantissas.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.bfloat16: (2e-2, 1e-2),
    torch.float16: (2e-3, 1e-3),
}


def _tolerance(*dts: torch.dtype) -> tuple[float, float]:
    tols = [TOLERANCES.get(d, (0.0, 0.0)) for d in dts]
    return max(t[0] for t in tols), max(t[1] for t in tols)
