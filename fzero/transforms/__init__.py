"""Transforms: functions from a train step to a train step with the same signature.

Each one installs a handler of fzero's primitives (see :mod:`fzero.transforms._core`)
around the inner step. What a transform of one's own needs is exported here: ``Handler``,
``Step``, ``as_step``, ``installed``; the primitives ``psum`` (with ``LeafSums``), ``emit_metric``,
``micro_batch`` (with ``MicroBatch``) and ``donating``; and ``bind`` to run a primitive through the
handlers.
"""

from fzero.transforms._core import (Handler, LeafSums, MicroBatch, NotApplied, Step, as_step, bind, donating,
                                    emit_metric, installed, micro_batch, psum)
from fzero.transforms.accumulate import accumulate
from fzero.transforms.finite import NonFiniteGradientError, check_finite
from fzero.transforms.mixed_precision import mixed_precision
from fzero.transforms.pipeline import pipeline
from fzero.transforms.shard_state import shard_state
from fzero.transforms.tensor_parallel import (BatchMismatchError, ColwiseParallel, DivideAttributes, RowwiseParallel,
                                             VocabShardedLogits, tensor_parallel)


__all__ = ["Handler", "LeafSums", "MicroBatch", "NotApplied", "Step", "as_step", "bind", "emit_metric", "installed", "micro_batch", "psum", "donating",
           "accumulate", "check_finite", "NonFiniteGradientError", "mixed_precision", "pipeline", "shard_state", "tensor_parallel", "ColwiseParallel",
           "DivideAttributes", "RowwiseParallel", "VocabShardedLogits", "BatchMismatchError"]
