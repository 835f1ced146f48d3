"""``Shard``: this rank's piece of a leaf ZeRO partitions, standing for the whole tensor.

A leaf of the training state that is partitioned becomes a :class:`Shard`: a pytree node
whose one child is this rank's piece of the leaf (the part of the leaf that falls in the
owned slice of its flat group, see :mod:`._layout`: possibly empty, possibly the whole leaf)
and whose static metadata (:class:`ShardInfo`) says where the piece sits. Optimizers see the
pieces as ordinary leaves; :func:`fzero.gather` and checkpoints read the metadata. Inside the
user's own step a Shard is one tensor with global semantics (see ``fzero.tree.user_view``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import optree
import torch
import torch.distributed as dist

from fzero import tree
from fzero.distributed import comm, device_check
from fzero.distributed.mesh import DEFAULT_TIMEOUT_S

__all__ = ["Shard", "ShardInfo", "is_shard"]

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
tree.register_one_child(Shard, "local", "info", Shard)  # a dict of Shards walked as a dict of tensors
