"""This rank's memory, measured (DeepSpeed's ``memory_breakdown``): what its state holds, the
process's peak resident set, and the CUDA allocator's peak."""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch

from fzero import tree

__all__ = ["memory_metrics", "peak_rss_bytes", "state_bytes"]


def state_bytes(state: Any) -> int:
    """Bytes of the tensors this rank's ``state`` holds (parameters, optimizer state, fp32
    masters, buffers): each storage counted once, so a ZeRO piece counts its flat buffer's
    bytes and tied or viewed tensors are not counted twice. Under ZeRO this is this rank's
    partition: compare it with :func:`fzero.memory.model_state_bytes` (no gradients: they live
    only during the step).

    Example:
        >>> w = torch.zeros(10)
        >>> state_bytes({"w": w, "v": w[:5], "b": torch.zeros(2, dtype=torch.float16)})
        44
    """
    seen, total = set(), 0
    for leaf in tree.leaves(state):
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
            storage = leaf.untyped_storage()
            key = (leaf.device, storage.data_ptr())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


def peak_rss_bytes() -> int:
    """The process's peak resident set size in bytes (``getrusage``: kilobytes on Linux,
    bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def memory_metrics(state: Any, device: torch.device) -> dict[str, int]:
    """``{"state_bytes", "peak_rss_bytes"}`` and, on a CUDA device, ``"cuda_peak_bytes"``
    (``torch.cuda.max_memory_allocated``: the allocator's peak since the process started or
    the caller last reset it)."""
    out = {"state_bytes": state_bytes(state), "peak_rss_bytes": peak_rss_bytes()}
    if device.type == "cuda":
        out["cuda_peak_bytes"] = int(torch.cuda.max_memory_allocated(device))
    return out
