"""Whole-tensor updates under ZeRO: each partitioned leaf gets an owner rank.

Under ZeRO stages 1-3 an optimizer sees this rank's piece of each leaf: a contiguous run of
the leaf's flattened elements, which may start or stop in the middle of a row. That is
enough for an element-wise optimizer (Adam, SGD, ...). An optimizer whose update of a
tensor reads the whole tensor -- Adafactor's row and column moments, Muon's
orthogonalisation, a norm of the whole parameter -- would compute something else on a
piece. For those, every partitioned leaf has one *owner* rank:

1. every rank sends its pieces of the gradient and of the parameter of every such leaf
   (one all-gather of one packed buffer per update);
2. the owner puts its leaves together whole and updates them with the state it alone keeps;
3. the owners send the whole updates back (a second all-gather), and every rank takes its
   own piece of each.

Owners are balanced by size: leaves in decreasing size, each to the rank that owns the
fewest elements so far (ties to the lower rank), so per-rank optimizer state stays about
1/N of the whole. The assignment depends only on the leaves' shapes and the world size, so
``init`` and every ``update`` (on every rank, and after a checkpoint is resharded) agree.

An owner's state of a leaf is kept as a partitioned leaf too: a ``Shard`` whose metadata
puts all of its elements on the owner (offset ``owner * n``, chunk ``n``) and none on the
other ranks. Checkpoints then save and reshard it as any other partitioned leaf, and a
checkpoint saved with one owner loads onto another.

Both all-gathers move every rank's contribution to every rank (the traffic of a stage-3
parameter gather), not only to the owner: one collective per direction per update, whatever
the number of leaves. Leaves that are not partitioned (stage 0, or a world of one) are
updated where they are, on every rank that holds them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist

from fzero import tree

from fzero.distributed import comm
from fzero.distributed.mesh import DEFAULT_TIMEOUT_S

__all__ = ["LeafState", "assign_owners", "is_piece", "owned_leaf", "present", "run_whole"]

WHERE = "fzero.optim (whole-tensor update)"


class LeafState(dict):
    """What an optimizer keeps for one parameter: tensors by name (``exp_avg``, ``v_row``,
    ``step``, ...), a pytree node, so a state keyed like the parameters reads
    ``['w']['exp_avg']`` in key paths and checkpoints."""


optree.register_pytree_node(
    LeafState,
    lambda d: (tuple(d.values()), tuple(d.keys()), tuple(d.keys())),
    lambda keys, values: LeafState(zip(keys, values)),
    path_entry_type=optree.MappingEntry,
    namespace=tree.NAMESPACE,
)


def is_leaf_state(x: Any) -> bool:
    return isinstance(x, LeafState)


def is_piece(x: Any) -> bool:
    """A partitioned leaf (ZeRO's ``Shard``): a node with this rank's piece and its metadata."""
    return hasattr(x, "__fzero_meta__")


def refuse_split(where: str, params: Any) -> None:
    """A whole-tensor optimizer cannot update a ``tensor_parallel`` slice: refuse, naming the
    split parameters (a split parameter's owner would have to gather it over ``tp`` too)."""
    splits = getattr(getattr(params, "layout", None), "splits", ())
    if splits:
        names = [name for name, _ in splits]
        raise NotImplementedError(
            f"{where}: a whole-tensor optimizer (its update of a parameter reads the whole parameter) under "
            f"tensor_parallel, which splits {names} over the tp axis: not supported; give those parameters an "
            f"element-wise optimizer (fzero.optim.masked), or train without tp")


def present(leaves: list) -> list[int]:
    """Indices of the leaves that are there: a partitioned leaf that ``masked`` took out of
    an inner transformation's tree is a node with ``None`` for its piece."""
    return [i for i, x in enumerate(leaves) if not (is_piece(x) and x.local is None)]


def assign_owners(numels: Sequence[int], world: int) -> list[int]:
    """The owner rank of each leaf, by size: largest first, each to the least loaded rank.

    Example:
        >>> assign_owners([10, 1, 8, 3], 2)
        [0, 0, 1, 1]
    """
    load = [0] * world
    owner = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += numels[i]
    return owner


def owned_leaf(like: Any, value: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, owner: int):
    """A leaf of ``shape`` that lives whole on ``owner``: a partitioned leaf of ``like``'s kind
    whose piece is the whole flattened ``value`` on the owner and empty elsewhere."""
    info = like.info
    n = math.prod(shape)
    new = dataclasses.replace(info, shape=tuple(shape), offset=owner * n, chunk=n)
    if info.rank == owner:
        local = value.reshape(-1) if value is not None else torch.zeros(n, dtype=dtype, device=like.local.device)
    else:
        local = torch.empty(0, dtype=dtype, device=like.local.device)
    return type(like)(local, new)


def _collective_device(t: torch.Tensor, group) -> torch.device:
    if t.device.type != "cpu":
        return t.device
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return t.device


def _all_gather(name: str, send: torch.Tensor, sizes: list[int], group) -> list[torch.Tensor]:
    """Every rank's ``send`` (``sizes[r]`` elements on rank ``r``, known to every rank from the
    leaves' metadata; padded to the longest), one row per rank."""
    world = len(sizes)
    width = max(sizes)
    device = _collective_device(send, group)
    padded = torch.zeros(width, dtype=send.dtype, device=device)
    padded[: send.numel()] = send
    recv = torch.empty(width * world, dtype=send.dtype, device=device)
    comm.run(f"all_gather({name})", lambda: comm.all_gather_flat(recv, padded, group=group, async_op=True,
                                                                  what="optimizer"),
             timeout_s=DEFAULT_TIMEOUT_S, where=WHERE)
    recv = recv.to(send.device)
    return [recv[r * width: r * width + sizes[r]] for r in range(world)]


Whole = tuple[torch.Tensor, torch.Tensor, dict]  # (gradient, parameter, state), whole tensors
StepFn = Callable[[list[int], list[Whole]], list[tuple[torch.Tensor, dict]]]


def run_whole(grads: list, params: list, states: list[dict], step: StepFn) -> tuple[list, list[dict]]:
    """Update whole tensors: ``step(indices, [(g, p, state), ...]) -> [(update, state), ...]``
    sees whole gradients, parameters and states (state leaves in their own shapes) of the
    leaves this rank updates; returns the updates (pieces where the leaves were pieces) and
    the new states, in the order of ``grads``.

    ``grads``/``params`` are plain tensors (updated here, on every rank that holds them) or
    partitioned leaves (updated by their owner; ``states`` then hold owner leaves made by
    :func:`owned_leaf`).
    """
    n = len(grads)
    updates: list = [None] * n
    new_states: list[dict] = list(states)
    plain = [i for i in range(n) if not is_piece(grads[i])]
    split = [i for i in range(n) if is_piece(grads[i])]
    if plain:
        for i, (u, s) in zip(plain, step(plain, [(grads[i], params[i], states[i]) for i in plain])):
            updates[i], new_states[i] = u, s
    if not split:
        return updates, new_states
    info0 = grads[split[0]].info
    world, rank, group = info0.world, info0.rank, info0.group
    shapes = [tuple(grads[i].info.shape) for i in split]
    owners = assign_owners([math.prod(s) for s in shapes], world)
    mine = [k for k, i in enumerate(split) if owners[k] == rank]

    def whole_state(i):
        return {name: (v.local.reshape(v.info.shape) if is_piece(v) else v) for name, v in states[i].items()}

    if world == 1:
        wholes = [(grads[i].local.reshape(s), params[i].local.reshape(s), whole_state(i))
                  for i, s in zip(split, shapes)]
        results = step(split, wholes)
    else:
        # 1. every rank's pieces of every leaf's gradient and parameter, to every rank
        dtype = params[split[0]].local.dtype
        for i in split:
            dtype = torch.promote_types(dtype, torch.promote_types(grads[i].local.dtype, params[i].local.dtype))
        send = torch.cat([x.local.reshape(-1).to(dtype) for i in split for x in (grads[i], params[i])]) \
            if split else torch.empty(0, dtype=dtype)
        sizes = [sum(2 * (b - a) for a, b in (grads[i].info.piece(r) for i in split)) for r in range(world)]
        rows = _all_gather("gradients and parameters to their owners", send, sizes, group)
        wholes = []
        for k in mine:
            i = split[k]
            g_parts, p_parts = [], []
            for r in range(world):
                at = 0
                for kk, ii in enumerate(split):
                    a, b = grads[ii].info.piece(r)
                    if kk == k:
                        g_parts.append(rows[r][at: at + (b - a)])
                        p_parts.append(rows[r][at + (b - a): at + 2 * (b - a)])
                    at += 2 * (b - a)
            g = torch.cat(g_parts).reshape(shapes[k]).to(grads[i].local.dtype)
            p = torch.cat(p_parts).reshape(shapes[k]).to(params[i].local.dtype)
            wholes.append((g, p, whole_state(i)))
        results = step([split[k] for k in mine], wholes)
    # 3. the whole updates back from their owners; each rank keeps its pieces
    done = dict(zip(mine if world > 1 else range(len(split)), results))
    for k, (u, s) in done.items():
        i = split[k]
        new_states[i] = {name: (owned_leaf(states[i][name], v, tuple(v.shape), v.dtype, rank)
                                if is_piece(states[i][name]) else v) for name, v in s.items()}
    if world == 1:
        for k, i in enumerate(split):
            updates[i] = type(grads[i])(done[k][0].reshape(-1), grads[i].info)
        return updates, new_states
    dtype = params[split[0]].local.dtype  # the same on every rank, whatever it owns
    for i in split:
        dtype = torch.promote_types(dtype, params[i].local.dtype)
    send = torch.cat([u.reshape(-1).to(dtype) for u, _ in results]) if results else torch.empty(0, dtype=dtype)
    sizes = [sum(math.prod(s) for s, o in zip(shapes, owners) if o == r) for r in range(world)]
    rows = _all_gather("updates from their owners", send, sizes, group)
    at = [0] * world
    for k, i in enumerate(split):
        o, numel = owners[k], math.prod(shapes[k])
        a, b = grads[i].info.piece()
        piece = rows[o][at[o] + a: at[o] + b]
        at[o] += numel
        updates[i] = type(grads[i])(piece.to(params[i].local.dtype).clone(), grads[i].info)
    return updates, new_states
