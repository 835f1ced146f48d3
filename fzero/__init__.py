"""fzero: JAX-style functional training on torch.func.

Write one pure single-device ``train_step(state, batch)``; fzero's transforms rewrite it
into a partitioned, communicating, mixed-precision step. See README.md and docs/.
"""

from __future__ import annotations

import importlib
import importlib.util

from fzero._version import __version__

# Every public name is imported when it is first read (PEP 562, as SPEC 1, lazy loading in
# scientific Python, has it): ``import fzero`` imports nothing else, so the console command
# (``fzero launch``), which reads none of them, starts without importing torch -- 3 to 4 s a
# process on the project's 2-core machines, paid before torchrun starts. ``_PUBLIC`` says
# where each name lives; any submodule read as an attribute (``fzero.distributed``,
# ``fzero.testing``, which needs hypothesis, a test dependency) is imported then.
_PUBLIC = {
    "tree": ("fzero.tree", None), "checkpoint": ("fzero.checkpoint", None), "data": ("fzero.data", None),
    "optim": ("fzero.optim", None), "rng": ("fzero.rng", None),
    "Params": ("fzero._params", "Params"),
    "compile": ("fzero._compile", "compile"),
    "Config": ("fzero.config", "Config"),
    "CompileOptions": ("fzero.options", "CompileOptions"),
    "Mesh": ("fzero.distributed", "Mesh"), "gather": ("fzero.distributed", "gather"),
    "preempted": ("fzero.distributed.preemption", "preempted"),
    **{n: ("fzero.functional", n) for n in ("functionalize", "grad", "load_into", "remat", "value_and_grad")},
    "global_mean": ("fzero.means", "global_mean"),
    "TrainState": ("fzero.train_state", "TrainState"),
    "ReplicaDivergenceError": ("fzero.replicas", "ReplicaDivergenceError"),
    # Step -> step transforms: each takes a train step and returns one with the same signature
    # (compile applies them in one fixed order, fzero/_compile.py's ORDER).
    **{n: ("fzero.transforms", n) for n in ("Step", "accumulate", "check_finite", "clip", "mixed_precision",
                                            "offload_optimizer", "shard_state", "tensor_parallel", "torch_autocast")},
    # Not a step transform: fzero.pipeline(stages, loss_fn, mesh) makes a gradient function, a
    # pipelined value_and_grad the train step calls (loss, grads = pipe(params, x, y)); its
    # .transform(step) is the step transform, which compile(pipeline=pipe) applies.
    "pipeline": ("fzero.transforms", "pipeline"),
    # What the transforms take and raise: tensor_parallel's plan styles, check_finite's error.
    **{n: ("fzero.transforms", n) for n in ("ColwiseParallel", "DivideAttributes", "NonFiniteGradientError",
                                            "PrepareModuleInput", "RowwiseParallel", "SequenceParallel")},
}

__all__ = sorted(_PUBLIC, key=str.lower)  # one list: every public name is one _PUBLIC holds



def __getattr__(name: str):
    if name in _PUBLIC:
        module, attr = _PUBLIC[name]
        value = importlib.import_module(module)
        if attr is not None:
            value = getattr(value, attr)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'fzero' has no attribute {name!r}")
    globals()[name] = value  # once: later reads are plain attribute lookups
    return value


def __dir__():
    return sorted({*globals(), *_PUBLIC})
