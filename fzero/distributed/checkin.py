"""Check-ins in the rendezvous store: which rank did not arrive, and agreement before data moves.

A collective that times out says only that it did not complete: the rank that waits cannot
tell a dead or stopped peer from one that went another way, and a stopped (SIGSTOP) or
hung rank never says anything, so torchrun blames the rank that waited. PyTorch's answers
are the flight recorder and ``monitored_barrier``; fzero's is a check-in in the store the
process group was made with (a few bytes per rank per second, no collective):

* :func:`start` runs a daemon thread per process that writes, every :data:`BEAT_S`, this
  rank's time and the collective it is waiting in (``fzero/checkin/RANK``);
* :func:`absent` reads every rank's check-in when a wait fails and names the ranks that did
  not arrive: those whose process is gone or stopped (asked of the OS, for ranks on this
  host), those not heard from for :data:`SILENT_S` (stopped, hung outside Python, or dead),
  and those alive but elsewhere (in another collective, or in their own code).
  :class:`~fzero.distributed.comm.CollectiveError` and the watchdog's report carry it.

:func:`agree` is an all-gather of small JSON values through the store, with a timeout and
no sized collective: ranks compare the structure of what they are about to exchange (the
parameters' names and shapes, the ZeRO stage) before any collective whose sizes follow
from it, where a mismatch would end in gloo's "Received data size doesn't match expected
size" abort or in a misleading difference of values.
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import json
import os
import socket
import threading
import time
from typing import Any

import torch.distributed as dist

__all__ = ["BEAT_S", "SILENT_S", "absent", "agree", "start", "waiting_in"]

#: How often a rank checks in.
BEAT_S = 1.0
#: A rank not heard from for this long is reported as silent (stopped, hung or dead).
SILENT_S = 2.5 * BEAT_S

_PREFIX = "fzero/checkin/"
_STATE: dict[str, Any] = {"thread": None, "stop": None, "store": None, "rank": 0, "world": 1, "group": None}
_WAITING = threading.local()
_IN: dict[int, str] = {}  # thread id -> the collective it waits in
_AGREE_SEQ: dict[str, Any] = {}  # scope -> count of agreements made in it


def _store():
    """The default process group's store (``None`` when there is none)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001  (a group made without a store)
        return None


_HOST = socket.gethostname()


def _record() -> bytes:
    waiting = sorted(set(_IN.values()))
    return json.dumps({"t": time.time(), "in": waiting, "host": _HOST, "pid": os.getpid()}).encode()


def _process_state(rec: dict) -> str | None:
    """What the OS says of a rank's process on this host: ``"gone"``, ``"stopped"`` or
    ``None`` (running, or on another host, or not known)."""
    if rec.get("host") != _HOST or not isinstance(rec.get("pid"), int):
        return None
    state = proc_state(f"/proc/{rec['pid']}/stat")
    if state is None:
        return "gone" if os.path.isdir("/proc") else None
    return {"T": "stopped", "t": "stopped", "Z": "gone", "X": "gone"}.get(state)


def proc_state(stat: str) -> str | None:
    """The state letter of a process or thread from its ``/proc/.../stat`` file (the field
    after the parenthesised name, which may itself hold ``)``), ``None`` when unreadable."""
    try:
        with open(stat) as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _beat(stop: threading.Event, store, rank: int) -> None:
    while not stop.is_set():
        try:
            store.set(f"{_PREFIX}{rank}", _record())
        except Exception:  # noqa: BLE001  (the store went away: the job is ending)
            return
        stop.wait(BEAT_S)


def start() -> None:
    """Start this process's check-ins in the default process group's store (once per group)."""
    store = _store()
    if store is None or dist.get_world_size() == 1:
        return
    group = dist.group.WORLD
    if _STATE["thread"] is not None and _STATE["group"] is group and _STATE["thread"].is_alive():
        return
    stop_checkins()
    stop = threading.Event()
    rank = dist.get_rank()
    store.set(f"{_PREFIX}{rank}", _record())  # checked in before the first collective
    thread = threading.Thread(target=_beat, args=(stop, store, rank), name="fzero-checkin", daemon=True)
    _STATE.update(thread=thread, stop=stop, store=store, rank=rank, world=dist.get_world_size(), group=group)
    thread.start()


