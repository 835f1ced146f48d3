"""Checkpoint throughput on 2 ranks: fzero.checkpoint against torch.distributed.checkpoint (DCP).

The state: a ~50M-parameter MLP (12 x Linear(2048, 2048)), fp32, AdamW, under
``fzero.compile(train_step, mesh, zero=1)`` after one step: parameters replicated on both
ranks, the two Adam moments partitioned (each rank holds its slice). About 600 MB in all,
~300 MB per rank.

DCP gets the same data, laid out the way DCP shards it: the parameters as plain tensors
(replicated: DCP's planner has one rank write each) and each flat group of each moment as a
``DTensor`` with ``Shard(0)`` placement over the 2 ranks (ZeRO-1 / FSDP1's flat layout, which
DCP can reshard). Both use their defaults: DCP's ``FileSystemWriter`` fsyncs its files, as
fzero does; fzero also checksums every block on save and verifies it on load, DCP does not.

Each operation runs between two barriers; its time is the slowest rank's. Throughput per
rank = (the checkpoint's bytes / 2) / time. Operations alternate between the two libraries
for ``--reps`` rounds (the order flips each round) and the table shows medians. Loads read
from the page cache in both cases (the files were just written). DCP loads in place into
the state dict; fzero's ``load`` returns new tensors by default and writes into ``like``'s
with ``in_place=True``; both are shown, and the ratio uses the like-for-like (in place).

Run (either form; the second re-executes itself under torchrun with 2 processes)::

    .venv/bin/torchrun --nproc_per_node 2 benchmarks/checkpoint.py --reps 3
    .venv/bin/python benchmarks/checkpoint.py --reps 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import fzero  # noqa: E402
import fzero.checkpoint as ckpt  # noqa: E402
from fzero import optim  # noqa: E402
from _common import run_under_torchrun  # noqa: E402

MiB = 2**20


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--stage", type=int, default=1, choices=(1, 2))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def _train_step(state, batch):
    loss, g = fzero.value_and_grad(lambda p: F.mse_loss(state.apply_fn(p, batch["x"]), batch["y"]))(state.params)
    return state.apply_gradients(g), {"loss": loss}


def build(args):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.depth)])
    apply, params = fzero.functionalize(model)
    n_params = sum(p.numel() for p in params.values())
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-3))
    step = fzero.compile(_train_step, fzero.Mesh(dp=-1), zero=args.stage)
    state = step.init(state)
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(2, args.width, generator=g)
    state, _ = step(state, {"x": x, "y": x})  # the moments are no longer zeros
    return state, step, n_params


def dcp_state_dict(state, step):
    """The same data as DCP shards it: replicated params, flat moment groups as DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    s = step
    while not hasattr(s, "handler"):  # the shard_state step inside compile's
        s = s.inner
    layout = s.handler.layout
    adam = next(s for s in fzero.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(s, "mu"))
    sd = {"step": state.step.clone(), "params": dict(state.params), "opt": {}}
    for kind in ("mu", "nu"):
        pieces = getattr(adam, kind)
        for g in layout.groups:
            local = torch.zeros(g.chunk, dtype=g.dtype)
            base = g.rank * g.chunk
            for i, name in enumerate(g.names):
                a, b = g.info(i).piece()
                lo = g.offsets[i] + a - base
                local[lo: lo + (b - a)] = pieces[name].local.reshape(-1)
            sd["opt"][f"{kind}.group{g.index}"] = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=torch.Size([g.padded]), stride=(1,))
    return sd


def nbytes(state) -> int:
    """Bytes of the checkpoint's data: every leaf once (replicated leaves counted once)."""
    total = 0
    for x in fzero.tree.leaves(state, is_leaf=lambda x: hasattr(x, "info")):
        if hasattr(x, "info"):
            t = torch.tensor(0, dtype=x.local.dtype)
            n = 1
            for s in x.info.shape:
                n *= s
            total += n * t.element_size()
        elif isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
    return total


def timed(fn):
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    dist.barrier()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t), out


