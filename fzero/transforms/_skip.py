"""What a skipped update owes beyond its parameters: the buffers as they were before the
step, and a word when updates go on being skipped.

``check_finite`` and ``mixed_precision`` decide to skip an update only after the forward has
run, and the forward updates buffers in place (BatchNorm's running statistics and its
counter). A skipped update must leave every tensor of the state as it was (SPEC), so each of
the two keeps the pre-update values of the buffers the forward changes and writes them back
on a skip (:class:`BufferGuard`), and counts its skips in a row (:class:`SkipStreak`). Both
run the update with their verdict still on the device (:func:`update_under_verdict`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from fzero import tree
from fzero.core import context, running

__all__ = ["BufferGuard", "Certificate", "SkipStreak", "WARN_AFTER", "update_under_verdict"]

# A streak of this many skipped updates in a row is reported once. DeepSpeed logs every
# skipped step; most skips are fp16's dynamic scaler finding its scale: from 2^16 with
# DeepSpeed's hysteresis of 2 it skips k + 1 updates to lower the scale 2^k-fold, and the
# scales real runs settle at (2^10 to 2^14) are reached within 7 skips. Ten in a row is
# past that, and under bf16 or fp32, which skip only on inf/NaN gradients, already a run
# that is not training.
WARN_AFTER = 10


class Certificate:
    """A verdict on an update's gradients that a reduction outside ``check_finite`` gives for
    free, handed over within one step (the step context's ``finite_certificate``).

    ZeRO 1-3 on gloo (``shard_state``'s reduce sink) all-reduces, beside its last
    reduce-scatter, how many ranks' *local* gradient had a sum of squares that is not finite
    (:meth:`give`). When none had, every local element was finite and below about 1.8e19
    in magnitude, so their sum over the ranks -- every element of the reduced gradient --
    is finite: the check needs no count and no all-reduce of its own. When one had, the
    check makes its exact count. :meth:`take` answers only for the very tensors given,
    unwritten since (identity and version counter): gradients a step changed in between get
    the exact count.
    """

    __slots__ = ("verdict", "leaves")

    def __init__(self):
        self.verdict: torch.Tensor | None = None
        self.leaves: tree.Unchanged | None = None

    def give(self, verdict: torch.Tensor, leaves: list[torch.Tensor]) -> None:
        """``verdict`` (a 0-dim count, agreed across the ranks) holds for ``leaves``."""
        self.verdict, self.leaves = verdict, tree.Unchanged(leaves)

    def take(self, leaves: list[torch.Tensor]) -> torch.Tensor | None:
        """The verdict given for exactly ``leaves``, unchanged since, else ``None``; it is
        taken once."""
        verdict, known = self.verdict, self.leaves
        self.verdict, self.leaves = None, None
        return verdict if verdict is not None and known.holds(leaves) else None


def update_under_verdict(flag: torch.Tensor, pending: bool, update: Callable[[], Any]) -> tuple[Any, bool]:
    """Run ``update()`` with the verdict on its gradients still on the device; then read it.

    ``flag`` is this transform's count of non-finite gradients (0-dim, on the device, agreed
    across ranks); ``pending`` says a deferred micro-batch of this update was not finite; a
    verdict from a transform outside (the step context's ``skip_flag``) counts too. The update
    runs with the sum as the step context's ``skip_flag`` (a discarded update writes nothing
    of its input: core's ``update``), and the host reads it once, with the update already on
    its way. Returns what the update returned and whether it is to be discarded.
    """
    if pending:
        flag = flag + 1.0
    outer = context().skip_flag
    if outer is not None:
        flag = flag + outer
    with running(skip_flag=flag):
        new = update()
    return new, bool(flag > 0)


class BufferGuard:
    """The pre-update values of the buffers the forward changes, for a skipped update to
    write back.

    ``keep(buffers)`` at the start of an update (before its first micro-batch's forward)
    copies the buffers earlier updates were seen to change -- every buffer at the first
    update, when nothing has been seen yet -- packed into one flat tensor per dtype (one
    copy kernel each). ``finish(skipped)`` at the verdict learns which buffers this update
    changed (at the first update by their values; at every update by their version
    counters, which in-place writes through autograd-visible ops bump -- BatchNorm's CPU
    kernel does not bump its running statistics', hence the values), writes the copies back
    when the update is skipped, and drops them. The cost of an applied update is one copy of
    the changing buffers (BatchNorm's statistics: 2 floats per channel), nothing for a model
    whose forward changes none.

    Example:
        >>> import torch
        >>> bn = torch.nn.BatchNorm1d(2)
        >>> buffers = dict(bn.named_buffers())
        >>> guard = BufferGuard("example")
        >>> guard.keep(buffers)
        >>> _ = bn(torch.randn(4, 2))            # the forward moves the statistics
        >>> guard.finish(skipped=True)           # the update was skipped: they go back
        >>> buffers["running_mean"].tolist(), int(buffers["num_batches_tracked"])
        ([0.0, 0.0], 0)
        >>> sorted(guard.changing)
        ['num_batches_tracked', 'running_mean', 'running_var']
    """

    def __init__(self, where: str):
        self.where = where
        self.changing: frozenset[str] | None = None  # the buffers forwards were seen to change
        self._kept = None

    def keep(self, buffers: dict[str, torch.Tensor] | None) -> None:
        """Copy what a skip of the update starting now would have to restore."""
        if not buffers or not all(isinstance(b, torch.Tensor) for b in buffers.values()):
            self._kept = None
            return
        names = [n for n in buffers if self.changing is None or n in self.changing]
        by_dtype: dict[torch.dtype, list[str]] = {}
        for n in names:
            by_dtype.setdefault(buffers[n].dtype, []).append(n)
        with torch.no_grad():
            flats = [(ns, torch.cat([buffers[n].detach().reshape(-1) for n in ns])) for ns in by_dtype.values()]
        self._kept = (buffers, flats, {n: b._version for n, b in buffers.items()})

    def finish(self, skipped: bool) -> None:
        """The update's verdict is in: restore the kept values if it was ``skipped``."""
        if self._kept is None:
            return
        buffers, flats, versions = self._kept
        self._kept = None
        saved = {}
        for ns, flat in flats:
            for n, v in zip(ns, flat.split([buffers[n].numel() for n in ns])):
                saved[n] = v.view(buffers[n].shape)
        changed = {n for n, b in buffers.items() if b._version != versions.get(n, b._version)}
        if self.changing is None:  # the first update: every buffer was kept, compare values
            changed |= {n for n, v in saved.items() if n not in changed and not torch.equal(v, buffers[n])}
        lost = sorted(n for n in changed if n not in saved)
        self.changing = frozenset(changed | (self.changing or frozenset()))
        if not skipped:
            return
        with torch.no_grad():
            for n, v in saved.items():
                buffers[n].copy_(v)
        if lost:
            warnings.warn(f"{self.where}: the skipped update's forward changed the buffers {lost}, which no "
                          "earlier update changed, so their values before the step were not kept and they "
                          "stay changed; from now on they are kept", RuntimeWarning, stacklevel=3)


class SkipStreak:
    """Counts the skipped updates in a row and warns once a streak reaches :data:`WARN_AFTER`
    (on the first rank; the verdict is the same on every rank).

    Example:
        >>> import warnings
        >>> streak = SkipStreak("example")
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     for _ in range(WARN_AFTER + 3):
        ...         streak.record(True, lambda: "non-finite gradients", step=7)
        >>> len(seen), streak.count
        (1, 13)
        >>> streak.record(False, lambda: "", step=7); streak.count
        0
    """

    def __init__(self, where: str):
        self.where = where
        self.count = 0

    def record(self, skipped: bool, reason: Callable[[], str], *, step: int) -> None:
        """One verdict; ``reason()`` says why updates are skipped (called only to warn),
        ``step`` is ``state.step``: the updates applied so far."""
        if not skipped:
            self.count = 0
            return
        self.count += 1
        if self.count != WARN_AFTER:
            return
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_rank() != 0:
            return
        since = f"since update {step}" if step else "since the start"
        warnings.warn(
            f"{self.where}: {self.count} updates in a row were skipped: {reason()}. No update has been applied "
            f"{since}: the model is not training. (Said once per streak.)", RuntimeWarning, stacklevel=2)
