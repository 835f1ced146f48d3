"""The styles of a tensor-parallel plan and Megatron's *f* and *g* they stand on."""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fzero.distributed import comm
from fzero.rng import Slice, with_slice
from fzero.transforms.tensor_parallel._vocab import VocabShardedLogits


WHERE = "fzero.tensor_parallel"


# --------------------------------------------------------------------------- Megatron's f and g


class _CopyToTP(torch.autograd.Function):
    """Megatron's *f*: identity forward; backward, the sum of every ``tp`` rank's gradient."""

    @staticmethod
    def forward(ctx, x, group, timeout_s):
        ctx.group, ctx.timeout_s = group, timeout_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group, ctx.timeout_s, "all_reduce(tp: input gradient)"), None, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's *g*: forward, the sum of every ``tp`` rank's partial product; identity backward."""

    @staticmethod
    def forward(ctx, x, group, timeout_s):
        return _all_reduce(x, group, timeout_s, "all_reduce(tp: partial products)")

    @staticmethod
    def backward(ctx, g):
        return g, None, None


# Inside the forward of a module that holds several column-parallel layers (Llama's q, k and v;
# its gate and up), their one input passes through *f* once: the layers' input gradients add up
# in autograd before the one all-reduce, as Megatron's fused QKV and gate/up layers do (one
# all-reduce per input, not per layer). The scope is that module's forward call
# (``_rewrite.shared_input_scope``), so nothing outlives it: not across micro-batches, not past a
# recomputation under activation checkpointing. ``id(x) -> (x, f(x))``; the entry keeps ``x``
# alive, so an id is never reused while it is in the map.
_SHARED_INPUT: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fzero_tp_shared_input", default=None)


def _copy_to_tp(x: torch.Tensor, group, timeout_s: float) -> torch.Tensor:
    """Megatron's *f* of ``x``: once per tensor inside a shared-input scope."""
    shared = _SHARED_INPUT.get()
    if shared is None:
        return _CopyToTP.apply(x, group, timeout_s)
    hit = shared.get(id(x))
    if hit is not None and hit[0] is x:
        return hit[1]
    y = _CopyToTP.apply(x, group, timeout_s)
    shared[id(x)] = (x, y)
    return y


def _all_reduce(x: torch.Tensor, group, timeout_s: float, name: str, what: str = "tp") -> torch.Tensor:
    out = x.contiguous().clone()
    comm.run(f"{name}, {out.numel()} elements",
             lambda: comm.all_reduce(out, group=group, async_op=True, what=what),
             timeout_s=timeout_s, where=WHERE)
    return out


# --------------------------------------------------------------------------- styles


def _is_conv1d(m: torch.nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): a Linear whose ``weight`` is stored ``(in, out)``."""
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and getattr(m, "weight", None) is not None


def _io(m: torch.nn.Module) -> tuple[int, int]:
    """(input features, output features) of an ``nn.Linear`` or a ``Conv1D``."""
    return (m.weight.shape[0], m.nf) if _is_conv1d(m) else (m.in_features, m.out_features)


def _affine(module: torch.nn.Module, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """``module``'s affine map with its (local) weight: ``nn.Linear`` or ``Conv1D``."""
    b = module.bias if bias else None
    if _is_conv1d(module):
        w = module.weight
        out = x.reshape(-1, x.shape[-1]) @ w if b is None else torch.addmm(b, x.reshape(-1, x.shape[-1]), w)
        return out.view(*x.shape[:-1], w.shape[1])
    return F.linear(x, module.weight, b)


