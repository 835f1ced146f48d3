"""Gradient transformations: the small pieces the optimizers are chained from.

Each is a state NamedTuple plus a factory returning a :class:`GradientTransformation`, in
optax's shape. The per-leaf math runs as ``torch._foreach_*`` ops over the flattened leaf
lists (one multi-tensor kernel per op on GPU, not a Python loop of small ops), out of place:
the incoming updates, state and params are never written to. Each factory records what it
built (:mod:`fzero.optim._known`); from that record the lowering may pass the keyword-only
``inplace=True`` (overwrite the incoming updates: tensors the previous member just made,
which nothing else references) or ``donate=True`` (write the new moments into the old ones),
which compute the same bits. The math runs under ``torch.no_grad()``; differentiating through
an update is not supported.

Counters (``count``) are 0-dim int64 CPU tensors so a schedule reads ``int(count)`` without
a device sync; moments have their parameters' dtype and device.

The factories an optimizer is built from take a keyword-only ``where``: the public name their
errors start with, so that ``adamw``'s errors, raised by its members, name ``adamw``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from fzero import tree
from fzero._params import Params as FrozenParams
from fzero._params import like_params
from fzero.optim import _known
from fzero.optim._known import record
from fzero.optim._checks import check_lr, check_nonneg, check_number, check_unit, type_name
from fzero.optim.base import (
    GradientTransformation,
    Params,
    ScalarOrSchedule,
    Updates,
    _flatten_like,
    _increment,
    _multiply,
    _new_count,
    init_empty_state,
)
from fzero.optim.clipping import leaf_norms

__all__ = [
    "MaskedState",
    "ScaleByAdamState",
    "ScaleByLionState",
    "ScaleByScheduleState",
    "TraceState",
    "add_decayed_weights",
    "masked",
    "scale",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_schedule",
    "scale_by_trust_ratio",
    "trace",
]


# --------------------------------------------------------------------------- helpers


def _zeros_like(params: Params) -> Params:
    """Zeros like each leaf. Leaves that lie back to back in one storage (ZeRO's pieces of a
    flat group) get views of one zero buffer laid out as they are, so the fused path
    (``fzero.optim.fused``) updates a flat group's parameters and moments in one launch."""
    leaves, spec = tree.flatten(params)
    out = [None] * len(leaves)
    shared: dict[tuple, list[int]] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor) and x.numel() and x.is_contiguous() and x.device.type != "meta":
            shared.setdefault((x.untyped_storage().data_ptr(), x.dtype, x.device), []).append(i)
    for idx in shared.values():
        idx.sort(key=lambda i: leaves[i].storage_offset())
        start = leaves[idx[0]].storage_offset()
        end = leaves[idx[-1]].storage_offset() + leaves[idx[-1]].numel()
        if len(idx) < 2 or end - start != sum(leaves[i].numel() for i in idx):
            continue  # alone, or with gaps or overlaps between them: zeros of their own
        buf = torch.zeros(end - start, dtype=leaves[idx[0]].dtype, device=leaves[idx[0]].device)
        for i in idx:
            a = leaves[i].storage_offset() - start
            out[i] = buf[a:a + leaves[i].numel()].view(leaves[i].shape)
    return tree.unflatten(spec, [torch.zeros_like(x) if o is None else o for x, o in zip(leaves, out)])


