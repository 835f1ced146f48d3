"""Point-to-point sends with names and timeouts, between the ranks of one mesh axis.

A pipeline moves activations forward and their gradients backward between neighbouring
stages. Sends are asynchronous (``isend``; the tensor is kept alive until the send is
waited on), so the only blocking operation is a receive, and each receive waits at most
``timeout_s``: a peer that raised, died or took another path ends in a
:class:`~fzero.distributed.comm.CollectiveError` that names what was expected, from which
rank, instead of a hang. Receives and sends of device tensors follow
:meth:`fzero.distributed.comm.Pending.wait`'s rule: waited on without a timeout (the current
stream waits, the host goes on), and the watchdog (:mod:`fzero.distributed.watchdog`) ends
the process with a report naming what was expected if it is still outstanding after
``timeout_s``.

Ranks are given as positions on the axis (``0 .. size-1``); the global rank of a position is
looked up once.

Every send and receive is counted in :data:`fzero.distributed.comm.traffic` (kinds
``"send"`` and ``"recv"``, by what they carry): a send of ``S`` bytes sends ``S``, a
receive sends nothing.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from fzero.distributed import comm, device_check, watchdog
from fzero.distributed.comm import CollectiveError, traffic

__all__ = ["Channel"]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class _Send:
    __slots__ = ("work", "tensor", "name", "launched")

    def __init__(self, work, tensor, name, launched):
        self.work, self.tensor, self.name, self.launched = work, tensor, name, launched


class Channel:
    """Sends and receives between positions of one process group.

    Args:
        group: the process group of the axis (``mesh.group(axis)``).
        timeout_s: how long a receive (or the wait for a send) may take.
        where: the public function to name in errors (``"fzero.pipeline"``).

    Each call takes a ``name`` (what it moves, in words, for errors: ``"the activation of
    micro-batch 3"``) and ``what``, the label it is counted under in
    :data:`fzero.distributed.comm.traffic` (``"activations"``, ``"activation_gradients"``,
    ``"tied_gradients"``; default ``"other"``).
    """

    def __init__(self, group, *, timeout_s: float, where: str):
        self.group, self.timeout_s, self.where = group, float(timeout_s), where
        self.size = dist.get_world_size(group)
        self._global = [dist.get_global_rank(group, i) for i in range(self.size)]
        self._sends: list[_Send] = []

    def global_rank(self, position: int) -> int:
        return self._global[position]

    def isend(self, tensor: torch.Tensor, to: int, name: str, *, what: str = "other", tag: int = 0) -> None:
        """Start sending ``tensor`` to position ``to``; it is kept alive until :meth:`flush`.
        Counted as a ``"send"`` of ``what``: ``tensor``'s bytes."""
        tensor = tensor.contiguous()
        traffic.add("send", what, tensor, ranks=tuple(self._global))
        launched = time.monotonic()
        try:
            with device_check.guard(f"send of {name}", self.where):
                work = dist.isend(tensor, dst=self._global[to], group=self.group, tag=tag)
        except device_check.DeviceMismatchError:
            raise
        except Exception as e:  # noqa: BLE001
            raise CollectiveError(f"{self.where}: send of {name} to rank {self._global[to]} failed to start "
                                  f"on rank {_rank()}: {e}") from e
        self._sends.append(_Send(work, tensor, name, launched))
        # Drop the sends that are already done, so what they keep alive can go.
        if len(self._sends) > 8:
            self._sends = [s for s in self._sends if not s.work.is_completed()]

    def recv(self, buf: torch.Tensor, frm: int, name: str, *, what: str = "other", tag: int = 0) -> torch.Tensor:
        """Receive ``name`` from position ``frm`` into ``buf`` (waits at most ``timeout_s``).
        Counted as a ``"recv"`` of ``what``: ``buf``'s bytes, none sent."""
        src = self._global[frm]
        traffic.add("recv", what, buf)
        launched = time.monotonic()
        try:
            with device_check.guard(f"receive of {name}", self.where):
                work = dist.irecv(buf, src=src, group=self.group, tag=tag)
            if comm._watched(buf.device.type):
                watchdog.watch(f"receive of {name} from rank {src}", work, where=self.where,
                               timeout_s=self.timeout_s, since=launched)
                work.wait()
            else:
                work.wait(datetime.timedelta(seconds=self.timeout_s))
        except device_check.DeviceMismatchError:
            raise
        except Exception as e:  # noqa: BLE001
            raise CollectiveError(
                f"{self.where}: rank {_rank()} waited for {name} from rank {src} and got nothing within "
                f"{self.timeout_s:g} s (that rank may have raised, died or taken another path): {e}") from e
        return buf

    def flush(self) -> None:
        """Wait for every started send."""
        sends, self._sends = self._sends, []
        for s in sends:
            try:
                if comm._watched(s.tensor.device.type):
                    watchdog.watch(f"send of {s.name}", s.work, where=self.where, timeout_s=self.timeout_s,
                                   since=s.launched)
                    s.work.wait()
                else:
                    s.work.wait(datetime.timedelta(seconds=self.timeout_s))
            except Exception as e:  # noqa: BLE001
                raise CollectiveError(f"{self.where}: send of {s.name} from rank {_rank()} did not complete "
                                      f"within {self.timeout_s:g} s: {e}") from e
