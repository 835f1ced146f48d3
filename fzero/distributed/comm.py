"""Collectives with names: a failure or a timeout says which collective, on which rank.

The data collectives (:func:`all_reduce`, :func:`broadcast`, :func:`all_gather_flat`,
:func:`reduce_scatter_flat`) and the pipeline's point-to-point sends and receives
(:class:`fzero.distributed.p2p.Channel`) are counted in :data:`traffic`, so a test, a
benchmark or a step's metrics (``fzero.compile(comm_bytes=True)``) can say how many bytes
a step handed to each kind of collective, and how many it sent on the wire.

Waiting: a collective of CPU tensors (gloo) is waited on with its timeout, and one that does
not complete raises a :class:`CollectiveError` naming it and the rank. A collective of
device tensors (CUDA: NCCL) is waited on without a timeout, because on NCCL a timed wait
blocks the host thread until the collective completes, while an untimed one only makes the
current stream wait and the host goes on launching the kernels the collective overlaps; the
per-process watchdog (:mod:`fzero.distributed.watchdog`) then reports a hang by name and
ends the process. Which path a collective takes is read from the tensors the helpers below
hand to torch.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import contextvars
import datetime
import threading
import time
from collections.abc import Callable, Iterator
from fractions import Fraction

import torch
import torch.distributed as dist

from fzero.distributed import _pair, checkin, device_check, watchdog
from fzero.distributed._errors import CollectiveError

__all__ = ["COPY_KINDS", "KINDS", "CollectiveError", "Pending", "Traffic", "all_gather_flat", "all_reduce",
           "all_to_all_flat", "broadcast",
           "group_ranks",
           "copy_", "new_gloo_group", "reduce_scatter_flat", "run", "sent_bytes", "start", "traffic"]

# torch 2.13 renamed the flat-tensor collectives (the old names warn); older torch (2.11 on
# the GPU machines) has only the old ones. Same arguments either way.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

#: The kinds of communication that send bytes, in the order :meth:`Traffic.comm_bytes` lists
#: them. A receive (kind ``"recv"``) is counted as payload but sends nothing.
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send")
#: The copies between a rank's device and its host (ZeRO-Offload's), counted as payload in
#: :data:`traffic` and listed by :meth:`Traffic.copy_bytes`; they send nothing on the wire.
COPY_KINDS = ("d2h", "h2d")


def sent_bytes(kind: str, payload: int, *, world: int) -> Fraction:
    """Bytes one rank sends on the wire when it hands ``payload`` bytes to a collective of
    ``kind`` over a group of ``world`` ranks, under the bandwidth-optimal ring algorithms.

    With ``S`` the payload and ``N`` the group size:

    =================  ===================  ==============================================
    kind               payload ``S``        bytes sent by each rank
    =================  ===================  ==============================================
    ``all_reduce``     the tensor           ``2 S (N - 1) / N`` (reduce-scatter, then
                                            all-gather, each ``N - 1`` chunks of ``S / N``)
    ``reduce_scatter`` the whole input      ``S (N - 1) / N``
    ``all_gather``     this rank's input    ``S (N - 1)`` (the output is ``N S``)
    ``all_to_all``     this rank's input    ``S (N - 1) / N``: ``N`` equal blocks, one per
                                            rank, the rank's own block staying here
    ``broadcast``      the tensor           ``S (N - 1) / N``: a pipelined ring, where the
                                            root and every rank but the last forward ``S``
                                            (``S (N - 1)`` in all), averaged over the ranks
    ``send``           the tensor           ``S`` (point to point)
    ``recv``           the buffer           0
    ``d2h``, ``h2d``   the tensor copied    0: a copy between this rank's device and its
                                            host (ZeRO-Offload, :func:`copy_`) crosses
                                            no network
    =================  ===================  ==============================================

    The result is exact (a :class:`fractions.Fraction`; whole whenever ``N`` divides
    ``S``, as it does for every flat ZeRO group, padded to a multiple of ``N``). A collective
    over a group of one sends nothing. This is the algorithms' bandwidth term, what NCCL's ring moves and
    what the ZeRO paper counts (2Ψ per step for data parallelism, 3Ψ at stage 3); a tree or
    a different chunking moves other bytes, and latency is not counted.

    Raises:
        ValueError: an unknown ``kind``, a negative ``payload`` or a ``world`` below 1.

    Example:
        >>> sent_bytes("all_reduce", 1000, world=4), sent_bytes("all_gather", 250, world=4)
        (Fraction(1500, 1), Fraction(750, 1))
        >>> sent_bytes("broadcast", 4, world=3), sent_bytes("send", 12, world=2), sent_bytes("all_reduce", 8, world=1)
        (Fraction(8, 3), Fraction(12, 1), Fraction(0, 1))
    """
    if payload < 0 or world < 1:
        raise ValueError(f"fzero.distributed.comm.sent_bytes: payload={payload!r} must be >= 0 and world={world!r} "
                         ">= 1")
    n = world
    if kind == "all_reduce":
        return Fraction(2 * payload * (n - 1), n)
    if kind in ("reduce_scatter", "broadcast", "all_to_all"):
        return Fraction(payload * (n - 1), n)
    if kind == "all_gather":
        return Fraction(payload * (n - 1))
    if kind == "send":
        return Fraction(payload)
    if kind in ("recv",) + COPY_KINDS:
        return Fraction(0)
    raise ValueError(f"fzero.distributed.comm.sent_bytes: unknown kind {kind!r}; expected one of "
                     f"{', '.join(KINDS + COPY_KINDS)} or recv")


class Traffic:
    """Bytes this rank handed to collectives and sent on the wire, by kind and by what
    they carried.

    Two measures of each call, both per rank:

    * :meth:`bytes`, the *payload*: ``numel * itemsize`` of the tensor this rank hands to
      the collective (the padded group buffer of a gradient all-reduce or reduce-scatter,
      the owned slice of an all-gather, the tensor sent or the buffer received). It
      compares across settings of one world size.
    * :meth:`sent`, the bytes this rank *sends on the wire* for it under the ring
      algorithms, by :func:`sent_bytes` of the payload and the size of the group passed
      (``dist.get_world_size(group)``); exact, a :class:`fractions.Fraction`.

    ``what`` says what a call carried: ``"gradients"``, ``"parameters"`` (ZeRO),
    ``"loss"``, ``"psum"``, ``"metadata"`` (batch sizes, shapes), ``"buffers"``,
    ``"gather"`` (:func:`fzero.gather`), ``"user"`` (a reduction over a partitioned
    tensor), ``"tp"``, ``"activations"``, ``"activation_gradients"``,
    ``"tied_gradients"`` (pipelines), ``"attention"`` (Ulysses' all-to-alls of attention's
    q, k, v and output, and of their gradients), ``"compressed"`` (the 1-bit optimizers' exchange of
    packed signs and scales), ``"offload"`` (the ``d2h``/``h2d`` copies of
    :func:`copy_`) or ``"other"``.

    Each call's wire bytes are also filed under the ranks of its group (``ranks=``), so
    :meth:`sent_by_axis` can say what crossed each mesh axis: the ``tp`` all-reduces apart
    from the ``dp`` gradient reductions and the ``pp`` sends.

    The counts only grow; a step's share is a difference (``traffic - before``, with
    ``before = traffic.copy()``), or :meth:`reset` clears them.

    Example:
        >>> import torch
        >>> t = Traffic()
        >>> t.add("all_reduce", "gradients", torch.zeros(10), world=4)
        >>> t.bytes("all_reduce", "gradients"), t.bytes("all_gather")
        (40, 0)
        >>> t.sent("all_reduce")                      # 2 * 40 * (4 - 1) / 4
        Fraction(60, 1)
        >>> before = t.copy()
        >>> t.add("send", "activations", torch.zeros(3, dtype=torch.bfloat16))
        >>> step = t - before
        >>> step.bytes(), step.comm_bytes()["send"], step.comm_bytes()["total"]
        (6, Fraction(6, 1), Fraction(6, 1))
        >>> t.add("all_reduce", "tp", torch.zeros(2), world=2, ranks=(0, 1))
        >>> t.sent_by_axis({"dp": (0, 2), "tp": (0, 1)})["tp"]
        Fraction(8, 1)
    """

    def __init__(self) -> None:
        self._bytes: collections.Counter = collections.Counter()
        self._sent: collections.Counter = collections.Counter()
        self._by_ranks: collections.Counter = collections.Counter()

    def add(self, kind: str, what: str, tensor: torch.Tensor, *, world: int = 1,
            ranks: tuple[int, ...] | None = None) -> None:
        """Count a call of ``kind`` carrying ``what``: ``tensor`` is this rank's payload,
        ``world`` the size of the group (1: a collective sends nothing; a send its payload),
        ``ranks`` the group's global ranks (``None``: not known)."""
        n = tensor.numel() * tensor.element_size()
        sent = sent_bytes(kind, n, world=world)
        self._bytes[(kind, what)] += n
        self._sent[(kind, what)] += sent
        if sent:
            self._by_ranks[None if ranks is None else tuple(sorted(ranks))] += sent

    def bytes(self, kind: str | None = None, what: str | None = None) -> int:
        """Bytes of collectives of ``kind`` carrying ``what`` (``None``: any) since the last reset."""
        return sum(n for (k, w), n in self._bytes.items() if kind in (None, k) and what in (None, w))

    def sent(self, kind: str | None = None, what: str | None = None) -> Fraction:
        """Bytes this rank sent on the wire in calls of ``kind`` carrying ``what`` (``None``:
        any) since the last reset (:func:`sent_bytes` of each call)."""
        return sum((n for (k, w), n in self._sent.items() if kind in (None, k) and what in (None, w)), Fraction(0))

    def comm_bytes(self) -> dict[str, Fraction]:
        """Bytes sent on the wire by kind, every kind of :data:`KINDS` present (0 if none),
        and their ``"total"``: what ``fzero.compile(comm_bytes=True)`` puts in a step's
        ``metrics["comm_bytes"]``."""
        out = {kind: self.sent(kind) for kind in KINDS}
        out["total"] = sum(out.values(), Fraction(0))
        return out

    def sent_by_axis(self, axes: dict[str, tuple[int, ...]]) -> dict[str, Fraction]:
        """Bytes this rank sent on the wire by mesh axis: ``axes`` maps each axis to the
        global ranks of this rank's group along it (:meth:`fzero.Mesh.ranks`); a call over
        a group that is none of them (the whole world of a mesh with two axes, a group not
        known) is ``"other"``. Every axis of ``axes`` is present (0 if nothing crossed it):
        what ``fzero.compile(comm_bytes=True)`` puts in ``metrics["comm_bytes_by_axis"]``."""
        by_group = {tuple(sorted(r)): a for a, r in axes.items() if len(r) > 1}
        out = {a: Fraction(0) for a in axes}
        out["other"] = Fraction(0)
        for ranks, n in self._by_ranks.items():
            out[by_group.get(ranks, "other")] += n
        return out

    def copy_bytes(self) -> dict[str, int]:
        """Bytes copied between the device and the host by kind (:data:`COPY_KINDS`, each
        present, 0 if none): what ``fzero.compile(comm_bytes=True)`` puts in an offloaded
        step's ``metrics["offload_bytes"]``."""
        return {kind: self.bytes(kind) for kind in COPY_KINDS}

    def copy(self) -> "Traffic":
        """An independent copy of the counts (to take a difference with later)."""
        out = Traffic()
        out._bytes.update(self._bytes)
        out._sent.update(self._sent)
        out._by_ranks.update(self._by_ranks)
        return out

    def __sub__(self, other: "Traffic") -> "Traffic":
        """The counts since ``other`` (an earlier :meth:`copy` of this one)."""
        out = Traffic()
        for mine, theirs, into in ((self._bytes, other._bytes, out._bytes), (self._sent, other._sent, out._sent),
                                   (self._by_ranks, other._by_ranks, out._by_ranks)):
            for key in mine.keys() | theirs.keys():
                if mine[key] != theirs[key]:
                    into[key] = mine[key] - theirs[key]
        return out

    def reset(self) -> None:
        self._bytes.clear()
        self._sent.clear()
        self._by_ranks.clear()

    def __repr__(self) -> str:
        return f"Traffic({dict(self._bytes)})"


