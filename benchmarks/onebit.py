"""The 1-bit family beside Adam on 2 ranks: loss curves of a tiny GPT and the bytes
each rank sends per update.

Every contestant trains a copy of one seeded GPT (``examples/gpt.py``) on the same batches:
windows of a seeded Markov source (:func:`corpus`: something to learn, the same everywhere),
each rank its own rows of every global batch, under
``fzero.compile(train_step, mesh)`` (ZeRO stage 0, fp32, no clipping):

* ``adam``          -- ``fzero.optim.adamw(lr, weight_decay=0)``: torch's Adam, bias-corrected
* ``adam-nobc``     -- ``adamw(lr, weight_decay=0, bias_correction=False)``: what the 1-bit warm-ups are
* ``onebit-adam``   -- ``onebit_adam(lr, freeze_step=F)``
* ``zero-one-adam`` -- ``zero_one_adam(lr, var_freeze_step=F, var_update_scaler=16, local_step_scaler=F,
  local_step_clipper=4)``
* ``lamb``          -- ``deepspeed_lamb(lamb_lr, bias_correction=False)``: what 1-bit LAMB's warm-up is
* ``onebit-lamb``   -- ``onebit_lamb(lamb_lr, freeze_step=F)``

with ``F`` = ``--freeze`` (default a quarter of the run, as DeepSpeed's tutorials warm up for
about 15-25% of it). It prints, per contestant, the mean training loss over each window of
``--every`` updates, the last window's margin over ``adam``, and the bytes a rank sent per
update on the wire (``fzero.distributed.comm``'s count of gradient and compressed payloads): at
update 0, and the mean over the updates after the warm-up (0/1 Adam's local steps send nothing).

Run (either form; the second re-executes itself under torchrun with 2 processes)::

    .venv/bin/torchrun --nproc_per_node 2 benchmarks/onebit.py
    .venv/bin/python benchmarks/onebit.py --steps 200

Not a timing: the numbers are losses and bytes, the same on any machine up to rounding.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fzero  # noqa: E402
from fzero import optim  # noqa: E402
from fzero.distributed import comm  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import run_under_torchrun  # noqa: E402


def contestants(lr: float, lamb_lr: float, b2: float, freeze: int) -> dict:
    return {
        "adam": lambda: optim.adamw(lr, b2=b2, weight_decay=0.0),
        "adam-nobc": lambda: optim.adamw(lr, b2=b2, weight_decay=0.0, bias_correction=False),
        "onebit-adam": lambda: optim.onebit_adam(lr, b2=b2, freeze_step=freeze),
        "zero-one-adam": lambda: optim.zero_one_adam(lr, b2=b2, var_freeze_step=freeze, var_update_scaler=16,
                                                     local_step_scaler=freeze, local_step_clipper=4),
        "lamb": lambda: optim.deepspeed_lamb(lamb_lr, b2=b2, bias_correction=False),
        "onebit-lamb": lambda: optim.onebit_lamb(lamb_lr, b2=b2, freeze_step=freeze),
    }


def corpus(n: int = 100_000, vocab: int = 64) -> tuple[torch.Tensor, int]:
    """A seeded Markov source: after each token one of 4 successors drawn for that token
    (uniformly), or with probability 0.1 any token. Something to learn (its entropy is about
    1.95 nats a token, against ln 64 = 4.16 for a guess), the same on every machine, and every
    token occurs early and often (a token that never occurs has a gradient
    of exactly 0, which 1-bit compression cannot represent: docs/optim.md)."""
    g = torch.Generator().manual_seed(0)
    table = torch.randint(vocab, (vocab, 4), generator=g).tolist()
    pick, noise, anyone = (torch.randint(4, (n,), generator=g).tolist(), torch.rand(n, generator=g).tolist(),
                           torch.randint(vocab, (n,), generator=g).tolist())
    out = [0]
    for i in range(n - 1):
        out.append(anyone[i] if noise[i] < 0.1 else table[out[-1]][pick[i]])
    return torch.tensor(out), vocab


def batches(data: torch.Tensor, steps: int, per_rank: int, block: int) -> list[dict]:
    """This rank's rows of each global batch: random windows of the corpus, one seed."""
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        starts = torch.randint(len(data) - block - 1, (per_rank * world,), generator=g)[rank * per_rank:][:per_rank]
        x = torch.stack([data[s: s + block + 1] for s in starts.tolist()])
        out.append({"x": x[:, :-1].contiguous(), "y": x[:, 1:].contiguous()})
    return out


