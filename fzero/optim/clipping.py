"""Norms of updates, exact on shards, and clipping by the global norm."""

from __future__ import annotations

import contextlib
import contextvars
from typing import NamedTuple

import torch

from fzero import tree
from fzero.optim import _known
from fzero.optim._checks import check_number
from fzero.optim.base import GradientTransformation, _multiply, init_empty_state
from fzero.core import LeafSums, emit_metric, psum

__all__ = ["clip_by_global_norm", "global_norm", "global_sumsq", "known_sumsq", "leaf_norms"]

# torch.nn.utils.clip_grad_norm_ divides by (norm + 1e-6); we keep it so clipping matches
# torch's (and never divides by zero on an all-zero gradient).
_CLIP_EPS = 1e-6


def _leaf_norms(xs: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The local L2 norm of each tensor, stacked into one vector on ``device``.

    Accumulated in fp32 at least (bf16/fp16 leaves are not rounded back), fp64 when a leaf
    is fp64; one multi-tensor kernel when the leaves share a precision.
    """
    acc = torch.float32
    for dtype in {x.dtype for x in xs}:  # the dtypes, not a dispatch per leaf
        acc = torch.promote_types(acc, dtype)
    if acc == torch.float32:
        norms = torch._foreach_norm(xs, 2, dtype=torch.float32)
    elif all(x.dtype == acc for x in xs):
        norms = torch._foreach_norm(xs, 2)
    else:  # mixed fp64 and lower precisions: rare, one norm per leaf
        norms = [torch.linalg.vector_norm(x, dtype=acc) for x in xs]
    if all(n.dtype == acc and n.device == device for n in norms):  # the usual case: no call per leaf
        return torch.stack(norms)
    return torch.stack([n.to(device=device, dtype=acc) for n in norms])


def leaf_norms(*trees, device: torch.device | None = None) -> tuple[torch.Tensor, ...]:
    """The L2 norm of each leaf of each tree: one vector per tree, in leaf order.

    The local sums of squares of all trees go through one :func:`fzero.transforms.psum`
    (as a :class:`~fzero.transforms.LeafSums`) before the square root, so the norm of a leaf
    that is a piece (a ZeRO shard, a ``tensor_parallel`` slice) is the whole tensor's, and a
    leaf every ``tp`` rank holds whole is counted once. Norms are fp32, or fp64 where a leaf
    is fp64. Per-leaf trust ratios (LARS, LAMB) are built on it.

    Args:
        *trees: pytrees of tensors, each with at least one leaf; keyed as ``state.params``
            (a leaf is named by its path's first key) where the parameters may be split.
        device: where the vectors are; default: the first leaf's device.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> optim.leaf_norms({"a": torch.tensor([3.0, 4.0]), "b": torch.ones(4)}, [torch.zeros(1)])
        (tensor([5., 2.]), tensor([0.]))
    """
    groups = [tree.leaves(t) for t in trees]
    if device is None:
        device = groups[0][0].device
    sq = psum(LeafSums.of(trees, torch.cat([_leaf_norms(xs, device).square() for xs in groups])))
    return sq.sqrt().split([len(xs) for xs in groups])


class _Known(NamedTuple):
    leaves: tree.Unchanged  # ordered: each name keeps its tensor
    names: tuple
    sumsq: torch.Tensor


# The global sum of squares of one set of gradients, already reduced (known_sumsq).
_KNOWN: contextvars.ContextVar[_Known | None] = contextvars.ContextVar("fzero_known_sumsq", default=None)


@contextlib.contextmanager
def known_sumsq(updates, sumsq: torch.Tensor):
    """While open, :func:`global_sumsq` of exactly the leaves of ``updates`` -- the same
    tensors, in the same order under the same names, not written in place since -- is
    ``sumsq``, not computed and reduced again: a norm taken once serves the non-finite
    check (``fzero.check_finite``) and the clip after it."""
    leaves = tree.leaves(updates)
    token = _KNOWN.set(_Known(tree.Unchanged(leaves, ordered=True), LeafSums.of([updates], None).names, sumsq))
    try:
        yield
    finally:
        _KNOWN.reset(token)


def _known_for(leaves: list, names: tuple) -> torch.Tensor | None:
    known = _KNOWN.get()
    if known is None or known.names != names or not known.leaves.holds(leaves):
        return None
    return known.sumsq


def global_sumsq(updates, device: torch.device | None = None) -> torch.Tensor:
    """The sum of squares of all leaves of ``updates`` together, reduced over the ranks
    (:func:`global_norm` squared; a 0-dim tensor on ``device``, default the first leaf's).
    Inside :func:`known_sumsq` for the same leaves, the value given there."""
    leaves = tree.leaves(updates)
    with torch.no_grad():
        if not leaves:
            return psum(torch.zeros((), dtype=torch.float32))
        sums = LeafSums.of([updates], None, total=True)
        known = _known_for(leaves, sums.names)
        if known is not None:
            return known
        return psum(sums._replace(sums=_leaf_norms(leaves, device or leaves[0].device).square()))


def global_norm(updates) -> torch.Tensor:
    """The L2 norm of all leaves of ``updates`` together, as a 0-dim tensor (fp32, or fp64
    when a leaf is fp64).

    The local sums of squares, one per leaf, go through :func:`fzero.transforms.psum` (as a
    :class:`~fzero.transforms.LeafSums` with ``total``) before the square root, so the norm
    is exact when the leaves are pieces of the full tensors (ZeRO's shards, ``tensor_parallel``'s
    slices), with a leaf every ``tp`` rank holds whole counted once. ``updates`` is keyed as
    ``state.params`` (a leaf is named by its path's first key).

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> optim.global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([[4.0]])})
        tensor(5.)
    """
    with torch.no_grad():
        return global_sumsq(updates).sqrt()


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all updates together so their global L2 norm is at most ``max_norm``.

    As ``torch.nn.utils.clip_grad_norm_``::

        norm = sqrt(sum over leaves of sum(u^2))
        out = u * min(1, max_norm / (norm + 1e-6))

    The ``1e-6`` is torch's choice (optax instead leaves updates untouched below
    ``max_norm`` and divides by ``norm`` exactly above it); the two differ by at most a
    relative 1e-6 / max_norm. The norm before clipping is reported with
    ``emit_metric("grad_norm", norm)`` (a 0-dim tensor: no device sync), and is
    :func:`global_norm`'s: exact when leaves are shards or ``tensor_parallel`` slices.

    Args:
        max_norm: the largest allowed global norm, > 0.

    Returns:
        A stateless :class:`GradientTransformation`.

    Raises:
        ValueError: ``max_norm`` is not positive.
        TypeError: ``max_norm`` is not a number.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> tx = optim.clip_by_global_norm(1.0)
        >>> u, _ = tx.update([torch.tensor([3.0, 4.0])], tx.init(None))
        >>> u
        [tensor([0.6000, 0.8000])]
    """
    where = "fzero.optim.clip_by_global_norm"
    max_norm = check_number(where, "max_norm", max_norm)
    if not max_norm > 0.0:
        raise ValueError(f"{where}: max_norm must be > 0, got {max_norm!r}")

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        norm = global_norm(updates)
        emit_metric("grad_norm", norm)
        leaves = tree.leaves(updates)
        if not leaves:
            return updates, state
        with torch.no_grad():
            coef = (max_norm / (norm + _CLIP_EPS)).clamp(max=1.0)
        if not all(x.device == leaves[0].device for x in leaves):
            coef = [coef.to(x.device) for x in leaves]  # a model placed on several devices by hand
        return _multiply(updates, coef, inplace), state

    return _known.record(GradientTransformation(init_empty_state, update_fn), _known.ClipByGlobalNorm(max_norm))
