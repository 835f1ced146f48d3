"""ZeRO's collectives on parameters and buffers, as plain functions of explicit arguments.

As FSDP2's ``_fsdp_collectives.py``: the lifecycle code (``_units.py``, the handler in
``_transform.py``) decides *when*; these say *what* moves, over which group, with which
name (every collective's name is in its error) and timeout. Gradient reductions are in
``_reduce.py``.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

from fzero.distributed import comm
from fzero.transforms.shard_state._layout import Group, Layout
from fzero.transforms.shard_state._shard import Shard

__all__ = ["all_gather_params", "start_all_gather", "sync_buffers"]

WHERE = "fzero.shard_state"


def start_all_gather(g: Group, own: torch.Tensor, full: torch.Tensor, *, group, world: int,
                     prefetch: bool = False) -> comm.Pending:
    """Start gathering group ``g``'s flat buffer into ``full`` from every rank's ``own`` slice
    (:meth:`Group.pack_own`). In a world of one, ``own`` is copied in at once. ``own`` must
    stay alive until the returned :class:`comm.Pending` is waited on."""
    name = f"all_gather(parameter group {g.index}, {g.padded} elements{', prefetch' if prefetch else ''})"
    if world == 1:
        full.copy_(own)
        return comm.Pending(name, None, None, WHERE)
    return comm.start(name, lambda: comm.all_gather_flat(full, own, group=group, async_op=True, what="parameters"),
                      where=WHERE)


def all_gather_params(layout: Layout, pieces: dict[str, Shard], *, group, world: int, timeout_s: float,
                      into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Full parameters, by name, from every rank's pieces: one all-gather per group (stages
    1-2, after the update), every group's started before the first is waited on.

    Each group is gathered into the flat buffer the parameters ``into`` view, when given
    and laid out so (the step owns its input state: no fresh parameter-sized buffer a step;
    the pieces an update in place wrote are already in the own slice, and nothing is
    copied), else into a fresh one (parameters a user or a loader put in the state).

    Example (a world of one):
        >>> from fzero.transforms.shard_state._layout import build_layout
        >>> params = {"w": torch.arange(4.)}
        >>> layout = build_layout(params, world=1, rank=0)
        >>> all_gather_params(layout, layout.shard_params(params), group=None, world=1, timeout_s=1.0)["w"].tolist()
        [0.0, 1.0, 2.0, 3.0]
        >>> full = layout.regroup({"w": torch.zeros(4)})
        >>> out = all_gather_params(layout, layout.shard_params(params), group=None, world=1, timeout_s=1.0,
        ...                         into=full)
        >>> out["w"].tolist(), out["w"] is full["w"]
        ([0.0, 1.0, 2.0, 3.0], True)
    """
    flats = _flat_buffers(layout, into) if into is not None else None
    works, out = [], {}
    for g in layout.groups:
        if flats is None:
            flat = torch.empty(g.padded, dtype=g.dtype, device=g.device)
            flat[slice(*g.owned)].zero_()  # the padding this rank sends is zero, as pack_own's
        else:
            flat = flats[g.index]
        own = flat[slice(*g.owned)]
        base, size = own.data_ptr(), own.element_size()
        for name, at in zip(g.names, g._placed(None)[1]):  # where each piece sits in the own slice
            piece = pieces[name].local
            if piece.data_ptr() != base + at.start * size:  # not already there (an update in place)
                own[at].copy_(piece.reshape(-1))
        if world > 1:
            works.append(start_all_gather(g, own, flat, group=group, world=world))
        out.update(zip(g.names, g.views(flat)) if flats is None else ((n, into[n]) for n in g.names))
    for work in works:
        work.wait(timeout_s)
    return out


def _flat_buffers(layout: Layout, full: dict[str, torch.Tensor]) -> list[torch.Tensor] | None:
    """The flat buffer each group's parameters in ``full`` view (:meth:`Group.flat_of`), or
    ``None`` when one group's are not laid out so."""
    flats = [g.flat_of(full) for g in layout.groups]
    return None if any(f is None for f in flats) else flats


def sync_buffers(buffers: dict[str, torch.Tensor], *, mode: Literal["broadcast", "mean", "local"], group,
                 world: int, timeout_s: float) -> None:
    """Make the model's buffers identical on every ``dp`` rank, in place.

    ``"broadcast"`` gives every rank dp-rank 0's buffers, as DDP's ``broadcast_buffers``
    does before each forward; here it happens after the step, so the state is identical
    everywhere when the step returns (and checkpoints agree). ``"mean"`` averages
    floating-point buffers over the ranks (running statistics of the global batch, as
    SyncBatchNorm's would be) and broadcasts the others. ``"local"`` does nothing. One
    collective per dtype: the buffers are packed into one flat tensor each.
    """
    if world == 1 or not buffers or mode == "local":
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for b in buffers.values():
        by_dtype.setdefault(b.dtype, []).append(b)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    for dtype, bs in by_dtype.items():
        flat = torch.cat([b.reshape(-1) for b in bs])
        if mode == "mean" and dtype.is_floating_point:
            comm.run(f"all_reduce(buffers, {dtype}, {flat.numel()} elements)",
                     lambda: comm.all_reduce(flat, group=group, async_op=True, what="buffers"),
                     timeout_s=timeout_s, where=WHERE)
            flat.div_(world)
        else:
            comm.run(f"broadcast(buffers, {dtype}, {flat.numel()} elements)",
                     lambda: comm.broadcast(flat, src=src, group=group, async_op=True, what="buffers"),
                     timeout_s=timeout_s, where=WHERE)
        o = 0
        for b in bs:
            b.copy_(flat[o: o + b.numel()].view_as(b))
            o += b.numel()
