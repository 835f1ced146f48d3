"""``check_finite``: what an update with a non-finite gradient does, at full precision.

Under fp16 and bf16 :func:`fzero.mixed_precision` already checks every update (DeepSpeed's
loss scaler and ``bf16.check_grad_overflow``). In fp32 nothing did, so one inf or NaN
gradient turned every parameter into NaN while ``state.step`` counted on. This transform
gives the choice: skip the update and report it (DeepSpeed's behaviour under its
overflow checks, and fzero's default), or fail fast naming the non-finite gradients.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from fzero import tree
from fzero.distributed import device_check
from fzero.optim.clipping import global_sumsq, known_sumsq
from fzero.optim.fused import back_to_back, span
from fzero.transforms.shard_state import is_shard
from fzero.core import (Handler, NotApplied, Step, as_step, collecting_metrics, context, emit_metric, installed, psum,
                        running)
from fzero.transforms._deferred import is_deferred
from fzero.transforms._skip import BufferGuard, Certificate, SkipStreak, update_under_verdict

__all__ = ["NonFiniteGradientError", "check_finite"]

WHERE = "fzero.check_finite"
MODES = ("skip", "raise")


class NonFiniteGradientError(FloatingPointError):
    """An update's gradient held inf or NaN under ``nonfinite="raise"``. ``paths`` are the
    key paths of every non-finite gradient, in the tree's order; the state is untouched."""

    def __init__(self, message: str, paths: list[str], step: int):
        super().__init__(message)
        self.paths, self.step = paths, step


def _device_of(leaves: list, state) -> torch.device | None:
    """Where a flag about ``leaves`` lives: theirs, or the parameters' when there are none
    (under NCCL a host flag could not be reduced)."""
    tensors = leaves or [p for p in tree.leaves(state.params) if isinstance(p, torch.Tensor)]
    return tensors[0].device if tensors else None


def _groups(leaves: list) -> list[list[int]]:
    """The indices of ``leaves`` that can hold a non-finite value, by device and dtype."""
    groups: dict[tuple, list[int]] = {}
    for i, g in enumerate(leaves):
        if g.numel() and (g.is_floating_point() or g.is_complex()):
            groups.setdefault((g.device, g.dtype), []).append(i)
    return list(groups.values())


def nonfinite_flags(leaves: list, state) -> torch.Tensor:
    """1.0 for each of ``leaves`` that holds an inf or NaN, else 0.0: an fp32 vector on their
    device, in their order.

    One multi-tensor max-abs (``torch._foreach_norm(ord=inf)``, which propagates NaN) per
    device and dtype, not a chain of element-wise kernels per leaf: on a GPU the check is a
    handful of launches whatever the number of parameters (on the CPU a multi-tensor 2-norm,
    the faster kernel there, with a second look at a leaf whose sum of squares is not
    finite: :func:`_bad_by_norm`). A max-abs or a min and max is finite exactly when every
    element is; empty leaves are finite.
    """
    device = _device_of(leaves, state)
    groups = _groups(leaves)
    if len(groups) == 1 and len(groups[0]) == len(leaves):  # the usual case: one kernel, in order
        return _bad(leaves, device)
    flags = torch.zeros(len(leaves), dtype=torch.float32, device=device)
    for idx in groups:
        flags.index_copy_(0, torch.tensor(idx, device=device), _bad([leaves[i] for i in idx], device))
    return flags


def _bad(leaves: list, device) -> torch.Tensor:
    """1.0 per leaf (one device, one dtype) holding an inf or NaN."""
    bad = _bad_by_norm(leaves) if device_check.is_host_device(leaves[0].device) else _bad_by_peak(leaves)
    return bad.to(device=device, dtype=torch.float32)


def _bad_by_peak(leaves: list) -> torch.Tensor:
    return ~torch.isfinite(torch.stack(torch._foreach_norm(leaves, math.inf)))


def _bad_by_norm(leaves: list) -> torch.Tensor:
    """On the CPU, where the inf-norm is a slow path (37 ms for a 10.8M-parameter GPT's
    gradients against 4.4 for the 2-norm) and a min-max per leaf costs the host a dispatch
    each: one multi-tensor 2-norm (torch's vectorised path, as the clip's), whose result is
    finite exactly when the leaf is, unless a finite leaf's sum of squares overflows
    (elements beyond about 1.8e19 in fp32): a leaf whose norm is not finite is looked at
    again, by its min and max. The host reads the verdict of the first pass, which on the
    CPU costs nothing."""
    real = [torch.view_as_real(x) if x.is_complex() else x for x in leaves]
    norms = torch._foreach_norm(real, 2, dtype=torch.float32 if real[0].dtype != torch.float64 else None)
    bad = ~torch.isfinite(torch.stack(norms))
    if bad.any():
        for i in bad.nonzero().flatten().tolist():
            lo, hi = torch.aminmax(real[i])
            bad[i] = not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)))
    return bad


