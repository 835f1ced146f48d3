"""Flat groups: how ZeRO lays parameters out and cuts them between ranks.

Parameters are packed into *groups* (a transformer block, or a bucket of consecutive
parameters up to a byte budget). A group's parameters are concatenated, in order, into one
flat buffer padded to a multiple of the ``dp`` size ``N``; rank ``r`` owns the contiguous
slice ``[r*c, (r+1)*c)`` with ``c = padded / N``. This is FSDP1's layout, chosen over
per-parameter sharding because both collectives then work on the flat buffer as it is:
``all_gather_into_tensor`` writes the gathered group straight into the storage the
parameters view, and ``reduce_scatter_tensor`` reads the group's gradient straight from
the flat gradient: no copy in, no copy out.

The part of a leaf that falls in this rank's owned slice is its piece, a
:class:`~fzero.transforms.shard_state.Shard` (``_shard.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import torch

from fzero.transforms.shard_state._shard import Shard, ShardInfo

__all__ = ["Group", "Layout", "build_layout"]


@dataclasses.dataclass
class Group:
    """One flat group: parameter names, their offsets, the padded size and the owned slice."""

    index: int
    names: list[str]
    shapes: list[tuple[int, ...]]
    offsets: list[int]
    numel: int
    padded: int
    world: int
    rank: int
    dtype: torch.dtype
    device: torch.device

    @property
    def chunk(self) -> int:
        return self.padded // self.world

    @property
    def owned(self) -> tuple[int, int]:
        return self.rank * self.chunk, (self.rank + 1) * self.chunk

    def info(self, i: int, group=None) -> ShardInfo:
        return self._placed(group)[0][i]

    def _placed(self, group) -> tuple[list[ShardInfo], list[slice], list[slice]]:
        """Each parameter's :class:`ShardInfo` over ``group``, where its piece sits in the
        owned slice, and which of the flattened leaf's elements it is: worked out once per
        group, not on every step (a step cuts every gradient and parameter into pieces)."""
        cache = self.__dict__.setdefault("_placements", {})
        hit = cache.get(id(group))
        if hit is None or hit[0] is not group:
            infos = [ShardInfo(tuple(s), o, self.chunk, self.world, self.rank, group)
                     for s, o in zip(self.shapes, self.offsets)]
            hit = cache[id(group)] = (group, infos, [self._in_owned(info) for info in infos],
                                      [slice(*info.piece()) for info in infos])
        return hit[1:]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter as a view into the group's full flat buffer.

        One ``split`` rather than a slice per parameter: under autograd a slice's backward
        zero-fills a gradient the size of the whole buffer for every parameter, while
        ``split``'s backward concatenates once (measured: 72 full-unit fills per step at
        ZeRO-3 on the 10.8M GPT, gone with this).
        """
        sizes = [math.prod(s) for s in self.shapes]
        parts = flat.split(sizes + [flat.numel() - self.numel])
        return [t.view(s) for t, s in zip(parts, self.shapes)]

    def pieces(self, local: torch.Tensor, group=None) -> list[Shard]:
        """Each parameter's piece as a view into the rank's owned slice ``local``: one
        ``split`` of it (:meth:`_cuts`), where a slice per parameter costs a Python call each;
        a piece this rank owns nothing of is an empty view at its place in the order."""
        infos, where, _ = self._placed(group)
        sizes = self._cuts(group) if local.dim() == 1 and local.numel() == self.chunk else None
        if sizes is None:
            return [Shard(local[at], info) for info, at in zip(infos, where)]
        return [Shard(t, info) for t, info in zip(local.split(sizes), infos)]  # (the padding's segment left)

    def _cuts(self, group) -> list[int] | None:
        """The ``split`` sizes of the owned slice into the parameters' pieces, in order (an
        empty piece a size of 0), the padding a last segment; ``None`` where the pieces do
        not lie back to back from the slice's start (the layout packs them so). Worked out
        once per group and process group."""
        cache = self.__dict__.setdefault("_cut_plans", {})
        hit = cache.get(id(group))
        if hit is None or hit[0] is not group:
            sizes, cursor = [], 0
            for w in self._placed(group)[1]:
                n = w.stop - w.start
                if n and w.start != cursor:
                    break
                sizes.append(n)
                cursor += n
            else:
                sizes.append(self.chunk - cursor)  # the rest of the slice: padding, or nothing
            plan = sizes if len(sizes) == len(self.names) + 1 and sizes[-1] >= 0 else None
            hit = cache[id(group)] = (group, plan)
        return hit[1]

    def flat_of(self, params: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """The flat buffer this group's ``params`` view, each at its offset, as
        :meth:`views` lays them out (the buffers a gather of stages 1-2 writes into), else
        ``None``."""
        views = [params[n] for n in self.names]
        base = views[0]._base
        if base is None or base._base is not None or base.dim() != 1 or base.numel() != self.padded \
                or base.dtype != self.dtype:
            return None
        at = base.storage_offset()
        for v, o in zip(views, self.offsets):
            if v._base is not base or v.storage_offset() - at != o or not v.is_contiguous():
                return None
        return base

    def owned_buffer(self, pieces: Mapping[str, Shard]) -> torch.Tensor | None:
        """The one buffer this rank's ``pieces`` view, when they lie in it as its owned slice
        is laid out (as :meth:`Layout.shard_params` lays them out, and an update in place
        keeps them; its padding is zero there), else ``None``."""
        local = [pieces[n].local for n in self.names]
        base = local[0]._base
        if base is None or base._base is not None or base.dim() != 1 or base.numel() != self.chunk \
                or base.dtype != self.dtype:
            return None
        where = self._placed(None)[1]
        for i, t in enumerate(local):
            if t.numel() and (t._base is not base  # an empty piece (owned by another rank) lies nowhere
                              or t.storage_offset() - base.storage_offset() != where[i].start):
                return None
        return base

    def pack_own(self, pieces: Mapping[str, Shard]) -> torch.Tensor:
        """This rank's owned slice (padding zero): what the rank sends to an all-gather of the
        group. The buffer the pieces view when they are laid out so (:meth:`owned_buffer`: no
        copy), else a new tensor packed from the pieces by name.

        Example (rank 1 of 2 owns elements 3-5 of the group ``b, a``: ``a[1:]`` and padding):
            >>> params = {"a": torch.arange(3.), "b": torch.arange(3., 5.)}
            >>> layout = build_layout(params, world=2, rank=1)
            >>> layout.groups[0].pack_own(layout.shard_params(params)).tolist()
            [1.0, 2.0, 0.0]
        """
        base = self.owned_buffer(pieces)
        if base is not None and base.device == self.device:
            return base
        own = torch.zeros(self.chunk, dtype=self.dtype, device=self.device)
        for name, at in zip(self.names, self._placed(None)[1]):
            own[at] = pieces[name].local.reshape(-1)
        return own

    def _in_owned(self, info: ShardInfo) -> slice:
        """Where a parameter's piece sits in the rank's owned slice."""
        a, b = info.piece()
        lo = info.offset + a - self.rank * self.chunk
        return slice(lo, lo + (b - a))


@dataclasses.dataclass
class Layout:
    """All groups of a params dict, where each name lives, and the order the groups'
    gradients are reduced in (see :func:`build_layout`)."""

    groups: list[Group]
    where: dict[str, tuple[int, int]]  # name -> (group index, position in group)
    reduce_order: list[int]  # group indices, in the order their gradient collectives start

    def flatten_full(self, params: dict[str, torch.Tensor], g: Group) -> torch.Tensor:
        dtype = params[g.names[0]].dtype  # the group's own dtype, or its masters' (fp32)
        flat = torch.zeros(g.padded, dtype=dtype, device=g.device)
        for name, o, s in zip(g.names, g.offsets, g.shapes):
            flat[o: o + math.prod(s)] = params[name].detach().reshape(-1)
        return flat

    def regroup(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full parameters (copies) as views into one flat buffer per group, the buffers an
        all-gather of the groups writes into."""
        return {name: view for g in self.groups for name, view in zip(g.names, g.views(self.flatten_full(params, g)))}

    def shard_params(self, params: dict[str, torch.Tensor], group=None, copy=torch.clone) -> dict[str, Shard]:
        """Cut full parameters into this rank's pieces (copies: the full tensors can go);
        ``copy(owned slice)`` makes each group's (a host copy, say)."""
        out = {}
        for g in self.groups:
            lo, hi = g.owned
            local = copy(self.flatten_full(params, g)[lo:hi])
            for name, piece in zip(g.names, g.pieces(local, group)):
                out[name] = piece
        return {k: out[k] for k in params}

    def piece_views(self, params: dict[str, torch.Tensor], group=None) -> dict[str, Shard]:
        """This rank's pieces of full parameters, as views (no copy): of a group whose
        parameters view one flat buffer (:meth:`Group.flat_of`), cut from its owned slice
        in one ``split``; else a slice of each parameter."""
        out = {}
        for g in self.groups:
            flat = g.flat_of(params) if all(n in params for n in g.names) else None
            if flat is not None:
                out.update(zip(g.names, g.pieces(flat[slice(*g.owned)], group)))
        if len(out) == len(params):
            return out if list(out) == list(params) else {k: out[k] for k in params}
        for name, p in params.items():
            if name not in out:
                gi, i = self.where[name]
                infos, _, spans = self.groups[gi]._placed(group)
                out[name] = Shard(p.reshape(-1)[spans[i]], infos[i])
        return {k: out[k] for k in params}


def build_layout(
    params: dict[str, torch.Tensor],
    *,
    world: int,
    rank: int,
    units: Sequence[Sequence[str]] | None = None,
    bucket_bytes: int = 25 * 2**20,
) -> Layout:
    """Group ``params`` and lay each group out flat.

    Args:
        params: full parameters by name (their order is the registration order).
        world, rank: the ``dp`` size and this rank's index.
        units: explicit groups of names (ZeRO-3's per-block units), in order; names not in
            any unit form further groups by ``bucket_bytes``.
        bucket_bytes: the size budget of a group formed from loose parameters.

    The layout's ``reduce_order`` (the order the groups' gradients are reduced in) is
    backward's: groups by the registration position of their earliest parameter, latest
    first. Backward runs the model from its last layer to its first, so a group is complete
    about when its earliest-registered parameter's gradient arrives (a tied embedding that
    the head uses too is registered early and completes last). It follows from the
    parameters' order alone, the same on every rank, so every rank starts the collectives
    in the same order. Loose buckets, cut from the reversed registration order, keep their
    index order; units, first in the index order (forward order, which their gathers
    follow), are reduced last block first.

    Example (ZeRO-3: two blocks as units, loose parameters around them; then every
    parameter loose, as at stages 0-2):
        >>> names = ["emb", "h.0.w", "h.1.w", "head"]
        >>> layout = build_layout({n: torch.zeros(2) for n in names}, world=1, rank=0,
        ...                       units=[["h.0.w"], ["h.1.w"]], bucket_bytes=8)
        >>> [g.names for g in layout.groups], layout.reduce_order
        ([['h.0.w'], ['h.1.w'], ['head'], ['emb']], [2, 1, 0, 3])
        >>> build_layout({n: torch.zeros(2) for n in names}, world=1, rank=0, bucket_bytes=8).reduce_order
        [0, 1, 2, 3]

    Raises:
        ValueError: a unit names a parameter that does not exist, or names one twice.
    """
    names = list(params)
    groups_names: list[list[str]] = []
    seen: set[str] = set()
    for unit in units or ():
        for n in unit:
            if n not in params:
                raise ValueError(f"fzero.shard_state: unit parameter {n!r} is not in the params")
            if n in seen:
                raise ValueError(f"fzero.shard_state: parameter {n!r} is in two units")
            seen.add(n)
        if unit:
            groups_names.append(list(unit))
    # Loose parameters, grouped in *reverse* registration order, which approximates the
    # order in which backward produces their gradients (DDP buckets the same way).
    loose = [n for n in reversed(names) if n not in seen]
    cur: list[str] = []
    cur_bytes = 0
    for n in loose:
        p = params[n]
        if cur and (cur_bytes + p.numel() * p.element_size() > bucket_bytes or p.dtype != params[cur[0]].dtype):
            groups_names.append(cur)
            cur, cur_bytes = [], 0
        cur.append(n)
        cur_bytes += p.numel() * p.element_size()
    if cur:
        groups_names.append(cur)

    position = {n: i for i, n in enumerate(names)}
    earliest = [min(position[n] for n in gnames) for gnames in groups_names]
    reduce_order = sorted(range(len(groups_names)), key=lambda gi: earliest[gi], reverse=True)
    groups, where = [], {}
    for gi, gnames in enumerate(groups_names):
        dtypes = {params[n].dtype for n in gnames}
        if len(dtypes) > 1:
            raise ValueError(f"fzero.shard_state: unit {gnames} mixes dtypes {sorted(map(str, dtypes))}")
        offsets, off = [], 0
        for n in gnames:
            offsets.append(off)
            off += params[n].numel()
        padded = max(world, -(-off // world) * world)
        first = params[gnames[0]]
        groups.append(Group(gi, gnames, [tuple(params[n].shape) for n in gnames], offsets, off, padded,
                            world, rank, first.dtype, first.device))
        for i, n in enumerate(gnames):
            where[n] = (gi, i)
    return Layout(groups, where, reduce_order)
