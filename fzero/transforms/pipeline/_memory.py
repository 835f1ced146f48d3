"""``measure_memory=True``: the bytes autograd saves for backward on this stage, counted by
saved-tensor hooks around each forward -- what a schedule keeps of its micro-batches'
activations (GPipe all ``m``, 1F1B at most ``p - s`` on stage ``s``)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch


class _Box:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


class _SavedBytes:
    """Counts bytes of distinct storages autograd saved for backward, live now and at the
    peak: what a schedule keeps of its micro-batches' activations (``exclude``: storages
    held anyway, the parameters and the batch)."""

    def __init__(self, exclude: Sequence[torch.Tensor]):
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.live: dict[int, list[int]] = {}
        self.now = self.peak = 0

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr == 0 or ptr in self.exclude:
            return t
        entry = self.live.get(ptr)
        if entry is None:
            nbytes = t.untyped_storage().nbytes()
            self.live[ptr] = [1, nbytes]
            self.now += nbytes
            self.peak = max(self.peak, self.now)
        else:
            entry[0] += 1
        box = _Box(t)
        weakref.finalize(box, self._release, ptr)
        return box

    def _release(self, ptr):
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.live[ptr]

    @staticmethod
    def unpack(x):
        return x.t if isinstance(x, _Box) else x
