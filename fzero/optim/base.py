"""The shape of an optimizer: a pair of pure functions, composed with :func:`chain`.

A :class:`GradientTransformation` is ``(init, update)`` as in optax:

* ``init(params) -> state`` builds the optimizer state (a pytree of NamedTuples);
* ``update(updates, state, params=None) -> (updates, state)`` turns gradients into
  updates and returns the next state. It never mutates its inputs.

``apply_updates(params, updates)`` adds the result to the parameters. An optimizer such as
``adamw`` is nothing but a chain of small transformations; its third field ``fused`` records
which optimizer it is and with which hyperparameters, so a later stage can run one fused
kernel over flat shards instead of the chain (see :class:`FusedSpec`).

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

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import torch

from fzero import tree
from fzero.optim._checks import type_name

__all__ = [
    "EmptyState",
    "FusedSpec",
    "GradientTransformation",
    "OptState",
    "Params",
    "Schedule",
    "ScalarOrSchedule",
    "Updates",
    "apply_updates",
    "chain",
    "fused_spec_of",
    "identity",
    "init_empty_state",
]

PyTree = Any
Params = PyTree
Updates = PyTree
OptState = PyTree
Schedule = Callable[[int], float]
ScalarOrSchedule = float | Schedule

FusedKind = Literal["adam", "adamw", "sgd", "lamb", "lion"]


@dataclasses.dataclass(frozen=True)
class FusedSpec:
    """Which optimizer an alias is, and its hyperparameters, for a fused-kernel back end.

    ``adam``, ``adamw``, ``sgd``, ``lamb`` and ``lion`` set ``GradientTransformation.fused``
    to one of these; the chain they return computes the same update unfused. Fields an
    optimizer does not use are ``None``.

    Attributes:
        kind: ``"adam"`` (L2 weight decay added to the gradient, as ``torch.optim.Adam``),
            ``"adamw"`` (decoupled, as ``torch.optim.AdamW``), ``"sgd"``, ``"lamb"``, ``"lion"``.
        learning_rate: a float, or a schedule ``fn(count) -> float`` (``count`` 0-based).
        b1, b2, eps, eps_root: the moment decay rates and stabilisers, as in optax.
        weight_decay: the weight-decay coefficient (0.0 when off).
        mask: the weight-decay mask (pytree of bools or callable) or ``None`` for all leaves.
        momentum, nesterov: SGD's momentum (``None`` when off) and Nesterov flag.
        clip_norm: set only on a chain's spec (:func:`chain`'s ``fusable``), when the alias
            is chained after ``clip_by_global_norm(clip_norm)``.
    """

    kind: FusedKind
    learning_rate: ScalarOrSchedule
    b1: float | None = None
    b2: float | None = None
    eps: float | None = None
    eps_root: float | None = None
    weight_decay: float = 0.0
    mask: Any = None
    momentum: float | None = None
    nesterov: bool = False
    clip_norm: float | None = None

    def __hash__(self) -> int:
        # A spec rides in TrainState's static fields, which may be hashed; a mask given as a
        # dict is not hashable itself, so hash its structure and leaves instead.
        def key(x):
            try:
                hash(x)
                return x
            except TypeError:
                return (tree.structure(x), tuple(tree.leaves(x)))

        return hash(tuple(key(getattr(self, f.name)) for f in dataclasses.fields(self)))


Output = Literal["new", "passthrough", "shared"]


class GradientTransformation(NamedTuple):
    """An optimizer as a value: ``init(params) -> state`` and
    ``update(updates, state, params=None) -> (updates, state)``, both pure.

    The fields after ``update`` declare what a faster path may rely on. Their defaults
    claim nothing, so ``GradientTransformation(init, update)`` is a complete transformation;
    :func:`chain` derives its own from its members'.

    Attributes:
        init: ``params -> state``.
        update: ``(updates, state, params=None) -> (updates, state)``; never writes into its
            arguments, unless called with ``inplace=True`` (see ``inplace``) or
            ``donate=True`` (see ``donates``).
        fused: which optimizer this is, with its hyperparameters, for a fused-kernel back end
            (:class:`FusedSpec`): set by the aliases ``adam``, ``adamw``, ``sgd``, ``lamb``,
            ``lion``; ``None`` elsewhere, a chain included.
        inplace: ``update`` also takes ``inplace=True``, and may then overwrite the incoming
            update tensors. :func:`chain` passes it only for tensors its previous member just
            made: on a CPU, allocating and page-faulting a fresh parameter-sized tensor costs
            more than the arithmetic.
        donates: ``update`` also takes ``donate=True``: the caller gives ``state`` up, and the
            returned state may be it, written in place (its moments updated where they are:
            no fresh state-sized tensors, and the same arithmetic, so the same bits). A
            compiled step whose state is donated (``fzero.compile(..., donate=True)``)
            passes it; :func:`chain` passes it to the members that declare it.
        output: the update tensors ``update`` returns: ``"new"``, made by this call and held by
            nothing else; ``"passthrough"``, the incoming ones wherever it made none (so new
            exactly when those were); ``"shared"``, possibly held elsewhere (by the state, say),
            never to be overwritten.
        clip_norm: set by :func:`~fzero.optim.clip_by_global_norm`: its bound, which a fused
            kernel folds in.
        fusable: set by :func:`chain`: the :class:`FusedSpec` of the whole chain when a fused
            kernel can run it (see :func:`fused_spec_of`), else ``None``.
    """

    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Updates, OptState]]
    fused: FusedSpec | None = None
    inplace: bool = False
    donates: bool = False
    output: Output = "shared"
    clip_norm: float | None = None
    fusable: FusedSpec | None = None


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


def _update(tx: GradientTransformation, updates, state, params, new: bool, donate: bool = False):
    """``tx.update(updates, state, params)``, writing into ``updates`` when they are ``new``
    and into ``state`` when it is donated, each where ``tx`` declares it can."""
    kwargs = {}
    if new and tx.inplace:
        kwargs["inplace"] = True
    if donate and tx.donates:
        kwargs["donate"] = True
    return tx.update(updates, state, params, **kwargs)


def _multiply(updates: Updates, factor: Any, inplace: bool) -> Updates:
    """``updates`` times ``factor`` (a number, a 0-dim tensor or one per leaf); written into
    ``updates`` when ``inplace`` (see :attr:`GradientTransformation.inplace`)."""
    leaves, spec = tree.flatten(updates)
    if not leaves:
        return updates
    with torch.no_grad():
        if inplace:
            torch._foreach_mul_(leaves, factor)
            return updates
        return tree.unflatten(spec, torch._foreach_mul(leaves, factor))


def _still_new(output: Output, new: bool) -> bool:
    """Whether a member's returned updates are new, given whether its incoming ones were."""
    return output == "new" or (output == "passthrough" and new)


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

    return GradientTransformation(init_empty_state, update_fn, inplace=True, output="passthrough")


