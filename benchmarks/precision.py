"""Precision x ZeRO on 2 ranks: fzero {fp32, bf16, fp16} x stages 0-3 beside DDP + torch.autocast.

Every contestant trains a copy of one seeded GPT (``examples/gpt.py``) on the same batches,
AdamW (lr 3e-4, betas (0.9, 0.999), eps 1e-8, decoupled weight decay 0.1 on every parameter,
no clipping):

* ``DDP fp32``          -- ``DistributedDataParallel(gradient_as_bucket_view=True)`` +
  ``torch.optim.AdamW(foreach=True)``
* ``DDP+autocast bf16`` -- the same, forward and loss under ``torch.autocast("cpu", torch.bfloat16)``
* ``DDP+autocast fp16`` -- the same under ``torch.autocast("cpu", torch.float16)`` with
  ``torch.amp.GradScaler("cpu")`` (torch's defaults: 2^16, growth interval 2000);
  ``--ddp-fp16-scaler off`` runs it without a scaler
* ``fzero <p> stage <s>`` -- the pure ``train_step`` under
  ``fzero.compile(train_step, mesh, zero=s, precision=p)`` with ``fzero.optim.adamw``
  (fp16: DeepSpeed's dynamic loss scaler, fzero's default)

Timing: all contestants are built first, then run in rounds -- one step of each per round,
the order rotated every round -- so drift on a shared machine hits all alike. Each step
starts after a barrier; a step's time is the slowest rank's; we report the median over the
timed rounds and its ratio to DDP fp32's median. On a CPU without bf16/fp16 GEMM support
(no AVX512-BF16/AMX) low-precision matmuls take a slow reference path: here the speed
columns say little about a GPU, the memory columns are the point.

Model-state bytes per rank: the distinct storages (views count once) of parameters,
gradients, optimizer state and fp32 master weights right after backward, before the update:
DDP's module parameters, their ``.grad`` (views into DDP's buckets) and ``optimizer.state``;
fzero's ``state.params``, ``state.opt_state``, ``state.master`` and the gradients
``fzero.value_and_grad`` returned, read inside the train step (as ``tests/test_zero.py``
counts them). It is probed on every warmup round after the first and the largest value is
kept (torch's AdamW allocates its state at its first applied step, which an fp16 scaler may
skip). ``x formula`` divides by the ZeRO paper's count (Psi parameters, N ranks, Adam):
fp32 16Psi, 8Psi+8Psi/N, 4Psi+12Psi/N, 16Psi/N for stages 0-3; mixed precision 16Psi,
4Psi+12Psi/N, 2Psi+14Psi/N, 16Psi/N; DDP + autocast keeps fp32 parameters, gradients and
Adam state: 16Psi.

Run (either form; the second re-executes itself under torchrun with 2 processes)::

    .venv/bin/torchrun --nproc_per_node 2 benchmarks/precision.py --steps 10 --warmup 3
    .venv/bin/python benchmarks/precision.py --steps 10 --warmup 3

``--batch`` is sequences per rank, ``--block`` tokens per sequence. The defaults (2 layers x 128
embd, 8 x 64 tokens per rank, 10 timed rounds) take about 5 minutes on 2 loaded cores, nearly
all of it in the ten low-precision contestants.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import platform
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, ".."))

import fzero  # noqa: E402
from _common import MIB, add_gpt_options, contestants, cpu_model, fzero_contestant, interleaved, loadavg, loss_of, \
    make_torch_optimizer, mean_over_ranks, rank_batches, run_under_torchrun, time_stats, timed, \
    torch_state_bytes  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

PRECISIONS = ("fp32", "bf16", "fp16")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
STAGES = (0, 1, 2, 3)
CONTESTANTS = tuple(f"ddp_{p}" for p in PRECISIONS) + tuple(f"{p}_z{s}" for p in PRECISIONS for s in STAGES)

# Bytes per parameter after backward, before the update (ZeRO paper, fig. 1), N ranks.
FP32 = {0: (lambda n: 16.0, "16Ψ"), 1: (lambda n: 8 + 8 / n, "8Ψ+8Ψ/N"),
        2: (lambda n: 4 + 12 / n, "4Ψ+12Ψ/N"), 3: (lambda n: 16 / n, "16Ψ/N")}
MIXED = {0: (lambda n: 16.0, "16Ψ"), 1: (lambda n: 4 + 12 / n, "4Ψ+12Ψ/N"),
         2: (lambda n: 2 + 14 / n, "2Ψ+14Ψ/N"), 3: (lambda n: 16 / n, "16Ψ/N")}
# What fzero's stage 1 holds instead (it keeps only the owned gradient slice once reduced):
# the stage-2 count of its precision.
STAGE1_FZERO = {"fp32": FP32[2], "mixed": MIXED[2]}


def precision_of(name: str) -> str:
    return name.split("_")[1] if name.startswith("ddp_") else name.split("_")[0]


def stage_of(name: str) -> int | None:
    return None if name.startswith("ddp_") else int(name.split("_z")[1])


def label(name: str) -> str:
    p, s = precision_of(name), stage_of(name)
    if s is None:
        return "DDP fp32" if p == "fp32" else f"DDP+autocast {p}"
    return f"fzero {p} stage {s}"


def formula(name: str) -> tuple:
    """(bytes per parameter as a function of N, its text) for a contestant."""
    p, s = precision_of(name), stage_of(name)
    if s is None:
        return FP32[0]  # autocast or not, DDP keeps fp32 params, grads and Adam state
    return (FP32 if p == "fp32" else MIXED)[s]


# --------------------------------------------------------------------------- contestants
#
# Each builder returns ``step(batch, probe) -> (loss, skipped)``: one full training step
# (forward, backward, gradient communication, update). When ``probe`` has key "on" set, the
# step stores the model-state bytes after backward in probe["bytes"]. ``skipped`` says the
# update was skipped by a loss scaler (a gradient overflowed).


def build_ddp(precision):
    def build(base, args, mesh):
        model = copy.deepcopy(base)
        ddp = DDP(model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True)
        opt = make_torch_optimizer(model.parameters())
        params = list(model.parameters())
        dtype = DTYPES.get(precision)
        scaler = torch.amp.GradScaler("cpu") if precision == "fp16" and args.ddp_fp16_scaler == "on" else None

        def step(batch, probe):
            opt.zero_grad(set_to_none=True)
            ctx = torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()
            with ctx:
                loss = loss_of(ddp(batch["x"]), batch["y"])
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if probe.get("on"):
                probe["bytes"] = torch_state_bytes(params, opt)
                probe["adam_state"] = len(opt.state) > 0
            skipped = False
            if scaler is not None:
                before = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                # An overflow skips opt.step and halves the scale (growth only every 2000
                # clean steps), so a smaller scale means this update was skipped.
                skipped = scaler.get_scale() < before
            else:
                opt.step()
            return loss.detach().float(), skipped

        return step

    return build


def build_fzero(precision, stage):
    def build(base, args, mesh):
        def held(state, grads):
            return state.params, state.opt_state, state.master, grads

        fzero_step = fzero_contestant(copy.deepcopy(base), mesh, held, zero=stage, precision=precision,
                                      bucket_bytes=int(args.bucket_mb * MIB))

        def step(batch, probe):
            metrics = fzero_step(batch, probe)
            skipped = bool(metrics["skipped"]) if "skipped" in metrics else False
            return metrics["loss"].detach().float(), skipped  # loss: already the mean over ranks

        return step

    return build


BUILDERS = {**{f"ddp_{p}": build_ddp(p) for p in PRECISIONS},
            **{f"{p}_z{s}": build_fzero(p, s) for p in PRECISIONS for s in STAGES}}


# --------------------------------------------------------------------------- the run


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="timed rounds (one step of each contestant per round)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed rounds first (at least 2; the memory is probed on rounds 2..warmup)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--block", type=int, default=64, help="tokens per sequence")
    add_gpt_options(p, n_layer=2, n_head=4, n_embd=128)
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradient bucket size of DDP and fzero (MiB)")
    p.add_argument("--ddp-fp16-scaler", choices=("on", "off"), default="on",
                   help="torch.amp.GradScaler('cpu') for DDP + autocast fp16")
    p.add_argument("--only", default=None,
                   help="comma-separated contestants (default: all of " + ", ".join(CONTESTANTS) + ")")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p.parse_args(argv)


def command_line(argv) -> str:
    return ".venv/bin/torchrun --nproc_per_node 2 benchmarks/precision.py " + " ".join(argv)


def run(args, argv) -> dict | None:
    torch.set_num_threads(args.threads)
    mesh = fzero.Mesh(dp=-1)
    world, rank = dist.get_world_size(), dist.get_rank()
    names = contestants(args.only, CONTESTANTS, "benchmarks/precision.py")
    t_start = time.perf_counter()

    cfg = GPTConfig(vocab_size=args.vocab_size, block_size=args.block, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd)
    torch.manual_seed(0)
    base = GPT(cfg)
    psi = sum(p.numel() for p in base.parameters())  # tied head counted once
    steps = {n: BUILDERS[n](base, args, mesh) for n in names}
    del base
    gc.collect()

    warmup = max(args.warmup, 2)
    batches = rank_batches(cfg.vocab_size, cfg.block_size, args.batch, warmup + args.steps)

    times = {n: [] for n in names}
    losses = {n: [] for n in names}
    skipped = {n: 0 for n in names}
    mem = {n: 0 for n in names}
    adam_state = {n: False for n in names}
    for i, n, batch in interleaved(names, batches):
        probe = {"on": True} if 1 <= i < warmup else {}

        def one_step():
            loss, skip = steps[n](batch, probe)
            return loss.item(), skip  # .item() waits for the step: inside the timing

        dt, (loss, skip) = timed(one_step)
        losses[n].append(loss)
        skipped[n] += int(skip)
        if i >= warmup:
            times[n].append(dt)
        if probe:
            mem[n] = max(mem[n], probe["bytes"])
            adam_state[n] = adam_state[n] or probe.get("adam_state", True)

    # The slowest rank's time per step; model state of the larger rank; global mean losses.
    gathered = [None] * world
    dist.all_gather_object(gathered, {"times": times, "mem": mem})
    loss_t = mean_over_ranks(losses, names)
    del steps
    gc.collect()
    dist.barrier()
    if rank != 0:
        return None

    res = {}
    for j, n in enumerate(names):
        t = [max(r["times"][n][k] for r in gathered) for k in range(len(times[n]))]
        b = max(r["mem"][n] for r in gathered)
        f, f_text = formula(n)
        res[n] = {
            "label": label(n),
            "precision": precision_of(n),
            "stage": stage_of(n),
            **time_stats(t),
            "state_bytes": b,
            "formula": f_text,
            "formula_bytes": f(world) * psi,
            "x_formula": b / (f(world) * psi),
            "skipped_updates": skipped[n],
            "adam_state_probed": adam_state[n],
            "final_loss": float(loss_t[j, -1]),
            "losses": [float(v) for v in loss_t[j]],
        }
    ddp = res.get("ddp_fp32", {}).get("median_s")
    for r in res.values():
        r["x_ddp_fp32"] = r["median_s"] / ddp if ddp else None
    return {
        "command": command_line(argv),
        "world": world,
        "psi": psi,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "model": {"n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd,
                  "vocab_size": args.vocab_size, "block": args.block},
        "batch_per_rank": args.batch,
        "steps": args.steps,
        "warmup": warmup,
        "ddp_fp16_scaler": args.ddp_fp16_scaler,
        "wall_s": time.perf_counter() - t_start,
        "results": res,
    }


def report(result: dict) -> None:
    res, world, psi = result["results"], result["world"], result["psi"]
    print(f"`{result['command']}`\n")
    m = result["model"]
    print(f"machine: {result['cpu']}, {world} ranks (gloo) x {result['threads']} torch thread(s), "
          f"torch {result['torch']}, Python {result['python']}; GPT {m['n_layer']} layers x {m['n_embd']} embd "
          f"({m['n_head']} heads, vocab {m['vocab_size']}), Ψ = {psi} params ({psi / 1e6:.3f}M), "
          f"{result['batch_per_rank']} x {m['block']} tokens per rank; AdamW; {result['steps']} timed rounds "
          f"after {result['warmup']} warmup, contestants interleaved; load average at start "
          f"{result['loadavg_start']}, at end {result['loadavg_end']}\n")
    print("| contestant | median step s | ×DDP fp32 | model state MiB/rank | formula MiB | ×formula "
          "| skipped updates | final loss |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, r in res.items():
        x = f"{r['x_ddp_fp32']:.2f}" if r["x_ddp_fp32"] is not None else "–"
        mark = "¹" if r["stage"] == 1 else ""
        warn = "" if r["adam_state_probed"] else " ²"
        print(f"| {r['label']} | {r['median_s']:.3f} | {x} | {r['state_bytes'] / MIB:.3f}{warn} | "
              f"{r['formula_bytes'] / MIB:.3f} ({r['formula']}) | {r['x_formula']:.3f}{mark} | "
              f"{r['skipped_updates']} | {r['final_loss']:.4f} |")
    print()
    s1 = {p: STAGE1_FZERO["fp32" if p == "fp32" else "mixed"] for p in PRECISIONS if f"{p}_z1" in res}
    exp = ", ".join(f"{p} {f[1]} = {f[0](world) / formula(f'{p}_z1')[0](world):.3f}" for p, f in s1.items())
    if s1:
        print(f"¹ fzero's stage 1 keeps only its owned gradient slice after the reduction (the full reduced "
              f"gradient is let go), so it holds the stage-2 bytes, below the paper's stage-1 figure (which "
              f"keeps every gradient): expected ×formula at N={world}: {exp}.")
    if not all(r["adam_state_probed"] for r in res.values()):
        print("² torch's AdamW had no state yet at every memory probe (the loss scaler skipped every "
              "update until then): run more --warmup rounds.")
    print("model state: the larger rank's, after backward, before the update. "
          "DDP+autocast keeps fp32 parameters, gradients and Adam state (16Ψ); autocast's low-precision "
          "weight copies live only for the forward and are not model state. fzero mixed precision: "
          "low-precision params and grads, fp32 masters + Adam (partitioned from stage 1).")
    scaler = ("torch.amp.GradScaler('cpu') (2^16, backoff 0.5, no hysteresis)"
              if result["ddp_fp16_scaler"] == "on" else "no loss scaler")
    print(f"fp16 loss scaling: DDP uses {scaler}; fzero uses DeepSpeed's dynamic scaler (2^16, hysteresis 2). "
          "A skipped update skips the optimizer step (faster steps, a different trajectory).")
    par = []
    for p in PRECISIONS:
        ref = res.get(f"ddp_{p}")
        if ref is None:
            continue
        worst = max((abs(a - b) / abs(b) for s in STAGES if f"{p}_z{s}" in res
                     for a, b in zip(res[f"{p}_z{s}"]["losses"], ref["losses"])), default=None)
        if worst is not None:
            par.append(f"{p} {worst:.1e}")
    if par:
        print("loss parity: max relative difference of fzero's losses from DDP's of the same precision, "
              f"every step: {', '.join(par)}")
    print("min / max step s: " + ", ".join(f"{n} {r['min_s']:.3f}/{r['max_s']:.3f}" for n, r in res.items()))
    print(f"wall: {result['wall_s']:.0f} s")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    run_under_torchrun(__file__, argv)
    start_load = loadavg()
    result = run(args, argv)
    if result is not None:
        result["loadavg_start"], result["loadavg_end"] = start_load, loadavg()
        report(result)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
