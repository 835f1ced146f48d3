"""``accumulate``: gradient accumulation over micro-batches."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fzero import means, tree
from fzero.transforms._checks import check_option
from fzero.core import Handler, MicroBatch, NotApplied, Step, as_step, context, installed, running
from fzero.transforms._batches import split_batch
from fzero.transforms._deferred import is_deferred

__all__ = ["accumulate"]

WHERE = "fzero.accumulate"


def _scaled(g, k: int):
    if is_deferred(g):
        return g
    # Low-precision gradients are summed in fp32 (k bf16 additions lose bits fast), so the
    # sum is the same whether a precision transform unscales before or after it.
    return (g.float() if g.dtype in (torch.bfloat16, torch.float16) else g) / k


def _sum(a, b):
    # A deferred gradient adds nothing here: the reducer holding it adds it into the
    # gradient it returns at the update's last micro-batch.
    if is_deferred(a):
        return b
    if is_deferred(b):
        return a
    return a + b


class _AccumulateHandler(Handler):
    """Defers ``apply_gradients`` for the first k-1 micro-batches (summing ``grads / k``)
    and passes the accumulated gradient on at the k-th, from inside the inner step, so the
    call still runs under every handler inside and outside this one. (Which micro-batch runs
    is in the step context, set by the loop in ``accumulate``.)"""

    def __init__(self, k: int):
        self.k = k
        self.seen = 0
        self.total = None

    def apply_gradients(self, state, grads, *, next):
        self.seen += 1
        scaled = tree.map(lambda g: _scaled(g, self.k), grads)
        # Whatever the gradients are (full tensors, or this rank's ZeRO pieces), the sum
        # has their structure: the accumulator is as partitioned as they are.
        self.total = scaled if self.total is None else tree.map(_sum, self.total, scaled)
        if self.seen < self.k:
            return NotApplied(state, "deferred")
        total, self.total = self.total, None
        return next(state, total)


def _mean_metrics(all_metrics: list[dict]) -> dict:
    out = {}
    for key in all_metrics[-1]:
        vals = [m[key] for m in all_metrics if key in m]
        if all(isinstance(v, torch.Tensor) and v.is_floating_point() for v in vals) and len(vals) == len(all_metrics):
            out[key] = torch.stack([v.detach() for v in vals]).mean(0)
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals) and len(vals) == len(all_metrics):
            out[key] = sum(vals) / len(vals)
        else:
            out[key] = vals[-1]
    return out


def accumulate(step: Callable, micro_batches: int) -> Step:
    """Accumulate gradients over ``micro_batches`` micro-batches, then update once.

    The local batch is split on its leading dim into ``k`` equal micro-batches; the inner
    step runs on each; their gradients are averaged (so a mean loss gives the full batch's
    gradient, as DeepSpeed and optax's ``MultiSteps`` do) and applied once. Floating-point
    metrics are averaged over the micro-batches; others are taken from the last.

    Args:
        step: ``train_step(state, batch) -> (state, metrics)``.
        micro_batches: ``k``, a positive int.

    Raises:
        ValueError: ``k`` is not a positive int; at call time, a batch whose leading size
            does not divide by ``k`` (naming both numbers).

    Example:
        >>> import torch, fzero
        >>> from fzero import optim
        >>> apply, params = fzero.functionalize(torch.nn.Linear(2, 1))
        >>> state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
        >>> def train_step(state, batch):
        ...     loss, g = fzero.value_and_grad(lambda p: state.apply_fn(p, batch).pow(2).mean())(state.params)
        ...     return state.apply_gradients(g), {"loss": loss}
        >>> step = fzero.accumulate(train_step, micro_batches=2)
        >>> state, metrics = step(step.init(state), torch.ones(4, 2))
        >>> int(state.step)
        1
    """
    check_option(WHERE, "micro_batches", micro_batches)
    inner = as_step(step)
    k = micro_batches

    def call(state, batch):
        parts = split_batch(batch, k, where=WHERE)
        handler = _AccumulateHandler(k)
        metrics = []
        outer = context().micro_batch  # an accumulation inside another cuts each of its micro-batches again
        with installed(handler):
            for i, mb in enumerate(parts):
                with running(micro_batch=MicroBatch(outer.index * k + i, outer.count * k)):
                    state, m = inner(state, mb)
                metrics.append(m)
        if handler.seen not in (0, k):
            raise RuntimeError(f"{WHERE}: the step applied gradients in {handler.seen} of {k} micro-batches; "
                               "it must apply them once per micro-batch")
        means.settle()  # the global means' count is whole now: their values are final before averaging
        return state, _mean_metrics(metrics)

    return Step(call, name=f"accumulate({inner.__name__}, {k})", inner=inner)
