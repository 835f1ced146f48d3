"""The fused path: ``adam``/``adamw`` updates run by ``fzero_kernels`` instead of the chain.

When is it used (``FZERO_FUSED``, or :func:`use_fused`):

* ``"auto"`` (default): when the parameters are on a GPU, where ``fzero_kernels`` runs its
  Triton kernel (one launch per leaf: unscale, clip coefficient, decoupled decay, both
  moments and the parameter in one pass);
* ``"on"``: always (on a CPU the kernels' torch reference runs -- the tests use this);
* ``"off"``: never.

The result equals the unfused chain's within fp32 rounding (``tests/test_fused.py``), and
the optimizer state keeps the chain's structure, so a checkpoint does not care which path
wrote it. Only an alias alone, or ``chain(clip_by_global_norm(c), alias)``, is fused
(:func:`fzero.optim.fused_spec_of`); anything else runs unfused.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, Literal

import torch

from fzero import tree
from fzero.optim.base import GradientTransformation, fused_spec_of
from fzero.optim.transform import ScaleByAdamState, _resolve_mask

__all__ = ["fused_update", "use_fused"]

Mode = Literal["auto", "on", "off"]
_forced: list[Mode] = []


@contextlib.contextmanager
def use_fused(mode: Mode) -> Iterator[None]:
    """Choose the fused path for the block: ``"auto"``, ``"on"`` or ``"off"``."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"fzero.optim.use_fused: mode must be 'auto', 'on' or 'off', got {mode!r}")
    _forced.append(mode)
    try:
        yield
    finally:
        _forced.pop()


def _mode() -> Mode:
    if _forced:
        return _forced[-1]
    mode = os.environ.get("FZERO_FUSED", "auto")
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"fzero.optim: FZERO_FUSED={mode!r} must be 'auto', 'on' or 'off'")
    return mode  # type: ignore[return-value]


def _find_adam(state: Any) -> tuple[Any, ...] | None:
    """The index path of the (only) ScaleByAdamState inside a chain's nested tuples."""
    if isinstance(state, ScaleByAdamState):
        return ()
    if isinstance(state, tuple):
        for i, s in enumerate(state):
            sub = _find_adam(s)
            if sub is not None:
                return (i, *sub)
    return None


def _rebuild(state: Any, path: tuple, adam: ScaleByAdamState) -> Any:
    """``state`` with the Adam state at ``path`` replaced and every other count advanced."""
    if not path:
        return adam
    out = []
    for i, s in enumerate(state):
        out.append(_rebuild(s, path[1:], adam) if i == path[0] else _advance(s))
    return type(state)(*out) if hasattr(state, "_fields") else tuple(out)


def _advance(s: Any) -> Any:
    if hasattr(s, "_fields") and "count" in s._fields:
        return s._replace(count=s.count + 1)
    if isinstance(s, tuple):
        parts = [_advance(x) for x in s]
        return type(s)(*parts) if hasattr(s, "_fields") else tuple(parts)
    return s


def fused_update(tx: GradientTransformation, grads: Any, opt_state: Any, params: Any):
    """``(new_params, new_opt_state)`` by the fused kernels, or ``None`` to run unfused.

    Pure: the kernels write into fresh copies of the parameters and moments.
    """
    mode = _mode()
    if mode == "off":
        return None
    spec = fused_spec_of(tx)
    if spec is None or spec.kind not in ("adam", "adamw") or spec.eps_root:
        return None
    p_leaves, p_spec = tree.flatten(params)
    if not p_leaves or not all(isinstance(p, torch.Tensor) and p.dtype == torch.float32 for p in p_leaves):
        return None
    if mode == "auto" and p_leaves[0].device.type != "cuda":
        return None
    path = _find_adam(opt_state)
    if path is None:
        return None
    import fzero_kernels

    from fzero.transforms._core import LeafSums, emit_metric, psum

    node = opt_state
    for i in path:
        node = node[i]
    adam: ScaleByAdamState = node
    g_leaves = tree.leaves(grads)
    mu, nu = tree.leaves(adam.mu), tree.leaves(adam.nu)
    count = int(adam.count)
    lr = spec.learning_rate(count) if callable(spec.learning_rate) else spec.learning_rate
    decay = [True] * len(p_leaves) if spec.mask is None else _resolve_mask("fzero.optim.adamw", spec.mask, params)

    grad_scale = 1.0
    if spec.clip_norm is not None:
        # clip_by_global_norm's coefficient, from one psum of the per-leaf sums of squares
        # (in fp64), each leaf named so that a split one is summed over tp and a whole one
        # counted once.
        sq = torch.stack([g.double().pow(2).sum() for g in g_leaves]).to(p_leaves[0].device)
        norm = psum(LeafSums.of([grads], sq, total=True)).sqrt().float()
        emit_metric("grad_norm", norm)
        coef = min(1.0, spec.clip_norm / (float(norm) + 1e-6))
        grad_scale = 1.0 / coef

    kernel = fzero_kernels.adamw_ if spec.kind == "adamw" else fzero_kernels.adam_
    new_p, new_mu, new_nu = [], [], []
    for p, g, m, v, d in zip(p_leaves, g_leaves, mu, nu, decay):
        # The kernels take flat, contiguous tensors. A parameter need not be row-major (a
        # transposed weight, a strided view; its moments inherit its strides), and a clone
        # keeps a dense tensor's strides, so the copies are made row-major explicitly; the
        # gradient, whatever its layout, is read in the same (logical) element order.
        p2, m2, v2 = (t.detach().clone(memory_format=torch.contiguous_format) for t in (p, m, v))
        if p.numel():
            kernel(p2.view(-1), g.detach().reshape(-1).contiguous(), m2.view(-1), v2.view(-1), lr=lr, beta1=spec.b1,
                   beta2=spec.b2, eps=spec.eps, weight_decay=spec.weight_decay if d else 0.0, step=count + 1,
                   grad_scale=grad_scale)
        new_p.append(p2)
        new_mu.append(m2)
        new_nu.append(v2)
    new_adam = ScaleByAdamState(adam.count + 1, tree.unflatten(tree.structure(adam.mu), new_mu),
                                tree.unflatten(tree.structure(adam.nu), new_nu))
    return tree.unflatten(p_spec, new_p), _rebuild(opt_state, path, new_adam)
