"""One GPU, one training step: plain PyTorch, the same under ``torch.compile``, and
``fzero.compile``, side by side in one run.

The contestants do the same math on the same batches from the same initial weights: a GPT
(``examples/gpt.py``) in GPT-2 124M or 350M shapes, bf16 autocast with fp32 weights,
AdamW (lr 3e-4, betas (0.9, 0.95), weight decay 0.1 on every parameter), gradients clipped
to global norm 1.0.

* ``plain``: the module, ``torch.autocast(bfloat16)``, ``loss.backward()``,
  ``clip_grad_norm_``, ``torch.optim.AdamW(fused=True)`` (``foreach`` on a CPU);
* ``compiled``: the same with ``torch.compile(module)``;
* ``fzero``: the pure ``train_step`` under ``fzero.compile(precision="bf16",
  clip_norm=1.0)``, one process.

What it prints, per contestant: the median step time over paired rounds (one step of each
per round, the order rotating, so drift in the machine hits all alike), its ratio to plain,
tokens/s, MFU (the step's FLOPs, counted once with ``torch.utils.flop_counter`` on the plain
step, over the median time, over the device's dense bf16 peak from
``fzero.monitor.peak_flops``; none on a CPU) and the peak memory of the contestant alone
(``torch.cuda.max_memory_allocated`` over a few steps run by itself, everything else freed
first). With ``--largest`` it then searches the deepest GPT of the preset's width that
trains a step on this GPU with and without ``offload_optimizer="cpu"`` (ZeRO-Offload).

Run on a GPU::

    python benchmarks/gpu_step.py --preset 124m --steps 20
    python benchmarks/gpu_step.py --preset 350m --steps 20 --largest

On a CPU it runs too (``--device cpu --preset tiny``), to check the script, not to measure.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import fzero  # noqa: E402
from fzero import optim  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

PRESETS = {  # n_layer, n_head, n_embd, block_size, vocab_size, batch
    "124m": (12, 12, 768, 1024, 50304, 8),
    "350m": (24, 16, 1024, 1024, 50304, 4),
    "tiny": (2, 2, 64, 64, 256, 4),
}
LR, BETAS, WEIGHT_DECAY, CLIP = 3e-4, (0.9, 0.95), 0.1, 1.0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_model(cfg: GPTConfig, device: torch.device, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg).to(device)


def plain_step(module: torch.nn.Module, device: torch.device, compiled: bool = False):
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(module.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY,
                            fused=fused, foreach=None if fused else True)
    model = torch.compile(module) if compiled else module

    def step(batch):
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            logits = model(batch["x"])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch["y"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def fzero_step(module: torch.nn.Module, **options):
    apply, params = fzero.functionalize(module)
    tx = optim.adamw(LR, BETAS[0], BETAS[1], 1e-8, WEIGHT_DECAY)
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=tx)

    def train_step(state, batch):
        def loss_fn(p):
            logits = state.apply_fn(p, batch["x"])
            return F.cross_entropy(logits.float().flatten(0, 1), batch["y"].flatten())

        loss, grads = fzero.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads), {"loss": loss}

    step = fzero.compile(train_step, fzero.Mesh(dp=1), precision="bf16", clip_norm=CLIP, **options)
    holder = {"state": step.init(state)}

    def run(batch):
        holder["state"], metrics = step(holder["state"], batch)
        return metrics["loss"].detach()

    return run


def batches(cfg: GPTConfig, batch: int, n: int, device: torch.device) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g)
        out.append({"x": x[:, :-1].to(device), "y": x[:, 1:].to(device)})
    return out


def count_flops(cfg: GPTConfig, device: torch.device, batch: dict) -> int:
    """FLOPs of one plain step (forward, backward; the optimizer's elementwise work is not
    counted, as MFU conventionally leaves it out)."""
    from torch.utils.flop_counter import FlopCounterMode

    module = make_model(cfg, device)
    with FlopCounterMode(display=False) as counter:
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            logits = module(batch["x"])
        F.cross_entropy(logits.float().flatten(0, 1), batch["y"].flatten()).backward()
    del module
    return counter.get_total_flops()


def build(name: str, cfg: GPTConfig, device: torch.device):
    module = make_model(cfg, device)
    if name == "plain":
        return plain_step(module, device)
    if name == "compiled":
        return plain_step(module, device, compiled=True)
    if name == "fzero":
        return fzero_step(module)
    if name == "fzero-offload":
        return fzero_step(module, zero=1, offload_optimizer="cpu", pin_memory=device.type == "cuda")
    raise ValueError(f"unknown contestant {name!r}")


def timed_rounds(names, cfg, device, data, steps, warmup):
    """Median seconds per step of each contestant, in paired rounds, and each one's losses."""
    runs = {n: build(n, cfg, device) for n in names}
    times = {n: [] for n in names}
    losses = {n: [] for n in names}
    for i in range(warmup + steps):
        order = names[i % len(names):] + names[:i % len(names)]
        for n in order:
            batch = data[i % len(data)]
            sync(device)
            t0 = time.perf_counter()
            loss = runs[n](batch)
            sync(device)
            if i >= warmup:
                times[n].append(time.perf_counter() - t0)
            losses[n].append(float(loss))
    del runs
    return {n: statistics.median(t) for n, t in times.items()}, losses


