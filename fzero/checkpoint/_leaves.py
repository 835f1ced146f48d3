"""How a state's leaves are named and classified for a checkpoint.

A leaf is a plain tensor (replicated: every rank holds the same), a :class:`Shard` (this
rank's piece of a partitioned leaf), or a Python scalar (``int``, ``float``, ``bool``,
``str``). Shards are leaves here, not nodes: the key path of a partitioned leaf is the same
at every ZeRO stage and world size (``.opt_state[0].mu['w']``), which is what lets a
checkpoint saved at one layout load into another.

Under ``fzero.tensor_parallel`` a tensor (or a Shard's whole) may also be this rank's *tp
slice* of a larger tensor, ``whole.chunk(size, dim)[rank]``: the state's
:class:`~fzero.transforms.tensor_parallel.TensorParallelLayout` names the split parameters,
and every tensor stored under a split parameter's name (the last key of its path: the
parameter, its optimizer moments, its master) is split as the parameter is
(:func:`tp_slices`). The key path does not change with the split either.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import optree
import torch

from fzero import tree
from fzero.checkpoint._format import CheckpointError
from fzero.transforms.shard_state import Shard, is_shard
from fzero.transforms.tensor_parallel import TensorParallelLayout

__all__ = ["TPSlice", "flatten", "keystr", "json_entries", "layout_of", "piece_name", "is_value", "slice_problem",
           "slice_shape", "stages_of", "tp_slices"]

VALUE_TYPES = (bool, int, float, str)


def flatten(state: Any):
    """``(paths, leaves, spec)`` of ``state`` with :class:`Shard` as leaves."""
    return tree.flatten_with_path(state, is_leaf=is_shard)


def keystr(path) -> str:
    return tree.keystr(path) or "<root>"


def json_entries(path) -> list[list]:
    """A key path as JSON: ``[["attr", "params"], ["key", "w"]]``; ``index`` for sequences."""
    out = []
    for e in path:
        if isinstance(e, optree.SequenceEntry) and not isinstance(e, optree.NamedTupleEntry):
            out.append(["index", e.entry])
        elif isinstance(e, (optree.GetAttrEntry, optree.NamedTupleEntry)):
            name = e.entry if isinstance(e.entry, str) else e.codify("").lstrip(".")
            out.append(["attr", name])
        elif isinstance(e, optree.PyTreeEntry):
            k = e.entry
            out.append(["key", k if isinstance(k, (str, int)) and not isinstance(k, bool) else repr(k)])
        else:
            out.append(["key", e if isinstance(e, (str, int)) else repr(e)])
    return out


def piece_name(key: str, start: int, stop: int) -> str:
    """The tensor name of a piece in a data file."""
    return f"{key}[{start}:{stop}]"


def is_value(x: Any) -> bool:
    return isinstance(x, VALUE_TYPES)


def global_shape(x: Any) -> tuple[int, ...] | None:
    if isinstance(x, Shard):
        return tuple(x.info.shape)
    if isinstance(x, torch.Tensor):
        return tuple(x.shape)
    return None


def stages_of(records: list[dict]) -> list[int]:
    """The ZeRO stages a layout is consistent with, from its manifest records: ``[0]``
    (nothing partitioned), ``[1, 2]`` (optimizer state partitioned, parameters whole: the
    two stages keep the same state between steps) or ``[3]`` (parameters partitioned too)."""
    sharded = [r for r in records if r.get("sharding") is not None]
    if not sharded:
        return [0]
    if any(r["entries"][:1] in ([["attr", "params"]], [["key", "params"]]) for r in sharded):
        return [3]
    return [1, 2]


# --------------------------------------------------------------------------- tensor parallelism


class TPSlice(NamedTuple):
    """A leaf that is slice ``rank`` of a tensor split over ``tp``: ``whole.chunk(size, dim)[rank]``.

    On disk a split leaf is its ``size`` slices one after another, each flattened: elements
    ``[t * n, (t + 1) * n)`` of the leaf (``n`` = :attr:`local_numel`) are slice ``t``. So a
    ZeRO piece ``[a, b)`` of slice ``t`` is elements ``[t * n + a, t * n + b)``, and a leaf
    saved and loaded at the same ``size`` and ``dim`` reshards over ``dp`` by interval
    overlap, as an unsplit one does.
    """

    name: str  # the split parameter's
    dim: int
    size: int
    rank: int
    shape: tuple[int, ...]  # the whole tensor's
    # A fused projection split block by block (``ColwiseParallel(parts=p)``): ``(d, p)``, and
    # then ``shape`` and ``dim`` are those of the whole viewed with dim ``d`` as ``(p, block)``,
    # split on the block axis ``d + 1``: a plain split of that view, whose row-major order is
    # the tensor's own.
    fused: tuple[int, int] | None = None

    @property
    def local_shape(self) -> tuple[int, ...]:
        return slice_shape(self.shape, self.dim, self.size)

    @property
    def real_local_shape(self) -> tuple[int, ...]:
        """The slice's own shape (``local_shape`` with a fused view's two axes merged back)."""
        return unfuse(self.local_shape, self.fused)

    @property
    def real_shape(self) -> tuple[int, ...]:
        return unfuse(self.shape, self.fused)

    @property
    def local_numel(self) -> int:
        return math.prod(self.local_shape)


def unfuse(shape, fused) -> tuple[int, ...]:
    """``shape`` with a fused view's axes ``d`` and ``d + 1`` merged back (``fused = (d, p)``)."""
    shape = tuple(int(n) for n in shape)
    if not fused:
        return shape
    d = int(fused[0])
    return shape[:d] + (shape[d] * shape[d + 1],) + shape[d + 2:]


