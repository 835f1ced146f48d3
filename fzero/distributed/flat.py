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
from collections.abc import Mapping, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist

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
        send = torch.zeros(width, dtype=self.local.dtype, device=_collective_device(self.local, info.group))
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

    # ------------------------------------------------------------ global semantics
    #
    # Inside the step a user wrote for one device, a Shard stands for the whole tensor (see
    # ``fzero.tree.user_view``): what the user computes with it must be what one process
    # would compute. Element-wise operations act piece by piece (the result is sharded
    # like the operand); reductions over every element (``sum``, ``norm``, ``max``,
    # ``isfinite(g).all()``, ...) reduce the piece and all-reduce over the leaf's ``dp``
    # group, so every rank gets the global value. Anything else (indexing, a reduction
    # over a dim, a matmul) is refused with the operation's name and the way out.

    @property
    def ndim(self) -> int:
        return len(self.info.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device

    def dim(self) -> int:
        return len(self.info.shape)

    def numel(self) -> int:
        return self.info.numel

    def size(self, dim: int | None = None):
        return torch.Size(self.info.shape) if dim is None else self.info.shape[dim]

    def is_floating_point(self) -> bool:
        return self.local.dtype.is_floating_point

    def element_size(self) -> int:
        return self.local.element_size()

    def _refuse(self, op: str, error: type = TypeError, why: str = "would give a rank-local result"):
        a, b = self.info.piece()
        raise error(
            f"fzero.shard_state: {op} on a partitioned tensor of global shape {tuple(self.info.shape)} "
            f"(this rank holds elements [{a}, {b})) {why}. Element-wise operations and reductions "
            "over every element (sum, mean, norm, max, min, all, any) are exact across shards; for "
            "anything else use fzero.gather(tree) for the full tensors, or do it in an optimizer "
            "transform (fzero.optim.clip_by_global_norm, masks)")

    def __getattr__(self, name: str):
        # AttributeError (with the message), so that hasattr() probes still answer False.
        if name.startswith("_") or name in ("local", "info"):
            raise AttributeError(name)
        if name in _ELEMENTWISE or name in _REDUCTIONS:
            method = getattr(torch.Tensor, name)
            return lambda *args, **kwargs: _dispatch(method, name, (self, *args), kwargs)
        self._refuse(f"'.{name}'", AttributeError)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        return _dispatch(func, name, tuple(args), dict(kwargs or {}))

    def __bool__(self):
        self._refuse("bool()")

    def __len__(self):
        self._refuse("len()")

    def __getitem__(self, index):
        self._refuse("indexing")

    def __setitem__(self, index, value):
        self._refuse("indexed assignment")

    def __matmul__(self, other):
        self._refuse("a matmul")

    __rmatmul__ = __matmul__


def _operator(dunder: str):
    method = getattr(torch.Tensor, dunder)

    def op(*args):
        return _dispatch(method, dunder, args, {})

    op.__name__ = dunder
    return op


for _dunder in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
                "__rtruediv__", "__pow__", "__rpow__", "__neg__", "__abs__", "__gt__", "__ge__", "__lt__",
                "__le__", "__and__", "__or__", "__invert__"):
    setattr(Shard, _dunder, _operator(_dunder))
del _dunder

# Operations that act element by element: the result's piece is the operation on the piece.
_ELEMENTWISE = frozenset("""
    add sub rsub mul div true_divide neg negative abs sign sgn sqrt rsqrt square pow exp log log1p
    expm1 clamp clip clamp_min clamp_max sigmoid tanh reciprocal isfinite isnan isinf nan_to_num
    float double half bfloat16 to type_as detach clone maximum minimum logical_not logical_and
    logical_or gt ge lt le add_ sub_ mul_ div_ clamp_ clip_ zero_ nan_to_num_ neg_ abs_ sqrt_ copy_
    __add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __pow__ __rpow__
    __neg__ __abs__ __gt__ __ge__ __lt__ __le__ __and__ __or__ __invert__
""".split())

# Reductions over every element, with the collective that combines the pieces' partial results.
_REDUCTIONS = frozenset("sum nansum mean norm linalg_vector_norm max min amax amin all any count_nonzero".split())


