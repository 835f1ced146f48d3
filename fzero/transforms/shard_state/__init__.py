"""``shard_state``: ZeRO stages 0-3 over the mesh's ``dp`` axis, and everything of it.

As FSDP2's ``_fully_shard/`` holds everything of ``fully_shard``:

* ``_transform.py``: the handler (partitioning at ``init``, the primitives on the
  partitioned state) and the transform :func:`shard_state`;
* ``_layout.py``: the flat groups (FSDP1's layout) and where each parameter sits;
* ``_shard.py``: :class:`Shard`, this rank's piece of a partitioned leaf, which stands for
  the whole tensor inside the user's step;
* ``_reduce.py``: the reduce sink that reduces gradient groups while backward runs, and
  its buffer pool;
* ``_units.py``: ZeRO-3's units and their lifecycle (FSDP2's ``FSDPParamGroup``);
* ``_collectives.py``: the parameter all-gathers and the buffer sync, as plain functions
  (FSDP2's ``_fsdp_collectives.py``);
* ``_checks.py``: the check at ``init`` that every rank holds the same model;
* ``_evaluate.py``: :func:`evaluating`, the module run outside a step with a partitioned
  state's weights, the ZeRO-3 units gathered one at a time.
"""

from fzero.transforms.shard_state._evaluate import evaluating, units_of
from fzero.transforms.shard_state._shard import Shard, ShardInfo, is_shard
from fzero.transforms.shard_state._transform import release_parameters, shard_state

__all__ = ["Shard", "ShardInfo", "evaluating", "is_shard", "release_parameters", "shard_state", "units_of"]
