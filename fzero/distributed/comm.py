"""Collectives with names: a failure or a timeout says which collective, on which rank."""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = ["CollectiveError", "Pending", "all_gather_flat", "reduce_scatter_flat", "run", "start"]

# torch 2.13 renamed the flat-tensor collectives (the old names warn); older torch (2.11 on
# the GPU machines) has only the old ones. Same arguments either way.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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
    run(name, lambda: all_gather_flat(out, x, group=group, async_op=True),
        timeout_s=timeout_s, where=where)
    return out.view(n, len(values)).cpu()
