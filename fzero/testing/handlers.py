"""Handlers that stand in for a two-shard all-reduce in one process: a transform's
``psum`` is recorded on one shard and added on the other, so a sharded result can be
checked against the unsharded one without ranks.

Example:
    >>> import torch
    >>> from fzero import optim
    >>> from fzero.transforms import installed
    >>> import fzero.testing as ft
    >>> g = {"w": torch.tensor([3.0, 4.0, 0.0, 12.0])}
    >>> tx = optim.clip_by_global_norm(1.0)
    >>> a, b = ft.halves(g)
    >>> rec = ft.RecordPsum()
    >>> with installed(rec):
    ...     _ = tx.update(b, ())
    >>> with installed(ft.AddOtherShard(rec.calls)):
    ...     out_a, _ = tx.update(a, ())
    >>> out_a["w"]  # the first half of g / |g|, |g| = 13
    tensor([0.2308, 0.3077])
"""

from __future__ import annotations

from typing import Any

from fzero import tree
from fzero.transforms import Handler

__all__ = ["AddOtherShard", "RecordPsum", "halves"]


class RecordPsum(Handler):
    """Records every value a transform ``psum``-s (a clone), and passes it on."""

    def __init__(self):
        self.calls = []

    def psum(self, value, *, next):
        self.calls.append(value.clone())
        return next(value)


class AddOtherShard(Handler):
    """``psum`` as an all-reduce over two shards: adds the other shard's recorded partial sums,
    in the order they were recorded (from a :class:`RecordPsum` run on the other shard)."""

    def __init__(self, other):
        self.other = list(other)

    def psum(self, value, *, next):
        return next(value + self.other.pop(0))


def halves(t: Any) -> tuple[Any, Any]:
    """Split every leaf's flattened values into two shards (as ZeRO partitions flat buffers):
    the first ``numel // 2`` values, and the rest."""
    first = tree.map(lambda x: x.flatten()[: x.numel() // 2], t)
    second = tree.map(lambda x: x.flatten()[x.numel() // 2 :], t)
    return first, second
