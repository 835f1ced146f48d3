"""The trial side of ``fzero autotune``: a compiled step that measures itself and ends the run.

The tuner starts each trial with ``$FZERO_AUTOTUNE`` naming a small JSON file (the *trial
spec*). ``fzero.compile`` reads it (:func:`from_env`) and, as DeepSpeed's engine does when
its config has an ``autotuning`` section, the compiled step

* in ``"model_info"`` mode: writes the model's trainable parameter count at ``step.init``
  and ends the run there (the tuner needs Ψ for ``fzero estimate``);
* in ``"profile"`` mode: times calls ``start_profile_step`` .. ``end_profile_step``
  (1-based, inclusive; the calls before are warm-up), writes samples/s and seconds per step
  once the last of them returns, and ends the run.

Ending the run is :class:`TrialDone`, a ``SystemExit(0)`` raised by every rank from the same
step call (the ranks call the step in lockstep), so ``finally`` blocks run and torchrun sees
success. Rank 0 writes the file; the times are the slowest rank's. Before raising, the ranks
meet at a barrier and the default process group is destroyed (code in a ``finally`` that
destroys it too should check ``torch.distributed.is_initialized()`` first).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from fzero.tree import leading_size

ENV = "FZERO_AUTOTUNE"

__all__ = ["ENV", "TrialDone", "TrialProfiler", "from_env", "count_params"]


class TrialDone(SystemExit):
    """Raised from the compiled step when an autotuning trial has measured what it came for.

    A ``SystemExit`` with code 0: a training script run by ``fzero autotune`` ends cleanly
    without catching it; code that runs a trial in-process catches it.
    """

    def __init__(self, path: str):
        super().__init__(0)
        self.path = path


def count_params(params: Any) -> int:
    """Ψ: elements of the trainable parameters (frozen ones are ``None`` in ``trainable``)."""
    from fzero import tree
    from fzero._params import trainable

    return sum(leaf.numel() for leaf in tree.leaves(trainable(params)) if isinstance(leaf, torch.Tensor))


def _write(path: str, record: dict) -> None:
    # Written whole, then renamed: the tuner never reads half a file.
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(tmp, p)


class TrialProfiler:
    """Measures one trial's compiled step (see the module docstring).

    Args:
        mode: ``"profile"`` or ``"model_info"``.
        metric_path: where rank 0 writes the result (JSON).
        start_profile_step, end_profile_step: the 1-based step calls timed, inclusive.
        shutdown: destroy the process group before ending the trial (the default, for a
            trial that is a whole run); ``False`` leaves it to a caller that goes on.
        clock: seconds as a float (default ``time.perf_counter``).
    """

    def __init__(self, mode: str, metric_path: str, *, start_profile_step: int = 3, end_profile_step: int = 5,
                 shutdown: bool = True, clock=time.perf_counter):
        if mode not in ("profile", "model_info"):
            raise ValueError(f"fzero autotune trial: mode must be 'profile' or 'model_info', got {mode!r}")
        if not (isinstance(start_profile_step, int) and isinstance(end_profile_step, int)
                and 1 <= start_profile_step <= end_profile_step):
            raise ValueError(f"fzero autotune trial: need 1 <= start_profile_step <= end_profile_step, got "
                             f"start_profile_step={start_profile_step!r}, end_profile_step={end_profile_step!r}")
        self.mode, self.metric_path = mode, str(metric_path)
        self.start, self.end, self.clock = start_profile_step, end_profile_step, clock
        self.shutdown = bool(shutdown)
        self.calls = 0
        self.num_params: int | None = None
        self._t0: float | None = None
        self._samples = 0

    def init(self, state: Any, mesh) -> None:
        """At ``step.init``: note Ψ; in ``model_info`` mode, write it and end the trial."""
        self.num_params = count_params(state.params)
        if self.mode == "model_info":
            if mesh.rank == 0:
                _write(self.metric_path, {"num_params": self.num_params, "world_size": mesh.world_size})
            _shutdown(mesh, self.shutdown)
            raise TrialDone(self.metric_path)

    def _sync(self, mesh) -> None:
        if mesh.device.type == "cuda":
            torch.cuda.synchronize(mesh.device)

    def before_call(self, mesh, batch) -> None:
        self.calls += 1
        if self.calls == self.start:
            self._sync(mesh)
            if mesh.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(mesh.device)
            self._t0 = self.clock()
        if self.start <= self.calls <= self.end:
            # Samples per update over the data-parallel ranks: this rank's batch × dp.
            self._samples += (leading_size(batch) or 0) * mesh.size("dp")

    def after_call(self, mesh) -> None:
        """After each call; after ``end_profile_step``, write the result and end the trial."""
        if self.calls != self.end:
            return
        self._sync(mesh)
        elapsed = self.clock() - self._t0
        peak = torch.cuda.max_memory_allocated(mesh.device) if mesh.device.type == "cuda" else None
        if mesh.world_size > 1:
            import torch.distributed as dist

            # The slowest rank sets the pace of a synchronous step; the peak is the largest rank's.
            t = torch.tensor([elapsed, float(peak or 0)], dtype=torch.float64, device=mesh.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            elapsed, peak = float(t[0]), (int(t[1]) if peak is not None else None)
        steps = self.end - self.start + 1
        if mesh.rank == 0:
            _write(self.metric_path, {
                "throughput": self._samples / elapsed if elapsed > 0 else float("inf"),
                "latency": elapsed / steps,
                "samples": self._samples,
                "profiled_steps": steps,
                "seconds": elapsed,
                "num_params": self.num_params,
                "peak_bytes": peak,
                "world_size": mesh.world_size,
            })
        _shutdown(mesh, self.shutdown)
        raise TrialDone(self.metric_path)


def _shutdown(mesh, destroy: bool) -> None:
    """Every rank waits for rank 0's file, then the process group closes, before any rank
    exits: a gloo rank whose peer's connection closes while it still runs can abort."""
    import torch.distributed as dist

    if mesh.world_size > 1 and dist.is_initialized():
        dist.barrier()
        if destroy:
            dist.destroy_process_group()


def from_env(environ=None) -> TrialProfiler | None:
    """The profiler ``$FZERO_AUTOTUNE``'s trial spec asks for, or ``None`` outside a trial.

    The spec is JSON: ``{"mode": "profile" | "model_info", "metric_path": PATH,
    "start_profile_step": 3, "end_profile_step": 5, "shutdown": true}``.

    Raises:
        ValueError: the spec cannot be read or has bad values (the file is named).
    """
    path = (os.environ if environ is None else environ).get(ENV)
    if not path:
        return None
    try:
        spec = json.loads(Path(path).read_text())
        return TrialProfiler(spec["mode"], spec["metric_path"],
                             start_profile_step=spec.get("start_profile_step", 3),
                             end_profile_step=spec.get("end_profile_step", 5),
                             shutdown=spec.get("shutdown", True))
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"fzero.compile: ${ENV}={path!r} is not a readable autotuning trial spec: {e!r}") from None
