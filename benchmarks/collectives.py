"""fzero's collectives on a gloo pair against gloo's own, side by side, by size.

On a gloo group of two ranks, ``fzero.distributed.comm``'s reduce-scatter, all-gather and
small all-reduces are one exchange of point-to-point messages (``fzero/distributed/_pair.py``).
This times each helper both ways on the same tensors: ``pair`` is the helper as fzero runs it,
``gloo`` the same helper with ``FZERO_GLOO_PAIR=0`` (gloo's collective). Rounds are paired:
each round runs every (kind, size) both ways, the order alternating, each call after a
barrier; a call's time is the slower rank's; the table gives the medians and the median over
rounds of pair / gloo. An all-reduce larger than ``_pair.ALL_REDUCE_MAX_BYTES`` is gloo's
either way (its rows read about 1.0).

Sizes are the payload in fp32 elements: the reduce-scatter's input and the all-reduce's
tensor hold that many, the all-gather's output does (its input half).

    python benchmarks/collectives.py [--rounds 30] [--sizes 4,1024,65536,875264,2700000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

from _common import loadavg, run_under_torchrun  # noqa: E402
from fzero.distributed import _pair, comm  # noqa: E402

SCRIPT = "benchmarks/collectives.py"
KINDS = ("reduce_scatter", "all_gather", "all_reduce")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30, help="timed rounds (each kind and size both ways per round)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--sizes", default="4,1024,65536,875264,2700000", help="payload sizes in fp32 elements")
    return p.parse_args(argv)


def call(kind: str, full: torch.Tensor, half: torch.Tensor) -> None:
    if kind == "reduce_scatter":
        comm.reduce_scatter_flat(half, full)
    elif kind == "all_gather":
        comm.all_gather_flat(full, half)
    else:
        comm.all_reduce(full)


def timed(kind: str, full: torch.Tensor, half: torch.Tensor, way: str) -> float:
    os.environ[_pair.ENV] = "1" if way == "pair" else "0"
    dist.barrier()
    t = time.perf_counter()
    call(kind, full, half)
    t = torch.tensor([time.perf_counter() - t])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main(argv=None) -> None:
    args = parse(argv)
    run_under_torchrun(SCRIPT, sys.argv[1:] if argv is None else argv)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    sizes = [int(x) for x in args.sizes.split(",")]
    start = loadavg()
    times = {(k, n, w): [] for k in KINDS for n in sizes for w in ("pair", "gloo")}
    for i in range(args.warmup + args.rounds):
        for k in KINDS:
            for n in sizes:
                full, half = torch.randn(2 * (n // 2)), torch.randn(n // 2)
                for w in (("pair", "gloo") if i % 2 else ("gloo", "pair")):
                    t = timed(k, full, half, w)
                    if i >= args.warmup:
                        times[(k, n, w)].append(t)
    os.environ.pop(_pair.ENV, None)
    if dist.get_rank() == 0:
        print(f"`{sys.executable} {SCRIPT} {' '.join(sys.argv[1:] if argv is None else argv)}`\n")
        print(f"2 gloo ranks x 1 thread, torch {torch.__version__}; {args.rounds} paired rounds after {args.warmup}; "
              f"load average {start} at start, {loadavg()} at end\n")
        print("| kind | elements | bytes | gloo ms | pair ms | pair / gloo (paired) |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for k in KINDS:
            for n in sizes:
                g, p = times[(k, n, "gloo")], times[(k, n, "pair")]
                ratio = statistics.median(a / b for a, b in zip(p, g))
                print(f"| {k} | {n:,} | {4 * n:,} | {1e3 * statistics.median(g):.3f} | "
                      f"{1e3 * statistics.median(p):.3f} | {ratio:.3f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
