"""``shard_state``'s check at ``init`` that every rank of the ``dp`` group holds the same model.

Data parallelism averages gradients of one model: ranks that built different models, or
seeded the same one differently, would train something no single process trains. The
check runs before any collective whose sizes follow from the parameters: first the
structure (the ZeRO stage, the parameters' names, shapes and dtypes), agreed through the
store, where a difference would otherwise end in gloo's size mismatch abort; then the
values, one all-gather of a fingerprint per parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fzero.distributed import checkin, comm

__all__ = ["check_same_model"]

WHERE = "fzero.shard_state"


def check_same_model(params: dict[str, torch.Tensor], *, stage: int, group, world: int, timeout_s: float,
                     device: torch.device) -> None:
    """Raise unless every rank of ``group`` compiled ``stage`` and holds ``params`` with the
    same names, shapes, dtypes and values (a collective: call it on every rank).

    Raises:
        ValueError: naming the ranks and what differs (the stage, a parameter only one rank
            has, a parameter's shape and dtype, or its values).
    """
    if world == 1:
        return
    _check_structure(params, stage=stage, group=group, world=world, timeout_s=timeout_s)
    stats = []
    for v in params.values():
        stats.append(v.numel())
        stats.append(int(v.detach().double().sum().mul(1e6).round().clamp(-2**62, 2**62).item()))
    allstats = comm.all_gather_ints("all_gather(parameter fingerprints)", [len(params)] + stats, group,
                                    timeout_s=timeout_s, where=WHERE, device=device)
    if not bool((allstats == allstats[0]).all()):
        bad_rank = int((allstats != allstats[0]).any(dim=1).nonzero()[0])
        if int(allstats[bad_rank, 0]) != len(params):
            raise ValueError(f"{WHERE}: rank {bad_rank} has {int(allstats[bad_rank, 0])} parameters, "
                             f"rank 0 has {int(allstats[0, 0])}")
        col = int((allstats[bad_rank] != allstats[0]).nonzero()[0]) - 1
        name = list(params)[col // 2]
        what = "shape" if col % 2 == 0 else "values"
        raise ValueError(f"{WHERE}: parameter {name!r} differs in {what} between rank 0 and rank {bad_rank}: "
                         "every rank must start from the same parameters (seed the model identically)")


def _check_structure(params: dict[str, torch.Tensor], *, stage: int, group, world: int, timeout_s: float) -> None:
    """The ZeRO stage and the parameters' names, shapes and dtypes, agreed through the
    store before any collective whose sizes follow from them (where a difference would
    end in gloo's size mismatch abort, or be reported as a difference of values)."""
    mine = {"stage": stage, "params": {k: [list(v.shape), str(v.dtype).removeprefix("torch.")]
                                       for k, v in params.items()}}
    said = checkin.agree("the parameters' structure and the ZeRO stage", mine, group=group,
                         timeout_s=timeout_s, where=WHERE)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    problems = []
    stages = [s["stage"] for s in said]
    if len(set(stages)) > 1:
        problems.append("ZeRO stage: " + ", ".join(f"rank {r} compiled stage {s}" for r, s in zip(ranks, stages)))
    ref = said[0]["params"]
    for r, s in zip(ranks[1:], said[1:]):
        other = s["params"]
        only_ref = [k for k in ref if k not in other]
        only_other = [k for k in other if k not in ref]
        if only_ref:
            problems.append(f"rank {ranks[0]} has {', '.join(map(repr, only_ref))}, which rank {r} has not")
        if only_other:
            problems.append(f"rank {r} has {', '.join(map(repr, only_other))}, which rank {ranks[0]} has not")
        for k in ref:
            if k in other and other[k] != ref[k]:
                problems.append(f"parameter {k!r} is {_desc(ref[k])} on rank {ranks[0]} and {_desc(other[k])} "
                                f"on rank {r}")
    if problems:
        raise ValueError(f"{WHERE}: the ranks of the data-parallel group do not hold the same model; every rank "
                         "must build the same model and compile it with the same options:\n  "
                         + "\n  ".join(problems))


def _desc(shape_dtype) -> str:
    shape, dtype = shape_dtype
    return f"{dtype}[{', '.join(map(str, shape))}]"
