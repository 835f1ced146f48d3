"""FLOPs per step, tokens per step and the device's peak: what tokens/s and MFU are made of.

The FLOPs are counted, not estimated: ``torch.utils.flop_counter.FlopCounterMode`` around a
real step counts every matmul, convolution and attention the step dispatches -- forward,
backward (autograd's ops dispatch under the mode too) and a ``remat``'s recomputed forward,
which is counted because it runs: with ``remat`` the utilization reported is what PaLM
(Chowdhery et al. 2022, appendix B) calls hardware FLOPs utilization, without it the model
FLOPs utilization. Elementwise ops (the optimizer, norms, activations) count 0, as in every
MFU convention. A step's FLOPs depend only on the shapes it sees, so a step is counted once
per distinct batch shape and the count reused (:class:`FlopCounter`).

``scaled_dot_product_attention`` on the CPU dispatches to
``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward), which torch's
counter has no formula for: it counted 0 there (checked on torch 2.13), so MFU on a CPU left
attention out. :data:`CPU_ATTENTION` counts them as the counter counts its CUDA flash
kernels (``sdpa_flop_count``: the two matmuls; the backward's five, the recomputed scores
included); with a mask or dropout torch takes the math path, whose matmuls count already.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from fzero import tree

__all__ = ["CPU_ATTENTION", "PEAK_FLOPS", "FlopCounter", "batch_tokens", "peak_flops"]


def _cpu_attention(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_flop_count

    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_attention_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                            **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count

    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# FlopCounterMode(custom_mapping=...): formulas for the CPU's fused attention, by op.
CPU_ATTENTION = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_attention_backward,
}

# Dense (not 2:4 sparse) peak FLOP/s per GPU from NVIDIA's datasheets, by the precision the
# step computes in: "16" is the BF16/FP16 tensor-core peak with FP32 accumulation (what
# torch's matmuls use), "tf32" the TF32 tensor-core peak (fp32 matmuls with
# torch.backends.cuda.matmul.allow_tf32), "fp32" plain FP32. Datasheets print sparse figures
# with an asterisk: the dense ones are half of those.
#   H100 SXM5 / PCIe / NVL and H200 SXM / NVL: "NVIDIA H100 Tensor Core GPU" and "NVIDIA H200
#     Tensor Core GPU" datasheets (BF16 1,979 / 1,513 / 1,671 TFLOPS sparse).
#   A100 (SXM4 and PCIe alike): "NVIDIA A100 Tensor Core GPU" datasheet (BF16 312, TF32 156,
#     FP32 19.5).
#   L4, L40S, A10: their datasheets (L4: BF16 242 sparse; L40S: 733 sparse; A10: 250 sparse).
#   V100 SXM2 / PCIe: "NVIDIA V100 Tensor Core GPU" datasheet (tensor 125 / 112, FP32
#     15.7 / 14; no BF16 nor TF32: their 16-bit figure is FP16's).
#   RTX 4090, RTX 3090: the Ada and Ampere GA102 whitepapers (FP16 tensor with FP32
#     accumulate 165.2 / 71; TF32 82.6 / 35.6).
# NVIDIA publishes no datasheet for the A10G (an AWS-only part): pass peak_flops= for it.
_T = 1e12
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100 SXM": {"16": 989.4 * _T, "tf32": 494.7 * _T, "fp32": 66.9 * _T},
    "H100 PCIe": {"16": 756.5 * _T, "tf32": 378.0 * _T, "fp32": 51.2 * _T},
    "H100 NVL": {"16": 835.5 * _T, "tf32": 417.5 * _T, "fp32": 60.0 * _T},
    "H200 SXM": {"16": 989.4 * _T, "tf32": 494.7 * _T, "fp32": 67.0 * _T},
    "H200 NVL": {"16": 835.5 * _T, "tf32": 417.5 * _T, "fp32": 60.0 * _T},
    "A100": {"16": 312.0 * _T, "tf32": 156.0 * _T, "fp32": 19.5 * _T},
    "L40S": {"16": 366.5 * _T, "tf32": 183.0 * _T, "fp32": 91.6 * _T},
    "L4": {"16": 121.0 * _T, "tf32": 60.0 * _T, "fp32": 30.3 * _T},
    "A10": {"16": 125.0 * _T, "tf32": 62.5 * _T, "fp32": 31.2 * _T},
    "V100 SXM2": {"16": 125.0 * _T, "tf32": 15.7 * _T, "fp32": 15.7 * _T},
    "V100 PCIe": {"16": 112.0 * _T, "tf32": 14.0 * _T, "fp32": 14.0 * _T},
    "RTX 4090": {"16": 165.2 * _T, "tf32": 82.6 * _T, "fp32": 82.6 * _T},
    "RTX 3090": {"16": 71.0 * _T, "tf32": 35.6 * _T, "fp32": 35.6 * _T},
}


def _model(name: str) -> str | None:
    """The :data:`PEAK_FLOPS` entry of a ``torch.cuda.get_device_name`` (``"NVIDIA H100 80GB
    HBM3"`` is the SXM part; the PCIe and NVL parts say so in their names)."""
    n = name.upper()
    for gpu in ("H100", "H200"):
        if gpu in n:
            return f"{gpu} NVL" if "NVL" in n else f"{gpu} PCIe" if "PCIE" in n else f"{gpu} SXM"
    if "V100" in n:
        return "V100 PCIe" if "PCIE" in n else "V100 SXM2"
    # Longest first: "A100" before "A10", "L40S" before "L4"; "A10G" is not an A10.
    for key in sorted(("A100", "L40S", "L4", "RTX 4090", "RTX 3090"), key=len, reverse=True):
        if key in n:
            return key
    if "A10" in n and "A10G" not in n:
        return "A10"
    return None


def peak_flops(device: torch.device | str, dtype: str = "fp32") -> float | None:
    """The device's dense peak FLOP/s for matmuls in ``dtype``, or ``None`` when unknown.

    Args:
        device: a CUDA device (looked up by ``torch.cuda.get_device_name`` in
            :data:`PEAK_FLOPS`); a CPU has no entry.
        dtype: the step's compute precision, ``"fp32"``, ``"bf16"`` or ``"fp16"``. fp32
            matmuls count at the TF32 peak when torch lets them use TF32
            (``torch.backends.cuda.matmul.allow_tf32``).

    Returns:
        FLOP/s, or ``None`` for a CPU or a GPU not in the table (pass
        ``fzero.compile(peak_flops=...)`` then).

    Example:
        >>> peak_flops("cpu") is None
        True
        >>> _model("NVIDIA H100 80GB HBM3"), _model("NVIDIA A100-SXM4-40GB"), _model("NVIDIA A10G")
        ('H100 SXM', 'A100', None)
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    model = _model(torch.cuda.get_device_name(device))
    if model is None:
        return None
    if dtype in ("bf16", "fp16"):
        kind = "16"
    else:
        kind = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    return PEAK_FLOPS[model][kind]


def batch_tokens(batch: Any) -> int | None:
    """Tokens in a batch, as fzero infers them: the element count of the first integer
    tensor of two or more dimensions (batch × sequence: ``input_ids``) in the batch's pytree
    order (a dict's keys sorted), or ``None`` when there is none.

    Example:
        >>> batch_tokens({"x": torch.zeros(4, 16, dtype=torch.long), "y": torch.zeros(4, 16, dtype=torch.long)})
        64
        >>> batch_tokens((torch.randn(8, 3), torch.zeros(8, dtype=torch.long))) is None
        True
    """
    for leaf in tree.leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2 and not leaf.is_floating_point() \
                and not leaf.is_complex() and leaf.dtype != torch.bool:
            return leaf.numel()
    return None


def _shape_key(batch: Any) -> tuple:
    leaves, spec = tree.flatten(batch)
    return (str(spec),) + tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else repr(x)
                                for x in leaves)


class FlopCounter:
    """The FLOPs of a step, counted on its first call with each distinct batch shape.

    Example:
        >>> counter = FlopCounter()
        >>> w = torch.randn(3, 5)
        >>> x = torch.randn(4, 3)
        >>> with counter.counting(x):
        ...     _ = x @ w
        >>> counter.flops(x)        # 2 * 4 * 3 * 5
        120
    """

    def __init__(self) -> None:
        self._counts: dict[tuple, int] = {}

    @contextlib.contextmanager
    def counting(self, batch: Any) -> Iterator[None]:
        """Run the block (one step on ``batch``) under a FLOP counter if this shape of batch
        has not been counted yet; otherwise run it as it is."""
        key = _shape_key(batch)
        if key in self._counts:
            yield
            return
        from torch.utils.flop_counter import FlopCounterMode

        mode = FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION)
        with mode:
            yield
        self._counts[key] = int(mode.get_total_flops())

    def flops(self, batch: Any) -> int | None:
        """The counted FLOPs of a step on a batch of this shape, or ``None`` before one ran."""
        return self._counts.get(_shape_key(batch))