def _cast_to(xs: list[torch.Tensor], refs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``xs`` in the dtypes of ``refs`` (a no-op list when they already agree)."""
    if all(x.dtype == r.dtype for x, r in zip(xs, refs)):
        return xs
    return [x.to(r.dtype) for x, r in zip(xs, refs)]


def _state_leaves(where: str, state_tree: Params, updates: Updates, what: str) -> tuple[list, list, Any]:
    """``(update leaves in the state's dtypes, state leaves, spec)``; the structures must match."""
    s_leaves, spec = tree.flatten(state_tree)
    u_leaves = _flatten_like(where, spec, state_tree, updates, (f"the optimizer state's {what}", "updates"))
    return _cast_to(u_leaves, s_leaves), s_leaves, spec


def _adam_moments(mu: list, nu: list, g: list, b1: float, b2: float) -> tuple[list, list]:
    """Adam's moments, new lists: ``mu = b1 * mu + (1 - b1) * g``, ``nu = b2 * nu + (1 - b2) * g^2``
    (``scale_by_adam``'s arithmetic, bit for bit)."""
    mu = torch._foreach_lerp(mu, g, 1.0 - b1)
    nu = torch._foreach_mul(nu, b2)
    torch._foreach_addcmul_(nu, g, g, value=1.0 - b2)
    return mu, nu


def _moment_leaves(where: str, state: Any, updates: Updates) -> tuple[list, list, Any, torch.Tensor]:
    """``(update leaves, leaves of state.mu, spec, the next count)`` for Adam and Lion."""
    g, mu, spec = _state_leaves(where, state.mu, updates, "mu")
    return g, mu, spec, _increment(state.count)


def _need_params(where: str, params: Params | None) -> None:
    if params is None:
        raise ValueError(f"{where}: needs the parameters; call update(updates, state, params)")


def _schedule_value(where: str, fn: Callable[[int], Any], count: int) -> float:
    value = fn(count)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"{where}: the schedule must return a float, got {type_name(value)} {value!r} at count {count}"
        ) from None


# --------------------------------------------------------------------------- scale


def scale(step_size: float) -> GradientTransformation:
    """Multiply every update by the constant ``step_size``.

    Args:
        step_size: a number.

    Returns:
        A stateless :class:`GradientTransformation`.

    Raises:
        TypeError: ``step_size`` is not a number.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> tx = optim.scale(-2.0)
        >>> tx.update([torch.ones(2)], tx.init([torch.ones(2)]))[0]
        [tensor([-2., -2.])]
    """
    step_size = check_number("fzero.optim.scale", "step_size", step_size)

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        return _multiply(updates, step_size, inplace), state

    return record(GradientTransformation(init_empty_state, update_fn), _known.Scale(step_size))


class ScaleByScheduleState(NamedTuple):
    """The number of updates made so far (0-dim int64 CPU tensor)."""

    count: torch.Tensor


def scale_by_schedule(step_size_fn: Callable[[int], float]) -> GradientTransformation:
    """Multiply the updates by ``step_size_fn(count)``, ``count`` the 0-based update index.

    Args:
        step_size_fn: a function ``int -> float``.

    Returns:
        A :class:`GradientTransformation` with state :class:`ScaleByScheduleState`.

    Raises:
        TypeError: ``step_size_fn`` is not callable; at update time, it returned no number.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> tx = optim.scale_by_schedule(lambda count: 10.0 ** -count)
        >>> s = tx.init([torch.ones(1)])
        >>> u, s = tx.update([torch.ones(1)], s)
        >>> u, s = tx.update([torch.ones(1)], s)
        >>> u, int(s.count)
        ([tensor([0.1000])], 2)
    """
    where = "fzero.optim.scale_by_schedule"
    if not callable(step_size_fn):
        raise TypeError(
            f"{where}: step_size_fn must be callable as fn(count: int) -> float, got {type_name(step_size_fn)}"
        )

    def init_fn(params):
        del params
        return ScaleByScheduleState(count=_new_count())

    def update_fn(updates, state, params=None, *, inplace=False):
        del params
        step_size = _schedule_value(where, step_size_fn, int(state.count))
        return _multiply(updates, step_size, inplace), ScaleByScheduleState(count=_increment(state.count))

    return record(GradientTransformation(init_fn, update_fn), _known.ScaleBySchedule(step_size_fn))


def scale_by_learning_rate(
    learning_rate: ScalarOrSchedule, *, flip_sign: bool = True, where: str = "fzero.optim.scale_by_learning_rate"
) -> GradientTransformation:
    """Multiply the updates by ``-learning_rate`` (gradient descent), or by ``+`` with
    ``flip_sign=False``.

    Args:
        learning_rate: a float, or a schedule ``fn(count: int) -> float`` where ``count`` is
            the 0-based index of the update.
        flip_sign: negate the learning rate (the default: updates are added to parameters).
        where: the name errors start with (an optimizer built on this passes its own).

    Returns:
        A stateless :class:`GradientTransformation` for a float; one with state
        :class:`ScaleByScheduleState` for a schedule.

    Raises:
        TypeError: ``learning_rate`` is neither a number nor callable.
        ValueError: ``learning_rate`` is negative.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> tx = optim.scale_by_learning_rate(0.5)
        >>> tx.update([torch.ones(1)], tx.init([torch.ones(1)]))[0]
        [tensor([-0.5000])]
    """
    lr = check_lr(where, learning_rate)
    sign = -1.0 if flip_sign else 1.0
    if callable(lr):
        tx = scale_by_schedule(lambda count: sign * _schedule_value(where, lr, count))
    else:
        tx = scale(sign * lr)
    return record(tx, _known.ScaleByLearningRate(lr, flip_sign))  # what it is, more precisely


# --------------------------------------------------------------------------- adam


class ScaleByAdamState(NamedTuple):
    """Adam's state: the update count, first moments ``mu`` and second moments ``nu``."""

    count: torch.Tensor
    mu: Updates
    nu: Updates


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    *,
    bias_correction: bool = True,
    where: str = "fzero.optim.scale_by_adam",
) -> GradientTransformation:
    """Rescale updates by Adam's bias-corrected moments.

    With ``t`` the 1-based update index and ``g`` the incoming update::

        mu = b1 * mu + (1 - b1) * g
        nu = b2 * nu + (1 - b2) * g^2
        out = (mu / (1 - b1^t)) / (sqrt(nu) / sqrt(1 - b2^t) + eps)

    (with ``eps_root > 0``, optax's ``sqrt(nu / (1 - b2^t) + eps_root)`` in the denominator).
    With ``bias_correction=False`` both corrections are 1: ``out = mu / (sqrt(nu) + eps)``,
    DeepSpeed's ``FusedAdam(bias_correction=False)``.

    Args:
        b1: decay rate of the first moment, in [0, 1).
        b2: decay rate of the second moment, in [0, 1).
        eps: added to the denominator outside the square root, >= 0.
        eps_root: added inside the square root, >= 0.
        bias_correction: divide the moments by ``1 - b^t`` (Adam's default); ``False`` uses
            them as they are.
        where: the name errors start with (an optimizer built on this passes its own).

    Returns:
        A :class:`GradientTransformation` with state :class:`ScaleByAdamState`.

    Raises:
        ValueError: a rate outside [0, 1) or a negative ``eps``/``eps_root``.
        TypeError: an argument is not a number.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> tx = optim.scale_by_adam()
        >>> u, s = tx.update([torch.tensor([2.0, -3.0])], tx.init([torch.zeros(2)]))
        >>> u[0].round(decimals=4), int(s.count)
        (tensor([ 1., -1.]), 1)
    """
    b1, b2 = check_unit(where, "b1", b1), check_unit(where, "b2", b2)
    eps, eps_root = check_nonneg(where, "eps", eps), check_nonneg(where, "eps_root", eps_root)
    if not isinstance(bias_correction, bool):
        raise TypeError(f"{where}: bias_correction must be a bool, got {bias_correction!r}")

    def init_fn(params):
        return ScaleByAdamState(count=_new_count(), mu=_zeros_like(params), nu=_zeros_like(params))

    def update_fn(updates, state, params=None, *, donate=False):
        del params
        g, mu, spec, count = _moment_leaves(where, state, updates)
        if not g:
            return updates, state._replace(count=count)
        nu = tree.leaves(state.nu)
        step = int(count)
        # torch.optim.Adam's math: moments, bias corrections as Python floats, then
        # mu / (1 - b1^t) / (sqrt(nu) / sqrt(1 - b2^t) + eps). The 1 / (1 - b1^t) is folded
        # into the denominator (as torch's capturable path does) to save a pass.
        bc1 = 1.0 - b1**step if bias_correction else 1.0
        bc2 = 1.0 - b2**step if bias_correction else 1.0
        with torch.no_grad():
            if donate:  # the moments are updated where they are (the same arithmetic)
                torch._foreach_lerp_(mu, g, 1.0 - b1)
                torch._foreach_mul_(nu, b2)
            else:
                mu = torch._foreach_lerp(mu, g, 1.0 - b1)
                nu = torch._foreach_mul(nu, b2)
            torch._foreach_addcmul_(nu, g, g, value=1.0 - b2)
            if eps_root == 0.0:
                denom = torch._foreach_sqrt(nu)
                torch._foreach_mul_(denom, bc1 / bc2**0.5)
            else:  # optax: sqrt(nu / (1 - b2^t) + eps_root)
                denom = torch._foreach_div(nu, bc2)
                torch._foreach_add_(denom, eps_root)
                torch._foreach_sqrt_(denom)
                torch._foreach_mul_(denom, bc1)
            torch._foreach_add_(denom, eps * bc1)
            if denom[0].device.type == "cpu":
                # On CPU a fresh parameter-sized tensor costs page faults: divide into denom.
                out = [torch.div(m, d, out=d) for m, d in zip(mu, denom)]
            else:
                out = torch._foreach_div(mu, denom)
        return tree.unflatten(spec, out), ScaleByAdamState(
            count=count, mu=tree.unflatten(spec, mu), nu=tree.unflatten(spec, nu)
        )

    return record(GradientTransformation(init_fn, update_fn), _known.ScaleByAdam(b1, b2, eps, eps_root,
                                                                                         bias_correction))


