"""The check that every ``tp`` peer was handed the same batch.

Tensor parallelism splits the model, not the batch: the ranks of a ``tp`` group compute one
forward together, so they must be handed the same batch. Handed different ones, the
all-reduces sum activations of different samples -- silently wrong when the shapes agree
(the replicated weights drift apart), and a gloo abort or a hang when they do not (the
peers hand all-reduces of different sizes to one collective). So every step, before the
first tp collective, the peers compare their batches:

1. one all-gather over ``tp`` of four int64 numbers per rank -- the number of leaves, a CRC
   of their key paths, shapes and dtypes, the length of that description, and a
   fingerprint of the values -- a fixed-size message, so it cannot itself mismatch;
2. only when the rows differ, the descriptions themselves (each leaf's key path, shape,
   dtype and fingerprint), padded to the longest, so every rank raises the same
   :class:`BatchMismatchError` naming each differing leaf, both ranks and both shapes.

The fingerprint is the sum of the values' bit patterns (as integers, so it is exact and
independent of summation order), weighted by position in up to 4,096 blocks: peers whose
batches differ anywhere get different numbers, unless the difference is two elements
swapped inside one block, or a sum that wraps around to the same 64-bit value.
"""

from __future__ import annotations

import json
import math
import zlib
from typing import Any

import torch
import torch.distributed as dist

from fzero import tree
from fzero.distributed import comm

__all__ = ["BatchMismatchError", "check_same_batch"]

WHERE = "fzero.tensor_parallel"

_BLOCKS = 4096
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class BatchMismatchError(ValueError):
    """The ``tp`` peers of one ``dp`` coordinate were handed different batches; the message
    names each differing leaf by key path, with both ranks and what each holds."""


def _fingerprint(x: torch.Tensor) -> torch.Tensor:
    """An int64 0-dim tensor on ``x``'s device: its bit patterns summed, block-weighted."""
    flat = x.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    bits = flat.view(_INTS[flat.element_size()])
    n = bits.numel()
    k = max(1, math.ceil(n / _BLOCKS))
    whole = n - n % k
    rows = bits[:whole].view(-1, k).sum(dim=1, dtype=torch.int64)
    weights = torch.arange(1, rows.numel() + 1, dtype=torch.int64, device=rows.device)
    return (rows * weights).sum() + bits[whole:].sum(dtype=torch.int64) * (rows.numel() + 1)


def _leaf(x: Any) -> tuple[list[int] | None, str]:
    if isinstance(x, torch.Tensor):
        return list(x.shape), str(x.dtype).replace("torch.", "")
    return None, f"{type(x).__name__} {x!r}"[:80]


def check_same_batch(batch: Any, group, *, device: torch.device | str, timeout_s: float) -> None:
    """Raise :class:`BatchMismatchError` on every ``tp`` rank unless all were handed the same
    ``batch`` (a collective over ``group``: every ``tp`` rank calls it once per step).

    Raises:
        BatchMismatchError: leaves, shapes, dtypes or values differ between peers (each
            differing leaf named with both ranks and what each holds).
    """
    paths, leaves, _ = tree.flatten_with_path(batch)
    described = [["batch" + tree.keystr(p), *_leaf(x)] for p, x in zip(paths, leaves)]
    text = json.dumps(described)
    fps = [_fingerprint(x).to(device) if isinstance(x, torch.Tensor)
           else torch.tensor(zlib.crc32(repr(x).encode()), dtype=torch.int64, device=device) for x in leaves]
    fp = torch.stack(fps).sum() if fps else torch.zeros((), dtype=torch.int64, device=device)
    head = torch.tensor([len(leaves), zlib.crc32(text.encode()), len(text.encode())], dtype=torch.int64,
                        device=device)
    mine = torch.cat([head, fp.reshape(1)])
    world = dist.get_world_size(group)
    every = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    comm.run("all_gather(tp: batch fingerprints)",
             lambda: comm.all_gather_flat(every, mine, group=group, async_op=True, what="metadata"),
             timeout_s=timeout_s, where=WHERE)
    rows = every.view(world, -1).cpu()
    if bool((rows == rows[0]).all()):
        return
    # Different somewhere: every rank saw the same rows, so every rank is here. Now the
    # descriptions, padded to the longest (whose length every rank knows from the rows).
    for d, v in zip(described, fps):
        d.append(int(v))
    detail = list(json.dumps(described).encode())
    width = int(rows[:, 2].max()) + 32 * (max(int(rows[:, 0].max()), 1)) + 64
    table = comm.all_gather_ints("all_gather(tp: batch descriptions)", detail + [-1] * (width - len(detail)),
                                 group, timeout_s=timeout_s, where=WHERE, device=device)
    ranks = [dist.get_global_rank(group, i) for i in range(world)]
    told = [json.loads(bytes(b for b in row.tolist() if b >= 0).decode()) for row in table]
    raise BatchMismatchError(_message(ranks, told))


def _message(ranks: list[int], told: list[list]) -> str:
    """What differs between the first ``tp`` rank's batch and each other's, every leaf named."""
    def shown(leaf):
        shape, kind = leaf[1], leaf[2]
        return f"{tuple(shape)} {kind}" if shape is not None else kind

    first = {leaf[0]: leaf for leaf in told[0]}
    lines = []
    for r, leaves in zip(ranks[1:], told[1:]):
        theirs = {leaf[0]: leaf for leaf in leaves}
        for key in sorted(first.keys() - theirs.keys()):
            lines.append(f"{key} is {shown(first[key])} on rank {ranks[0]} and absent on rank {r}")
        for key in sorted(theirs.keys() - first.keys()):
            lines.append(f"{key} is absent on rank {ranks[0]} and {shown(theirs[key])} on rank {r}")
        for key in [k for k in first if k in theirs]:
            a, b = first[key], theirs[key]
            if a[1:3] != b[1:3]:
                lines.append(f"{key} is {shown(a)} on rank {ranks[0]} and {shown(b)} on rank {r}")
            elif a[3] != b[3]:
                lines.append(f"{key} is {shown(a)} on both, with different values on rank {ranks[0]} and rank {r}")
    return (f"{WHERE}: the ranks of a tp group must be handed the same batch (tensor parallelism splits the "
            "model, not the batch: give every tp rank of a dp coordinate the same rows, as "
            "fzero.data.DataLoader does); they differ:\n  " + "\n  ".join(lines or ["(in a way not shown)"]))
