"""Transforms: functions from a train step to a train step with the same signature.

Each one installs a handler of fzero's primitives (see :mod:`fzero.transforms._core`)
around the inner step.
"""

from fzero.transforms._core import Handler, Step, as_step
from fzero.transforms.accumulate import accumulate
from fzero.transforms.mixed_precision import mixed_precision
from fzero.transforms.pipeline import pipeline
from fzero.transforms.shard_state import shard_state


__all__ = ["Handler", "Step", "as_step", "accumulate", "mixed_precision", "pipeline", "shard_state"]
