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
from fzero.functional import functionalize, grad, load_into, remat, value_and_grad
from fzero.means import global_mean
from fzero import rng
from fzero.train_state import TrainState
from fzero.transforms import (ColwiseParallel, DivideAttributes, NonFiniteGradientError, RowwiseParallel, Step, accumulate,
                              check_finite, mixed_precision, pipeline, shard_state, tensor_parallel)
from fzero._version import __version__

__all__ = [
    "ColwiseParallel",
    "CompileOptions",
    "Config",
    "DivideAttributes",
    "Mesh",
    "NonFiniteGradientError",
    "Params",
    "Step",
    "TrainState",
    "accumulate",
    "check_finite",
    "checkpoint",
    "compile",
    "data",
    "functionalize",
    "gather",
    "global_mean",
    "grad",
    "load_into",
    "mixed_precision",
    "optim",
    "pipeline",
    "RowwiseParallel",
    "remat",
    "rng",
    "shard_state",
    "tensor_parallel",
    "tree",
    "value_and_grad",
]


def __getattr__(name: str):
    # fzero.testing needs hypothesis, a test dependency: imported on first use only.
    if name == "testing":
        import importlib

        return importlib.import_module("fzero.testing")
    raise AttributeError(f"module 'fzero' has no attribute {name!r}")
