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
import numbers
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import torch

from fzero import tree

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
        clip_norm: set only by :func:`fused_spec_of` when the alias is chained after
            ``clip_by_global_norm(clip_norm)``.
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


class GradientTransformation(NamedTuple):
    """An optimizer as a value: ``init(params) -> state`` and
    ``update(updates, state, params=None) -> (updates, state)``, both pure.

    ``fused`` is a :class:`FusedSpec` on the optimizer aliases and ``None`` elsewhere.
    """

    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Updates, OptState]]
    fused: FusedSpec | None = None


class EmptyState(NamedTuple):
    """The state of a stateless transformation."""


# --------------------------------------------------------------------------- validation


def _type_name(x: Any) -> str:
    return type(x).__name__


def _check_number(where: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: {name} must be a number, got {_type_name(value)} {value!r}")
    return float(value)


def _check_nonneg(where: str, name: str, value: Any) -> float:
    v = _check_number(where, name, value)
    if not v >= 0.0:
        raise ValueError(f"{where}: {name} must be >= 0, got {value!r}")
    return v


def _check_unit(where: str, name: str, value: Any, *, closed: bool = False) -> float:
    """A decay rate: 0 <= value < 1 (or <= 1 with ``closed``)."""
    v = _check_number(where, name, value)
    ok = 0.0 <= v <= 1.0 if closed else 0.0 <= v < 1.0
    if not ok:
        interval = "[0, 1]" if closed else "[0, 1)"
        raise ValueError(f"{where}: {name} must lie in {interval}, got {value!r}")
    return v


def _check_lr(where: str, learning_rate: Any) -> ScalarOrSchedule:
    """A learning rate is a non-negative number or a schedule ``fn(count) -> float``."""
    if callable(learning_rate):
        return learning_rate
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, numbers.Real):
        raise TypeError(
            f"{where}: learning_rate must be a float or a schedule fn(count: int) -> float, "
            f"got {_type_name(learning_rate)} {learning_rate!r}"
        )
    if not float(learning_rate) >= 0.0:
        raise ValueError(f"{where}: learning_rate must be >= 0, got {learning_rate!r}")
    return float(learning_rate)


def _check_tx(where: str, i: int, tx: Any) -> GradientTransformation:
    if isinstance(tx, GradientTransformation):
        return tx
    if callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None)):
        return GradientTransformation(tx.init, tx.update)
    raise TypeError(
        f"{where}: argument {i} must be a GradientTransformation (an (init, update) pair such as "
        f"fzero.optim.adamw(1e-3)), got {_type_name(tx)}"
    )


def _check_same(where: str, expected: PyTree, got: PyTree, names: tuple[str, str]) -> None:
    """Raise :class:`fzero.tree.StructureError` naming key paths when the structures differ."""
    tree.assert_same_structure(expected, got, what=where, names=names)


def _flatten_like(where: str, expected_spec, expected: PyTree, got: PyTree, names: tuple[str, str]) -> list:
    """Leaves of ``got``, which must have the structure ``expected_spec`` of ``expected``."""
    leaves, spec = tree.flatten(got)
    if spec != expected_spec:
        _check_same(where, expected, got, names)
    return leaves


