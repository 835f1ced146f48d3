"""Optimizers whose update of a tensor reads the whole tensor: :func:`adafactor`, :func:`muon`.

Adafactor keeps, for a matrix, one second moment per row and one per column (their outer
product, over their mean, estimates the per-element one) and scales each update by the
parameter's RMS; Muon orthogonalises the momentum matrix by a Newton-Schulz iteration.
Neither can run on a flat run of a tensor's elements, so both are declared whole-tensor
(``_known.Adafactor`` / ``_known.Muon``) and, under ZeRO stages 1-3, each partitioned leaf
is updated whole by its owner rank (:mod:`fzero.optim._owners`), which alone keeps its state.

Names and arguments are optax's (``optax.adafactor``, ``optax.contrib.muon``); the
parameters are torch's (a ``Linear`` weight is ``(out, in)``). Where optax and torch 2.13
(``torch.optim.Adafactor``, ``torch.optim.Muon``) compute the same, these compute it; where
they differ, see each function and ``docs/optim.md``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fzero import tree
from fzero.optim import _known
from fzero.optim._checks import check_lr, check_nonneg, check_unit, type_name
from fzero.optim._owners import LeafState, assign_owners, is_piece, owned_leaf, present, refuse_split, run_whole
from fzero.optim.torch_optim import _fill, _per_leaf
from fzero.optim.base import GradientTransformation, ScalarOrSchedule, _increment, _new_count, chain
from fzero.optim.transform import (_need_params, _resolve_mask, _schedule_value, add_decayed_weights, masked,
                                   scale_by_adam, scale_by_learning_rate)

__all__ = ["WholeTensorState", "adafactor", "muon", "scale_by_muon"]


class WholeTensorState(NamedTuple):
    """The state of a whole-tensor optimizer: the update count (0-dim int64 CPU) and, keyed
    like the parameters, each parameter's tensors by name (a :class:`LeafState`); under
    ZeRO >= 1 a partitioned parameter's live on its owner rank only."""

    count: torch.Tensor
    state: Any


LeafInit = Callable[[tuple[int, ...], torch.dtype], dict[str, tuple[tuple[int, ...], torch.dtype]]]
LeafStep = Callable[[torch.Tensor, torch.Tensor, dict, int, bool], tuple[torch.Tensor, dict]]


def _whole_tensor(where: str, what: _known.Known, leaf_init: LeafInit, leaf_step: LeafStep,
                  decay_mask: Any = None) -> GradientTransformation:
    """A transformation that updates each leaf from the whole leaf: ``leaf_init(shape, dtype)``
    names the state tensors of a leaf, ``leaf_step(g, p, state, count, decay) -> (update,
    state)`` updates one whole leaf (``decay``: its weight-decay mask flag)."""
    def init_fn(params):
        refuse_split(where, params)
        all_leaves, spec = tree.flatten(params, is_leaf=is_piece)
        here = present(all_leaves)
        leaves = [all_leaves[i] for i in here]
        split = [i for i, x in enumerate(leaves) if is_piece(x)]
        world = leaves[split[0]].info.world if split else 1
        owners = dict(zip(split, assign_owners([leaves[i].info.numel for i in split], world)))
        out = []
        for i, x in enumerate(leaves):
            if is_piece(x):
                found = leaf_init(tuple(x.info.shape), x.local.dtype)
                out.append(LeafState({k: owned_leaf(x, None, s, d, owners[i]) for k, (s, d) in found.items()}))
            else:
                found = leaf_init(tuple(x.shape), x.dtype)
                out.append(LeafState({k: torch.zeros(s, dtype=d, device=x.device) for k, (s, d) in found.items()}))
        return WholeTensorState(count=_new_count(), state=tree.unflatten(spec, _fill(all_leaves, here, out,
                                                                                          LeafState())))

    def update_fn(updates, state, params=None, *, inplace=False, donate=False):
        del inplace, donate  # the whole tensors are made afresh on the owner
        _need_params(where, params)
        refuse_split(where, params)
        if not isinstance(state, WholeTensorState):
            raise TypeError(f"{where}: the state must be the WholeTensorState init returned, got {type_name(state)}")
        all_g, all_s, spec, s_spec, here, (p_leaves, g_leaves, s_leaves) = _per_leaf(where, updates, state.state,
                                                                                     params)
        count = int(state.count)
        decay = _resolve_mask(where, decay_mask, params) if decay_mask is not None else [True] * len(p_leaves)

        def step(idx, wholes):
            with torch.no_grad():
                return [leaf_step(g, p, st, count, decay[i]) for i, (g, p, st) in zip(idx, wholes)]

        new_u, new_s = run_whole(g_leaves, p_leaves, [dict(s) for s in s_leaves], step)
        return tree.unflatten(spec, _fill(all_g, here, new_u)), WholeTensorState(
            count=_increment(state.count), state=tree.unflatten(s_spec, _fill(all_s, here, [LeafState(s) for s in new_s])))

    return _known.record(GradientTransformation(init_fn, update_fn), what)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.norm() / math.sqrt(x.numel()) if x.numel() else x.new_zeros(())


