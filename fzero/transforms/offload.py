"""``offload_optimizer``: ZeRO-Offload of the optimizer (Ren et al., 2021), DeepSpeed's
``zero_optimization.offload_optimizer: {"device": "cpu"}``.

The fp32 master weights and the optimizer state of this rank's pieces live in host memory,
and the optimizer's update runs there (``fzero.optim``'s chain on host tensors: torch's
foreach CPU kernels). Each update copies the reduced gradient pieces device→host first and
the new parameter pieces host→device after, before ZeRO-1/2 all-gathers them; the device
keeps only what the forward and backward compute with.

The transform sits just outside ``shard_state`` (``fzero/_compile.py``). Its ``init`` scope
says ``offload_optimizer`` to the inits inside it, and ``shard_state`` (stages 1-3) then cuts
this rank's pieces of the masters straight into host memory and builds the optimizer state
over them there, so the device never holds them; a ``shard_state`` that did not (another
transform in between) has them copied to the host by this transform's ``after``. Its handler
of ``update`` is the last before the optimizer's own, so it sees exactly the pieces the
optimizer steps, with ``mixed_precision``'s masters already swapped in.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from fzero import tree
from fzero._params import merge_trainable, trainable
from fzero.distributed import comm, device_check
from fzero.core import Handler, Step, as_step, context, installed, running
from fzero.transforms._checks import check_option

__all__ = ["HostStaging", "host_copy", "offload_optimizer", "write_params"]

WHERE = "fzero.offload_optimizer"


def host_copy(x: Any, pin: bool) -> Any:
    """A new host tensor holding ``x`` (pinned when ``pin``); never ``x`` itself, so the host
    copy has storage of its own even when the device is the host."""
    if not isinstance(x, torch.Tensor) or x.dim() == 0:  # counters stay where Mesh.place keeps them
        return x
    out = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=pin)
    with torch.no_grad():
        out.copy_(x)
    return out


class HostStaging:
    """The host buffers an offloaded update's new parameters are cast into before their copy
    to the device (DeepSpeed's ZeRO-Offload copies from such buffers too), one per
    parameter, kept between steps: a new host tensor a parameter every step would be
    page-faulted in every step. Page-locked where ``pin`` (with CUDA): each copy then runs
    asynchronously, behind the compute already queued, and the next update's casts wait for
    the copies to have read the buffers before writing them again.

    Example (one process, no CUDA: the copies are synchronous, the buffers still reused):
        >>> import torch
        >>> staging = HostStaging(pin=False)
        >>> out = staging.copy({"w": torch.zeros(2, dtype=torch.bfloat16)}, {"w": torch.ones(2)}, into=lambda p: p)
        >>> out["w"].tolist(), staging.buffers[0].dtype
        ([1.0, 1.0], torch.bfloat16)
    """

    def __init__(self, pin: bool):
        self.pin = pin
        self.buffers: dict[int, torch.Tensor] = {}
        self.read: Any = None  # a CUDA event: the last update's asynchronous copies have run

    def copy(self, params: Any, masters: Any, into: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        """``masters`` cast to their ``params``' dtypes and copied into ``into(p)`` for each
        parameter ``p`` (a master already of its parameter's dtype is copied as it is)."""
        if self.read is not None:
            self.read.synchronize()
            self.read = None
        count = itertools.count()
        queued = []

        def one(p: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            i = next(count)
            if m.dtype == p.dtype:  # the master itself: the next update writes it, so copied now
                return comm.copy_(into(p), m, kind="h2d")
            buf = self.buffers.get(i)
            if buf is None or buf.shape != m.shape or buf.dtype != p.dtype:
                buf = self.buffers[i] = torch.empty(m.shape, dtype=p.dtype, device="cpu", pin_memory=self.pin)
            with torch.no_grad():
                buf.copy_(m)  # the cast, on the host: only the parameter's bytes cross
            dst = into(p)
            later = self.pin and dst.is_cuda
            if later:
                queued.append(dst.device)
            return comm.copy_(dst, buf, kind="h2d", non_blocking=later)

        out = tree.map(one, params, masters)
        if queued:
            self.read = torch.cuda.Event()
            self.read.record(torch.cuda.current_stream(queued[0]))
        return out


def copy_to_device(params: Any, masters: Any) -> Any:
    """The new host ``masters`` copied into the device ``params`` (each cast on the host to
    its parameter's dtype first, so only the parameter's bytes move): into ``params``
    themselves when the step owns its state (the step context's ``donate``), else into new tensors.
    Counted as ``"h2d"``. What an offloaded update ends with, whichever transform keeps the
    device parameters (this one in fp32 training, ``mixed_precision`` its 16-bit copies).
    The casts go through ``offload_optimizer``'s :class:`HostStaging` (the step context's
    ``offload_staging``) where there is one."""
    here = context()
    into = (lambda p: p) if here.donate else torch.empty_like
    staging = here.offload_staging or HostStaging(pin=False)
    return staging.copy(params, masters, into)


def write_params(params: Any, masters: Any) -> Any:
    """The new ``masters`` written into ``params`` (each cast to its parameter's dtype),
    wherever each lives: the masters on the host when the update runs there
    (the step context's ``offload_optimizer``), the parameters' pieces on the host under
    ZeRO-3's parameter offload (its ``offload_params``). So:

    * masters on the host, parameters on the device: cast on the host, copied ``"h2d"``
      (:func:`copy_to_device`);
    * masters on the device, parameters on the host: cast on the device, copied ``"d2h"``;
    * both on the host: cast on the host, nothing crosses.

    Into ``params`` themselves when the step owns its state (``donate``), else into new
    tensors (page-locked on the host when the parameter was). What an update ends with,
    whichever transform keeps the parameters beside its masters (``offload_optimizer`` in
    fp32 training, ``mixed_precision`` its 16-bit copies).
    """
    here = context()
    masters_home, params_home = here.offload_optimizer, here.offload_params
    if masters_home and not params_home:
        return copy_to_device(params, masters)
    own = here.donate

    def host_like(p):
        return p if own else torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=p.is_pinned())

    def write(p, m):
        if not params_home:  # both on the device: a transform's own business (not an offload)
            raise ValueError("fzero.transforms.offload.write_params: neither the masters nor the parameters are "
                             "offloaded; cast them where they are")
        if masters_home:  # both on the host
            out = host_like(p)
            with torch.no_grad():
                return out.copy_(m)
        return comm.copy_(host_like(p), m.to(p.dtype), kind="d2h")

    return tree.map(write, params, masters)


class _OffloadHandler(Handler):
    """Runs ``update`` on the host.

    ``copies`` is whether this transform keeps the device parameters itself (fp32 training:
    they are the host masters' copies); under ``mixed_precision`` that transform keeps its
    low-precision copies and writes them from the host masters (the step context's
    ``offload_optimizer``, which this transform's call sets).
    """

    def __init__(self, pin_memory: bool, copies: bool, inner_handler=None):
        # Pinned pages only mean something to a CUDA copy engine; without CUDA they cannot
        # be made, so they are not asked for.
        self.pin = pin_memory and torch.cuda.is_available()
        self.copies = copies
        # shard_state at stages 1-3 directly inside builds the optimizer state over its
        # pieces of the masters, which it cuts to the host when told (this transform's init
        # scope): nothing to build before it, nothing to move after.
        self.inner = inner_handler
        self.rebuilt = getattr(inner_handler, "builds_optimizer_state", False)
        self.ready = False
        self.grads: dict[int, torch.Tensor] = {}  # host gradient buffers, kept between steps
        self.staging = HostStaging(self.pin)  # and the new parameters' casts on their way back
        self.on_device = False  # whether the parameters live apart from the host (set at init)

    def before(self, state):
        # fp32: the parameters stand as their own masters until shard_state, inside, cuts
        # them into this rank's pieces (as it cuts mixed_precision's) and builds the
        # optimizer state over those.
        if self.copies and state.master is None:
            master = tree.map(lambda p: p.detach(), trainable(state.params))
            state = state.replace(master=master, opt_state=None if self.rebuilt else state.tx.init(master))
        return state

    def after(self, state):
        if state.master is None:
            raise ValueError(f"{WHERE}: found no master weights in state.master after the inner transforms' "
                             "init: pass make_masters=True unless a mixed_precision inside makes them")
        self.ready = True
        self.on_device = any(not device_check.in_host_memory(p) for p in tree.leaves(state.params)
                             if isinstance(p, torch.Tensor))
        if getattr(self.inner, "opt_state_on_host", False):  # shard_state built them there
            return state
        # After a shard_state that did not: this rank's pieces, placed on the mesh's device.
        host = lambda x: host_copy(x, self.pin)  # noqa: E731
        return state.replace(opt_state=tree.map(host, state.opt_state),
                             master=tree.map(host, state.master))

    def _on_host(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is in host memory apart from the device: a CPU tensor where the
        parameters live on a device (inside ``device_check.pretend()``, one made on the
        host). Where they live on the CPU, the host is the device, and every gradient is
        copied as it would be from a device."""
        return self.on_device and device_check.in_host_memory(t)

    def _to_host(self, i: int, g: torch.Tensor) -> torch.Tensor:
        """Gradient piece ``g`` in host buffer ``i`` (made once: a new buffer every step would
        be page-faulted in every step); ``g`` itself when it is on the host already (ZeRO's
        reduction copied it there as it completed: ``shard_state``'s ``HostGradients``)."""
        if self._on_host(g):
            return g
        buf = self.grads.get(i)
        if buf is None or buf.shape != g.shape or buf.dtype != g.dtype:
            buf = self.grads[i] = torch.empty(g.shape, dtype=g.dtype, device="cpu", pin_memory=self.pin)
        return comm.copy_(buf, g, kind="d2h")

    def update(self, state, grads, *, next):
        if not self.ready:
            raise RuntimeError(f"{WHERE}: call step.init(state) once before the first step")
        master = state.master
        flat, spec = tree.flatten(grads)
        host = tree.unflatten(spec, [self._to_host(i, g) if isinstance(g, torch.Tensor) else g
                                     for i, g in enumerate(flat)])
        new = next(state.replace(params=merge_trainable(state.params, master)), host)
        if not self.copies:  # mixed_precision, inside, rounds the new masters into its device copies
            return new
        master = trainable(new.params)
        written = write_params(trainable(state.params), master)  # on the host under parameter offload
        return new.replace(params=merge_trainable(state.params, written), master=master)


def offload_optimizer(step: Callable, *, pin_memory: bool = False, make_masters: bool = True) -> Step:
    """Keep the fp32 master weights and the optimizer state on the host and run the update
    there (ZeRO-Offload; DeepSpeed's ``offload_optimizer: {"device": "cpu"}``).

    Apply it outside :func:`fzero.shard_state` (stages 1-3), as ``fzero.compile(...,
    offload_optimizer="cpu")`` does. ``state.master`` holds the fp32 master
    weights: :func:`fzero.mixed_precision`'s, or in fp32 training this transform's own
    (``make_masters``), which shard_state partitions like any masters; at ``init`` this
    rank's pieces of them, and the optimizer state built over those, are made on the host
    (by the shard_state directly inside, told so; else copied there). Each update copies
    the gradient pieces to the host, steps the masters there, and copies the new pieces back
    into the device parameters (in place when the step owns its state), before ZeRO-1/2's
    all-gather; under mixed precision the low-precision bytes are copied, cast on the host.
    The arithmetic is the optimizer's own, so the trajectory is the non-offloaded one. The
    copies are counted in ``fzero.distributed.comm.traffic`` (kinds ``"d2h"``, ``"h2d"``).

    Args:
        step: ``train_step(state, batch) -> (state, metrics)``, usually a ``shard_state``.
        pin_memory: page-lock the host buffers (faster copies to and from a GPU; ignored
            without CUDA, where pinning is impossible).
        make_masters: fp32 training: make the masters here (the parameters' values) and
            copy each update's new pieces back into the device parameters. ``False`` when a
            ``mixed_precision`` inside makes them and writes its low-precision copies.

    Returns:
        A :class:`Step`; ``step.init(state)`` must run once, after the inner transforms'.

    Raises:
        ValueError: ``pin_memory`` or ``make_masters`` not a bool; at ``init``, no masters
            (``make_masters=False`` with no ``mixed_precision`` inside).

    Example (one process; on a CPU the host and the "device" are the same memory, but the
    masters and moments are still their own tensors and every copy is made and counted):
        >>> import torch, fzero, fzero.testing as ft
        >>> from fzero import optim
        >>> apply, params = fzero.functionalize(torch.nn.Linear(3, 2))
        >>> state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-2))
        >>> step = fzero.compile(ft.mse_step, zero=1, offload_optimizer="cpu")
        >>> state = step.init(state)
        >>> state, _ = step(state, {"x": torch.ones(4, 3), "y": torch.zeros(4, 2)})
        >>> master = fzero.gather(state.master)["weight"]
        >>> torch.equal(master, fzero.gather(state.params)["weight"])
        True
    """
    check_option(WHERE, "pin_memory", pin_memory)
    check_option(WHERE, "make_masters", make_masters, "pin_memory")  # a bool, the same check
    inner = as_step(step)
    handler = _OffloadHandler(pin_memory, make_masters, getattr(inner, "handler", None))

    def call(state, batch):
        with installed(handler), running(offload_optimizer=True, offload_staging=handler.staging):
            return inner(state, batch)

    out = Step(call, before=handler.before, after=handler.after, name=f"offload_optimizer({inner.__name__})",
               inner=inner, init_scope=lambda: running(offload_optimizer=True))
    out.handler = handler
    return out
