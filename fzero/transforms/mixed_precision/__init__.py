"""``mixed_precision``: low-precision compute with fp32 master weights, and everything of it.

* ``_transform.py``: the handler (autocast, the loss scale on the way down, the overflow
  verdict and the masters' update on the way up) and the transform :func:`mixed_precision`;
* ``_scaler.py``: DeepSpeed's dynamic loss scaler, its state :class:`LossScaler` and one
  update of it;
* ``_autocast.py``: :func:`torch_autocast`, the forward under ``torch.autocast`` with fp32
  weights (DeepSpeed's ``torch_autocast`` section);
* ``_lowp.py``: bf16 masters and optimizer state, stochastic rounding, Kahan compensation;
* ``_norm.py``: :class:`NormWeight`, the alias through which a norm computes with a 16-bit
  weight in fp32, as under ``torch.autocast``.
"""

from fzero.transforms.mixed_precision._autocast import torch_autocast
from fzero.transforms.mixed_precision._norm import NormWeight
from fzero.transforms.mixed_precision._scaler import LossScaler
from fzero.transforms.mixed_precision._transform import mixed_precision

__all__ = ["LossScaler", "NormWeight", "mixed_precision", "torch_autocast"]
