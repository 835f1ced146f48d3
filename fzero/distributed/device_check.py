"""Checks that every tensor handed to a collective is on the device its process group moves.

Why: on GPUs the mesh's process groups are NCCL groups, and NCCL moves CUDA tensors only.
A CPU tensor handed to one (a flag built with ``torch.zeros(())``, a list of ints made
into ``torch.tensor(values)``, a value moved with ``.cpu()``) fails inside torch on the GPU
machines -- while CPU CI, on gloo, takes any CPU tensor and passes. Two checks make the
mistake visible before it reaches a GPU:

* ``FZERO_CHECK_DEVICE=cuda`` (any device type): before a collective starts, every tensor
  it is handed must be on a device of that type, or a :class:`DeviceMismatchError` names
  the collective, the rank, the tensor and its device.
* :func:`pretend` (tests on CPU): tensors are told apart as they would be on a GPU. A
  tensor *made on the host* -- by a factory given no device (``torch.zeros(3)``,
  ``torch.tensor([...])``), by ``.cpu()`` or ``.to("cpu")``, or computed from host tensors
  only -- is a host tensor; one made with ``device=mesh.device``, by ``.to(mesh.device)``,
  or computed with such a tensor, is a device tensor. Inside ``pretend()`` a
  :class:`fzero.Mesh`'s device is :data:`PRETEND_DEVICE` (the CPU, marked), and a
  collective handed a host tensor raises exactly where NCCL would have failed.

Inside ``pretend()``, :func:`host_syncs` records what would make a GPU's host wait for the
device: a read of a device value (``.item()``, ``bool()``, ``.tolist()``, ...) and a copy
between host and device that is not asynchronous. A step on a GPU runs ahead of the device
only between such points, so a test can pin down where its step waits.

Collectives that move host data on purpose (the checkpoint's JSON messages, on a gloo group
of its own) run inside :func:`on_host` and are not checked.

How ``pretend`` tells them apart: it records the *storages* of host tensors (views,
``detach``, ``nn.Parameter`` share their storage, so they share its mark) with a
``TorchFunctionMode`` that sees every torch call made from Python; a tensor it never saw
made (e.g. a gradient the autograd engine made) counts as a device tensor. Collectives are
watched with a ``TorchDispatchMode`` while they start, which sees the tensors of torch's
``c10d`` operators whichever ``torch.distributed`` function issued them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import traceback
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from fzero.distributed._errors import CollectiveError

__all__ = ["ENV", "PRETEND_DEVICE", "DeviceMismatchError", "HostSync", "guard", "host_syncs", "in_host_memory",
           "is_host", "is_host_device", "on_host", "pretend", "pretending"]

ENV = "FZERO_CHECK_DEVICE"
# The mesh's device inside pretend(): the CPU, told apart from other CPU devices by identity.
PRETEND_DEVICE = torch.device("cpu")
_DEVICE_ATTR = torch._C.TensorBase.__dict__["device"]  # ``Tensor.device``'s descriptor
_LOCAL = threading.local()  # ``host``: depth of on_host() blocks on this thread
_TRACKER: "_HostTracker | None" = None  # the tracker of the pretend() block running, if any


class DeviceMismatchError(CollectiveError, ValueError):
    """A collective was handed a tensor on another device than its process group moves."""


# --------------------------------------------------------------------------- what is expected


def _expected() -> str | None:
    """``"pretend"``, a device type, or ``None`` when collectives started now are not checked."""
    if getattr(_LOCAL, "host", 0):
        return None
    if _TRACKER is not None:
        return "pretend"
    want = os.environ.get(ENV, "").strip()
    return want if want not in ("", "0") else None


@contextlib.contextmanager
def on_host() -> Iterator[None]:
    """Collectives started in this block (on this thread) move host tensors on purpose, on a
    gloo group: they are not checked."""
    _LOCAL.host = getattr(_LOCAL, "host", 0) + 1
    try:
        yield
    finally:
        _LOCAL.host -= 1


def guard(name: str, where: str):
    """A context in which the tensors of the collectives started are checked, or a no-op
    context when no check is on (the common case: one environment lookup)."""
    want = _expected()
    if want is None:
        return contextlib.nullcontext()
    return _Watch(name, where, want)


class _Watch(TorchDispatchMode):
    """Checks every tensor of a ``c10d`` operator dispatched while it is active."""

    def __init__(self, name: str, where: str, want: str):
        super().__init__()
        self.name, self.where, self.want = name, where, want

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "namespace", None) == "c10d":
            for t in _pytree.tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor):
                    self._check(t)
        return func(*args, **kwargs)

    def _check(self, t: torch.Tensor) -> None:
        if self.want == "pretend":
            if not is_host(t):
                return
            got, need = "made on the host (cpu)", "the mesh's device (a pretend accelerator, fzero's device check)"
        else:
            if t.device.type == self.want:
                return
            got, need = f"on {t.device}", f"{self.want} ({ENV}={self.want})"
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        raise DeviceMismatchError(
            f"{self.where}: collective {self.name} on rank {rank} was handed a {str(t.dtype).replace('torch.', '')} "
            f"tensor of shape {tuple(t.shape)} {got}, but its process group moves tensors on {need}: make it on "
            f"mesh.device (a host value that must stay on the host goes through a gloo group, inside "
            f"fzero.distributed.device_check.on_host())")


# --------------------------------------------------------------------------- pretend


def pretending() -> bool:
    """Whether a :func:`pretend` block is running."""
    return _TRACKER is not None


def is_host(t: torch.Tensor) -> bool:
    """Inside :func:`pretend`: whether ``t`` was made on the host (``False`` outside it)."""
    tracker = _TRACKER
    return tracker is not None and tracker.is_host(t)


def in_host_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` is in host memory: a CPU tensor, or inside :func:`pretend` (a CPU standing
    for a GPU) one made on the host."""
    return is_host(t) if _TRACKER is not None else t.device.type == "cpu"


