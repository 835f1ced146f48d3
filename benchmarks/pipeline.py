"""Pipeline on 2 ranks: measured bubble against (p-1)/(m+p-1), and step time against DDP.

One model for every contestant: an MLP of ``--layers`` Linear(width, width) + Tanh blocks and
a Linear head, fp32, SGD (lr 1e-3), MSE loss, global batch ``--batch`` rows per step.

* ``ddp``        -- ``DistributedDataParallel`` + ``torch.optim.SGD``: each rank the full model,
  half the batch (the usual way to use 2 ranks for a model that fits)
* ``fzero dp``   -- ``fzero.shard_state(train_step, Mesh(dp=2), 0)``: fzero's own DDP
* ``pp gpipe m`` / ``pp 1f1b m`` -- ``fzero.pipeline`` over ``Mesh(pp=2)``: layers split half and
  half (``fzero.pipeline.split``), each rank one stage and the whole batch in ``m`` micro-batches

Bubble: inside each pipelined step a rank records the seconds it spends computing forwards
and backwards (``pipe.stats["compute_s"]``) and the seconds the schedule takes
(``step_s``, from its first forward to the loss broadcast); the bubble is
``1 - compute_s / step_s``, the share of the schedule a rank waits. It is averaged over the
two ranks and taken as the median over the timed steps. The theory, (p-1)/(m+p-1), assumes
equal stages, a backward costing a fixed multiple of a forward, free communication and no
per-micro-batch overhead; the measured figure includes the sends and receives.

Step time: each step starts after a barrier; its time is the slowest rank's; we report the
median over the timed steps and its ratio to DDP's. The configurations run in rounds (one
step of each per round, the order rotated each round), so drift in a shared machine hits all
alike.

Run (either form; the second re-executes itself under torchrun with 2 processes)::

    .venv/bin/torchrun --standalone --nproc_per_node 2 benchmarks/pipeline.py --steps 12 --warmup 3
    .venv/bin/python benchmarks/pipeline.py --steps 12 --warmup 3
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fzero
from fzero import optim
from fzero.transforms.pipeline import pipeline, split
from _common import run_under_torchrun


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=7)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--micro", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    return ap.parse_args(argv)


def make_model(args) -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(args.width, args.width))


def build_ddp(args, batch):
    model = make_model(args)
    ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    r = dist.get_rank()
    x, y = batch["x"].chunk(2)[r], batch["y"].chunk(2)[r]

    def step():
        opt.zero_grad(set_to_none=True)
        F.mse_loss(ddp(x), y).backward()
        opt.step()
        return None

    return step


def _state(args):
    model = make_model(args)
    apply, params = fzero.functionalize(model)
    return model, fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(1e-3))


def build_fzero_dp(args, batch):
    _, state = _state(args)

    def train_step(state, b):
        loss, g = fzero.value_and_grad(lambda p: F.mse_loss(state.apply_fn(p, b["x"]), b["y"]))(state.params)
        return state.apply_gradients(g), {"loss": loss}

    st = fzero.shard_state(train_step, fzero.Mesh(dp=2), 0)
    box = {"state": st.init(state)}
    r = dist.get_rank()
    local = {k: v.chunk(2)[r] for k, v in batch.items()}

    def step():
        box["state"], _ = st(box["state"], local)
        return None

    return step


def build_pipeline(args, batch, kind, m):
    model, state = _state(args)
    mesh = fzero.Mesh(pp=2, dp=1)
    # Half the Linear layers (the head included) on each stage: balanced stages.
    cut = 2 * ((args.layers + 1) // 2)
    pipe = pipeline(split(model, [cut]), F.mse_loss, mesh, micro_batches=m, schedule=kind)

    def train_step(state, b):
        loss, g = pipe(state.params, b["x"], b["y"])
        return state.apply_gradients(g), {"loss": loss}

    st = pipe.transform(train_step)
    box = {"state": st.init(state)}

    def step():
        box["state"], _ = st(box["state"], batch)
        return pipe.stats

    return step


def timed(step) -> tuple[float, dict | None]:
    dist.barrier()
    t0 = time.perf_counter()
    stats = step()
    dt = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt), stats


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    run_under_torchrun(__file__, argv)
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    if dist.get_world_size() != 2:
        raise SystemExit("benchmarks/pipeline.py: run on exactly 2 ranks")
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randn(args.batch, args.width, generator=g), "y": torch.randn(args.batch, args.width, generator=g)}
    contestants = {"ddp": build_ddp(args, batch), "fzero dp (zero=0)": build_fzero_dp(args, batch)}
    for kind in ("gpipe", "1f1b"):
        for m in args.micro:
            contestants[f"pp {kind} m={m}"] = build_pipeline(args, batch, kind, m)
    names = list(contestants)
    times = {n: [] for n in names}
    bubbles = {n: [] for n in names}
    for rnd in range(args.warmup + args.steps):
        order = names[rnd % len(names):] + names[: rnd % len(names)]
        for n in order:
            dt, stats = timed(contestants[n])
            if rnd < args.warmup:
                continue
            times[n].append(dt)
            if stats:
                b = torch.tensor([stats["bubble"]])
                dist.all_reduce(b)
                bubbles[n].append(float(b) / 2)
    if dist.get_rank() == 0:
        report(args, names, times, bubbles)
    dist.destroy_process_group()


def report(args, names, times, bubbles) -> None:
    params = args.layers * (args.width * args.width + args.width) + args.width * args.width + args.width
    print(f"# fzero pipeline benchmark: 2 ranks (gloo, {args.threads} thread each), torch {torch.__version__}, "
          f"{platform.processor() or platform.machine()}")
    print(f"# load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"({os.cpu_count()} CPUs; other processes share them)")
    print(f"# MLP {args.layers}x{args.width} + head ({params / 1e6:.2f}M params), fp32, SGD, global batch "
          f"{args.batch} rows; {args.steps} timed steps after {args.warmup} warm-up, median, slowest rank")
    print()
    print("| schedule | m | bubble measured | (p-1)/(m+p-1) | step time (ms) | x DDP |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    base = statistics.median(times["ddp"])
    for n in names:
        t = statistics.median(times[n])
        if n.startswith("pp "):
            _, kind, mm = n.split()
            m = int(mm.split("=")[1])
            bub = f"{statistics.median(bubbles[n]):.3f}"
            theory = f"{1 / (m + 1):.3f}"
        else:
            kind, m, bub, theory = n, "", "", ""
        print(f"| {kind} | {m} | {bub} | {theory} | {t * 1e3:.1f} | {t / base:.2f} |")


if __name__ == "__main__":
    main()
