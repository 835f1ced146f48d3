"""Megatron's sequence parallelism: between the tensor-parallel pairs, activations are split
on the sequence dim.

Under plain tensor parallelism every ``tp`` rank holds the whole ``(batch, sequence, d)``
activation between the split pairs -- the residual stream, the norms' inputs and outputs, the
dropouts' masks -- and computes the same norm and dropout on it as its peers. Sequence
parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", 2022, section 4.2.2) keeps only this rank's ``1/tp`` of the sequence there, so those
activations divide by ``tp`` too. Megatron's *f* and *g* change partner:

* into a column-parallel layer, an **all-gather** of the sequence shards (forward) whose
  backward is a **reduce-scatter** of the input gradient (each rank's slice of the
  features contributes to every token's);
* out of a row-parallel layer, a **reduce-scatter** of the partial products (forward), each
  rank keeping the sum for its tokens, whose backward is an **all-gather**.

An all-gather and a reduce-scatter of the same activation send the bytes of one all-reduce
(a ring all-reduce *is* a reduce-scatter then an all-gather), so the pairs cost what they
cost under tensor parallelism. A column-parallel layer keeps its input's *shard* for its
weight gradient and all-gathers it again in backward (Megatron's
``LinearWithGradAccumulationAndAsyncCommunication``): one more all-gather per column-parallel
layer, for a saved input ``1/tp`` the size.

Parameters that stay whole but are used on the shards (a norm's weight and bias, a
row-parallel layer's bias, added after the reduce-scatter) see only this rank's tokens, so
their gradients are summed over ``tp``: they pass through *f* (identity forward, all-reduce
of the gradient backward), one all-reduce per module call.

Which tensors are shards is read from the tensors themselves: a shard carries the
:class:`fzero.rng.Slice` of the sequence it holds, so a dropout on it draws its slice of the
whole mask (the same run at any ``tp``), and a column-parallel layer refuses an input that is
not a shard, naming the layer, rather than gathering the wrong thing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
# What torch.func.functional_call binds parameters with: a norm's own forward runs with its
# parameters passed through *f* (SequenceParallel), nested inside the step's functional_call.
from torch.nn.utils.stateless import _reparametrize_module

from fzero.distributed import comm
from fzero.rng import Slice, slice_of, with_slice
from fzero.transforms.tensor_parallel._styles import (WHERE, ColwiseParallel, RowwiseParallel, _CopyToTP, _embed_local,
                                                      _is_conv1d)
from fzero.transforms.tensor_parallel._vocab import VocabShardedLogits

__all__ = ["PrepareModuleInput", "SequenceParallel"]


# --------------------------------------------------------------------------- collectives on the sequence dim


def _gather(x: torch.Tensor, dim: int, group, timeout_s: float, name: str) -> torch.Tensor:
    """Every rank's shard of ``dim``, in rank order: the whole sequence."""
    tp = dist.get_world_size(group)
    x = x.contiguous()
    out = x.new_empty((tp * x.numel(),))
    comm.run(f"all_gather(tp: {name}), {x.numel()} elements",
             lambda: comm.all_gather_flat(out, x.view(-1), group=group, async_op=True, what="tp"),
             timeout_s=timeout_s, where=WHERE)
    return out.view(tp, *x.shape).movedim(0, dim).flatten(dim, dim + 1)


