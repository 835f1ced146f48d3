"""DeepSpeed's 1-bit family: optimizers whose momentum (0/1 Adam: gradient, or local steps'
sum), not their gradient, crosses the data-parallel ranks, compressed to one bit per element
after a warm-up. :func:`onebit_adam` (Tang et al., 2021, <https://arxiv.org/abs/2102.02888>),
:func:`zero_one_adam` (Lu et al., 2022) and :func:`onebit_lamb` (Li et al., 2021) compute
what DeepSpeed's ``OnebitAdam``, ``ZeroOneAdam`` and ``OnebitLamb``
(``runtime/fp16/onebit/{adam,zoadam,lamb}.py``) compute; docs/optim.md says where they differ.

Such an optimizer does its own data-parallel exchange, and says so by a type
(:class:`DataParallelExchange`, from :func:`exchange_of`): ``shard_state`` asks before each
update whether the optimizer takes this rank's local gradients, and at ZeRO stage 0 then hands
them over unreduced; the optimizer averages its momentum through the ``compressed_pmean``
primitive (:func:`fzero.core.compressed_pmean`), which ``shard_state`` answers with the
compressed collectives of :mod:`fzero.distributed.compressed`. In a world of one each is its
uncompressed self (Adam or LAMB with the variance frozen after the warm-up).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import torch

from fzero import tree
from fzero.core import compressed_pmean
from fzero.optim import _known
from fzero.optim._checks import (check_adamw_args, check_coeff_bounds, check_int, check_lr, check_nonneg, check_unit,
                                 check_update_args)
from fzero.optim._known import record
from fzero.optim.base import GradientTransformation, ScalarOrSchedule, chain
from fzero.optim.transform import (ScaleByAdamState, _adam_moments, _moment_leaves, add_decayed_weights,
                                   scale_by_adam, scale_by_learning_rate)

__all__ = ["DataParallelExchange", "OnebitLambState", "ZeroOneAdamState", "exchange_of", "onebit_adam",
           "onebit_lamb", "scale_by_onebit_adam", "zero_one_adam"]


@dataclasses.dataclass(frozen=True)
class ScaleByOnebitAdam(_known.Known):
    """The record of :func:`scale_by_onebit_adam` (see :mod:`fzero.optim._known`)."""

    b1: float
    b2: float
    eps: float
    freeze_step: int
    where: str
    output = "new"


@dataclasses.dataclass(frozen=True)
class ZeroOneAdam(_known.Known):
    """The record of :func:`zero_one_adam`."""

    var_freeze_step: int
    where: str
    output = "new"


@dataclasses.dataclass(frozen=True)
class OnebitLamb(_known.Known):
    """The record of :func:`onebit_lamb`."""

    freeze_step: int
    where: str
    output = "new"


class DataParallelExchange(NamedTuple):
    """What an optimizer that exchanges across the data-parallel ranks itself declares for its
    next update.

    Attributes:
        optimizer: its public name (for errors: ``"fzero.optim.onebit_adam"``).
        local_gradients: the next update takes this rank's own gradients, unreduced (the
            optimizer averages what it needs itself); ``False`` during a warm-up that wants
            the averaged gradients.
        stages: the ZeRO stages it runs at (``(0,)``: DeepSpeed's 1-bit optimizers refuse
            ZeRO).
    """

    optimizer: str
    local_gradients: bool
    stages: tuple[int, ...] = (0,)


def exchange_of(tx: Any, opt_state: Any = None) -> DataParallelExchange | None:
    """The :class:`DataParallelExchange` of ``tx`` (found in nested chains) at ``opt_state``,
    or ``None`` for an optimizer that leaves the exchange to the transforms (every other one).
    Without ``opt_state``, ``local_gradients`` is ``False``.

    Example:
        >>> from fzero import optim
        >>> tx = optim.onebit_adam(1e-3, freeze_step=2)
        >>> state = tx.init({"w": torch.zeros(3)})
        >>> optim.exchange_of(tx, state), optim.exchange_of(optim.adam(1e-3)) is None
        (DataParallelExchange(optimizer='fzero.optim.onebit_adam', local_gradients=False, stages=(0,)), True)
    """
    what = _known.known(tx)
    if isinstance(what, _known.Chain):
        states = opt_state if isinstance(opt_state, tuple) else (None,) * len(what.transforms)
        for t, s in zip(what.transforms, states):
            if (found := exchange_of(t, s)) is not None:
                return found
        return None
    if isinstance(what, (ScaleByOnebitAdam, OnebitLamb)):
        local = opt_state is not None and int(opt_state.count) >= what.freeze_step
        return DataParallelExchange(what.where, local)
    if isinstance(what, ZeroOneAdam):
        local = opt_state is not None and (int(opt_state.count) > what.var_freeze_step
                                           or (int(opt_state.count) + 1) % int(opt_state.var_interval) != 0)
        return DataParallelExchange(what.where, local)
    return None


def scale_by_onebit_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *, freeze_step: int = 100000,
                         where: str = "fzero.optim.scale_by_onebit_adam") -> GradientTransformation:
    """1-bit Adam's direction, with DeepSpeed's arithmetic (no bias correction). With ``k`` the
    0-based index of the update::

        k <  freeze_step (warm-up; g averaged over the ranks, as for Adam):
            mu = b1 * mu + (1 - b1) * g ;  nu = b2 * nu + (1 - b2) * g^2
        k >= freeze_step (g this rank's own):
            mu = compressed_pmean(b1 * mu + (1 - b1) * g)      nu frozen
        out = mu / (sqrt(nu) + eps)

    The warm-up is ``scale_by_adam(b1, b2, eps, bias_correction=False)``, bit for bit.

    Args:
        b1, b2: the moment decay rates, in [0, 1).
        eps: added to the root, >= 0.
        freeze_step: the number of warm-up updates (DeepSpeed's ``freeze_step``), >= 0.
        where: the name errors start with.

    Returns:
        A :class:`GradientTransformation` with state :class:`~fzero.optim.ScaleByAdamState`.
    """
    b1, b2 = check_unit(where, "b1", b1), check_unit(where, "b2", b2)
    eps = check_nonneg(where, "eps", eps)
    check_int(where, "freeze_step", freeze_step)
    adam = scale_by_adam(b1, b2, eps, bias_correction=False, where=where)

    @torch.no_grad()
    def update_fn(updates, state, params=None):
        if int(state.count) < freeze_step:
            return adam.update(updates, state, params)
        g, mu, spec, count = _moment_leaves(where, state, updates)
        if not g:
            return updates, state._replace(count=count)
        mu = torch._foreach_lerp(mu, g, 1.0 - b1)  # scale_by_adam's arithmetic
        mu = [m.to(x.dtype) for m, x in zip(compressed_pmean(mu, where), mu)]
        denom = torch._foreach_sqrt(tree.leaves(state.nu))
        torch._foreach_add_(denom, eps)
        out = torch._foreach_div(mu, denom)
        return tree.unflatten(spec, out), ScaleByAdamState(count=count, mu=tree.unflatten(spec, mu), nu=state.nu)

    return record(GradientTransformation(adam.init, update_fn), ScaleByOnebitAdam(b1, b2, eps, freeze_step, where))


def onebit_adam(
    learning_rate: ScalarOrSchedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    freeze_step: int = 100000,
) -> GradientTransformation:
    """1-bit Adam, DeepSpeed's ``OnebitAdam`` (its defaults)::

        warm-up (the first freeze_step updates), on the averaged gradient:
            mu = b1 * mu + (1 - b1) * g ;  nu = b2 * nu + (1 - b2) * g^2
        then, on this rank's gradient, nu frozen:
            mu = compressed_pmean(b1 * mu + (1 - b1) * g)
        u = -lr * (mu / (sqrt(nu) + eps) + weight_decay * p)

    No bias correction (DeepSpeed's OnebitAdam accepts ``bias_correction`` and does not use
    it), decoupled weight decay scaled by the learning rate. The warm-up is
    ``adamw(learning_rate, b1, b2, eps, weight_decay, bias_correction=False)`` bit for bit.
    After it, gradients are not averaged: the momentum is, 1-bit compressed with error
    feedback (:mod:`fzero.distributed.compressed`), about 1/32 of the bytes. ZeRO stage 0 only.

    Args:
        learning_rate: a float or a schedule ``fn(count) -> float``.
        b1, b2: DeepSpeed's ``betas``, in [0, 1).
        eps: added to the root, >= 0.
        weight_decay: decoupled decay, >= 0.
        freeze_step: the number of uncompressed warm-up updates.

    Returns:
        ``chain(scale_by_onebit_adam(b1, b2, eps, freeze_step=freeze_step),
        add_decayed_weights(weight_decay), scale_by_learning_rate(learning_rate))``.

    Raises:
        TypeError, ValueError: an argument out of range, named.

    Example:
        >>> from fzero import optim
        >>> tx = optim.onebit_adam(0.1, freeze_step=1)
        >>> params = {"w": torch.zeros(2)}
        >>> updates, state = tx.update({"w": torch.tensor([1.0, -1.0])}, tx.init(params), params)
        >>> optim.apply_updates(params, updates)["w"]     # mu / sqrt(nu) = sqrt(10) * sign(g)
        tensor([-0.3162,  0.3162])
    """
    where = "fzero.optim.onebit_adam"
    lr = check_lr(where, learning_rate)
    wd = check_nonneg(where, "weight_decay", weight_decay)
    return chain(scale_by_onebit_adam(b1, b2, eps, freeze_step=freeze_step, where=where),
                 add_decayed_weights(wd, where=where), scale_by_learning_rate(lr, where=where))


# --------------------------------------------------------------------------- 0/1 Adam


class ZeroOneAdamState(NamedTuple):
    """0/1 Adam's state: the update count, the moments, and the schedules of the variance
    updates and of the local steps (0-dim CPU tensors), with what the local steps since the
    last synchronisation added up to (``buffer``, per rank, and ``lrs``, their learning rates'
    sum)."""

    count: torch.Tensor
    mu: Any
    nu: Any
    buffer: Any
    lrs: torch.Tensor
    var_interval: torch.Tensor
    var_counter: torch.Tensor
    local_step_interval: torch.Tensor
    local_step_counter: torch.Tensor


def _scalar(value, dtype=torch.int64) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype)


def _zeros(params) -> Any:
    return tree.map(torch.zeros_like, params)


def _lr_at(lr_of, count: int) -> float:
    """The learning rate of the update with 0-based index ``count``."""
    return float(lr_of(count)) if callable(lr_of) else lr_of


def zero_one_adam(
    learning_rate: ScalarOrSchedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    var_freeze_step: int = 100000,
    var_update_scaler: int = 16,
    local_step_scaler: int = 32678,
    local_step_clipper: int = 16,
) -> GradientTransformation:
    """0/1 Adam, DeepSpeed's ``ZeroOneAdam`` (Lu et al., 2022, <https://arxiv.org/abs/2202.06009>),
    with its defaults. With ``t`` the 1-based index of the update, ``d = mu / (sqrt(nu) + eps)``
    and ``u = -lr * (d + weight_decay * p)``:

    * ``t <= var_freeze_step + 1`` (variance phase). The variance is updated at the steps of an
      exponential schedule only: ``var_interval`` starts at 1 and doubles after every
      ``var_update_scaler`` updates of the variance. At a step with ``t % var_interval == 0``
      the gradient is averaged over the ranks and ``mu``, ``nu`` are Adam's (without bias
      correction); at any other the gradient is this rank's, averaged 1-bit compressed
      (``compressed_pmean``), and only ``mu`` moves. Then ``p += u``.
    * after it (``t > var_freeze_step + 1``), local steps: on this rank's gradient,
      ``mu = b1 mu + (1 - b1) g``, ``p += u``, ``buffer += u``, ``lrs += lr``. Every
      ``local_step_interval`` updates (1 at first, doubled after every ``local_step_scaler``
      updates, at most ``local_step_clipper``) the ranks synchronise: ``p -= buffer``,
      ``buffer = compressed_pmean(buffer * (sqrt(nu) + eps))``, ``mu = -buffer / lrs``,
      ``p += buffer / (sqrt(nu) + eps)``, ``buffer = 0``, ``lrs = 0``. Between
      synchronisations each rank's parameters and ``mu`` are its own.

    The first ``var_update_scaler`` updates are ``adamw(..., bias_correction=False)`` bit for bit.

    Args:
        learning_rate: a float or a schedule ``fn(count) -> float``.
        b1, b2: DeepSpeed's ``betas``, in [0, 1).
        eps: added to the root, >= 0.
        weight_decay: decoupled decay, >= 0.
        var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper: DeepSpeed's
            names and meanings (ints; the scalers and the clipper >= 1).

    Returns:
        A :class:`GradientTransformation` with state :class:`ZeroOneAdamState`; ``update``
        needs ``params``.

    Example:
        >>> from fzero import optim
        >>> tx = optim.zero_one_adam(0.1, var_freeze_step=10)
        >>> params = {"w": torch.zeros(2)}
        >>> updates, state = tx.update({"w": torch.tensor([1.0, -1.0])}, tx.init(params), params)
        >>> optim.apply_updates(params, updates)["w"], int(state.var_interval)
        (tensor([-0.3162,  0.3162]), 1)
    """
    where = "fzero.optim.zero_one_adam"
    lr_of, b1, b2, eps, wd = check_adamw_args(where, learning_rate, b1, b2, eps, weight_decay)
    for name, value, low in (("var_freeze_step", var_freeze_step, 0), ("var_update_scaler", var_update_scaler, 1),
                             ("local_step_scaler", local_step_scaler, 1),
                             ("local_step_clipper", local_step_clipper, 1)):
        check_int(where, name, value, low)

    def init_fn(params):
        return ZeroOneAdamState(count=_scalar(0), mu=_zeros(params), nu=_zeros(params), buffer=_zeros(params),
                                lrs=_scalar(0.0, torch.float64), var_interval=_scalar(1), var_counter=_scalar(0),
                                local_step_interval=_scalar(1), local_step_counter=_scalar(0))

    def step_of(mu, nu, p, lr):
        """``-lr * (mu / (sqrt(nu) + eps) + wd * p)``, as adamw's chain computes it."""
        denom = torch._foreach_sqrt(nu)
        torch._foreach_add_(denom, eps)
        d = torch._foreach_div(mu, denom)
        u = torch._foreach_add(d, p, alpha=wd) if wd else d
        return torch._foreach_mul(u, -lr), denom

    @torch.no_grad()
    def update_fn(updates, state, params=None):
        mu, spec, g, p = check_update_args(where, state.mu, updates, params)
        nu, buf = tree.leaves(state.nu), tree.leaves(state.buffer)
        k = int(state.count)
        t, lr = k + 1, _lr_at(lr_of, k)
        vi, vc = int(state.var_interval), int(state.var_counter)
        lsi, lsc, lrs = int(state.local_step_interval), int(state.local_step_counter), float(state.lrs)
        if k <= var_freeze_step:  # the variance phase
            if t % vi == 0:  # an averaged gradient (shard_state reduced it: see exchange_of)
                mu, nu = _adam_moments(mu, nu, g, b1, b2)
                vc += 1
                if vc == var_update_scaler:
                    vc, vi = 0, vi * 2
            else:
                g = [x.to(m.dtype) for x, m in zip(compressed_pmean(g, where + " (gradients)"), g)]
                mu = torch._foreach_lerp(mu, g, 1.0 - b1)
            out, _ = step_of(mu, nu, p, lr)
        else:  # local steps, synchronised every local_step_interval updates
            mu = torch._foreach_lerp(mu, g, 1.0 - b1)
            out, denom = step_of(mu, nu, p, lr)
            buf = torch._foreach_add(buf, out)
            lrs += lr
            if t % lsi == 0:
                torch._foreach_sub_(out, buf)  # undo this rank's local steps ...
                sent = torch._foreach_mul(buf, denom)
                avg = [x.to(m.dtype) for x, m in zip(compressed_pmean(sent, where + " (local steps)"), sent)]
                mu = torch._foreach_div(avg, -lrs)
                torch._foreach_add_(out, torch._foreach_div(avg, denom))  # ... and take the ranks' mean
                buf, lrs = [torch.zeros_like(x) for x in buf], 0.0
            lsc += 1
            if lsc == local_step_scaler:
                lsc, lsi = 0, min(local_step_clipper, lsi * 2)
        return tree.unflatten(spec, out), ZeroOneAdamState(
            count=_scalar(t), mu=tree.unflatten(spec, mu), nu=tree.unflatten(spec, nu),
            buffer=tree.unflatten(spec, buf), lrs=_scalar(lrs, torch.float64), var_interval=_scalar(vi),
            var_counter=_scalar(vc), local_step_interval=_scalar(lsi), local_step_counter=_scalar(lsc))

    return record(GradientTransformation(init_fn, update_fn), ZeroOneAdam(var_freeze_step, where))


# --------------------------------------------------------------------------- 1-bit LAMB


class OnebitLambState(NamedTuple):
    """1-bit LAMB's state: the update count, the moments, the fresh variance tracked after the
    warm-up (``nu_fresh``), and per leaf (float64 vectors in leaf order) the running trust
    ratio of the warm-up (``coeff_freeze``), the last factor applied to it and the momentum
    scaling coefficients fixed at the first compressed update."""

    count: torch.Tensor
    mu: Any
    nu: Any
    nu_fresh: Any
    coeff_freeze: torch.Tensor
    last_factor: torch.Tensor
    scaling_coeff: torch.Tensor


def onebit_lamb(
    learning_rate: ScalarOrSchedule = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    freeze_step: int = 100000,
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
    coeff_beta: float = 0.9,
    factor_max: float = 4.0,
    factor_min: float = 0.5,
    factor_threshold: float = 0.1,
) -> GradientTransformation:
    """1-bit LAMB, DeepSpeed's ``OnebitLamb`` (Li et al., 2021, <https://arxiv.org/abs/2104.06069>),
    with its defaults. Per leaf, ``t`` the 1-based index of the update:

    * warm-up, ``t <= freeze_step``, on the averaged gradient: ``mu``, ``nu`` as Adam's (no
      bias correction), ``u = mu / (sqrt(nu) + eps) + weight_decay * p``, the trust ratio
      ``c = clamp(||p|| / ||u||, min_coeff, max_coeff)`` (1 where a norm is 0), and where
      ``c != 1`` its running mean ``C = coeff_beta * C + (1 - coeff_beta) * c``;
      ``p -= lr * c * u``. At ``t = freeze_step`` ``nu_fresh = nu``.
    * then, on this rank's gradient, ``nu`` frozen: at the first such update each leaf's
      momentum scale ``||mu|| / sqrt(numel)`` fixes ``s = mean scale / scale``; every update
      ``mu = (b1 mu + (1 - b1) g) * s``, all leaves' ``mu`` concatenated into one tensor and
      averaged by ``compressed_pmean``, then ``/ s``. ``nu_fresh`` follows the gradient the
      averaged momentum implies, ``(mu - b1 mu_prev) / (1 - b1)``; the factor
      ``max((sqrt(nu) + eps) / (sqrt(nu_fresh) + eps))`` (blended toward 1 by
      ``||mu / (sqrt(nu) + eps)|| / ||u||`` with weight decay) is clamped to
      ``[factor_min, factor_max]`` and to within ``factor_threshold`` of the last one, and
      ``p -= lr * C * factor * u``.

    Args:
        learning_rate: a float or a schedule ``fn(count) -> float``.
        b1, b2: DeepSpeed's ``betas``, in [0, 1).
        eps, weight_decay: >= 0.
        freeze_step: the number of uncompressed warm-up updates.
        max_coeff, min_coeff, coeff_beta, factor_max, factor_min, factor_threshold:
            DeepSpeed's names and meanings, >= 0.

    Returns:
        A :class:`GradientTransformation` with state :class:`OnebitLambState`; ``update``
        needs ``params``.

    Example:
        >>> from fzero import optim
        >>> tx = optim.onebit_lamb(0.1, freeze_step=10)
        >>> params = {"w": torch.tensor([3.0, 4.0])}
        >>> updates, state = tx.update({"w": torch.tensor([1.0, 0.0])}, tx.init(params), params)
        >>> updates["w"]        # ratio ||p|| / ||u|| = 5 / sqrt(10); u = (sqrt(10), 0)
        tensor([-0.5000, -0.0000])
    """
    where = "fzero.optim.onebit_lamb"
    lr_of, b1, b2, eps, wd = check_adamw_args(where, learning_rate, b1, b2, eps, weight_decay)
    max_coeff, min_coeff = check_coeff_bounds(where, max_coeff, min_coeff)
    coeff_beta = check_unit(where, "coeff_beta", coeff_beta, closed=True)
    factor_max = check_nonneg(where, "factor_max", factor_max)
    factor_min = check_nonneg(where, "factor_min", factor_min)
    factor_threshold = check_nonneg(where, "factor_threshold", factor_threshold)
    check_int(where, "freeze_step", freeze_step)

    def init_fn(params):
        n = len(tree.leaves(params))
        f64 = torch.float64
        return OnebitLambState(count=_scalar(0), mu=_zeros(params), nu=_zeros(params), nu_fresh=_zeros(params),
                               coeff_freeze=torch.zeros(n, dtype=f64), last_factor=torch.ones(n, dtype=f64),
                               scaling_coeff=torch.ones(n, dtype=f64))

    def norm(x) -> float:
        return float(x.pow(2).sum().sqrt())

    @torch.no_grad()
    def update_fn(updates, state, params=None):
        mu, spec, g, p = check_update_args(where, state.mu, updates, params)
        nu, fresh = tree.leaves(state.nu), tree.leaves(state.nu_fresh)
        k = int(state.count)
        t, lr = k + 1, _lr_at(lr_of, k)
        coeff_freeze, last_factor = state.coeff_freeze.clone(), state.last_factor.clone()
        scaling = state.scaling_coeff.clone()
        out = []
        if k < freeze_step:  # warm-up: LAMB on the averaged gradient
            mu, nu = _adam_moments(mu, nu, g, b1, b2)
            if t == freeze_step:
                fresh = [x.clone() for x in nu]
            for i, (m, v, x) in enumerate(zip(mu, nu, p)):
                u = m / (v.sqrt() + eps)
                if wd > 0:
                    u = u + wd * x
                w_norm, u_norm = norm(x), norm(u)
                c = min(max(w_norm / u_norm, min_coeff), max_coeff) if w_norm != 0 and u_norm != 0 else 1.0
                if c != 1.0:
                    coeff_freeze[i] = coeff_beta * float(coeff_freeze[i]) + (1 - coeff_beta) * c
                out.append(u * (-lr * c))
        else:  # compressed: the scaled momenta, concatenated, cross the ranks as one tensor
            if k == freeze_step:
                scales = [norm(m) / math.sqrt(m.numel()) for m in mu]
                united = sum(scales) / len(scales)
                scaling = torch.tensor([united / s for s in scales], dtype=torch.float64)
            last = mu
            mu = torch._foreach_lerp(mu, g, 1.0 - b1)
            mu = [m * float(s) for m, s in zip(mu, scaling)]
            flat = compressed_pmean([torch.cat([m.reshape(-1) for m in mu])], where)[0]
            mu = [part.reshape(m.shape).to(m.dtype) / float(s)
                  for part, m, s in zip(flat.split([m.numel() for m in mu]), mu, scaling)]
            fresh = [x.clone() for x in fresh]
            for i, (m, m_last, v, f, x) in enumerate(zip(mu, last, nu, fresh, p)):
                rebuilt = (m - m_last * b1) / (1 - b1)
                f.mul_(b2).addcmul_(rebuilt, rebuilt, value=1 - b2)
                denom = v.sqrt() + eps
                prelim = m / denom
                u = prelim + wd * x if wd > 0 else prelim
                factor = float((denom / (f.sqrt() + eps)).max())
                if wd > 0:
                    ratio = min(1.0, norm(prelim) / norm(u))
                    factor = factor * ratio + (1.0 - ratio)
                factor = min(max(factor, factor_min), factor_max)
                lf = float(last_factor[i])
                factor = min(max(factor, lf * (1.0 - factor_threshold)), lf * (1.0 + factor_threshold))
                last_factor[i] = factor
                out.append(u * (-lr * float(coeff_freeze[i]) * factor))
        return tree.unflatten(spec, out), OnebitLambState(
            count=_scalar(t), mu=tree.unflatten(spec, mu), nu=tree.unflatten(spec, nu),
            nu_fresh=tree.unflatten(spec, fresh), coeff_freeze=coeff_freeze, last_factor=last_factor,
            scaling_coeff=scaling)

    return record(GradientTransformation(init_fn, update_fn), OnebitLamb(freeze_step, where))
