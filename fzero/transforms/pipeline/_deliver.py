"""How one pipelined step looks like one differentiable function to ``value_and_grad``: the
schedule's accumulated gradients handed out by the backward of :class:`_Deliver`, for the
tensors :func:`_targets` says the schedule differentiates."""

from __future__ import annotations

import torch


class _Deliver(torch.autograd.Function):
    """Returns the loss; its backward hands out the gradients the schedule accumulated.

    This is how one pipelined step looks like one differentiable function to the
    ``value_and_grad`` primitive: whatever asked for gradients of the parameters (the plain
    engine, ZeRO's reduce-as-you-go sink, a cast to fp32 masters) receives them through
    the autograd engine as if the step's backward had produced them. ``seed`` is the
    gradient the schedule seeded the loss with; the incoming gradient divided by it is
    exactly 1.0 in the usual case, so the hand-over adds no rounding.
    """

    @staticmethod
    def forward(ctx, loss, seed, grads, *params):
        ctx.seed, ctx.grads = seed, grads
        ctx.dtypes = [p.dtype for p in params]
        return loss.clone()

    @staticmethod
    def backward(ctx, g):
        grads, ctx.grads = ctx.grads, None
        factor = g.float() / ctx.seed
        out = [None if a is None else (a * factor).to(dt) for a, dt in zip(grads, ctx.dtypes)]
        return (None, None, None, *out)


def _targets(ptensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """What the schedule differentiates: each parameter, or the tensor it is a view of.

    A transform may hand the stage views into flat buffers (ZeRO); re-gathering a ZeRO-3
    unit writes its buffer in place, which gives the views new autograd nodes, so a
    micro-batch's graph is only found again from the buffer itself. Gradients of the
    buffers are what ``value_and_grad`` wants anyway."""
    out, seen = [], set()
    for p in ptensors:
        t = p._base if p._base is not None and p._base.requires_grad else p
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out
