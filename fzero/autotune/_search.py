"""The search of ``fzero autotune``: the grid, the memory prune, the trials, the winner.

Nothing here starts a process: :func:`search` takes the function that runs one trial, so
the same loop serves the console command (a trial is a ``fzero launch`` of the user's
script) and a test or notebook (a trial is a function call).
"""

from __future__ import annotations

import copy
import dataclasses
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

from fzero.autotune._config import METRICS
from fzero.memory import OPTIMIZER_STATES, format_bytes, model_state_bytes, reduce_buffer_bytes

__all__ = ["Candidate", "Trial", "TrialFailed", "SearchResult", "grid", "estimate_bytes", "search", "apply"]


class TrialFailed(RuntimeError):
    """What a ``run_trial`` raises for a trial that ran and failed; its message is the whole
    reason (shown as is, without the exception's type)."""


class OutOfMemoryError(TrialFailed):
    """A trial that ran out of device memory."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration to try: ZeRO stage, micro-batch per rank, accumulation steps, tp."""

    stage: int
    micro_batch: int
    accumulation: int
    train_batch_size: int
    tp: int = 1

    @property
    def name(self) -> str:
        """DeepSpeed's experiment naming: ``z2_tp1_mbs4_gas2``."""
        return f"z{self.stage}_tp{self.tp}_mbs{self.micro_batch}_gas{self.accumulation}"


@dataclasses.dataclass
class Trial:
    """What became of one candidate.

    ``status``: ``"ok"`` (measured), ``"failed"`` (the trial raised or its run failed;
    ``error`` says why), ``"oom"`` (it ran out of device memory), ``"pruned"`` (its
    estimate exceeds the budget; not run) or ``"not run"`` (early stopping or
    ``tuner_num_trials``).
    """

    candidate: Candidate
    status: Literal["ok", "failed", "oom", "pruned", "not run"]
    estimate_bytes: int | None = None
    result: dict | None = None
    error: str | None = None
    value: float | None = None


@dataclasses.dataclass
class SearchResult:
    """Every trial in the order considered, and the best (``None`` when none succeeded)."""

    trials: list[Trial]
    best: Trial | None
    metric: str

    def table(self) -> str:
        """The trials as a text table; the best is marked ``*``."""
        unit = {"throughput": "samples/s", "latency": "s/step", "flops": "samples/s"}[self.metric]
        head = ["", "trial", "stage", "tp", "micro", "accum", "batch", "estimate", "status", f"{self.metric} ({unit})"]
        rows = []
        for t in self.trials:
            c = t.candidate
            shown = "" if t.value is None else f"{t.value:.4g}"
            error = t.error if not t.error or len(t.error) <= 140 else t.error[:137] + "..."
            status = t.status if not error else f"{t.status}: {error}"
            rows.append(["*" if t is self.best else "", c.name, str(c.stage), str(c.tp), str(c.micro_batch),
                         str(c.accumulation), str(c.train_batch_size),
                         "" if t.estimate_bytes is None else format_bytes(t.estimate_bytes), status, shown])
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        fmt = lambda r: "  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip()  # noqa: E731
        return "\n".join([fmt(head), *map(fmt, rows)])


def _micro_sizes(lo: int, hi: int) -> list[int]:
    """Powers of two in [lo, hi], and hi itself (DeepSpeed's autotuner also tries its max)."""
    sizes, m = [], 1
    while m <= hi:
        if m >= lo:
            sizes.append(m)
        m *= 2
    if lo <= hi and hi not in sizes:
        sizes.append(hi)
    return sizes