@dataclasses.dataclass(frozen=True)
class ColwiseParallel:
    """Split a Linear layer's output features over ``tp`` (``nn.Linear``'s ``weight`` rows,
    Hugging Face ``Conv1D``'s columns; ``bias`` with them).

    Args:
        parts: the output is this many equal blocks split one by one (a fused q/k/v
            projection: ``parts=3``), so each rank gets its slice of each block.
        unit: features kept together (an attention head's width): a split never cuts one.
        output: ``"features"``, this rank's slice as a plain tensor, for the row-parallel
            layer after it; ``"vocab"``, for a language-model head: the slice wrapped in a
            :class:`VocabShardedLogits`, which stands for the whole logits in the user's loss
            code -- ``F.cross_entropy`` on it is computed across the ``tp`` ranks without
            gathering the logits (Megatron's vocab-parallel cross-entropy).
    """

    parts: int = 1
    unit: int = 1
    output: Literal["features", "vocab"] = "features"

    def __post_init__(self):
        if self.output not in ("features", "vocab"):
            raise ValueError(f"{WHERE}: ColwiseParallel(output=...) must be 'features' or 'vocab', got {self.output!r}")
        if self.output == "vocab" and (self.parts, self.unit) != (1, 1):
            raise ValueError(f"{WHERE}: ColwiseParallel(output='vocab') splits the vocabulary in one block; got "
                             f"parts={self.parts}, unit={self.unit}")

    def dims(self, module: torch.nn.Module) -> dict[str, int]:
        return {"weight": 1 if _is_conv1d(module) else 0, "bias": 0}

    def forward(self, module: torch.nn.Module, x: torch.Tensor, group, timeout_s: float) -> torch.Tensor:
        out = _affine(module, _copy_to_tp(x, group, timeout_s))
        tp = dist.get_world_size(group)
        if self.output == "features":
            # Where this rank's columns sit in the whole output: a dropout on it (or on what
            # the model computes from it) draws its slice of the whole mask (_slices.py).
            per_part = out.shape[-1] // self.parts
            return with_slice(out, Slice(out.dim() - 1, dist.get_rank(group) * per_part, out.shape[-1] * tp,
                                         self.parts))
        return VocabShardedLogits(out, vocab=out.shape[-1] * tp, tp=tp, rank=dist.get_rank(group), group=group,
                                  timeout_s=timeout_s)


@dataclasses.dataclass(frozen=True)
class RowwiseParallel:
    """Split a Linear layer's input features over ``tp`` (``bias`` whole, added once after
    the sum); or an ``nn.Embedding``'s vocabulary (``weight`` rows), as torch's
    ``RowwiseParallel`` splits an embedding.

    An embedding rank looks up the ids in its ``[lo, hi)`` of the vocabulary, gives zeros for
    the others, and Megatron's *g* sums the ranks' rows (one rank holds each id), so the
    output is whole on every rank and each rank's gradient lands on its own rows only.

    Args:
        unit: input features kept together (an attention head's width).
    """

    parts: int = 1
    unit: int = 1

    def dims(self, module: torch.nn.Module) -> dict[str, int]:
        return {"weight": 0 if _is_conv1d(module) or isinstance(module, torch.nn.Embedding) else 1}

    def forward(self, module: torch.nn.Module, x: torch.Tensor, group, timeout_s: float) -> torch.Tensor:
        if isinstance(module, torch.nn.Embedding):
            return with_slice(_ReduceFromTP.apply(_embed_local(module, x, dist.get_rank(group)), group, timeout_s),
                              None)
        out = _ReduceFromTP.apply(_affine(module, x, bias=False), group, timeout_s)
        out = out if module.bias is None else out + module.bias
        return with_slice(out, None)  # summed over the ranks: whole again


def _embed_local(module: torch.nn.Embedding, ids: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's part of the lookup: its rows for its ids, zeros for the others'."""
    rows = module.weight.shape[0]
    lo = rank * rows
    here = (ids >= lo) & (ids < lo + rows)
    pad = module.padding_idx
    pad = pad - lo if pad is not None and lo <= pad < lo + rows else None
    out = F.embedding(torch.where(here, ids - lo, torch.zeros_like(ids)), module.weight, pad)
    return out * here.unsqueeze(-1).to(out.dtype)


@dataclasses.dataclass(frozen=True)
class DivideAttributes:
    """Divide integer attributes of a module by ``tp`` while the step runs -- the sizes its
    own forward reads that become per-rank once its projections are split (Hugging Face
    GPT-2's attention reads ``split_size`` to cut the fused q/k/v output; a model that reads
    a head count does the same with it). The module's code is unchanged, and outside the
    step the attributes have their own values again.
    """

    names: tuple[str, ...]

    def __init__(self, *names: str):
        object.__setattr__(self, "names", tuple(names))


STYLES = (ColwiseParallel, RowwiseParallel, DivideAttributes)


def _local(full: torch.Tensor, dim: int, tp: int, rank: int, parts: int) -> torch.Tensor:
    """Rank ``rank``'s slice of ``full`` on ``dim``: of each of ``parts`` equal blocks."""
    blocks = full.detach().chunk(parts, dim=dim)
    return torch.cat([b.chunk(tp, dim=dim)[rank] for b in blocks], dim=dim).clone()


def _whole(pieces: list[torch.Tensor], dim: int, parts: int) -> torch.Tensor:
    """The inverse of :func:`_local`: every rank's slice (in rank order) back into the whole."""
    per = [p.chunk(parts, dim=dim) for p in pieces]
    return torch.cat([torch.cat([q[i] for q in per], dim=dim) for i in range(parts)], dim=dim)

