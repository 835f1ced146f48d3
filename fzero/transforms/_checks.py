"""What a transform's keyword may be: one check per keyword, written once.

The transforms check their own keywords here (``shard_state(stage=, bucket_bytes=, ...)``,
``mixed_precision(loss_scale=, ...)``, ``accumulate(micro_batches=)``, ``clip(clip_norm=)``,
``offload_optimizer(pin_memory=)``), and :class:`fzero.CompileOptions` checks the option
that feeds each keyword with the same function, so a bad value gets the same message
wherever it is given. This module imports nothing of fzero: every transform may use it.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

__all__ = ["BUCKETS_PER_MODEL", "CHECKS", "DEFAULT_BUCKET_BYTES", "DEFAULT_REUSE_BYTES", "MIN_BUCKET_BYTES",
           "check_option", "default_bucket_bytes", "default_reuse_distance", "kept_reduce_bytes", "run_elements",
           "unit_runs", "units_within_reuse"]

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb (DeepSpeed's buckets are larger still): the default
# Stage 3's default bucket is at most this fraction of the trainable parameters' bytes (there
# it cuts only the parameters outside the units, the blocks, into groups).
BUCKETS_PER_MODEL = 32
# ...but not below this: a bucket is also a flat group, the unit of one collective and one
# launch of the fused optimizer, and a tiny model cut into 32 groups pays 32 of each per step
# for a few kilobytes saved. A model smaller than it is one group (no buffer exceeds the model).
MIN_BUCKET_BYTES = 64 * 2**10
# Stage 3's default reuse window: the last units of forward whose parameters, together, are
# at most this many bytes stay gathered until their backward (``max_reuse_distance``) instead
# of being gathered a second time. DeepSpeed's default keeps up to 1e9 elements so; FSDP2's
# ``reshard_after_forward=True`` none.
DEFAULT_REUSE_BYTES = DEFAULT_BUCKET_BYTES


def default_bucket_bytes(model_bytes: int, stage: int | None = None) -> int:
    """The bucket ``shard_state`` uses when none is given, from ``model_bytes`` (the trainable
    parameters' bytes). A parameter larger than the bucket is a bucket of its own.

    At stages 0-2 (``stage`` ``None`` too) it is DDP's: :data:`DEFAULT_BUCKET_BYTES`, or the
    whole model when smaller. Each bucket is a collective and a fused-optimizer launch per
    step, whose latency a small model pays many times over when cut small (the 0.88M GPT of
    ``benchmarks/zero.py --preset tiny --fzero-default-bucket`` at stage 2, on 2 gloo
    ranks: 2.11x DDP in 28 buckets of 1/32, 1.10-1.13x in one). What a large bucket would
    cost in memory between steps, the reduce buffers kept, :func:`kept_reduce_bytes`
    bounds instead.

    At stage 3 it is 1/:data:`BUCKETS_PER_MODEL` of the model, rounded up, at most
    :data:`DEFAULT_BUCKET_BYTES` and at least :data:`MIN_BUCKET_BYTES` or the whole model,
    whichever is smaller.

    Example:
        >>> default_bucket_bytes(4 * 10**6), default_bucket_bytes(4 * 10**9) == DEFAULT_BUCKET_BYTES
        (4000000, True)
        >>> default_bucket_bytes(4 * 10**6, stage=3), default_bucket_bytes(4 * 10**9, stage=3) == DEFAULT_BUCKET_BYTES
        (125000, True)
        >>> default_bucket_bytes(10**6, stage=3), default_bucket_bytes(1000, stage=3)  # the floor; a model under it
        (65536, 1000)
    """
    if stage != 3:
        return max(1, min(int(model_bytes), DEFAULT_BUCKET_BYTES))
    share = min(DEFAULT_BUCKET_BYTES, -(-int(model_bytes) // BUCKETS_PER_MODEL))
    return max(1, min(int(model_bytes), max(MIN_BUCKET_BYTES, share)))


def kept_reduce_bytes(model_bytes: int) -> int:
    """The most bytes of free reduce buffers ``shard_state`` keeps between steps at stages 1-2
    when it chose the bucket itself: 1/16 of ``model_bytes`` (two buffers of 1/32: 2.5% of
    ZeRO-2's 4Ψ + 12Ψ/N at N = 2, under 6.25% of its 4Ψ at any N), or two default buckets,
    whichever is smaller. A larger buffer goes back to the allocator when its reduce-scatter
    completes; a given bucket's buffers are kept (two of them), as DeepSpeed keeps its
    ``reduce_bucket_size`` buffers, and so are stage 3's, whose buffers are its units'.

    Example:
        >>> kept_reduce_bytes(4 * 10**6), kept_reduce_bytes(4 * 10**9) == 2 * DEFAULT_BUCKET_BYTES
        (250000, True)
    """
    return min(2 * DEFAULT_BUCKET_BYTES, 2 * -(-int(model_bytes) // BUCKETS_PER_MODEL))


def default_reuse_distance(itemsize: int, given: float | None = None) -> float:
    """Stage 3's ``max_reuse_distance``: ``given`` when set, else the default, in elements of
    ``itemsize`` bytes: the units within :data:`DEFAULT_REUSE_BYTES` (25 MiB) of parameters
    stay gathered from their forward to their backward -- at most that much memory more at
    the step's peak, whatever the model's size, for one all-gather fewer per kept unit. A
    model smaller than the window is gathered once per step, as stage 2 gathers it.

    Example:
        >>> default_reuse_distance(4), default_reuse_distance(2)  # fp32, bf16 parameters
        (6553600, 13107200)
        >>> default_reuse_distance(4, given=0)
        0
    """
    return DEFAULT_REUSE_BYTES // max(1, int(itemsize)) if given is None else given


def units_within_reuse(sizes: list[float], max_reuse_distance: float) -> int:
    """How many of ZeRO-3's units, ``sizes`` their elements in forward order, stay gathered
    from their forward to their backward: the last ones whose *reuse distance* -- the
    elements gathered from a unit's gather until its backward needs it, itself and the units
    after it (each gathered once) -- is at most ``max_reuse_distance``. ``shard_state``
    keeps these; ``fzero.perf_model`` counts their traffic so.

    Example:
        >>> units_within_reuse([10, 10, 10], 25), units_within_reuse([10, 10, 10], 9)
        (2, 0)
    """
    kept, distance = 0, 0.0
    for n in reversed(sizes):
        distance += n
        if distance > max_reuse_distance:
            break
        kept += 1
    return kept


def run_elements(block: float, max_reuse_distance: float) -> float:
    """The elements of each unit :func:`unit_runs` makes of equal blocks of ``block``
    elements, the model larger than ``max_reuse_distance``: as many blocks as fit within
    the window, at least one (``fzero estimate``'s stage-3 unit).

    Example:
        >>> run_elements(10, 25), unit_runs([10] * 6, 25)[-1] * 10, run_elements(30, 25)
        (20, 20, 30)
    """
    return block * max(1, int(max_reuse_distance // block)) if block > 0 else 0


def unit_runs(sizes: list[float], max_reuse_distance: float) -> list[int]:
    """How ``shard_state`` groups ZeRO-3's blocks into units when it finds them itself:
    ``sizes`` the blocks' elements in forward order; returns how many consecutive blocks each
    unit holds, in forward order. Runs are cut from the last block back, each as long as its
    elements stay within ``max_reuse_distance`` (a block larger than it, or every block when
    it is 0, is a unit alone), so the last run is the reuse window itself, kept gathered
    from its forward to its backward (:func:`units_within_reuse`), and no gather moves more
    than the window. A unit is one all-gather each way and one reduce-scatter: on the
    10.8M GPT of ``benchmarks/zero.py``, six blocks of 7 MB, two units of three ran 3-4%
    faster than six (docs/performance.md, "Stage 3's cost on this machine").

    Example:
        >>> unit_runs([10, 10, 10, 10, 10], 25), unit_runs([10, 30, 10], 25), unit_runs([10, 10], 0)
        ([1, 2, 2], [1, 1, 1], [1, 1])
    """
    runs: list[int] = []
    total = 0.0
    for n in reversed(sizes):
        if runs and total + n <= max_reuse_distance:
            runs[-1] += 1
            total += n
        else:
            runs.append(1)
            total = n
    return runs[::-1]


Check = Callable[[Any], "str | None"]  # None when the value is valid, else why not ("must be ...")


def choice(*allowed) -> Check:
    text = ", ".join(repr(a) for a in allowed[:-1]) + f" or {allowed[-1]!r}"

    def check(v):
        return None if any(v == a and type(v) is type(a) for a in allowed) else f"must be {text}"

    return check


def positive_int(v) -> str | None:
    ok = isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1
    return None if ok else "must be a positive int"


def positive_number(v) -> str | None:
    ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and v > 0
    return None if ok else "must be a positive number"


def nonneg_number(v) -> str | None:
    ok = isinstance(v, numbers.Real) and not isinstance(v, bool) and v >= 0
    return None if ok else "must be a number >= 0"


def optional(check: Check) -> Check:
    def optional(v):
        why = None if v is None else check(v)
        return None if why is None else f"{why} or None"

    return optional


def boolean(v) -> str | None:
    return None if isinstance(v, bool) else "must be True or False"


def _loss_scale(v) -> str | None:
    return None if v in ("dynamic", None) or positive_number(v) is None else \
        "must be 'dynamic', a positive number or None"


def _int(v) -> str | None:
    return None if isinstance(v, numbers.Integral) and not isinstance(v, bool) else "must be an int"


# Each transform's keyword, by the name the transform takes it under.
CHECKS: dict[str, Check] = {
    # shard_state
    "stage": choice(0, 1, 2, 3),
    "bucket_bytes": optional(positive_int),  # None: default_bucket_bytes of the model
    "reduce_in": optional(choice("fp32", "bf16", "fp16")),
    "overlap_comm": boolean,
    "buffer_sync": choice("broadcast", "mean", "local"),
    "offload_param": choice("none", "cpu"),
    "pin_memory": boolean,  # and offload_optimizer's
    "max_reuse_distance": optional(nonneg_number),  # None: 25 MiB of parameters' worth of elements
    # mixed_precision (its dtype is checked there: "bf16" or "fp16")
    "loss_scale": _loss_scale,
    "initial_scale_power": _int,
    "loss_scale_window": positive_int,
    "hysteresis": positive_int,
    "consecutive_hysteresis": boolean,
    "min_loss_scale": positive_number,
    "check_grad_overflow": boolean,
    # accumulate, clip
    "micro_batches": positive_int,
    "clip_norm": positive_number,
}


def check_option(where: str, name: str, value: Any, check: str | None = None) -> None:
    """Raise ``ValueError("<where>: <name>=<value> must be ...")`` if ``value`` is not valid
    for the keyword ``check`` (default: ``name``), as spelled ``name`` by the caller."""
    why = CHECKS[check or name](value)
    if why is not None:
        raise ValueError(f"{where}: {name}={value!r} {why}")
