"""``clip``: clip each update's gradients to a global L2 norm, as ``torch.nn.utils.clip_grad_norm_``."""

from __future__ import annotations

from collections.abc import Callable

from fzero import optim
from fzero.core import Step, as_step, collecting_metrics, emit_metric
from fzero.transforms._checks import check_option

__all__ = ["clip"]

WHERE = "fzero.clip"


def clip(step: Callable, clip_norm: float) -> Step:
    """Clip the gradients of each update to the global L2 norm ``clip_norm``.

    What ``torch.nn.utils.clip_grad_norm_(params, clip_norm)`` before ``optimizer.step()``
    does: every gradient is multiplied by ``min(1, clip_norm / (norm + 1e-6))``, ``norm``
    the L2 norm of all the gradients together, and ``metrics["grad_norm"]`` is that norm
    before clipping (a 0-dim tensor). The clip joins the optimizer: ``init`` puts
    :func:`fzero.optim.clip_by_global_norm` in front of the state's ``tx`` (after the
    transforms inside have built their optimizer state), so the norm is the one of the
    update's final gradient -- reduced over ranks, unscaled, averaged over micro-batches --
    computed exactly on ZeRO shards and tensor-parallel slices, as DeepSpeed clips.
    ``fzero.compile(clip_norm=)`` makes it the innermost transform, which is what gives it
    that gradient whatever the other options; applied by hand outside a transform that
    rewrites the optimizer's step (``mixed_precision``, ``offload_optimizer``), it clips
    the gradient that transform hands the optimizer, which is the same one.

    torch and optax call the bound ``max_norm``, DeepSpeed's config ``gradient_clipping``.

    Args:
        step: ``train_step(state, batch) -> (state, metrics)``.
        clip_norm: the largest global L2 norm of an update's gradients, > 0.

    Returns:
        A :class:`fzero.transforms.Step`; its metrics gain ``grad_norm``.

    Raises:
        ValueError: ``clip_norm`` is not a positive number.

    Example:
        >>> import torch, fzero
        >>> from fzero import optim
        >>> apply, params = fzero.functionalize(torch.nn.Linear(2, 1, bias=False))
        >>> state = fzero.TrainState.create(apply_fn=apply, params={"weight": torch.zeros(1, 2)}, tx=optim.sgd(1.0))
        >>> def train_step(state, batch):
        ...     g = {"weight": torch.tensor([[3.0, 4.0]])}    # norm 5
        ...     return state.apply_gradients(g), {}
        >>> step = fzero.clip(train_step, clip_norm=1.0)
        >>> state, metrics = step(step.init(state), None)
        >>> float(metrics["grad_norm"]), state.params["weight"]
        (5.0, tensor([[-0.6000, -0.8000]]))
    """
    check_option(WHERE, "clip_norm", clip_norm)
    inner = as_step(step)
    clip_norm = float(clip_norm)

    def after(state):  # in front of the optimizer the inner transforms built the state for
        tx = optim.clip_by_global_norm(clip_norm)
        return state.replace(tx=optim.chain(tx, state.tx), opt_state=(tx.init(state.params), state.opt_state))

    def call(state, batch):
        # What the optimizer emits (grad_norm) joins this step's own metrics, so the
        # transform reports it used alone as well as under compile.
        with collecting_metrics() as emitted:
            state, metrics = inner(state, batch)
        for k, v in emitted.items():
            emit_metric(k, v)  # and on outwards, for enclosing collectors
        return state, {**metrics, **emitted}

    return Step(call, after=after, name=f"clip({inner.__name__})", inner=inner)
