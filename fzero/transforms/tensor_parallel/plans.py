"""Tensor-parallel plans for models people train, for :func:`fzero.tensor_parallel`; public
as ``fzero.transforms.tp_plans``.

Each takes the model (its sizes decide the head width) and returns a plan: module-name globs
to styles. Attention is split by heads (q, k, v by columns, the output projection by rows,
never cutting a head), the MLP by Megatron's column / row pair; norms stay whole, and so do
the embeddings and the LM head unless asked (``vocab=True``: split by vocabulary, the loss
then computed across ``tp`` by ``F.cross_entropy`` on :class:`VocabShardedLogits`).

Example:
    >>> import torch
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from fzero.transforms import tp_plans
    >>> model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=32))
    >>> sorted(tp_plans.llama(model))[:2]
    ['model.layers.*.mlp.down_proj', 'model.layers.*.mlp.gate_proj']
"""

from __future__ import annotations

from typing import Any

import torch

from fzero.transforms.tensor_parallel._sequence import PrepareModuleInput, SequenceParallel
from fzero.transforms.tensor_parallel._styles import ColwiseParallel, DivideAttributes, RowwiseParallel

__all__ = ["gpt", "gpt2", "llama"]


def llama(model: torch.nn.Module, *, vocab: bool = False) -> dict[str, Any]:
    """Hugging Face Llama (and Mistral/Qwen2-shaped) decoder layers: heads split over ``tp``
    (``num_attention_heads`` and ``num_key_value_heads`` must divide by it), the gated MLP
    by columns then rows. The attention's own code reads the head count from the tensors'
    shapes, so no attribute changes.

    Args:
        vocab: also split ``model.embed_tokens`` (:class:`RowwiseParallel`) and ``lm_head``
            (``ColwiseParallel(output="vocab")``) by vocabulary (``tie_word_embeddings=False``
            and ``vocab_size`` divisible by ``tp``). Off by default: the logits are then a
            :class:`VocabShardedLogits`, which supports the loss (``F.cross_entropy``, Hugging
            Face's own) but refuses what reads the whole vocabulary (an argmax for accuracy,
            generation).
    """
    head = model.config.hidden_size // model.config.num_attention_heads
    head = getattr(model.config, "head_dim", None) or head
    layers = "model.layers.*"
    return {
        f"{layers}.self_attn.q_proj": ColwiseParallel(unit=head),
        f"{layers}.self_attn.k_proj": ColwiseParallel(unit=head),
        f"{layers}.self_attn.v_proj": ColwiseParallel(unit=head),
        f"{layers}.self_attn.o_proj": RowwiseParallel(unit=head),
        f"{layers}.mlp.gate_proj": ColwiseParallel(),
        f"{layers}.mlp.up_proj": ColwiseParallel(),
        f"{layers}.mlp.down_proj": RowwiseParallel(),
        **({"model.embed_tokens": RowwiseParallel(), "lm_head": ColwiseParallel(output="vocab")} if vocab else {}),
    }


def gpt2(model: torch.nn.Module, *, sequence_parallel: bool = False) -> dict[str, Any]:
    """Hugging Face GPT-2 blocks (``Conv1D`` layers): the fused q/k/v projection split as
    three blocks by heads, the attention's ``split_size`` and ``num_heads`` divided (its
    forward cuts the fused output with them), the MLP by columns then rows.

    Args:
        sequence_parallel: also the places of Megatron's sequence parallelism, for
            ``compile(..., tp=plan, sequence_parallel=True)``: shards from the first block's
            input, the blocks' LayerNorms on them, and the whole sequence gathered for the
            final LayerNorm (``GPT2Model`` reshapes its output to the input's length).
    """
    from torch.distributed.tensor import Replicate, Shard

    head = model.config.n_embd // model.config.n_head
    blocks = "transformer.h.*"
    plan: dict[str, Any] = {
        f"{blocks}.attn.c_attn": ColwiseParallel(parts=3, unit=head),
        f"{blocks}.attn.c_proj": RowwiseParallel(unit=head),
        f"{blocks}.attn": DivideAttributes("split_size", "num_heads"),
        f"{blocks}.mlp.c_fc": ColwiseParallel(),
        f"{blocks}.mlp.c_proj": RowwiseParallel(),
    }
    if sequence_parallel:
        plan.update({
            "transformer.h.0": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1)),
            f"{blocks}.ln_1": SequenceParallel(),
            f"{blocks}.ln_2": SequenceParallel(),
            "transformer.ln_f": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
        })
    return plan


def gpt(model: torch.nn.Module, *, sequence_parallel: bool = False) -> dict[str, Any]:
    """The example GPT (``examples/gpt.py``): the fused q/k/v projection as three blocks by
    heads (``n_head`` must divide by ``tp``) and the output projection by rows, the MLPs by
    columns then rows. Its attention reads the head count from the tensors' shapes, so
    nothing else changes.

    Args:
        sequence_parallel: also the places of Megatron's sequence parallelism, for
            ``compile(..., tp=plan, sequence_parallel=True)``: the residual stream is cut into
            sequence shards at the first block's input, the blocks' LayerNorms and the final
            one run on the shards, and the whole LM head (tied to the embedding) gets the
            whole sequence back (as torch's Llama plan: ``norm: SequenceParallel()`` before the
            output layer).
    """
    from torch.distributed.tensor import Replicate, Shard

    head = model.cfg.n_embd // model.cfg.n_head
    plan: dict[str, Any] = {
        "blocks.*.attn.c_attn": ColwiseParallel(parts=3, unit=head),
        "blocks.*.attn.c_proj": RowwiseParallel(unit=head),
        "blocks.*.mlp.c_fc": ColwiseParallel(),
        "blocks.*.mlp.c_proj": RowwiseParallel(),
    }
    if sequence_parallel:
        plan.update({
            "blocks.0": PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1)),
            "blocks.*.ln_1": SequenceParallel(),
            "blocks.*.ln_2": SequenceParallel(),
            "ln_f": SequenceParallel(),
            "lm_head": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
        })
    return plan
