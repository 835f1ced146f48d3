"""Host time against GPU time of one training step: is a contestant bound by its Python?

For ``plain`` (module, bf16 autocast, ``torch.optim.AdamW(fused=True)``) and ``fzero``
(``fzero.compile(precision="bf16", clip_norm=1.0)``), as ``benchmarks/gpu_step.py`` builds
them: the mean step time over a few synchronised steps, how long one step's call takes to
return on the host, and a ``torch.profiler`` table of one step by GPU time and (fzero) by
host time, with the counts of kernel launches and host syncs. A step whose host time is
near its step time while its GPU time is far below is host-bound: its launches, not its
kernels, set the pace. ``--backend reference`` adds fzero on the optimizer's torch path
instead of the Triton kernels.

    python benchmarks/gpu_profile.py --preset 124m [--contestants plain,fzero,fzero-reference]

CUDA only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import gpu_step as g  # noqa: E402
from gpt import GPTConfig  # noqa: E402

COUNTED = ("Synchronize", "Memcpy", "LaunchKernel", "local_scalar")


def timed(step, batch, n: int = 6) -> tuple[float, float]:
    for _ in range(3):
        step(batch)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        step(batch)
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - t) / n * 1e3
    t = time.perf_counter()
    step(batch)
    host = (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    return per_step, host


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=tuple(g.PRESETS), default="124m")
    p.add_argument("--contestants", default="plain,fzero")
    p.add_argument("--rows", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_profile.py: needs a CUDA GPU")
    dev = torch.device("cuda", torch.cuda.current_device())
    n_layer, n_head, n_embd, block, vocab, batch_size = g.PRESETS[args.preset]
    cfg = GPTConfig(vocab_size=vocab, block_size=block, n_layer=n_layer, n_head=n_head, n_embd=n_embd)
    batch = g.batches(cfg, batch_size, 1, dev)[0]
    for name in args.contestants.split(","):
        os.environ.pop("FZERO_KERNELS_BACKEND", None)
        if name == "fzero-reference":
            os.environ["FZERO_KERNELS_BACKEND"] = "reference"
        module = g.make_model(cfg, dev)
        step = g.plain_step(module, dev) if name == "plain" else g.fzero_step(module)
        per_step, host = timed(step, batch)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(batch)
            torch.cuda.synchronize()
        events = prof.key_averages()
        gpu_ms = sum(e.self_device_time_total for e in events) / 1e3
        cpu_ms = sum(e.self_cpu_time_total for e in events) / 1e3
        counts = {e.key: e.count for e in events if any(c in e.key for c in COUNTED)}
        print(f"### {name}: {per_step:.1f} ms/step; one step returns on the host in {host:.1f} ms; "
              f"profiled: GPU {gpu_ms:.1f} ms, host {cpu_ms:.1f} ms; {counts}", flush=True)
        print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=60))
        if name != "plain":
            print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60))
        del step, module
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
