"""How a state's leaves are named and classified for a checkpoint.

A leaf is a plain tensor (replicated: every rank holds the same), a :class:`Shard` (this
rank's piece of a partitioned leaf), or a Python scalar (``int``, ``float``, ``bool``,
``str``). Shards are leaves here, not nodes: the key path of a partitioned leaf is the same
at every ZeRO stage and world size (``.opt_state[0].mu['w']``), which is what lets a
checkpoint saved at one layout load into another.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from fzero import tree
from fzero.distributed.flat import Shard, is_shard

__all__ = ["flatten", "keystr", "json_entries", "piece_name", "is_value", "stages_of"]

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
