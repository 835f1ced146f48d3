"""Gradient reduction for ZeRO: a sink that reduces flat groups while backward runs.

:class:`ReduceSink` is the ``grad_sink`` of ``fzero.core._value_and_grad_base``: the
autograd engine hands it each parameter's gradient the moment it is complete; it copies the
gradient into its group's flat buffer and, once a group is complete, starts the group's
collective (all-reduce at stage 0, reduce-scatter at stages 1-3) while backward goes on.
Everything it needs is passed in: the layout, the ``dp`` group, the stage, the reduction
dtype, the buffer pool and the timeout (see ``_transform.py`` for the handler that builds
one per ``value_and_grad``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from fzero.distributed import comm, device_check
from fzero.transforms.shard_state._layout import Layout

__all__ = ["MAX_IN_FLIGHT", "BufferPool", "HostGradients", "ReduceSink", "gradients", "reduce_dtype"]

WHERE = "fzero.shard_state"
# Stages 2-3: reduce-scatters outstanding at once. A group's buffer is taken only once fewer
# are outstanding, so the buffers in use are the group being filled and MAX_IN_FLIGHT - 1
# sent before it: two units at ZeRO-3, as FSDP2 (which keeps a reduce-scatter's input until
# the next one is issued). Each reduce-scatter still has the next group's whole backward to
# complete in before its buffer is waited for.
MAX_IN_FLIGHT = 2


def reduce_dtype(dtype: torch.dtype, asked: torch.dtype | None = None) -> torch.dtype:
    """The dtype gradients of ``dtype`` are summed in: ``asked`` if given, else fp32 for
    low-precision gradients (bf16 sums lose bits fast) and the gradients' own otherwise.

    Example:
        >>> reduce_dtype(torch.bfloat16), reduce_dtype(torch.bfloat16, torch.bfloat16)
        (torch.float32, torch.bfloat16)
    """
    if asked is not None:
        return asked
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


class BufferPool:
    """A few reduce buffers kept between steps (stages 1-3), reused largest-fit.

    Fresh multi-megabyte buffers cost page faults on every step (measured: 26-48 ms a step on
    the 10.8M GPT); at most ``limit`` buffers are kept, the smallest that fits reused. The
    default, ``MAX_IN_FLIGHT``, is as many as are ever in use at once at stages 1-3, so the
    pool holds no more between steps than the step's peak: two buckets (one buffer each, never
    larger than its group). Stage 0 keeps one per group, as DDP keeps its buckets.

    ``keep_bytes`` (``None``: no bound) bounds the bytes of the buffers kept free: a buffer
    given back beyond it goes back to the allocator at once, largest first, where the rest
    of the step and the next forward can use it. ``shard_state`` bounds it by a share of the
    model when it chose the bucket itself (:func:`fzero.transforms._checks.kept_reduce_bytes`),
    so a default bucket as large as the model costs no memory between steps.

    Attributes:
        in_use_bytes: bytes of the buffers taken and not given back yet.
        peak_bytes: the most ``in_use_bytes`` has been, over every step so far.

    Example:
        >>> pool = BufferPool()
        >>> a = pool.take(4, torch.float32, torch.device("cpu")); b = pool.take(2, torch.float32, torch.device("cpu"))
        >>> pool.give(a); pool.give(b); pool.in_use_bytes, pool.peak_bytes
        (0, 24)
        >>> bounded = BufferPool(keep_bytes=16)  # a 32-byte buffer goes, the 16-byte one stays
        >>> a = bounded.take(4, torch.float32, torch.device("cpu")); b = bounded.take(8, torch.float32, torch.device("cpu"))
        >>> bounded.give(b); bounded.give(a); [t.numel() for t in bounded.free]
        [4]
    """

    def __init__(self, limit: int = MAX_IN_FLIGHT, keep_bytes: int | None = None):
        self.limit, self.keep_bytes = limit, keep_bytes
        self.free: list[torch.Tensor] = []
        self.lent: list[torch.Tensor] = []  # buffers the step's gradients view (stage 0)
        self.in_use_bytes = 0
        self.peak_bytes = 0

    def take(self, n: int, dtype: torch.dtype, device: torch.device, *, zero: bool = True) -> torch.Tensor:
        """A buffer of ``n`` elements: zeroed, or with ``zero=False`` holding whatever it held
        (for a caller that writes every element)."""
        if self.lent:
            self._reclaim()
        fits = [i for i, t in enumerate(self.free) if t.numel() >= n and t.dtype == dtype and t.device == device]
        if fits:
            t = self.free.pop(min(fits, key=lambda i: self.free[i].numel()))
            view = t[:n]
            if zero:
                view.zero_()
        else:
            view = torch.zeros(n, dtype=dtype, device=device) if zero else torch.empty(n, dtype=dtype, device=device)
        self.in_use_bytes += n * view.element_size()
        self.peak_bytes = max(self.peak_bytes, self.in_use_bytes)
        return view

    def give(self, t: torch.Tensor) -> None:
        """Take back a buffer :meth:`take` gave (the same view)."""
        self.in_use_bytes -= _nbytes(t)
        base = t._base if t._base is not None else t
        self.free.append(base)
        if len(self.free) > self.limit:
            self.free.pop(min(range(len(self.free)), key=lambda i: self.free[i].numel()))
        if self.keep_bytes is not None:
            while self.free and sum(_nbytes(f) for f in self.free) > self.keep_bytes:
                self.free.pop(max(range(len(self.free)), key=lambda i: _nbytes(self.free[i])))

    def drop(self, t: torch.Tensor) -> None:
        """Account a buffer :meth:`take` gave as given back without keeping it: its memory
        goes with its last user (a world of one's gradient at stages 1-3, which is the
        buffer itself)."""
        self.in_use_bytes -= _nbytes(t)

    def lend(self, t: torch.Tensor) -> None:
        """Take back a buffer whose views went out as gradients (stage 0's reduced groups,
        DDP's ``gradient_as_bucket_view``): it is reused only once nothing else holds a view
        of it, so a gradient a user kept past the step is never overwritten."""
        self.in_use_bytes -= _nbytes(t)
        self.lent.append(t._base if t._base is not None else t)

    def _reclaim(self) -> None:
        still = []
        for base in self.lent:
            (self.free if _only_holder(base) else still).append(base)
        self.lent = still
        while len(self.free) > self.limit:
            self.free.pop(min(range(len(self.free)), key=lambda i: self.free[i].numel()))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage_uses(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


_SOLE = _storage_uses(torch.empty(1)) if hasattr(torch._C, "_storage_Use_Count") else None


def _only_holder(t: torch.Tensor) -> bool:
    """Whether ``t`` is the only tensor using its storage (no view of it is alive)."""
    return _SOLE is not None and _storage_uses(t) == _SOLE


class HostGradients:
    """Host buffers that each group's reduced gradient piece is copied into the moment its
    reduction completes, while backward goes on (ZeRO-Offload, as DeepSpeed's stage 1-2
    offload copies each partition's gradient to the host during backward): the device holds
    a few groups' buffers at a time, never this rank's whole gradient, and the optimizer on
    the host reads the copies. One buffer per group, kept between steps (a fresh one would be
    page-faulted in every step), page-locked with ``pin`` (CUDA only), where the copy is
    asynchronous until :meth:`wait`.

    Example (on a CPU the copy is a plain one, counted all the same):
        >>> from fzero.distributed import comm
        >>> host, before = HostGradients(pin=False), comm.traffic.copy()
        >>> out = host.copy(0, torch.ones(4), valid=3); host.wait()
        >>> out.tolist(), (comm.traffic - before).copy_bytes()["d2h"]
        ([1.0, 1.0, 1.0, 0.0], 12)
    """

    def __init__(self, pin: bool):
        self.pin = pin and torch.cuda.is_available()
        self.buffers: dict[int, torch.Tensor] = {}
        self._device: torch.device | None = None  # where asynchronous copies are outstanding

    def copy(self, gi: int, r: torch.Tensor, valid: int) -> torch.Tensor:
        """Group ``gi``'s reduced piece ``r`` in its host buffer: its first ``valid`` elements
        (the rest is padding past the group's end: zero)."""
        buf = self.buffers.get(gi)
        if buf is None or buf.shape != r.shape or buf.dtype != r.dtype:
            buf = self.buffers[gi] = torch.zeros(r.shape, dtype=r.dtype, pin_memory=self.pin)
        later = self.pin and r.is_cuda
        comm.copy_(buf[:valid], r[:valid], kind="d2h", non_blocking=later)
        if later:
            self._device = r.device
        return buf

    def wait(self) -> None:
        """Every copy made so far has landed (the host may read the buffers)."""
        if self._device is not None:
            torch.cuda.current_stream(self._device).synchronize()
            self._device = None


class ReduceSink:
    """Receives gradients during backward and reduces them group by group.

    Groups are launched in the layout's ``reduce_order`` (backward's order, the same on
    every rank, so the collectives match), each as soon as it and every group before it in
    that order is complete: at ZeRO-3 the last block's reduce-scatter starts while the
    blocks before it are still in backward.

    Under accumulation at stages 0-1 a sink may hold instead of reduce (``hold`` given): it
    only adds the gradients into its buffers, which the next micro-batch's sink starts from
    (``held``), and :meth:`finish` returns the placeholders ``hold``; the update's last sink
    reduces the sum.

    Args:
        layout: the flat groups of the trainable parameters.
        leaf_names: the differentiated leaves' names in flatten order; a name outside the
            layout is an argument beside the parameters (its gradient is kept local).
        group, world, stage: the ``dp`` process group, its size and the ZeRO stage.
        reduce_in: the reduction dtype asked for (``None``: see :func:`reduce_dtype`; in a
            world of one, where nothing is summed, the gradients' own dtype).
        pool: where stage 1-3 send buffers come from and go back to.
        timeout_s: of every collective.
        held: stages 0-1: group buffers holding earlier micro-batches' sum.
        hold: placeholders by name, to return instead of reducing.
        summed: the result is a sum over micro-batches (kept in fp32 at least).
        on_complete: called with a group's index once every gradient of it has arrived
            (ZeRO-3 frees the unit then).
        on_value: called with the loss before backward starts (the loss's mean over the
            ranks is launched then, to overlap backward).
        overlap: launch each group's collective as soon as it is complete, while backward
            goes on; ``False`` launches them all once backward is done (DeepSpeed's
            ``overlap_comm: false``: the same sums, later, with every bucket held at once).
        certificate: stages 1-3, a ``fzero.transforms._skip.Certificate`` to give, for the
            gradients :meth:`finish` returns, how many ranks' local gradient had a sum of
            squares that is not finite: each group's buffer is looked at as it is launched
            and the count is all-reduced beside the last reduce-scatter (``check_finite``
            then needs no all-reduce of its own). Ignored when the sink holds; a gradient
            kept local (an argument's) is not among the leaves it is given for, so the check
            counts exactly there.
        to_host: stages 1-3, where the reduced pieces are the update's gradients and the
            optimizer runs on the host (``offload_optimizer``): each group's piece, averaged
            and in the dtype :func:`gradients` gives it, is copied there as its reduction
            completes, and the device's buffer is let go; :meth:`finish` returns the host
            copies.
    """

    def __init__(self, layout: Layout, leaf_names: list[str], *, group, world: int, stage: int,
                 reduce_in: torch.dtype | None, pool: BufferPool, timeout_s: float,
                 held: dict[int, torch.Tensor] | None = None, hold: dict[str, Any] | None = None,
                 summed: bool = False, on_complete: Callable[[int], None] | None = None, overlap: bool = True,
                 on_value: Callable[[torch.Tensor], None] | None = None, certificate: Any = None,
                 to_host: HostGradients | None = None):
        self.layout, self.group, self.world, self.stage = layout, group, world, stage
        self.overlap = overlap  # launch each group as it completes (else all at finish)
        self.reduce_in, self.pool, self.timeout_s = reduce_in, pool, timeout_s
        # A world of one that sums nothing (no other rank, no earlier micro-batch here or to
        # come): a gradient is its own reduction, and a wider buffer would give back its very
        # bits (a bf16 value cast to fp32 and back). In its own dtype backward accumulates it
        # in place, without a hook per parameter (takes_after_backward).
        self.own_dtype = world == 1 and reduce_in is None and not summed and not held and hold is None
        self.leaf_names = leaf_names  # the leaves in flatten order
        self.leaf_groups = [layout.where.get(n) for n in leaf_names]  # (group, position); None: not a parameter
        self.missing = [set(range(len(g.names))) for g in layout.groups]
        self.buffers: dict[int, torch.Tensor] = dict(held or {})
        self.carried = set(self.buffers)  # groups whose buffer holds earlier micro-batches' sum
        self.hold = hold
        self.summed = summed  # the result is a sum over micro-batches
        self.on_complete, self.on_value = on_complete, on_value
        self.pending: dict[int, comm.Pending] = {}
        self.results: dict[int, torch.Tensor] = {}
        self.to_host = to_host if stage >= 1 and hold is None else None
        self.settled: set[int] = set()  # groups whose result is final (averaged, cast, on the host)
        # Frozen leaves have no gradient to certify (see the docstring for a local one).
        certifies = stage >= 1 and world > 1 and hold is None
        self.certificate = certificate if certifies else None
        self.local_bad: torch.Tensor | None = None  # ranks' local sums of squares not finite, so far
        self.order = layout.reduce_order
        self.next = 0  # position in ``order`` of the next group to launch
        self.sending: dict[int, torch.Tensor] = {}  # stages 1-3: send buffers in flight, oldest first
        self.local: dict[str, torch.Tensor] = {}  # gradients of arguments other than the parameters
        # One group (a model smaller than the bucket; at stage 3 no unit): nothing can overlap
        # its one collective, so backward runs without a hook per parameter (see takes_after_backward).
        self.one_group = len(layout.groups) == 1 and on_complete is None

    def _dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype gradients of ``dtype`` are reduced in here."""
        return dtype if self.own_dtype else reduce_dtype(dtype, self.reduce_in)

    def _buffer(self, group, dtype: torch.dtype, *, zero: bool = False) -> torch.Tensor:
        """A reduce buffer for ``group``, from the pool (reusing resident memory instead of
        faulting in fresh pages every step). Not zeroed: the gradients are copied over it, its
        padding is zeroed here, and the slots of parameters no gradient reached are zeroed
        before it is reduced or held (:meth:`_zero_missing`) -- one pass over the whole buffer
        less per step."""
        while len(self.sending) >= MAX_IN_FLIGHT:  # see MAX_IN_FLIGHT (stages 1-3)
            self._complete(next(iter(self.sending)))
        buf = self.pool.take(group.padded, dtype, group.device, zero=zero)
        if not zero:
            buf[group.numel:].zero_()
        return buf

    def _zero_missing(self, gi: int, buf: torch.Tensor) -> None:
        """Zero the slots of group ``gi``'s fresh buffer that no gradient was copied into (a
        buffer carried from an earlier micro-batch keeps its sums there)."""
        if gi in self.carried or not self.missing[gi]:
            return
        group = self.layout.groups[gi]
        for pos in self.missing[gi]:
            o = group.offsets[pos]
            buf[o: o + math.prod(group.shapes[pos])].zero_()

    def _slot(self, i: int, g: torch.Tensor) -> tuple[int, torch.Tensor] | None:
        """``(group, the view of its reduce buffer that leaf i's gradient goes to)``, the
        buffer taken from the pool at the group's first gradient; the leaf is no longer
        missing. ``None`` for a differentiated argument beside the parameters, whose
        gradient is kept as it is (this rank's share of the global gradient)."""
        if self.leaf_groups[i] is None:
            self.local[self.leaf_names[i]] = g / self.world
            return None
        return self._view(i, self._dtype(g.dtype))

    def _view(self, i: int, dtype: torch.dtype, *, zero: bool = False) -> tuple[int, torch.Tensor]:
        """``(group, leaf i's 1-D slot in the group's reduce buffer)``, the buffer (of
        ``dtype``; ``zero``: zeroed whole) taken from the pool at the group's first leaf; the
        leaf is no longer missing."""
        gi, pos = self.leaf_groups[i]
        group = self.layout.groups[gi]
        buf = self.buffers.get(gi)
        if buf is None:
            buf = self.buffers[gi] = self._buffer(group, dtype, zero=zero)
        o = group.offsets[pos]
        self.missing[gi].discard(pos)
        return gi, buf[o: o + math.prod(group.shapes[pos])]

    def on_grad(self, i: int, g: torch.Tensor) -> None:
        if (slot := self._slot(i, g)) is None:
            return
        gi, dst = slot
        if gi in self.carried:
            dst.add_(g.reshape(-1))
        else:
            dst.copy_(g.reshape(-1))
        if self.on_complete is not None and not self.missing[gi]:
            self.on_complete(gi)
        if self.hold is None and self.overlap:
            self._launch_ready()

    def takes_after_backward(self, leaves: list[torch.Tensor]) -> bool:
        """Whether this backward's gradients (of ``leaves``) come in at once, after it
        (``fzero.core._backward_into``): one group (at stage 3, no unit), whose one collective
        nothing can overlap, and gradients of the buffer's dtype, which backward accumulates
        in place (:meth:`grad_buffers`), as a C++ reducer would take them. Gradients reduced
        in another dtype (bf16 summed in fp32) come in one by one instead, each freed once
        copied, so that autograd's whole gradient is never held beside the buffer."""
        return self.one_group and all(self._dtype(d) == d for d in {x.dtype for x in leaves})

    def grad_buffers(self, indices: list[int], leaves: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """After :meth:`takes_after_backward`: for each of ``leaves`` (leaf ``indices[k]``), the view of its
        group's reduce buffer for backward to accumulate its gradient into as its ``.grad``
        (zeroed, or an earlier micro-batch's sum), so that autograd's gradients are never
        held beside the buffers (DDP's ``gradient_as_bucket_view``); ``None`` where a leaf
        is an argument beside the parameters: that gradient comes in as autograd's own.
        (The buffer's dtype is the leaves', or :meth:`takes_after_backward` said no.)
        :meth:`on_accumulated` takes them after backward."""
        views: list[torch.Tensor | None] = []
        for i, leaf in zip(indices, leaves):
            if self.leaf_groups[i] is None:
                views.append(None)
                continue
            # its slot holds a value from now on: zero, or the sum so far
            views.append(self._view(i, leaf.dtype, zero=True)[1].view(leaf.shape))
        return views

    def on_accumulated(self, indices: list[int], grads, views: list[torch.Tensor | None]) -> None:
        """After a backward that accumulated into :meth:`grad_buffers`' views: ``grads`` are
        the leaves' ``.grad``. A gradient autograd did not accumulate in place (it replaced
        the view) is added into it; those without a view come in as :meth:`on_grads`'."""
        rest, rest_grads = [], []
        for i, g, view in zip(indices, grads, views):
            if view is None:
                rest.append(i)
                rest_grads.append(g)
            elif g is not None and g is not view:
                view.add_(g.reshape(view.shape))
        self.on_grads(rest, rest_grads)

    def on_grads(self, indices: list[int], grads) -> None:
        """Every gradient of backward at once (:meth:`takes_after_backward`): ``grads[k]`` is leaf
        ``indices[k]``'s (``None`` where the loss did not reach it)."""
        copy_dst, copy_src, add_dst, add_src = [], [], [], []
        for i, g in zip(indices, grads):
            if g is None or (slot := self._slot(i, g)) is None:
                continue
            gi, view = slot
            dst, src = (add_dst, add_src) if gi in self.carried else (copy_dst, copy_src)
            dst.append(view)
            src.append(g.reshape(-1))
        if copy_dst:
            torch._foreach_copy_(copy_dst, copy_src)
        if add_dst:
            torch._foreach_add_(add_dst, add_src)
        if self.hold is None and self.overlap:
            self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        while self.next < len(self.order) and (force or not self.missing[self.order[self.next]]):
            self._launch(self.order[self.next])
            self.next += 1

    def _launch(self, gi: int) -> None:
        group = self.layout.groups[gi]
        buf = self.buffers.pop(gi, None)
        if buf is None:  # no parameter of this group reached the loss
            buf = self._buffer(group, self._dtype(group.dtype), zero=True)
        else:
            self._zero_missing(gi, buf)
        if self.world == 1:  # nothing to reduce: the buffer is the gradient, not copied
            self.results[gi] = buf if self.stage == 0 else buf[: group.chunk]
            if self.stage >= 1:  # its memory goes with the gradient (never kept between steps)
                self.pool.drop(buf)
                self._settle(gi)
            return
        if self.stage == 0:
            self.pending[gi] = comm.start(
                f"all_reduce(gradient group {gi}, {group.padded} elements)",
                lambda: comm.all_reduce(buf, group=self.group, async_op=True, what="gradients"),
                lambda: buf, where=WHERE)
        else:
            if self.certificate is not None:
                acc = torch.promote_types(buf.dtype, torch.float32)
                bad = (~torch.isfinite(torch.linalg.vector_norm(buf, dtype=acc))).to(torch.float32)
                self.local_bad = bad if self.local_bad is None else self.local_bad + bad
            out = torch.empty(group.chunk, dtype=buf.dtype, device=buf.device)
            self.pending[gi] = comm.start(
                f"reduce_scatter(gradient group {gi}, {group.padded} elements)",
                lambda: comm.reduce_scatter_flat(out, buf, group=self.group, async_op=True, what="gradients"),
                lambda: out, where=WHERE)
            self.sending[gi] = buf
            # Bound what is in flight: beyond MAX_IN_FLIGHT buckets, wait for the oldest, so
            # a rank holds its gradient partition plus a few buckets, never the full gradient.
            while len(self.sending) > MAX_IN_FLIGHT:
                self._complete(next(iter(self.sending)))

    def _complete(self, gi: int) -> None:
        self.results[gi] = self.pending.pop(gi).wait(self.timeout_s)
        self.pool.give(self.sending.pop(gi))
        self._settle(gi)

    def _settle(self, gi: int) -> None:
        """With :attr:`to_host`: group ``gi``'s reduced piece made final -- averaged over the
        ranks and cast as :func:`gradients` would, on the device, in that order (the same
        bits) -- and copied to the host; the device's copy goes with its last reference.
        (On a CPU, where the host is the device, nothing is moved early, unless
        ``device_check.pretend()`` tells them apart, as on a GPU.)"""
        group, r = self.layout.groups[gi], self.results[gi]
        if self.to_host is None or device_check.in_host_memory(r):
            return  # the gradient is in host memory already (on a CPU the host is the device)
        if self.world > 1:
            r.div_(self.world)
        dtype = torch.promote_types(group.dtype, torch.float32) if self.summed else group.dtype
        if r.dtype != dtype:
            r = r.to(dtype)
        valid = max(0, min(group.numel - group.rank * group.chunk, group.chunk))  # the rest is padding
        self.results[gi] = self.to_host.copy(gi, r, valid)
        self.settled.add(gi)

    def finish(self) -> list[Any]:
        """The gradient leaves in flatten order (``None`` for frozen ones): this rank's share
        of the reduced gradients, or the placeholders ``hold`` when the sink only held."""
        if self.hold is not None:
            for gi, buf in self.buffers.items():  # held for the next micro-batch to add into
                self._zero_missing(gi, buf)
            grads = self.hold
        else:
            self._launch_ready(force=True)
            certified = None
            if self.certificate is not None and self.local_bad is not None:
                flag = self.local_bad  # beside the last reduce-scatter: no wait of its own
                certified = comm.start("all_reduce(finite certificate)", lambda: comm.all_reduce(
                    flag, group=self.group, async_op=True, what="psum"), lambda: flag, where=WHERE)
            for gi in list(self.pending):
                if gi in self.sending:
                    self._complete(gi)
                else:
                    self.results[gi] = self.pending.pop(gi).wait(self.timeout_s)
            if self.world > 1:
                for gi, r in self.results.items():
                    if gi not in self.settled:
                        r.div_(self.world)
            if self.to_host is not None:
                self.to_host.wait()
            grads = gradients(self.layout, self.results, stage=self.stage, group=self.group, keep_fp32=self.summed)
            if self.stage == 0:  # the gradients are views of the reduced buffers
                for r in self.results.values():
                    self.pool.lend(r)
            if certified is not None:
                self.certificate.give(certified.wait(self.timeout_s), [getattr(g, "local", g) for g in grads.values()])
        return [self.local[n] if n in self.local else grads.get(n) for n in self.leaf_names]  # frozen: None


def gradients(layout: Layout, results: dict[int, torch.Tensor], *, stage: int, group=None,
              keep_fp32: bool = False) -> dict[str, Any]:
    """Per-parameter gradients from the reduced group buffers ``results`` (by group index):
    full tensors at stage 0, this rank's pieces (``Shard``) at stages 1-3. ``keep_fp32``: a
    sum over micro-batches stays in fp32 at least (``accumulate`` sums in fp32 anyway; k
    times one micro-batch's gradient could overflow fp16)."""
    out = {}
    for g in layout.groups:
        r = results[g.index]
        dtype = torch.promote_types(g.dtype, torch.float32) if keep_fp32 else g.dtype
        if r.dtype != dtype:  # reduced in fp32, kept in the parameters' dtype
            r = r.to(dtype)
        if stage == 0:
            out.update(zip(g.names, g.views(r)))
            continue
        out.update(zip(g.names, g.pieces(r, group)))
    return out
