"""How a state's optimizer makes one update: the lowering ``fzero.core``'s ``update`` runs.

An optimizer is optax's pair ``(init, update)``; one update of a state is ``tx.update`` and
:func:`fzero.optim.apply_updates`. Where the chain is one the fused kernels know (adam, adamw,
lamb, lion, sgd, alone or after a global-norm clip: :mod:`fzero.optim.fused`), the update runs
as those kernels instead, and when the step owns its state (``donate``) it is written in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fzero.core import register_lowering
from fzero.optim.base import _update as update_of
from fzero.optim.base import apply_updates
from fzero.optim.fused import fused_update

__all__ = ["lower"]


def lower(tx: Any) -> Callable[..., tuple[Any, Any]]:
    """``fn(grads, opt_state, params, *, donate) -> (params, opt_state)``: one update by ``tx``."""

    def step(grads, opt_state, params, *, donate: bool = False):
        fused = fused_update(tx, grads, opt_state, params, donate=donate)
        if fused is not None:
            return fused
        updates, opt_state = update_of(tx, grads, opt_state, params, new=False, donate=donate)
        return apply_updates(params, updates, donate=donate), opt_state

    return step


register_lowering(lower)
