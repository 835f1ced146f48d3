"""Marks in a backward pass, for tests that check what happens while it runs."""

from __future__ import annotations

import torch

__all__ = ["REACHED_FIRST_LAYER", "BackwardReached"]

REACHED_FIRST_LAYER = "backward reached the first layer"


class BackwardReached(torch.autograd.Function):
    """Identity on ``x``; its backward appends :data:`REACHED_FIRST_LAYER` to ``seen``. Put
    after a model's first layer, it says when all that is left of backward is that layer's
    own gradients.

    Example:
        >>> seen = []
        >>> x = torch.ones(2, requires_grad=True)
        >>> BackwardReached.apply(x * 2, seen).sum().backward()
        >>> seen
        ['backward reached the first layer']
    """

    @staticmethod
    def forward(ctx, x, seen):
        ctx.seen = seen
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.seen.append(REACHED_FIRST_LAYER)
        return g, None
