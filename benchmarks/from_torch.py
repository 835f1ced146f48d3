"""What ``fzero.optim.from_torch`` costs per update against torch's optimizer stepping the
module's parameters in place, in one process.

Both sides update the same parameters from the same gradients (a stack of ``Linear(D, D)``
layers; no forward or backward is timed). ``torch``: ``opt.step()`` on the module's
parameters. ``fzero``: the update a compiled step makes (``fzero.core.lower(tx, params)``,
the lowering a step runs), ``donated`` (a compiled step's default: the optimizer steps the
parameters themselves, in place) and ``pure`` (``donate=False``: it steps copies of the
parameters and returns ``new - old``, which ``apply_updates`` adds). The rounds are paired:
each round times one update of every contestant back to back in a rotating order, so a
change in the machine's load reaches all of them; the report is each contestant's median
and its median ratio to torch's update of the same round.

    python benchmarks/from_torch.py [--optimizer Adam] [--width 1024] [--layers 8] [--rounds 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

import fzero  # noqa: E402
from fzero import optim  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--optimizer", default="Adam", help="a torch.optim class (default Adam)")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    cls = getattr(torch.optim, args.optimizer)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]).to(dev)
    grads = {k: torch.randn_like(v) * 1e-3 for k, v in model.named_parameters()}
    for k, p in model.named_parameters():
        p.grad = grads[k]
    opt = cls(model.parameters(), lr=1e-4)
    tx = optim.from_torch(cls, lr=1e-4)
    sides = {}
    for name in ("donated", "pure"):
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        sides[name] = [params, tx.init(params)]
    lowered = fzero.core.lower(tx, sides["donated"][0])

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def run_torch():
        opt.step()

    def run(name):
        params, state = sides[name]
        params, state = lowered.update(grads, state, params, donate=name == "donated")
        sides[name] = [params, state]

    contestants = {"torch": run_torch, "fzero donated": lambda: run("donated"), "fzero pure": lambda: run("pure")}
    for fn in contestants.values():  # warm up: each side's state is built at its first update
        fn()
    sync()
    times = {name: [] for name in contestants}
    names = list(contestants)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            sync()
            t0 = time.perf_counter()
            contestants[name]()
            sync()
            times[name].append(time.perf_counter() - t0)
    n = sum(p.numel() for p in model.parameters())
    print(f"from_torch({args.optimizer}) vs torch.optim.{args.optimizer}: {args.layers} x Linear({args.width}, "
          f"{args.width}), {n:,} parameters, {len(grads)} tensors, {args.device}, {args.rounds} paired rounds")
    for name in names:
        ratio = statistics.median(a / b for a, b in zip(times[name], times["torch"]))
        print(f"  {name:14s} median {statistics.median(times[name]) * 1e3:8.3f} ms   x torch {ratio:5.2f}")


if __name__ == "__main__":
    main()
