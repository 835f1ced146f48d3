"""Test support: hypothesis strategies, ``assert_trees_close``, one tolerance table, and the
plain steps transforms are held to.

fzero's own tests use these, and so can users who property-test their own steps:

    >>> from hypothesis import given, settings
    >>> import fzero.testing as ft
    >>> @settings(max_examples=5, deadline=None)
    ... @given(ft.pytrees())
    ... def test_roundtrip(t):
    ...     leaves, spec = fzero.tree.flatten(t)
    ...     ft.assert_trees_close(fzero.tree.unflatten(spec, leaves), t)
    >>> import fzero; test_roundtrip()

The modules:

- :mod:`fzero.testing.strategies`: ``seeds``, ``shapes``, ``dtypes``, ``tensors``,
  ``pytrees``, ``models`` (with :class:`ModelCase`);
- :mod:`fzero.testing.asserts`: ``assert_trees_close``;
- :mod:`fzero.testing.tolerances`: ``TOLERANCES``, the one table of ``(rtol, atol, why)``
  keyed by what is compared, and ``tolerance(what)``;
- :mod:`fzero.testing.steps`: ``mse_step`` (the plain step tests hold transforms to),
  ``token_mean_step`` (a language model's token-mean step),
  ``run_steps``, ``torch_mse_steps`` (plain PyTorch's run of ``mse_step``'s training),
  ``torch_rank_grads`` (plain PyTorch's per-rank gradients of a global batch), ``local_batch``, ``Blocks`` (an MLP with ZeRO-3 units),
  ``shard_handler`` (the ``shard_state`` handler inside a compiled step);
- :mod:`fzero.testing.handlers`: ``RecordPsum``, ``AddOtherShard``, ``halves`` (a two-shard
  ``psum`` in one process);
- :mod:`fzero.testing.memory`: ``storage_bytes`` (distinct storages, views once);
- :mod:`fzero.testing.fuzz`: strategies for bad input (DeepSpeed configs, batches,
  checkpoint manifests) and the checks each drawn case is held to (``tests/test_fuzz.py``,
  ``benchmarks/fuzz.py``).

The harness that runs fzero's own tests on real gloo ranks is test support and stays with
the tests (``tests/harness/``), not in the installed package.
"""

from fzero.testing.asserts import assert_trees_close
from fzero.testing.handlers import AddOtherShard, RecordPsum, halves
from fzero.testing.memory import storage_bytes
from fzero.testing.steps import (Blocks, local_batch, mse_step, run_steps, shard_handler, token_mean_step,
                                 torch_mse_steps, torch_rank_grads)
from fzero.testing.strategies import FLOAT_DTYPES, ModelCase, dtypes, models, pytrees, seeds, shapes, tensors
from fzero.testing.tolerances import TOLERANCES, Tolerance, tolerance

__all__ = [
    "AddOtherShard",
    "Blocks",
    "FLOAT_DTYPES",
    "TOLERANCES",
    "ModelCase",
    "RecordPsum",
    "Tolerance",
    "assert_trees_close",
    "dtypes",
    "halves",
    "local_batch",
    "models",
    "mse_step",
    "pytrees",
    "run_steps",
    "token_mean_step",
    "torch_mse_steps",
    "torch_rank_grads",
    "seeds",
    "shapes",
    "shard_handler",
    "storage_bytes",
    "tensors",
    "tolerance",
]