def stop_checkins() -> None:
    """Stop the check-in thread (at exit, before the process group goes)."""
    stop, thread = _STATE["stop"], _STATE["thread"]
    if stop is not None:
        stop.set()
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=2 * BEAT_S)
    _STATE.update(thread=None, stop=None)


class waiting_in:  # noqa: N801  (used as a context manager, like a function)
    """``with waiting_in(name):`` marks this thread as waiting in the collective ``name``
    (what other ranks' :func:`absent` reports about this one)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __enter__(self) -> None:
        _IN[threading.get_ident()] = self.name

    def __exit__(self, *exc) -> None:
        _IN.pop(threading.get_ident(), None)


def absent(name: str, *, silent_only: bool = False) -> str:
    """Which ranks did not arrive at the collective ``name``, from their check-ins.

    Returns a sentence for an error message ("" when there is no store or no finding):
    the ranks whose process is gone or stopped, and those not heard from for
    :data:`SILENT_S` or more, with how long; unless ``silent_only`` (where waits are not
    recorded: the device path), also the ranks heard from but not waiting in ``name``, with
    where they are instead.
    """
    store = _STATE["store"] or _store()
    if store is None:
        return ""
    world, me = _STATE["world"], _STATE["rank"]
    now = time.time()
    silent, elsewhere = [], []
    for r in range(world):
        if r == me:
            continue
        try:
            if not store.check([f"{_PREFIX}{r}"]):
                silent.append(f"rank {r} (never checked in)")
                continue
            rec = json.loads(store.get(f"{_PREFIX}{r}").decode())
        except Exception:  # noqa: BLE001  (the store itself is gone)
            return ""
        age = now - rec["t"]
        state = _process_state(rec)
        if state is not None:
            silent.append(f"rank {r} (its process {rec['pid']} is {state})")
        elif age >= SILENT_S:
            silent.append(f"rank {r} (not heard from for {age:.1f} s)")
        elif not silent_only and name not in rec["in"]:
            where = f"waiting in {', '.join(rec['in'])}" if rec["in"] else "not in a collective"
            elsewhere.append(f"rank {r} ({where})")
    parts = []
    if silent:
        parts.append(f"{', '.join(silent)} did not arrive")
    if elsewhere:
        parts.append(f"{', '.join(elsewhere)} did not arrive: alive, elsewhere in the program")
    return "; ".join(parts)


def agree(name: str, value: Any, *, timeout_s: float, where: str, group=None) -> list[Any]:
    """Every rank's JSON-serialisable ``value``, in the order of ``group``'s ranks (default:
    every rank), through the store.

    Every rank of ``group`` must call it, with the same ``name``, in the same order. No
    sized collective runs, so ranks that disagree on sizes learn it here. In a world of one
    (or without a process group) it returns ``[value]``.

    Raises:
        TimeoutError: some rank did not arrive within ``timeout_s``; names those ranks.
    """
    store = _store()
    if store is None or dist.get_world_size(group) == 1:
        return [value]
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    scope = f"{name}/{','.join(map(str, ranks))}"
    base = f"fzero/agree/{scope}/{_AGREE_SEQ.setdefault(scope, itertools.count()).__next__()}/"
    me = dist.get_rank()
    store.set(f"{base}{me}", json.dumps(value, separators=(",", ":")).encode())
    keys = [f"{base}{r}" for r in ranks]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001  (DistStoreError: a timeout)
        missing = [r for r, k in zip(ranks, keys) if not _has(store, k)]
        why = absent(name)
        raise TimeoutError(f"{where}: rank{'s' if len(missing) != 1 else ''} {', '.join(map(str, missing)) or '?'} "
                           f"did not reach {name} within {timeout_s:g} s (rank {me} waited"
                           f"{'; ' + why if why else ''}): {e}") from None
    return [json.loads(store.get(k).decode()) for k in keys]


def _has(store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:  # noqa: BLE001
        return False


atexit.register(stop_checkins)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _STATE.update(thread=None, stop=None, store=None, group=None))
