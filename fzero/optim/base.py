"""The shape of an optimizer: a pair of pure functions, composed with :func:`chain`.

A :class:`GradientTransformation` is ``(init, update)`` as in optax:

* ``init(params) -> state`` builds the optimizer state (a pytree of NamedTuples);
* ``update(updates, state, params=None) -> (updates, state)`` turns gradients into
  updates and returns the next state. It never mutates its inputs.

``apply_updates(params, updates)`` adds the result to the parameters. An optimizer such as
``adamw`` is nothing but a chain of small transformations. Running one as fused kernels, or
in place, is not the transformation's business but the lowering's
(:mod:`fzero.optim.lowering`), which recognises known chains by what their members are.

Example:
    >>> import torch
    >>> from fzero import optim
    >>> tx = optim.chain(optim.scale(2.0), optim.scale(-0.5))
    >>> params = {"w": torch.ones(2)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": torch.tensor([1.0, -3.0])}, state, params)
    >>> optim.apply_updates(params, updates)["w"]
    tensor([0., 4.])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fzero import tree
from fzero.optim import _known
from fzero.optim._checks import type_name

__all__ = [
    "EmptyState",
    "GradientTransformation",
    "OptState",
    "Params",
    "Schedule",
    "ScalarOrSchedule",
    "Updates",
    "apply_updates",
    "chain",
    "identity",
    "init_empty_state",
]

PyTree = Any
Params = PyTree
Updates = PyTree
OptState = PyTree
Schedule = Callable[[int], float]
ScalarOrSchedule = float | Schedule


class GradientTransformation(NamedTuple):
    """An optimizer as a value: ``init(params) -> state`` and
    ``update(updates, state, params=None) -> (updates, state)``, both pure (optax's pair).

    ``GradientTransformation(init, update)`` of one's own functions is a complete
    transformation: it chains, masks and runs as any other.

    Attributes:
        init: ``params -> state``.
        update: ``(updates, state, params=None) -> (updates, state)``; never writes into its
            arguments. (fzero's own take keyword-only extras, ``inplace=True`` or
            ``donate=True``, that the lowering passes where writing in place computes the
            same bits: see :mod:`fzero.optim._known`.)
    """

    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Updates, OptState]]


class EmptyState(NamedTuple):
    """The state of a stateless transformation."""


def init_empty_state(params: Params) -> EmptyState:
    """The ``init`` of a stateless transformation."""
    del params
    return EmptyState()


# --------------------------------------------------------------------------- helpers


def _check_tx(where: str, i: int, tx: Any) -> GradientTransformation:
    if isinstance(tx, GradientTransformation):
        return tx
    if callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None)):
        return GradientTransformation(tx.init, tx.update)
    raise TypeError(
        f"{where}: argument {i} must be a GradientTransformation (an (init, update) pair such as "
        f"fzero.optim.adamw(1e-3)), got {type_name(tx)}"
    )


def _flatten_like(where: str, expected_spec, expected: PyTree, got: PyTree, names: tuple[str, str]) -> list:
    """Leaves of ``got``, which must have the structure ``expected_spec`` of ``expected``;
    else :class:`fzero.tree.StructureError` naming the key paths."""
    leaves, spec = tree.flatten(got)
    if spec != expected_spec:
        tree.assert_same_structure(expected, got, what=where, names=names)
    return leaves


def _new_count() -> torch.Tensor:
    """A 0-dim int64 CPU counter; schedules read it with ``int(count)`` without a device sync."""
    return torch.zeros((), dtype=torch.int64)


def _increment(count: torch.Tensor) -> torch.Tensor:
    return count + 1


def _multiply(updates: Updates, factor: Any, inplace: bool) -> Updates:
    """``updates`` times ``factor`` (a number, a 0-dim tensor or one per leaf); written into
    ``updates`` when ``inplace`` (the lowering says so only for tensors nothing else holds)."""
    leaves, spec = tree.flatten(updates)
    if not leaves:
        return updates
    with torch.no_grad():
        if inplace:
            torch._foreach_mul_(leaves, factor)
            return updates
        return tree.unflatten(spec, torch._foreach_mul(leaves, factor))


# --------------------------------------------------------------------------- combinators


def identity() -> GradientTransformation:
    """The transformation that returns its updates unchanged.

    Returns:
        A stateless :class:`GradientTransformation`.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> tx = optim.identity()
        >>> tx.update({"w": torch.ones(1)}, tx.init({"w": torch.ones(1)}))[0]
        {'w': tensor([1.])}
    """

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        return updates, state

    return _known.record(GradientTransformation(init_empty_state, update_fn), _known.Identity())


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` one after the other; the state is the tuple of their states.

    Args:
        *transforms: :class:`GradientTransformation` values, applied left to right.

    Returns:
        A :class:`GradientTransformation` whose state is a tuple with one entry per transform
        (key paths read ``[1].mu['w']``).

    Raises:
        TypeError: an argument is not a :class:`GradientTransformation`.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> tx = optim.chain(optim.clip_by_global_norm(1.0), optim.sgd(0.1))
        >>> params = {"w": torch.zeros(2)}
        >>> updates, _ = tx.update({"w": torch.tensor([3.0, 4.0])}, tx.init(params), params)
        >>> updates["w"]
        tensor([-0.0600, -0.0800])
    """
    txs = tuple(_check_tx("fzero.optim.chain", i, t) for i, t in enumerate(transforms))

    def init_fn(params):
        return tuple(t.init(params) for t in txs)

    def update_fn(updates, state, params=None, *, inplace=False, donate=False):
        # inplace/donate: the lowering's extras (fzero.optim._known), passed on to the members
        # whose records allow them; without them the chain is optax's.
        if not isinstance(state, tuple) or len(state) != len(txs):
            raise ValueError(
                f"fzero.optim.chain: the state must be the tuple of {len(txs)} states that init "
                f"returned, got {type_name(state)}"
                + (f" of length {len(state)}" if isinstance(state, tuple) else "")
            )
        new_states = []
        new = inplace
        for t, s in zip(txs, state):
            updates, s = _known.update(t, updates, s, params, new=new, donate=donate)
            new = _known.still_new(t, new)
            new_states.append(s)
        return updates, tuple(new_states)

    return _known.record(GradientTransformation(init_fn, update_fn), _known.Chain(txs))


# --------------------------------------------------------------------------- apply


def apply_updates(params: Params, updates: Updates, *, donate: bool = False) -> Params:
    """``params + updates``, leafwise, as new tensors in each parameter's dtype.

    Pure: ``params`` and ``updates`` are left untouched, unless ``donate``: then the sums are
    written into ``params`` (the same arithmetic, so the same bits) and ``params`` is
    returned. Where an update's dtype differs from
    its parameter's, the sum is formed in the promoted dtype and rounded once to the
    parameter's dtype (as optax's ``apply_updates`` and torch's in-place ``p.add_(u)`` do), so
    a bf16 parameter takes an fp32 update with a single rounding.

    Args:
        params: a pytree of tensors.
        updates: a pytree of tensors with the structure of ``params``.
        donate: the caller gives ``params`` up: update them in place.

    Returns:
        A pytree like ``params``; each leaf has its parameter's dtype and device.

    Raises:
        fzero.tree.StructureError: the structures differ; the message names the key paths.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> p = {"w": torch.ones(2, dtype=torch.bfloat16)}
        >>> optim.apply_updates(p, {"w": torch.full((2,), 0.5)})["w"]
        tensor([1.5000, 1.5000], dtype=torch.bfloat16)
    """
    p_leaves, spec = tree.flatten(params)
    u_leaves = _flatten_like("fzero.optim.apply_updates", spec, params, updates, ("params", "updates"))
    if not p_leaves:
        return params
    with torch.no_grad():
        if donate:
            # In place: on a CPU a fresh parameter-sized tensor a step costs page faults.
            if all(p.dtype == u.dtype for p, u in zip(p_leaves, u_leaves)):
                torch._foreach_add_(p_leaves, u_leaves)
            else:
                for p, u in zip(p_leaves, u_leaves):
                    p.add_(u)  # in the promoted dtype, rounded once to the parameter's
            return params
        if all(p.dtype == u.dtype for p, u in zip(p_leaves, u_leaves)):
            return tree.unflatten(spec, torch._foreach_add(p_leaves, u_leaves))
        out = []
        for p, u in zip(p_leaves, u_leaves):
            # out= in the parameter's dtype: computed in the promoted dtype, rounded once.
            out.append(p + u if p.dtype == u.dtype else torch.add(p, u, out=torch.empty_like(p)))
        return tree.unflatten(spec, out)