def nonfinite_by_norm(grads):
    """The verdict on ``grads`` (keyed as ``state.params``; ZeRO pieces allowed) that a clip by
    global norm gives: ``(flag, known)``, ``flag`` 1.0 where the global sum of squares is not
    finite -- exactly when some element is not, unless the sum itself overflows (elements
    past about 1e19, where the clip would scale the update to zero), which counts too -- and
    ``known`` the block (``optim.known_sumsq``) inside which the clip reuses that sum instead
    of taking it again: one pass over the gradients and one ``psum`` for both.

    Example:
        >>> import torch
        >>> flag, known = nonfinite_by_norm({"w": torch.tensor([1.0, float("inf")])})
        >>> float(flag)
        1.0
    """
    # In fzero's view of the trees (a handler's) a Shard flattens to its piece already: no
    # walk that stops at each one to take it.
    local = tree.map(lambda g: g.local if is_shard(g) else g, grads, is_leaf=is_shard) if tree.in_user_view() else grads
    sumsq = global_sumsq(local)
    return (~torch.isfinite(sumsq)).to(torch.float32), known_sumsq(local, sumsq)


def count_nonfinite(leaves: list, state) -> torch.Tensor:
    """More than 0 exactly when some of ``leaves`` holds an inf or NaN: a 0-dim fp32 tensor
    on their device, counting the non-finite leaves, where leaves that lie back to back in
    one storage (the views of a reduced flat buffer) count as one (:func:`_spans`).

    It is an *any*, so it goes to ``psum`` as a bare tensor: a leaf held whole by every tp
    rank is counted tp times, and the count is still > 0 exactly when some gradient is not
    finite (no LeafSums, no per-leaf vector).
    """
    total = torch.zeros((), dtype=torch.float32, device=_device_of(leaves, state))
    spans = _spans(leaves)
    for idx in _groups(spans):  # in no particular order: no index to copy to the device
        total = total + _bad([spans[i] for i in idx], total.device).sum()
    return total


def _spans(leaves: list) -> list:
    """``leaves`` with each run of contiguous leaves that lie back to back in one storage
    (the gradients as views of a reduced flat buffer: :func:`fzero.optim.fused.back_to_back`,
    the fused update's runs) replaced by one tensor over the run: the same elements, one
    tensor for the check instead of one per leaf. Any other leaf stays as it is; empty ones
    go. Leaves that share no storage (a world of one's autograd gradients) are not searched."""
    if len({t.untyped_storage().data_ptr() for t in leaves}) == len(leaves):  # no two share a storage
        return [t for t in leaves if t.numel()]
    runs = back_to_back([leaves], [None] * len(leaves))
    return [leaves[idx[0]] if len(idx) == 1 else span([leaves[i] for i in idx]) for idx in runs]