#: This process's (so this rank's) count of every collective made through this module,
#: every send and receive of :class:`fzero.distributed.p2p.Channel` and every host/device
#: copy of :func:`copy_`.
traffic = Traffic()


def copy_(dst: torch.Tensor, src: torch.Tensor, *, kind: str, non_blocking: bool = False) -> torch.Tensor:
    """``dst.copy_(src)``, a copy between this rank's device and its host (``kind``
    ``"d2h"`` or ``"h2d"``), counted in :data:`traffic` as ``what="offload"`` (payload:
    ``src``'s bytes). Both must have one dtype, so the bytes counted are the bytes moved:
    cast on the side where the cast belongs first. The copy is synchronous (the host reads
    what it copied next, and a pinned buffer is refilled every step) unless
    ``non_blocking``: an h2d copy from page-locked memory that the device reads next, in
    stream order (ZeRO-3's gather of offloaded parameters).

    Raises:
        ValueError: an unknown ``kind``, or dtypes or sizes that differ.

    Example:
        >>> import torch
        >>> before = traffic.copy()
        >>> _ = copy_(torch.empty(3), torch.ones(3), kind="d2h")
        >>> (traffic - before).copy_bytes()
        {'d2h': 12, 'h2d': 0}
    """
    if kind not in COPY_KINDS:
        raise ValueError(f"fzero.distributed.comm.copy_: kind={kind!r} must be 'd2h' or 'h2d'")
    if dst.dtype != src.dtype or dst.numel() != src.numel():
        raise ValueError(f"fzero.distributed.comm.copy_: {kind} copy of {src.dtype}[{src.numel()}] into "
                         f"{dst.dtype}[{dst.numel()}]: dtypes and sizes must match")
    traffic.add(kind, "offload", src)
    with torch.no_grad():
        dst.copy_(src.view_as(dst), non_blocking=non_blocking)
    return dst