def is_host_device(device: torch.device | str) -> bool:
    """Whether ``device`` is the host as a GPU machine sees it: a CPU device, but not, inside
    :func:`pretend`, the mesh's (:data:`PRETEND_DEVICE`). For the code that takes a path of
    its own on the CPU, so that under ``pretend()`` it takes the GPU's."""
    if device is PRETEND_DEVICE and _TRACKER is not None:
        return False
    return torch.device(device).type == "cpu"


@contextlib.contextmanager
def pretend() -> Iterator[torch.device]:
    """Tell host tensors from device tensors on a CPU-only machine, as on a GPU (tests).

    Inside the block a :class:`fzero.Mesh` made there has :data:`PRETEND_DEVICE` as its
    device, ``Tensor.device`` of a device tensor is that device, and every collective of the
    mesh handed a host tensor raises :class:`DeviceMismatchError`. Enter it before the
    tensors are made (a tensor made before counts as a device tensor). The arithmetic is
    unchanged: ``.cpu()`` of a device tensor and ``.to(mesh.device)`` of a host tensor
    return copies, as on a GPU, where a view would have been returned on the CPU.

    Yields:
        :data:`PRETEND_DEVICE`.

    Raises:
        RuntimeError: a ``pretend`` block is already running.

    Example:
        >>> import torch
        >>> from fzero.distributed import device_check
        >>> with device_check.pretend() as device:
        ...     x = torch.zeros(2)
        ...     device_check.is_host(x), device_check.is_host(x.to(device)), device_check.is_host(x.to(device) + x)
        (True, False, False)
    """
    global _TRACKER
    if _TRACKER is not None:
        raise RuntimeError("fzero.distributed.device_check.pretend: a pretend block is already running")
    tracker = _HostTracker()
    _TRACKER = tracker
    try:
        with tracker:
            yield PRETEND_DEVICE
    finally:
        _TRACKER = None


