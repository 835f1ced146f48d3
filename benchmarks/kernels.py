"""Benchmark fzero_kernels on flat shards against torch's optimizers (GPU).

For each shard size (default 1M, 16M, 128M and 1B fp32 elements) it times, with CUDA
events (median of the timed runs after warm-up):

- ``copy``: ``dst.copy_(src)``, the device's copy bandwidth, measured in the same run;
- ``fzero adamw_``: one step, fp32 grad (28 B/element moved) and bf16 grad with the bf16
  copy written in the same pass (28 B/element);
- ``torch AdamW fused`` / ``foreach``: ``torch.optim.AdamW(fused=True / foreach=True)`` on
  the same data, as one flat parameter (28 B/element at best);
- ``torch unscale+clip+step+cast``: what a torch mixed-precision loop does per step --
  ``GradScaler``'s unscale and non-finite check, ``clip_grad_norm_``, the fused AdamW step
  (skipped on overflow after reading the flag, as ``GradScaler.step``) and the bf16 copy of
  the parameters -- against ``fzero sequence``: ``sum_of_squares`` (the clip norm, which
  also detects overflow) then one ``adamw_`` that unscales, clips (``grad_sumsq``,
  ``max_norm``), skips on overflow and writes the bf16 copy, with no host sync;
- LAMB (both launches), Lion, SGD with momentum, ``l2_norm`` and ``unscale_and_check_``.

GB/s counts the fewest bytes each operation must move (each input read once, each output
written once), the same count for fzero and torch. Targets (issue): >= 90% of the copy
bandwidth from 16M elements up, and >= 1.2x torch's fused sequence.

    python benchmarks/kernels.py                 # GPU; prints a table
    python benchmarks/kernels.py --sizes 1M,16M  # a subset
    python benchmarks/kernels.py --cpu-smoke     # tiny sizes on the CPU (reference path): checks the script runs

Without CUDA (and without ``--cpu-smoke``) it says so and exits 0.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

try:
    import fzero_kernels as fk
except ImportError:  # run from a checkout without installing: the repository root is the parent
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fzero_kernels as fk

HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
LOSS_SCALE, MAX_NORM = 1024.0, 1.0


def parse_size(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "B": 1 << 30}.get(text[-1], 1)
    return int(float(text[:-1] if text[-1] in "KMGB" else text) * mult)


class Timer:
    """Median milliseconds of ``fn`` over ``iters`` runs after ``warmup`` runs.

    Runs are launched back to back with an event pair around each and one synchronize at
    the end (as triton.testing.do_bench), so the host's launch work overlaps the device's
    work as in a training loop; a run that syncs (torch's GradScaler reads found_inf) pays
    for it. On the CPU, wall-clock time.
    """

    def __init__(self, device: torch.device, warmup: int, iters: int):
        self.device, self.warmup, self.iters = device, warmup, iters

    def __call__(self, fn: Callable[[], object], iters: int | None = None) -> float:
        iters = iters or self.iters
        for _ in range(self.warmup):
            fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(iters)]
            for start, end in events:
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize()
            return statistics.median(start.elapsed_time(end) for start, end in events)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def copy_bandwidth(device: torch.device, timer: Timer, n: int) -> float:
    """GB/s of a device-to-device copy of n fp32, counting bytes read and written."""
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    del src, dst
    return 8 * n / ms / 1e6


def torch_sequence(param: torch.nn.Parameter, opt: torch.optim.Optimizer, lowp: torch.Tensor,
                   inv_scale: torch.Tensor, found_inf: torch.Tensor) -> None:
    """torch's unscale + non-finite check, clip, step (skipped on overflow), bf16 cast."""
    found_inf.zero_()
    torch._amp_foreach_non_finite_check_and_unscale_([param.grad], found_inf, inv_scale)
    torch.nn.utils.clip_grad_norm_([param], MAX_NORM, foreach=True)
    if not found_inf.item():  # GradScaler.step reads the flag on the host
        opt.step()
    lowp.copy_(param.detach())


def fzero_sequence(p, g, m, v, lowp, step: int) -> None:
    """sum_of_squares (the clip norm, which also detects overflow), then one adamw_ pass that
    unscales, clips, skips on overflow and writes the bf16 copy -- two launches, no host sync."""
    sumsq = fk.sum_of_squares(g, grad_scale=LOSS_SCALE)
    fk.adamw_(p, g, m, v, **HYPER, step=step, grad_scale=LOSS_SCALE, grad_sumsq=sumsq, max_norm=MAX_NORM,
              lowp_param=lowp)


def bench_size(n: int, device: torch.device, timer: Timer, copy_gbs: float, with_torch: bool) -> list[dict]:
    rows: list[dict] = []
    gen = torch.Generator(device=device).manual_seed(0)

    def row(name: str, ms: float, bytes_per_elem: float, **extra) -> dict:
        gbs = bytes_per_elem * n / ms / 1e6
        r = dict(n=n, op=name, ms=ms, gbs=gbs, of_copy=gbs / copy_gbs, **extra)
        rows.append(r)
        return r

    p = torch.randn(n, device=device, generator=gen)
    m = torch.randn(n, device=device, generator=gen) * 0.01
    v = torch.rand(n, device=device, generator=gen) * 1e-4
    g32 = torch.randn(n, device=device, generator=gen) * LOSS_SCALE * 1e-4
    g16 = g32.to(torch.bfloat16)
    lowp = torch.empty(n, device=device, dtype=torch.bfloat16)
    step = [0]

    def next_step():
        step[0] += 1
        return step[0]

    ms_f32 = timer(lambda: fk.adamw_(p, g32, m, v, **HYPER, step=next_step()))
    row("fzero adamw_ fp32 grad", ms_f32, 28)
    ms_bf16 = timer(lambda: fk.adamw_(p, g16, m, v, **HYPER, step=next_step(), grad_scale=LOSS_SCALE,
                                      lowp_param=lowp))
    row("fzero adamw_ bf16 grad + bf16 copy", ms_bf16, 28)
    seq_fz16 = timer(lambda: fzero_sequence(p, g16, m, v, lowp, next_step()))
    row("fzero sequence, bf16 grad", seq_fz16, 30)
    seq_fz32 = timer(lambda: fzero_sequence(p, g32, m, v, lowp, next_step()))
    row("fzero sequence, fp32 grad", seq_fz32, 34)

    if with_torch:
        for name, kw in (("torch AdamW fused", dict(fused=True)), ("torch AdamW foreach", dict(foreach=True))):
            param = torch.nn.Parameter(p.clone())
            param.grad = g32.clone() / LOSS_SCALE
            opt = torch.optim.AdamW([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                                    eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], **kw)
            ms = timer(opt.step)
            row(name, ms, 28, vs_fzero=ms / ms_f32)
            del opt, param
        param = torch.nn.Parameter(p.clone())
        param.grad = g32.clone()  # unscaled and clipped in place each run: stays finite
        opt = torch.optim.AdamW([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                                eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], fused=True)
        inv_scale = torch.full((), 1.0 / LOSS_SCALE, device=device)
        found_inf = torch.zeros((), device=device)
        ms_seq = timer(lambda: torch_sequence(param, opt, lowp, inv_scale, found_inf))
        # unscale r+w 8, norm r 4, clip r+w 8, step 28, cast r 4 + w 2 = 54 B/element
        row("torch unscale+clip+step+cast", ms_seq, 54, vs_fzero_bf16=ms_seq / seq_fz16,
            vs_fzero_fp32=ms_seq / seq_fz32)
        del opt, param

    segs = tuple(range(0, n, max(1, n // 64))) + (n,)
    ms = timer(lambda: fk.lamb_(p, g16, m, v, segments=segs, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-6,
                                weight_decay=0.01, step=next_step(), lowp_param=lowp))
    row("fzero lamb_ (2 launches, 64 tensors)", ms, 14 + 28)  # launch 1 reads p,g,m,v; launch 2 as adamw_
    ms = timer(lambda: fk.lion_(p, g16, m, lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.01, lowp_param=lowp))
    row("fzero lion_ bf16 grad + bf16 copy", ms, 20)
    ms = timer(lambda: fk.sgd_(p, g16, m, lr=1e-3, momentum=0.9, nesterov=True, step=2, lowp_param=lowp))
    row("fzero sgd_ nesterov bf16 grad + bf16 copy", ms, 20)
    ms = timer(lambda: fk.l2_norm(g32))
    row("fzero l2_norm fp32", ms, 4)
    if with_torch:
        ms_t = timer(lambda: torch.linalg.vector_norm(g32))
        row("torch vector_norm fp32", ms_t, 4, vs_fzero=ms_t / ms)
    ms = timer(lambda: fk.unscale_and_check_(g16, 1.0))
    row("fzero unscale_and_check_ bf16", ms, 4)
    del p, m, v, g32, g16, lowp
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,16M,128M,1B", help="comma-separated shard sizes (K/M/B suffixes)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--no-torch", action="store_true", help="time fzero only")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run tiny sizes on the CPU (the torch reference path): a smoke test of this script")
    args = ap.parse_args(argv)

    if args.cpu_smoke:
        device, sizes = torch.device("cpu"), [1 << 10, 1 << 14]
        args.iters, args.warmup = 2, 1
    elif not torch.cuda.is_available():
        print("benchmarks/kernels.py: no CUDA device here, nothing to benchmark "
              "(run it on a GPU machine, or pass --cpu-smoke for a tiny CPU run of the script).")
        return 0
    else:
        device, sizes = torch.device("cuda"), [parse_size(s) for s in args.sizes.split(",")]

    timer = Timer(device, args.warmup, args.iters)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    copy_n = max(sizes) if device.type == "cpu" else max(1 << 28, min(max(sizes), 1 << 29))
    copy_gbs = copy_bandwidth(device, timer, copy_n)
    print(f"device: {name}; torch {torch.__version__}; backend for this device: "
          f"{fk.backend_for(torch.empty(0, device=device))}")
    print(f"copy bandwidth (dst.copy_(src), {copy_n * 4 / 2**30:.1f} GiB fp32, read + write): {copy_gbs:.0f} GB/s")
    rows = []
    for n in sizes:
        timer.iters = args.iters if n < (1 << 29) else max(3, args.iters // 4)
        rows += bench_size(n, device, timer, copy_gbs, with_torch=not args.no_torch)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print(f"\n{'elements':>10} {'operation':<44} {'ms':>9} {'GB/s':>7} {'of copy':>8}  speed-up")
    for r in rows:
        extra = "  ".join(f"{k}={v:.2f}x" for k, v in r.items() if k.startswith("vs_"))
        size = f"{r['n'] / 2**20:.0f}M" if r["n"] >= 2**20 else str(r["n"])
        print(f"{size:>10} {r['op']:<44} {r['ms']:9.3f} {r['gbs']:7.0f} {r['of_copy']:8.1%}  {extra}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, copy_gbs=copy_gbs, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