def run(args):
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(args.threads)
    rank, world = dist.get_rank(), dist.get_world_size()
    state, step, n_params = build(args)
    data = nbytes(state)
    sd = dcp_state_dict(state, step)
    if rank == 0:
        root = args.dir or tempfile.mkdtemp(prefix="fzero-ckpt-bench-")
        os.makedirs(root, exist_ok=True)
    obj = [root if rank == 0 else None]
    dist.broadcast_object_list(obj)  # the benchmark's own setup, not part of any timing
    root = obj[0]
    like = state
    times: dict[str, list[float]] = {k: [] for k in ("fzero save", "fzero save async (blocked)", "dcp save",
                                                     "fzero load", "fzero load in place", "dcp load")}
    for rep in range(args.reps):
        fz, dc = os.path.join(root, f"fzero-{rep}"), os.path.join(root, f"dcp-{rep}")
        order = ("fzero", "dcp") if rep % 2 == 0 else ("dcp", "fzero")
        for who in order:
            if who == "fzero":
                t, _ = timed(lambda: ckpt.save(fz, state))
                times["fzero save"].append(t)
            else:
                t, _ = timed(lambda: dcp.save(sd, checkpoint_id=dc))
                times["dcp save"].append(t)
        handles = []
        t, _ = timed(lambda: handles.append(ckpt.save(fz + "-async", state, async_=True)))
        times["fzero save async (blocked)"].append(t)
        handles[0].wait()
        for who in order:
            if who == "fzero":
                t, loaded = timed(lambda: ckpt.load(fz, like=like))
                times["fzero load"].append(t)
                assert torch.equal(loaded.params["0.weight"], state.params["0.weight"])
                del loaded
                t, _ = timed(lambda: ckpt.load(fz, like=like, in_place=True))
                times["fzero load in place"].append(t)
            else:
                t, _ = timed(lambda: dcp.load(sd, checkpoint_id=dc))
                times["dcp load"].append(t)
        dist.barrier()
        if rank == 0:
            for p in (fz, fz + "-async", dc):
                shutil.rmtree(p, ignore_errors=True)
    dist.barrier()
    if rank == 0 and args.dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return {"times": times, "bytes": data, "params": n_params, "world": world, "stage": args.stage}


def report(res, argv):
    per_rank = res["bytes"] / res["world"]
    med = {k: statistics.median(v) for k, v in res["times"].items()}
    rate = {k: per_rank / MiB / t for k, t in med.items()}
    print(f"\nfzero.checkpoint vs torch.distributed.checkpoint: {res['params'] / 1e6:.1f}M parameters, fp32 AdamW, "
          f"ZeRO stage {res['stage']}, {res['world']} ranks; {res['bytes'] / MiB:.0f} MiB per checkpoint "
          f"({per_rank / MiB:.0f} MiB per rank); median of {len(next(iter(res['times'].values())))} rounds; "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs\n")
    print("| operation | fzero | DCP | fzero / DCP |")
    print("| --- | --- | --- | --- |")

    def cell(k):
        return f"{rate[k]:.0f} MiB/s per rank ({med[k]:.2f} s)"

    print(f"| save (sync, fsync'd, committed) | {cell('fzero save')} | {cell('dcp save')} | "
          f"{rate['fzero save'] / rate['dcp save']:.2f}x |")
    print(f"| load in place | {cell('fzero load in place')} | {cell('dcp load')} | "
          f"{rate['fzero load in place'] / rate['dcp load']:.2f}x |")
    print(f"| load into new tensors (fzero's default) | {cell('fzero load')} | - | "
          f"{rate['fzero load'] / rate['dcp load']:.2f}x |")
    print(f"| async save: time training is blocked | {med['fzero save async (blocked)']:.2f} s | - | - |")
    print(f"\ncommand: .venv/bin/torchrun --nproc_per_node 2 benchmarks/checkpoint.py {' '.join(argv)}".rstrip())
    print("raw seconds per round: " + "; ".join(f"{k}: {', '.join(f'{t:.2f}' for t in v)}"
                                             for k, v in res["times"].items()))


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    run_under_torchrun(__file__, argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    dist.init_process_group("gloo")
    res = run(args)
    if dist.get_rank() == 0:
        report(res, argv)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
