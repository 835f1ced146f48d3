"""What does fzero cost on one device? A ~10.7M-parameter GPT, plain PyTorch vs ``fzero.compile``.

The programs do the same math on the same batches from the same initial weights: AdamW
(decoupled weight decay 0.1 on the Linear weight matrices only, warmup-cosine learning rate),
gradients clipped to global norm 1.0. The plain one is the loop everyone writes -- the module,
``loss.backward()``, ``clip_grad_norm_``, ``torch.optim.AdamW(foreach=True)`` (torch's default), and
again with ``fused=True`` (torch's one-pass kernel, which fzero's AdamW runs on the CPU); the fzero ones
are the pure ``train_step`` of ``examples/train_gpt.py``, clipped by
``fzero.compile(..., clip_norm=1.0)``, once with ``donate=False`` (a new state each step) and
once with the default ``donate=True`` (the update written into the state it was given).

They run in rounds, one step of each, in one process after a warmup, so drift in the machine
(turbo, other tenants) hits all alike; the order within a round rotates every step so none
always runs on a cache (or a heap) another warmed. We report median step times (wall and
CPU), their ratios to plain, the median of the per-round ratios, the minor page faults a step
took (fresh memory touched: counted, not timed), and the load average: on shared cores a run
with a load above the core count measures the neighbours more than the programs::

    python benchmarks/overhead.py --steps 12 --threads 2
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import fzero
from fzero import optim

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from _common import cpu_model  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from train_gpt import train_step  # noqa: E402  (the example's step is the one measured)

LR, WARMUP, TOTAL, END_LR = 3e-4, 10, 1000, 3e-5
BETAS, EPS, WEIGHT_DECAY, CLIP = (0.9, 0.999), 1e-8, 0.1, 1.0
NO_DECAY = (".bias", "ln_1.weight", "ln_2.weight", "ln_f.weight", "wte.weight", "wpe.weight")


def lr_at(count: int) -> float:
    """optax's warmup_cosine_decay_schedule(0, LR, WARMUP, TOTAL, END_LR), for the plain loop."""
    if count < WARMUP:
        return LR * count / WARMUP
    frac = min(count - WARMUP, TOTAL - WARMUP) / (TOTAL - WARMUP)
    return END_LR + (LR - END_LR) * 0.5 * (1 + math.cos(math.pi * frac))


def make_plain(model: torch.nn.Module, fused: bool = False):
    decay = [p for n, p in model.named_parameters() if not n.endswith(NO_DECAY)]
    no_decay = [p for n, p in model.named_parameters() if n.endswith(NO_DECAY)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr_at(0), betas=BETAS, eps=EPS, **({"fused": True} if fused else {"foreach": True}),
    )

    def step(count: int, batch: dict) -> float:
        for group in opt.param_groups:
            group["lr"] = lr_at(count)
        opt.zero_grad(set_to_none=True)
        logits = model(batch["x"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=True)
        opt.step()
        return loss.item()

    return step


def make_fzero(model: torch.nn.Module, donate: bool = True):
    apply, params = fzero.functionalize(model)
    tx = optim.adamw(
        optim.schedules.warmup_cosine(LR, warmup=WARMUP, total=TOTAL, end=END_LR),
        b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY,
        mask={n: not n.endswith(NO_DECAY) for n in params},
    )

    compiled = fzero.compile(train_step, fzero.Mesh(dp=-1), clip_norm=CLIP, donate=donate)
    box = {"state": compiled.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=tx))}

    def step(count: int, batch: dict) -> float:
        box["state"], metrics = compiled(box["state"], batch)
        return metrics["loss"].item()

    return step


