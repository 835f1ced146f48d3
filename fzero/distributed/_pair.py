"""The collectives of a gloo group of two ranks, as one exchange of point-to-point messages.

Why: gloo's own reduce-scatter is slower than its all-reduce of the same tensor, and its
all-gather and small all-reduces pay bookkeeping a pair does not need
(``benchmarks/collectives.py``, docs/performance.md: on this project's 2-core machines gloo's
reduce-scatter of 3.5 MB took 6.4 ms, its all-reduce 4.7 ms, the exchange 3.2 ms). Between
two ranks each of these collectives is one exchange: every rank sends the other what the other lacks and receives what it lacks,
both directions at once, then (a reduction) adds what it received to what it kept.

* reduce-scatter of ``x`` (``2n`` elements): send the peer's half, receive the peer's
  contribution to ours into ``out``, then ``out += x[ours]``; sends ``n`` (the ring's ``S/2``).
* all-gather of ``x`` (``n``): send ``x``, receive the peer's half into ``out``, and copy
  ours into ``out`` while they move; sends ``n`` (the ring's ``S(N-1)``).
* all-reduce of a small ``x`` (a loss, a norm, a flag): send it whole, receive the peer's
  into a scratch tensor, then combine; sends ``S`` (the ring's ``2S(N-1)/N``). A large one
  stays gloo's, whose pipelined ring is faster there and needs no scratch
  (:data:`ALL_REDUCE_MAX_BYTES`).

Every rank gets the same bits: IEEE addition, minimum and maximum are commutative, so
``a + b`` on one rank equals ``b + a`` on the other. The bytes each rank sends equal the ring
algorithms' (so :data:`fzero.distributed.comm.traffic` counts them as those kinds).

The exchange is asynchronous as the collective it replaces: gloo moves the messages on its
own thread; the returned work's ``wait`` waits for both and then combines. Its messages carry
a tag of their own per group, counted alike on both ranks (collectives are issued in the same
order everywhere), so two exchanges in flight never take each other's message.

``FZERO_GLOO_PAIR=0`` turns this off (gloo's own collectives), for a side-by-side measurement.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from fzero.distributed._errors import CollectiveError

__all__ = ["ALL_REDUCE_MAX_BYTES", "ENV", "PairWork", "Peer", "all_gather", "all_reduce", "peer", "reduce_scatter"]

ENV = "FZERO_GLOO_PAIR"
#: An all-reduce of at most this many bytes is one exchange; a larger one is gloo's ring.
#: The exchange receives into a scratch tensor as large as the one reduced, so it is kept to
#: the step's small sums (losses, norms, flags), where it gains (``benchmarks/collectives.py``:
#: 0.77-0.81 of gloo's time at 16 B and 4 KiB); gradient buckets stay gloo's, whose pipelined
#: ring is no slower there and needs no scratch.
ALL_REDUCE_MAX_BYTES = 16 * 1024
# Tags of the exchanges' messages: a range of their own, above any a caller of ``isend`` picks.
_TAG_BASE = 1 << 24
_TAG_SPAN = 1 << 20
_OPS = (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN)

class Peer(NamedTuple):
    """The other rank of a pair: its global rank, and this rank's place in the group (0 or 1),
    which is the half of a flat buffer this rank owns."""

    rank: int
    me: int


_peers: dict[object, Peer | None] = {}  # group -> the other rank, or None: not a gloo pair
_tags: dict[object, int] = {}  # group -> exchanges started on it


def _key(group):
    return group if group is not None else dist.group.WORLD


def peer(group, tensor: torch.Tensor) -> Peer | None:
    """The other rank when a collective of ``tensor`` over ``group`` (``None``: the default
    group) is an exchange: a gloo group of two, a CPU tensor, and not turned off by
    :data:`ENV`; else ``None``."""
    if tensor.device.type != "cpu" or os.environ.get(ENV, "1") == "0":
        return None
    key = _key(group)
    if key not in _peers:
        found = None
        if dist.get_world_size(key) == 2 and dist.get_backend(key) == "gloo":
            ranks = dist.get_process_group_ranks(key)
            me = ranks.index(dist.get_rank())
            found = Peer(ranks[1 - me], me)
        _peers[key] = found
    return _peers[key]


def _tag(group) -> int:
    key = _key(group)
    n = _tags.get(key, 0)
    _tags[key] = n + 1
    return _TAG_BASE + n % _TAG_SPAN


class PairWork:
    """An exchange in flight: a send and a receive, and what to do once both are done.

    The interface of a ``torch.distributed`` work that fzero uses: ``wait`` (with an optional
    ``timedelta``, which bounds the whole exchange) and ``is_completed``.
    """

    __slots__ = ("works", "finish", "keep", "error")

    def __init__(self, works: list, finish: Callable[[], None] | None, keep: tuple = (),
                 error: Exception | None = None):
        self.works, self.finish, self.keep = works, finish, keep  # keep: tensors in flight
        self.error = error  # a send or receive that failed to start (a peer gone): raised by wait

    def is_completed(self) -> bool:
        return self.error is not None or all(w.is_completed() for w in self.works)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self.error is not None:
            raise self.error
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        for w in self.works:
            if deadline is None:
                w.wait()
            else:
                w.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        finish, self.finish, self.keep = self.finish, None, ()
        if finish is not None:
            finish()
        return True


def _exchange(send: torch.Tensor, recv: torch.Tensor, other: Peer, group, finish, keep=()) -> PairWork:
    tag = _tag(group)
    works = []
    try:
        works.append(dist.isend(send, dst=other.rank, group=group, tag=tag))
        works.append(dist.irecv(recv, src=other.rank, group=group, tag=tag))
    except CollectiveError:  # the device check's: raised where the collective starts
        raise
    except RuntimeError as e:  # a peer gone: fails on wait, as a collective that could not complete does
        return PairWork(works, None, error=e)
    return PairWork(works, finish, (send, recv) + tuple(keep))


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    sa, sb = a.data_ptr(), b.data_ptr()
    return sa < sb + b.numel() * b.element_size() and sb < sa + a.numel() * a.element_size()


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, other: Peer, *, group):  # noqa: A002
    """Start the exchange that leaves this rank's half of the sum of both ranks' ``input`` in
    ``output``; ``None`` when the tensors do not suit one (the caller uses gloo's collective)."""
    n = output.numel()
    if (input.numel() != 2 * n or not input.is_contiguous() or not output.is_contiguous()
            or input.dtype != output.dtype or _overlaps(output, input)):
        return None
    halves = input.view(2, n)
    mine = halves[other.me]
    return _exchange(halves[1 - other.me], output, other, group, lambda: output.add_(mine.view(output.shape)),
                     keep=(input,))


def all_gather(output: torch.Tensor, input: torch.Tensor, other: Peer, *, group):  # noqa: A002
    """Both ranks' ``input``, in group-rank order, into ``output``; ``None`` when the tensors do
    not suit an exchange."""
    n = input.numel()
    if (output.numel() != 2 * n or not input.is_contiguous() or not output.is_contiguous()
            or input.dtype != output.dtype):
        return None
    me = other.me
    halves = output.view(2, n)
    if _overlaps(halves[1 - me], input):
        return None
    # The exchange sends from ``input`` and receives into the other half: posted first, so
    # that it runs while this rank's half is copied in.
    work = _exchange(input, halves[1 - me], other, group, None)
    if halves[me].data_ptr() != input.data_ptr():
        halves[me].copy_(input.reshape(-1))
    return work


def all_reduce(tensor: torch.Tensor, other: Peer, *, group, op):
    """Both ranks' ``tensor`` combined by ``op`` (sum, max or min) in place; ``None`` when it is
    too large to gain from an exchange, not contiguous, or another reduction."""
    if (not any(op == o for o in _OPS) or not tensor.is_contiguous()
            or tensor.numel() * tensor.element_size() > ALL_REDUCE_MAX_BYTES):
        return None
    theirs = torch.empty_like(tensor)
    if op == dist.ReduceOp.SUM:
        def finish():
            tensor.add_(theirs)
    elif op == dist.ReduceOp.MAX:
        def finish():
            torch.maximum(tensor, theirs, out=tensor)
    else:
        def finish():
            torch.minimum(tensor, theirs, out=tensor)
    return _exchange(tensor, theirs, other, group, finish)