# --------------------------------------------------------------------------- lion


class ScaleByLionState(NamedTuple):
    """Lion's state: the update count and the momentum ``mu``."""

    count: torch.Tensor
    mu: Updates


def scale_by_lion(b1: float = 0.9, b2: float = 0.99, *, where: str = "fzero.optim.scale_by_lion") -> GradientTransformation:
    """Rescale updates by Lion's sign of interpolated momentum (Chen et al., 2023)::

        out = sign(b1 * mu + (1 - b1) * g)
        mu = b2 * mu + (1 - b2) * g

    Args:
        b1: interpolation rate of the momentum and the current update, in [0, 1].
        b2: decay rate of the momentum, in [0, 1].
        where: the name errors start with (an optimizer built on this passes its own).

    Returns:
        A :class:`GradientTransformation` with state :class:`ScaleByLionState`.

    Raises:
        ValueError: a rate outside [0, 1].
        TypeError: an argument is not a number.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> tx = optim.scale_by_lion()
        >>> tx.update([torch.tensor([0.3, -2.0, 0.0])], tx.init([torch.zeros(3)]))[0]
        [tensor([ 1., -1.,  0.])]
    """
    b1, b2 = check_unit(where, "b1", b1, closed=True), check_unit(where, "b2", b2, closed=True)

    def init_fn(params):
        return ScaleByLionState(count=_new_count(), mu=_zeros_like(params))

    def update_fn(updates, state, params=None, *, donate=False):
        del params
        g, mu, spec, count = _moment_leaves(where, state, updates)
        if not g:
            return updates, state._replace(count=count)
        with torch.no_grad():
            out = torch._foreach_lerp(mu, g, 1.0 - b1)  # b1 * mu + (1 - b1) * g
            torch._foreach_sign_(out)
            if donate:
                torch._foreach_lerp_(mu, g, 1.0 - b2)
                new_mu = mu
            else:
                new_mu = torch._foreach_lerp(mu, g, 1.0 - b2)
        return tree.unflatten(spec, out), ScaleByLionState(count=count, mu=tree.unflatten(spec, new_mu))

    return record(GradientTransformation(init_fn, update_fn), _known.ScaleByLion(b1, b2))


