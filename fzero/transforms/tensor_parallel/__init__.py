"""``tensor_parallel``: Megatron-style tensor parallelism over the mesh's ``tp`` axis.

A *plan* maps module names (globs, as ``fnmatch`` reads them) to a style, named as
``torch.distributed.tensor.parallel`` names them:

* :class:`ColwiseParallel` -- an ``nn.Linear`` whose output features are split over the
  ``tp`` ranks (rows of ``weight``, and ``bias``). Its input is whole on every rank; its
  output is this rank's slice of the features. Megatron's *f* stands in front: identity
  forward, all-reduce of the input's gradient backward (each rank's slice contributes to it).
  ``ColwiseParallel(output="vocab")`` on a language-model head: the output is a
  :class:`VocabShardedLogits`, this rank's slice of the vocabulary standing for the whole
  logits, on which the user's ``F.cross_entropy`` is computed across the ranks (Megatron's
  vocab-parallel cross-entropy: three all-reduces of ``tokens`` elements) -- the logits are
  never gathered, and what would need them whole is refused by name.
* :class:`RowwiseParallel` -- an ``nn.Linear`` whose input features are split (columns of
  ``weight``; ``bias`` whole). Its input is the slice a column-parallel layer produced; the
  partial products are summed by Megatron's *g* -- all-reduce forward, identity backward --
  and the bias is added once, after the sum. On an ``nn.Embedding`` (as torch's
  ``RowwiseParallel``): the vocabulary (``weight`` rows) is split, each rank looks up the ids
  it holds (zeros for the others) and *g* sums them.

A column-parallel layer followed by a row-parallel one (an MLP, attention's QKV and output
projection with the heads split) costs one all-reduce of the activation forward and one
backward: column-parallel layers that one module's forward calls on one tensor (separate q,
k and v; Llama's gate and up) share one *f*, as Megatron's fused layers do. Every other
tensor stays whole and identical on every ``tp`` rank, and so do its gradients (the
all-reduces make every activation outside the pairs identical), so the update needs no
further communication.

This is the narrow thing rather than DTensor: the state holds each rank's slice as a plain
tensor, so ``shard_state`` partitions it over ``dp`` and the optimizer runs on it unchanged,
and the model's code runs unchanged (the planned modules' forwards are replaced while the
step runs, a few lines each, and put back when it returns: ``_rewrite.py``) with no per-op
dispatch on the step's path. Every step first checks that the ``tp`` peers were handed the
same batch (``_batch.py``).

Reductions across parameters (``psum``: global-norm clipping, LAMB's trust ratios, the
overflow check of ``mixed_precision``) are exact: they name each leaf's parameter
(:class:`fzero.transforms.LeafSums`), and the handler counts a whole leaf on ``tp`` rank 0
only and sums over ``tp`` -- a split leaf's slices add up, a whole one is counted once.
``init`` records the split in the state (:class:`TensorParallelLayout`, in
``state.tensor_parallel`` and as the ``layout`` of ``state.params``), so
``fzero.checkpoint`` saves, reshards and exports it, and ``fzero.gather`` /
``fzero.load_into`` give the whole model back.

With ``sequence_parallel=True`` (``_sequence.py``), Megatron's sequence parallelism: the
activations between the split pairs are this rank's shard of the sequence, the pairs'
all-reduces become an all-gather into the column-parallel layer and a reduce-scatter out of the
row-parallel one, and the norms and dropouts run on the shards (:class:`SequenceParallel`),
their weights' gradients summed over ``tp``; :class:`PrepareModuleInput` says where the
shards begin and end.

Plans for the models people train (Hugging Face Llama and GPT-2, the example GPT) are in
``plans.py``, public as ``fzero.transforms.tp_plans``.
"""

from fzero.transforms.tensor_parallel._batch import BatchMismatchError
from fzero.transforms.tensor_parallel._sequence import PrepareModuleInput, SequenceParallel
from fzero.transforms.tensor_parallel._plan import TensorParallelLayout, _Split, auto_plan, check_plan, resolve_plan
from fzero.transforms.tensor_parallel._styles import (STYLES, WHERE, ColwiseParallel, DivideAttributes,
                                                      RowwiseParallel)
from fzero.transforms.tensor_parallel._transform import tensor_parallel
from fzero.transforms.tensor_parallel._vocab import VocabShardedLogits

__all__ = ["BatchMismatchError", "ColwiseParallel", "DivideAttributes", "PrepareModuleInput", "RowwiseParallel",
           "SequenceParallel", "TensorParallelLayout",
           "VocabShardedLogits", "auto_plan", "tensor_parallel"]
