"""The plain train step that tests hold transforms to, the loop that runs a step over
batches, plain PyTorch's run of the same training and its ranks' gradients, a rank's rows of a global batch, and a
small model with ZeRO-3 units.

Example:
    >>> import torch
    >>> import fzero, fzero.testing as ft
    >>> from fzero import optim
    >>> torch.manual_seed(0) and None
    >>> apply, params = fzero.functionalize(torch.nn.Linear(3, 2))
    >>> state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
    >>> batches = [{"x": torch.randn(4, 3), "y": torch.randn(4, 2)} for _ in range(3)]
    >>> state, losses = ft.run_steps(ft.mse_step, state, batches)
    >>> losses.shape, int(state.step)
    (torch.Size([3]), 3)
    >>> ft.local_batch(batches[0], 2, 1)["x"].shape
    torch.Size([2, 3])
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn.functional as F

import fzero

__all__ = ["Blocks", "local_batch", "mse_step", "run_steps", "shard_handler", "token_mean_step", "torch_mse_steps",
           "torch_rank_grads"]


class Blocks(torch.nn.Module):
    """An MLP whose hidden layers sit in a ModuleList: ZeRO-3 gathers them one by one (its
    units), and the input and output layers stay outside every unit.

    Example:
        >>> [n for n, _ in Blocks(2, 3, 1, 1).named_parameters()]
        ['inp.weight', 'inp.bias', 'blocks.0.0.weight', 'blocks.0.0.bias', 'out.weight', 'out.bias']
    """

    def __init__(self, d_in: int, width: int, depth: int, d_out: int):
        super().__init__()
        self.inp = torch.nn.Linear(d_in, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                          for _ in range(depth))
        self.out = torch.nn.Linear(width, d_out)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def mse_step(state: Any, batch: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
    """The plain train step: the mean squared error of ``state.apply_fn(params, batch["x"])``
    against ``batch["y"]``, its gradients by :func:`fzero.value_and_grad`, one update.

    A module-level function, so a multi-rank harness that pickles jobs by name (fzero's own,
    in ``tests/harness/``) can run it on every rank.

    Returns:
        ``(new state, {"loss": loss})``.
    """

    def loss_fn(p):
        return F.mse_loss(state.apply_fn(p, batch["x"]), batch["y"])

    loss, grads = fzero.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads), {"loss": loss}


def token_mean_step(state: Any, batch: dict[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
    """A language model's step with a token-mean loss: the cross-entropy of
    ``state.apply_fn(params, batch["ids"])`` against ``batch["y"]``, averaged with
    :func:`fzero.global_mean` over the targets that are not ``-100`` (so the whole global
    batch's mean at any layout), one update.

    Returns:
        ``(new state, {"loss": loss})``.
    """

    def loss_fn(p):
        logits = state.apply_fn(p, batch["ids"]).flatten(0, 1)
        y = batch["y"].flatten()
        ce = F.cross_entropy(logits, y.clamp(min=0), reduction="none")
        return fzero.global_mean(ce, where=y != -100)

    loss, grads = fzero.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads), {"loss": loss}


def run_steps(step: Callable, state: Any, batches) -> tuple[Any, torch.Tensor]:
    """Run ``step`` over ``batches``; return the last state and the losses, stacked."""
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(m["loss"])
    return state, torch.stack(losses)


def torch_mse_steps(model: torch.nn.Module, optimizer: Callable[[list], torch.optim.Optimizer],
                    batches) -> dict[str, torch.Tensor]:
    """What plain PyTorch makes of :func:`mse_step`'s training: a copy of ``model``'s
    parameters, trained by ``optimizer(parameters)`` (a ``torch.optim`` optimizer) with
    ``mse_loss`` and ``backward`` over ``batches`` (``{"x", "y"}`` each). Returns the trained
    parameters by name; ``model`` keeps its own."""
    ref = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    opt = optimizer(list(ref.values()))
    for b in batches:
        loss = F.mse_loss(torch.func.functional_call(model, ref, (b["x"],)), b["y"])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {n: p.detach() for n, p in ref.items()}


def torch_rank_grads(module: torch.nn.Module, batch: dict[str, torch.Tensor], world_size: int, *,
                     autocast: torch.dtype | None = None) -> tuple[float, list[dict[str, torch.Tensor]]]:
    """Plain PyTorch's data-parallel gradients before their reduction: for each of
    ``world_size`` ranks, module + backward of ``mse_loss`` on its rows of ``batch``
    (``{"x", "y"}``, cut as :func:`local_batch` cuts them), the forward under
    ``torch.autocast("cpu", autocast)`` when ``autocast`` is a dtype. Returns the ranks' mean
    loss and each rank's gradients by name; ``module``'s ``.grad`` are the last rank's."""
    loss, grads = 0.0, []
    for x, y in zip(batch["x"].chunk(world_size), batch["y"].chunk(world_size)):
        module.zero_grad()
        with torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext():
            out = F.mse_loss(module(x), y)
        out.backward()
        loss += float(out.detach()) / world_size
        grads.append({n: p.grad.clone() for n, p in module.named_parameters()})
    return loss, grads


def shard_handler(step: Any) -> Any:
    """The ``shard_state`` handler inside a compiled step (steps nest by ``inner``): its
    ``layout``, and at stage 3 its ``units`` (each module's group, the kept ones), after
    ``step.init``.

    Example:
        >>> import fzero, fzero.testing as ft
        >>> ft.shard_handler(fzero.compile(ft.mse_step, zero=2)).stage
        2
    """
    while not hasattr(step, "handler"):
        step = step.inner
    return step.handler


def local_batch(batch: Any, world_size: int, rank: int) -> Any:
    """Rank ``rank``'s rows of a global batch: every leaf cut on its leading axis into
    ``world_size`` chunks (as ``Tensor.chunk``), the ``rank``-th kept."""
    return fzero.tree.map(lambda v: v.chunk(world_size)[rank], batch)
