"""What ``step.init`` allocates: every byte, counted by torch's profiler, per parameter.

One process, an MLP of ``--blocks`` layers of ``--width`` (fp32, AdamW), compiled in a world of
one with each option set below; for each, the most bytes allocated at once while ``init``
runs and what is allocated when it returns, over what the caller held just before (the
module's fp32 weights, the state's -- which share them -- and the AdamW moments
``TrainState.create`` built: 12 bytes per parameter; what ``init`` frees of them counts
against its own). On a CPU the host and the device are
one memory, so offload's rows count both; on a GPU ``benchmarks/gpu_memory.py`` reads the
device's share.

    python benchmarks/init_memory.py [--width 512] [--blocks 6]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fzero  # noqa: E402
from fzero import optim  # noqa: E402

VARIANTS = [
    {"zero": 0, "precision": "bf16"},
    {"zero": 1},
    {"zero": 1, "precision": "bf16"},
    {"zero": 2, "precision": "bf16"},
    {"zero": 3, "precision": "bf16"},
    {"zero": 1, "offload_optimizer": "cpu"},
    {"zero": 1, "precision": "bf16", "offload_optimizer": "cpu"},
]


def init_bytes(width: int, blocks: int, **options) -> tuple[int, int, int]:
    """(Ψ, init's peak bytes, the bytes allocated when it returns), over what was allocated
    just before it (the caller's module and state): the profiler watches from before the
    module is made, so what ``init`` frees of the caller's is counted too. The suite's bound
    on init's memory counts with it (``tests/test_zero.py``)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        torch.manual_seed(0)
        module = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(blocks)])
        apply, params = fzero.functionalize(module)
        psi = sum(p.numel() for p in params.values())
        state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-3))
        del params
        step = fzero.compile(lambda s, b: (s, {}), fzero.Mesh(dp=1), **options)
        with record_function("init"):
            new = step.init(state)
        del new, state, module
    events = list(prof.profiler.kineto_results.events())
    mark = next(e for e in events if e.name() == "init")
    now = before = peak = after = 0
    for t, n in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        if t < mark.start_ns():
            before = now = now + n
            continue
        now += n
        if t <= mark.end_ns():
            peak, after = max(peak, now), now
    return psi, peak - before, after - before


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--blocks", type=int, default=6)
    args = p.parse_args(argv)
    print(f"bytes per parameter allocated while step.init runs, over the caller's 12 (module, moments) (MLP "
          f"{args.blocks} x {args.width}, torch {torch.__version__})")
    print("| options | init's peak | when init returns |")
    print("| --- | ---: | ---: |")
    for options in VARIANTS:
        psi, peak, left = init_bytes(args.width, args.blocks, **options)
        name = ", ".join(f"{k}={v!r}" for k, v in options.items())
        print(f"| {name} | {peak / psi:.2f} | {left / psi:.2f} |", flush=True)


if __name__ == "__main__":
    main()
