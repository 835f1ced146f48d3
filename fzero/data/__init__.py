"""``fzero.data``: a distributed, deterministic, resumable data loader (DeepSpeed's ``training_data``).

* :class:`DataLoader` -- ``torch.utils.data.DataLoader`` over any map-style dataset, each
  data-parallel rank its slice of one global batch per step, shuffled by seed and epoch,
  with a position (``state_dict``/``load_state_dict``) that a checkpoint carries.
* :class:`GlobalBatchSampler` -- the batch sampler underneath, for torch's own loader.

See docs/data.md.
"""

from fzero.data._loader import DataLoader
from fzero.data._sampler import GlobalBatchSampler

__all__ = ["DataLoader", "GlobalBatchSampler"]
