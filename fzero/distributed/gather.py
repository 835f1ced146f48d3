"""``gather``: full, unsharded tensors of a (possibly sharded) pytree, over every mesh axis."""

from __future__ import annotations

from typing import Any

import torch

from fzero import tree
from fzero._params import Params

__all__ = ["gather"]


def _is_sharded(x: Any) -> bool:
    return hasattr(x, "__fzero_gather__")


def _is_record(x: Any) -> bool:
    """A layout record a transform keeps in a state (``state.tensor_parallel``,
    ``state.pipeline``): it names the mesh axis
    it split the state over (``__fzero_axis__``) and knows how to put it back together."""
    return hasattr(type(x), "__fzero_axis__")


def _is_split(x: Any) -> bool:
    return isinstance(x, Params) and x.layout is not None


def gather(state: Any) -> Any:
    """Full tensors of every leaf of ``state``, on every rank (for logging, export, tests).

    The pieces come back together axis by axis, each from what the data says of itself:

    1. ``dp``: a ZeRO piece (a ``Shard``, made by ``shard_state``) is all-gathered over its
       ``dp`` group and reshaped to its global shape.
    2. ``tp``: a :class:`fzero.Params` whose ``layout`` says how it is split over ``tp``
       (``state.params`` under ``tensor_parallel``, and every tree a pytree operation made
       from it: gradients, fp32 masters, optimizer moments, a checkpoint loaded like the
       state) has each split entry all-gathered into the whole tensor. In a tree that holds a
       ``TensorParallelLayout`` record (a ``TrainState``'s ``tensor_parallel``) every other
       tensor stored under a split parameter's name is too, as checkpoints read it.
    3. ``pp``: in a tree that holds a pipeline's record (a pipelined ``TrainState``), every
       dict keyed by the stage's parameter names (parameters, masters, moments) is completed
       with every other stage's entries, so each rank holds the whole model's.

    What a plain dict cannot say is not guessed: a dict of slices built by hand from
    ``state.params`` (``{k: v for k, v in ...}``) has lost its layout and comes back as the
    slices, and a stage's parameters come back as that stage's alone unless the
    ``TrainState`` is passed. Replicated tensors are returned detached. The result holds no
    reference into the training buffers (changing it changes nothing) and no layout record:
    it is whole. Call it on every rank: it is a collective.

    Args:
        state: any pytree: a ``TrainState``, ``state.params``, gradients, a metrics dict.

    Returns:
        The same structure with whole tensors (a ``TrainState`` without its layout records:
        ``tensor_parallel`` and ``pipeline`` are ``None``).

    Raises:
        ValueError: the tree holds two different records for one axis.

    Example:
        >>> import torch, fzero
        >>> fzero.gather({"w": torch.ones(2)})["w"].tolist()
        [1.0, 1.0]
    """
    records: dict[str, Any] = {}
    for r in tree.leaves(state, is_leaf=_is_record):
        if _is_record(r):
            axis = type(r).__fzero_axis__
            if records.setdefault(axis, r) != r:
                raise ValueError(f"fzero.gather: the tree holds two different {axis} layouts ({records[axis]!r} and "
                                 f"{r!r}); gather one state at a time")

    def full(x):
        if _is_sharded(x):
            return x.__fzero_gather__()
        if isinstance(x, torch.Tensor):
            return x.detach().clone()
        return x

    out = tree.map(full, state, is_leaf=_is_sharded)
    tp = records.get("tp")

    def over_tp(path, x):
        if _is_split(x):
            return x.layout.whole_params(x)
        return tp.whole_leaf(path, x) if tp is not None else x

    if tp is not None or any(_is_split(x) for x in tree.leaves(out, is_leaf=_is_split)):
        out = tree.map_with_path(over_tp, out, is_leaf=_is_split)
    if "pp" in records:
        out = records["pp"].whole_tree(out)
    if records and hasattr(out, "replace"):
        out = out.replace(**{f: None for f in ("tensor_parallel", "pipeline") if _is_record(getattr(out, f, None))})
    return out
