"""``gather``: full, unsharded tensors of a (possibly sharded) pytree."""

from __future__ import annotations

from typing import Any

import torch

from fzero import tree

__all__ = ["gather"]


def _is_sharded(x: Any) -> bool:
    return hasattr(x, "__fzero_gather__")


def gather(state: Any) -> Any:
    """Full tensors of every leaf of ``state``, on every rank (for logging, export, tests).

    Sharded leaves (those made by ``shard_state``) are all-gathered over their mesh axis and
    reshaped to their global shape; replicated tensors are returned detached. The result
    holds no reference into the training buffers: changing it changes nothing.

    Example:
        >>> import torch, fzero
        >>> fzero.gather({"w": torch.ones(2)})["w"].tolist()
        [1.0, 1.0]
    """
    def full(x):
        if _is_sharded(x):
            return x.__fzero_gather__()
        if isinstance(x, torch.Tensor):
            return x.detach().clone()
        return x

    return tree.map(full, state, is_leaf=_is_sharded)
