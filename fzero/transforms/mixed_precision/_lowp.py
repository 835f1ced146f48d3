"""bf16 master weights and bf16 optimizer state (DeepSpeed's ``bf16.bf16_master_weights_and_grads``
and ``bf16.bf16_optimizer_states``): what ``mixed_precision`` needs to keep them.

* :func:`states_in`: an optimizer whose state is kept in a given dtype whatever its
  parameters' dtype (fp32 moments beside bf16 masters);
* :func:`widen` / :func:`narrow_like`: the update's fp32 working copies and their rounding
  back to the stored dtypes;
* :func:`compensated`: an optimizer whose state carries a bf16 Kahan compensation per
  parameter (:class:`CompensatedState`), the rounding error the bf16 masters dropped;
* :func:`stochastic_round`: fp32 to bf16, rounding up with probability equal to the distance
  from the value below, with bits from :mod:`fzero.rng`'s counter-based hash keyed by (seed,
  update, parameter name, element's position in the whole tensor), so every layout of the
  same run draws the same bits.

Why stochastic rounding: a bf16 weight ``w`` keeps 8 significant bits, so an update smaller
than half its ulp (``|u| < 2**(e-8)`` for ``w`` in ``[2**e, 2**(e+1))``) rounds back to ``w``
and is lost, step after step (Zamirai et al., "Revisiting BFloat16 Training", 2020). Rounded
stochastically, ``E[round(w + u)] = w + u``: small updates survive on average. With a Kahan
compensation ``c`` (Kahan 1965; for bf16 weights, Zamirai et al. 2020, section 4.2) the
update computes with ``w + c``, keeps ``w' = round(w + c + u)`` and ``c' = w + c + u - w'`` (rounded
toward zero, so ``w' + c'`` rounds back to ``w'``):
the pair carries about 16 significant bits, so small updates accumulate in ``c`` until they
move ``w``, deterministically, for 2 bytes per parameter.
"""

from __future__ import annotations

import zlib
from typing import Any, NamedTuple

import torch

from fzero import tree
from fzero.optim.base import GradientTransformation
from fzero.rng import _M32, _mix, _mix_, hash32

__all__ = ["CompensatedState", "compensated", "narrow_like", "states_in", "stochastic_round", "toward_zero", "widen"]

# Folded into every stochastic-rounding key, so these bits never coincide with dropout's.
_ROUNDING_TAG = 0x5EED_B16


