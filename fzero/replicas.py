"""Silent divergence: compare a fingerprint of what should be identical across the ranks.

Leaves that every holder must keep bit for bit -- the parameters on each ``dp`` replica
(stages 0-2; stage 3 partitions them), the replicated optimizer state and masters (stage
0), the counts, the step, the loss scaler, synced buffers, the weights ``tp`` peers all hold
whole, a tied weight's copies on two pipeline stages -- can drift apart through a bad host,
a non-deterministic kernel or per-rank user code, and nothing else notices. Every ``N``
updates (``fzero.compile(check_replicas=N)``), each rank fingerprints each such tensor of
its state and one all-gather brings every rank the others'; a leaf whose holders disagree is
a :class:`ReplicaDivergenceError` on every rank, naming the leaf, the ranks and the step.

The fingerprint of a tensor is the int64 sum of its elements' bit patterns (the float32
bits as int32, bf16/fp16 as int16, ...): exact and independent of the order of summation,
so equal tensors give equal fingerprints on any kernel, and a change of one bit changes it.
The float64 sum of the values travels with it, for the message.

Which ranks must agree on a leaf: the ranks holding its key path (so a pipeline stage's own
layers are compared within the stage, a tied weight across the stages that hold it), and,
for a leaf split over ``tp``, holding the same slice. Not compared: ``Shard`` pieces (each
rank holds its own part), ``state.extra`` (the user's, which may differ per rank by
design) and, with ``buffer_sync="local"``, the buffers.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import torch
import torch.distributed as dist

from fzero.checkpoint import _leaves
from fzero.distributed import comm
from fzero.transforms.shard_state import Shard

__all__ = ["ReplicaDivergenceError", "fingerprints", "check"]

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicaDivergenceError(RuntimeError):
    """Ranks that should hold the same values do not. ``step`` is the update at which it was
    seen; ``leaves`` maps each differing key path to ``{rank: float64 sum of its values}``."""

    def __init__(self, message: str, step: int, leaves: dict[str, dict[int, float]]):
        super().__init__(message)
        self.step, self.leaves = step, leaves


def _bits_sum(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point() or t.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        t = t.contiguous().view(_BITS[t.element_size()])
    return t.sum(dtype=torch.int64)


def _key_id(key: str) -> int:
    return struct.unpack("<q", hashlib.blake2b(key.encode(), digest_size=8).digest())[0]


def fingerprints(state: Any, *, buffers: bool = True) -> tuple[list[str], torch.Tensor]:
    """This rank's compared leaves (their group keys: the key path, ``@tp=r`` for a tp
    slice) and their fingerprints, a ``(n, 2)`` int64 host tensor: the bit-pattern sum
    and the float64 sum's bits."""
    paths, leaves, _ = _leaves.flatten(state)
    layout = _leaves.layout_of(state, "fzero.compile(check_replicas=)")
    slices = _leaves.tp_slices(paths, leaves, layout)
    keys, sums, values = [], [], []
    for path, x, sl in zip(paths, leaves, slices):
        if not isinstance(x, torch.Tensor) or isinstance(x, Shard) or x.is_meta:
            continue
        key = _leaves.keystr(path)
        if key.startswith(".extra") or (not buffers and key.startswith(".buffers")):
            continue
        keys.append(key if sl is None else f"{key}@tp={sl.rank}")
        sums.append(_bits_sum(x))
        v = x.detach()
        v = torch.view_as_real(v) if v.is_complex() else v.view(torch.uint8) if v.dtype == torch.bool else v
        values.append(v.sum(dtype=torch.float64))
    if not keys:
        return keys, torch.zeros(0, 2, dtype=torch.int64)
    out = torch.stack([torch.stack(sums), torch.stack(values).view(torch.int64)], 1)
    return keys, out.cpu()


def check(state: Any, step: int, *, device: Any = None, timeout_s: float, buffers: bool = True,
          where: str = "fzero.compile(check_replicas=)", _counts: dict | None = None) -> None:
    """Compare ``state``'s replicated leaves across every rank of the default group; raise
    :class:`ReplicaDivergenceError` on every rank if any differ.

    Collective: every rank calls it at the same update. One all-gather of 3 int64 per leaf
    (a first call also gathers the leaf counts, kept in ``_counts`` for the next).
    """
    if not dist.is_initialized() or dist.get_world_size() < 2:
        return
    keys, fp = fingerprints(state, buffers=buffers)
    world = dist.get_world_size()
    counts = None if _counts is None else _counts.get("counts")
    if counts is None or counts[dist.get_rank()] != len(keys):
        counts = comm.all_gather_ints("replica fingerprint counts", [len(keys)], timeout_s=timeout_s, where=where,
                                      device=device)[:, 0].tolist()
        if _counts is not None:
            _counts["counts"] = counts
    width = max(counts)
    rows = [[_key_id(k), int(a), int(b)] for k, (a, b) in zip(keys, fp.tolist())]
    rows += [[0, 0, 0]] * (width - len(rows))
    flat = [v for row in rows for v in row] or [0]
    got = comm.all_gather_ints("replica fingerprints", flat if width else [0], timeout_s=timeout_s, where=where,
                               device=device)
    by_key: dict[int, dict[int, tuple[int, int]]] = {}
    for r in range(world):
        row = got[r].tolist()
        for i in range(counts[r]):
            kid, bits, value = row[3 * i: 3 * i + 3]
            by_key.setdefault(kid, {})[r] = (bits, value)
    bad = {kid: held for kid, held in by_key.items() if len({b for b, _ in held.values()}) > 1}
    if not bad:
        return
    # Rare: name the differing leaves. Every rank sends the names it holds of them.
    mine = {_key_id(k): k for k in keys}
    names: list[Any] = [None] * world
    dist.all_gather_object(names, {kid: mine[kid] for kid in bad if kid in mine})
    named = {kid: n for part in names for kid, n in part.items()}
    lines, leaves = [], {}
    for kid in sorted(bad, key=lambda k: named.get(k, "")):
        held = bad[kid]
        groups: dict[int, list[int]] = {}
        for r, (b, _) in sorted(held.items()):
            groups.setdefault(b, []).append(r)
        ordered = sorted(groups.values(), key=lambda rs: (-len(rs), rs[0]))
        value = {r: struct.unpack("<d", struct.pack("<q", v))[0] for r, (_, v) in held.items()}
        key = named.get(kid, f"<leaf {kid:#x}>")
        leaves[key] = value
        sides = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: sum {value[rs[0]]!r}"
                          for rs in ordered)
        if len(ordered[0]) > len(ordered[1]):
            odd = [r for rs in ordered[1:] for r in rs]
            lines.append(f"  {key} differs on rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} "
                         f"from the others ({sides})")
        else:
            lines.append(f"  {key} differs between its holders ({sides})")
    raise ReplicaDivergenceError(
        f"{where}: replicas diverged at step {step}: {len(bad)} lea{'f' if len(bad) == 1 else 'ves'} that "
        f"should be identical on the ranks holding {'it differs' if len(bad) == 1 else 'them differ'}:\n"
        + "\n".join(lines),
        step, leaves)
