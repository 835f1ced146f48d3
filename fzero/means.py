"""``fzero.global_mean``: a mean over the whole global batch, whatever the layout.

A token-mean loss (a cross-entropy over the valid tokens, ``ignore_index``, padding) divides
by how many tokens count. Computed per micro-batch and per rank, then averaged, it weights
each micro-batch's tokens by one over *its* count: the result depends on how the batch was
split (the bug Hugging Face's Trainer fixed in 2024 with ``num_items_in_batch``).
``global_mean(values, where)`` divides by the count over the whole global batch instead --
every data-parallel rank, every accumulated micro-batch, every pipeline micro-batch -- so the
loss and its gradient are the one-process full-batch ones at any layout.

How the count is known:

* **One unit per rank** (no accumulation, no pipeline): the count is summed over the
  data-parallel ranks at the call (one scalar all-reduce, :func:`fzero.transforms.pmean_data`),
  and the mean is exact there and then, whatever the loss does with it.
* **Several units per rank** (``accumulate``, a pipeline's micro-batches): a unit's backward
  runs before the later units exist, so their counts are not known yet. Each unit divides by
  a provisional count (the first unit's, averaged over the ranks); once the update's last
  unit has run, the step sums the true count, and multiplies the update's gradient -- and the
  loss values ``value_and_grad`` returned -- by ``provisional / true``. That is exact when
  the loss is linear in the global means (a sum of them, times constants), which is checked
  on the autograd graph: anything else between the loss and a global mean, or a path from
  the loss to the parameters that bypasses them, is an error naming the operation. Every
  ``global_mean`` of a step must then count the same elements (one ``where``), or the one
  factor cannot be right for all of them: checked when the count is summed.

A global mean of no counted element is 0 (with a zero gradient), not NaN.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

from fzero import tree
from fzero.core import Handler, context, installed, pmean_data, register_step_scope, rehearsing

__all__ = ["global_mean"]

WHERE = "fzero.global_mean"

# Autograd nodes a loss may have between itself and its global means under deferral: linear
# maps (sums, constant factors, views, casts). Anything else would not scale with the means.
_LINEAR = frozenset({
    "AddBackward0", "SubBackward0", "MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1", "NegBackward0",
    "ToCopyBackward0", "ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0", "SqueezeBackward0",
    "SqueezeBackward1", "SqueezeBackward4", "UnsqueezeBackward0", "CloneBackward0", "AliasBackward0",
    "ExpandBackward0", "SumBackward0", "SumBackward1", "StackBackward0", "CatBackward0", "MeanBackward0",
    "MeanBackward1", "SelectBackward0",
})


class _Ledger(Handler):
    """One step's global means: the deferred counts, the provisional divisor, the factor.

    Installed by the outermost step as its outermost handler; its ``update`` multiplies the
    update's gradients by the factor just before the optimizer sees them."""

    def __init__(self):
        self.counts: list[torch.Tensor] = []  # per global_mean of a unit, its count summed over units
        self.units = 1  # units per rank this update
        self.unit: tuple | None = None  # the running unit, to number the calls within it
        self.call = 0
        self.provisional: torch.Tensor | None = None
        self.outputs: list[Any] = []  # grad_fn of each deferred global mean (the linearity check)
        self.values: list[torch.Tensor] = []  # what value_and_grad returned, to correct in place
        self.factor: torch.Tensor | None = None

    @property
    def deferred(self) -> bool:
        return bool(self.counts)

    def record(self, count: torch.Tensor, units: int, unit: tuple) -> torch.Tensor:
        """A deferred global mean's count; returns the provisional divisor."""
        if self.factor is not None:
            raise RuntimeError(f"{WHERE}: called after the step's update was applied; a global mean belongs to the "
                               "loss of the update")
        if unit != self.unit:
            self.unit, self.call = unit, 0
        i, self.call = self.call, self.call + 1
        count = count.detach().to(torch.float64)
        if i < len(self.counts):
            self.counts[i] = self.counts[i] + count
        else:
            self.counts.append(count)
        self.units = units
        if self.provisional is None:
            first = pmean_data(count.clone())
            self.provisional = torch.where(first > 0, first, torch.ones_like(first))
        return self.provisional

    def finish(self) -> torch.Tensor | None:
        """The factor ``provisional / true`` (computed once: a collective on every rank)."""
        if self.factor is not None or not self.counts:
            return self.factor
        totals = pmean_data(torch.stack(self.counts)) / self.units  # the true per-unit divisor, per call
        values = totals.tolist()
        if any(v != values[0] for v in values):
            raise ValueError(f"{WHERE}: under accumulation or a pipeline every global_mean of a step must count the "
                             f"same elements (one `where`), because the count over the whole batch is applied after "
                             f"the last micro-batch as one factor; the calls of each micro-batch counted "
                             + ", ".join(f"#{i}: {v * self.units:g}" for i, v in enumerate(values))
                             + " per rank on average. Fold them into one call (global_mean(a + b, where)) or "
                             "use accumulate=1")
        true = totals[0]
        self.factor = (self.provisional / torch.where(true > 0, true, torch.ones_like(true))).to(torch.float32)
        for v in self.values:
            v.mul_(self.factor.to(v.device, v.dtype))
        self.values.clear()
        return self.factor

    def mirror(self, count: torch.Tensor, provisional: torch.Tensor, units: int) -> None:
        """Take on the deferred count another rank recorded (a pipeline's last stage, for the
        stages before it, whose gradients its loss seeded): the same factor comes out."""
        count = count.detach().to(torch.float64)
        if self.counts:
            self.counts[0] = self.counts[0] + count
        else:
            self.counts.append(count)
        if self.provisional is None:
            self.provisional = provisional.detach().to(torch.float64)
        self.units = units

    def update(self, state, grads, *, next):
        factor = self.finish()
        if factor is not None:
            # In place: the update's gradients are the step's own (reduce buffers, an
            # accumulator), and a copy would cost a gradient's bytes at the step's peak.
            grads = tree.map(lambda g: g.mul_(factor.to(g.device, g.dtype)), grads)
        return next(state, grads)


