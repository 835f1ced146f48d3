"""How a state's optimizer makes one update: the lowering ``fzero.core``'s ``update`` runs.

An optimizer is optax's pair ``(init, update)``; it knows nothing of kernels or of writing
in place. This pass turns it into one update, ``(grads, opt_state, params, *, donate) ->
(params, opt_state)``, from what the optimizer's members are (their records,
:mod:`fzero.optim._known`):

* a chain the fused kernels compute (:func:`~fzero.optim.fused_spec_of`: adam, adamw, lamb,
  lion, sgd, optionally after a global-norm clip), where :func:`fzero.optim.fused.fuses`
  says so, runs as those kernels, one launch per flat run of leaves; they read bf16/fp16
  gradients as they are;
* an element-wise :func:`~fzero.optim.from_torch`, bare or last in a chain (after a clip,
  say), under ``donate`` steps its torch optimizer on the parameters themselves, in place:
  no copy of them, no update tensor, and the new parameters are the optimizer's own bits;
* anything else runs as ``tx.update`` then :func:`~fzero.optim.apply_updates`. When the step
  owns its state (``donate``), each member whose record allows it writes its new moments
  into the old ones and ``apply_updates`` adds into the parameters; within the chain, a
  member overwrites the updates its predecessor just made. The same bits either way.

The lowered update says which gradients it reads (:class:`fzero.core.Lowered`): a transform
holding 16-bit gradients beside fp32 masters (``mixed_precision``) casts them to fp32 before
handing them on only where the update does not read them as they are.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from fzero import tree
from fzero.core import Lowered, register_lowering
from fzero.optim import _known, fused
from fzero.optim.base import apply_updates

__all__ = ["lower"]


def lower(tx: Any, params: Any) -> Lowered:
    """One update by ``tx`` of ``params`` (the tensors the optimizer steps: the masters under
    mixed precision, this rank's pieces under ZeRO)."""
    if fused.fuses(tx, params):
        return Lowered(functools.partial(_fused, tx), reads_low_precision=True, honours_skip_flag=True)
    what = _known.known(tx)
    if isinstance(what, _known.FromTorch) and what.step_in_place is not None:
        return Lowered(functools.partial(_from_torch, tx, what.step_in_place), reads_low_precision=False)
    last = _known.known(what.transforms[-1]) if isinstance(what, _known.Chain) and what.transforms else None
    if isinstance(last, _known.FromTorch) and last.step_in_place is not None:
        return Lowered(functools.partial(_chain_then_in_place, tx, what.transforms, last.step_in_place),
                       reads_low_precision=False)
    return Lowered(functools.partial(_chain, tx), reads_low_precision=False)


def _from_torch(tx, step_in_place, grads, opt_state, params, *, donate: bool = False):
    """A bare element-wise ``from_torch``: donated, its optimizer steps the parameters in place
    (torch's own bits, no copy of them and no update tensor); otherwise the pure update."""
    if donate:
        return step_in_place(grads, opt_state, params)
    return _chain(tx, grads, opt_state, params, donate=False)


def _chain_then_in_place(tx, members, step_in_place, grads, opt_state, params, *, donate: bool = False):
    """A chain that ends in an element-wise ``from_torch`` (``chain(clip_by_global_norm(1.0),
    from_torch(...))``): donated, the members before it run as the chain runs them and the
    last steps the parameters in place; otherwise the pure chain."""
    if not donate or not isinstance(opt_state, tuple) or len(opt_state) != len(members):
        return _chain(tx, grads, opt_state, params, donate=donate)  # the chain names a bad state
    updates, new, states = grads, False, []
    for t, s in zip(members[:-1], opt_state[:-1]):
        updates, s = _known.update(t, updates, s, params, new=new, donate=True)
        new = _known.still_new(t, new)
        states.append(s)
    params, s = step_in_place(updates, opt_state[-1], params)
    return params, (*states, s)


def _chain(tx, grads, opt_state, params, *, donate: bool = False):
    updates, opt_state = _known.update(tx, grads, opt_state, params, new=False, donate=donate)
    return apply_updates(params, updates, donate=donate), opt_state


def _fused(tx, grads, opt_state, params, *, donate: bool = False, found_inf: torch.Tensor | None = None):
    out = fused.fused_update(tx, grads, opt_state, params, donate=donate, found_inf=found_inf)  # by name: tests watch it
    if out is not None:
        return out
    if found_inf is not None and bool(found_inf > 0):  # discarded: the chain cannot read the flag on the device
        return params, opt_state
    # The kernels did not take these operands after all: the chain, on the gradients in the
    # parameters' dtypes, as a caller told "reads_low_precision" did not cast them.
    return _chain(tx, tree.map(_widen, grads, params), opt_state, params, donate=donate)


def _widen(g: Any, p: Any) -> Any:
    if isinstance(g, torch.Tensor) and isinstance(p, torch.Tensor) and g.dtype != p.dtype \
            and g.dtype in (torch.bfloat16, torch.float16):
        return g.to(p.dtype)
    return g


register_lowering(lower)
