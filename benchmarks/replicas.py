"""What does ``compile(check_replicas=N)`` cost? The example GPT on 2 ranks (gloo, CPU).

Two compiled steps of the same model and batches, one with ``check_replicas=1`` (a check
after every update: the worst case) and one without, in paired rounds (one step of each per
round, the order alternating), each step timed between barriers. The cost at ``N`` is the
extra time of a checked step spread over ``N`` updates: ``(checked - plain) / N``, against
the plain step, from the median of the per-round differences. The check alone (the
fingerprints and the all-gather, :func:`fzero.replicas.check` on the trained state) is timed
too, as a second estimate that does not depend on the step's noise.

Run (re-executes itself under torchrun with 2 processes)::

    .venv/bin/python benchmarks/replicas.py --rounds 20 --zero 0
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "..", "examples"), HERE]

import fzero  # noqa: E402
from fzero import optim, replicas  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from _common import cpu_model, loadavg, run_under_torchrun  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--zero", type=int, default=0)
    ap.add_argument("--every", type=int, default=100, help="the N the cost is stated for")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    run_under_torchrun(__file__, sys.argv[1:])
    torch.set_num_threads(args.threads)
    mesh = fzero.Mesh(dp=-1)
    rank = dist.get_rank()
    cfg = GPTConfig(block_size=args.block, n_layer=args.layers, n_head=args.heads, n_embd=args.embd)
    g = torch.Generator().manual_seed(rank)
    batch = {"x": torch.randint(0, 256, (args.batch, args.block), generator=g),
             "y": torch.randint(0, 256, (args.batch, args.block), generator=g)}

    def lm_step(state, b):
        def loss_fn(p):
            return F.cross_entropy(state.apply_fn(p, b["x"]).flatten(0, 1), b["y"].flatten())
        loss, grads = fzero.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads), {"loss": loss}

    steps, holders = {}, {}
    for name, every in (("plain", None), ("checked every update", 1)):
        torch.manual_seed(0)
        model = GPT(cfg)
        n_params = sum(p.numel() for p in model.parameters())
        apply, params = fzero.functionalize(model)
        state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(3e-4))
        steps[name] = fzero.compile(lm_step, mesh, zero=args.zero, check_replicas=every)
        holders[name] = steps[name].init(state)
    names = list(steps)
    times = {n: [] for n in names}
    for r in range(args.rounds + args.warmup):
        order = names[r % 2:] + names[: r % 2]
        for n in order:
            dist.barrier()
            t0 = time.perf_counter()
            holders[n], m = steps[n](holders[n], batch)
            float(m["loss"])
            dt = torch.tensor(time.perf_counter() - t0)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's
            if r >= args.warmup:
                times[n].append(float(dt))
    checks = []
    state = holders["plain"]
    n_leaves = len(replicas.fingerprints(state)[0])
    for i in range(args.rounds):
        dist.barrier()
        t0 = time.perf_counter()
        replicas.check(state, i, timeout_s=60)
        dt = torch.tensor(time.perf_counter() - t0)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        checks.append(float(dt))
    if rank != 0:
        return
    plain, checked = statistics.median(times[names[0]]), statistics.median(times[names[1]])
    diff = statistics.median(b - a for a, b in zip(times[names[0]], times[names[1]]))
    ratio = statistics.median(b / a for a, b in zip(times[names[0]], times[names[1]]))
    check = statistics.median(checks)
    print(f"# {cpu_model()}, load {loadavg()}, torch {torch.__version__}, 2 ranks (gloo), {args.threads} thread(s) "
          f"each")
    print(f"# GPT {n_params / 1e6:.2f}M parameters ({args.layers} layers, {args.embd} wide), batch {args.batch} x "
          f"{args.block} per rank, AdamW, fp32, ZeRO-{args.zero}: {n_leaves} compared leaves per rank; "
          f"{args.rounds} paired rounds")
    print("| measure | value |")
    print("| --- | ---: |")
    print(f"| plain step, median | {plain * 1e3:.1f} ms |")
    print(f"| step with check_replicas=1, median | {checked * 1e3:.1f} ms |")
    print(f"| checked / plain, median of per-round ratios | {ratio:.3f} |")
    print(f"| checked - plain, median of per-round differences | {diff * 1e3:.2f} ms |")
    print(f"| the check alone (fingerprints + all-gather), median | {check * 1e3:.2f} ms |")
    print(f"| cost at check_replicas={args.every}, from the paired difference | "
          f"{100 * max(diff, 0.0) / args.every / plain:.3f} % of the step |")
    print(f"| cost at check_replicas={args.every}, from the check alone | "
          f"{100 * check / args.every / plain:.4f} % of the step |")


if __name__ == "__main__":
    main()
