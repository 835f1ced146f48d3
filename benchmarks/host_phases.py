"""Host time of one training step by phase: before the forward, forward and backward, after.

On a GPU a step's host work before its forward's first kernel, and after its backward's last
(the optimizer's bookkeeping), is time the GPU waits for when the step starts from a
synchronised device, as ``benchmarks/gpu_step.py`` times it. This measures the three phases
on the CPU for ``plain`` (module, bf16 autocast, ``torch.optim.AdamW``, ``clip_grad_norm_``)
and ``fzero`` (``fzero.compile(precision="bf16", clip_norm=1.0)``), built as ``gpu_step.py``
builds them, on a GPT of GPT-2 124M's depth (12 blocks, 148 parameter tensors) at a tiny
width, where a step is mostly Python and dispatch: the forward starts at the model's call
(a forward pre-hook), the backward ends when autograd's engine returns. Paired rounds, one
step of each per round; medians.

The middle phase includes the CPU's own compute of the tiny model, and the last one the
optimizer's (on a GPU both are kernels); the first has none: it is host overhead alone.

    python benchmarks/host_phases.py [--n-layer 12] [--n-embd 64] [--rounds 40] [--zero 1,2,3]

``--zero`` adds ``fzero.compile(zero=N)`` in a world of one for each ``N`` listed: what a
ZeRO configuration costs a run on one GPU, where no stage has a rank to share with.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.autograd.graph as autograd_graph

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import gpu_step as g  # noqa: E402
from gpt import GPTConfig  # noqa: E402

from fzero import core  # noqa: E402

PHASES = ("before forward", "forward + backward", "after backward", "step")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--zero", default="", metavar="N,...",
                   help="also fzero.compile(zero=N) for each N listed, in a world of one (a ZeRO config run on one GPU)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=args.n_layer, n_head=2, n_embd=args.n_embd)
    device = torch.device("cpu")
    batch = g.batches(cfg, 1, 1, device)[0]

    marks: dict[str, float] = {}
    engine, fzero_engine = torch.autograd._engine_run_backward, getattr(core, "_engine_run_backward", None)

    def timed_engine(*a, **kw):  # torch's backward() and grad() call it (torch.autograd's name), so does fzero.core
        out = engine(*a, **kw)
        marks["backward end"] = time.perf_counter()
        return out

    def forward_start(module, args):
        marks.setdefault("forward start", time.perf_counter())

    torch.autograd._engine_run_backward = autograd_graph._engine_run_backward = timed_engine
    if fzero_engine is not None:  # (an fzero that calls the engine itself)
        core._engine_run_backward = timed_engine
    try:
        steps = {}
        stages = [int(n) for n in args.zero.split(",") if n.strip()]
        for name in ("plain", "fzero", *[f"fzero zero={n}" for n in stages]):
            module = g.make_model(cfg, device)
            module.register_forward_pre_hook(forward_start)
            steps[name] = (g.plain_step(module, device) if name == "plain" else
                           g.fzero_step(module, zero=int(name.rpartition("=")[2])) if "=" in name else g.fzero_step(module))
            for _ in range(3):
                steps[name](batch)
        times = {n: [] for n in steps}
        for _ in range(args.rounds):
            for name, step in steps.items():
                marks.clear()
                t0 = time.perf_counter()
                step(batch)
                t1 = time.perf_counter()
                times[name].append((marks["forward start"] - t0, marks["backward end"] - marks["forward start"],
                                    t1 - marks["backward end"], t1 - t0))
    finally:  # torch's and fzero's own entries back
        torch.autograd._engine_run_backward = autograd_graph._engine_run_backward = engine
        if fzero_engine is not None:
            core._engine_run_backward = fzero_engine
    result = {n: {ph: statistics.median(r[i] for r in rows) * 1e3 for i, ph in enumerate(PHASES)}
              for n, rows in times.items()}
    print(f"`python benchmarks/host_phases.py {' '.join(argv if argv is not None else sys.argv[1:])}`".replace(" `", "`"))
    print(f"GPT {args.n_layer} blocks of width {args.n_embd}, 1 sequence of 32 tokens, {args.threads} thread(s), "
          f"torch {torch.__version__}; median of {args.rounds} paired rounds, host ms")
    print()
    print("| phase | " + " | ".join(result) + " |")
    print("| --- |" + " ---: |" * len(result))
    for ph in PHASES:
        print(f"| {ph} | " + " | ".join(f"{result[n][ph]:.3f}" for n in result) + " |")
    return result


if __name__ == "__main__":
    main()
