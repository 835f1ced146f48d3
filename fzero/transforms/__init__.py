"""Transforms: functions from a train step to a train step with the same signature.

Each one installs a handler of fzero's primitives (see :mod:`fzero.core`) around the inner
step and narrows the step context for it. What a transform of one's own needs is exported
here: ``Handler``, ``Step``, ``as_step``, ``installed``; the primitives ``psum`` (with
``LeafSums``) and ``emit_metric``; the step context (``context``, ``running``, ``StepContext``,
``MicroBatch``); and ``bind`` to run a primitive through the handlers.
"""

import sys

from fzero.core import (Handler, LeafSums, MicroBatch, NotApplied, Step, StepContext, as_step, bind, context,
                        emit_metric, installed, psum, running)
from fzero.transforms.accumulate import accumulate
from fzero.transforms.clip import clip
from fzero.transforms.finite import NonFiniteGradientError, check_finite
from fzero.transforms.mixed_precision import mixed_precision, torch_autocast
from fzero.transforms.offload import offload_optimizer
from fzero.transforms.pipeline import pipeline
from fzero.transforms.shard_state import shard_state
from fzero.transforms.tensor_parallel import (BatchMismatchError, ColwiseParallel, DivideAttributes, PrepareModuleInput,
                                             RowwiseParallel, SequenceParallel,
                                             VocabShardedLogits, plans as tp_plans, tensor_parallel)
from fzero.transforms.ulysses import ulysses

# The plans live in the tensor_parallel package; their public path stays
# fzero.transforms.tp_plans, importable as a module too (as os.path is).
sys.modules[f"{__name__}.tp_plans"] = tp_plans


__all__ = ["Handler", "LeafSums", "MicroBatch", "NotApplied", "Step", "StepContext", "as_step", "bind", "context",
           "emit_metric", "installed", "psum", "running",
           "accumulate", "check_finite", "clip", "NonFiniteGradientError", "mixed_precision", "offload_optimizer",
           "pipeline", "shard_state", "tensor_parallel", "torch_autocast", "ulysses", "ColwiseParallel",
           "DivideAttributes", "PrepareModuleInput", "RowwiseParallel", "SequenceParallel", "VocabShardedLogits",
           "BatchMismatchError", "tp_plans"]
