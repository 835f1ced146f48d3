"""ZeRO on 2 ranks: DDP, FSDP2 and fzero stages 0-3, side by side, on a ~10.7M-parameter GPT.

Every contestant trains a copy of one seeded initialisation on the same batches (global
batch 16 x 128 tokens, 8 sequences per rank), fp32, AdamW (lr 3e-4, betas (0.9, 0.999),
eps 1e-8, decoupled weight decay 0.1 on every parameter, no clipping):

* ``ddp``    -- ``DistributedDataParallel(gradient_as_bucket_view=True)`` + ``torch.optim.AdamW(foreach=True)``
* ``fsdp2``  -- ``fully_shard`` on each block, then on the root + ``torch.optim.AdamW(foreach=True)``
* ``zero0``..``zero3`` -- the pure ``train_step`` under ``fzero.compile(train_step, mesh, zero=s)``
  with ``fzero.optim.adamw``

Timing: all contestants are built first, then run in rounds -- one step of each per round,
the order rotated every round -- so drift in a shared machine hits all alike. Each step
starts after a barrier; a step's time is the slowest rank's. The table gives the median over
the timed rounds and its ratio to DDP's median (``×DDP``); under the table, the paired ratio
(median over rounds of this contestant's time / DDP's in the same round), which is less
sensitive to load that drifts during the run. On a shared machine, read both with the load
average printed beside them.

Model-state bytes per rank: the distinct storages (views count once) of parameters,
gradients and optimizer state right after backward, before the update, on the second step
(when every optimizer has its state): DDP's module parameters, their ``.grad`` (views into
DDP's buckets) and ``optimizer.state``; FSDP2's local shards of the same; fzero's
``state.params``, ``state.opt_state`` and the gradients ``fzero.value_and_grad`` returned,
read inside the train step. ``x formula`` divides by the ZeRO paper's count for fp32 Adam
(Psi parameters, N ranks): DDP / stage 0 16Psi, stage 1 8Psi + 8Psi/N, stage 2 4Psi + 12Psi/N,
stage 3 and FSDP2 16Psi/N.

Peak RSS: ``ru_maxrss`` is a lifetime maximum, so after the timed run each contestant is
run again alone in a fresh pair of processes (``--only NAME``, a few steps) and its peak
RSS is the larger of the two ranks'. Every process imports ``torch._dynamo`` up front
(DDP and FSDP2 import it when built), so the baseline -- torch, fzero and the process group
before any model exists, printed under the table -- is the same for all contestants.
``--rss off`` skips this.

Run (either form; the second re-executes itself under torchrun with 2 processes)::

    .venv/bin/torchrun --nproc_per_node 2 benchmarks/zero.py --steps 20 --warmup 3 --threads 1
    .venv/bin/python benchmarks/zero.py --steps 20 --warmup 3 --threads 1
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
# Imported up front in every process (not inside the builders) so that every contestant's
# peak RSS includes the same code and the baseline is the same for all of them: building a
# DDP or FSDP2 module imports torch._dynamo (with _inductor and triton), ~100 MiB of RSS.
import torch._dynamo  # noqa: F401
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, ".."))

import fzero  # noqa: E402
from _common import MIB, add_gpt_options, contestants, cpu_model, fzero_contestant, loadavg, loss_of, \
    make_torch_optimizer, mean_over_ranks, paired_rounds, rank_batches, run_under_torchrun, time_stats, \
    torch_state_bytes, torchrun_command  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

CONTESTANTS = ("ddp", "fsdp2", "zero0", "zero1", "zero2", "zero3")
LABELS = {"ddp": "DDP", "fsdp2": "FSDP2 (fully_shard per block)", "zero0": "fzero stage 0",
          "zero1": "fzero stage 1", "zero2": "fzero stage 2", "zero3": "fzero stage 3"}
# Bytes per parameter after backward, fp32 Adam, N ranks (ZeRO paper, fig. 1).
FORMULA = {
    "ddp": lambda n: 16.0, "zero0": lambda n: 16.0,
    "zero1": lambda n: 8 + 8 / n, "zero2": lambda n: 4 + 12 / n,
    "zero3": lambda n: 16 / n, "fsdp2": lambda n: 16 / n,
}
FORMULA_TEXT = {"ddp": "16Ψ", "zero0": "16Ψ", "zero1": "8Ψ+8Ψ/N", "zero2": "4Ψ+12Ψ/N",
                "zero3": "16Ψ/N", "fsdp2": "16Ψ/N"}
TARGET = {"zero0": 1.02, "zero1": 1.02, "zero2": 1.02, "zero3": 1.10}
# torch 2.13 deprecates the *_tensor collectives fzero calls; say it once, not per rank per step.
warnings.filterwarnings("ignore", message=r".*torch.distributed.(all_gather_into_tensor|reduce_scatter_tensor)")


# --------------------------------------------------------------------------- helpers


def rss_mib() -> tuple[float, float]:
    """(current RSS, peak RSS) of this process in MiB."""
    cur = float("nan")
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    cur = int(line.split()[1]) / 1024
    except OSError:
        pass
    return cur, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# --------------------------------------------------------------------------- contestants
#
# Each builder returns ``step(batch, probe) -> loss``: one full training step (forward,
# backward, gradient communication, update). ``probe`` is a dict; when it has key "on"
# set, the step stores the model-state bytes after backward in probe["bytes"].


def torch_step(model, forward, opt):
    """The step of a torch contestant: ``forward`` is ``model`` wrapped (DDP, or FSDP2's root)."""
    params = list(model.parameters())

    def step(batch, probe):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(forward(batch["x"]), batch["y"])
        loss.backward()
        if probe.get("on"):
            probe["bytes"] = torch_state_bytes(params, opt)
        opt.step()
        return loss.detach()

    return step


def build_ddp(base, args, mesh):
    model = copy.deepcopy(base)
    ddp = DDP(model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True)
    return torch_step(model, ddp, make_torch_optimizer(model.parameters()))


def build_fsdp2(base, args, mesh):
    model = copy.deepcopy(base)
    dmesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=dmesh)
    fully_shard(model, mesh=dmesh)
    return torch_step(model, model, make_torch_optimizer(model.parameters()))


