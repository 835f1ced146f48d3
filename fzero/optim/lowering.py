"""How a state's optimizer makes one update: the lowering ``fzero.core``'s ``update`` runs.

An optimizer is optax's pair ``(init, update)``; it knows nothing of kernels or of writing
in place. This pass turns it into one update, ``(grads, opt_state, params, *, donate) ->
(params, opt_state)``, from what the optimizer's members are (their records,
:mod:`fzero.optim._known`):

* a chain the fused kernels compute (:func:`~fzero.optim.fused_spec_of`: adam, adamw, lamb,
  lion, sgd, optionally after a global-norm clip), where :func:`fzero.optim.fused.fuses`
  says so, runs as those kernels, one launch per flat run of leaves;
* anything else runs as ``tx.update`` then :func:`~fzero.optim.apply_updates`. When the step
  owns its state (``donate``), each member whose record allows it writes its new moments
  into the old ones and ``apply_updates`` adds into the parameters; within the chain, a
  member overwrites the updates its predecessor just made. The same bits either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fzero.core import register_lowering
from fzero.optim import _known, fused
from fzero.optim.base import apply_updates

__all__ = ["lower"]


def lower(tx: Any) -> Callable[..., tuple[Any, Any]]:
    """``fn(grads, opt_state, params, *, donate) -> (params, opt_state)``: one update by ``tx``."""

    def step(grads, opt_state, params, *, donate: bool = False):
        out = fused.fused_update(tx, grads, opt_state, params, donate=donate)  # by name: tests watch it
        if out is not None:
            return out
        updates, opt_state = _known.update(tx, grads, opt_state, params, new=False, donate=donate)
        return apply_updates(params, updates, donate=donate), opt_state

    return step


register_lowering(lower)