def whole_shape(rec: dict) -> tuple[int, ...]:
    """A saved tensor leaf's own shape (its record keeps a fused projection's view)."""
    return unfuse(rec["shape"], (rec.get("tp") or {}).get("fused"))


def slice_shape(shape, dim: int, size: int) -> tuple[int, ...]:
    """The shape of each of the ``size`` slices of a ``shape`` split on ``dim``."""
    return tuple(int(n) // size if d == dim else int(n) for d, n in enumerate(shape))


def layout_of(state: Any, where: str) -> TensorParallelLayout | None:
    """The state's tp layout (``init`` of ``fzero.tensor_parallel`` keeps it in
    ``state.tensor_parallel``), or ``None``: nothing is split. A layout of ``size`` 1 splits nothing.

    Raises:
        CheckpointError: the state holds two different layouts.
    """
    found = {x for x in tree.leaves(state, is_leaf=lambda x: isinstance(x, TensorParallelLayout))
             if isinstance(x, TensorParallelLayout)}
    if len(found) > 1:
        raise CheckpointError(f"{where}: the state holds {len(found)} different TensorParallelLayouts; a state "
                              f"is split over one tp axis")
    layout = next(iter(found), None)
    return layout if layout is not None and layout.size > 1 else None


def tp_slices(paths: list, leaves: list, layout: TensorParallelLayout | None) -> list[TPSlice | None]:
    """Per leaf, the tp slice it is, or ``None`` (whole on every ``tp`` rank): a tensor or
    Shard whose last key is the name of a parameter ``layout`` splits. Shapes are not
    checked here (see :func:`slice_problem`)."""
    if layout is None:
        return [None] * len(leaves)
    splits = dict(layout.splits)
    out: list[TPSlice | None] = []
    for path, x in zip(paths, leaves):
        last = json_entries(path[-1:])[0] if path else None
        split = splits.get(last[1]) if last and last[0] == "key" and isinstance(last[1], str) else None
        if split is None or global_shape(x) is None:
            out.append(None)
        elif split.parts > 1:
            d, p, shape = split.dim, split.parts, tuple(split.shape)
            view = shape[:d] + (p, shape[d] // p) + shape[d + 1:]
            out.append(TPSlice(last[1], d + 1, layout.size, layout.rank, view, (d, p)))
        else:
            out.append(TPSlice(last[1], split.dim, layout.size, layout.rank, tuple(split.shape)))
    return out


def slice_problem(key: str, x: Any, sl: TPSlice) -> str | None:
    """What is wrong with ``x`` as the tp slice ``sl``, or ``None``."""
    name = sl.name
    if sl.shape[sl.dim] % sl.size:
        return (f"parameter {name!r} of shape {sl.shape}: dim {sl.dim} ({sl.shape[sl.dim]}) does not divide by "
                f"tp={sl.size}")
    if global_shape(x) != sl.real_local_shape:
        return (f"leaf {key} is stored under the split parameter {name!r} (shape {sl.shape}, dim {sl.dim} split "
                f"over tp={sl.size}: slices of {sl.local_shape}) but has shape {global_shape(x)}: a tensor stored "
                f"under a split parameter's name must be its slice")
    return None
