"""Where one GPU's bytes go in an fzero step, with and without ``offload_optimizer="cpu"``.

For a GPT of 350M width (12 blocks by default), batch 4 x 1024, bf16, AdamW, ZeRO-1 on one
process: the GPU bytes per parameter after ``init``, the peak during the forward and backward
(read inside the train step, before the update), the peak during the update, what is left
after two steps, and what the state's trees hold on the GPU (params, masters, optimizer
state) and what the user's module still holds. ZeRO-Offload should cut the states' 14 bytes
per parameter to the 2 of the bf16 copies; the H200 run of 2026-11-27 found the step's peak
hardly lower (docs/performance.md, GPU), which this script is here to take apart.

    python benchmarks/gpu_memory.py [--n-layer 12] [--batch 4]

CUDA only.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import fzero  # noqa: E402
from fzero import optim, tree  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402


def cuda_bytes(t) -> int:
    """The bytes of the distinct CUDA storages under ``t`` (a ZeRO piece counts as its local tensor)."""
    seen, n = set(), 0
    for x in tree.leaves(t):
        x = getattr(x, "local", x)
        if isinstance(x, torch.Tensor) and x.is_cuda and x.untyped_storage().data_ptr() not in seen:
            seen.add(x.untyped_storage().data_ptr())
            n += x.untyped_storage().nbytes()
    return n


def probe(cfg: GPTConfig, batch: int, dev: torch.device, **opts) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.manual_seed(0)
    module = GPT(cfg).to(dev)
    n = sum(p.numel() for p in module.parameters())
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=g).to(dev)
    data = {"x": x[:, :-1], "y": x[:, 1:]}
    apply, params = fzero.functionalize(module)
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(3e-4, 0.9, 0.95, 1e-8, 0.1))
    del params
    seen = {}

    def train_step(state, batch):
        def loss_fn(p):
            return F.cross_entropy(state.apply_fn(p, batch["x"]).float().flatten(0, 1), batch["y"].flatten())

        torch.cuda.reset_peak_memory_stats(dev)
        loss, grads = fzero.value_and_grad(loss_fn)(state.params)
        seen["backward_peak"] = torch.cuda.max_memory_allocated(dev) - base
        seen["after_backward"] = torch.cuda.memory_allocated(dev) - base
        torch.cuda.reset_peak_memory_stats(dev)
        return state.apply_gradients(grads), {"loss": loss}

    step = fzero.compile(train_step, fzero.Mesh(dp=1), precision="bf16", clip_norm=1.0, **opts)
    s = step.init(state)
    del state
    out = {"params": n, "init_peak": torch.cuda.max_memory_allocated(dev) - base,
           "after_init": torch.cuda.memory_allocated(dev) - base}
    for _ in range(2):
        s, m = step(s, data)
    torch.cuda.synchronize(dev)
    out.update(seen, update_peak=torch.cuda.max_memory_allocated(dev) - base,
               after_steps=torch.cuda.memory_allocated(dev) - base, loss=float(m["loss"]),
               state_params=cuda_bytes(s.params), state_master=cuda_bytes(s.master),
               state_opt=cuda_bytes(s.opt_state), module=cuda_bytes(list(module.parameters())))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_memory.py: needs a CUDA GPU")
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = GPTConfig(vocab_size=50304, block_size=1024, n_layer=args.n_layer, n_head=16, n_embd=1024)
    keys = ("init_peak", "after_init", "backward_peak", "after_backward", "update_peak", "after_steps",
            "state_params", "state_master", "state_opt", "module")
    print("| variant | " + " | ".join(keys) + " | loss |")
    print("| --- |" + " ---: |" * (len(keys) + 1))
    for name, opts in (("zero=1", {"zero": 1}), ("zero=1, offload", {"zero": 1, "offload_optimizer": "cpu",
                                                                      "pin_memory": True})):
        r = probe(cfg, args.batch, dev, **opts)
        print(f"| {name} | " + " | ".join(f"{r[k] / r['params']:.2f}" for k in keys) + f" | {r['loss']:.4f} |",
              flush=True)
    print(f"bytes per parameter ({r['params'] / 1e6:.1f}M parameters), on {torch.cuda.get_device_name(dev)}")


if __name__ == "__main__":
    main()