_LEDGER: contextvars.ContextVar[_Ledger | None] = contextvars.ContextVar("fzero_means", default=None)


@contextlib.contextmanager
def _step_means(state: Any, batch: Any) -> Iterator[None]:
    ledger = _Ledger()
    token = _LEDGER.set(ledger)
    try:
        with installed(ledger):
            yield
            ledger.finish()  # no update applied (a skipped one, an evaluation): the values still
    finally:
        _LEDGER.reset(token)


register_step_scope(_step_means)


def settle() -> None:
    """Correct this step's global means now (the transform that averages the values of its
    micro-batches calls it after its last one, before it averages: ``accumulate``)."""
    ledger = _LEDGER.get()
    if ledger is not None:
        ledger.finish()


def global_mean(values: torch.Tensor, where: torch.Tensor | None = None) -> torch.Tensor:
    """The mean of ``values`` over the whole global batch, counting only where ``where`` is true.

    Inside a ``train_step`` run by fzero, "the whole global batch" is every data-parallel
    rank's local batch, every accumulated micro-batch and every pipeline micro-batch: a
    token-mean loss written with it gives the one-process full-batch loss and gradient at any
    layout. Outside a step (a world of one, no accumulation) it is ``values[where].mean()``.

    Use it where a mean would divide by a count that depends on the batch::

        ce = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
        loss = fzero.global_mean(ce, where=y.flatten() != -100)

    (``F.cross_entropy(..., ignore_index=-100)`` with its default ``reduction="mean"`` divides
    by the count of *this* micro-batch on *this* rank.)

    Args:
        values: a floating-point tensor (per-token losses, say).
        where: a bool tensor broadcastable to ``values``: the elements that count. ``None``:
            all of them.

    Returns:
        A 0-dim tensor (fp32 for 16-bit ``values``), differentiable in ``values``. 0 when no
        element counts anywhere. Under accumulation or a pipeline the value is provisional
        until the update's last micro-batch has run; the loss ``value_and_grad`` returned is
        corrected in place then (see the module's docstring).

    Raises:
        TypeError: ``values`` is not a floating-point tensor, or ``where`` not a bool tensor.
        ValueError: ``where`` does not broadcast to ``values`` (both shapes named); under
            accumulation, a loss that is not linear in its global means (the operation named).

    Example:
        >>> import torch, fzero
        >>> fzero.global_mean(torch.tensor([1.0, 2.0, 30.0]), where=torch.tensor([True, True, False]))
        tensor(1.5000)
    """
    if not isinstance(values, torch.Tensor) or not values.is_floating_point():
        raise TypeError(f"{WHERE}: values must be a floating-point tensor, got "
                        + (f"a {values.dtype} tensor" if isinstance(values, torch.Tensor) else type(values).__name__))
    acc = torch.promote_types(values.dtype, torch.float32)
    if where is None:
        total = values.sum(dtype=acc)
        count = torch.full((), values.numel(), dtype=torch.float64, device=values.device)
    else:
        if not isinstance(where, torch.Tensor) or where.dtype != torch.bool:
            raise TypeError(f"{WHERE}: where must be a bool tensor, got "
                            + (f"a {where.dtype} tensor" if isinstance(where, torch.Tensor) else type(where).__name__))
        try:
            mask = torch.broadcast_to(where, values.shape)
        except RuntimeError:
            raise ValueError(f"{WHERE}: where of shape {tuple(where.shape)} does not broadcast to values of shape "
                             f"{tuple(values.shape)}") from None
        total = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device)).sum(dtype=acc)
        count = mask.sum(dtype=torch.float64)
    if rehearsing():  # a shape rehearsal (a pipeline's handshake): this rank's mean, nothing counted
        return total / torch.clamp(count, min=1).to(acc)
    ledger = _LEDGER.get()
    here = context()
    mb, pm = here.micro_batch, here.pipeline_micro_batch
    units = mb.count * pm.count
    if ledger is None or units == 1:
        divisor = pmean_data(count)
        divisor = torch.where(divisor > 0, divisor, torch.ones_like(divisor))
        return total / divisor.to(acc)
    out = total / ledger.record(count, units, (mb.index, pm.index)).to(acc)
    if out.grad_fn is not None:
        ledger.outputs.append(out.grad_fn)
    return out


