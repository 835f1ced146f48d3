"""The step's wall-clock breakdown (DeepSpeed's ``wall_clock_breakdown``), as a handler.

:class:`StepTimer` is installed outermost by ``fzero.compile(timers=True)``, so it sees each
primitive last, right above its plain implementation:

* ``value_and_grad``: the function it passes down is the user's loss function (wrapped by
  the transforms inside); its run is the **forward**, the rest of the call (autograd's
  backward, with the gradient hooks that start reductions) the **backward**;
* ``update``: the optimizer's step on this rank's pieces, the **update**;
* the host's waits for collectives (:data:`fzero.distributed.comm.WAIT_TIMER`): on
  gradients the **reduce** phase, on parameters the **gather** phase (ZeRO-3's all-gathers
  in forward and backward, stages 1-2's after the update).

Each phase is *exclusive*: a wait inside the forward counts as gather, not forward. So
``reduce`` is the time the host is blocked on gradient reduction -- the communication that
backward did not hide -- not the collectives' duration. What no phase covers (the
transforms' own bookkeeping, the loss all-reduce, launching collectives) is in ``step`` only.

On a GPU the host runs ahead of the device, so with timers on every phase boundary
synchronizes the device first (as DeepSpeed's timers do): the times are the device's, and the
step loses some overlap of host and device work. With timers off nothing is installed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import torch

from fzero.distributed import comm
from fzero.core import Handler, installed

__all__ = ["PHASES", "StepTimer"]

#: The phases of ``metrics["time"]``, besides ``"step"`` (the whole call).
PHASES = ("forward", "backward", "reduce", "update", "gather")
# A collective's ``what=`` -> the phase its waits count in.
_WAIT_PHASES = {"gradients": "reduce", "parameters": "gather"}


class StepTimer(Handler):
    """Seconds spent in each of :data:`PHASES` during one step, exclusive of each other.

    Args:
        device: the step's device; on CUDA every boundary synchronizes it.

    Example:
        >>> timer = StepTimer(torch.device("cpu"))
        >>> with timer.timing() as seconds:
        ...     pass
        >>> sorted(seconds) == sorted(PHASES + ("step",))
        True
    """

    def __init__(self, device: torch.device | str = "cpu"):
        device = torch.device(device)
        self._sync: Callable[[], None] = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" \
            else (lambda: None)
        self.seconds: dict[str, float] = {}
        self._inner: list[float] = []  # per open span: seconds of the spans nested in it

    @contextlib.contextmanager
    def span(self, phase: str | None) -> Iterator[None]:
        """Count the block's time, less the spans nested in it, in ``phase`` (``None``:
        nowhere, but still excluded from the enclosing span)."""
        self._sync()
        start = time.perf_counter()
        self._inner.append(0.0)
        try:
            yield
        finally:
            self._sync()
            elapsed = time.perf_counter() - start
            nested = self._inner.pop()
            if phase is not None:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + elapsed - nested
            if self._inner:
                self._inner[-1] += elapsed

    def _waiting(self, what: str, device: str | None):
        return self.span(_WAIT_PHASES.get(what))

    @contextlib.contextmanager
    def timing(self) -> Iterator[dict[str, float]]:
        """Time one step run inside the block; the yielded dict holds each phase's seconds
        (0.0 for a phase that did not happen) and ``"step"``, the whole block, once it exits."""
        self.seconds = dict.fromkeys(PHASES, 0.0)
        out: dict[str, float] = {}
        token = comm.WAIT_TIMER.set(self._waiting)
        try:
            with installed(self):
                self._sync()
                start = time.perf_counter()
                yield out
                self._sync()
                step = time.perf_counter() - start
        finally:
            comm.WAIT_TIMER.reset(token)
        out.update(self.seconds, step=step)

    # ---------------------------------------------------------------- primitives

    def value_and_grad(self, fn, params, args, kwargs, *, next, **options):
        def forward(*a, **kw):
            with self.span("forward"):
                return fn(*a, **kw)

        with self.span("backward"):  # less the forward and the waits nested in it
            return next(forward, params, args, kwargs, **options)

    def update(self, state, grads, *, next):
        with self.span("update"):
            return next(state, grads)
