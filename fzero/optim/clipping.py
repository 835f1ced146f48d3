"""Gradient clipping."""

from __future__ import annotations

import torch

from fzero import tree
from fzero.optim.base import EmptyState, GradientTransformation, _check_number, _leaf_norms, _mark
from fzero.transforms._core import emit_metric, psum

__all__ = ["clip_by_global_norm", "global_norm"]

# torch.nn.utils.clip_grad_norm_ divides by (norm + 1e-6); we keep it so clipping matches
# torch's (and never divides by zero on an all-zero gradient).
_CLIP_EPS = 1e-6


def global_norm(updates) -> torch.Tensor:
    """The L2 norm of all leaves of ``updates`` together, as a 0-dim tensor (fp32, or fp64
    when a leaf is fp64).

    The local sum of squares goes through :func:`fzero.transforms._core.psum` before the
    square root, so the norm is exact when the leaves are shards of the full tensors.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> optim.global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([[4.0]])})
        tensor(5.)
    """
    leaves = tree.leaves(updates)
    with torch.no_grad():
        if not leaves:
            local = torch.zeros((), dtype=torch.float32)
        else:
            local = _leaf_norms(leaves, leaves[0].device).square().sum()
        return psum(local).sqrt()


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale all updates together so their global L2 norm is at most ``max_norm``.

    As ``torch.nn.utils.clip_grad_norm_``::

        norm = sqrt(sum over leaves of sum(u^2))
        out = u * min(1, max_norm / (norm + 1e-6))

    The ``1e-6`` is torch's choice (optax instead leaves updates untouched below
    ``max_norm`` and divides by ``norm`` exactly above it); the two differ by at most a
    relative 1e-6 / max_norm. The norm before clipping is reported with
    ``emit_metric("grad_norm", norm)`` (a 0-dim tensor: no device sync), and is computed with
    a ``psum`` of the local sum of squares, exact when leaves are shards.

    Args:
        max_norm: the largest allowed global norm, > 0.

    Returns:
        A stateless :class:`GradientTransformation`.

    Raises:
        ValueError: ``max_norm`` is not positive.
        TypeError: ``max_norm`` is not a number.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> tx = optim.clip_by_global_norm(1.0)
        >>> u, _ = tx.update([torch.tensor([3.0, 4.0])], tx.init(None))
        >>> u
        [tensor([0.6000, 0.8000])]
    """
    where = "fzero.optim.clip_by_global_norm"
    max_norm = _check_number(where, "max_norm", max_norm)
    if not max_norm > 0.0:
        raise ValueError(f"{where}: max_norm must be > 0, got {max_norm!r}")

    def init_fn(params):
        del params
        return EmptyState()

    def update_fn(updates, state, params=None, *, _inplace=False):
        del params
        leaves, spec = tree.flatten(updates)
        norm = global_norm(updates)
        emit_metric("grad_norm", norm)
        if not leaves:
            return updates, state
        with torch.no_grad():
            coef = (max_norm / (norm + _CLIP_EPS)).clamp(max=1.0)
            device = leaves[0].device
            if not all(x.device == device for x in leaves):
                out = [x * coef.to(x.device) for x in leaves]
            elif _inplace:
                torch._foreach_mul_(leaves, coef)
                return updates, state
            else:
                out = torch._foreach_mul(leaves, coef)
        return tree.unflatten(spec, out), state

    # Recognised by fused_spec_of: a stateless clip in front of an alias.
    update_fn._fzero_clip_norm = max_norm  # type: ignore[attr-defined]
    return GradientTransformation(init_fn, _mark(update_fn, inplace=True, fresh=lambda f: True))
