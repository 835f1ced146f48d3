"""``GlobalBatchSampler``: one global batch per step, each data-parallel rank its slice.

The order is a function of ``(seed, epoch)`` alone -- ``torch.randperm`` under a
``torch.Generator`` seeded with ``seed + epoch``, as ``DistributedSampler.set_epoch``
seeds it -- and the world size only decides which slice of each global batch a rank
takes. So the ranks' local batches, concatenated in rank order, are the batch one process
with the same global batch size gets, at any world size, and a position (epoch, batches
handed out) means the same samples at any world size.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

__all__ = ["GlobalBatchSampler"]

WHERE = "fzero.data.GlobalBatchSampler"


def check_int(where: str, name: str, value, minimum: int) -> int:
    """``value`` as an int >= ``minimum``, or a ``TypeError``/``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{where}: {name} must be >= {minimum}, got {value}")
    return value


class GlobalBatchSampler(Sampler[list[int]]):
    """A batch sampler for ``torch.utils.data.DataLoader``: the sample indices of this data-parallel
    rank's slice of each global batch.

    Epoch ``e``'s order is ``torch.randperm(dataset_length, generator=g)`` with
    ``g = torch.Generator().manual_seed(seed + e)`` (``torch.arange`` when ``shuffle`` is
    False). Global batch ``b`` is ``order[b*B:(b+1)*B]`` for the global batch size ``B``;
    rank ``r`` of ``dp_size`` takes its contiguous slice ``[r*L:(r+1)*L]`` of it,
    ``L = B // dp_size``. Iterating yields the batches of epoch :attr:`epoch` from
    :attr:`start` on; the batches before ``start`` are never computed into indices, let
    alone loaded.

    Args:
        dataset_length: number of samples (``len(dataset)``).
        global_batch_size: samples per step over all data-parallel ranks.
        dp_size, dp_rank: the data-parallel world size and this rank's place in it.
        seed: the shuffle seed (any int, as ``torch.Generator.manual_seed`` takes).
        shuffle: reshuffle every epoch (``False``: the dataset's own order every epoch).
        drop_last: drop the last global batch when it is short. ``False`` keeps it (every
            rank gets ``remainder // dp_size`` samples), which needs the remainder to split
            evenly over the ranks.

    Raises:
        TypeError, ValueError: a size that is not a positive int, a global batch that does
            not split over ``dp_size`` ranks, ``dp_rank`` outside ``[0, dp_size)``, an epoch
            with no batch, or a short last batch that does not split (``drop_last=False``);
            each names the values.

    Example:
        >>> from fzero.data import GlobalBatchSampler
        >>> [list(GlobalBatchSampler(8, 4, dp_size=2, dp_rank=r, shuffle=False)) for r in (0, 1)]
        [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]
    """

    def __init__(self, dataset_length: int, global_batch_size: int, *, dp_size: int = 1, dp_rank: int = 0,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = True):
        n = check_int(WHERE, "dataset_length", dataset_length, 0)
        b = check_int(WHERE, "global_batch_size", global_batch_size, 1)
        dp = check_int(WHERE, "dp_size", dp_size, 1)
        r = check_int(WHERE, "dp_rank", dp_rank, 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"{WHERE}: seed must be an int, got {type(seed).__name__} {seed!r}")
        for name, v in (("shuffle", shuffle), ("drop_last", drop_last)):
            if not isinstance(v, bool):
                raise TypeError(f"{WHERE}: {name} must be a bool, got {type(v).__name__} {v!r}")
        if r >= dp:
            raise ValueError(f"{WHERE}: dp_rank={r} is outside a data-parallel world of dp_size={dp} ranks")
        if b % dp:
            raise ValueError(f"{WHERE}: global_batch_size={b} does not split evenly over dp_size={dp} "
                             f"data-parallel ranks ({b} % {dp} = {b % dp})")
        full, rest = divmod(n, b)
        if not drop_last and rest % dp:
            raise ValueError(
                f"{WHERE}: with drop_last=False the last global batch has dataset_length % global_batch_size "
                f"= {n} % {b} = {rest} samples, which does not split evenly over dp_size={dp} ranks; "
                f"use drop_last=True, or a dataset length whose remainder divides by {dp}")
        batches = full + (1 if rest and not drop_last else 0)
        if batches == 0:
            raise ValueError(f"{WHERE}: an epoch has no batch: dataset_length={n} < global_batch_size={b}"
                             + (" with drop_last=True" if drop_last and n else ""))
        self.dataset_length, self.global_batch_size = n, b
        self.dp_size, self.dp_rank = dp, r
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.batches_per_epoch = batches
        self.epoch = 0
        self.start = 0

    def order(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s order of all sample indices (int64), the same on every rank."""
        if not self.shuffle:
            return torch.arange(self.dataset_length)
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.dataset_length, generator=g)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Iterate epoch ``epoch`` from its global batch ``start`` on (``DistributedSampler``'s
        ``set_epoch``, with a place to start).

        Raises:
            TypeError, ValueError: ``epoch`` < 0, or ``start`` outside ``[0, batches_per_epoch]``.
        """
        self.epoch = check_int(WHERE + ".set_epoch", "epoch", epoch, 0)
        self.start = check_int(WHERE + ".set_epoch", "start", start, 0)
        if start > self.batches_per_epoch:
            raise ValueError(f"{WHERE}.set_epoch: start={start} is past the epoch's "
                             f"{self.batches_per_epoch} global batches")

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order(self.epoch)
        b, n = self.global_batch_size, self.dataset_length
        for i in range(self.start, self.batches_per_epoch):
            batch = order[i * b:min((i + 1) * b, n)]
            local = len(batch) // self.dp_size
            yield batch[self.dp_rank * local:(self.dp_rank + 1) * local].tolist()

    def __len__(self) -> int:
        """The number of batches :meth:`__iter__` yields: the epoch's, from :attr:`start` on."""
        return self.batches_per_epoch - self.start
