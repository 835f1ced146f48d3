"""``split_batch``: a local batch cut into micro-batches on its leading dim, as ``accumulate``
and ``pipeline`` both cut it; ``split_sequence``: this rank's slice of its sequence dim, as
Ulysses sequence parallelism cuts it."""

from __future__ import annotations

from typing import Any

import torch

from fzero import tree

__all__ = ["split_batch", "split_sequence"]


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


def split_sequence(batch: Any, parts: int, index: int, *, where: str) -> tuple[Any, int]:
    """Slice ``index`` of ``parts`` equal slices of the sequence dim (dim 1) of every tensor
    leaf of ``batch`` with two dims or more, and the whole sequence length; 0-dim and 1-dim
    leaves (a per-row weight, a count) are passed whole.

    Raises:
        ValueError: no leaf has a sequence dim; the leaves disagree on its size (each named
            with its key path); or it does not divide into ``parts`` (names the leaf, the
            length and ``parts``).

    Example:
        >>> import torch
        >>> part, n = split_sequence({"x": torch.arange(8).view(2, 4), "w": torch.ones(2)}, 2, 1, where="f")
        >>> part["x"].tolist(), part["w"].tolist(), n
        ([[2, 3], [6, 7]], [1.0, 1.0], 4)
    """
    paths, leaves, spec = tree.flatten_with_path(batch)
    sizes = {tree.keystr(p) or "<batch>": x.shape[1] for p, x in zip(paths, leaves)
             if isinstance(x, torch.Tensor) and x.dim() >= 2}
    if not sizes:
        raise ValueError(f"{where}: the batch has no tensor with a sequence dim (dim 1) to split over "
                         f"sp={parts}; its tensors must be shaped (batch, sequence, ...)")
    if len(set(sizes.values())) > 1:
        raise ValueError(f"{where}: batch leaves disagree on the sequence length (dim 1): "
                         + ", ".join(f"{n}: {s}" for n, s in sizes.items()))
    name, n = next(iter(sizes.items()))
    if n % parts:
        raise ValueError(f"{where}: the batch's sequence length {n} (dim 1 of {name}) does not divide into "
                         f"sp={parts} slices; pad or cut sequences to a multiple of {parts}")
    per = n // parts
    # Contiguous, as a batch the loader made would be (a model may .view() it).
    out = [x.narrow(1, index * per, per).contiguous() if isinstance(x, torch.Tensor) and x.dim() >= 2 else x
           for x in leaves]
    return tree.unflatten(spec, out), n
