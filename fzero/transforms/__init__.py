"""Transforms: functions from a train step to a train step with the same signature.

Each one installs a handler of fzero's primitives (see :mod:`fzero.transforms._core`)
around the inner step. Those whose issue has not landed raise ``NotImplementedError``
naming themselves, so a program written for them fails loudly instead of training wrong.
"""

from fzero.transforms._core import Handler, Step, as_step
from fzero.transforms.accumulate import accumulate
from fzero.transforms.mixed_precision import mixed_precision
from fzero.transforms.pipeline import pipeline
from fzero.transforms.shard_state import shard_state


def _not_yet(name: str, what: str):
    def transform(step, *args, **kwargs):
        raise NotImplementedError(f"fzero.{name}: {what} is not supported yet")

    transform.__name__ = name
    transform.__qualname__ = name
    transform.__doc__ = f"{what} (not supported yet: raises NotImplementedError)."
    return transform



__all__ = ["Handler", "Step", "as_step", "accumulate", "mixed_precision", "pipeline", "shard_state"]
