"""Tied weights: a parameter name owned by several stages (an embedding used again as the
head). Each holder keeps a copy; after the schedule their gradients are summed over the
holders, so the copies get the same update and stay equal."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from fzero.transforms.pipeline._stages import Stage

if TYPE_CHECKING:
    from fzero.distributed.p2p import Channel


def tied_weights(stages: Sequence[Stage]) -> dict[str, tuple[int, ...]]:
    """Each name owned by more than one stage -> the stages holding it, in stage order."""
    holders: dict[str, list[int]] = {}
    for i, s in enumerate(stages):
        for k in s.keys:
            holders.setdefault(k, []).append(i)
    return {k: tuple(h) for k, h in holders.items() if len(h) > 1}


def sum_tied_grads(params: dict, targets: list, acc: list, *, tied: dict[str, tuple[int, ...]], stage: int,
                   channel: Channel, device: torch.device) -> None:
    """Sum the gradients of each tied weight over the stages holding it.

    Every holder sends its gradients of the weights it shares with another holder and
    receives theirs (point to point, tag 1), then adds them in stage order, so every
    holder gets the same bits and its copy stays equal to the others after the update.
    ``params`` are this stage's trainable parameters by name; ``acc`` the accumulated
    gradients of ``targets`` (the tensors differentiated), summed into in place.
    """
    s = stage
    shared = {h: [n for n, hs in sorted(tied.items()) if s in hs and h in hs and n in params]
              for h in range(channel.size) if h != s}
    shared = {h: ns for h, ns in shared.items() if ns}
    if not shared:
        return
    mine = {}
    for ns in shared.values():
        for n in ns:
            mine[n] = _grad_of(params[n], targets, acc)
    for h, ns in shared.items():
        channel.isend(torch.cat([mine[n].float().reshape(-1) for n in ns]), h,
                      f"the gradients of tied weights {ns}", what="tied_gradients", tag=1)
    received: dict[int, dict[str, torch.Tensor]] = {}
    for h, ns in shared.items():
        buf = torch.empty(sum(mine[n].numel() for n in ns), dtype=torch.float32, device=device)
        channel.recv(buf, h, f"the gradients of tied weights {ns} (stage {h} -> {s})", what="tied_gradients", tag=1)
        parts = buf.split([mine[n].numel() for n in ns])
        received[h] = {n: t.view(mine[n].shape) for n, t in zip(ns, parts)}
    channel.flush()
    for n, g in mine.items():
        parts = [g.float() if h == s else received[h][n] for h in tied[n]]
        total = parts[0].clone()
        for t in parts[1:]:
            total += t
        g.copy_(total)


def _grad_of(p: torch.Tensor, targets: list, acc: list) -> torch.Tensor:
    """The accumulated gradient of parameter ``p``, as a view into ``acc`` (made zeros
    where nothing reached it), whether ``p`` is a target itself or a view of one."""
    for i, t in enumerate(targets):
        if t is p or p._base is t:
            if acc[i] is None:
                acc[i] = torch.zeros(t.shape, dtype=torch.float32, device=t.device)
            if t is p:
                return acc[i]
            return acc[i].as_strided(p.shape, p.stride(), p.storage_offset() - t.storage_offset())
    raise AssertionError("unreachable: every parameter is a target or a view of one")
