"""What a training step holds on the device, with and without ``offload_optimizer``, per parameter.

One process, an MLP of ``--blocks`` layers of ``--width`` (AdamW), handed to ``step.init``
on the host and placed on a device with ``fzero.Mesh(dp=1, device=...)``. There is no GPU
here: the step runs inside ``device_check.pretend()``, which tells the tensors made on the
host from the ones made on the device as a GPU would (the CPU standing for it). After every
operation of the second step the distinct storages of the live device tensors are added up;
the table gives the most, over Ψ. Activations are small here (4 rows), so this is the
model's states and gradients: what decides how large a model offload can train beside the
one without it, before activations (``benchmarks/gpu_step.py --largest`` measures that on
a GPU).

    python benchmarks/offload_memory.py [--width 256] [--blocks 8] [--groups 4]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import fzero  # noqa: E402
from fzero import optim  # noqa: E402
from fzero.distributed import device_check  # noqa: E402

VARIANTS = [
    {"zero": 1, "precision": "bf16"},
    {"zero": 1, "precision": "bf16", "offload_optimizer": "cpu"},
    {"zero": 2, "precision": "bf16", "offload_optimizer": "cpu"},
    {"zero": 1},
    {"zero": 1, "offload_optimizer": "cpu"},
]


def _device_bytes(tensors, excluded: frozenset = frozenset()) -> int:
    """Bytes of the distinct storages of the live ``tensors`` made on the device, but those at
    the addresses ``excluded``."""
    return sum(n for ptr, n in _device_storages(tensors).items() if ptr not in excluded)


def _live_tensors() -> list:
    """Every tensor the process's objects hold (one walk of the heap)."""
    with warnings.catch_warnings():  # isinstance on a deprecated object of torch's warns
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]


def _device_storages(tensors=None) -> dict[int, int]:
    """The storages made on the device of ``tensors`` (default: every live tensor): bytes by address."""
    from torch._subclasses.fake_tensor import FakeTensor

    seen = {}
    for o in _live_tensors() if tensors is None else list(tensors):
        # A fake tensor (another program's compile left it behind) has no storage of its own:
        # torch warns, and will refuse, on its data pointer.
        if isinstance(o, FakeTensor) or o.device.type == "meta" or device_check.is_host(o):
            continue
        try:  # a tensor without real storage (a fake one another program left behind) is none of the step's
            storage = o.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):
            continue
    return seen


class _Peak(TorchDispatchMode):
    """The most device bytes live after any operation of the block it is entered for.

    The live tensors are those of one walk of the heap when it is entered and every tensor
    an operation returns after, held by weak reference: a tensor the process no longer
    holds drops out as it is freed. So each count sees what a walk of the heap would, without
    walking it hundreds of times a step, but for a tensor made outside any operation: torch's
    generator state, 5 KB, which the step's ``fork_rng`` saves (on a GPU, host memory)."""

    def __init__(self, least: int, excluded: frozenset):
        super().__init__()
        self.peak, self.least, self.excluded = 0, least, excluded
        self.live = weakref.WeakValueDictionary()  # id -> tensor

    def __enter__(self):
        self.live.update({id(t): t for t in _live_tensors()})
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        made = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.live.update({id(t): t for t in made})
        # The device's bytes only rise when an operation allocates there: counted after
        # those that return a device tensor of some size.
        if any(t.numel() * t.element_size() >= self.least and not device_check.is_host(t) for t in made):
            self.peak = max(self.peak, _device_bytes(self.live.values(), self.excluded))
        return out


def _step(state, batch):
    loss, grads = fzero.value_and_grad(lambda p: F.mse_loss(state.apply_fn(p, batch["x"]).float(), batch["y"]))(
        state.params)
    return state.apply_gradients(grads), {"loss": loss}


def step_device_peak(width: int, blocks: int, groups: int = 4, **options) -> tuple[int, int]:
    """(Ψ, the most bytes the device held during a step), the model cut into ``groups``
    reduction groups (``bucket_bytes``: Ψ / ``groups`` parameters each). The suite's
    bound on offload's device memory counts with it (``tests/test_offload.py``)."""
    gc.collect()
    with device_check.pretend():
        torch.manual_seed(0)
        module = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(blocks)])
        apply, params = fzero.functionalize(module)
        psi = sum(p.numel() for p in params.values())
        state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-3))
        del params, module
        item = 2 if options.get("precision") in ("bf16", "fp16") else 4  # the parameters' bytes
        step = fzero.compile(_step, fzero.Mesh(dp=1, device="cpu"), bucket_bytes=item * -(-psi // groups), **options)
        state = step.init(state)
        batch = {"x": torch.randn(4, width), "y": torch.randn(4, width)}
        state, _ = step(state, batch)  # the first step makes what the steps keep
        # What the process held on the "device" before, but the state's own (another
        # program's tensors, in a test suite's process, are none of the step's).
        mine = {t.untyped_storage().data_ptr() for t in fzero.tree.leaves(state) if isinstance(t, torch.Tensor)}
        others = frozenset(set(_device_storages()) - mine)
        peak = _Peak(least=width * 4, excluded=others)  # least: a layer's bias in fp32
        with peak:
            state, _ = step(state, batch)
        del state, step
    return psi, peak.peak


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--groups", type=int, default=4, help="reduction groups the model is cut into")
    args = p.parse_args(argv)
    print(f"device bytes per parameter at a step's peak (MLP {args.blocks} x {args.width}, {args.groups} "
          f"reduction groups, AdamW, 4 rows; under device_check.pretend(); torch {torch.__version__})")
    print("| options | device bytes / parameter at the step's peak |")
    print("| --- | ---: |")
    for options in VARIANTS:
        psi, peak = step_device_peak(args.width, args.blocks, args.groups, **options)
        name = ", ".join(f"{k}={v!r}" for k, v in options.items())
        print(f"| `{name}` | {peak / psi:.2f} |", flush=True)


if __name__ == "__main__":
    main()
