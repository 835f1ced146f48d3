"""Ulysses' attention: ``F.scaled_dot_product_attention`` on whole sequences for a slice of
the heads, between two all-to-alls over the ``sp`` axis.

A rank enters attention holding ``q``, ``k``, ``v`` of its slice of the sequence for every
head, ``(batch, heads, seq/sp, dim)``. One all-to-all per tensor trades sequence for heads:
afterwards it holds the whole sequence for ``heads/sp`` heads, ``(batch, heads/sp, seq,
dim)``, where attention is the ordinary one (causal masks and softmax over the whole
sequence). One all-to-all of the output trades back. The backward of each all-to-all is the
other one (DeepSpeed-Ulysses' ``_SeqAllToAll``; Jacobs et al. 2023, "DeepSpeed Ulysses").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from fzero.distributed import comm

__all__ = ["UlyssesAttention"]

WHERE = "fzero.ulysses"


class UlyssesAttention:
    """The all-to-alls of one ``sp`` group and the attention that runs between them.

    ``calls`` counts the attention calls that reached it (a model whose attention does not
    go through ``F.scaled_dot_product_attention`` would attend within its slice only: the
    transform refuses a step where none did).
    """

    def __init__(self, group, sp: int, timeout_s: float):
        self.group, self.sp, self.timeout_s = group, sp, timeout_s
        self.calls = 0

    # ---------------------------------------------------------------- the two exchanges

    def _exchange(self, blocks: torch.Tensor) -> torch.Tensor:
        """Block ``r`` of ``blocks`` (dim 0, ``sp`` blocks) to rank ``r``; block ``q`` of the
        result came from rank ``q``."""
        out = torch.empty_like(blocks)
        comm.run("all_to_all(attention)",
                 lambda: comm.all_to_all_flat(out, blocks, group=self.group, async_op=True, what="attention"),
                 timeout_s=self.timeout_s, where=WHERE)
        return out

    def seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """``(b, h, s/sp, d)`` of this rank's sequence slice -> ``(b, h/sp, s, d)`` of its heads."""
        b, h, s, d = x.shape
        n = self.sp
        blocks = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()  # head block r -> rank r
        got = self._exchange(blocks)  # block q: sequence slice q of this rank's heads
        return got.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)

    def heads_to_seq(self, y: torch.Tensor) -> torch.Tensor:
        """``(b, h/sp, s, d)`` of this rank's heads -> ``(b, h, s/sp, d)`` of its sequence slice."""
        b, h, s, d = y.shape
        n = self.sp
        blocks = y.reshape(b, h, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous()  # sequence slice r -> rank r
        got = self._exchange(blocks)  # block q: heads block q of this rank's sequence slice
        return got.transpose(0, 1).reshape(b, n * h, s // n, d)

    # ---------------------------------------------------------------- attention

    def attention(self, inner, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
        """``inner`` (the ``scaled_dot_product_attention`` in place before this one) on whole
        sequences for this rank's heads; same arguments and result as torch's."""
        if attn_mask is not None:
            raise ValueError(
                f"{WHERE}: scaled_dot_product_attention was given an attn_mask of shape {tuple(attn_mask.shape)} "
                f"under sequence parallelism (sp={self.sp}): a mask built for this rank's slice of the sequence "
                "does not fit the whole sequence attention runs on. Use is_causal=True (Hugging Face models do "
                "with no padding attention_mask) or unpadded batches")
        if dropout_p:
            raise ValueError(f"{WHERE}: scaled_dot_product_attention(dropout_p={dropout_p}) under sequence "
                             f"parallelism (sp={self.sp}) is not supported; set the attention dropout to 0")
        bad = [f"{name} of shape {tuple(t.shape)}" for name, t in (("query", query), ("key", key), ("value", value))
               if t.dim() != 4]
        if bad:
            raise ValueError(f"{WHERE}: scaled_dot_product_attention under sp={self.sp} needs (batch, heads, "
                             f"sequence, dim) tensors, got {', '.join(bad)}")
        heads = {"query": query.shape[1], "key": key.shape[1], "value": value.shape[1]}
        odd = {k: h for k, h in heads.items() if h % self.sp}
        if odd:
            raise ValueError(f"{WHERE}: attention heads must divide by sp={self.sp} (each rank attends for "
                             f"heads/sp of them), got {', '.join(f'{k}: {h} heads' for k, h in odd.items())}")
        self.calls += 1
        q, k, v = (_SeqToHeads.apply(t, self) for t in (query, key, value))
        out = inner(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        return _HeadsToSeq.apply(out, self)

    @contextlib.contextmanager
    def installed(self) -> Iterator["UlyssesAttention"]:
        """``F.scaled_dot_product_attention`` is this attention within the block (a name, as
        ``fzero.rng`` replaces it: Hugging Face's SDPA attention and hand-written models
        look it up at each call), put back after."""
        inner = F.scaled_dot_product_attention

        def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                         scale=None, enable_gqa=False):
            return self.attention(inner, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

        F.scaled_dot_product_attention = scaled_dot_product_attention
        try:
            yield self
        finally:
            F.scaled_dot_product_attention = inner


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ulysses):
        ctx.ulysses = ulysses
        return ulysses.seq_to_heads(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.ulysses.heads_to_seq(g), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, ulysses):
        ctx.ulysses = ulysses
        return ulysses.heads_to_seq(y)

    @staticmethod
    def backward(ctx, g):
        return ctx.ulysses.seq_to_heads(g), None