def _info_of(args, kwargs) -> tuple[Shard, ShardInfo]:
    flat = [b for a in (*args, *kwargs.values()) for b in (a if isinstance(a, (list, tuple)) else (a,))]
    shards = [a for a in flat if isinstance(a, Shard)]
    first = shards[0]
    for other in shards[1:]:
        if other.info != first.info:
            first._refuse("an operation between partitioned tensors laid out differently",
                          why=f"(the other is {other!r}) cannot be done piece by piece")
    return first, first.info


def _piece_of(x, shard: Shard, op: str):
    """``x`` as an operand of ``op`` on ``shard``'s piece: a Shard's piece, the matching piece
    of a whole tensor of the global shape, a scalar as it is."""
    if isinstance(x, Shard):
        return x.local
    if isinstance(x, torch.Tensor) and x.dim() > 0:
        if tuple(x.shape) != tuple(shard.info.shape):
            shard._refuse(f"{op} with a tensor of shape {tuple(x.shape)}",
                          why="cannot be done piece by piece (broadcasting is not supported)")
        a, b = shard.info.piece()
        return x.reshape(-1)[a:b]
    if isinstance(x, (list, tuple)) and any(isinstance(i, (Shard, torch.Tensor)) for i in x):
        shard._refuse(f"{op} with a sequence of tensors", why="cannot be done piece by piece")
    return x


def _dispatch(func, name: str, args: tuple, kwargs: dict):
    shard, info = _info_of(args, kwargs)
    if not isinstance(shard.local, torch.Tensor):  # a placeholder (accumulate's Deferred) refuses itself
        rest = [a for a in args if a is not shard]
        return getattr(shard.local, name)(*rest, **kwargs)
    if name in _ELEMENTWISE:
        mapped = [_piece_of(a, shard, name) for a in args]
        mapped_kw = {k: _piece_of(v, shard, name) for k, v in kwargs.items()}
        out = func(*mapped, **mapped_kw)
        if name.endswith("_") and not name.endswith("__"):  # in place: the piece changed
            return args[0] if isinstance(args[0], Shard) else out
        if isinstance(out, torch.Tensor) and out.shape == shard.local.shape:
            return Shard(out, info)
        shard._refuse(f"torch function {name}", why="did not keep the piece's shape")
    if name in _REDUCTIONS and args and args[0] is shard:
        return _reduce(shard, name, args[1:], kwargs)
    shard._refuse(f"torch function {name}" if not name.startswith("__") else f"operator {name}")


_NO_DIM = {"dim": None, "keepdim": False, "out": None, "axis": None}


def _reduce(shard: Shard, name: str, rest: tuple, kwargs: dict) -> torch.Tensor:
    """The reduction ``name`` over every element of the whole leaf, on every rank."""
    x = shard.local
    p = None
    if name in ("norm", "linalg_vector_norm"):
        p = rest[0] if rest else kwargs.pop("p", kwargs.pop("ord", 2))
        rest = rest[1:]
        p = 2 if p in (None, "fro") else p
        if not isinstance(p, (int, float)):
            shard._refuse(f"{name} with p={p!r}", why="is not a vector norm")
    dtype = kwargs.pop("dtype", None)
    if rest or any(kwargs.get(k, d) != d for k, d in _NO_DIM.items()) or set(kwargs) - set(_NO_DIM):
        shard._refuse(f"{name} over a dim", why="cannot be reduced piece by piece")
    SUM, MAX, MIN = dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN
    low = x.dtype in (torch.float16, torch.bfloat16)
    work = x.float() if low else x  # partial sums of a low-precision piece in fp32
    if name in ("sum", "nansum", "mean"):
        part = (torch.nansum if name == "nansum" else torch.sum)(work, dtype=dtype)
        if name == "mean" and not part.dtype.is_floating_point:
            shard._refuse("mean of an integer tensor", why="is not defined")
        out = _all_reduce(part, SUM, info=shard.info)
        out = out / shard.info.numel if name == "mean" else out
        return out.to(dtype or (x.dtype if x.dtype.is_floating_point else out.dtype))
    if name in ("norm", "linalg_vector_norm"):
        a = work.abs()
        if p == math.inf:
            out = _all_reduce(a.amax() if a.numel() else a.new_zeros(()), MAX, info=shard.info)
        elif p == -math.inf:
            out = _all_reduce(a.amin() if a.numel() else a.new_full((), math.inf), MIN, info=shard.info)
        elif p == 0:
            out = _all_reduce((a != 0).sum().to(a.dtype), SUM, info=shard.info)
        else:
            out = _all_reduce(a.pow(p).sum(), SUM, info=shard.info).pow(1.0 / p)
        return out.to(dtype or x.dtype)
    if name in ("max", "amax", "min", "amin"):
        big = name in ("max", "amax")
        if x.numel():
            part = x.amax() if big else x.amin()
        else:
            lim = -math.inf if big else math.inf
            if not x.dtype.is_floating_point:
                lim = torch.iinfo(x.dtype).min if big else torch.iinfo(x.dtype).max
            part = torch.full((), lim, dtype=x.dtype, device=x.device)
        return _all_reduce(part, MAX if big else MIN, info=shard.info)
    if name in ("all", "any"):
        part = (x.all() if name == "all" else x.any()).to(torch.int32)
        return _all_reduce(part, MIN if name == "all" else MAX, info=shard.info).to(torch.bool)
    # count_nonzero
    return _all_reduce(torch.count_nonzero(x), SUM, info=shard.info)