def grid(*, world_size: int, stages: Iterable[int] = (0, 1, 2, 3), tp: Iterable[int] = (1,), pp: int = 1,
         train_batch_size: int | None = None, micro_batches: Sequence[int] | None = None, accumulation: int = 1,
         min_micro_batch: int = 1, max_micro_batch: int = 1024, num_micro_batches: int = 3,
         min_train_batch_size: int = 1, max_train_batch_size: int | None = None) -> list[Candidate]:
    """The candidates: stage × tp × micro-batch, with the accumulation each implies.

    With ``train_batch_size`` fixed, a micro-batch ``m`` on ``dp = world_size / (tp·pp)``
    ranks takes ``train_batch_size / (m·dp)`` accumulation steps (sizes that do not divide
    are left out, unless listed in ``micro_batches``: those are tried as given, and the
    trial's config names the mismatch). Otherwise every size takes ``accumulation`` steps and
    the batch is ``m · accumulation · dp``, kept within ``[min_train_batch_size,
    max_train_batch_size]``. Without ``micro_batches``, the sizes are powers of two in
    ``[min_micro_batch, max_micro_batch]`` and the maximum, the ``num_micro_batches``
    largest of those that fit.

    Raises:
        ValueError: a ``tp`` (times ``pp``) that does not divide ``world_size``, or a stage
            not in 0-3; the value is named.

    Example:
        >>> [c.name for c in grid(world_size=2, stages=(0, 3), train_batch_size=8, max_micro_batch=4,
        ...                       num_micro_batches=2)]
        ['z0_tp1_mbs2_gas2', 'z0_tp1_mbs4_gas1', 'z3_tp1_mbs2_gas2', 'z3_tp1_mbs4_gas1']
    """
    out = []
    for s in stages:
        if s not in (0, 1, 2, 3):
            raise ValueError(f"fzero.autotune.grid: stage must be 0, 1, 2 or 3, got {s!r}")
    for t in tp:
        if world_size % (t * pp):
            raise ValueError(f"fzero.autotune.grid: tp={t} × pp={pp} does not divide the world of {world_size} ranks")
    for stage in stages:
        for t in tp:
            dp = world_size // (t * pp)
            listed = list(micro_batches) if micro_batches is not None else None
            sizes = listed if listed is not None else _micro_sizes(min_micro_batch, max_micro_batch)
            found = []
            for m in sizes:
                if train_batch_size is not None:
                    gas = train_batch_size // (m * dp)
                    if listed is None and (gas < 1 or gas * m * dp != train_batch_size):
                        continue
                    found.append(Candidate(stage, m, max(gas, 1), train_batch_size, t))
                else:
                    batch = m * accumulation * dp
                    if listed is None and (batch < min_train_batch_size
                                           or (max_train_batch_size is not None and batch > max_train_batch_size)):
                        continue
                    found.append(Candidate(stage, m, accumulation, batch, t))
            out += found if listed is not None else found[-num_micro_batches:]
    return out


def estimate_bytes(candidate: Candidate, *, num_params: int, world_size: int, precision: str = "fp32",
                   optimizer: str = "adam", bucket_bytes: int | None = None, pp: int = 1,
                   max_reuse_distance: float | None = None, block_params: int | None = None) -> int:
    """Per-rank bytes ``fzero estimate`` prints as *total* for this candidate (model states
    and reduce buffers; activations not counted); ``max_reuse_distance`` the config's and
    ``block_params`` the model's largest block (``0``: none; ``None``: unknown, 1/32 of the
    model), which size stage 3's units (:func:`fzero.memory.reduce_buffer_bytes`).

    Example:
        >>> estimate_bytes(Candidate(0, 1, 1, 1), num_params=1000, world_size=1)   # 16 bytes per parameter
        16000
    """
    kw = dict(world_size=world_size, stage=candidate.stage, precision=precision, tp=candidate.tp, pp=pp)
    states = model_state_bytes(num_params, optimizer=optimizer, **kw)["total"]
    return states + reduce_buffer_bytes(num_params, bucket_bytes=bucket_bytes, max_reuse_distance=max_reuse_distance,
                                        block_params=block_params, **kw)


def apply(base: Mapping[str, Any], candidate: Candidate) -> dict:
    """``base`` (a DeepSpeed config dict) with the candidate's batch sizes, stage and tp.

    Example:
        >>> apply({"zero_optimization": {"stage": 0, "overlap_comm": True}}, Candidate(2, 4, 2, 16))
        ... # doctest: +NORMALIZE_WHITESPACE
        {'zero_optimization': {'stage': 2, 'overlap_comm': True}, 'train_batch_size': 16,
         'train_micro_batch_size_per_gpu': 4, 'gradient_accumulation_steps': 2}
    """
    out = copy.deepcopy(dict(base))
    zero = out.get("zero_optimization")
    out["zero_optimization"] = {**(zero if isinstance(zero, Mapping) else {}), "stage": candidate.stage}
    out["train_batch_size"] = candidate.train_batch_size
    out["train_micro_batch_size_per_gpu"] = candidate.micro_batch
    out["gradient_accumulation_steps"] = candidate.accumulation
    if candidate.tp > 1 or "tensor_parallel" in out:
        out["tensor_parallel"] = {**out.get("tensor_parallel", {}), "autotp_size": candidate.tp}
    return out


