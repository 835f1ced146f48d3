"""Count the bytes tensors hold: the distinct storages, views counted once (the way the ZeRO
paper's per-rank memory is checked).

Example:
    >>> import torch
    >>> from fzero.testing import storage_bytes
    >>> w = torch.zeros(10)
    >>> storage_bytes({"w": w, "view": w[2:5]}, [torch.zeros(2, dtype=torch.float16)])
    44
"""

from __future__ import annotations

from typing import Any

import torch

from fzero import tree
from fzero.transforms.shard_state import Shard

__all__ = ["storage_bytes"]


def storage_bytes(*trees: Any) -> int:
    """Bytes of the distinct storages reachable from the leaves of ``trees`` (views count once).

    A partitioned leaf counts the piece this rank holds: a :class:`~fzero.transforms.shard_state.Shard`
    (inside a train step) its ``local``, a ``DTensor`` its local tensor. Meta tensors, empty
    storages, tensors with no memory behind them (the fake tensors ``torch.compile`` traces
    with, which a census of every object may meet) and leaves that are not tensors count nothing.
    """
    seen, total = set(), 0
    for t in trees:
        for x in tree.leaves(t):
            x = _local(x)
            if not isinstance(x, torch.Tensor) or x.is_meta:
                continue
            s = x.untyped_storage()
            if not s.nbytes():
                continue
            try:
                ptr = s.data_ptr()
            except RuntimeError:  # a fake tensor: no memory
                continue
            if ptr not in seen:
                seen.add(ptr)
                total += s.nbytes()
    return total


def _local(x: Any) -> Any:
    if isinstance(x, Shard):
        return x.local
    to_local = getattr(x, "to_local", None)
    return to_local() if callable(to_local) and hasattr(x, "_local_tensor") else x