def _names_host(device) -> bool:
    """Whether a ``device=`` argument names the host (the CPU, other than the pretend device)."""
    if device is PRETEND_DEVICE:
        return False
    return torch.device(device).type == "cpu"


def _moves_to_host(func, args, kwargs) -> bool | None:
    """For ``Tensor.cpu`` and ``Tensor.to``: whether the result is a host tensor (``None`` for
    other functions, and for a ``to`` that only changes the dtype)."""
    if func is torch.Tensor.cpu:
        return True
    if func is not torch.Tensor.to:
        return None
    for a in (*args[1:], kwargs.get("device")):
        if isinstance(a, torch.Tensor):
            return _TRACKER is not None and _TRACKER.is_host(a)
        if isinstance(a, (str, torch.device)):
            return _names_host(a)
    return None


class _HostTracker(TorchFunctionMode):
    """Marks the storages of tensors made on the host (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.host = WeakIdKeyDictionary()  # storage -> True

    def is_host(self, t: torch.Tensor) -> bool:
        try:
            return t.device.type == "cpu" and t.untyped_storage() in self.host
        except (RuntimeError, NotImplementedError):  # tensors without a storage
            return False

    def _mark(self, out) -> None:
        for t in _pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                try:
                    self.host[t.untyped_storage()] = True
                except (RuntimeError, NotImplementedError):
                    pass

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _DEVICE_ATTR:  # ``t.device``
            device = func(*args, **kwargs)
            return PRETEND_DEVICE if device.type == "cpu" and not self.is_host(args[0]) else device
        to_host = _moves_to_host(func, args, kwargs)
        if to_host is not None:  # .cpu(), .to(device): a copy where the device changes
            self_ = args[0]
            out = func(*args, **kwargs)
            if out is self_ and to_host != self.is_host(self_):
                out = self_.clone()
            if to_host:
                self._mark(out)
            return out
        tensors = [t for t in _pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        device = kwargs.get("device")
        if device is not None:
            host = _names_host(device)
        elif tensors:
            host = all(self.is_host(t) for t in tensors)
        else:
            host = True  # a factory on the default device: the host, as on a GPU machine
        out = func(*args, **kwargs)
        if host:
            self._mark(out)
        return out


# --------------------------------------------------------------------------- host syncs


@dataclasses.dataclass(frozen=True)
class HostSync:
    """One operation that would make a GPU's host wait for the device: ``what`` it was
    (``"read (Tensor.item)"``, ``"blocking copy to the device (Tensor.to)"``, ...) and
    ``where``, the innermost frames outside torch, innermost last (``path:line (function)``)."""

    what: str
    where: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.what} at {' <- '.join(reversed(self.where))}"


# Reads of a tensor's value by the host, and operators whose output shape depends on it.
_READS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
          torch.Tensor.__index__, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.equal, torch.equal,
          torch.Tensor.nonzero, torch.nonzero, torch.allclose, torch.Tensor.allclose, torch.masked_select,
          torch.Tensor.masked_select, torch.unique, torch.Tensor.unique, torch.Tensor.__repr__,
          torch.Tensor.__format__}
_COPIES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.copy_, torch.tensor, torch.as_tensor}


@contextlib.contextmanager
def host_syncs(frames: int = 4) -> Iterator[list[HostSync]]:
    """Record, inside :func:`pretend`, each operation of this thread that on a GPU makes the
    host wait for the device (a test's view of ``torch.cuda.set_sync_debug_mode``, on a CPU):

    * a read of a device tensor's value: ``.item()``, ``bool()``, ``float()``, ``int()``,
      ``.tolist()``, ``.numpy()``, ``torch.equal``, and operators whose output shape depends
      on the values (``nonzero``, ``masked_select``, ``unique``);
    * a copy between the host and the device without ``non_blocking=True`` (``.to()``,
      ``.cpu()``, ``.copy_()``; a pageable copy to the device waits for the stream), and
      ``torch.tensor(data, device=...)`` on the device, which is one.

    Yields the list the records are appended to (:class:`HostSync`). What it cannot see: a
    sync made inside a C++ operator (none of torch's element-wise, reduction or collective
    operators makes one) and a Python branch on ``tensor.device.type == "cpu"`` that takes a
    host-only path under ``pretend()`` (fzero's own ask :func:`is_host_device` instead).

    Example:
        >>> import torch
        >>> from fzero.distributed import device_check
        >>> with device_check.pretend() as device:
        ...     x = torch.ones(3).to(device, non_blocking=True)   # asynchronous: not a sync
        ...     with device_check.host_syncs() as syncs:
        ...         y = x * 2                                      # stays on the device
        ...         if y.sum() > 0:                                # the host reads it
        ...             pass
        >>> [s.what for s in syncs]
        ['read (Tensor.__bool__)']
    """
    if _TRACKER is None:
        raise RuntimeError("fzero.distributed.device_check.host_syncs: only inside pretend(), which tells device "
                           "tensors from host tensors")
    out: list[HostSync] = []
    with _SyncWatch(out, frames):
        yield out


def _is_device(t) -> bool:
    return isinstance(t, torch.Tensor) and not is_host(t)


def _nonblocking(args, kwargs) -> bool:
    return bool(kwargs.get("non_blocking", False)) or any(a is True for a in args[1:])


class _SyncWatch(TorchFunctionMode):
    def __init__(self, out: list[HostSync], frames: int):
        super().__init__()
        self.out, self.frames = out, frames

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = None
        if func in _READS:
            if any(_is_device(a) for a in args):
                what = f"read ({_name(func)})"
        elif func in _COPIES:
            what = self._copy(func, args, kwargs)
        if what is not None:
            self.out.append(HostSync(what, self._where()))
        return func(*args, **kwargs)

    def _copy(self, func, args, kwargs) -> str | None:
        if func in (torch.tensor, torch.as_tensor):
            device = kwargs.get("device")
            data = args[0] if args else kwargs.get("data")
            if device is not None and not _names_host(device) and not _is_device(data):
                return f"copy to the device ({_name(func)}(data, device=...))"
            return None
        if func is torch.Tensor.copy_:
            dst, src = args[0], args[1] if len(args) > 1 else kwargs.get("src")
            if not isinstance(src, torch.Tensor) or is_host(dst) == is_host(src) or _nonblocking(args[1:], kwargs):
                return None
            return f"blocking copy {'to the device' if is_host(src) else 'to the host'} (Tensor.copy_)"
        src, to_host = args[0], _moves_to_host(func, args, kwargs)
        if to_host is None or (func is torch.Tensor.to and _nonblocking(args, kwargs)):
            return None
        if to_host == is_host(src):
            return None
        return f"blocking copy {'to the host' if to_host else 'to the device'} ({_name(func)})"

    def _where(self) -> tuple[str, ...]:
        here = os.path.dirname(os.path.abspath(torch.__file__))
        frames = [f for f in traceback.extract_stack()
                  if not f.filename.startswith(here) and f.filename != __file__ and "contextlib" not in f.filename]
        return tuple(f"{_short(f.filename)}:{f.lineno} ({f.name})" for f in frames[-self.frames:])


def _name(func) -> str:
    """``Tensor.item``, ``torch.tensor``: how the recorded function is written."""
    name = getattr(func, "__name__", str(func))
    return f"torch.{name}" if getattr(torch, name, None) is func else f"Tensor.{name}"


def _short(path: str) -> str:
    parts = path.replace(os.sep, "/").split("/")
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] in ("fzero", "fzero_kernels", "tests", "benchmarks", "examples"):
            return "/".join(parts[i:])
    return parts[-1]