def peak_memory(name, cfg, device, data, steps=3) -> int | None:
    """Peak bytes allocated by one contestant run alone (CUDA only)."""
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    run = build(name, cfg, device)
    for i in range(steps):
        run(data[i % len(data)])
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del run
    gc.collect()
    torch.cuda.empty_cache()
    return peak


def trains(name: str, cfg: GPTConfig, device: torch.device, batch: int) -> bool:
    """Whether ``name`` trains two steps of ``cfg`` on ``device`` without running out of memory."""
    run = None
    try:
        data = batches(cfg, batch, 1, device)
        run = build(name, cfg, device)
        for _ in range(2):
            run(data[0])
        sync(device)
        return True
    except torch.cuda.OutOfMemoryError:
        return False
    finally:
        del run
        gc.collect()
        torch.cuda.empty_cache()


def deepest(name: str, base: GPTConfig, device: torch.device, batch: int, hi: int = 1024) -> int:
    """The most blocks of ``base``'s width that ``name`` trains (doubling, then bisecting)."""
    lo, n = 0, max(1, base.n_layer)
    while n <= hi and trains(name, GPTConfig(**{**vars(base), "n_layer": n}), device, batch):
        lo, n = n, n * 2
    hi = min(n, hi + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if trains(name, GPTConfig(**{**vars(base), "n_layer": mid}), device, batch):
            lo = mid
        else:
            hi = mid
    return lo


def params_of(cfg: GPTConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--preset", choices=sorted(PRESETS), default="124m")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default: the preset's)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--contestants", default="plain,compiled,fzero")
    p.add_argument("--largest", action="store_true", help="also search the deepest GPT that trains, with and "
                                                         "without offload (CUDA only)")
    args = p.parse_args()
    device = torch.device(args.device)
    n_layer, n_head, n_embd, block, vocab, batch = PRESETS[args.preset]
    batch = args.batch or batch
    cfg = GPTConfig(vocab_size=vocab, block_size=block, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    names = [n.strip() for n in args.contestants.split(",") if n.strip()]
    data = batches(cfg, batch, 4, device)
    tokens = batch * block

    from fzero.monitor import peak_flops

    peak = peak_flops(device, "bf16")
    flops = count_flops(cfg, device, data[0])
    medians, losses = timed_rounds(names, cfg, device, data, args.steps, args.warmup)
    mems = {n: peak_memory(n, cfg, device, data) for n in names}

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {where}; torch {torch.__version__}; GPT {args.preset}: {params_of(cfg) / 1e6:.1f}M parameters, "
          f"batch {batch} x {block} tokens; bf16 autocast, AdamW, clip 1.0; {args.steps} paired rounds after "
          f"{args.warmup} warmup; {flops / 1e12:.3f} TFLOP per step (counted on the plain step)")
    print("| contestant | median step (ms) | × plain | tokens/s | MFU | peak memory (MiB) | × plain |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    ref_t, ref_m = medians.get("plain"), mems.get("plain")
    for n in names:
        t, m = medians[n], mems[n]
        mfu = f"{flops / t / peak:.1%}" if peak else "n/a"
        ratio = f"{t / ref_t:.3f}" if ref_t else "n/a"
        mem = f"{m / 2**20:.0f}" if m is not None else "n/a"
        mratio = f"{m / ref_m:.3f}" if m is not None and ref_m else "n/a"
        print(f"| {n} | {t * 1e3:.1f} | {ratio} | {tokens / t:,.0f} | {mfu} | {mem} | {mratio} |")
    first = {n: losses[n][0] for n in names}
    print("first-step losses (same weights, same batch):", ", ".join(f"{n} {v:.5f}" for n, v in first.items()))

    if args.largest:
        if device.type != "cuda":
            print("--largest: needs a GPU (it searches what fits in its memory)")
            return
        print(f"deepest GPT of width {n_embd} that trains two steps at batch {batch} x {block}:")
        for n in ("fzero", "fzero-offload"):
            depth = deepest(n, cfg, device, batch)
            size = params_of(GPTConfig(**{**vars(cfg), "n_layer": depth})) if depth else 0
            print(f"  {n}: {depth} blocks, {size / 1e6:.0f}M parameters")


if __name__ == "__main__":
    main()
