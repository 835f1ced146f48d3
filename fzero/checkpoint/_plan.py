"""The save plan: which leaves the checkpoint holds, and which rank writes which bytes.

Ranks need not hold the same tree. Under ``fzero.pipeline`` each stage's ranks hold that
stage's parameters (and their optimizer state) and share a few leaves with the other stages
(``.step``, the optimizer's counts, the loss scaler, tied weights). The checkpoint is the
*union* of the ranks' trees, each key path once:

1. every rank describes its own leaves (key path, kind, dtype, global shape, how it is
   partitioned over ``dp`` and split over ``tp``) and hashes the description;
2. the ranks all-gather the hashes; ranks with the same hash hold the same tree and form a
   *part* (with ``fzero.pipeline``, the ranks of one stage); the first rank of each part
   broadcasts its description when there is more than one part;
3. every rank then builds the same plan from the same descriptions: a key held by several
   parts must be the same leaf in each (shape, dtype, value, split); a partitioned leaf is
   written piece by piece by the lowest rank holding each piece; a replicated leaf by the
   least loaded rank among those holding it, largest leaves first.

A leaf split over ``tp`` (``fzero.tensor_parallel``) is described by its whole shape and the
split (``dim``, ``size``); the ``tp`` ranks hold the same description, and each rank's
coordinate on ``tp`` travels with its ZeRO position. Slice ``t`` is elements
``[t*n, (t+1)*n)`` of the leaf on disk (``_leaves.TPSlice``), written as any leaf is -- by
its ZeRO pieces, or whole by one rank of those holding it -- by ranks at coordinate ``t``.

Nothing but descriptions moves between ranks (kilobytes per leaf, once per distinct tree),
and a world whose ranks hold the same tree -- any state without a pipeline -- exchanges one
hash per rank.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import torch

from fzero.checkpoint import _comm, _format, _leaves
from fzero.checkpoint._format import CheckpointError
from fzero.transforms.shard_state import Shard, ShardInfo

__all__ = ["Plan", "plan"]

WHERE = "fzero.checkpoint.save"


class Plan:
    """What a checkpoint holds and who writes it; the same on every rank but ``mine``.

    Attributes:
        records: per leaf of the union tree, its manifest record (without file offsets).
        parts: per part, ``{"ranks", "leaves", "treespec"}``.
        stages: the ZeRO stages the layout is consistent with.
        mine: ``(tensor name, tensor)`` this rank writes.
        fingerprint: a hash of ``records``, equal on every rank that planned the same.
    """

    def __init__(self, records, parts, stages, mine, treespec):
        self.records, self.parts, self.stages, self.mine, self.treespec = records, parts, stages, mine, treespec
        self.fingerprint = _hash([[r["path"], r["kind"], r.get("dtype"), r.get("shape"), r.get("sharding"),
                                   r.get("tp"), r.get("pieces"), r.get("value")] for r in records])


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:32]


# --------------------------------------------------------------------------- 1. this rank's leaves


def _describe(state: Any, world: _comm.World):
    """``(descriptions, local tensors by key, shard position, treespec, tp coordinate)`` of
    this rank's state.

    The shard position is the ``ShardInfo.rank`` of this rank's pieces (one per rank: the
    rank's place on the axis its leaves are partitioned over), ``None`` without pieces. The
    tp coordinate is the rank's place on ``tp`` (``None`` when nothing is split).
    """
    paths, leaves, spec = _leaves.flatten(state)
    layout = _leaves.layout_of(state, WHERE)
    descs, local, position = [], {}, None
    for path, x, sl in zip(paths, leaves, _leaves.tp_slices(paths, leaves, layout)):
        key = _leaves.keystr(path)
        d: dict[str, Any] = {"path": key, "entries": _leaves.json_entries(path)}
        problem = _leaves.slice_problem(key, x, sl) if sl is not None else None
        if problem is not None:
            raise CheckpointError(f"{WHERE}: on rank {world.rank}: {problem}")
        if isinstance(x, Shard):
            info = x.info
            a, b = info.piece()
            if x.local.numel() != b - a:
                raise CheckpointError(f"{WHERE}: leaf {key} on rank {world.rank}: the piece holds {x.local.numel()} "
                                      f"elements, its ShardInfo says [{a}, {b})")
            if position is None:
                position = info.rank
            elif info.rank != position:
                raise CheckpointError(f"{WHERE}: leaf {key} on rank {world.rank} is piece {info.rank} of its "
                                      f"partition, other leaves of this rank are piece {position}: a rank must hold "
                                      f"the same position in every partitioned leaf")
            d.update(kind="tensor", dtype=_format.dtype_name(x.local.dtype, WHERE, key), shape=list(info.shape),
                     sharding={"world": info.world, "offset": info.offset, "chunk": info.chunk})
            local[key] = x.local
        elif isinstance(x, torch.Tensor):
            d.update(kind="tensor", dtype=_format.dtype_name(x.dtype, WHERE, key), shape=list(x.shape), sharding=None)
            local[key] = x
        elif _leaves.is_value(x):
            if isinstance(x, float) and not math.isfinite(x):
                d.update(kind="value", type="float", value=repr(x))  # JSON has no inf or nan
            else:
                d.update(kind="value", type=type(x).__name__, value=x)
        else:
            what = repr(x)
            what = f" ({what})" if len(what) <= 100 else ""
            raise TypeError(f"{WHERE}: leaf {key} is a {type(x).__name__}{what}; a checkpoint stores tensors, "
                            f"fzero Shards and Python scalars (int, float, bool, str)")
        if sl is not None:  # the whole tensor's shape; ``sharding`` stays the slice's
            d.update(shape=list(sl.shape), tp={"dim": sl.dim, "size": sl.size,
                                               **({"fused": list(sl.fused)} if sl.fused else {})})
        descs.append(d)
    return descs, local, position, str(spec), None if layout is None else layout.rank


# --------------------------------------------------------------------------- 2. agreement


def plan(state: Any, world: _comm.World) -> Plan:
    """The plan for saving ``state`` (collective: every rank calls it with its own state).

    Raises:
        TypeError: a leaf that cannot be stored (on the rank that holds it; the others
            raise a ``CheckpointError`` naming that rank).
        CheckpointError: ranks disagree on a shared key path, or a partitioned leaf has a
            piece no rank holds (named, with the ranks).
    """
    error, mine = None, None
    try:
        mine = _describe(state, world)
    except Exception as e:  # noqa: BLE001  (every rank must reach the agreement below)
        error = e
    descs, local, position, treespec, coord = mine if mine is not None else ([], {}, None, "", None)
    digest = _hash(descs)  # not the treespec: its text holds the addresses of static fields' functions
    if world.size == 1:
        if error is not None:
            raise error
        return _build([(0, [0], descs, treespec)], [position], local, 0, [coord])
    said = world.all_gather_json("what each rank saves", {
        "hash": digest, "position": position, "tp": coord,
        "error": None if error is None else f"{type(error).__name__}: {error}"})
    failed = [r for r, s in enumerate(said) if s["error"] is not None]
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"{WHERE}: rank {failed[0]} cannot save its state: {said[failed[0]]['error']}")
    groups: dict[str, list[int]] = {}
    for r, s in enumerate(said):
        groups.setdefault(s["hash"], []).append(r)
    parts = []
    for h, ranks in groups.items():  # in order of first rank
        if len(groups) == 1:
            parts.append((0, ranks, descs, treespec))
            continue
        got = world.broadcast_json(f"the tree of ranks {_ranks(ranks)}", [descs, treespec] if h == digest else None,
                                   src=ranks[0])
        parts.append((len(parts), ranks, got[0], got[1]))
    return _build(parts, [s["position"] for s in said], local, world.rank, [s["tp"] for s in said])


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


# --------------------------------------------------------------------------- 3. the plan


_SAME = ("kind", "dtype", "shape", "tp", "type", "value")  # what ranks sharing a key path must agree on


def _build(parts: list[tuple], positions: list, local: dict[str, torch.Tensor], me: int,
           coords: list | None = None) -> Plan:
    """The plan from every part's descriptions; ``positions`` and ``coords`` are each rank's
    ZeRO position and tp coordinate (``None``: it holds no pieces, nothing split)."""
    n = len(positions)
    coords = coords if coords is not None else [None] * n
    holders: dict[str, list[tuple[int, dict]]] = {}  # key -> [(part, description)]
    for p, _ranks_p, descs, _ in parts:
        for d in descs:
            holders.setdefault(d["path"], []).append((p, d))
    load = [0] * n
    records: list[dict] = []
    # (record index, bytes, candidate writers, start, stop, tp slice or None)
    replicated: list[tuple[int, int, list[int], int, int, int | None]] = []
    mine: list[tuple[str, torch.Tensor]] = []
    for key, held in holders.items():
        p0, d0 = held[0]
        for p, d in held[1:]:
            if any(d.get(f) != d0.get(f) for f in _SAME):
                raise CheckpointError(
                    f"{WHERE}: leaf {key} is {_what(d0)} on rank(s) {_ranks(parts[p0][1])} but {_what(d)} on "
                    f"rank(s) {_ranks(parts[p][1])}: ranks holding the same key path must hold the same leaf")
        rec = {k: v for k, v in d0.items() if k != "sharding"}
        rec["parts"] = [p for p, _ in held]
        records.append(rec)
        if d0["kind"] != "tensor":
            continue
        rec["pieces"] = []
        item = _format.dtype_of(d0["dtype"], "manifest").itemsize
        sharding = d0["sharding"]
        rec["sharding"] = sharding
        tp = d0.get("tp")
        shape = _leaves.slice_shape(d0["shape"], tp["dim"], tp["size"]) if tp else tuple(d0["shape"])
        numel = math.prod(shape)
        for t in range(tp["size"] if tp else 1):  # each tp slice is a leaf of its own, at elements base + [0, numel)
            base = t * numel
            on_slice = [r for p, d in held if d["sharding"] == sharding for r in parts[p][1]
                        if tp is None or coords[r] == t]
            if tp is not None and not on_slice:
                raise CheckpointError(
                    f"{WHERE}: leaf {key} is split over tp={tp['size']}, but none of the ranks holding it "
                    f"({_ranks(sorted(r for p, _ in held for r in parts[p][1]))}) holds slice {t}: every rank of "
                    f"the tp axis must save together")
            if sharding is None:
                replicated.append((len(records) - 1, numel * item, sorted(on_slice), base, base + numel,
                                   t if tp else None))
                continue
            holding = sorted(on_slice)
            info = ShardInfo(shape, sharding["offset"], sharding["chunk"], sharding["world"], 0)
            for q in range(sharding["world"]):
                a, b = info.piece(q)
                if b <= a:
                    continue
                writer = next((r for r in holding if positions[r] == q), None)
                if writer is None:
                    raise CheckpointError(
                        f"{WHERE}: leaf {key} is partitioned over {sharding['world']} ranks, but none of the ranks "
                        f"holding it ({_ranks(holding)}) holds piece {q} (elements [{a}, {b})): every rank of the "
                        f"partition must save together")
                name = _leaves.piece_name(key, base + a, base + b)
                rec["pieces"].append({"rank": writer, "name": name, "start": base + a, "stop": base + b,
                                      **({"tp": t} if tp else {})})
                load[writer] += (b - a) * item
                if writer == me:
                    mine.append((name, local[key]))
    # Replicated leaves go to the least-loaded rank holding them, largest first (LPT), so
    # writing is spread over the ranks; ties go to the lowest rank, so every rank agrees.
    # A slice of a tp-split leaf is replicated over the ranks at its tp coordinate only.
    for i, nbytes, writers, a, b, t in sorted(replicated, key=lambda e: (-e[1], e[0], e[3])):
        owner = min(writers, key=lambda r: (load[r], r))
        load[owner] += nbytes
        key = records[i]["path"]
        name = key if t is None else _leaves.piece_name(key, a, b)
        records[i]["pieces"].append({"rank": owner, "name": name, "start": a, "stop": b,
                                     **({} if t is None else {"tp": t})})
        if owner == me:
            mine.append((name, local[key]))
    for rec in records:
        if "tp" in rec:
            rec["pieces"].sort(key=lambda p: p["start"])
    part_list = [{"ranks": ranks, "leaves": len(descs), "treespec": spec} for _, ranks, descs, spec in parts]
    return Plan(records, part_list, _leaves.stages_of(records), mine, parts[0][3])


def _what(d: dict) -> str:
    if d["kind"] == "value":
        return f"the {d['type']} {d['value']!r}"
    split = f", dim {d['tp']['dim']} split over tp={d['tp']['size']}" if d.get("tp") else ""
    return f"a tensor of {d['dtype']}, shape {tuple(d['shape'])}{split}"