# The device type of the tensor the last helper below handed to torch on this thread, read
# by :func:`start` to choose how the collective is waited on. Per thread: the checkpoint's
# background thread starts collectives while training does.
_LAUNCH = threading.local()
# Depth of _watchdog_for_cpu() blocks: CPU collectives take the device path too (tests).
_WATCH_CPU = 0


# While a step is timed (``fzero.compile(timers=True)``): a context manager factory that
# :meth:`Pending.wait` runs inside, ``timer(what, device_type)``; ``what`` is the collective's
# ``what=`` (``"gradients"``, ``"parameters"``, ...). A context variable, so the checkpoint's
# background thread is never timed; ``None``, the default, costs one lookup per wait.
WAIT_TIMER: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("fzero_wait_timer", default=None)


def _launching(tensor: torch.Tensor, what: str = "other") -> None:
    _LAUNCH.device = tensor.device.type
    _LAUNCH.what = what


def _watched(device_type: str | None) -> bool:
    """Whether a collective on tensors of ``device_type`` is waited on without a timeout,
    under the watchdog: device tensors, and CPU ones inside :func:`_watchdog_for_cpu`.
    ``None`` (a collective started without these helpers) keeps the timed wait."""
    return device_type is not None and (device_type != "cpu" or _WATCH_CPU > 0)