# --------------------------------------------------------------------------- adafactor


def _factored_dims(shape: tuple[int, ...], factored: bool, min_dim: int) -> tuple[int, int] | None:
    """``(d1, d0)``: the second largest and the largest dimension (optax's choice), or
    ``None`` when the leaf keeps one moment per element."""
    if not factored or len(shape) < 2:
        return None
    order = sorted(range(len(shape)), key=lambda d: (shape[d], d))
    if shape[order[-2]] < min_dim:
        return None
    return order[-2], order[-1]


def adafactor(
    learning_rate: ScalarOrSchedule | None = None,
    min_dim_size_to_factor: int = 128,
    decay_rate: float = 0.8,
    decay_offset: int = 0,
    multiply_by_parameter_scale: bool = True,
    clipping_threshold: float | None = 1.0,
    momentum: float | None = None,
    dtype_momentum: torch.dtype = torch.float32,
    weight_decay_rate: float | None = None,
    eps: float = 1e-30,
    factored: bool = True,
    weight_decay_mask: Any = None,
) -> GradientTransformation:
    """Adafactor (Shazeer & Stern, 2018), as optax's ``adafactor``; a whole-tensor optimizer.

    Per leaf, with ``t`` the 1-based update and ``β_t = 1 - (t - decay_offset)^-decay_rate``:
    a matrix (two dimensions of at least ``min_dim_size_to_factor``) keeps the means of
    ``g² + eps`` over its largest and its second largest dimension, and ``v̂ = v_row ⊗ v_col
    / mean(v_row)``; any other leaf keeps ``v`` per element. Then::

        u = g / sqrt(v̂)
        u = u / max(1, rms(u) / clipping_threshold)          # clipping_threshold
        u = learning_rate * u                                 # learning_rate
        u = u * max(rms(p), 1e-3)                             # multiply_by_parameter_scale
        u = m = momentum * m + (1 - momentum) * u             # momentum
        u = u + weight_decay_rate * p                         # weight_decay_rate (masked)
        p = p - u

    ``torch.optim.Adafactor(lr, beta2_decay=-decay_rate, eps=(None, 1e-3), d=clipping_threshold)``
    computes the same for matrices and vectors while ``learning_rate <= 1/sqrt(t)`` (torch
    uses ``min(lr, 1/sqrt(t))``), with ``min_dim_size_to_factor=1`` (torch factors every
    matrix), no momentum and no weight decay (torch's is ``p *= 1 - lr * wd``), and its
    stabiliser ``eps`` (the dtype's epsilon, squared, as a floor of ``v̂``) where optax adds
    ``1e-30`` to ``g²``. Tensors of more than two dimensions are factored over their two
    largest dimensions (optax), torch's over the last two.

    Args:
        learning_rate: a float or a schedule; ``None`` leaves the updates unscaled (optax).
        min_dim_size_to_factor, decay_rate, decay_offset, multiply_by_parameter_scale,
        clipping_threshold, momentum, dtype_momentum, weight_decay_rate, eps, factored,
        weight_decay_mask: as optax's.

    Returns:
        A whole-tensor :class:`GradientTransformation` (state :class:`WholeTensorState`).

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> tx = optim.adafactor(1e-2, min_dim_size_to_factor=1)
        >>> params = {"w": torch.ones(2, 3)}
        >>> state = tx.init(params)
        >>> sorted(state.state["w"]), tuple(state.state["w"]["v_row"].shape)
        (['v_col', 'v_row'], (2,))
        >>> tx.update({"w": torch.ones(2, 3)}, state, params)[0]["w"]
        tensor([[-0.0100, -0.0100, -0.0100],
                [-0.0100, -0.0100, -0.0100]])
    """
    where = "fzero.optim.adafactor"
    if learning_rate is not None:
        check_lr(where, learning_rate)
    check_nonneg(where, "eps", eps)
    if momentum is not None:
        check_unit(where, "momentum", momentum)
    if clipping_threshold is not None and not clipping_threshold >= 1.0:
        raise ValueError(f"{where}: clipping_threshold must be >= 1 or None, got {clipping_threshold!r}")

    def leaf_init(shape, dtype):
        dims = _factored_dims(shape, factored, min_dim_size_to_factor)
        out = {}
        if dims is None:
            out["v"] = (shape, dtype)
        else:
            d1, d0 = dims
            out["v_row"] = (tuple(s for d, s in enumerate(shape) if d != d0), dtype)
            out["v_col"] = (tuple(s for d, s in enumerate(shape) if d != d1), dtype)
        if momentum is not None:
            out["m"] = (shape, dtype_momentum)
        return out

    def leaf_step(g, p, st, count, decay):
        g = g.to(p.dtype)
        beta = 1.0 - float(count + 1 - decay_offset) ** (-decay_rate)
        g2 = g * g + eps
        dims = _factored_dims(tuple(g.shape), factored, min_dim_size_to_factor)
        new = {}
        if dims is None:
            v = st["v"] * beta + g2 * (1.0 - beta)
            u = g * v.rsqrt()
            new["v"] = v
        else:
            d1, d0 = dims
            v_row = st["v_row"] * beta + g2.mean(dim=d0) * (1.0 - beta)
            v_col = st["v_col"] * beta + g2.mean(dim=d1) * (1.0 - beta)
            reduced = d1 - 1 if d1 > d0 else d1
            row_factor = (v_row / v_row.mean(dim=reduced, keepdim=True)).rsqrt()
            u = g * row_factor.unsqueeze(d0) * v_col.rsqrt().unsqueeze(d1)
            new["v_row"], new["v_col"] = v_row, v_col
        if clipping_threshold is not None:
            u = u / torch.clamp_min(_rms(u) / clipping_threshold, 1.0)
        if learning_rate is not None:
            lr = _schedule_value(where, learning_rate, count) if callable(learning_rate) else learning_rate
            u = u * lr
        if multiply_by_parameter_scale:
            u = u * torch.clamp_min(_rms(p), 1e-3)
        if momentum is not None:
            m = st["m"] * momentum + u.to(dtype_momentum) * (1.0 - momentum)
            new["m"], u = m, m.to(p.dtype)
        if weight_decay_rate is not None and decay:
            u = u + weight_decay_rate * p
        return -u, new

    return _whole_tensor(where, _known.Adafactor(), leaf_init, leaf_step, weight_decay_mask)