# --------------------------------------------------------------------------- trust ratio


def scale_by_trust_ratio(
    min_norm: float = 0.0,
    trust_coefficient: float = 1.0,
    eps: float = 0.0,
    *,
    where: str = "fzero.optim.scale_by_trust_ratio",
) -> GradientTransformation:
    """Scale each leaf's update by its trust ratio ``||param|| / ||update||`` (LARS / LAMB)::

        ratio = trust_coefficient * max(||p||, min_norm) / (max(||u||, min_norm) + eps)
        out = u * (ratio if ||p|| != 0 and ||u|| != 0 else 1)

    The norms are per leaf, by :func:`~fzero.optim.leaf_norms`, so the ratio is exact when a
    leaf is a shard of a larger tensor.

    Args:
        min_norm: lower bound of both norms, >= 0.
        trust_coefficient: a multiplier of the ratio.
        eps: added to the update norm in the denominator, >= 0.
        where: the name errors start with (an optimizer built on this passes its own).

    Returns:
        A stateless :class:`GradientTransformation`; ``update`` needs ``params``.

    Raises:
        ValueError: a negative ``min_norm`` or ``eps``; at update time, no ``params``.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> tx = optim.scale_by_trust_ratio()
        >>> p = [torch.tensor([3.0, 4.0])]
        >>> tx.update([torch.tensor([0.0, 0.5])], tx.init(p), p)[0]
        [tensor([0., 5.])]
    """
    min_norm = check_nonneg(where, "min_norm", min_norm)
    trust_coefficient = check_number(where, "trust_coefficient", trust_coefficient)
    eps = check_nonneg(where, "eps", eps)

    def update_fn(updates, state, params=None, *, inplace=False):
        _need_params(where, params)
        spec = tree.structure(params)
        u = _flatten_like(where, spec, params, updates, ("params", "updates"))
        if not u:
            return updates, state
        with torch.no_grad():
            # the trees, not their leaves: leaf_norms names each leaf by parameter (tensor_parallel
            # sums a split one over tp and counts a whole one once)
            p_norm, u_norm = leaf_norms(params, updates, device=u[0].device)
            # optax's safe_norm(x, min_norm) is max(norm, min_norm); the ratio falls back to 1
            # where either norm is zero, so zero params or updates are never rescaled.
            p_norm = p_norm.clamp_min(min_norm)
            u_norm = u_norm.clamp_min(min_norm)
            ratio = trust_coefficient * p_norm / (u_norm + eps)
            ratio = torch.where((p_norm == 0) | (u_norm == 0), torch.ones_like(ratio), ratio)
            ratios = [r.to(x.device) for r, x in zip(ratio.unbind(0), u)]
        return _multiply(updates, ratios, inplace), state

    return record(GradientTransformation(init_empty_state, update_fn),
                  _known.ScaleByTrustRatio(min_norm, trust_coefficient, eps))