# --------------------------------------------------------------------------- value_and_grad's side


def mark() -> int:
    """How many deferred global means this step has made so far (``value_and_grad`` compares
    before and after its function)."""
    ledger = _LEDGER.get()
    return -1 if ledger is None else len(ledger.outputs)


def check_loss(loss: torch.Tensor, since: int, fn_name: str) -> bool:
    """Whether ``loss`` used deferred global means made after ``since``; if so, that it is
    linear in them (the factor applied later is then exact), else a ``ValueError``."""
    ledger = _LEDGER.get()
    if ledger is None or since < 0 or len(ledger.outputs) == since:
        return False
    ends = set(ledger.outputs[since:])
    seen, todo = set(), [loss.grad_fn] if isinstance(loss, torch.Tensor) and loss.grad_fn is not None else []
    while todo:
        node = todo.pop()
        if node is None or node in ends or node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        inputs = [n for n, _ in node.next_functions if n is not None]
        problem = None
        if name not in _LINEAR:
            problem = f"{name} (not linear)" if name != "AccumulateGrad" else "a path to the parameters that does not " \
                                                                             "go through a global mean"
        elif name.startswith(("Add", "Sub")) and len(inputs) < 2:
            problem = f"{name} (a constant added to a global mean)"
        elif name.startswith(("Mul", "Div")) and len(inputs) > 1 and name != "DivBackward0":
            problem = f"{name} (a product of two differentiable values)"
        elif name == "DivBackward0" and len(inputs) > 1:
            problem = f"{name} (a division by a differentiable value)"
        if problem is not None:
            raise ValueError(
                f"{WHERE}: under accumulation or a pipeline the count over the whole batch is known after the last "
                f"micro-batch, so fzero scales the update's gradient by it afterwards: the loss {fn_name} returns "
                f"must be a linear combination of global means (sums and constant factors), but between them "
                f"there is {problem}. Put every per-element term inside one global mean "
                "(fzero.global_mean(ce + 0.1 * z, where)), or compile with accumulate=1")
        todo.extend(inputs)
    return True


def deferred_state() -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(count so far, provisional divisor)`` of the step's first deferred global mean, or
    ``None`` (what a pipeline's last stage hands the stages before it)."""
    ledger = _LEDGER.get()
    if ledger is None or not ledger.counts:
        return None
    return ledger.counts[0], ledger.provisional


def mirror(count: torch.Tensor, provisional: torch.Tensor, units: int) -> None:
    """See :meth:`_Ledger.mirror`."""
    ledger = _LEDGER.get()
    if ledger is not None:
        ledger.mirror(count, provisional, units)


def returned(value: torch.Tensor) -> None:
    """The loss ``value_and_grad`` hands the user, corrected in place once the count is known."""
    ledger = _LEDGER.get()
    if ledger is not None and ledger.factor is None:
        ledger.values.append(value)
