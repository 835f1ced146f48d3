"""``Params``: a model's parameters by name, knowing which of them are frozen.

A frozen parameter (``requires_grad=False`` on the module) is part of the model -- its
forward uses it, checkpoints save it -- but not of training: it gets no gradient, no
optimizer state and no gradient communication, and stays bit-identical. The set of frozen
names has to travel with the parameters through every pytree operation (a cast, a
partition, a checkpoint load), so it is *static metadata of the container*: ``Params`` is a
``dict`` registered as a pytree node whose spec records the frozen names. ``tree.map`` over
it returns a ``Params`` with the same frozen names; two ``Params`` trees with different
frozen sets have different structures.

Gradients follow JAX's equinox (``filter_grad``): a frozen leaf's gradient is ``None``, an
empty subtree, so ``tree.leaves(grads)`` holds the trainable gradients only and a norm or a
sum over them is the trainable one. :meth:`Params.trainable` is the same view of the
parameters (``None`` at frozen keys): the optimizer is initialised and updated on it.

A ``Params`` may also carry a ``layout``: how its entries are split over a mesh axis
(:class:`fzero.transforms.tensor_parallel.TensorParallelLayout`, set by
``tensor_parallel``'s ``init``). It is static metadata for the same reason: gradients,
fp32 masters, optimizer moments and a checkpoint loaded like the state are built from the
parameters by pytree operations, so each of them knows which of its entries are slices, and
``fzero.gather`` of any of them returns whole tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import optree

from fzero import tree

__all__ = ["Params", "frozen_names", "like_params", "merge_trainable", "trainable", "with_values"]


class Params(dict):
    """A ``dict`` of parameters by name whose ``frozen`` names are not trained.

    Args:
        items: the parameters, a mapping or ``(name, tensor)`` pairs.
        frozen: names of parameters that are not trained (each must be a key).
        layout: how the entries are split over a mesh axis (``None``: whole); fzero's
            transforms set it, and ``fzero.gather`` reads it.

    Example:
        >>> import torch
        >>> from fzero import Params, tree
        >>> p = Params({"a": torch.ones(2), "b": torch.zeros(3)}, frozen={"b"})
        >>> sorted(p.frozen), [x.shape[0] for x in tree.leaves(p.trainable())]
        (['b'], [2])
        >>> tree.map(lambda x: x + 1, p).frozen == p.frozen
        True
    """

    __slots__ = ("frozen", "layout")

    def __init__(self, items: Mapping[str, Any] | Iterable[tuple[str, Any]] = (), *, frozen: Iterable[str] = (),
                 layout: Any = None):
        super().__init__(items)
        frozen = frozenset(frozen)
        unknown = sorted(frozen - self.keys())
        if unknown:
            raise KeyError(f"fzero.Params: frozen names {unknown} are not parameters (have {sorted(self)[:8]}...)")
        self.frozen = frozen
        self.layout = layout

    def trainable(self) -> "Params":
        """The same parameters with ``None`` at frozen names (what gradients look like)."""
        return Params({k: (None if k in self.frozen else v) for k, v in self.items()}, frozen=self.frozen,
                      layout=self.layout)

    def __repr__(self) -> str:
        layout = "" if self.layout is None else f", layout={self.layout!r}"
        return f"Params({dict.__repr__(self)}, frozen={sorted(self.frozen)}{layout})"

    # A dict subclass with slots pickles through __reduce__ (the multi-rank harness sends
    # states between processes).
    def __reduce__(self):
        return (_rebuild, (dict(self), tuple(sorted(self.frozen)), self.layout))


def _rebuild(items, frozen, layout=None):
    return Params(items, frozen=frozen, layout=layout)


def _flatten(p: Params):
    keys = sorted(p)  # optree's own order for dicts, so a Params flattens as a dict does
    return [p[k] for k in keys], (tuple(p), p.frozen, p.layout), keys


def _unflatten(meta, children):
    order, frozen, layout = meta
    by_key = dict(zip(sorted(order), children))
    return Params({k: by_key[k] for k in order}, frozen=frozen, layout=layout)


optree.register_pytree_node(Params, _flatten, _unflatten, path_entry_type=optree.MappingEntry,
                            namespace=tree.NAMESPACE)


def frozen_names(params: Any) -> frozenset[str]:
    """The frozen names of a ``Params`` (empty for any other mapping)."""
    return params.frozen if isinstance(params, Params) else frozenset()


def trainable(params: Any) -> Any:
    """``params.trainable()`` for a ``Params``; any other tree is all trainable."""
    return params.trainable() if isinstance(params, Params) else params


def with_values(like: dict, values: Mapping[str, Any]) -> dict:
    """``like`` (a params dict, or a ``Params`` with its frozen names and layout) with the
    entries named in ``values`` replaced; same keys, same order."""
    out = {k: values.get(k, v) for k, v in like.items()}
    return like_params(like, out)


def like_params(like: Any, items: Mapping[str, Any], frozen: Iterable[str] | None = None) -> dict:
    """``items`` in ``like``'s container: a ``Params`` with ``like``'s layout and its frozen
    names among ``items`` (or ``frozen``), when ``like`` is one; else a plain dict."""
    if not isinstance(like, Params):
        return dict(items)
    frozen = like.frozen & items.keys() if frozen is None else frozen
    return Params(items, frozen=frozen, layout=like.layout)


def merge_trainable(params: Any, new_trainable: Any) -> Any:
    """``params`` with its trainable entries taken from ``new_trainable`` (a tree like
    ``params.trainable()``); frozen entries kept."""
    if not isinstance(params, dict):
        return new_trainable
    frozen = frozen_names(params)
    return with_values(params, {k: v for k, v in new_trainable.items() if k not in frozen})