def _reduce_scatter(x: torch.Tensor, dim: int, group, timeout_s: float, name: str) -> torch.Tensor:
    """The sum over the ranks of ``x``, this rank's shard of ``dim`` of it."""
    tp = dist.get_world_size(group)
    shape = list(x.shape)
    shape[dim] //= tp
    blocks = x.unflatten(dim, (tp, shape[dim])).movedim(dim, 0).contiguous()
    out = x.new_empty((blocks.numel() // tp,))
    comm.run(f"reduce_scatter(tp: {name}), {blocks.numel()} elements",
             lambda: comm.reduce_scatter_flat(out, blocks.view(-1), group=group, async_op=True, what="tp"),
             timeout_s=timeout_s, where=WHERE)
    return out.view(shape)


def _shard(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    tp = dist.get_world_size(group)
    return x.chunk(tp, dim=dim)[dist.get_rank(group)].contiguous()


class _Scatter(torch.autograd.Function):
    """Whole (the same on every rank) to this rank's shard; backward, the shards' gradients
    all-gathered (Megatron's ``scatter_to_sequence_parallel_region``)."""

    @staticmethod
    def forward(ctx, x, dim, group, timeout_s):
        ctx.args = dim, group, timeout_s
        return _shard(x, dim, group)

    @staticmethod
    def backward(ctx, g):
        return _gather(g, *ctx.args, "sequence shards' gradients"), None, None, None


class _Gather(torch.autograd.Function):
    """Shards to the whole sequence, for code that runs the same on every rank (a whole LM
    head); backward, this rank's shard of the (identical) gradient."""

    @staticmethod
    def forward(ctx, x, dim, group, timeout_s):
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group, timeout_s, "sequence shards")

    @staticmethod
    def backward(ctx, g):
        return _shard(g, ctx.dim, ctx.group), None, None, None


class _GatherSplit(torch.autograd.Function):
    """Shards to the whole sequence, into a layer split by features (a vocabulary-split head);
    backward, the partial gradients reduce-scattered."""

    @staticmethod
    def forward(ctx, x, dim, group, timeout_s):
        ctx.args = dim, group, timeout_s
        return _gather(x, dim, group, timeout_s, "sequence shards")

    @staticmethod
    def backward(ctx, g):
        return _reduce_scatter(g, *ctx.args, "input gradient"), None, None, None


class _ReduceScatter(torch.autograd.Function):
    """Out of a row-parallel layer: the partial products summed, this rank's tokens kept;
    backward, the shards' gradients all-gathered."""

    @staticmethod
    def forward(ctx, x, dim, group, timeout_s):
        ctx.args = dim, group, timeout_s
        return _reduce_scatter(x, dim, group, timeout_s, "partial products")

    @staticmethod
    def backward(ctx, g):
        return _gather(g, *ctx.args, "output gradient"), None, None, None


class _GatherLinear(torch.autograd.Function):
    """A column-parallel layer on sequence shards: the input all-gathered, this rank's
    output features computed on the whole sequence. Only the shard is saved: backward
    gathers it again for the weight gradient and reduce-scatters the input gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, conv1d, dim, group, timeout_s):
        ctx.save_for_backward(x, weight)
        ctx.conv1d, ctx.has_bias, ctx.args = conv1d, bias is not None, (dim, group, timeout_s)
        return _matmul(_gather(x, dim, group, timeout_s, "sequence shards"), weight, bias, conv1d)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        dim, group, timeout_s = ctx.args
        whole = _gather(x, dim, group, timeout_s, "sequence shards, again for the weight gradient")
        # In the gradient's dtype: under autocast the forward's matmul ran in the low dtype
        # whatever the input's (a norm's output stays fp32).
        weight = weight.to(g.dtype)
        g2, x2 = g.reshape(-1, g.shape[-1]), whole.reshape(-1, whole.shape[-1]).to(g.dtype)
        if ctx.conv1d:  # weight (in, out): y = x @ w
            gx, gw = g @ weight.t(), x2.t() @ g2
        else:  # weight (out, in): y = x @ w.T
            gx, gw = g @ weight, g2.t() @ x2
        gb = g2.sum(0) if ctx.has_bias else None
        return _reduce_scatter(gx, dim, group, timeout_s, "input gradient"), gw, gb, None, None, None, None


def _matmul(x, weight, bias, conv1d):
    if conv1d:
        out = x.reshape(-1, x.shape[-1]) @ weight
        out = out if bias is None else out + bias
        return out.view(*x.shape[:-1], weight.shape[1])
    return torch.nn.functional.linear(x, weight, bias)


# --------------------------------------------------------------------------- what a shard is


def _dim(x: torch.Tensor, sequence_dim: int) -> int:
    return sequence_dim % x.dim()


def is_shard(x: Any, sequence_dim: int, tp: int) -> bool:
    """Whether ``x`` is tagged as this rank's shard of the sequence."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return False
    tag = slice_of(x)
    d = _dim(x, sequence_dim)
    return isinstance(tag, Slice) and tag.dim == d and tag.parts == 1 and tag.whole == x.shape[d] * tp


def _tag_shard(x: torch.Tensor, sequence_dim: int, group) -> torch.Tensor:
    d = _dim(x, sequence_dim)
    n = x.shape[d]
    return with_slice(x, Slice(d, dist.get_rank(group) * n, n * dist.get_world_size(group)))


def _check_divides(x: torch.Tensor, sequence_dim: int, tp: int, who: str) -> None:
    d = _dim(x, sequence_dim)
    if x.shape[d] % tp:
        raise ValueError(f"{WHERE}: sequence_parallel: the input of {who} has shape {tuple(x.shape)}: its sequence "
                         f"dim {d} ({x.shape[d]}) does not divide by tp={tp}; pad the sequence to a multiple of tp")


def scatter(x: torch.Tensor, sequence_dim: int, group, timeout_s: float, who: str) -> torch.Tensor:
    """A whole activation (the same on every ``tp`` rank) cut to this rank's shard."""
    _check_divides(x, sequence_dim, dist.get_world_size(group), who)
    return _tag_shard(_Scatter.apply(x, _dim(x, sequence_dim), group, timeout_s), sequence_dim, group)


def gather(x: torch.Tensor, sequence_dim: int, group, timeout_s: float) -> torch.Tensor:
    """This rank's shard back to the whole sequence, for code every rank runs alike."""
    return with_slice(_Gather.apply(x, _dim(x, sequence_dim), group, timeout_s), None)


def _whole_on_shards(module: torch.nn.Module, group, timeout_s: float) -> dict[str, torch.Tensor]:
    """``module``'s own parameters through Megatron's *f*, one all-reduce for all of them:
    used on this rank's tokens only, their gradients are summed over ``tp``."""
    own = {n: p for n, p in module.named_parameters(recurse=False) if p.requires_grad}
    if not own:
        return {}
    if len(own) == 1:
        (n, p), = own.items()
        return {n: _CopyToTP.apply(p, group, timeout_s)}
    flat = _CopyToTP.apply(torch.cat([p.reshape(-1) for p in own.values()]), group, timeout_s)
    pieces = flat.split([p.numel() for p in own.values()])
    return {n: piece.view_as(p) for (n, p), piece in zip(own.items(), pieces)}


def _not_a_shard(who: str, x: torch.Tensor) -> ValueError:
    tag = slice_of(x)
    return ValueError(
        f"{WHERE}: sequence_parallel: the input of {who} (shape {tuple(x.shape)}) is not a shard of the sequence "
        f"(it is {'whole' if tag is None else tag}): shard the activations before the first split pair -- "
        "PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1)) on the first block, or a "
        "vocabulary-split embedding -- and run the norms between the pairs as SequenceParallel() "
        "(fzero.transforms.tp_plans.gpt(model, sequence_parallel=True))")


# --------------------------------------------------------------------------- the split layers on shards


def colwise_forward(style: ColwiseParallel, module: torch.nn.Module, x: torch.Tensor, group, timeout_s: float, *,
                    name: str, sequence_dim: int = 1) -> torch.Tensor:
    """A column-parallel layer whose input is this rank's shard of the sequence."""
    tp = dist.get_world_size(group)
    if not is_shard(x, sequence_dim, tp):
        raise _not_a_shard(f"the column-parallel layer {name!r}", x)
    d = _dim(x, sequence_dim)
    if style.output == "vocab":
        out = _matmul(_GatherSplit.apply(x, d, group, timeout_s), module.weight, module.bias, _is_conv1d(module))
        return VocabShardedLogits(out, vocab=out.shape[-1] * tp, tp=tp, rank=dist.get_rank(group), group=group,
                                  timeout_s=timeout_s)
    out = _GatherLinear.apply(x, module.weight, module.bias, _is_conv1d(module), d, group, timeout_s)
    per_part = out.shape[-1] // style.parts
    return with_slice(out, Slice(out.dim() - 1, dist.get_rank(group) * per_part, out.shape[-1] * tp, style.parts))


def rowwise_forward(style: RowwiseParallel, module: torch.nn.Module, x: torch.Tensor, group, timeout_s: float, *,
                    name: str, sequence_dim: int = 1) -> torch.Tensor:
    """A row-parallel layer whose output is this rank's shard of the sequence (summed over
    the ranks by a reduce-scatter); an embedding split by vocabulary, likewise."""
    tp = dist.get_world_size(group)
    if isinstance(module, torch.nn.Embedding):
        part = _embed_local(module, x, dist.get_rank(group))
        _check_divides(part, sequence_dim, tp, f"the embedding {name!r}")
        return _tag_shard(_ReduceScatter.apply(part, _dim(part, sequence_dim), group, timeout_s), sequence_dim, group)
    partial = _matmul(x, module.weight, None, _is_conv1d(module))
    _check_divides(partial, sequence_dim, tp, f"the row-parallel layer {name!r}")
    out = _ReduceScatter.apply(with_slice(partial, None), _dim(partial, sequence_dim), group, timeout_s)
    if module.bias is not None:  # whole, added on this rank's tokens: its gradient summed over tp
        out = out + _CopyToTP.apply(module.bias, group, timeout_s)
    return _tag_shard(out, sequence_dim, group)


# --------------------------------------------------------------------------- the styles


@dataclasses.dataclass(frozen=True)
class SequenceParallel:
    """Run a module whose parameters stay whole (a LayerNorm or RMSNorm, a dropout) on this
    rank's shard of the sequence, as ``torch.distributed.tensor.parallel.SequenceParallel``
    does: used with ``compile(..., tp=plan, sequence_parallel=True)``.

    Its input must be the shard (what a row-parallel layer, a :class:`PrepareModuleInput` to
    ``Shard(1)`` or a vocabulary-split embedding gives, and what is computed from it token by
    token); its output is the shard. The module's own parameters see only this rank's
    tokens, so their gradients are summed over ``tp`` (one all-reduce per call).

    Args:
        sequence_dim: the sequence dim of the module's input (``(batch, sequence, d)``: 1).
    """

    sequence_dim: int = 1

    def forward(self, module: torch.nn.Module, x: torch.Tensor, *args, group, timeout_s: float, name: str,
                **kwargs) -> torch.Tensor:
        tp = dist.get_world_size(group)
        if not is_shard(x, self.sequence_dim, tp):
            raise _not_a_shard(f"the SequenceParallel module {name!r}", x)
        with _reparametrize_module(module, _whole_on_shards(module, group, timeout_s)):
            out = type(module).forward(module, x, *args, **kwargs)
        # Where its input sits, so does its output (a norm's statistics are per token).
        return _tag_shard(out, self.sequence_dim, group)


def _is_shard_layout(p) -> bool:
    from torch.distributed.tensor import Shard

    return isinstance(p, Shard)


def _check_layout(p, where: str) -> None:
    from torch.distributed.tensor import Replicate, Shard

    if p is not None and not isinstance(p, (Replicate, Shard)):
        raise TypeError(f"{WHERE}: PrepareModuleInput({where}=...) takes torch.distributed.tensor's Replicate() or "
                        f"Shard(dim) (or None to leave an input as it is), got {p!r}")


@dataclasses.dataclass(frozen=True)
class PrepareModuleInput:
    """Move a module's positional inputs between whole and sequence-sharded, as
    ``torch.distributed.tensor.parallel.PrepareModuleInput`` does, before its forward runs:
    ``Replicate()`` to ``Shard(d)`` cuts this rank's shard (gradients all-gathered back),
    ``Shard(d)`` to ``Replicate()`` all-gathers the whole sequence (for code every rank runs
    alike; its gradient is cut back to the shard). Where sequence parallelism begins (the
    first block's input) and ends (a whole LM head's input).

    Args:
        input_layouts: the layout of each positional input as it arrives (one placement, or a
            tuple with ``None`` for inputs left alone), torch's ``Replicate()`` / ``Shard(d)``.
        desired_input_layouts: the layout the module's forward gets, the same way.

    Example:
        >>> from torch.distributed.tensor import Replicate, Shard
        >>> PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1)).moves()
        ((Replicate(), Shard(dim=1)),)
    """

    input_layouts: Any = None
    desired_input_layouts: Any = None

    def __post_init__(self):
        have, want = self.input_layouts, self.desired_input_layouts
        have = have if isinstance(have, tuple) else (have,)
        want = want if isinstance(want, tuple) else (want,)
        if len(have) != len(want):
            raise ValueError(f"{WHERE}: PrepareModuleInput: input_layouts={self.input_layouts!r} and "
                             f"desired_input_layouts={self.desired_input_layouts!r} must have one entry per input")
        for h, w in zip(have, want):
            _check_layout(h, "input_layouts")
            _check_layout(w, "desired_input_layouts")

    def moves(self) -> tuple:
        have, want = self.input_layouts, self.desired_input_layouts
        have = have if isinstance(have, tuple) else (have,)
        want = want if isinstance(want, tuple) else (want,)
        return tuple(zip(have, want))

    def shards(self) -> bool:
        """Whether it makes a shard of a whole input (where sequence parallelism begins)."""
        return any(w is not None and _is_shard_layout(w) and not _is_shard_layout(h) for h, w in self.moves())

    def forward(self, module: torch.nn.Module, *args, group, timeout_s: float, name: str, **kwargs):
        tp = dist.get_world_size(group)
        moved = list(args)
        for i, (have, want) in enumerate(self.moves()):
            if i >= len(moved) or have is None or want is None or not isinstance(moved[i], torch.Tensor):
                continue
            x = moved[i]
            if _is_shard_layout(want) and not _is_shard_layout(have):
                moved[i] = scatter(x, want.dim, group, timeout_s, f"{name!r} (input {i})")
            elif _is_shard_layout(have) and not _is_shard_layout(want):
                if not is_shard(x, have.dim, tp):
                    raise _not_a_shard(f"{name!r} (input {i}, planned as Shard({have.dim}))", x)
                moved[i] = gather(x, have.dim, group, timeout_s)
        return type(module).forward(module, *moved, **kwargs)