def timed(fn, *args) -> tuple[float, float, int, float]:
    """Wall and CPU seconds of ``fn(*args)``, the minor page faults it took, and its result.

    CPU time (all of this process's threads) is reported too: on shared cores the wall time
    includes waiting for other jobs, the CPU time mostly does not. Page faults count fresh
    memory touched (a counted, not timed, cost of allocating new tensors every step).
    """
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    c, t = time.process_time(), time.perf_counter()
    out = fn(*args)  # .item() inside each step is the sync point: the step is finished here
    dt, dc = time.perf_counter() - t, time.process_time() - c
    return dt, dc, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0, out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="timed steps of each program")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each program first")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--device", default="cpu", help="cpu or cuda (on a GPU, fzero's AdamW runs the fused kernel)")
    p.add_argument("--n-layer", type=int, default=6)
    p.add_argument("--n-embd", type=int, default=384)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=args.n_layer, n_head=6, n_embd=args.n_embd)
    model = GPT(cfg).to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    # Copies of one initialisation: functionalize shares storage with its module, so each
    # program must own separate tensors. deepcopy keeps the tied head tied.
    programs = {"plain": make_plain(copy.deepcopy(model)), "plain-fused": make_plain(copy.deepcopy(model), fused=True),
                "fzero": make_fzero(copy.deepcopy(model), donate=False), "donated": make_fzero(model, donate=True)}
    labels = {"plain": "plain PyTorch (AdamW foreach)", "plain-fused": "plain PyTorch (AdamW fused)",
              "fzero": "fzero.compile(donate=False)", "donated": "fzero.compile (donate=True, the default)"}
    load_before = os.getloadavg()[0]

    g = torch.Generator().manual_seed(0)
    n = args.warmup + args.steps
    batches = []
    for _ in range(n):
        x = torch.randint(cfg.vocab_size, (args.batch_size, cfg.block_size + 1), generator=g)
        batches.append({"x": x[:, :-1].contiguous().to(args.device), "y": x[:, 1:].contiguous().to(args.device)})

    times = {k: [] for k in programs}
    cpu = {k: [] for k in programs}
    faults = {k: [] for k in programs}
    losses = {k: [] for k in programs}
    names = list(programs)
    for i, batch in enumerate(batches):
        # The order within a round rotates every step, so no program always runs on a cache
        # (or a heap) another one just warmed.
        for name in names[i % len(names):] + names[: i % len(names)]:
            dt, dc, nf, loss = timed(programs[name], i, batch)
            losses[name].append(loss)
            if i >= args.warmup:
                times[name].append(dt)
                cpu[name].append(dc)
                faults[name].append(nf)

    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    ratio = {k: med[k] / med["plain"] for k in programs}
    # The same ratio taken within each round, then the median: robust to a machine whose
    # speed drifts over the run (other jobs on shared cores), as a ratio of medians is not.
    paired = {k: statistics.median(f / p for f, p in zip(times[k], times["plain"])) for k in programs}
    # Same math, so the same losses up to fp32 reduction order: a benchmark of two programs
    # that train differently would measure nothing.
    parity = max(abs(a - b) / abs(a) for k in programs for a, b in zip(losses["plain"], losses[k]))
    command = "python benchmarks/overhead.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {
        "command": command.strip(),
        "cpu": cpu_model(),
        "threads": args.threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "params": n_params,
        "batch": [args.batch_size, cfg.block_size],
        "steps": args.steps,
        "warmup": args.warmup,
        "median_s": med,
        "min_s": {k: min(v) for k, v in times.items()},
        "max_s": {k: max(v) for k, v in times.items()},
        "ratio_over_plain": ratio,
        "paired_ratio_median": paired,
        "median_cpu_s": med_cpu,
        "cpu_ratio_over_plain": {k: med_cpu[k] / med_cpu["plain"] for k in programs},
        "median_minor_faults": {k: statistics.median(v) for k, v in faults.items()},
        "max_rel_loss_diff": parity,
        "load_average_1min": [load_before, os.getloadavg()[0]],
    }

    print(f"`{result['command']}`\n")
    if args.device != "cpu":
        result["device"] = torch.cuda.get_device_name()
        print(f"device: {result['device']}")
    print(f"machine: {result['cpu']}, {args.threads} torch threads, torch {torch.__version__}, "
          f"Python {result['python']}; GPT {n_params / 1e6:.1f}M params, batch {args.batch_size}x{cfg.block_size}, "
          f"{args.steps} timed steps each after {args.warmup} warmup, in rotating rounds; "
          f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after\n")
    print("| program | median step (ms) | min (ms) | max (ms) | median CPU (ms) | ×plain | ×plain paired "
          "| ×plain CPU | minor page faults/step |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in programs:
        print(f"| {labels[name]} | {1e3 * med[name]:.1f} | {1e3 * result['min_s'][name]:.1f} "
              f"| {1e3 * result['max_s'][name]:.1f} | {1e3 * med_cpu[name]:.1f} | {ratio[name]:.3f} "
              f"| {paired[name]:.3f} | {result['cpu_ratio_over_plain'][name]:.3f} "
              f"| {result['median_minor_faults'][name]:.0f} |")
    print(f"\ntarget: fzero ≤ 1.00 × plain (paired); loss parity over {n} steps: max relative difference "
          f"{parity:.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