# --------------------------------------------------------------------------- masks


class MaskedState(NamedTuple):
    """The state of the inner transformation, built on the masked-in leaves only."""

    inner_state: Any


def _is_piece(x: Any) -> bool:
    """A partitioned leaf (ZeRO's ``Shard``): a node whose leaf is this rank's piece."""
    return hasattr(x, "__fzero_meta__")


def _whole(params: Params) -> Params:
    """``params`` with each partitioned leaf replaced by a meta tensor of the whole leaf.

    Under ZeRO stages 1-3 the optimizer sees each rank's 1-D pieces; a callable mask written
    for whole parameters (optax's ``lambda p: tree.map(lambda x: x.ndim > 1, p)``) would
    then decide on the pieces' shapes, differently on every stage. It gets the whole leaves'
    shape, dtype and key path instead (values it must not read: a meta tensor has none).
    """
    if not any(_is_piece(x) for x in tree.leaves(params, is_leaf=_is_piece)):
        return params
    return tree.map(lambda x: x.__fzero_meta__() if _is_piece(x) else x, params, is_leaf=_is_piece)


def _by_name(where: str, m: dict, params: FrozenParams) -> FrozenParams:
    """A mask keyed by parameter name (a plain dict) on ``params``, whose frozen entries are
    ``None``: a frozen name's flag is ignored (it is never updated), every trainable name
    must have one, and no other name may."""
    trainable = [k for k in params if k not in params.frozen]
    missing = [k for k in trainable if k not in m]
    unknown = [k for k in m if k not in params]
    if missing or unknown:
        said = ([f"no flag for the trainable parameters {missing}"] if missing else []) + \
               ([f"flags for {unknown}, which are not parameters"] if unknown else [])
        raise tree.StructureError(f"{where}: mask does not have the structure of params: it has "
                                  + " and ".join(said) + f" (frozen, so never decayed: {sorted(params.frozen)})")
    return like_params(params, {k: None if k in params.frozen else m[k] for k in params})  # frozen, layout kept