@contextlib.contextmanager
def _watchdog_for_cpu() -> Iterator[None]:
    """Collectives of CPU tensors waited on in this block take the device path: an untimed
    wait under the watchdog, which ends the process on a hang. For tests on gloo, where
    NCCL's path cannot otherwise be seen."""
    global _WATCH_CPU
    _WATCH_CPU += 1
    try:
        yield
    finally:
        _WATCH_CPU -= 1


def group_ranks(group) -> tuple[int, ...]:
    """The global ranks of ``group`` (``None``: the default group), as :data:`traffic` files
    a call's bytes under them."""
    return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def all_reduce(tensor: torch.Tensor, *, group=None, async_op: bool = False, what: str = "other",
               op=dist.ReduceOp.SUM):
    """``dist.all_reduce`` of ``tensor`` in place (a sum unless ``op`` says otherwise),
    counted in :data:`traffic` (payload: ``tensor``'s bytes)."""
    traffic.add("all_reduce", what, tensor, world=dist.get_world_size(group), ranks=group_ranks(group))
    _launching(tensor, what)
    if (other := _pair.peer(group, tensor)) is not None:
        work = _pair.all_reduce(tensor, other, group=group, op=op)
        if work is not None:
            return _done(work, async_op)
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, *, src: int, group=None, async_op: bool = False, what: str = "other"):
    """``dist.broadcast`` of global rank ``src``'s ``tensor`` in place, counted in :data:`traffic`
    (payload: ``tensor``'s bytes, on every rank)."""
    traffic.add("broadcast", what, tensor, world=dist.get_world_size(group), ranks=group_ranks(group))
    _launching(tensor, what)
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def all_gather_flat(output: torch.Tensor, input: torch.Tensor, *, group=None, async_op: bool = False,  # noqa: A002
                    what: str = "other"):
    """Every rank's ``input`` concatenated into ``output`` (counted: ``input``'s bytes)."""
    traffic.add("all_gather", what, input, world=dist.get_world_size(group), ranks=group_ranks(group))
    _launching(input, what)
    if (other := _pair.peer(group, input)) is not None:
        work = _pair.all_gather(output, input, other, group=group)
        if work is not None:
            return _done(work, async_op)
    return _all_gather_flat(output, input, group=group, async_op=async_op)