def build_fzero(stage):
    def build(base, args, mesh):
        module = copy.deepcopy(base)

        def held(state, grads):  # the module too: every byte the process holds for the model
            return state.params, state.opt_state, grads, list(module.parameters()), list(module.buffers())

        step = fzero_contestant(module, mesh, held, zero=stage, bucket_bytes=int(args.bucket_mb * MIB))
        return lambda batch, probe: step(batch, probe)["loss"]  # already the mean over ranks

    return build


BUILDERS = {"ddp": build_ddp, "fsdp2": build_fsdp2, **{f"zero{s}": build_fzero(s) for s in range(4)}}


# --------------------------------------------------------------------------- the run


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="timed rounds (one step of each contestant per round)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed rounds first (at least 2: round 2 is the memory probe)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--batch-size", type=int, default=16, help="global batch (sequences), split over the ranks")
    p.add_argument("--block-size", type=int, default=128, help="tokens per sequence")
    add_gpt_options(p, n_layer=6, n_head=6, n_embd=384)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size of DDP and fzero (MiB)")
    p.add_argument("--only", default=None,
                   help="comma-separated contestants to run (default: all of " + ", ".join(CONTESTANTS) + ")")
    p.add_argument("--rss", choices=("isolated", "off"), default="isolated",
                   help="isolated: measure each contestant's peak RSS in a fresh process pair afterwards")
    p.add_argument("--rss-steps", type=int, default=3, help="steps of each isolated peak-RSS run")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p.parse_args(argv)


def command_line(argv) -> str:
    return ".venv/bin/torchrun --nproc_per_node 2 benchmarks/zero.py " + " ".join(argv)


def run(args, argv) -> dict | None:
    torch.set_num_threads(args.threads)
    mesh = fzero.Mesh(dp=-1)
    world, rank = dist.get_world_size(), dist.get_rank()
    names = contestants(args.only, CONTESTANTS, "benchmarks/zero.py")
    if args.batch_size % world:
        raise SystemExit(f"benchmarks/zero.py: --batch-size {args.batch_size} does not split over {world} ranks")
    baseline_rss = rss_mib()[0]
    t_start = time.perf_counter()

    cfg = GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd)
    torch.manual_seed(0)
    base = GPT(cfg)
    psi = sum(p.numel() for p in base.parameters())  # tied head counted once
    steps = {}
    for n in names:
        steps[n] = BUILDERS[n](base, args, mesh)
    del base
    gc.collect()

    warmup = max(args.warmup, 2)
    batches = rank_batches(cfg.vocab_size, cfg.block_size, args.batch_size // world, warmup + args.steps)

    times, losses, probes = paired_rounds(steps, batches, warmup)
    mem = {n: p["bytes"] for n, p in probes.items()}

    # The slowest rank's time per step; model state of the larger rank; global mean losses.
    all_times = [None] * world
    dist.all_gather_object(all_times, times)
    all_mem = [None] * world
    dist.all_gather_object(all_mem, mem)
    loss_t = mean_over_ranks(losses, names)
    peak_rss = torch.tensor([rss_mib()[1]], dtype=torch.float64)
    dist.all_reduce(peak_rss, op=dist.ReduceOp.MAX)
    del steps
    gc.collect()
    dist.barrier()
    if rank != 0:
        return None

    res = {}
    slowest = {n: [max(r[n][k] for r in all_times) for k in range(len(times[n]))] for n in names}
    for j, n in enumerate(names):
        t = slowest[n]
        # Paired: this contestant's time over DDP's in the same round, median over rounds.
        paired = [a / b for a, b in zip(t, slowest["ddp"])] if "ddp" in slowest and t else []
        b = max(m[n] for m in all_mem)
        res[n] = {
            **time_stats(t),
            "x_ddp_paired": statistics.median(paired) if paired else None,
            "state_bytes": b,
            "formula_bytes": FORMULA[n](world) * psi,
            "x_formula": b / (FORMULA[n](world) * psi),
            "final_loss": float(loss_t[j, -1]),
            "losses": [float(v) for v in loss_t[j]],
        }
    return {
        "command": command_line(argv),
        "world": world,
        "psi": psi,
        "threads": args.threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "batch": [args.batch_size, args.block_size],
        "steps": args.steps,
        "warmup": warmup,
        "baseline_rss_mib": baseline_rss,
        "peak_rss_all_contestants_mib": float(peak_rss),
        "loadavg_start": None,
        "timing_wall_s": time.perf_counter() - t_start,
        "results": res,
    }


def isolated_rss(args, names) -> dict[str, float]:
    """Each contestant alone in a fresh pair of processes: its peak RSS (max over ranks)."""
    out = {}
    for n in names:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "r.json")
            cmd = torchrun_command(__file__, [
                "--only", n, "--rss", "off", "--steps", str(max(args.rss_steps - 2, 0)), "--warmup", "2",
                "--threads", str(args.threads), "--batch-size", str(args.batch_size),
                "--block-size", str(args.block_size), "--n-layer", str(args.n_layer), "--n-head", str(args.n_head),
                "--n-embd", str(args.n_embd), "--vocab-size", str(args.vocab_size), "--bucket-mb", str(args.bucket_mb),
                "--json", path, "--quiet"])
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                print(f"isolated RSS run of {n} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}", file=sys.stderr)
                out[n] = float("nan")
                continue
            with open(path) as f:
                r = json.load(f)
            out[n] = r["peak_rss_all_contestants_mib"]
            out[n + ":baseline"] = r["baseline_rss_mib"]
    return out


