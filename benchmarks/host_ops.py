"""The ops one training step dispatches, by the source line that dispatched them.

On a GPU each dispatched op is a kernel launch and its host-side cost, so a step whose host
cannot keep ahead of the GPU is slowed by their number (docs/performance.md, GPU). This
counts them on the CPU for ``plain`` (module, autocast, ``torch.optim.AdamW``) and ``fzero``
(``fzero.compile(precision="bf16", clip_norm=1.0)``), as ``benchmarks/gpu_step.py`` builds
them, on a GPT of GPT-2 124M's depth (12 blocks, 148 parameter tensors) at a tiny width:
the number of non-view ops in one step and the lines that dispatch the most. Counts, not
times: they do not depend on the machine's load.

    python benchmarks/host_ops.py [--contestants plain,fzero] [--top 12]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import gpu_step as g  # noqa: E402
from gpt import GPTConfig  # noqa: E402

ROOT = os.path.dirname(HERE) + os.sep
VIEWS = {"view", "_unsafe_view", "t", "detach", "alias", "as_strided", "transpose", "expand", "permute", "split",
         "slice", "unsqueeze", "squeeze", "select"}


class Count(TorchDispatchMode):
    """Non-view aten ops by the innermost project line (fzero, the example, this benchmark)."""

    def __init__(self):
        super().__init__()
        self.by_line: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] not in VIEWS:
            frames = [f for f in traceback.extract_stack(limit=40)
                      if f.filename.startswith(ROOT) and "site-packages" not in f.filename
                      and not f.filename.endswith("host_ops.py")]
            where = f"{os.path.relpath(frames[-1].filename, ROOT)}:{frames[-1].lineno}" if frames else "?"
            self.by_line[where] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contestants", default="plain,fzero")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=12, n_head=2, n_embd=32)
    batch = {"x": torch.randint(0, 64, (2, 16)), "y": torch.randint(0, 64, (2, 16))}
    for name in args.contestants.split(","):
        module = g.make_model(cfg, torch.device("cpu"))
        step = g.plain_step(module, torch.device("cpu")) if name == "plain" else g.fzero_step(module)
        for _ in range(3):
            step(batch)
        with Count() as c:
            step(batch)
        print(f"{name}: {sum(c.by_line.values())} non-view ops in one step "
              f"({sum(p.numel() > 0 for p in module.parameters())} parameter tensors)")
        for where, n in c.by_line.most_common(args.top):
            print(f"  {n:6d}  {where}")


if __name__ == "__main__":
    main()