# --------------------------------------------------------------------------- muon


def _orthogonalize(x: torch.Tensor, coeffs: tuple[float, float, float], steps: int, eps: float,
                   dtype: torch.dtype | None) -> torch.Tensor:
    """The quintic Newton-Schulz iteration (Jordan et al., 2024): about ``U Vᵀ`` of ``x = U S
    Vᵀ``, in ``dtype`` (``None``: ``x``'s). A wide matrix is iterated as it is, a tall one
    transposed, so the Gram matrix is the smaller one."""
    a, b, c = coeffs
    y = x.to(dtype or x.dtype)
    tall = y.size(0) > y.size(1)
    if tall:
        y = y.T
    y = y / y.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = y @ y.T
        y = torch.addmm(y, torch.addmm(gram, gram, gram, beta=b, alpha=c), y, beta=a)
    return y.T if tall else y


def scale_by_muon(
    ns_coeffs: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-8,
    mu_dtype: torch.dtype | None = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    ns_dtype: torch.dtype | None = None,
    bias_correction: bool = True,
) -> GradientTransformation:
    """Muon's direction for matrices, as optax's ``contrib.scale_by_muon``; whole-tensor.

    ``mu = beta * mu + (1 - beta) * g``; with ``nesterov``, ``m̂ = beta * mu / (1 - beta^(t+1)) +
    (1 - beta) * g / (1 - beta^t)``, else ``m̂ = mu`` (optax divides by ``1 - beta^t`` too, a
    positive factor the orthogonalisation's normalisation takes out again, up to ``eps``;
    torch does not); ``u = NS(m̂)`` (:func:`_orthogonalize`, ``ns_steps`` quintic steps),
    times ``<m̂, u>`` when ``adaptive``, times ``sqrt(max(1, rows / cols))`` (torch's
    ``"original"`` adjustment: optax's ``sqrt(max(1, shape[-1] / shape[-2]))`` for JAX's
    ``(in, out)`` kernels, the same ratio of fan-out to fan-in). Only 2-D leaves.

    ``ns_dtype``: the dtype of the iteration (``None``: the parameter's, as optax and
    DeepSpeed on a CPU; ``torch.bfloat16`` as ``torch.optim.Muon``).
    ``bias_correction=False``: torch's and DeepSpeed's momentum instead of optax's, ``m̂ =
    beta * mu + (1 - beta) * g`` with ``nesterov`` (else ``mu``).
    """
    where = "fzero.optim.scale_by_muon"
    check_unit(where, "beta", beta)
    if len(tuple(ns_coeffs)) != 3:
        raise ValueError(f"{where}: ns_coeffs must be three numbers (a, b, c), got {ns_coeffs!r}")
    coeffs = tuple(float(c) for c in ns_coeffs)

    def leaf_init(shape, dtype):
        if len(shape) != 2:
            raise ValueError(f"{where}: Muon orthogonalises matrices; got a leaf of shape {shape} (give the other "
                             f"leaves another optimizer, as fzero.optim.muon does with AdamW)")
        return {"mu": (shape, mu_dtype or dtype)}

    def leaf_step(g, p, st, count, decay):
        del decay
        t = count + 1
        g = g.to(st["mu"].dtype)
        mu = st["mu"].lerp(g, 1.0 - beta)
        if nesterov and bias_correction:
            m_hat = mu * (beta / (1.0 - beta ** (t + 1))) + g * ((1.0 - beta) / (1.0 - beta ** t))
        elif nesterov:
            m_hat = g.lerp(mu, beta)
        else:
            m_hat = mu
        u = _orthogonalize(m_hat, coeffs, ns_steps, eps, ns_dtype).to(p.dtype)
        if adaptive:
            u = u * (m_hat.to(p.dtype) * u).sum()
        rows, cols = p.shape
        u = u * math.sqrt(max(1.0, rows / cols))
        return u, {"mu": mu}

    return _whole_tensor(where, _known.Muon(), leaf_init, leaf_step)