def report(result: dict, rss: dict) -> None:
    res, world, psi = result["results"], result["world"], result["psi"]
    ddp = res.get("ddp", {}).get("median_s")
    print(f"`{result['command']}`\n")
    print(f"machine: {result['cpu']}, {world} ranks (gloo) x {result['threads']} torch thread(s), "
          f"torch {result['torch']}, Python {result['python']}; GPT {psi / 1e6:.2f}M params (Ψ = {psi}), fp32, "
          f"global batch {result['batch'][0]}x{result['batch'][1]} ({result['batch'][0] // world} per rank); "
          f"{result['steps']} timed rounds after {result['warmup']} warmup, contestants interleaved; "
          f"load average at start {result['loadavg_start']}, at end {result['loadavg_end']}\n")
    print("| contestant | median step s | ×DDP | model-state MiB/rank | ×formula | peak RSS MiB | final loss |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, r in res.items():
        x = f"{r['median_s'] / ddp:.3f}" if ddp else "–"
        target = f" (≤ {TARGET[n]:.2f})" if n in TARGET else ""
        peak = rss.get(n)
        peak_s = f"{peak:.0f}" if peak is not None and peak == peak else "–"
        print(f"| {LABELS[n]} | {r['median_s']:.3f} | {x}{target} | {r['state_bytes'] / MIB:.1f} | "
              f"{r['x_formula']:.3f} ({FORMULA_TEXT[n]}) | {peak_s} | {r['final_loss']:.5f} |")
    base = [v for k, v in rss.items() if k.endswith(":baseline")]
    print()
    if base:
        print(f"peak RSS: each contestant alone in a fresh process pair ({result['rss_steps']} steps), larger rank; "
              f"baseline before the model (torch + fzero + gloo) ≈ {statistics.median(base):.0f} MiB")
    if "ddp" in res:
        ref = res["ddp"]["losses"]
        worst = max(abs(a - b) / abs(b) for r in res.values() for a, b in zip(r["losses"], ref))
        print(f"loss parity: max relative difference from DDP over all {len(ref)} steps of every contestant: {worst:.1e}")
    if "ddp" in res:
        print("×DDP paired (median over rounds of the contestant's step time / DDP's in the same round): "
              + ", ".join(f"{n} {r['x_ddp_paired']:.3f}" for n, r in res.items() if r["x_ddp_paired"] is not None))
    print("min / max step s: " + ", ".join(f"{n} {r['min_s']:.3f}/{r['max_s']:.3f}" for n, r in res.items()))
    print(f"wall: timed run {result['timing_wall_s']:.0f} s, isolated RSS runs {result['rss_wall_s']:.0f} s")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    quiet = "--quiet" in argv
    argv = [a for a in argv if a != "--quiet"]
    args = parse(argv)
    run_under_torchrun(__file__, argv)
    start_load = loadavg()
    result = run(args, argv)
    if result is None:
        dist.destroy_process_group()
        return
    result["loadavg_start"], result["rss_steps"] = start_load, max(args.rss_steps, 2)
    dist.destroy_process_group()
    t_rss = time.perf_counter()
    rss = isolated_rss(args, list(result["results"])) if args.rss == "isolated" else {}
    result["rss_wall_s"] = time.perf_counter() - t_rss
    result["loadavg_end"] = loadavg()
    for n, r in result["results"].items():
        r["peak_rss_mib"] = rss.get(n)
    result["isolated_baseline_rss_mib"] = {k.split(":")[0]: v for k, v in rss.items() if k.endswith(":baseline")}
    if not quiet:
        report(result, rss)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
