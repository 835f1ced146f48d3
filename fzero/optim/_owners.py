"""Whole-tensor updates under ZeRO: each partitioned leaf gets an owner rank.

Under ZeRO stages 1-3 an optimizer sees this rank's piece of each leaf: a contiguous run of
the leaf's flattened elements, which may start or stop in the middle of a row. That is
enough for an element-wise optimizer (Adam, SGD, ...). An optimizer whose update of a
tensor reads the whole tensor -- Adafactor's row and column moments, Muon's
orthogonalisation, a norm of the whole parameter -- would compute something else on a
piece. For those, every partitioned leaf has one *owner* rank:

1. every rank sends its pieces of the gradient and of the parameter of each such leaf to the
   leaf's owner (one all-to-all of one packed buffer per update);
2. the owner puts its leaves together whole and updates them with the state it alone keeps;
3. the owner sends each rank its piece of each whole update (a second all-to-all).

Owners are balanced by size: leaves in decreasing size, each to the rank that owns the
fewest elements so far (ties to the lower rank), so per-rank optimizer state stays about
1/N of the whole. The assignment depends only on the leaves' shapes and the world size, so
``init`` and every ``update`` (on every rank, and after a checkpoint is resharded) agree.

An owner's state of a leaf is kept as a partitioned leaf too: a ``Shard`` whose metadata
puts all of its elements on the owner (offset ``owner * n``, chunk ``n``) and none on the
other ranks. Checkpoints then save and reshard it as any other partitioned leaf, and a
checkpoint saved with one owner loads onto another.

Each element crosses the wire at most once each way, and a rank holds whole only the
leaves it owns: one collective per direction per update, whatever the number of leaves. Leaves that are not partitioned (stage 0, or a world of one) are
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
    here = params if isinstance(params, dict) else {}
    names = [name for name, _ in splits if here.get(name) is not None and getattr(here[name], "local", 0) is not None]
    if names:
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


def _all_to_all(name: str, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> list[torch.Tensor]:
    """``send_splits[r]`` elements of ``send`` to rank ``r``; what each rank sent here, one
    tensor per rank (the splits are known to every rank from the leaves' metadata)."""
    device = _collective_device(send, group)
    out = torch.empty(sum(recv_splits), dtype=send.dtype, device=device)
    comm.run(f"all_to_all({name})",
             lambda: comm.all_to_all_flat(out, send.to(device), recv_splits, send_splits, group=group,
                                          async_op=True, what="optimizer"),
             timeout_s=DEFAULT_TIMEOUT_S, where=WHERE)
    return list(out.to(send.device).split(recv_splits))


def _owned_state(old: dict, new: dict, rank: int) -> dict:
    """The owner's new state of a leaf, each tensor a leaf that lives whole on ``rank``
    (plain where the old one was plain)."""
    return {name: (owned_leaf(old[name], v, tuple(v.shape), v.dtype, rank) if is_piece(old[name]) else v)
            for name, v in new.items()}


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
        results = step(split, [(grads[i].local.reshape(s), params[i].local.reshape(s), whole_state(i))
                               for i, s in zip(split, shapes)])
        for k, i in enumerate(split):
            u, st = results[k]
            updates[i] = type(grads[i])(u.reshape(-1), grads[i].info)
            new_states[i] = _owned_state(states[i], st, rank)
        return updates, new_states
    owned_by = [[k for k in range(len(split)) if owners[k] == r] for r in range(world)]

    def size(k, r):  # elements of leaf k's piece on rank r
        a, b = grads[split[k]].info.piece(r)
        return b - a

    # 1. each rank's pieces of each leaf's gradient and value, to the leaf's owner
    dtype = params[split[0]].local.dtype  # one dtype for the wire, the same on every rank
    for i in split:
        dtype = torch.promote_types(dtype, torch.promote_types(grads[i].local.dtype, params[i].local.dtype))
    home = params[split[0]].local.device
    send = torch.cat([torch.empty(0, dtype=dtype, device=home)] + [x.local.reshape(-1).to(dtype) for o in range(world)
                                                      for k in owned_by[o] for x in (grads[split[k]], params[split[k]])])
    got = _all_to_all("gradients and parameters to their owners", send,
                      [sum(2 * size(k, rank) for k in owned_by[o]) for o in range(world)],
                      [sum(2 * size(k, q) for k in mine) for q in range(world)], group)
    parts: dict[int, tuple[list, list]] = {k: ([], []) for k in mine}
    for q in range(world):
        at = 0
        for k in mine:
            n = size(k, q)
            parts[k][0].append(got[q][at: at + n])
            parts[k][1].append(got[q][at + n: at + 2 * n])
            at += 2 * n
    wholes = [(torch.cat(parts[k][0]).reshape(shapes[k]).to(grads[split[k]].local.dtype),
               torch.cat(parts[k][1]).reshape(shapes[k]).to(params[split[k]].local.dtype),
               whole_state(split[k])) for k in mine]
    # 2. the owner updates its leaves whole
    results = step([split[k] for k in mine], wholes)
    for k, (_, st) in zip(mine, results):
        new_states[split[k]] = _owned_state(states[split[k]], st, rank)
    # 3. each rank's piece of each whole update, from the owner
    flat = {k: u.reshape(-1).to(dtype) for k, (u, _) in zip(mine, results)}
    send = torch.cat([torch.empty(0, dtype=dtype, device=home)] + [flat[k][slice(*grads[split[k]].info.piece(q))]
                                                      for q in range(world) for k in mine])
    got = _all_to_all("updates from their owners", send,
                      [sum(size(k, q) for k in mine) for q in range(world)],
                      [sum(size(k, rank) for k in owned_by[o]) for o in range(world)], group)
    for o in range(world):
        at = 0
        for k in owned_by[o]:
            i, n = split[k], size(k, rank)
            updates[i] = type(grads[i])(got[o][at: at + n].to(params[i].local.dtype), grads[i].info)
            at += n
    return updates, new_states
