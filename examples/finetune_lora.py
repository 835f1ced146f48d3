"""Fine-tune the example GPT with LoRA adapters: the base weights frozen, adapters trained.

LoRA (Hu et al., 2021) adds a low-rank update ``B @ A`` beside a frozen weight ``W``:
``y = x W^T + (alpha / r) * x A^T B^T``. Only ``A`` and ``B`` train, so the optimizer state
is ``2 * 4 * r * (d_in + d_out)`` bytes per adapted matrix instead of ``8 * d_in * d_out``.

fzero needs nothing special for it: the base weights are ordinary parameters with
``requires_grad=False``, which ``fzero.functionalize`` records in ``params.frozen``; they get
no gradient, no optimizer state and no gradient communication, at every ZeRO stage, and stay
bit-identical. At the end ``fzero.load_into`` puts the trained weights back into the module.

Run (one process, or ``fzero launch --nproc 2 examples/finetune_lora.py --zero 2``)::

    python examples/finetune_lora.py --steps 30

Example:
    >>> import torch, fzero
    >>> from gpt import GPT, GPTConfig
    >>> model = add_lora(GPT(GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=16)), rank=2)
    >>> apply, params = fzero.functionalize(model)
    >>> sorted(k for k in params if k not in params.frozen)  # doctest: +NORMALIZE_WHITESPACE
    ['blocks.0.attn.c_attn.lora_a', 'blocks.0.attn.c_attn.lora_b',
     'blocks.0.attn.c_proj.lora_a', 'blocks.0.attn.c_proj.lora_b']
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # `gpt` beside this file

import fzero  # noqa: E402
from fzero import optim  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from train_gpt import train_step  # noqa: E402  (full training's step as it is: frozen weights need nothing)


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update.

    Args:
        base: the linear layer to adapt; its parameters are frozen in place.
        rank: ``r``, the rank of the update.
        alpha: the update is scaled by ``alpha / r`` (the paper's choice, so the learning rate
            need not change with ``r``).
    """

    def __init__(self, base: nn.Linear, rank: int = 4, alpha: float = 8.0):
        super().__init__()
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        # A random, B zero: the adapted model starts as the base model exactly.
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) / math.sqrt(base.in_features))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + self.scale * F.linear(F.linear(x, self.lora_a), self.lora_b)


def add_lora(model: nn.Module, *, rank: int = 4, alpha: float = 8.0, targets: tuple[str, ...] = ("attn",)) -> nn.Module:
    """Freeze every parameter of ``model`` and wrap its Linear layers under ``targets``
    (module-name substrings) in :class:`LoRALinear`. Returns ``model``, changed in place."""
    for p in model.parameters():
        p.requires_grad_(False)
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear) and any(t in full for t in targets):
                setattr(module, child_name, LoRALinear(child, rank, alpha))
    return model


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per update, per rank")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--rank", type=int, default=4, help="LoRA rank")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    model = add_lora(GPT(GPTConfig(block_size=args.block_size, n_layer=2, n_head=4, n_embd=64)), rank=args.rank)
    apply, params = fzero.functionalize(model)
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(args.lr, weight_decay=0.0))
    frozen_before = {k: params[k].clone() for k in params.frozen}

    mesh = fzero.Mesh(dp=-1)
    step = fzero.compile(train_step, mesh, zero=args.zero)
    state = step.init(state)
    # The task: continue a fixed random byte pattern, so the adapters have something to learn.
    g = torch.Generator().manual_seed(args.seed + 1 + mesh.rank)
    pattern = torch.randint(0, 256, (97,), generator=g.manual_seed(args.seed + 1))
    losses = []
    for i in range(args.steps):
        starts = torch.randint(0, 97, (args.batch_size,), generator=g)
        idx = (starts[:, None] + torch.arange(args.block_size + 1)) % 97
        seq = pattern[idx]
        state, metrics = step(state, {"x": seq[:, :-1], "y": seq[:, 1:]})
        losses.append(float(metrics["loss"]))
        if mesh.rank == 0 and (i % 10 == 0 or i == args.steps - 1):
            print(f"step {i:4d}  loss {losses[-1]:.4f}")
    # Optimizer state exists for the adapters only.
    opt_bytes = sum(x.numel() * x.element_size() for x in fzero.tree.leaves(state.opt_state)
                    if isinstance(x, torch.Tensor) and x.dim() > 0)
    trainable = sum(v.numel() for k, v in params.items() if k not in params.frozen)
    fzero.load_into(model, state)
    unchanged = all(torch.equal(dict(model.named_parameters())[k], v) for k, v in frozen_before.items())
    if mesh.rank == 0:
        print(f"trainable parameters {trainable:,} of {sum(v.numel() for v in params.values()):,}; "
              f"optimizer state {opt_bytes:,} bytes on this rank; frozen weights unchanged: {unchanged}")
    return {"losses": losses, "opt_bytes": opt_bytes, "trainable": trainable, "frozen_unchanged": unchanged}


if __name__ == "__main__":
    main()