class _FiniteHandler(Handler):
    def __init__(self, mode: str, by_norm: bool = False):
        self.mode, self.by_norm = mode, by_norm
        self.pending = False  # a deferred micro-batch of this update was not finite
        # The buffers' values before the update's first forward, for a skip or a raise to restore.
        self.guard = BufferGuard(WHERE)
        self.streak = SkipStreak(WHERE)
        self.certificate: Certificate | None = None  # this call's, where a reduction may give one

    def apply_gradients(self, state, grads, *, next):
        # Paths only under "raise", which names the leaves; "skip" runs on every update.
        if self.mode == "raise":
            paths, found, _ = tree.flatten_with_path(grads, is_leaf=is_shard)
        else:  # a Shard flattens to this rank's piece (a handler sees fzero's view of the trees)
            found = tree.leaves(grads)
            paths = [None] * len(found)
        pieces = [(path, g.local if is_shard(g) else g) for path, g in zip(paths, found)]  # this rank's
        pieces = [(path, g) for path, g in pieces if isinstance(g, torch.Tensor) and not is_deferred(g)]
        leaves = [g for _, g in pieces]
        if self.certificate is not None and len(leaves) == len(found):
            # ZeRO's reduction certified these very gradients (Certificate): every rank's
            # local sum of squares was finite, so the reduced gradient is; no count, no psum.
            verdict = self.certificate.take(leaves)
            if verdict is not None and not bool(verdict > 0):  # on the host already (gloo)
                return self._under_verdict(state, grads, torch.zeros((), dtype=torch.float32, device=verdict.device),
                                           next)
        if self.mode == "skip" and self.by_norm and len(leaves) == len(found):
            flag, known = nonfinite_by_norm(grads)  # the clip's global norm decides
            with known:
                return self._under_verdict(state, grads, flag, next)
        if self.mode == "raise":
            # One flag per leaf, summed over the ranks (each holds its pieces of the
            # gradients under ZeRO): every rank learns which leaves, and all raise together.
            flags = nonfinite_flags(leaves, state)
        else:
            flags = count_nonfinite(leaves, state)
        flags = psum(flags)
        if self.mode == "raise":
            bad = [tree.keystr(p) for (p, _), f in zip(pieces, flags.tolist()) if f > 0]
            if bad:
                self.guard.finish(skipped=True)  # "the state is unchanged": its buffers too
                step = int(state.step)
                shown = ", ".join(f"grads{b}" for b in bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
                raise NonFiniteGradientError(
                    f"{WHERE}: the gradient of update {step + 1} is not finite (inf or NaN) at {shown}; "
                    "the state is unchanged. Compile with nonfinite=\"skip\" to skip such updates instead",
                    bad, step)
            new = next(state, grads)
            if not (isinstance(new, NotApplied) and new.reason == "deferred"):
                self.guard.finish(skipped=False)
            return new
        return self._under_verdict(state, grads, flags, next)

    def _under_verdict(self, state, grads, flags: torch.Tensor, next):
        new, overflow = update_under_verdict(flags, self.pending, lambda: next(state, grads))
        if isinstance(new, NotApplied) and new.reason == "deferred":  # an accumulation outside
            self.pending = overflow
            return new
        self.pending = False
        emit_metric("skipped", torch.tensor(overflow))
        self.guard.finish(skipped=overflow)
        self.streak.record(overflow, lambda: "their gradients held inf or NaN (nonfinite=\"raise\" stops at the "
                           "first such update and names the gradients)", step=int(state.step))
        if overflow:  # the parameters, the optimizer state, state.step and the buffers stay as they were
            return NotApplied(state, "skipped")
        return new



def check_finite(step, mode: Literal["skip", "raise"] = "skip", *, by_norm: bool = False) -> Step:
    """``step`` with its updates checked for non-finite gradients.

    ``"skip"``: an update whose gradients hold inf or NaN on any rank is skipped by every
    rank (parameters, optimizer state, schedule count, ``state.step`` and the buffers the
    forward changed, such as BatchNorm's running statistics, as they were before the step)
    and ``metrics["skipped"]`` says so, as DeepSpeed skips an overflowed update; after
    ``fzero.transforms._skip.WARN_AFTER`` (10) skips in a row a ``RuntimeWarning`` says the
    run is not training. ``"raise"``: such an update raises :class:`NonFiniteGradientError`
    on every rank, naming the key path of each non-finite gradient, with the state as it was
    (buffers included). Under accumulation the verdict is for the whole update (every
    micro-batch of it), and the buffers go back to before its first micro-batch.

    ``fzero.compile`` applies it in fp32 (``nonfinite=``, default ``"skip"``); under fp16
    and bf16 ``fzero.mixed_precision`` checks instead (and ``nonfinite="raise"`` adds this).

    ``by_norm`` (``"skip"`` only; ``fzero.compile`` sets it with ``clip_norm``): the verdict
    is the gradients' global L2 norm, the one the clip takes -- computed and reduced once,
    here, and handed to the clip (:func:`fzero.optim.known_sumsq`) -- instead of a count of
    its own: not finite when an element is inf or NaN, and also when the sum of squares
    overflows though every element is finite (elements beyond about 1e19 in fp32, where the
    clip would scale the update to zero), which is skipped too.

    Example:
        >>> import torch, fzero
        >>> from fzero import optim
        >>> apply, params = fzero.functionalize(torch.nn.Linear(2, 1))
        >>> state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
        >>> def train_step(state, batch):
        ...     loss, g = fzero.value_and_grad(lambda p: state.apply_fn(p, batch).sum())(state.params)
        ...     return state.apply_gradients(g), {"loss": loss}
        >>> step = fzero.check_finite(train_step, "raise")
        >>> step(state, torch.tensor([[float("nan"), 1.0]]))
        Traceback (most recent call last):
        ...
        fzero.transforms.finite.NonFiniteGradientError: fzero.check_finite: the gradient of update 1 is not finite (inf or NaN) at grads['weight']; the state is unchanged. Compile with nonfinite="skip" to skip such updates instead
    """
    if mode not in MODES:
        raise ValueError(f"{WHERE}: mode={mode!r} must be one of {', '.join(map(repr, MODES))}")
    inner = as_step(step)
    handler = _FiniteHandler(mode, by_norm=by_norm and mode == "skip")

    def call(state, batch):
        if context().micro_batch.index == 0:  # an update starts: its forwards are about to change the buffers
            handler.guard.keep(getattr(state, "buffers", None))
        # "skip" without a clip takes a verdict a reduction outside may give for free
        # (Certificate); with a clip the norm decides (by_norm), "raise" counts per leaf.
        handler.certificate = Certificate() if handler.mode == "skip" and not handler.by_norm else None
        with collecting_metrics() as emitted, installed(handler), running(finite_certificate=handler.certificate):
            out = inner(state, batch)
        for k, v in emitted.items():
            emit_metric(k, v)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
            return out  # not (state, metrics): fzero.compile names what the step returned
        return out[0], {**out[1], **emitted}

    return Step(call, name=f"check_finite({inner.__name__}, {mode})", inner=inner)