def train_step(state, batch):
    def loss_fn(p):
        logits = state.apply_fn(p, batch["x"])
        return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())

    loss, grads = fzero.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads), {"loss": loss}


def run(make_tx, data, cfg: GPTConfig) -> tuple[list[float], list[float]]:
    torch.manual_seed(0)
    apply, params = fzero.functionalize(GPT(cfg))
    step = fzero.compile(train_step, fzero.Mesh(dp=-1))
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=make_tx()))
    losses, sent = [], []
    for b in data:
        before = comm.traffic.copy()
        state, m = step(state, b)
        spent = comm.traffic - before
        sent.append(float(spent.sent(what="gradients") + spent.sent(what="compressed")))
        losses.append(float(m["loss"]))
    return losses, sent


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--freeze", type=int, default=None, help="warm-up updates (default: steps // 4)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--lamb-lr", type=float, default=2e-2, help="the LAMBs' learning rate (a trust ratio "
                   "scales each step to the parameter's norm)")
    p.add_argument("--b2", type=float, default=0.95, help="every contestant's beta2 (a short run: the variance "
                   "the warm-up freezes must have converged by then, as over DeepSpeed's thousands of steps)")
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--block", type=int, default=64)
    args = p.parse_args(argv)
    run_under_torchrun(__file__, sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    fzero.Mesh(dp=-1)  # the process group, from torchrun's environment
    freeze = args.steps // 4 if args.freeze is None else args.freeze
    tokens, vocab = corpus()
    cfg = GPTConfig(vocab_size=vocab, block_size=args.block, n_layer=2, n_head=2, n_embd=64)
    data = batches(tokens, args.steps, args.batch, args.block)
    results = {name: run(make, data, cfg) for name, make in contestants(args.lr, args.lamb_lr, args.b2, freeze).items()}
    if dist.get_rank() != 0:
        return
    n_params = sum(x.numel() for x in GPT(cfg).parameters())
    print(f"# 2 ranks, GPT {n_params} parameters (2 layers x 64), {args.batch} x {args.block} tokens per rank, "
          f"lr {args.lr} (LAMBs {args.lamb_lr}), betas (0.9, {args.b2}), warm-up {freeze} of {args.steps} "
          f"updates; mean loss per {args.every} updates")
    windows = range(0, args.steps, args.every)
    print(f"{'updates':>14} | " + " | ".join(f"{n:>13}" for n in results))
    for w in windows:
        row = [sum(results[n][0][w:w + args.every]) / len(results[n][0][w:w + args.every]) for n in results]
        print(f"{w:>6}-{min(w + args.every, args.steps) - 1:<7} | " + " | ".join(f"{x:>13.4f}" for x in row))
    last = {n: sum(r[0][-args.every:]) / args.every for n, r in results.items()}
    print(f"{'last - adam':>14} | " + " | ".join(f"{last[n] - last['adam']:>+13.4f}" for n in results))
    print(f"{'last - lamb':>14} | " + " | ".join(f"{last[n] - last['lamb']:>+13.4f}" for n in results))
    after = {n: sum(r[1][freeze + 1:]) / len(r[1][freeze + 1:]) for n, r in results.items()}
    print(f"{'bytes, update 0':>14} | " + " | ".join(f"{r[1][0]:>13.0f}" for r in results.values()))
    print(f"{'bytes, mean >F':>14} | " + " | ".join(f"{after[n]:>13.0f}" for n in results))
    print(f"{'ratio':>14} | " + " | ".join(f"{after[n] / r[1][0]:>13.4f}" for n, r in results.items()))


if __name__ == "__main__":
    main()
