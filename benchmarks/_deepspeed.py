"""DeepSpeed's ZeRO stages 0-3 as contestants of benchmarks/zero.py, where ``import deepspeed`` works.

DeepSpeed is no dependency of fzero: nothing here imports it until :func:`available` is
called, and a run without it skips these contestants. In a scratch environment::

    python3 -m venv /tmp/dsvenv
    /tmp/dsvenv/bin/pip install torch==2.13.0 optree safetensors tqdm numpy hypothesis
    DS_BUILD_OPS=0 /tmp/dsvenv/bin/pip install deepspeed==0.19.8
    PYTHONPATH=$PWD /tmp/dsvenv/bin/python benchmarks/zero.py --steps 2 --warmup 2 --rss off

The engine: ``deepspeed.initialize(model=<a copy of the module>, optimizer=<the same
torch.optim.AdamW(foreach=True) as DDP's>, config=...)``, then ``engine.backward(loss)`` and
``engine.step()``. The config (:func:`config`) asks for fp32 (neither ``fp16`` nor ``bf16``),
no accumulation and no clipping (``gradient_clipping: 0.0``: DeepSpeed 0.19 clips to norm 1.0
when the key is absent, and no other contestant clips), so the engine trains the math DDP
trains. Its gradient buckets (``reduce_bucket_size``, ``allgather_bucket_size``) hold
``--bucket-mb``, as DDP's and fzero's do (DeepSpeed's default is 5e8 elements). At stage 3,
``stage3_param_persistence_threshold`` is 0: DeepSpeed keeps every parameter below 1e5
elements whole on every rank by default, which in a width-128 GPT is every parameter, and the
ZeRO-3 formula partitions them all; and ``memory_efficient_linear`` is off: left on, it
replaces ``torch.nn.functional.linear`` for the whole process ("This will persist unless
manually reset", DeepSpeed 0.19's ``zero.Init``), so every other contestant's ``nn.Linear``
would run through DeepSpeed's autograd function. :func:`build` checks that building an engine
changed no function of ``torch``, ``torch.nn.functional`` or ``torch.Tensor``.

Model state per rank (:func:`state_bytes`), counted as for the other contestants: the
distinct storages, views once, of the parameters, the gradients and the optimizer state that
the engine holds after ``engine.backward`` and before ``engine.step``:

* stage 0 (the engine steps the AdamW itself): the module's parameters, their ``.grad`` and
  the AdamW's state;
* stages 1-2 (``DeepSpeedZeroOptimizer``): the flat parameter buffers the module's
  parameters are views of (``bit16_groups_flat``, fp32 here), the fp32 master partition the
  AdamW updates (``single_partition_of_fp32_groups``, a second copy of this rank's slice even
  in fp32) and its ``.grad``, the reduced gradients (``averaged_gradients``; at stage 2 also
  ``grads_in_partition``), any ``.grad`` left on the module's parameters, and the AdamW's
  state of the master partition;
* stage 3 (``DeepSpeedZeroOptimizer_Stage3``): each parameter's partition (``ds_tensor``,
  in ``fp16_partitioned_groups_flat``) and whatever of it is gathered, the fp32 master
  partition (``fp32_partitioned_groups_flat``) and its ``.grad``, the gradient partition
  (``grad_partitions_flat_buffer``, ``averaged_gradients``) and the AdamW's state.

Not counted: DeepSpeed's reduce staging buffers (``ipg_buckets``, ``reduce_bucket_size``
elements), as fzero's reduce buffers are not: they are communication space, not state.
"""

from __future__ import annotations

import copy
import logging
import os
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from _common import MIB, loss_of, make_torch_optimizer
from fzero.testing import storage_bytes

STAGES = (0, 1, 2, 3)
# The optimizer attributes that hold parameters or gradients, stages 1-2 and stage 3; an
# attribute a stage lacks counts nothing.
HELD = ("bit16_groups_flat", "single_partition_of_fp32_groups", "averaged_gradients", "grads_in_partition",
        "fp16_partitioned_groups_flat", "fp32_partitioned_groups_flat", "grad_partitions_flat_buffer")
# The fp32 master partitions the AdamW updates: their .grad is set for the update.
MASTERS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
# Where a library can replace the functions every contestant calls (DeepSpeed's zero.Init does).
SPACES = {"torch": torch, "torch.nn.functional": F, "torch.Tensor": torch.Tensor}


def available() -> tuple[bool, str]:
    """``(True, version)`` if DeepSpeed imports in this interpreter, else ``(False, why)``.

    The benchmark runs on the CPU with gloo: unless ``DS_ACCELERATOR`` says otherwise,
    DeepSpeed is told so before it is imported (it picks its accelerator at import).
    """
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except Exception as e:  # ImportError, or an accelerator DeepSpeed cannot set up
        return False, f"{type(e).__name__}: {e}"
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    return True, deepspeed.__version__


def config(stage: int, *, micro_batch: int, bucket_elements: int) -> dict:
    """The DeepSpeed config of a contestant (see the module docstring for each choice)."""
    zero = {"stage": stage, "reduce_bucket_size": bucket_elements, "allgather_bucket_size": bucket_elements}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, memory_efficient_linear=False)
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def state_bytes(engine) -> int:
    """Bytes of the model state ``engine`` holds on this rank (see the module docstring)."""
    opt = engine.optimizer
    params = list(engine.module.parameters())
    adamw = getattr(opt, "optimizer", opt)  # the torch AdamW DeepSpeed steps: the engine's own at stage 0
    masters = [m for name in MASTERS for m in (getattr(opt, name, None) or [])]
    return storage_bytes(
        params, [p.grad for p in params if p.grad is not None], [getattr(p, "ds_tensor", None) for p in params],
        {name: getattr(opt, name, None) for name in HELD}, [m.grad for m in masters if m.grad is not None],
        [dict(s) for s in adamw.state.values()])


def build(stage: int) -> Callable:
    """The builder of contestant ``deepspeed<stage>``: ``build(base, args, mesh) -> step``, where
    ``step(batch, probe) -> loss`` stores :func:`state_bytes` in probe["bytes"] when probe["on"]."""

    def build_stage(base, args, mesh):
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")  # wraps the process group the mesh made
        model = copy.deepcopy(base)
        cfg = config(stage, micro_batch=args.batch_size // dist.get_world_size(),
                     bucket_elements=int(args.bucket_mb * MIB) // 4)  # fp32 elements
        before = _torch_functions()
        engine, *_ = deepspeed.initialize(model=model, optimizer=make_torch_optimizer(model.parameters()), config=cfg)
        changed = sorted(k for k, f in _torch_functions().items() if k in before and before[k] is not f)
        if changed:
            for space, name in changed:  # put torch's back, so that the other contestants run it
                setattr(SPACES[space], name, before[space, name])
            raise RuntimeError(f"deepspeed.initialize replaced {', '.join(f'{s}.{n}' for s, n in changed)}, "
                               "which every other contestant calls too")

        def step(batch, probe):
            loss = loss_of(engine(batch["x"]), batch["y"])
            engine.backward(loss)
            if probe.get("on"):
                probe["bytes"] = state_bytes(engine)
            engine.step()
            return loss.detach()

        return step

    return build_stage


def _torch_functions() -> dict:
    """The functions of :data:`SPACES`, by ``(space, name)``: what the other contestants call
    through module attributes. (Importing ``torch._dynamo`` wraps a few of ``torch``'s,
    ``manual_seed`` among them: benchmarks/zero.py imports it first, so that is not taken for
    DeepSpeed's doing.)"""
    return {(space, k): v for space, ns in SPACES.items() for k, v in vars(ns).items() if callable(v)}
