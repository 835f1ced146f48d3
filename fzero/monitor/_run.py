"""What ``fzero.compile`` does around each step when it is asked to measure or to log:
time the phases, count the FLOPs, read the memory, add them to the metrics, and write the
metrics to the monitors on rank 0."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from fzero import tree
from fzero.monitor._flops import FlopCounter, batch_tokens
from fzero.monitor._flops import peak_flops as device_peak
from fzero.monitor._memory import memory_metrics
from fzero.monitor._timers import StepTimer
from fzero.monitor._writers import scalars

__all__ = ["Monitoring"]


class Monitoring:
    """Per compiled step: the measurements its options ask for, and its monitors.

    Args:
        device: the mesh's device.
        rank: this process's global rank (monitors write on rank 0 only).
        dp: the data-parallel world size (samples = local rows × dp).
        dtype: the step's compute precision (which peak MFU is measured against).
        timers, flops, memory: what to measure (``CompileOptions``' fields of those names).
        peak_flops: the peak FLOP/s for MFU (``None``: the device's, from the table).
        tokens_per_batch: tokens in one local batch (``None``: :func:`batch_tokens`).
        monitors: the writers.
        lr: the learning rate at a 0-based update count, when the config says it.
    """

    def __init__(self, *, device: torch.device, rank: int, dp: int, dtype: str, timers: bool, flops: bool,
                 memory: bool, peak_flops: float | None, tokens_per_batch: int | None,
                 monitors: Sequence[Any], lr: Callable[[int], float] | None):
        self.device, self.rank, self.dp = device, rank, dp
        self.timer = StepTimer(device) if timers else None
        self.counter = FlopCounter() if flops else None
        self.memory = memory
        self.peak = peak_flops if peak_flops is not None else device_peak(device, dtype)
        self.tokens_per_batch = tokens_per_batch
        self.monitors = tuple(monitors) if rank == 0 else ()
        self.lr = lr
        self.calls = 0
        self.samples = 0

    @property
    def active(self) -> bool:
        return bool(self.timer or self.counter or self.memory or self.monitors)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def running(self, batch: Any) -> Iterator[dict[str, float]]:
        """Run one step in the block; the yielded dict then holds its times (``"step"``
        always, the phases with timers)."""
        with contextlib.ExitStack() as stack:
            if self.counter is not None:
                stack.enter_context(self.counter.counting(batch))
            if self.timer is not None:
                yield stack.enter_context(self.timer.timing())
                return
            times: dict[str, float] = {}
            self._sync()
            start = time.perf_counter()
            yield times
            if self.counter is not None:  # FLOP/s needs the device's time, not the host's
                self._sync()
            times["step"] = time.perf_counter() - start

    def report(self, metrics: dict, times: dict[str, float], state: Any, batch: Any, update: int) -> dict:
        """``metrics`` with what was measured added; written to the monitors on rank 0.

        ``update`` is the state's update count before the step (the learning rate's index)."""
        self.calls += 1
        rows = tree.leading_size(batch)
        self.samples += (rows or 0) * self.dp
        metrics = dict(metrics)
        if self.timer is not None:
            metrics["time"] = dict(times)
        if self.counter is not None:
            seconds = times["step"]
            flops = self.counter.flops(batch)
            metrics["flops"] = flops
            metrics["flops_per_s"] = flops / seconds if seconds > 0 else 0.0
            if self.peak:
                metrics["mfu"] = metrics["flops_per_s"] / self.peak
            tokens = self.tokens_per_batch if self.tokens_per_batch is not None else batch_tokens(batch)
            if tokens is not None:
                metrics["tokens_per_s"] = tokens / seconds if seconds > 0 else 0.0
        if self.memory:
            metrics["memory"] = memory_metrics(state, self.device)
        if self.monitors:
            logged = scalars(metrics)
            if self.lr is not None and "lr" not in logged:
                logged["lr"] = float(self.lr(update))
            for monitor in self.monitors:
                monitor.write(logged, step=self.calls, samples=self.samples)
        return metrics

    def close(self) -> None:
        """Close every monitor (each also closes itself at exit)."""
        for monitor in self.monitors:
            monitor.close()

