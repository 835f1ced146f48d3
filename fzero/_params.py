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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import optree
import torch

from fzero import tree

__all__ = ["Params", "frozen_names", "merge_trainable", "trainable"]


class Params(dict):
    """A ``dict`` of parameters by name whose ``frozen`` names are not trained.

    Args:
        items: the parameters, a mapping or ``(name, tensor)`` pairs.
        frozen: names of parameters that are not trained (each must be a key).

    Example:
        >>> import torch
        >>> from fzero import Params, tree
        >>> p = Params({"a": torch.ones(2), "b": torch.zeros(3)}, frozen={"b"})
        >>> sorted(p.frozen), [x.shape[0] for x in tree.leaves(p.trainable())]
        (['b'], [2])
        >>> tree.map(lambda x: x + 1, p).frozen == p.frozen
        True
    """

    __slots__ = ("frozen",)

    def __init__(self, items: Mapping[str, Any] | Iterable[tuple[str, Any]] = (), *, frozen: Iterable[str] = ()):
        super().__init__(items)
        frozen = frozenset(frozen)
        unknown = sorted(frozen - self.keys())
        if unknown:
            raise KeyError(f"fzero.Params: frozen names {unknown} are not parameters (have {sorted(self)[:8]}...)")
        self.frozen = frozen

    def trainable(self) -> "Params":
        """The same parameters with ``None`` at frozen names (what gradients look like)."""
        return Params({k: (None if k in self.frozen else v) for k, v in self.items()}, frozen=self.frozen)

    def replace_values(self, values: Mapping[str, Any]) -> "Params":
        """A ``Params`` with the same keys, order and frozen names, taking ``values[k]``
        where given and keeping the current value elsewhere."""
        return Params({k: values.get(k, v) for k, v in self.items()}, frozen=self.frozen)

    def __repr__(self) -> str:
        return f"Params({dict.__repr__(self)}, frozen={sorted(self.frozen)})"

    # A dict subclass with slots pickles through __reduce__ (the multi-rank harness sends
    # states between processes).
    def __reduce__(self):
        return (_rebuild, (dict(self), tuple(sorted(self.frozen))))


def _rebuild(items, frozen):
    return Params(items, frozen=frozen)


def _flatten(p: Params):
    keys = sorted(p)  # optree's own order for dicts, so a Params flattens as a dict does
    return [p[k] for k in keys], (tuple(p), p.frozen), keys


def _unflatten(meta, children):
    order, frozen = meta
    by_key = dict(zip(sorted(order), children))
    return Params({k: by_key[k] for k in order}, frozen=frozen)


optree.register_pytree_node(Params, _flatten, _unflatten, path_entry_type=optree.MappingEntry,
                            namespace=tree.NAMESPACE)


def frozen_names(params: Any) -> frozenset[str]:
    """The frozen names of a ``Params`` (empty for any other mapping)."""
    return params.frozen if isinstance(params, Params) else frozenset()


def trainable(params: Any) -> Any:
    """``params.trainable()`` for a ``Params``; any other tree is all trainable."""
    return params.trainable() if isinstance(params, Params) else params


def merge_trainable(params: Any, new_trainable: Any) -> Any:
    """``params`` with its trainable entries taken from ``new_trainable`` (frozen kept)."""
    if not isinstance(params, Params) or not params.frozen:
        if isinstance(params, Params):
            return Params(dict(new_trainable), frozen=())
        return new_trainable
    return Params({k: (v if k in params.frozen else new_trainable[k]) for k, v in params.items()},
                  frozen=params.frozen)


def is_tensor_dict(x: Any) -> bool:
    return isinstance(x, dict) and all(isinstance(v, torch.Tensor) for v in x.values())
