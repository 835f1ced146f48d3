"""``Mesh``: named axes over the ranks torchrun started.

Naming rule (torchtitan's): an *axis* is a mesh axis (``dp``, ``sp``, ``tp``, ``pp``); a *dim*
is a tensor dimension.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import threading
import time
from typing import Literal

import torch
import torch.distributed as dist

from fzero.distributed import checkin, device_check

__all__ = ["Mesh", "AXES"]

# Outermost first: pipeline stages are furthest apart, tensor parallel ranks closest
# (they exchange the most), as torchtitan orders its mesh. Ulysses' sequence-parallel ranks
# sit between dp and tp: they exchange activations in every layer (all-to-alls), and they
# are data-parallel peers for the gradients, so dp x sp is one contiguous block of ranks
# (DeepSpeed's "sequence data parallel" group).
AXES = ("pp", "dp", "sp", "tp")
Axis = Literal["pp", "dp", "sp", "tp"]

#: The axes whose ranks hold different data and so reduce gradients together (ZeRO's group).
DATA_AXES = ("dp", "sp")

DEFAULT_TIMEOUT_S = float(os.environ.get("FZERO_TIMEOUT", "300"))
# NCCL's own watchdog aborts a process whose collective is outstanding past the group's
# timeout, naming an op type and a sequence number; fzero's (fzero.distributed.watchdog)
# counts the same time from the same launch and names the collective. An NCCL group made
# here gets this much longer, so fzero's report comes first and NCCL's abort is the backstop.
NCCL_BACKSTOP_S = 30.0

# DeviceMeshes by (device type, shape): building one creates process groups (a collective),
# so meshes of one shape in one process share it.
_DEVICE_MESHES: dict = {}
# Groups of several adjacent axes by (DeviceMesh, axes): Mesh.group(("dp", "sp")).
_FLAT_GROUPS: dict = {}


def _chosen_device(device: str | torch.device, group_device: torch.device, world: int) -> torch.device:
    """``Mesh(device=)`` as a device: ``"cuda"`` on this rank's GPU; in a world of several
    ranks it must be the process group's device (``group_device``)."""
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"fzero.Mesh: device={device!r} is not a device ({e})") from None
    if chosen.type == "cuda" and chosen.index is None:
        chosen = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if world > 1 and (chosen.type != group_device.type
                      or (chosen.type != "cpu" and chosen.index != group_device.index)):
        raise ValueError(f"fzero.Mesh: device={str(device)!r} on rank {dist.get_rank()} of {world}, whose "
                         f"process group moves tensors on {group_device} "
                         f"(backend {dist.get_backend()!r}); leave device unset or name {group_device}")
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"fzero.Mesh: device={str(device)!r}, but this process sees no CUDA device")
    return group_device if chosen == group_device else chosen  # the very object (device_check's mark)


def _launched() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