# The flags of a mask that is a pytree (or dict) of bools, by mask and parameters' structure:
# the same at every update (a mask is the optimizer's, fixed when it was made, as optax's), and
# resolving it walks both trees in Python. A callable mask is called every time.
_MASK_FLAGS = tree.SpecCache(kept=64)


def _resolve_mask(where: str, mask: Any, params: Params, spec: Any = None) -> tuple[bool, ...]:
    """One bool per leaf of ``params`` (:func:`_mask_flags`); for a mask that is not a
    callable, worked out once per structure of ``params`` (``spec``, when the caller has it)."""
    if callable(mask):
        return _mask_flags(where, mask, params)
    key = (id(mask), spec if spec is not None else tree.structure(params))
    kept, flags = _MASK_FLAGS.get(key, lambda: (mask, _mask_flags(where, mask, params)))
    if kept is not mask:  # another mask at the address of one that is gone
        kept, flags = _MASK_FLAGS.values[key] = (mask, _mask_flags(where, mask, params))
    return flags


def _mask_flags(where: str, mask: Any, params: Params) -> tuple[bool, ...]:
    """One bool per leaf of ``params``, from a pytree of bools or a callable returning one.

    With frozen parameters (a :class:`fzero.Params`, ``None`` at the frozen names, as the
    optimizer sees it) a callable is given the trainable entries only, as a plain dict, so
    that ``lambda p: {k: v.ndim > 1 for k, v in p.items()}`` never meets a ``None``; a mask
    keyed by name (given, or returned) may name the frozen parameters too."""
    frozen = isinstance(params, FrozenParams) and bool(params.frozen)
    # The callable's result has the whole parameters' structure: a prefix of the
    # partitioned tree's (one bool per Shard node), broadcast onto its pieces below.
    if callable(mask):
        whole = _whole(params)
        m = mask({k: v for k, v in whole.items() if k not in params.frozen} if frozen else whole)
    else:
        m = mask
    if isinstance(params, FrozenParams) and type(m) is dict:  # frozen names, or a tp layout, on the container
        m = _by_name(where, m, params)
    if tree.structure(m) != tree.structure(params):
        # A mask may be a prefix of the params' tree (as in JAX): one bool for a whole
        # subtree -- e.g. for each leaf that ZeRO has wrapped as a shard of this rank.
        try:
            m = optree.tree_broadcast_prefix(m, params, namespace=tree.NAMESPACE)
        except ValueError:
            tree.assert_same_structure(params, m, what=where, names=("params", "mask"))
    m_paths, m_leaves, m_spec = tree.flatten_with_path(m)
    if m_spec != tree.structure(params):
        tree.assert_same_structure(params, m, what=where, names=("params", "mask"))
    flags = []
    for path, leaf in zip(m_paths, m_leaves):
        if not isinstance(leaf, bool):
            if isinstance(leaf, torch.Tensor) and leaf.dtype == torch.bool and leaf.dim() == 0 and leaf.device.type == "cpu":
                leaf = bool(leaf)
            elif type(leaf).__name__ == "bool_":  # numpy.bool_
                leaf = bool(leaf)
            else:
                raise TypeError(
                    f"{where}: mask leaves must be bools (True: apply, False: pass through), "
                    f"got {type_name(leaf)} at {tree.keystr(path) or '<root>'}"
                )
        flags.append(leaf)
    return tuple(flags)