def _all_reduce(part: torch.Tensor, op, *, info: ShardInfo) -> torch.Tensor:
    out = part.detach().clone().reshape(())
    if info.world == 1 or not dist.is_initialized():
        return out
    out = torch.empty((), dtype=out.dtype, device=_collective_device(out, info.group)).copy_(out)
    comm.run(f"all_reduce({op}) of a reduction over a partitioned {tuple(info.shape)} leaf",
             lambda: comm.all_reduce(out, group=info.group, async_op=True, op=op, what="user"),
             timeout_s=DEFAULT_TIMEOUT_S, where="fzero.Shard")
    return out.to(part.device)


def _collective_device(t: torch.Tensor, group) -> torch.device:
    """Where a collective over ``group`` takes a value computed from ``t``: ``t``'s device,
    but a host piece (ZeRO-Offload keeps masters, optimizer state and, at stage 3, the
    parameters' pieces on the host) goes to the device an NCCL group moves (the pretended
    device in tests, :mod:`fzero.distributed.device_check`)."""
    if t.device.type != "cpu":
        return t.device
    from fzero.distributed import device_check

    if device_check.pretending():
        return device_check.PRETEND_DEVICE
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return t.device


optree.register_pytree_node(
    Shard,
    lambda s: ((s.local,), s.info, ("local",)),
    lambda info, children: Shard(children[0], info),
    path_entry_type=optree.GetAttrEntry,
    namespace=tree.NAMESPACE,
)


def is_shard(x: Any) -> bool:
    return isinstance(x, Shard)


tree._USER_LEAVES.append(Shard)  # one tensor to the user's step (see fzero.tree.user_view)


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
        infos = [self.info(i, group) for i in range(len(self.names))]
        return [Shard(local[self._in_owned(info)], info) for info in infos]

    def pack_own(self, pieces: Mapping[str, Shard]) -> torch.Tensor:
        """This rank's owned slice, packed from its pieces by name (padding zero): what the
        rank sends to an all-gather of the group. A new tensor, not a view of ``pieces``.

        Example (rank 1 of 2 owns elements 3-5 of the group ``b, a``: ``a[1:]`` and padding):
            >>> params = {"a": torch.arange(3.), "b": torch.arange(3., 5.)}
            >>> layout = build_layout(params, world=2, rank=1)
            >>> layout.groups[0].pack_own(layout.shard_params(params)).tolist()
            [1.0, 2.0, 0.0]
        """
        own = torch.zeros(self.chunk, dtype=self.dtype, device=self.device)
        for i, name in enumerate(self.names):
            own[self._in_owned(self.info(i))] = pieces[name].local.reshape(-1)
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
