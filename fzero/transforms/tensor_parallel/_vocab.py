"""Vocab-parallel logits and their cross-entropy (Megatron-LM's ``vocab_parallel_cross_entropy``).

A language-model head split over ``tp`` by vocabulary (``ColwiseParallel(output="vocab")``)
gives each rank the logits of its slice of the vocabulary. Gathering them would put a
``tokens x vocab`` tensor on every rank -- the largest activation of a small model, and the
all-gather the split was meant to avoid. :class:`VocabShardedLogits` stands for the whole
logits in the user's loss code instead: it reshapes and slices over the token dims, and
``F.cross_entropy`` on it is computed from three all-reduces of ``tokens`` elements each
(the max over the vocabulary, then the sum of exponentials and the target's logit in one),
as Megatron does (Shoeybi et al. 2019, §3). Anything that would need the whole vocabulary
on one rank (an argmax, a softmax, a matmul, the values) is refused by name, as
:class:`fzero.transforms.shard_state.Shard` refuses what would be rank-local -- never a silent
wrong value.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fzero.distributed import comm

__all__ = ["VocabShardedLogits"]

WHERE = "fzero.tensor_parallel"


def _all_reduce(x: torch.Tensor, group, timeout_s: float, name: str, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is None:  # tp=1: the whole vocabulary is here
        return x
    comm.run(f"{name}, {x.numel()} elements",
             lambda: comm.all_reduce(x, group=group, async_op=True, what="tp", op=op),
             timeout_s=timeout_s, where=WHERE)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-row cross-entropy of logits split over ``tp`` by vocabulary (ignored rows: 0).

    Forward: the row max over every rank's slice (all-reduce MAX), then the sum of
    exponentials and the target's shifted logit -- which only the rank holding the target
    has; the others add 0 -- in one all-reduce SUM. Backward needs no communication:
    the gradient of a row's loss is ``softmax - one_hot(target)``, and each rank holds its
    slice of both.
    """

    @staticmethod
    def forward(ctx, local, target, lo, ignore_index, group, timeout_s):
        x = local.detach().float()  # fp32 exponentials, as Megatron computes them
        m = _all_reduce(x.max(dim=-1).values, group, timeout_s, "all_reduce(tp: max of the logits)",
                        op=dist.ReduceOp.MAX)
        x = x - m.unsqueeze(-1)
        valid = target != ignore_index
        here = valid & (target >= lo) & (target < lo + x.shape[-1])
        t = torch.where(here, target - lo, torch.zeros_like(target))
        exp = x.exp()
        sums = torch.stack([exp.sum(dim=-1), x.gather(-1, t.unsqueeze(-1)).squeeze(-1) * here])
        sums = _all_reduce(sums, group, timeout_s, "all_reduce(tp: sum of exp, target logit)")
        loss = torch.where(valid, sums[0].log() - sums[1], torch.zeros_like(sums[0]))
        ctx.save_for_backward(exp.div_(sums[0].unsqueeze(-1)), t, here, valid)
        ctx.dtype = local.dtype
        return loss.to(local.dtype)

    @staticmethod
    def backward(ctx, g):
        softmax, t, here, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, t.unsqueeze(-1), -here.to(grad.dtype).unsqueeze(-1))
        grad.mul_((g.float() * valid).unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None, None


# Tensor methods and torch functions that act on the token dims only: the result is the same
# slice of the same whole tensor, computed on the local slice. Reshapes are checked to keep
# the vocabulary as the last dim (then they regroup the token dims only: a flat element
# index is token * vocab + v before and after).
_RESHAPES = frozenset({"reshape", "view", "flatten", "unflatten", "squeeze", "unsqueeze"})
_CASTS = frozenset({"contiguous", "float", "double", "half", "bfloat16", "to", "clone", "detach", "cpu", "cuda"})


class VocabShardedLogits:
    """Logits split over ``tp`` by vocabulary (the last dim): this rank's slice, standing for
    the whole tensor in the user's loss code.

    Supported: ``.shape`` / ``.size()`` / ``.dim()`` (the whole tensor's), reshapes over the
    token dims (``reshape``, ``view``, ``flatten``, ``unflatten``, ``squeeze``,
    ``unsqueeze``), casts (``float``, ``to``, ``contiguous``, ...), indexing that keeps the
    last dim whole (``logits[..., :-1, :]``), and ``F.cross_entropy(logits_2d, targets,
    ignore_index=..., reduction=...)`` with class-index targets. Everything else raises a
    ``TypeError`` naming the operation.

    Attributes:
        local: this rank's slice, ``(..., vocab // tp)``.
        vocab: the whole vocabulary size.
        tp, rank, group: the ``tp`` axis; this rank holds ``[rank * vocab // tp, (rank + 1) * vocab // tp)``.

    Example (a world of one: the whole vocabulary on this rank):
        >>> import torch, torch.nn.functional as F
        >>> from fzero.transforms import VocabShardedLogits
        >>> full = torch.randn(2, 3, 8)
        >>> logits = VocabShardedLogits(full, vocab=8, tp=1, rank=0, group=None)
        >>> logits[:, :-1, :].flatten(0, 1).shape
        torch.Size([4, 8])
        >>> y = torch.randint(0, 8, (4,))
        >>> bool(torch.allclose(F.cross_entropy(logits[:, :-1, :].flatten(0, 1), y),
        ...                     F.cross_entropy(full[:, :-1, :].flatten(0, 1), y)))
        True
        >>> logits.argmax(-1)
        Traceback (most recent call last):
        ...
        TypeError: fzero.tensor_parallel: argmax on logits of shape (2, 3, 8) split over tp by vocabulary ...
    """

    __slots__ = ("local", "vocab", "tp", "rank", "group", "timeout_s")

    def __init__(self, local: torch.Tensor, *, vocab: int, tp: int, rank: int, group, timeout_s: float = 300.0):
        self.local, self.vocab, self.tp, self.rank, self.group = local, vocab, tp, rank, group
        self.timeout_s = timeout_s

    def _like(self, local: torch.Tensor) -> VocabShardedLogits:
        return VocabShardedLogits(local, vocab=self.vocab, tp=self.tp, rank=self.rank, group=self.group,
                                  timeout_s=self.timeout_s)

    # ------------------------------------------------------------ metadata of the whole tensor

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.local.shape[:-1], self.vocab))

    @property
    def ndim(self) -> int:
        return self.local.ndim

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def requires_grad(self) -> bool:
        return self.local.requires_grad

    def dim(self) -> int:
        return self.local.ndim

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return math.prod(self.shape)

    def is_floating_point(self) -> bool:
        return self.local.is_floating_point()

    def __repr__(self) -> str:  # no values: this rank has a slice of them
        lo = self.rank * self.local.shape[-1]
        return (f"VocabShardedLogits(shape={tuple(self.shape)}, dtype={self.dtype}, vocabulary "
                f"[{lo}, {lo + self.local.shape[-1]}) on tp rank {self.rank}/{self.tp})")

    # ------------------------------------------------------------ refusals

    def _refuse(self, op: str):
        lo = self.rank * self.local.shape[-1]
        raise TypeError(
            f"{WHERE}: {op} on logits of shape {tuple(self.shape)} split over tp by vocabulary (this rank "
            f"holds [{lo}, {lo + self.local.shape[-1]})) would need the whole vocabulary on one rank. "
            "Supported: reshapes and indexing over the token dims, casts, and F.cross_entropy(logits_2d, "
            "targets); for anything else leave the LM head whole (ColwiseParallel() without "
            "output='vocab', or no plan entry)")

    def __getattr__(self, name: str):
        if name.startswith("__") or name in self.__slots__:
            raise AttributeError(name)
        if name in _RESHAPES or name in _CASTS:
            method = getattr(torch.Tensor, name)
            return lambda *args, **kwargs: self._apply(method, name, args, kwargs)
        if callable(getattr(torch.Tensor, name, None)):
            return lambda *args, **kwargs: self._refuse(name)
        self._refuse(f"'.{name}'")

    def __getitem__(self, index):
        return self._index(index)

    def __setitem__(self, index, value):
        self._refuse("indexed assignment")

    def __bool__(self):
        self._refuse("bool()")

    def __len__(self):
        return self.shape[0]

    def __iter__(self):
        self._refuse("iteration")

    # ------------------------------------------------------------ the supported operations

    def _apply(self, method, name: str, args, kwargs):
        if name in _CASTS:
            return self._like(method(self.local, *args, **kwargs))
        whole = method(torch.empty(self.shape, device="meta"), *args, **kwargs)
        if whole.ndim == 0 or whole.shape[-1] != self.vocab:
            self._refuse(f"{name}{tuple(args)} (to shape {tuple(whole.shape)}, not ending in the vocabulary)")
        return self._like(self.local.reshape(*whole.shape[:-1], self.local.shape[-1]))

    def _index(self, index):
        items = index if isinstance(index, tuple) else (index,)

        def whole(i):  # a slice that keeps every element of the vocabulary, in order
            return isinstance(i, slice) and i.indices(self.vocab) == (0, self.vocab, 1)

        if Ellipsis in items:  # the items after it index the trailing dims
            tail = [i for i in items[items.index(Ellipsis) + 1:] if i is not None]
            keeps = not tail or whole(tail[-1])
        else:
            dims = [i for i in items if i is not None]
            used = sum(i.ndim if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1 for i in dims)
            keeps = used < self.ndim or (bool(dims) and whole(dims[-1]))
        if not keeps:
            self._refuse(f"indexing with {index!r} (it must keep the last dim whole, as logits[..., :-1, :])")
        return self._like(self.local[index])

    def cross_entropy(self, target: torch.Tensor, weight=None, size_average=None, ignore_index: int = -100,
                      reduce=None, reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
        if weight is not None or size_average is not None or reduce is not None or label_smoothing:
            self._refuse("F.cross_entropy with weight, label_smoothing or the deprecated size_average/reduce")
        if self.ndim != 2 or not isinstance(target, torch.Tensor) or target.ndim != 1 \
                or target.dtype.is_floating_point:
            self._refuse(f"F.cross_entropy of logits {tuple(self.shape)} and target "
                         f"{getattr(target, 'shape', target)!r} (supported: (tokens, vocab) logits and "
                         "(tokens,) class indices; flatten them first)")
        lo = self.rank * self.local.shape[-1]
        losses = _VocabParallelCrossEntropy.apply(self.local, target, lo, ignore_index,
                                                  self.group if self.tp > 1 else None, self.timeout_s)
        if reduction == "none":
            return losses
        if reduction == "sum":
            return losses.sum()
        if reduction == "mean":  # torch's: over the targets not ignored (0 / 0 = nan when all are)
            return losses.sum() / (target != ignore_index).sum().to(losses.dtype)
        raise ValueError(f"{WHERE}: F.cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", str(func))
        me = next(a for a in (*args, *kwargs.values()) if isinstance(a, VocabShardedLogits))
        if func is F.cross_entropy and args and args[0] is me \
                and not any(isinstance(a, VocabShardedLogits) for a in (*args[1:], *kwargs.values())):
            return me.cross_entropy(*args[1:], **kwargs)
        if (name in _RESHAPES or name in _CASTS) and args and args[0] is me:
            return me._apply(getattr(torch.Tensor, name), name, args[1:], kwargs)
        if name == "__getitem__" and args and args[0] is me:
            return me._index(args[1])
        me._refuse(name)


def _operator(dunder: str):
    def refuse(self, *args):
        self._refuse(f"the operator {dunder}")
    return refuse


for _d in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
           "__matmul__", "__rmatmul__", "__pow__", "__neg__", "__lt__", "__le__", "__gt__", "__ge__",
           "__float__", "__int__", "__array__"):
    setattr(VocabShardedLogits, _d, _operator(_d))