class Mesh:
    """Named axes over a ``torch.distributed`` world.

    ``Mesh(dp=-1)`` spans every rank torchrun (or ``fzero launch``) started; in a process
    that was not launched it is a world of one and no process group is created. If a
    process group is needed and none exists, it is initialised from torchrun's
    environment: NCCL when CUDA is available, gloo otherwise.

    ``mesh.device`` is the device of this rank's collectives: ``cuda:LOCAL_RANK`` on an
    NCCL group, the CPU on a gloo group (and in a world of one). NCCL moves CUDA tensors
    only, so every tensor fzero hands to the mesh's groups is made there, and
    ``step.init`` puts the state there (:meth:`place`); see docs/design.md, "Devices".
    A world of one keeps the state where the program made it, unless ``device=`` names a
    device: a model built on the host then trains there (with ``offload_optimizer``, only
    what the device computes with ever reaches it).

    Axes accept a tuple of axes too (``mesh.size(("dp", "sp"))``, ``mesh.group(...)``,
    ``mesh.ranks(...)``, ``mesh.coord(...)``): the block of ranks spanned by them, as one
    axis of their product's size (ZeRO reduces over :data:`DATA_AXES`).

    Args:
        dp, sp, tp, pp: axis sizes; one of them may be ``-1``, "the rest of the world".
            ``sp`` is DeepSpeed-Ulysses sequence parallelism (docs/parallelism.md): each
            ``sp`` rank holds a slice of every sequence.
        backend: force ``"gloo"`` or ``"nccl"``.
        device: the device the step runs on (``"cuda"`` is ``cuda:LOCAL_RANK``); default:
            the process group's (``cuda:LOCAL_RANK`` on NCCL, the CPU on gloo), and in a world
            of one wherever the program put the state. It must agree with the process
            group's: NCCL moves CUDA tensors, gloo's groups here move the CPU's.
        timeout_s: collective timeout; a collective that does not return in time raises
            instead of hanging (default ``$FZERO_TIMEOUT`` or 300 s). On a device, where
            collectives are waited on without a timeout, the watchdog reports it and ends the
            process instead (:mod:`fzero.distributed.watchdog`).

    Raises:
        ValueError: the sizes do not multiply to the world size, or more than one is -1; or
            ``device`` is not the process group's.

    Example:
        >>> import fzero
        >>> mesh = fzero.Mesh(dp=-1)
        >>> mesh.size("dp"), mesh.rank
        (1, 0)
    """

    def __init__(self, *, dp: int = -1, sp: int = 1, tp: int = 1, pp: int = 1, backend: str | None = None,
                 timeout_s: float | None = None, device: str | torch.device | None = None):
        self.timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s)
        if dist.is_available() and dist.is_initialized():
            # A group someone else made (Hugging Face's TrainingArguments, through accelerate,
            # makes one before any Mesh): destroyed at exit too, as fzero's own is below.
            world, rank = dist.get_world_size(), dist.get_rank()
            _register_destroy_at_exit()
        elif _launched() and int(os.environ["WORLD_SIZE"]) > 1:
            backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            pg_timeout_s = self.timeout_s + (NCCL_BACKSTOP_S if backend == "nccl" else 0.0)
            _init_process_group(backend, datetime.timedelta(seconds=pg_timeout_s))
            world, rank = dist.get_world_size(), dist.get_rank()
        else:
            world, rank = 1, 0
        self.world_size, self.rank = world, rank
        if world > 1:
            checkin.start()  # so that a rank that does not arrive at a collective is named
        self.shape = self._resolve({"pp": pp, "dp": dp, "sp": sp, "tp": tp}, world)
        self._device_mesh = None
        # Coordinates of this rank, row-major over AXES.
        coords, r = {}, rank
        for axis in reversed(AXES):
            coords[axis] = r % self.shape[axis]
            r //= self.shape[axis]
        self.coords = {a: coords[a] for a in AXES}
        if torch.cuda.is_available() and (backend == "nccl" or dist.is_initialized() and dist.get_backend() == "nccl"):
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        elif device_check.pretending():  # tests: the CPU, standing for an accelerator
            self.device = device_check.PRETEND_DEVICE
        else:
            self.device = torch.device("cpu")
        # A device the program chose: in a world of one, place() moves the state there.
        self.chosen = None if device is None else _chosen_device(device, self.device, world)
        if self.chosen is not None:
            self.device = self.chosen

    @staticmethod
    def _resolve(sizes: dict[str, int], world: int) -> dict[str, int]:
        for axis, n in sizes.items():
            if not isinstance(n, int) or (n < 1 and n != -1):
                raise ValueError(f"fzero.Mesh: {axis}={n!r} must be a positive int or -1")
        rest = [a for a, n in sizes.items() if n == -1]
        if len(rest) > 1:
            raise ValueError(f"fzero.Mesh: only one axis may be -1, got {', '.join(f'{a}=-1' for a in rest)}")
        fixed = 1
        for n in sizes.values():
            fixed *= n if n != -1 else 1
        if rest:
            if world % fixed:
                raise ValueError(
                    f"fzero.Mesh: {_fmt(sizes)} cannot cover a world of {world} ranks "
                    f"({world} is not divisible by {fixed})"
                )
            sizes = {**sizes, rest[0]: world // fixed}
        total = 1
        for n in sizes.values():
            total *= n
        if total != world:
            raise ValueError(f"fzero.Mesh: {_fmt(sizes)} multiply to {total}, but the world has {world} ranks")
        return {a: sizes.get(a, 1) for a in AXES}

    def place(self, state):
        """``state`` with its tensors on :attr:`device`, as ``step.init`` needs them.

        Every tensor of ``state.params`` and ``state.buffers`` moves (a module's buffers,
        ``num_batches_tracked`` too, live where its forward runs), and every tensor of the rest of the state
        (optimizer state, masters, ``extra``) but 0-dim ones: update
        counters and the loss scaler stay on the host, where they are read every step
        (``int(count)``, ``float(scale)``) without a device synchronisation and from where
        they never enter a collective. In a process without a process group (a world of
        one) the state stays where its creator put it, as in plain PyTorch: the device is
        chosen by the program there (by the state it makes, or by ``Mesh(device=)``), and by
        the mesh only when the mesh's ranks exchange tensors.

        Example:
            >>> import torch, fzero
            >>> state = {"params": {"w": torch.ones(2)}, "count": torch.tensor(0)}
            >>> fzero.Mesh(dp=-1).place(state)["params"]["w"].device.type
            'cpu'
        """
        if not (dist.is_available() and dist.is_initialized()) and self.chosen is None:
            return state
        from fzero import tree

        def every(x):
            return x.to(self.device) if isinstance(x, torch.Tensor) else x

        def shaped(x):
            return x.to(self.device) if isinstance(x, torch.Tensor) and x.dim() > 0 else x

        if hasattr(state, "params") and hasattr(state, "replace"):
            moved = {f: tree.map(every, getattr(state, f)) for f in ("params", "buffers")
                     if hasattr(state, f)}
            return state.replace(**moved,
                                 **{f: tree.map(shaped, getattr(state, f))
                                    for f in ("opt_state", "extra", "master", "loss_scaler") if hasattr(state, f)})
        if isinstance(state, dict) and "params" in state:
            return {k: tree.map(every if k in ("params", "buffers") else shaped, v)
                    for k, v in state.items()}
        return tree.map(shaped, state)

    def size(self, axis: Axis | tuple[Axis, ...]) -> int:
        """Number of ranks along ``axis`` (along all of them, for a tuple)."""
        n = 1
        for a in _axes(axis):
            n *= self.shape[a]
        return n

    def coord(self, axis: Axis | tuple[Axis, ...]) -> int:
        """This rank's index along ``axis``; for a tuple, in the block the axes span, row-major
        (its index in :meth:`ranks` of the tuple).

        Example:
            >>> import fzero
            >>> fzero.Mesh(dp=-1).coord(("dp", "sp"))
            0
        """
        index = 0
        for a in _axes(axis):
            index = index * self.shape[a] + self.coords[a]
        return index

    @property
    def device_mesh(self):
        """The ``torch.distributed.device_mesh.DeviceMesh`` (``None`` in a world of one)."""
        if self.world_size == 1:
            return None
        if self._device_mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            key = (self.device.type, tuple(self.shape[a] for a in AXES), id(dist.group.WORLD))
            if key not in _DEVICE_MESHES:
                _DEVICE_MESHES[key] = init_device_mesh(self.device.type, key[1], mesh_dim_names=AXES)
            self._device_mesh = _DEVICE_MESHES[key]
        return self._device_mesh

    def ranks(self, axis: Axis | tuple[Axis, ...]) -> tuple[int, ...]:
        """The global ranks of this rank's group along ``axis``, in the axis' order (for a
        tuple, the block the axes span, row-major).

        Example:
            >>> import fzero
            >>> fzero.Mesh(dp=-1).ranks("tp")
            (0,)
        """
        strides = {}
        stride = 1
        for a in reversed(AXES):  # row-major over AXES, as the coordinates are
            strides[a] = stride
            stride *= self.shape[a]
        out = [self.rank]
        for a in _axes(axis):
            base = [r - self.coords[a] * strides[a] for r in out]
            out = [b + i * strides[a] for b in base for i in range(self.shape[a])]
        return tuple(out) if len(_axes(axis)) == 1 else tuple(sorted(out))

    def group(self, axis: Axis | tuple[Axis, ...]):
        """The process group of this rank's ``axis`` (``None`` when that axis has one rank).

        For a tuple of adjacent axes, the group of the block they span; where only one of
        them has more than one rank it is that axis' own group (so ``("dp", "sp")`` without
        sequence parallelism is the ``dp`` group, and its traffic is filed under ``dp``)."""
        axes = [a for a in _axes(axis) if self.shape[a] > 1]
        if not axes:
            return None
        if len(axes) == 1:
            return self.device_mesh.get_group(axes[0])
        names = tuple(_axes(axis))
        order = [AXES.index(a) for a in names]
        if order != list(range(order[0], order[0] + len(order))):
            raise ValueError(f"fzero.Mesh.group: the axes {names} are not adjacent in {AXES}")
        key = (id(self.device_mesh), names)
        if key not in _FLAT_GROUPS:
            # DeviceMesh's flattening of adjacent dims: one group per block, made by every rank
            # (once per DeviceMesh, as the DeviceMesh is once per shape).
            _FLAT_GROUPS[key] = self.device_mesh[names]._flatten("_".join(names)).get_group()
        return _FLAT_GROUPS[key]

    def __repr__(self) -> str:
        shown = {a: n for a, n in self.shape.items() if a != "sp" or n > 1}
        return f"Mesh({_fmt(shown)}, rank={self.rank}/{self.world_size}, device={self.device})"


def _init_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """``dist.init_process_group`` from torchrun's environment, with two differences.

    Under torchrun every restart attempt of the worker group rendezvouses in the agent's
    store, which outlives the attempt: the keys of attempt 0 (each rank's gloo address) are
    still there when attempt 1 starts, and a restarted rank that reads them connects to a
    process that is gone ("Gloo connectFullMesh failed ... Connection refused"). Each attempt
    (``TORCHELASTIC_RESTART_COUNT``) gets keys of its own under a ``PrefixStore``.

    Without the agent's store (``TORCHELASTIC_USE_AGENT_STORE`` not ``True``: an elastic
    ``fzero launch`` sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) rank 0 hosts a new store
    for each worker group, so no key outlives its attempt, and no prefix is used: the agents
    of an elastic job count their restarts differently (a node that joins later starts at 0),
    so a prefix by restart count would part ranks of one group.

    And a group made here is destroyed as the interpreter exits (:func:`_destroy_at_exit`).
    """
    from torch.distributed import rendezvous

    store, rank, world = next(rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"default_pg/attempt{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    _register_destroy_at_exit()


_destroy_registered = False


def _register_destroy_at_exit() -> None:
    global _destroy_registered
    if not _destroy_registered:
        _destroy_registered = True
        atexit.register(_destroy_at_exit)


def _destroy_at_exit() -> None:
    # The group is destroyed here, while the interpreter is whole and after the checkpoint's
    # last asynchronous save (which is waited for at threading's exit, before atexit hooks
    # run), not left to the interpreter's teardown, which takes down the threads that use
    # it in no set order. (A save still running at that teardown ended ranks in
    # std::terminate: "terminate called without an active exception", SIGABRT.)
    checkin.stop_checkins()
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    _let_threads_settle()


def _let_threads_settle(timeout_s: float = 0.5) -> None:
    """Wait, at most ``timeout_s``, until no other thread of this process is runnable.

    A gloo worker thread that has completed a collective drops its last hold on the
    collective's tensors a moment after the caller's wait returned. Under load it may not
    have run yet when the program ends; if it runs only once the interpreter is finalizing
    (the tensors' Python objects already gone), freeing them takes the GIL there, which ends
    the thread inside a C++ destructor: "terminate called without an active exception"
    (SIGABRT), seen after a plain ``dist.all_reduce`` and ``destroy_process_group()`` (a
    group some object still holds outlives that call, and its threads with it). Here, at
    exit, before the interpreter tears anything down, each thread that is still runnable
    (``R`` in ``/proc/self/task/*/stat``) is given the cores until every one is asleep, so
    such a release happens while it is safe. Without ``/proc`` it returns at once."""
    me, deadline = threading.get_native_id(), time.monotonic() + timeout_s
    while _others_runnable("/proc/self/task", me) and time.monotonic() < deadline:
        time.sleep(0.001)


def _others_runnable(tasks: str, me: int) -> bool:
    """Whether a thread of ``tasks`` (``/proc/<pid>/task``) other than ``me`` is runnable
    (state ``R``); ``False`` when that cannot be read."""
    try:
        return any(checkin.proc_state(os.path.join(tasks, tid, "stat")) == "R"
                   for tid in os.listdir(tasks) if int(tid) != me)
    except (OSError, ValueError):
        return False


def _axes(axis) -> tuple[str, ...]:
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    unknown = [a for a in axes if a not in AXES]
    if unknown or not axes:
        raise ValueError(f"fzero.Mesh: unknown axis {', '.join(map(repr, unknown)) or '()'}; the axes are {AXES}")
    return axes


def _fmt(sizes: dict[str, int]) -> str:
    # sp, the newest axis, is shown where it is not 1 (a mesh without sequence parallelism
    # reads as it always has).
    return ", ".join(f"{a}={n}" for a, n in sizes.items() if a != "sp" or n != 1)
