"""Collectives with names: a failure or a timeout says which collective, on which rank.

The data collectives (:func:`all_reduce`, :func:`all_gather_flat`,
:func:`reduce_scatter_flat`) are counted in :data:`traffic`, so a test or a benchmark can
say how many bytes a step handed to each kind of collective.
"""

from __future__ import annotations

import collections
import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["CollectiveError", "Pending", "Traffic", "all_gather_flat", "all_reduce", "reduce_scatter_flat", "run",
           "start", "traffic"]

# torch 2.13 renamed the flat-tensor collectives (the old names warn); older torch (2.11 on
# the GPU machines) has only the old ones. Same arguments either way.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Traffic:
    """Bytes this rank handed to collectives, by kind and by what they carried.

    A count is the payload this rank contributes, ``numel * itemsize`` of the flat tensor
    given to the collective: the padded group buffer of a gradient all-reduce or
    reduce-scatter, the owned slice of an all-gather. It is not the bytes on the wire,
    which the algorithm multiplies (a ring all-reduce sends ``2 (N - 1) / N`` of it), so
    counts compare across settings of one world size.

    Example:
        >>> import torch
        >>> t = Traffic()
        >>> t.add("all_reduce", "gradients", torch.zeros(10))
        >>> t.bytes("all_reduce", "gradients"), t.bytes("all_gather")
        (40, 0)
    """

    def __init__(self) -> None:
        self._bytes: collections.Counter = collections.Counter()

    def add(self, kind: str, what: str, tensor: torch.Tensor) -> None:
        self._bytes[(kind, what)] += tensor.numel() * tensor.element_size()

    def bytes(self, kind: str | None = None, what: str | None = None) -> int:
        """Bytes of collectives of ``kind`` carrying ``what`` (``None``: any) since the last reset."""
        return sum(n for (k, w), n in self._bytes.items() if kind in (None, k) and what in (None, w))

    def reset(self) -> None:
        self._bytes.clear()

    def __repr__(self) -> str:
        return f"Traffic({dict(self._bytes)})"


#: This process's (so this rank's) count of every collective made through this module.
traffic = Traffic()


def all_reduce(tensor: torch.Tensor, *, group=None, async_op: bool = False, what: str = "other",
               op=dist.ReduceOp.SUM):
    """``dist.all_reduce`` of ``tensor`` in place (a sum unless ``op`` says otherwise),
    counted in :data:`traffic`."""
    traffic.add("all_reduce", what, tensor)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, *, src: int, group=None, async_op: bool = False, what: str = "other"):
    """``dist.broadcast`` of global rank ``src``'s ``tensor`` in place, counted in :data:`traffic`."""
    traffic.add("broadcast", what, tensor)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather_flat(output: torch.Tensor, input: torch.Tensor, *, group=None, async_op: bool = False,  # noqa: A002
                    what: str = "other"):
    """Every rank's ``input`` concatenated into ``output`` (counted: ``input``'s bytes)."""
    traffic.add("all_gather", what, input)
    return _all_gather_flat(output, input, group=group, async_op=async_op)


def reduce_scatter_flat(output: torch.Tensor, input: torch.Tensor, *, group=None, async_op: bool = False,  # noqa: A002
                        what: str = "other"):
    """This rank's slice of the sum of every rank's ``input`` (counted: ``input``'s bytes)."""
    traffic.add("reduce_scatter", what, input)
    return _reduce_scatter_flat(output, input, group=group, async_op=async_op)


class CollectiveError(RuntimeError):
    """A collective failed or did not complete in time; the message names it and the rank."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def run(name: str, fn: Callable[[], object], *, timeout_s: float, where: str = "fzero"):
    """Run a collective to completion within ``timeout_s``.

    ``fn`` starts it with ``async_op=True`` and returns the work; a failure or a timeout is
    a :class:`CollectiveError` naming ``name`` and this rank.
    """
    return start(name, fn, where=where).wait(timeout_s)


class Pending:
    """An asynchronous collective and what to do with its result."""

    __slots__ = ("name", "work", "done", "where")

    def __init__(self, name: str, work, done: Callable[[], object] | None, where: str):
        self.name, self.work, self.done, self.where = name, work, done, where

    def wait(self, timeout_s: float):
        try:
            if self.work is not None:
                self.work.wait(datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # noqa: BLE001
            raise CollectiveError(
                f"{self.where}: collective {self.name} did not complete on rank {_rank()} "
                f"within {timeout_s:g} s (a rank may have died or taken another path): {e}"
            ) from e
        return self.done() if self.done is not None else None


def start(name: str, fn: Callable[[], object], done: Callable[[], object] | None = None, *,
          where: str = "fzero") -> Pending:
    """Start an asynchronous collective (``fn`` passes ``async_op=True``).

    Under a device check (``$FZERO_CHECK_DEVICE``, or ``device_check.pretend()`` in tests)
    every tensor ``fn`` hands to torch's collectives is checked first: see
    :mod:`fzero.distributed.device_check`.
    """
    from fzero.distributed import device_check

    try:
        with device_check.guard(name, where):
            work = fn()
    except device_check.DeviceMismatchError:
        raise  # it names the collective and the rank already
    except Exception as e:  # noqa: BLE001
        raise CollectiveError(f"{where}: collective {name} failed to start on rank {_rank()}: {e}") from e
    return Pending(name, work, done, where)


def all_gather_ints(name: str, values: list[int], group=None, *, timeout_s: float, where: str = "fzero",
                    device: torch.device | str | None = None):
    """Every rank's ``values`` (equal length everywhere), as a ``(world, len)`` int64 CPU tensor.

    ``device`` is where the collective's tensors are made: the group's device
    (``mesh.device``; an NCCL group moves CUDA tensors only). The result is copied back to
    the host, where callers read it.
    """
    x = torch.tensor(values, dtype=torch.int64, device=device)
    n = dist.get_world_size(group)
    out = torch.empty(n * len(values), dtype=torch.int64, device=device)
    run(name, lambda: all_gather_flat(out, x, group=group, async_op=True, what="metadata"),
        timeout_s=timeout_s, where=where)
    return out.view(n, len(values)).cpu()