def _select(spec, leaves: list, flags: list[bool]) -> Any:
    """The tree with masked-out leaves replaced by ``None`` (an empty subtree)."""
    return tree.unflatten(spec, [x if f else None for x, f in zip(leaves, flags)])


def masked(inner: GradientTransformation, mask: Any, *, where: str = "fzero.optim.masked") -> GradientTransformation:
    """Apply ``inner`` to the masked-in leaves only; the others pass through unchanged.

    ``inner`` sees (and keeps state for) a tree in which masked-out leaves are ``None``.

    Args:
        inner: the transformation to apply.
        mask: a pytree of bools with the structure of the params (``True``: apply ``inner``),
            or a callable ``params -> such a pytree``. Its structure can only be checked against
            the params, at init/update time.
        where: the name errors start with (an optimizer built on this passes its own).

    Returns:
        A :class:`GradientTransformation` with state :class:`MaskedState`.

    Raises:
        fzero.tree.StructureError: (at init/update) the mask's structure is not the params';
            the message names the key paths.
        TypeError: a mask leaf is not a bool; ``inner`` is not a transformation.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> tx = optim.masked(optim.scale(0.0), {"w": True, "b": False})
        >>> p = {"w": torch.ones(1), "b": torch.ones(1)}
        >>> tx.update(p, tx.init(p), p)[0]
        {'w': tensor([0.]), 'b': tensor([1.])}
    """
    if not isinstance(inner, GradientTransformation):
        raise TypeError(f"{where}: inner must be a GradientTransformation, got {type_name(inner)}")

    def init_fn(params):
        flags = _resolve_mask(where, mask, params)
        leaves, spec = tree.flatten(params)
        return MaskedState(inner_state=inner.init(_select(spec, leaves, flags)))

    def update_fn(updates, state, params=None, *, inplace=False, donate=False):
        flags = _resolve_mask(where, mask, params if params is not None else updates)
        u_leaves, spec = tree.flatten(updates)
        if len(u_leaves) != len(flags) or (params is not None and spec != tree.structure(params)):
            tree.assert_same_structure(params if params is not None else mask, updates, what=where,
                                       names=("params", "updates"))
        sub_params = None if params is None else _select(spec, tree.leaves(params), flags)
        sub = _select(spec, u_leaves, flags)
        new_sub, inner_state = _known.update(inner, sub, state.inner_state, sub_params, new=inplace, donate=donate)
        it = iter(tree.leaves(new_sub))
        out = [next(it) if f else u for u, f in zip(u_leaves, flags)]
        return tree.unflatten(spec, out), MaskedState(inner_state=inner_state)

    return record(GradientTransformation(init_fn, update_fn), _known.Masked(inner, mask))


# --------------------------------------------------------------------------- weight decay


