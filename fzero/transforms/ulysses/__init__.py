"""``ulysses``: DeepSpeed-Ulysses sequence parallelism over the mesh's ``sp`` axis.

Each ``sp`` rank holds a slice of every sequence of its local batch; every layer but
attention is per token and runs on the slice as it is. Attention needs whole sequences, so
``q``, ``k`` and ``v`` are exchanged by all-to-all for a slice of the heads, attention runs
on whole sequences for those heads, and an all-to-all of its output brings back this rank's
slice of the sequence for every head (``_attention.py``). The user's model does not change:
``F.scaled_dot_product_attention`` is replaced while the step runs, and the model is given
the global positions of its slice (``_transform.py``). Gradients and the loss are averaged
over ``dp`` x ``sp`` by ``shard_state``, whose group spans both, so ZeRO partitions over
both, as DeepSpeed does.
"""

from fzero.transforms.ulysses._attention import UlyssesAttention
from fzero.transforms.ulysses._transform import ulysses

__all__ = ["UlyssesAttention", "ulysses"]
