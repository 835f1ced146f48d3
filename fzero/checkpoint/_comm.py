"""The few collectives a save or a load needs, on a gloo group of the checkpoint's own.

A separate group (created once per process, on the first save or load, by every rank) lets
an asynchronous save talk to the other ranks from its background thread while training
runs collectives on the default group: collectives on one group must be issued in the
same order on every rank, which two threads sharing a group cannot promise. gloo also
keeps the checkpoint's small messages on the CPU when training uses NCCL (so they run inside
``device_check.on_host()``: host tensors on a host group, on purpose).

Messages are JSON bytes in uint8 tensors: no pickle (``broadcast_object_list`` pickles).
"""

from __future__ import annotations

import json
import threading
from typing import Any

import torch
import torch.distributed as dist

from fzero.distributed import comm, device_check
from fzero.distributed.mesh import DEFAULT_TIMEOUT_S

__all__ = ["World", "world"]

_LOCK = threading.Lock()
_GROUPS: list[tuple[Any, Any]] = []  # (default group object, its checkpoint group)


class World:
    """This process's place in the checkpoint's world: ``size``, ``rank``, and ``group``
    (``None`` for a world of one)."""

    def __init__(self, size: int, rank: int, group, timeout_s: float, where: str):
        self.size, self.rank, self.group, self.timeout_s, self.where = size, rank, group, timeout_s, where

    def _run(self, name: str, fn, *tensors: torch.Tensor) -> None:
        with device_check.on_host():
            comm.run(name, fn, timeout_s=self.timeout_s, where=self.where, hold=tensors)

    def all_gather_json(self, name: str, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (JSON-serialisable), in rank order."""
        data = json.dumps(obj, separators=(",", ":")).encode()
        if self.group is None:
            return [json.loads(data)]
        n = torch.tensor([len(data)], dtype=torch.int64)
        lengths = [torch.empty(1, dtype=torch.int64) for _ in range(self.size)]
        self._run(f"all_gather({name} lengths)", lambda: dist.all_gather(lengths, n, group=self.group, async_op=True),
                  n, *lengths)
        sizes = [int(x) for x in lengths]
        width = max(sizes)
        send = torch.zeros(width, dtype=torch.uint8)
        if data:
            send[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        recv = [torch.empty(width, dtype=torch.uint8) for _ in range(self.size)]
        self._run(f"all_gather({name})", lambda: dist.all_gather(recv, send, group=self.group, async_op=True),
                  send, *recv)
        return [json.loads(t.numpy().tobytes()[:k]) for t, k in zip(recv, sizes)]

    def broadcast_json(self, name: str, obj: Any = None, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank."""
        if self.group is None:
            return obj
        data = json.dumps(obj, separators=(",", ":")).encode() if self.rank == src else b""
        n = torch.tensor([len(data)], dtype=torch.int64)
        self._run(f"broadcast({name} length)", lambda: dist.broadcast(n, src, group=self.group, async_op=True), n)
        buf = torch.zeros(int(n), dtype=torch.uint8)
        if self.rank == src and data:
            buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._run(f"broadcast({name})", lambda: dist.broadcast(buf, src, group=self.group, async_op=True), buf)
        return json.loads(buf.numpy().tobytes())


def world(where: str, timeout_s: float | None = None, *, path: str | None = None) -> World:
    """The checkpoint world of this process: every rank of the default process group.

    With ``path`` (the checkpoint's), the ranks first check that they all passed the same
    one; ``where`` then names it in every message.

    Raises:
        CollectiveError: a rank did not arrive in time (named, with the checkpoint).
        ValueError: the ranks passed different paths (every rank's is named).
    """
    timeout = DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s)
    public = where
    if path is not None:
        where = f"{where}({path!r})"
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return World(1, 0, None, timeout, where)
    default = dist.group.WORLD
    with _LOCK:
        group = next((g for d, g in _GROUPS if d is default), None)
        if group is None:
            # Every rank reaches its first save/load at the same point of the program, so
            # every rank creates this group in the same order relative to other groups.
            group = comm.new_gloo_group("the checkpoint's process group (dist.new_group, on every rank's first "
                                        "save or load)", timeout_s=timeout, where=where)
            _GROUPS[:] = [(d, g) for d, g in _GROUPS if dist.is_initialized()] + [(default, group)]
    out = World(dist.get_world_size(), dist.get_rank(), group, timeout, where)
    if path is not None:
        paths = out.all_gather_json("checkpoint path", path)
        if len(set(paths)) > 1:
            by_path: dict[str, list[int]] = {}
            for r, p in enumerate(paths):
                by_path.setdefault(p, []).append(r)
            said = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {p!r}"
                             for p, rs in by_path.items())
            raise ValueError(f"{public}: the ranks passed different checkpoint paths ({said}); every "
                             "rank must pass the same path, which all of them write to or read from")
    return out