def _optimizer_kind(base: Mapping[str, Any]) -> str:
    """The ``fzero estimate`` optimizer of a config's optimizer section (adam when it has none)."""
    sec = base.get("optimizer") or {}
    kind = str(sec.get("type", "adam")).lower()
    if kind == "sgd":
        return "sgd-momentum" if (sec.get("params") or {}).get("momentum", 0) else "sgd"
    return kind if kind in OPTIMIZER_STATES else "adam"


def search(candidates: Iterable[Candidate], run_trial: Callable[[Candidate], Mapping[str, Any]],
           budget: int | None = None, *, estimate: Callable[[Candidate], int] | None = None,
           metric: Literal["throughput", "latency", "flops"] = "throughput", early_stopping: int | None = None,
           num_trials: int | None = None, order: Literal["gridsearch", "random", "model_based"] = "gridsearch",
           seed: int = 0, on_trial: Callable[[Trial], None] | None = None) -> SearchResult:
    """Try the candidates that fit ``budget`` and return the one with the best ``metric``.

    Args:
        candidates: what to try, in order (:func:`grid`).
        run_trial: runs one candidate and returns its measurement, a mapping holding
            ``"throughput"`` (samples/s) and/or ``"latency"`` (s/step). An exception it raises
            (``Exception``, not ``KeyboardInterrupt``) marks the trial failed — ``"oom"`` for
            ``torch.OutOfMemoryError`` or a ``MemoryError`` — and the search goes on.
        budget: per-rank bytes; a candidate whose ``estimate`` exceeds it is pruned, not run.
        estimate: candidate → per-rank bytes (e.g. a ``functools.partial`` of
            :func:`estimate_bytes`); required with ``budget``, shown in the table otherwise.
        metric: ``"throughput"`` (higher is better), ``"latency"`` (lower), ``"flops"``
            (FLOPs/s per GPU: at one model and world size it ranks as throughput does).
        early_stopping: stop after this many trials in a row that do not beat the best.
        num_trials: run at most this many trials.
        order: ``"random"`` shuffles the candidates with ``seed``; the others keep the order.
        on_trial: called with each finished :class:`Trial` (to print progress).

    Returns:
        A :class:`SearchResult`; ties go to the candidate tried first.

    Raises:
        ValueError: an unknown metric, or a ``budget`` without ``estimate``.

    Example:
        >>> speed = {1: 10.0, 2: 30.0, 4: 20.0}
        >>> res = search(grid(world_size=1, stages=(0,), micro_batches=(1, 2, 4)),
        ...              lambda c: {"throughput": speed[c.micro_batch]})
        >>> res.best.candidate.name
        'z0_tp1_mbs2_gas1'
    """
    if metric not in METRICS:
        raise ValueError(f"fzero.autotune.search: metric must be one of {', '.join(METRICS)}, got {metric!r}")
    if budget is not None and estimate is None:
        raise ValueError("fzero.autotune.search: a budget needs estimate=, the per-rank bytes of a candidate")
    key = "latency" if metric == "latency" else "throughput"
    better = (lambda a, b: a > b) if METRICS[metric] else (lambda a, b: a < b)
    todo = list(candidates)
    if order == "random":
        random.Random(seed).shuffle(todo)
    trials: list[Trial] = []
    best: Trial | None = None
    ran = since_best = 0
    for c in todo:
        est = estimate(c) if estimate is not None else None
        if budget is not None and est > budget:
            trial = Trial(c, "pruned", est)
        elif (num_trials is not None and ran >= num_trials) or (early_stopping is not None and best is not None
                                                                 and since_best >= early_stopping):
            trial = Trial(c, "not run", est)
        else:
            ran += 1
            trial = _run(c, run_trial, est, key)
            if trial.status == "ok" and (best is None or better(trial.value, best.value)):
                best, since_best = trial, 0
            else:
                since_best += 1
        trials.append(trial)
        if on_trial is not None:
            on_trial(trial)
    return SearchResult(trials, best, metric)


def _run(c: Candidate, run_trial, est: int | None, key: str) -> Trial:
    try:
        result = run_trial(c)
    except Exception as e:  # noqa: BLE001 - a failed trial is a result, not the end of the search
        oom = isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError"
        why = str(e) if isinstance(e, TrialFailed) else f"{type(e).__name__}: {e}"
        return Trial(c, "oom" if oom else "failed", est, error=(why.splitlines() or [""])[0])
    if not isinstance(result, Mapping) or not isinstance(result.get(key), (int, float)):
        return Trial(c, "failed", est, result=dict(result) if isinstance(result, Mapping) else None,
                     error=f"the trial reported no {key!r}")
    return Trial(c, "ok", est, result=dict(result), value=float(result[key]))
