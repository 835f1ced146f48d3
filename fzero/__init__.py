"""fzero: JAX-style functional training on torch.func.

Write one pure single-device ``train_step(state, batch)``; fzero's transforms rewrite it
into a partitioned, communicating, mixed-precision step. See README.md and docs/.
"""

from fzero import tree
from fzero._params import Params
from fzero import checkpoint, data, optim
from fzero._compile import compile
from fzero.config import Config
from fzero.options import CompileOptions
from fzero.distributed import Mesh, gather
from fzero.distributed.preemption import preempted
from fzero.functional import functionalize, grad, load_into, remat, value_and_grad
from fzero.means import global_mean
from fzero import rng
from fzero.train_state import TrainState
from fzero.replicas import ReplicaDivergenceError
# Step -> step transforms: each takes a train step and returns one with the same signature
# (compile applies them in one fixed order, fzero/_compile.py's ORDER).
from fzero.transforms import (Step, accumulate, check_finite, clip, mixed_precision, offload_optimizer, shard_state,
                              tensor_parallel, torch_autocast)
# Not a step transform: fzero.pipeline(stages, loss_fn, mesh) makes a gradient function, a
# pipelined value_and_grad the train step calls (loss, grads = pipe(params, x, y)); its
# .transform(step) is the step transform, which compile(pipeline=pipe) applies.
from fzero.transforms import pipeline
# What the transforms take and raise: tensor_parallel's plan styles, check_finite's error.
from fzero.transforms import (ColwiseParallel, DivideAttributes, NonFiniteGradientError, PrepareModuleInput,
                              RowwiseParallel, SequenceParallel)
from fzero._version import __version__

__all__ = [
    "ColwiseParallel",
    "CompileOptions",
    "Config",
    "DivideAttributes",
    "Mesh",
    "NonFiniteGradientError",
    "ReplicaDivergenceError",
    "Params",
    "PrepareModuleInput",
    "SequenceParallel",
    "Step",
    "TrainState",
    "accumulate",
    "check_finite",
    "checkpoint",
    "clip",
    "compile",
    "data",
    "functionalize",
    "gather",
    "global_mean",
    "grad",
    "load_into",
    "mixed_precision",
    "offload_optimizer",
    "optim",
    "pipeline",
    "preempted",
    "RowwiseParallel",
    "remat",
    "rng",
    "shard_state",
    "tensor_parallel",
    "torch_autocast",
    "tree",
    "value_and_grad",
]

# Subpackages reachable as attributes but imported on first use only, as SPEC 1 (lazy
# loading, scientific Python) has it: fzero.testing needs hypothesis, a test dependency,
# and stands above the whole package (it imports fzero), so nothing here imports it.
_LAZY_SUBMODULES = frozenset({"testing"})


def __getattr__(name: str):
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'fzero' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_LAZY_SUBMODULES])