def add_decayed_weights(
    weight_decay: float = 0.0, mask: Any = None, *, where: str = "fzero.optim.add_decayed_weights"
) -> GradientTransformation:
    """Add ``weight_decay * param`` to each update.

    Args:
        weight_decay: the coefficient, >= 0.
        mask: ``None`` (all leaves), a pytree of bools with the params' structure, or a
            callable ``params -> such a pytree``; masked-out leaves pass through unchanged.
        where: the name errors start with (an optimizer built on this passes its own).

    Returns:
        A :class:`GradientTransformation` (state :class:`EmptyState`, or :class:`MaskedState`
        with a mask); ``update`` needs ``params``.

    Raises:
        ValueError: a negative ``weight_decay``; at update time, no ``params``, or a mask or
            updates whose structure is not the params' (naming the key paths).
        TypeError: ``weight_decay`` is not a number; a mask leaf is not a bool.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> tx = optim.add_decayed_weights(0.1, mask={"w": True, "b": False})
        >>> p = {"w": torch.ones(1), "b": torch.ones(1)}
        >>> tx.update({"w": torch.zeros(1), "b": torch.zeros(1)}, tx.init(p), p)[0]
        {'w': tensor([0.1000]), 'b': tensor([0.])}
    """
    weight_decay = check_nonneg(where, "weight_decay", weight_decay)

    def update_fn(updates, state, params=None, *, inplace=False):
        _need_params(where, params)
        p, spec = tree.flatten(params)
        u = _flatten_like(where, spec, params, updates, ("params", "updates"))
        if weight_decay == 0.0 or not u:
            return updates, state
        with torch.no_grad():
            if inplace:
                torch._foreach_add_(u, p, alpha=weight_decay)
                return updates, state
            return tree.unflatten(spec, torch._foreach_add(u, p, alpha=weight_decay)), state

    tx = record(GradientTransformation(init_empty_state, update_fn), _known.AddDecayedWeights(weight_decay))
    return tx if mask is None else masked(tx, mask, where=where)


# --------------------------------------------------------------------------- momentum


class TraceState(NamedTuple):
    """The momentum buffer."""

    trace: Updates


def trace(decay: float, nesterov: bool = False, *, where: str = "fzero.optim.trace") -> GradientTransformation:
    """Momentum: ``trace = decay * trace + g``; the update is ``trace``, or
    ``g + decay * trace`` with ``nesterov`` (``torch.optim.SGD`` with dampening 0).

    Args:
        decay: the momentum coefficient, in [0, 1].
        nesterov: use Nesterov momentum.
        where: the name errors start with (an optimizer built on this passes its own).

    Returns:
        A :class:`GradientTransformation` with state :class:`TraceState`.

    Raises:
        ValueError: ``decay`` outside [0, 1].
        TypeError: ``decay`` is not a number.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> tx = optim.trace(0.5)
        >>> s = tx.init([torch.zeros(1)])
        >>> u, s = tx.update([torch.ones(1)], s)
        >>> tx.update([torch.ones(1)], s)[0]
        [tensor([1.5000])]
    """
    decay, nesterov = check_unit(where, "decay", decay, closed=True), bool(nesterov)

    def init_fn(params):
        return TraceState(trace=_zeros_like(params))

    def update_fn(updates, state, params=None, *, donate=False):
        del params
        g, t, spec = _state_leaves(where, state.trace, updates, "trace")
        if not g:
            return updates, state
        with torch.no_grad():
            # torch.optim.SGD (dampening 0): buf = momentum * buf + g, in torch's two
            # roundings (mul, then add); the first buffer is g, as from a zero trace.
            if donate:
                torch._foreach_mul_(t, decay)
                new_t = t
            else:
                new_t = torch._foreach_mul(t, decay)
            torch._foreach_add_(new_t, g)
            out = torch._foreach_add(g, new_t, alpha=decay) if nesterov else new_t
        return tree.unflatten(spec, out), TraceState(trace=tree.unflatten(spec, new_t))

    return record(GradientTransformation(init_fn, update_fn), _known.Trace(decay, nesterov))

