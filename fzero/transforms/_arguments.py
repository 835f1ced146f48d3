"""Differentiated arguments beside the parameters, under data parallelism.

``fzero.value_and_grad(fn, argnums=(0, 1))(state.params, x)`` asks for the gradient of
the parameters and of ``x``. Under ``shard_state`` the parameters are the state's: sharded,
and their gradient reduced over ``dp`` as always. Any other differentiated argument is
this rank's own data (its part of the global batch, as ``x`` is): its gradient is this
rank's part of the gradient of the global loss, which is the mean of the ranks' losses, so
``1/N`` of the rank's own gradient -- the rows one process would compute for these
examples of the whole batch (as ``jax.grad`` gives for an argument sharded like the batch).

A tensor that is the same on every rank is not data but a replicated value, whose gradient
would be the mean over ranks; fzero cannot tell the two apart from the values, and a
replicated value that is trained belongs in ``state.params``. So a differentiated argument
that is bit-identical on every rank is refused, naming it (one small all-gather of
checksums per call, only when ``argnums`` selects something other than the parameters).

The handler does the work by differentiating one dict: the parameters under their names
and each argument leaf under a key that sorts before every name (:data:`KEY`); the reduce
sink keeps those leaves' gradients local.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fzero import tree
from fzero._params import frozen_names, like_params, with_values
from fzero.distributed import comm

__all__ = ["KEY", "Arguments", "is_argument"]

KEY = "\x00arg"  # the prefix of an argument leaf's key in the differentiated dict


def is_argument(name: Any) -> bool:
    return isinstance(name, str) and name.startswith(KEY)


class Arguments:
    """The differentiated tuple ``diff`` as one dict, and the way back.

    Args:
        diff: the differentiated arguments (a tuple; one element when ``argnums`` is an int).
        names: every name of the state's parameters: the element whose keys are exactly
            these is the parameters.
        where: the caller, for messages.
    """

    def __init__(self, diff: tuple, names: set[str], where: str):
        at = [j for j, d in enumerate(diff) if isinstance(d, dict) and set(d) == names]
        if len(at) > 1:
            raise TypeError(f"{where}: value_and_grad differentiates the state's parameters twice "
                            f"(arguments {at} of argnums)")
        self.diff, self.where = diff, where
        self.at = at[0] if at else None
        self.specs: dict[int, Any] = {}
        self.keys: dict[int, list[str]] = {}
        leaves: dict[str, Any] = {}
        for j, d in enumerate(diff):
            if j == self.at:
                continue
            lv, self.specs[j] = tree.flatten(d)
            self.keys[j] = [f"{KEY}{j:04d}.{i:06d}" for i in range(len(lv))]
            leaves.update(zip(self.keys[j], lv))
        self.leaves = leaves
        base = diff[self.at] if self.at is not None else {}
        combined = {**base, **leaves}
        self.combined = like_params(base, combined, frozen_names(base))

    def call(self, fn: Callable, single: bool) -> Callable:
        """``fn`` (of the tuple, or of its one element if ``single``) as a function of the
        combined dict."""

        def wrapped(p, *args, **kwargs):
            d = self.split(p)
            return fn(d[0] if single else d, *args, **kwargs)

        return wrapped

    def split(self, combined: dict) -> tuple:
        """The tuple ``diff`` with every value taken from ``combined`` (values or gradients)."""
        out = []
        for j, d in enumerate(self.diff):
            if j == self.at:
                out.append(with_values(d, {k: combined[k] for k in d}))
            else:
                out.append(tree.unflatten(self.specs[j], [combined[k] for k in self.keys[j]]))
        return tuple(out)

    def check_per_rank(self, group, world: int, timeout_s: float) -> None:
        """Refuse an argument leaf that holds the same values on every rank (see the module
        docstring): one all-gather of two checksums per leaf."""
        tensors = [(k, x) for k, x in self.leaves.items() if isinstance(x, torch.Tensor) and x.is_floating_point()]
        if world == 1 or not tensors:
            return
        sums = []
        for _, x in tensors:
            v = x.detach().reshape(-1).double()
            ramp = torch.arange(1, v.numel() + 1, dtype=torch.float64, device=v.device)
            sums += [v.sum(), (v * ramp).sum()]
        mine = torch.stack(sums)
        every = torch.empty(world * mine.numel(), dtype=mine.dtype, device=mine.device)
        comm.run("all_gather(checksums of value_and_grad's arguments)",
                 lambda: comm.all_gather_flat(every, mine, group=group, async_op=True, what="metadata"),
                 timeout_s=timeout_s, where=self.where)
        every = every.view(world, -1)
        same = [k for i, (k, _) in enumerate(tensors)
                if bool((every[:, 2 * i: 2 * i + 2] == mine[2 * i: 2 * i + 2]).all())]
        if same:
            where = [self._describe(k) for k in same]
            raise TypeError(
                f"{self.where}: value_and_grad differentiates {', '.join(where)}, which "
                f"{'is' if len(where) == 1 else 'are'} not the state's parameters and hold"
                f"{'s' if len(where) == 1 else ''} the same values on every one of the {world} dp ranks. "
                "An argument other than the parameters is taken as this rank's data (its part of the "
                "batch), whose gradient is this rank's share of the global one; a value replicated on "
                "every rank would need the mean over ranks instead. Put a tensor you train into "
                "state.params (it is then reduced like every parameter), or give each rank its own data")

    def _describe(self, key: str) -> str:
        j, i = int(key[len(KEY): len(KEY) + 4]), int(key[len(KEY) + 5:])
        paths = tree.paths(self.diff[j])
        return f"argument {j} of argnums" + (f" at {tree.keystr(paths[i])}" if paths and paths[i] else "")
