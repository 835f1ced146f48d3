"""Loss curves of bf16 masters against fp32 masters on the tiny GPT: what rounding loses.

One process, one seeded byte-level GPT (``examples/gpt.py``) trained on the same batches of
the Python standard library's source (``examples/train_gpt.py``'s data) by each contestant:

* ``fp32``                 -- ``fzero.compile(train_step)``
* ``bf16, fp32 masters``   -- ``precision="bf16"`` (fp32 masters and Adam moments, 16 B/param)
* ``bf16 masters``         -- ``master_weights="bf16"``, rounding to nearest (14 B/param)
* ``bf16 masters, SR``     -- the same, ``rounding="stochastic"`` (14 B/param)
* ``bf16 masters, Kahan``  -- the same, ``rounding="kahan"`` (16 B/param)
* ``bf16 all, Kahan``      -- bf16 masters and moments, ``rounding="kahan"`` (12 B/param)
* ``bf16 all``             -- bf16 masters and moments, rounding to nearest (10 B/param)

(B/param: parameters + gradients + masters + optimizer state at ZeRO stage 0, Adam.)

AdamW, ``--lr`` constant after a linear warm-up. The learning rate decides how much rounding
to nearest loses: an Adam update is about ``lr`` in size, and a bf16 weight ``w`` drops any
update below half its ulp (``|w| * 2**-8``); LayerNorm gains sit at 1.0, where that is 0.0039.

It prints, every ``--every`` steps, each contestant's train loss averaged over the last
``--every`` steps, and the mean over the final ``--every`` steps. Not a timing: the
contestants run one after another on whatever the machine has free.

Run::

    PYTHONPATH=. .venv/bin/python benchmarks/bf16_modes.py --steps 300 --lr 3e-4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import fzero  # noqa: E402
from fzero import optim  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from train_gpt import get_batch, load_stdlib, train_step  # noqa: E402

CONTESTANTS = {
    "fp32": {},
    "bf16, fp32 masters": {"precision": "bf16"},
    "bf16 masters": {"precision": "bf16", "master_weights": "bf16"},
    "bf16 masters, SR": {"precision": "bf16", "master_weights": "bf16", "rounding": "stochastic"},
    "bf16 masters, Kahan": {"precision": "bf16", "master_weights": "bf16", "rounding": "kahan"},
    "bf16 all, Kahan": {"precision": "bf16", "master_weights": "bf16", "optimizer_states": "bf16",
                        "rounding": "kahan"},
    "bf16 all": {"precision": "bf16", "master_weights": "bf16", "optimizer_states": "bf16"},
}


def curve(options: dict, batches: list, cfg: GPTConfig, lr: float, warmup: int) -> list[float]:
    torch.manual_seed(0)
    apply, params = fzero.functionalize(GPT(cfg))
    tx = optim.adamw(optim.schedules.linear_warmup(lr, warmup), weight_decay=0.0)
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=tx)
    step = fzero.compile(train_step, **options)
    state = step.init(state)
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    return losses


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--every", type=int, default=25)
    p.add_argument("--only", default=None, help="contestant names separated by \";\"")
    p.add_argument("--json", default=None, help="also write the curves to this file")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    data, _ = load_stdlib(2_000_000)
    g = torch.Generator().manual_seed(1)
    batches = [get_batch(data, args.batch_size, args.block_size, g) for _ in range(args.steps)]
    cfg = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)
    names = list(CONTESTANTS) if args.only is None else args.only.split(";")
    curves = {}
    for name in names:
        curves[name] = curve(CONTESTANTS[name], batches, cfg, args.lr, args.warmup)
        print(f"  {name}: done", file=sys.stderr, flush=True)
    k = args.every
    width = max(len(n) for n in names)
    print(f"train loss, mean of each {k} steps; lr {args.lr:g}, warm-up {args.warmup}, "
          f"GPT {args.n_layer} x {args.n_embd}, batch {args.batch_size} x {args.block_size}")
    print(" " * width + "  " + " ".join(f"{s:>6d}" for s in range(k, args.steps + 1, k)))
    for name in names:
        c = curves[name]
        means = [sum(c[s - k:s]) / k for s in range(k, args.steps + 1, k)]
        print(f"{name:<{width}}  " + " ".join(f"{m:6.3f}" for m in means))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "curves": curves}, indent=1))
    return curves


if __name__ == "__main__":
    main()
