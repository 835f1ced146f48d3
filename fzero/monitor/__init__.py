"""Measuring and logging a step: DeepSpeed's ``wall_clock_breakdown``, ``flops_profiler``,
``memory_breakdown`` and monitors (``tensorboard``, ``csv_monitor``, ``wandb``), plus JSON lines.

``fzero.compile(timers=True, flops=True, memory=True, monitors=[...])`` -- or a config's
sections of those names -- adds ``metrics["time"]``, ``["flops"]``, ``["flops_per_s"]``,
``["tokens_per_s"]``, ``["mfu"]`` and ``["memory"]`` to each step's metrics and writes them
to the monitors on rank 0. See docs/monitoring.md.
"""

from fzero.monitor._flops import PEAK_FLOPS, FlopCounter, batch_tokens, peak_flops
from fzero.monitor._memory import peak_rss_bytes, state_bytes
from fzero.monitor._timers import PHASES, StepTimer
from fzero.monitor._writers import CSV, JSONL, Monitor, TensorBoard, Wandb, event_name, scalars

__all__ = ["CSV", "JSONL", "PEAK_FLOPS", "PHASES", "FlopCounter", "Monitor", "StepTimer", "TensorBoard", "Wandb",
           "batch_tokens", "event_name", "peak_flops", "peak_rss_bytes", "scalars", "state_bytes"]