def _is_matrix(params):
    return tree.map(lambda x: x.ndim == 2, params)


def muon(
    learning_rate: ScalarOrSchedule,
    ns_coeffs: tuple[float, float, float] = (3.4445, -4.7750, 2.0315),
    ns_steps: int = 5,
    beta: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    weight_decay_mask: Any = None,
    mu_dtype: torch.dtype | None = None,
    *,
    nesterov: bool = True,
    adaptive: bool = False,
    adam_b1: float = 0.9,
    adam_b2: float = 0.999,
    adam_eps_root: float = 0.0,
    adam_weight_decay: float = 0.0,
    ns_dtype: torch.dtype | None = None,
    bias_correction: bool = True,
) -> GradientTransformation:
    """Muon (Jordan et al., 2024), as optax's ``contrib.muon``: 2-D leaves by
    :func:`scale_by_muon`, decoupled weight decay and the learning rate
    (``p -= lr * (u + weight_decay * p)``); every other leaf by AdamW (``adam_b1``,
    ``adam_b2``, ``eps``, ``adam_eps_root``, ``adam_weight_decay``). Whole-tensor: under ZeRO
    each matrix is orthogonalised whole by its owner rank; the AdamW leaves run on pieces.

    ``torch.optim.Muon(lr, weight_decay, momentum=beta, nesterov, eps)`` on the matrices
    computes the same as ``muon(lr, beta=beta, eps=eps, weight_decay=weight_decay,
    nesterov=nesterov, ns_dtype=torch.bfloat16, bias_correction=False)`` (torch iterates in
    bf16, blends ``g`` and ``mu`` without optax's bias corrections, and refuses other
    leaves). optax's AdamW on the other leaves follows ``nesterov`` too (NAdamW); here it is
    AdamW. ``bias_correction`` and ``ns_dtype`` are fzero's, for torch's and DeepSpeed's
    variants.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> tx = optim.muon(0.1)
        >>> params = {"w": torch.ones(2, 2), "b": torch.ones(2)}
        >>> updates, _ = tx.update({"w": torch.eye(2), "b": torch.ones(2)}, tx.init(params), params)
        >>> updates["b"], updates["w"].diagonal().abs().gt(0.05).all().item()
        (tensor([-0.1000, -0.1000]), True)
    """
    where = "fzero.optim.muon"
    check_lr(where, learning_rate)
    check_nonneg(where, "weight_decay", weight_decay)
    matrices = chain(
        scale_by_muon(ns_coeffs, ns_steps, beta, eps, mu_dtype, nesterov=nesterov, adaptive=adaptive,
                      ns_dtype=ns_dtype, bias_correction=bias_correction),
        add_decayed_weights(weight_decay, weight_decay_mask),
        scale_by_learning_rate(learning_rate),
    )
    others = chain(
        scale_by_adam(adam_b1, adam_b2, eps, adam_eps_root),
        add_decayed_weights(adam_weight_decay),
        scale_by_learning_rate(learning_rate),
    )
    not_matrix = lambda params: tree.map(lambda x: x.ndim != 2, params)  # noqa: E731
    return chain(masked(matrices, _is_matrix, where=where), masked(others, not_matrix, where=where))