def _leaf_norms(xs: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The L2 norm of each tensor, stacked into one vector on ``device``.

    Accumulated in fp32 at least (bf16/fp16 leaves are not rounded back), fp64 when a leaf
    is fp64; one multi-tensor kernel when the leaves share a precision.
    """
    acc = torch.float32
    for x in xs:
        acc = torch.promote_types(acc, x.dtype)
    if acc == torch.float32:
        norms = torch._foreach_norm(xs, 2, dtype=torch.float32)
    elif all(x.dtype == acc for x in xs):
        norms = torch._foreach_norm(xs, 2)
    else:  # mixed fp64 and lower precisions: rare, one norm per leaf
        norms = [torch.linalg.vector_norm(x, dtype=acc) for x in xs]
    return torch.stack([n.to(device=device, dtype=acc) for n in norms])


# In-place protocol between chain members. The public update(updates, state, params) is
# pure; a transformation built here also accepts ``_inplace=True``, which chain passes only
# when the incoming updates are tensors the previous member just made (referenced by nothing
# else), letting it overwrite them instead of allocating: on CPU, allocating and
# page-faulting a fresh parameter-sized tensor costs more than the arithmetic.
#   update_fn._fzero_inplace: the function accepts _inplace=True;
#   update_fn._fzero_fresh(fresh_in) -> bool: whether its output leaves are such fresh
#   tensors, given whether its input leaves were.


def _mark(update_fn: Callable, *, inplace: bool, fresh: Callable[[bool], bool]) -> Callable:
    update_fn._fzero_inplace = inplace  # type: ignore[attr-defined]
    update_fn._fzero_fresh = fresh  # type: ignore[attr-defined]
    return update_fn


def _fresh_after(update_fn: Callable, fresh_in: bool) -> bool:
    f = getattr(update_fn, "_fzero_fresh", None)
    return bool(f(fresh_in)) if f is not None else False


def _call(update_fn: Callable, updates, state, params, fresh: bool):
    """``update_fn(updates, state, params)``, in place when allowed and supported."""
    if fresh and getattr(update_fn, "_fzero_inplace", False):
        return update_fn(updates, state, params, _inplace=True)
    return update_fn(updates, state, params)


def _new_count() -> torch.Tensor:
    """A 0-dim int64 CPU counter; schedules read it with ``int(count)`` without a device sync."""
    return torch.zeros((), dtype=torch.int64)


def _increment(count: torch.Tensor) -> torch.Tensor:
    return count + 1


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

    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, *, _inplace=False):
        del params
        return updates, state

    return GradientTransformation(init_fn, _mark(update_fn, inplace=True, fresh=lambda f: f))


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` one after the other; the state is the tuple of their states.

    Args:
        *transforms: :class:`GradientTransformation` values, applied left to right.

    Returns:
        A :class:`GradientTransformation` whose state is a tuple with one entry per transform
        (key paths read ``[1].mu['w']``), and whose ``fused`` is ``None`` (see
        :func:`fused_spec_of`).

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

    def update_fn(updates, state, params=None, *, _inplace=False):
        if not isinstance(state, tuple) or len(state) != len(txs):
            raise ValueError(
                f"fzero.optim.chain: the state must be the tuple of {len(txs)} states that init "
                f"returned, got {_type_name(state)}"
                + (f" of length {len(state)}" if isinstance(state, tuple) else "")
            )
        new_states = []
        fresh = _inplace
        for t, s in zip(txs, state):
            updates, s = _call(t.update, updates, s, params, fresh)
            fresh = _fresh_after(t.update, fresh)
            new_states.append(s)
        return updates, tuple(new_states)

    def fresh_fn(fresh: bool) -> bool:
        for t in txs:
            fresh = _fresh_after(t.update, fresh)
        return fresh

    # Remembered so fused_spec_of can recognise clip-then-alias chains.
    update_fn._fzero_chain = txs  # type: ignore[attr-defined]
    return GradientTransformation(init_fn, _mark(update_fn, inplace=True, fresh=fresh_fn))


def fused_spec_of(tx: GradientTransformation) -> FusedSpec | None:
    """The :class:`FusedSpec` of ``tx`` when a fused kernel can compute it, else ``None``.

    That is the case for an alias (``adam``, ``adamw``, ``sgd``, ``lamb``, ``lion``) and for
    ``chain(clip_by_global_norm(c), alias)``, whose spec gets ``clip_norm=c``. Anything else
    (other chains, masks around an alias, ...) returns ``None`` and runs unfused.

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
        raise TypeError(f"fzero.optim.fused_spec_of: expected a GradientTransformation, got {_type_name(tx)}")
    if tx.fused is not None:
        return tx.fused
    members = getattr(tx.update, "_fzero_chain", None)
    if not members:
        return None
    *before, last = members
    spec = fused_spec_of(last)
    if spec is None:
        return None
    clip = None
    for m in before:
        c = getattr(m.update, "_fzero_clip_norm", None)
        if c is None or clip is not None or spec.clip_norm is not None:
            return None
        clip = c
    return spec if clip is None else dataclasses.replace(spec, clip_norm=clip)


# --------------------------------------------------------------------------- apply


def apply_updates(params: Params, updates: Updates) -> Params:
    """``params + updates``, leafwise, as new tensors in each parameter's dtype.

    Pure: ``params`` and ``updates`` are left untouched. Where an update's dtype differs from
    its parameter's, the sum is formed in the promoted dtype and rounded once to the
    parameter's dtype (as optax's ``apply_updates`` and torch's in-place ``p.add_(u)`` do), so
    a bf16 parameter takes an fp32 update with a single rounding.

    Args:
        params: a pytree of tensors.
        updates: a pytree of tensors with the structure of ``params``.

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
        if all(p.dtype == u.dtype for p, u in zip(p_leaves, u_leaves)):
            return tree.unflatten(spec, torch._foreach_add(p_leaves, u_leaves))
        out = []
        for p, u in zip(p_leaves, u_leaves):
            # out= in the parameter's dtype: computed in the promoted dtype, rounded once.
            out.append(p + u if p.dtype == u.dtype else torch.add(p, u, out=torch.empty_like(p)))
        return tree.unflatten(spec, out)
