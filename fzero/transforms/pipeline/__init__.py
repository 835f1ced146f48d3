"""``pipeline``: GPipe, 1F1B and interleaved 1F1B pipeline parallelism over the mesh's ``pp`` axis.

The user gives *stages* -- pure functions ``stage(params, x) -> y``, each owning some keys of
the params dict (or :func:`split` of an ``nn.Sequential``) -- and a loss on the last stage.
``fzero.pipeline`` returns a :class:`Pipeline`, a ``value_and_grad``-shaped function::

    loss, grads = pipe(params, x, y)

Rank ``s`` on the ``pp`` axis runs stage ``s`` on each of ``m`` micro-batches in the order
the schedule gives (GPipe: all forwards, then all backwards; 1F1B: at most ``p - s``
micro-batches in flight; interleaved: ``v`` model stages per rank, ``s, s + p, ...``, for a
bubble ``v`` times smaller), sends activations forward and their gradients backward with real
point-to-point sends (shapes agreed once, then cached), and accumulates this stage's
parameter gradients. The loss is computed on the last stage and broadcast to every stage.

How it composes (see docs/pipeline.md): the whole schedule runs inside *one* call of the
``value_and_grad`` primitive, whose differentiated function returns the loss through a
small autograd function that hands the accumulated gradients to whatever asked for them.
So every handler of the primitive sees one ordinary call per step: ``mixed_precision``
casts and scales (the schedule seeds its backward with the loss scale), ``shard_state``
gathers (stage 3) and reduces each stage's gradients over ``dp`` once per step -- not once
per micro-batch -- and ``accumulate`` runs whole pipelined steps. ``pipe.transform(step)``
keeps only this stage's parameters in the state (so each ``dp`` group shards one stage's
parameters) and turns 0-dim ``psum`` reductions (a global norm, fp16's overflow flag) into
all-reduces over ``pp`` as well.

The code, one job per module: ``_stages`` (:class:`Stage`, :func:`split`, which parameters
a stage owns), ``_schedule`` (the op orders and their unit-slot timeline, pure functions), ``_handshake`` (the shapes
agreed once), ``_runtime`` (:class:`Pipeline`: the schedule run inside one
``value_and_grad`` call, and :func:`pipeline`), ``_deliver`` (the gradients it accumulated
handed to ``value_and_grad`` through the autograd engine), ``_tied`` (tied weights' gradients summed
over their stages), ``_memory`` (what ``measure_memory=True`` counts).
"""

from fzero.transforms.pipeline._runtime import Pipeline, pipeline
from fzero.transforms.pipeline._schedule import schedule
from fzero.transforms.pipeline._stages import Stage, StageError, split

__all__ = ["Pipeline", "Stage", "StageError", "pipeline", "schedule", "split"]

# ``fzero.pipeline.split(...)``, ``fzero.pipeline.Stage(...)``: the helpers ride on the function.
pipeline.Stage = Stage
pipeline.StageError = StageError
pipeline.Pipeline = Pipeline
pipeline.split = split
pipeline.schedule = schedule
