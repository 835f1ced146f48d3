"""The trial side of ``fzero autotune``: a compiled step that measures itself and ends the run.

``fzero.compile(trial=TrialSpec(...))`` is the hook: the tuner gives it to each run of the
script through the trial's config, whose ``autotuning`` section holds DeepSpeed's trial keys
(``Config.trial``), as DeepSpeed's autotuner hands its engine each experiment's config.
The compiled step then, as DeepSpeed's engine does,

* in ``"model_info"`` mode: writes the model's trainable parameter count at ``step.init``,
  and its largest block's (``0`` when it has none for ZeRO-3 to gather one at a time), and
  ends the run there (the tuner needs both for ``fzero estimate``'s bytes);
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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from fzero.options import TrialSpec
from fzero.tree import leading_size

__all__ = ["TrialDone", "TrialProfiler", "TrialSpec", "count_params", "largest_block"]


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


def largest_block(state: Any) -> int | None:
    """Trainable elements of the model's largest block, as ZeRO-3 finds blocks (each element
    of a ``ModuleList``: :func:`fzero.transforms.shard_state._units.find_units`); ``0`` when
    it has none (stage 3 then gathers the model whole for the step); ``None`` when the state's
    ``apply_fn`` holds no module to look in."""
    from fzero._params import trainable
    from fzero.transforms.shard_state._units import find_units

    module = getattr(state.apply_fn, "module", None)
    if not isinstance(module, torch.nn.Module) or not isinstance(state.params, Mapping):
        return None
    train = {k: v for k, v in trainable(state.params).items() if isinstance(v, torch.Tensor)}
    return max((sum(train[n].numel() for n in names) for _, names in find_units(module, train)), default=0)


def _write(path: str, record: dict) -> None:
    # Written whole, then renamed: the tuner never reads half a file.
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
    os.replace(tmp, p)


class TrialProfiler:
    """Measures one trial's compiled step (see the module docstring); ``fzero.compile``
    makes one from its ``trial`` option.

    Args:
        spec: the :class:`TrialSpec`: the mode, where rank 0 writes the result, the 1-based
            step calls timed (inclusive), and whether to destroy the process group first.
        clock: seconds as a float (default ``time.perf_counter``).
    """

    def __init__(self, spec: TrialSpec, *, clock=time.perf_counter):
        if not isinstance(spec, TrialSpec):
            raise TypeError(f"fzero autotune trial: expected a TrialSpec, got {type(spec).__name__}")
        self.mode, self.metric_path = spec.mode, spec.metric_path
        self.start, self.end, self.clock = spec.start_profile_step, spec.end_profile_step, clock
        self.shutdown = spec.shutdown
        self.calls = 0
        self.num_params: int | None = None
        self._t0: float | None = None
        self._samples = 0

    def init(self, state: Any, mesh) -> None:
        """At ``step.init``: note Ψ; in ``model_info`` mode, write it and end the trial."""
        self.num_params = count_params(state.params)
        if self.mode == "model_info":
            if mesh.rank == 0:
                _write(self.metric_path, {"num_params": self.num_params, "block_params": largest_block(state),
                                          "world_size": mesh.world_size})
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
