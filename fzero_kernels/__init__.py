"""fzero_kernels: fused optimizer and norm kernels (Triton) over flat fp32 shards.

ZeRO gives each rank one flat contiguous shard per dtype, so a single launch updates a
rank's whole partition. Each family lives in one module -- the ``@triton.jit`` kernel,
a launcher that checks its inputs, and a pure-torch ``*_reference`` with the same
signature:

- :mod:`fzero_kernels.adamw`: ``adamw_``, ``adam_``
- :mod:`fzero_kernels.adamw_multi`: ``adamw_multi_``, ``adam_multi_`` (many tensors, one launch)
- :mod:`fzero_kernels.lamb`: ``lamb_`` = ``lamb_partial_norms`` + ``lamb_apply_``
- :mod:`fzero_kernels.lion`: ``lion_``
- :mod:`fzero_kernels.sgd`: ``sgd_``
- :mod:`fzero_kernels.norm`: ``l2_norm``, ``sum_of_squares``, ``segment_sum_of_squares``,
  ``unscale_and_check_``, ``nonfinite_check``

The Triton kernel runs for CUDA tensors, and for CPU tensors while ``TRITON_INTERPRET=1``
(Triton's interpreter); otherwise, or with ``FZERO_KERNELS_BACKEND=reference`` /
:func:`force_backend`, the reference runs. Importing this package never imports triton
(``HAS_TRITON`` says whether it is installed); the first kernel launch does.
This package imports nothing from ``fzero``.
"""
from fzero_kernels._common import HAS_TRITON, backend_for, force_backend
from fzero_kernels.adamw import adam_, adam_reference, adamw_, adamw_reference
from fzero_kernels.adamw_multi import adam_multi_, adam_multi_reference, adamw_multi_, adamw_multi_reference
from fzero_kernels.lamb import (
    LambNorms,
    lamb_,
    lamb_apply_,
    lamb_apply_reference,
    lamb_partial_norms,
    lamb_partial_norms_reference,
    lamb_reference,
)
from fzero_kernels.lion import lion_, lion_reference
from fzero_kernels.norm import (
    l2_norm,
    l2_norm_reference,
    nonfinite_check,
    nonfinite_check_reference,
    segment_sum_of_squares,
    segment_sum_of_squares_reference,
    sum_of_squares,
    sum_of_squares_reference,
    unscale_and_check_,
    unscale_and_check_reference,
)
from fzero_kernels.sgd import sgd_, sgd_reference

__all__ = [
    "HAS_TRITON",
    "backend_for",
    "force_backend",
    "adamw_",
    "adamw_reference",
    "adam_",
    "adam_reference",
    "adamw_multi_",
    "adamw_multi_reference",
    "adam_multi_",
    "adam_multi_reference",
    "LambNorms",
    "lamb_",
    "lamb_reference",
    "lamb_partial_norms",
    "lamb_partial_norms_reference",
    "lamb_apply_",
    "lamb_apply_reference",
    "lion_",
    "lion_reference",
    "sgd_",
    "sgd_reference",
    "l2_norm",
    "l2_norm_reference",
    "sum_of_squares",
    "sum_of_squares_reference",
    "segment_sum_of_squares",
    "segment_sum_of_squares_reference",
    "unscale_and_check_",
    "unscale_and_check_reference",
    "nonfinite_check",
    "nonfinite_check_reference",
]
