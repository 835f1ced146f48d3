"""Flat groups: how ZeRO lays parameters out and cuts them between ranks.

Parameters are packed into *groups* (a transformer block, or a bucket of consecutive
parameters up to a byte budget). A group's parameters are concatenated, in order, into one
flat buffer padded to a multiple of the ``dp`` size ``N``; rank ``r`` owns the contiguous
slice ``[r*c, (r+1)*c)`` with ``c = padded / N``. This is FSDP1's layout, chosen over
per-parameter sharding because both collectives then work on the flat buffer as it is:
``all_gather_into_tensor`` writes the gathered group straight into the storage the
parameters view, and ``reduce_scatter_tensor`` reads the group's gradient straight from
the flat gradient: no copy in, no copy out.

A leaf of the training state that is partitioned becomes a :class:`Shard`: a pytree node
whose one child is this rank's piece of the leaf (the part of the leaf that falls in the
owned slice: possibly empty, possibly the whole leaf) and whose static metadata says where
the piece sits. Optimizers see the pieces as ordinary leaves; :func:`fzero.gather` and
checkpoints read the metadata.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import optree
import torch

from fzero import tree
from fzero.distributed import comm
from fzero.distributed.mesh import DEFAULT_TIMEOUT_S

__all__ = ["Group", "Layout", "Shard", "ShardInfo", "build_layout"]


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """Where a rank's piece of one leaf sits.

    Attributes:
        shape: the leaf's global shape.
        offset: the leaf's first element in its group's flat buffer.
        chunk: elements per rank in the group (``c``).
        world: the number of ranks sharing the group (``N``).
        rank: this rank's index on the ``dp`` axis.
        group: the process group of the ``dp`` axis (not compared).
    """

    shape: tuple[int, ...]
    offset: int
    chunk: int
    world: int
    rank: int
    group: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def piece(self, rank: int | None = None) -> tuple[int, int]:
        """``(start, stop)`` of ``rank``'s piece, in elements of the flattened leaf."""
        r = self.rank if rank is None else rank
        lo = max(self.offset, r * self.chunk)
        hi = min(self.offset + self.numel, (r + 1) * self.chunk)
        if hi <= lo:
            return 0, 0
        return lo - self.offset, hi - self.offset


class Shard:
    """This rank's piece of a partitioned leaf; a pytree node with one child, ``local``."""

    __slots__ = ("local", "info")

    def __init__(self, local: torch.Tensor, info: ShardInfo):
        self.local = local
        self.info = info

    @property
    def shape(self):
        return self.info.shape

    def __fzero_meta__(self) -> torch.Tensor:
        """The whole leaf's metadata as a meta tensor (global shape, this piece's dtype, no
        storage): what a function of the parameters' structure, such as an optimizer mask,
        needs to see instead of this rank's 1-D piece."""
        return torch.empty(self.info.shape, dtype=self.local.dtype, device="meta")

    def __fzero_gather__(self) -> torch.Tensor:
        info = self.info
        if info.world == 1:
            return self.local.detach().clone().reshape(info.shape)
        pieces = [info.piece(r) for r in range(info.world)]
        width = max(b - a for a, b in pieces)
        send = torch.zeros(width, dtype=self.local.dtype, device=self.local.device)
        send[: self.local.numel()] = self.local.detach().reshape(-1)
        recv = torch.empty(width * info.world, dtype=send.dtype, device=send.device)
        comm.run(f"all_gather(gather of a {tuple(info.shape)} leaf)",
                 lambda: comm.all_gather_flat(recv, send, group=info.group, async_op=True,
                                              what="gather"),
                 timeout_s=DEFAULT_TIMEOUT_S, where="fzero.gather")
        parts = [recv[r * width: r * width + (b - a)] for r, (a, b) in enumerate(pieces)]
        return torch.cat(parts).reshape(info.shape)

    def __repr__(self) -> str:
        a, b = self.info.piece()
        return f"Shard({tuple(self.info.shape)}, elements [{a}, {b}) on rank {self.info.rank}/{self.info.world})"

    # Used as a tensor inside a train step (``g.norm()``, ``torch.sum(g)``, ``g * 2``), a
    # piece would give a rank-local answer: refuse, naming the operation and the way out.
    def _refuse(self, op: str, error: type = TypeError):
        a, b = self.info.piece()
        raise error(
            f"fzero.shard_state: {op} on a partitioned tensor of global shape {tuple(self.info.shape)} "
            f"(this rank holds elements [{a}, {b})) would give a rank-local result. Use "
            "fzero.gather(tree) for the full tensors, or do it in an optimizer transform "
            "(fzero.optim.clip_by_global_norm, masks), which are exact across shards")

    def __getattr__(self, name: str):
        # AttributeError (with the message), so that hasattr() probes still answer False.
        if name.startswith("_") or name in ("local", "info"):
            raise AttributeError(name)
        self._refuse(f"'.{name}'", AttributeError)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        shard = next(a for a in list(args) + list((kwargs or {}).values()) if isinstance(a, Shard))
        shard._refuse(f"torch function {getattr(func, '__name__', func)!s}")

    def _binary(self, *_):
        self._refuse("arithmetic")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = _binary
    __pow__ = __neg__ = __abs__ = __matmul__ = __rmatmul__ = _binary


optree.register_pytree_node(
    Shard,
    lambda s: ((s.local,), s.info, ("local",)),
    lambda info, children: Shard(children[0], info),
    path_entry_type=optree.GetAttrEntry,
    namespace=tree.NAMESPACE,
)


def is_shard(x: Any) -> bool:
    return isinstance(x, Shard)


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
        return ShardInfo(tuple(self.shapes[i]), self.offsets[i], self.chunk, self.world, self.rank, group)

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
        """Each parameter's piece as a view into the rank's owned slice ``local``."""
        base = self.rank * self.chunk
        out = []
        for i in range(len(self.names)):
            info = self.info(i, group)
            a, b = info.piece()
            lo = self.offsets[i] + a - base
            out.append(Shard(local[lo: lo + (b - a)], info))
        return out


@dataclasses.dataclass
class Layout:
    """All groups of a params dict, and where each name lives."""

    groups: list[Group]
    where: dict[str, tuple[int, int]]  # name -> (group index, position in group)

    def flatten_full(self, params: dict[str, torch.Tensor], g: Group) -> torch.Tensor:
        dtype = params[g.names[0]].dtype  # the group's own dtype, or its masters' (fp32)
        flat = torch.zeros(g.padded, dtype=dtype, device=g.device)
        for name, o, s in zip(g.names, g.offsets, g.shapes):
            flat[o: o + math.prod(s)] = params[name].detach().reshape(-1)
        return flat

    def shard_params(self, params: dict[str, torch.Tensor], group=None) -> dict[str, Shard]:
        """Cut full parameters into this rank's pieces (copies: the full tensors can go)."""
        out = {}
        for g in self.groups:
            lo, hi = g.owned
            local = self.flatten_full(params, g)[lo:hi].clone()
            for name, piece in zip(g.names, g.pieces(local, group)):
                out[name] = piece
        return {k: out[k] for k in params}

    def piece_views(self, params: dict[str, torch.Tensor], group=None) -> dict[str, Shard]:
        """This rank's pieces of full parameters, as views (no copy)."""
        out = {}
        for name, p in params.items():
            gi, i = self.where[name]
            info = self.groups[gi].info(i, group)
            a, b = info.piece()
            out[name] = Shard(p.reshape(-1)[a:b], info)
        return out


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
    return Layout(groups, where)