def all_to_all_flat(output: torch.Tensor, input: torch.Tensor, output_splits: list[int] | None = None,  # noqa: A002
                    input_splits: list[int] | None = None, *, group=None, async_op: bool = False,
                    what: str = "other"):
    """This rank's ``input`` cut into blocks, block ``r`` to rank ``r``, whose block ``q`` of
    ``output`` it becomes (``q`` this rank). Without splits the blocks are ``N`` equal ones on
    the first dim, counted as ``"all_to_all"`` (``input``'s bytes); with ``input_splits[r]``
    elements to rank ``r`` and ``output_splits[r]`` from it, the elements that leave this rank
    are counted exactly, as a ``"send"``."""
    if input_splits is None:
        traffic.add("all_to_all", what, input, world=dist.get_world_size(group), ranks=group_ranks(group))
    else:
        me = dist.get_rank(group)
        traffic.add("send", what, input.new_empty(sum(input_splits) - input_splits[me]), world=2,
                    ranks=group_ranks(group))
    _launching(input, what)
    return dist.all_to_all_single(output, input, output_splits, input_splits, group=group, async_op=async_op)


def reduce_scatter_flat(output: torch.Tensor, input: torch.Tensor, *, group=None, async_op: bool = False,  # noqa: A002
                        what: str = "other"):
    """This rank's slice of the sum of every rank's ``input`` (counted: ``input``'s bytes)."""
    traffic.add("reduce_scatter", what, input, world=dist.get_world_size(group), ranks=group_ranks(group))
    _launching(input, what)
    if (other := _pair.peer(group, input)) is not None:
        work = _pair.reduce_scatter(output, input, other, group=group)
        if work is not None:
            return _done(work, async_op)
    return _reduce_scatter_flat(output, input, group=group, async_op=async_op)


def _done(work, async_op: bool):
    """An exchange of a gloo pair (:mod:`fzero.distributed._pair`) returned as a collective
    is: its work when asynchronous, else completed."""
    if async_op:
        return work
    work.wait()
    return None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def run(name: str, fn: Callable[[], object], *, timeout_s: float, where: str = "fzero",
        hold: tuple[torch.Tensor, ...] = ()):
    """Run a collective to completion within ``timeout_s``.

    ``fn`` starts it with ``async_op=True`` and returns the work; a failure or a timeout is
    a :class:`CollectiveError` naming ``name`` and this rank (on a device, a hang is the
    watchdog's: see :meth:`Pending.wait`). ``hold``: the collective's tensors, when the
    caller lets them go right after (:func:`hold_until_released`).
    """
    out = start(name, fn, where=where).wait(timeout_s)
    hold_until_released(*hold)
    return out


# Small tensors of completed collectives that their caller let go of at once (a checkpoint's
# metadata exchanges: a few bytes each, so holding the last 64 costs nothing). Gloo's worker thread
# drops its reference to a completed work (and to the work's tensors) a moment after the
# wait returns; if it holds the last reference to a tensor Python has let go of, it must take
# the GIL to free the tensor's Python object, and during the interpreter's finalization
# (a program that ends right after a collective: a checkpoint's last commit) that ends the
# thread inside a C++ destructor: std::terminate, "terminate called without an active
# exception", SIGABRT. These are held here, the most recent ones, and at exit the worker is
# given a moment to let go of them while Python can still free them (:func:`_release_held`).
_HELD: collections.deque = collections.deque(maxlen=64)
_HELD_LOCK = threading.Lock()
HOLD_AT_EXIT_S = 1.0


def hold_until_released(*tensors: torch.Tensor) -> None:
    """Keep ``tensors`` (those of a completed collective) alive until the interpreter exits,
    where :func:`_release_held` waits for the backend to let go of them first."""
    if tensors:
        with _HELD_LOCK:
            _HELD.extend(t for t in tensors if isinstance(t, torch.Tensor))


