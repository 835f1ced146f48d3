"""A small GPT, in the manner of nanoGPT's ``model.py``, and a sampler that uses fzero's pure apply.

The model is an ordinary ``nn.Module``: token and position embeddings, ``n_layer`` pre-LayerNorm
blocks (causal self-attention, then an MLP), a final LayerNorm, and an LM head that shares its
weight with the token embedding. fzero never needs the module to know about it:
``fzero.functionalize(GPT(cfg))`` splits it into a pure ``apply(params, idx)`` and a dict of
parameters, and everything else (gradients, optimizer, sampling) works on those.

Example:
    >>> import torch, fzero
    >>> cfg = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32)
    >>> apply, params = fzero.functionalize(GPT(cfg))
    >>> apply(params, torch.zeros(2, 5, dtype=torch.long)).shape
    torch.Size([2, 5, 256])
    >>> generate(apply, params, torch.zeros(1, 1, dtype=torch.long), 7).shape
    torch.Size([1, 8])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


@dataclass(kw_only=True)
class GPTConfig:
    """The shape of a :class:`GPT`; every field is keyword-only."""

    vocab_size: int = 256
    """Number of token ids. 256 for a byte-level model: every byte is a token, no tokenizer."""

    block_size: int = 128
    """Longest context the model sees (the length of the position-embedding table)."""

    n_layer: int = 4
    """Number of transformer blocks."""

    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""

    n_embd: int = 128
    """Width of the residual stream."""

    bias: bool = True
    """Biases in the Linear layers and LayerNorms (nanoGPT's GPT-2 default)."""

    dropout: float = 0.0
    """Dropout rate on the embeddings, the attention probabilities and each block's two
    residual branches (nanoGPT's places); 0 for none."""

    remat: bool = False
    """Activation checkpointing of every block (``torch.utils.checkpoint``, non-reentrant):
    a training forward keeps only each block's input and backward runs the block again."""

    def __post_init__(self):
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout={self.dropout!r} must be in [0, 1)")
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig: {name}={value!r} must be a positive int")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig: n_embd={self.n_embd} must be divisible by n_head={self.n_head} "
                "(each head gets n_embd // n_head channels)"
            )


def init_weights(module: nn.Module, n_layer: int) -> None:
    """GPT-2's initialisation, in place, of a :class:`GPT` or any part of one (a part made on
    ``meta`` and materialised with ``to_empty``): Linear and Embedding weights N(0, 0.02),
    biases 0, LayerNorms 1 and 0, and -- GPT-2's scaled init: each block adds two projections
    to the residual stream, so they shrink by sqrt(2 * n_layer) to keep its variance flat
    with depth -- the ``c_proj`` weights N(0, 0.02 / sqrt(2 * n_layer))."""

    def init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        elif isinstance(m, nn.LayerNorm):
            m.reset_parameters()

    module.apply(init)
    for name, p in module.named_parameters():
        if name.endswith("c_proj.weight"):
            nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))


def _dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    # No call at all without dropout: a model without it has no dropout in its graph.
    return F.dropout(x, p, training) if p and training else x


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.dropout = cfg.dropout
        # One matmul makes q, k and v for every head at once: fewer, larger kernels.
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Sizes come from the projection's output, not the config or the input: under tensor
        # parallelism a rank's c_attn makes q, k and v for its own heads only, and under sequence
        # parallelism its input is the rank's shard of the sequence and its output the whole
        # sequence; this code runs unchanged.
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        B, T = q.shape[:2]
        # (B, T, C) -> (B, heads, T, head_dim): heads become a batch dim for the attention kernel.
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        # is_causal=True lets torch pick a fused kernel (flash / memory-efficient) and never
        # materialise the T x T mask that nanoGPT's fallback path keeps as a buffer.
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return _dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, -1)), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _dropout(self.c_proj(F.gelu(self.c_fc(x))), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Pre-LN (GPT-2): the residual stream itself is never normalised, which keeps
        # gradients well-scaled through depth without a careful warmup.
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A decoder-only transformer language model: ``forward(idx) -> logits``.

    Args:
        cfg: the model's shape.

    ``idx`` is a ``(batch, time)`` tensor of token ids with ``time <= cfg.block_size``; the
    logits are ``(batch, time, vocab_size)``, position ``t`` predicting token ``t + 1``.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        # wte is registered first, so named_parameters() -- and hence fzero's params dict --
        # lists the tied matrix once, as "wte.weight".
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # Weight tying (Press & Wolf, 2017): the same matrix reads tokens in and scores them
        # out. Fewer parameters, and it usually helps small models.
        self.lm_head.weight = self.wte.weight
        init_weights(self, cfg.n_layer)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.cfg.block_size:
            raise ValueError(f"GPT: a sequence of {T} tokens is longer than block_size={self.cfg.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = _dropout(self.wte(idx) + self.wpe(pos), self.cfg.dropout, self.training)
        remat = self.cfg.remat and torch.is_grad_enabled()
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if remat else block(x)
        return self.lm_head(self.ln_f(x))


@torch.no_grad()
def generate(
    apply,
    params: dict[str, torch.Tensor],
    idx: torch.Tensor,
    n: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    *,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample ``n`` tokens after the context ``idx`` with the pure ``apply`` function.

    Args:
        apply, params: from ``fzero.functionalize(GPT(cfg))`` (full, unsharded params: use
            ``fzero.gather`` on a sharded state first).
        idx: ``(batch, time)`` token ids to continue.
        n: number of tokens to add.
        temperature: divides the logits; below 1 sharpens, above 1 flattens.
        top_k: sample only among the ``top_k`` most likely tokens (``None``: all of them).
        generator: the random source of the samples (``None``: torch's global one).

    Returns:
        ``(batch, time + n)``: ``idx`` followed by the sampled tokens.
    """
    if temperature <= 0:
        raise ValueError(f"generate: temperature={temperature!r} must be positive")
    # The position table's length is the context the model was built for; read it from the
    # params so this function needs nothing but (apply, params).
    block_size = params["wpe.weight"].shape[0]
    for _ in range(n):
        # Past block_size the model has no position embedding: keep only the latest context.
        logits = apply(params, idx[:, -block_size:])[:, -1, :] / temperature
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, [-1]]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = F.softmax(logits, dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
    return idx