def _chain_output(txs: tuple[GradientTransformation, ...]) -> Output:
    out: Output = "passthrough"
    for t in txs:
        out = out if t.output == "passthrough" else t.output
    return out


def _chain_fusable(txs: tuple[GradientTransformation, ...]) -> FusedSpec | None:
    """An alias, after at most one ``clip_by_global_norm`` (folded into ``clip_norm``)."""
    if not txs:
        return None
    *before, last = txs
    spec = fused_spec_of(last)
    if spec is None or not before:
        return spec
    if len(before) == 1 and before[0].clip_norm is not None and spec.clip_norm is None:
        return dataclasses.replace(spec, clip_norm=before[0].clip_norm)
    return None


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` one after the other; the state is the tuple of their states.

    Args:
        *transforms: :class:`GradientTransformation` values, applied left to right.

    Returns:
        A :class:`GradientTransformation` whose state is a tuple with one entry per transform
        (key paths read ``[1].mu['w']``), whose ``fused`` is ``None`` and whose ``fusable``
        is the spec a fused kernel can run instead (see :func:`fused_spec_of`).

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
        if not isinstance(state, tuple) or len(state) != len(txs):
            raise ValueError(
                f"fzero.optim.chain: the state must be the tuple of {len(txs)} states that init "
                f"returned, got {type_name(state)}"
                + (f" of length {len(state)}" if isinstance(state, tuple) else "")
            )
        new_states = []
        new = inplace
        for t, s in zip(txs, state):
            updates, s = _update(t, updates, s, params, new, donate)
            new = _still_new(t.output, new)
            new_states.append(s)
        return updates, tuple(new_states)

    return GradientTransformation(init_fn, update_fn, inplace=True, donates=any(t.donates for t in txs),
                                  output=_chain_output(txs), fusable=_chain_fusable(txs))


def fused_spec_of(tx: GradientTransformation) -> FusedSpec | None:
    """The :class:`FusedSpec` of ``tx`` when a fused kernel can compute it, else ``None``.

    That is the case for an alias (``adam``, ``adamw``, ``sgd``, ``lamb``, ``lion``: its
    ``fused``) and for a chain of one, or of ``clip_by_global_norm(c)`` then one (its
    ``fusable``, with ``clip_norm=c``). Anything else (other chains, masks around an alias,
    ...) returns ``None`` and runs unfused.

    The state of such a chain is ``(EmptyState(), alias_state)``.

    Example:
        >>> from fzero import optim
        >>> spec = optim.fused_spec_of(optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3)))
        >>> spec.kind, spec.clip_norm, spec.weight_decay
        ('adamw', 1.0, 0.01)
        >>> optim.fused_spec_of(optim.chain(optim.scale(2.0), optim.adamw(1e-3))) is None
        True
    """
    if not isinstance(tx, GradientTransformation):
        raise TypeError(f"fzero.optim.fused_spec_of: expected a GradientTransformation, got {type_name(tx)}")
    return tx.fused if tx.fused is not None else tx.fusable


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
