"""What does fzero's layout-invariant dropout cost against torch's?

Two measurements, in one process, in paired rounds (one call of each contestant per round,
the order rotating), medians and the median of the per-round ratios:

1. **The dropout alone**: ``F.dropout`` forward and backward on activations of a GPT's
   shapes, torch's (a Bernoulli draw from its generator) against fzero's (a counter-based
   hash of seed, update, call, global row and position; ``fzero/rng.py``), and attention's
   dropout: ``scaled_dot_product_attention(dropout_p=0.1)``, torch's kernel against fzero's
   (the attention's math with fzero's mask on the probabilities).
2. **A training step**: the example GPT with dropout 0.1 after the embeddings, in every
   attention (its probabilities, through ``scaled_dot_product_attention``) and after every
   residual branch, under ``fzero.compile`` (fzero's dropout) against the same step run
   with torch's dropout (fzero's replacement switched off), AdamW, fp32.

    python benchmarks/dropout.py --threads 2 --rounds 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

import fzero  # noqa: E402
from fzero import optim  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from _common import cpu_model, loadavg  # noqa: E402


class DropoutGPT(GPT):
    """The example GPT with GPT-2's dropouts (embeddings, attention probabilities, residual
    branches), at rate ``p``."""

    def __init__(self, cfg, p):
        super().__init__(cfg)
        self.p = p
        for block in self.blocks:
            attn = block.attn
            original = attn.forward

            def forward(x, attn=attn):
                B, T, _ = x.shape
                q, k, v = attn.c_attn(x).chunk(3, dim=2)
                q, k, v = (t.view(B, T, -1, attn.head_dim).transpose(1, 2) for t in (q, k, v))
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                   dropout_p=self.p if self.training else 0.0)
                return F.dropout(attn.c_proj(y.transpose(1, 2).reshape(B, T, -1)), self.p, self.training)

            attn.forward = forward
            del original


def paired(fns: dict, rounds: int, warmup: int = 2) -> dict[str, list[float]]:
    names = list(fns)
    times = {n: [] for n in names}
    for r in range(rounds + warmup):
        order = names[r % len(names):] + names[: r % len(names)]
        for n in order:
            t0 = time.perf_counter()
            fns[n]()
            dt = time.perf_counter() - t0
            if r >= warmup:
                times[n].append(dt)
    return times


def report(title: str, times: dict[str, list[float]], base: str) -> None:
    print(f"\n{title}")
    print(f"| contestant | median ms | x {base} (median of per-round ratios) |")
    print("| --- | ---: | ---: |")
    for n, t in times.items():
        ratio = statistics.median(a / b for a, b in zip(t, times[base]))
        print(f"| {n} | {statistics.median(t) * 1e3:.2f} | {ratio:.2f} |")


def in_step(fn):
    """``fn`` run inside a step fzero runs (its dropout), on a throwaway state."""
    apply, params = fzero.functionalize(nn.Linear(1, 1))
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.0))
    step = fzero.Step(lambda s, b: (fn(), (s, {}))[1])
    return lambda: step(state, torch.zeros(8, 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# {cpu_model()}, {args.threads} threads, torch {torch.__version__}, load {loadavg()}")

    B, T, C, H = args.batch, args.block, args.embd, args.heads
    x = torch.randn(B, T, 4 * C, requires_grad=True)
    q, k, v = (torch.randn(B, H, T, C // H, requires_grad=True) for _ in range(3))

    def torch_dropout():
        F.dropout(x, 0.1, True).sum().backward()

    def torch_attention():
        F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True).sum().backward()

    report(f"F.dropout forward + backward on ({B}, {T}, {4 * C}) fp32, p = 0.1",
           paired({"torch": torch_dropout, "fzero": in_step(torch_dropout)}, args.rounds), "torch")
    report(f"scaled_dot_product_attention(dropout_p=0.1) forward + backward, ({B}, {H}, {T}, {C // H})",
           paired({"torch": torch_attention, "fzero": in_step(torch_attention)}, args.rounds), "torch")

    cfg = GPTConfig(block_size=T, n_layer=args.layers, n_head=H, n_embd=C)
    g = torch.Generator().manual_seed(0)
    batch = {"x": torch.randint(0, 256, (B, T), generator=g), "y": torch.randint(0, 256, (B, T), generator=g)}

    def lm_step(state, b):
        def loss_fn(p):
            logits = state.apply_fn(p, b["x"])
            return F.cross_entropy(logits.flatten(0, 1), b["y"].flatten())

        loss, grads = fzero.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads), {"loss": loss}

    steps = {}
    for name in ("torch dropout", "fzero dropout"):
        torch.manual_seed(0)
        apply, params = fzero.functionalize(DropoutGPT(cfg, 0.1))
        state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(3e-4))
        if name == "torch dropout":
            state = state.replace(seed=None)  # a state without a seed keeps torch's own dropout
        step = fzero.compile(lm_step)
        holder = {"state": step.init(state)}

        def run(step=step, holder=holder):
            holder["state"], _ = step(holder["state"], batch)

        steps[name] = run
    report(f"a training step of a {sum(p.numel() for p in DropoutGPT(cfg, 0.1).parameters()) / 1e6:.1f}M GPT "
           f"with dropout 0.1 (batch {B} x {T}, AdamW, fp32)", paired(steps, max(3, args.rounds // 2), 1),
           "torch dropout")


if __name__ == "__main__":
    main()