def _floating(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def widen(t: Any) -> Any:
    """Every floating leaf of ``t`` in fp32 (a copy where it is not fp32 already)."""
    return tree.map(lambda x: x.float() if _floating(x) else x, t)


def narrow_like(t: Any, like: Any) -> Any:
    """Every floating leaf of ``t`` rounded to nearest into the dtype of ``like``'s leaf."""
    return tree.map(lambda x, ref: x.to(ref.dtype) if _floating(x) and _floating(ref) else x, t, like)


def states_in(tx: GradientTransformation, dtype: torch.dtype) -> GradientTransformation:
    """``tx`` whose ``init`` builds its state over ``dtype`` copies of the parameters, so the
    floating state (Adam's moments) is kept in ``dtype`` whatever the parameters' dtype;
    ``update`` is ``tx``'s. ``mixed_precision(master_weights="bf16",
    optimizer_states="fp32")`` installs it: fp32 moments beside bf16 masters.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> tx = states_in(optim.adamw(1e-3), torch.float32)
        >>> tx.init({"w": torch.zeros(3, dtype=torch.bfloat16)})[0].mu["w"].dtype
        torch.float32
    """

    def init(params):
        return tx.init(tree.map(lambda p: p.to(dtype) if _floating(p) else p, params))

    return GradientTransformation(init, tx.update)


class CompensatedState(NamedTuple):
    """The state of :func:`compensated`: the optimizer's own, and the Kahan compensation of
    each parameter (its dtype: bf16 beside bf16 masters), partitioned and checkpointed with
    the optimizer state."""

    inner: Any
    compensation: Any


def compensated(tx: GradientTransformation) -> GradientTransformation:
    """``tx`` whose state also holds a zero-initialised compensation per parameter, in the
    parameter's dtype. ``update`` is ``tx``'s and carries the compensation unchanged:
    ``mixed_precision(rounding="kahan")`` reads it before the update and writes it after.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> s = compensated(optim.sgd(0.1)).init({"w": torch.ones(2, dtype=torch.bfloat16)})
        >>> s.compensation["w"]
        tensor([0., 0.], dtype=torch.bfloat16)
    """

    def init(params):
        zeros = tree.map(lambda p: torch.zeros_like(p) if _floating(p) else None, params)
        return CompensatedState(tx.init(params), zeros)

    def update(updates, state, params=None, **kw):
        updates, inner = tx.update(updates, state.inner, params, **kw)
        return updates, CompensatedState(inner, state.compensation)

    return GradientTransformation(init, update)


def toward_zero(x: torch.Tensor) -> torch.Tensor:
    """``x`` (fp32) rounded toward zero to bf16: its 16 low bits dropped.

    A Kahan compensation rounded so stays within half an ulp of its weight, so weight plus
    compensation always rounds back to the weight: an update that changes nothing (a skipped
    one, a zero gradient) leaves the weight's bits as they were.

    Example:
        >>> toward_zero(torch.tensor([1.0 + 2.0 ** -8, -(1.0 + 2.0 ** -8)])).tolist()
        [1.0, -1.0]
    """
    if x.dtype != torch.float32:
        raise TypeError(f"toward_zero: x must be float32, got {x.dtype}")
    return (x.contiguous().view(torch.int32) & -0x10000).view(torch.float32).to(torch.bfloat16)


def _name_key(name: str) -> int:
    return zlib.crc32(name.encode())


def stochastic_round(x: torch.Tensor, *, seed: int, update: int, name: str, start: int = 0) -> torch.Tensor:
    """``x`` (fp32) rounded stochastically to bf16: up to the next bf16 value with probability
    equal to the fraction of the gap ``x`` lies above the one below, so ``E[result] = x``.

    Element ``i`` of ``x`` is element ``start + i`` of the flattened whole tensor ``name``
    (``start`` > 0 for a ZeRO piece); its 16 random bits hash (``seed``, ``update``, ``name``,
    ``start + i``), so the result is the same whichever rank holds which piece. Infinities
    and NaN round to nearest (they stay what they are).

    The rounding adds the random bits to the 16 bits bf16 drops and truncates: the magnitude
    rounds up exactly when the dropped bits plus a uniform draw from ``[0, 2**16)`` carry.

    Example:
        >>> import torch
        >>> x = torch.full((4096,), 1.0 + 2.0 ** -10)  # an eighth of the way from 1 to the next bf16 value
        >>> r = stochastic_round(x, seed=0, update=0, name="w")
        >>> sorted(set(r.tolist())), round(r.float().mean().item(), 4)
        ([1.0, 1.0078125], 1.001)
        >>> bool((stochastic_round(x[1000:], seed=0, update=0, name="w", start=1000) == r[1000:]).all())
        True
    """
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round: x must be float32, got {x.dtype}")
    flat = x.reshape(-1)
    n = flat.numel()
    bits = flat.view(torch.int32).to(torch.int64) & _M32
    key = hash32(seed, update, _name_key(name), _ROUNDING_TAG)
    k1, k2 = hash32(key, 1), hash32(key, 2)
    pos = torch.arange(start, start + n, dtype=torch.int64, device=x.device) & _M32
    draw = _mix_(_mix(pos ^ k1).bitwise_xor_(k2)) & 0xFFFF
    high = ((bits + draw) >> 16) & 0xFFFF
    out = torch.where(high >= 0x8000, high - 0x10000, high).to(torch.int16).view(torch.bfloat16)
    out = torch.where(torch.isfinite(flat), out, flat.to(torch.bfloat16))
    return out.reshape(x.shape)
