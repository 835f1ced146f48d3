"""``split_batch``: a local batch cut into micro-batches on its leading dim, as ``accumulate``
and ``pipeline`` both cut it."""

from __future__ import annotations

from typing import Any

import torch

from fzero import tree

__all__ = ["split_batch"]


def split_batch(batch: Any, k: int, *, where: str) -> list[Any]:
    """Split every tensor leaf of ``batch`` on its leading dim into ``k`` equal parts.

    Raises:
        ValueError: a leaf's leading size does not divide by ``k`` (names the leaf's key
            path and both numbers), or the leaves disagree on the leading size.
    """
    paths, leaves, spec = tree.flatten_with_path(batch)
    sizes = {}
    for p, x in zip(paths, leaves):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            sizes[tree.keystr(p) or "<batch>"] = x.shape[0]
    if not sizes:
        raise ValueError(f"{where}: the batch has no tensor with a leading dim to split into {k} micro-batches")
    if len(set(sizes.values())) > 1:
        raise ValueError(f"{where}: batch leaves disagree on the leading size: "
                         + ", ".join(f"{n}: {s}" for n, s in sizes.items()))
    name, n = next(iter(sizes.items()))
    if n % k:
        raise ValueError(f"{where}: the batch's leading size {n} (at {name}) does not divide into "
                         f"{k} micro-batches")
    parts = [[] for _ in range(k)]
    for x in leaves:
        chunks = x.chunk(k) if isinstance(x, torch.Tensor) and x.dim() > 0 else [x] * k
        for i in range(k):
            parts[i].append(chunks[i])
    return [tree.unflatten(spec, p) for p in parts]