def _release_held(timeout_s: float = HOLD_AT_EXIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    with _HELD_LOCK:
        held = list(_HELD)
        _HELD.clear()
    for t in held:  # 1: only this list's reference is left
        while t._use_count() > 1 and time.monotonic() < deadline:
            time.sleep(0.001)


class Pending:
    """An asynchronous collective and what to do with its result.

    ``device`` is the device type of the tensors it moves (``None``: not known), ``what``
    the data it moves (the helpers' ``what=``), and ``launched`` when it started
    (``time.monotonic()``).
    """

    __slots__ = ("name", "work", "done", "where", "device", "what", "launched")

    def __init__(self, name: str, work, done: Callable[[], object] | None, where: str, *,
                 device: str | None = None, what: str = "other", launched: float | None = None):
        self.name, self.work, self.done, self.where = name, work, done, where
        self.device, self.what = device, what
        self.launched = time.monotonic() if launched is None else launched

    def wait(self, timeout_s: float):
        """Complete the collective and return ``done()``'s result.

        On the CPU this blocks until the collective completes, at most ``timeout_s``. On a
        device it returns once the current stream is made to wait for the collective (the
        host goes on), and the watchdog (:mod:`fzero.distributed.watchdog`) ends the process
        with a report naming it if it is still outstanding ``timeout_s`` after its launch.

        Raises:
            CollectiveError: the collective failed, or (on the CPU) did not complete in time.
        """
        timer = WAIT_TIMER.get()
        if timer is not None and self.work is not None:
            with timer(self.what, self.device):
                return self._wait(timeout_s)
        return self._wait(timeout_s)

    def _wait(self, timeout_s: float):
        if self.work is not None:
            if _watched(self.device):
                watchdog.watch(f"collective {self.name}", self.work, where=self.where, timeout_s=timeout_s,
                               since=self.launched)
                try:
                    self.work.wait()
                except Exception as e:  # noqa: BLE001
                    raise CollectiveError(f"{self.where}: collective {self.name} failed on rank {_rank()}: {e}") from e
            else:
                waited = time.monotonic()
                try:
                    with checkin.waiting_in(self.name):
                        self.work.wait(datetime.timedelta(seconds=timeout_s))
                except Exception as e:  # noqa: BLE001
                    why = checkin.absent(self.name) or "a rank may have died or taken another path"
                    waited = time.monotonic() - waited
                    # A peer's closed connection fails the wait at once: not a timeout.
                    how = (f"did not complete on rank {_rank()} within {timeout_s:g} s" if waited >= 0.9 * timeout_s
                           else f"failed on rank {_rank()} after {waited:.1f} s")
                    raise CollectiveError(f"{self.where}: collective {self.name} {how} ({why}): {e}") from e
        return self.done() if self.done is not None else None


def start(name: str, fn: Callable[[], object], done: Callable[[], object] | None = None, *,
          where: str = "fzero") -> Pending:
    """Start an asynchronous collective (``fn`` passes ``async_op=True``).

    ``fn`` starts it through this module's helpers (:func:`all_reduce`, ...), which say what
    device its tensors are on, and so how it is waited on (:meth:`Pending.wait`).

    Under a device check (``$FZERO_CHECK_DEVICE``, or ``device_check.pretend()`` in tests)
    every tensor ``fn`` hands to torch's collectives is checked first: see
    :mod:`fzero.distributed.device_check`.
    """
    _LAUNCH.device, _LAUNCH.what = None, "other"
    launched = time.monotonic()
    try:
        with device_check.guard(name, where):
            work = fn()
    except device_check.DeviceMismatchError:
        raise  # it names the collective and the rank already
    except Exception as e:  # noqa: BLE001
        raise CollectiveError(f"{where}: collective {name} failed to start on rank {_rank()}: {e}") from e
    return Pending(name, work, done, where, device=_LAUNCH.device, what=_LAUNCH.what, launched=launched)


def new_gloo_group(what: str, *, timeout_s: float, where: str):
    """A gloo group of every rank of the default group (``dist.new_group``), for host data
    beside the mesh's groups: the checkpoint's messages, the preemption flag. Every rank must
    call it at the same point of its program. ``what`` says which group and when it is made,
    for the error.

    Raises:
        CollectiveError: a rank did not come within ``timeout_s`` (at least 1 s), named from
            the check-ins where they say.
    """
    timeout = max(timeout_s, 1.0)
    try:
        return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
    except Exception as e:  # noqa: BLE001  (DistStoreError: a rank did not come)
        why = checkin.absent("new_group") or "a rank may have died or taken another path"
        raise CollectiveError(f"{where}: creating {what} did not complete on rank {_rank()} within {timeout:g} s "
                              f"({why}): {e}") from e


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


atexit.register(_release_held)
