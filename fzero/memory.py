"""Per-rank memory of the model states under ZeRO: the formula of the ZeRO paper.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(SC'20), section 3.1 / figure 1: with Ψ parameters, N data-parallel ranks and K bytes of
optimizer state per parameter, a rank holds

=====  =========================  ==============================
stage  fp32 Adam (K = 8)          mixed precision Adam (K = 12)
=====  =========================  ==============================
0      4Ψ + 4Ψ + 8Ψ   = 16Ψ       2Ψ + 2Ψ + 12Ψ    = 16Ψ
1      4Ψ + 4Ψ + 8Ψ/N             2Ψ + 2Ψ + 12Ψ/N
2      4Ψ + (4Ψ + 8Ψ)/N           2Ψ + (2Ψ + 12Ψ)/N
3      (4Ψ + 4Ψ + 8Ψ)/N           (2Ψ + 2Ψ + 12Ψ)/N
=====  =========================  ==============================

(parameters + gradients + optimizer state). Under mixed precision the optimizer state
includes the fp32 master weights (4 bytes) beside the fp32 Adam moments (2 x 4 bytes).

bf16 mixed precision may keep the masters in bf16 (DeepSpeed's
``bf16.bf16_master_weights_and_grads``: K = 2 + 8 = 10 with fp32 Adam moments) and the
moments in bf16 too (``bf16.bf16_optimizer_states``: K = 2 + 4 = 6); the 2-byte parameters
and gradients stay what they are. The masters are a partition of their own, as DeepSpeed
keeps its master partition beside the parameters, so they count in the optimizer state:

=====  ===========================  ===========================
stage  bf16 masters, fp32 Adam      bf16 masters, bf16 Adam
=====  ===========================  ===========================
0      2Ψ + 2Ψ + 10Ψ  = 14Ψ         2Ψ + 2Ψ + 6Ψ   = 10Ψ
1      2Ψ + 2Ψ + 10Ψ/N              2Ψ + 2Ψ + 6Ψ/N
2      2Ψ + (2Ψ + 10Ψ)/N            2Ψ + (2Ψ + 6Ψ)/N
3      (2Ψ + 2Ψ + 10Ψ)/N            (2Ψ + 2Ψ + 6Ψ)/N
=====  ===========================  ===========================

``rounding="kahan"`` adds a bf16 compensation per parameter, kept with the optimizer state:
K + 2 (12 or 8), partitioned from stage 1 on.

The update works on fp32 copies of this rank's masters, gradients and moments (the fp32
math DeepSpeed's fused Adam does in registers): they live during the update only and are
not model states.
Activations, temporary buffers (gathered ZeRO-3 parameters, communication buckets) and
allocator fragmentation are not model states and are not counted here;
:func:`reduce_buffer_bytes` gives what fzero holds beside them at the step's peak (its
gradient reduce buffers, and ZeRO-3's gathered units), which ``fzero estimate`` adds to
its total; a test holds the sum within 10% of every tensor byte a rank's process holds.

A partitioned flat buffer is padded to a multiple of N, so a rank's shard is
``ceil(Ψ / N)`` elements.

Tensor and pipeline parallelism (``tp=``, ``pp=``): the world is ``pp × dp × tp`` ranks,
as :class:`fzero.Mesh` lays it out, and ZeRO partitions over ``dp = world_size / (tp·pp)``
only. Before ZeRO a rank holds Ψ' = Ψ / (tp·pp) parameters: Megatron slices every weight
matrix over the tp ranks (Shoeybi et al. 2019, section 3) and a pipeline stage holds 1/pp
of the layers. That assumes an even split, and ignores the small tensors tp replicates
(LayerNorm weights, biases of row-parallel layers) and a stage's extra embedding; Ψ' is
rounded up, the share of the busiest rank. So every formula above holds with Ψ → Ψ' and
N → dp: mixed precision ZeRO-2 on pp × dp × tp = 2 × 4 × 2 is 2Ψ' + 14Ψ'/4 with Ψ' = Ψ/4.
"""

from __future__ import annotations

from typing import Literal

from fzero.transforms._checks import default_bucket_bytes

__all__ = ["model_state_bytes", "reduce_buffer_bytes", "coefficients", "rank_share", "format_bytes", "KEPT",
           "OPTIMIZER_STATES", "PRECISIONS", "REDUCE_BUFFERS"]

Precision = Literal["fp32", "bf16", "fp16"]
Kept = Literal["fp32", "bf16"]

# fp32 state tensors per parameter that each optimizer keeps.
OPTIMIZER_STATES = {
    "adam": 2,  # exp_avg, exp_avg_sq
    "adamw": 2,
    "lamb": 2,
    "lion": 1,  # momentum
    "sgd-momentum": 1,  # momentum buffer
    "sgd": 0,
}
# Bytes of the parameters (and gradients) a step computes with.
PRECISIONS = {"fp32": 4, "bf16": 2, "fp16": 2}
# Bytes per element of master weights and optimizer state, by the dtype they are kept in.
KEPT = {"fp32": 4, "bf16": 2}
# Reduce buffers fzero's shard_state keeps at stages 2-3: MAX_IN_FLIGHT (2), the bucket being
# filled and the one sent before it; a bucket's buffer is taken only once fewer reduce-scatters
# are outstanding, and the pool allocates only when none of its buffers fits
# (fzero/transforms/shard_state/_reduce.py).
REDUCE_BUFFERS = 2


def _positive(name: str, arg: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: {arg} must be a positive int, got {value!r}")


def rank_share(num_params: int, *, world_size: int, tp: int = 1, pp: int = 1) -> tuple[int, int]:
    """``(Ψ', dp)``: the parameters one rank holds before ZeRO, and the data-parallel
    ranks ZeRO partitions them over, on a world of ``pp × dp × tp`` ranks.

    Ψ' = ⌈Ψ / (tp·pp)⌉, assuming tp slices every weight matrix and pp gives each stage
    1/pp of the layers, evenly (replicated small tensors such as LayerNorm's ignored).

    Raises:
        ValueError: a count that is not a positive int, or ``world_size`` not a multiple
            of ``tp·pp``; the message gives world_size, tp and pp.

    Example:
        >>> rank_share(1_000_000, world_size=16, tp=2, pp=2)
        (250000, 4)
    """
    return _rank_share("rank_share", num_params, world_size, tp, pp)


def _rank_share(name: str, num_params: int, world_size: int, tp: int, pp: int) -> tuple[int, int]:
    for arg, value in (("num_params", num_params), ("world_size", world_size), ("tp", tp), ("pp", pp)):
        _positive(name, arg, value)
    if world_size < tp * pp:
        raise ValueError(f"{name}: world_size={world_size} is smaller than tp={tp} × pp={pp} = {tp * pp}: "
                         f"dp = world_size/(tp·pp) would be less than 1 (the world is pp × dp × tp ranks)")
    if world_size % (tp * pp):
        raise ValueError(f"{name}: world_size={world_size} is not a multiple of tp={tp} × pp={pp} = {tp * pp}: "
                         f"dp = world_size/(tp·pp) must be whole (the world is pp × dp × tp ranks)")
    return -(-num_params // (tp * pp)), world_size // (tp * pp)


def model_state_bytes(
    num_params: int,
    *,
    world_size: int,
    stage: int,
    precision: Precision = "fp32",
    optimizer: str = "adam",
    tp: int = 1,
    pp: int = 1,
    master_weights: Kept = "fp32",
    optimizer_states: Kept = "fp32",
    rounding: Literal["nearest", "stochastic", "kahan"] = "nearest",
) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state that one rank holds.

    Args:
        num_params: Ψ, the number of (trainable) parameters of the whole model.
        world_size: the number of ranks, ``pp × dp × tp``; with ``tp = pp = 1`` it is N,
            the data-parallel ranks the states are partitioned over.
        stage: ZeRO stage: 0 replicates everything, 1 partitions the optimizer state,
            2 also the gradients, 3 also the parameters.
        precision: ``"fp32"``, or ``"bf16"`` / ``"fp16"`` mixed precision (2-byte
            parameters and gradients, fp32 master weights counted as optimizer state).
        optimizer: ``adam``, ``adamw``, ``lamb`` (2 fp32 states per parameter), ``lion``,
            ``sgd-momentum`` (1) or ``sgd`` (0).
        tp, pp: tensor- and pipeline-parallel degrees: a rank holds Ψ' = Ψ/(tp·pp) of the
            parameters and ZeRO partitions them over N = dp = world_size/(tp·pp) (see
            :func:`rank_share` for the assumption).
        master_weights, optimizer_states: under ``"bf16"`` precision, the dtype of the
            master weights and of the optimizer's states (``fzero.mixed_precision``'s
            keywords of these names); ``"bf16"`` needs ``precision="bf16"``, and bf16 states
            need bf16 masters, as in DeepSpeed.
        rounding: ``"kahan"`` (bf16 masters only) adds the 2-byte compensation per parameter
            to the optimizer state; ``"nearest"`` and ``"stochastic"`` add nothing.

    Raises:
        ValueError: an argument out of range, or ``world_size`` not a multiple of
            ``tp·pp``; the message names it.

    Example:
        >>> model_state_bytes(1_000_000, world_size=8, stage=2, precision="bf16")
        {'params': 2000000, 'grads': 250000, 'optimizer': 1500000, 'total': 3750000}
        >>> model_state_bytes(4_000_000, world_size=32, stage=2, precision="bf16", tp=2, pp=2)
        {'params': 2000000, 'grads': 250000, 'optimizer': 1500000, 'total': 3750000}
        >>> model_state_bytes(1_000_000, world_size=8, stage=2, precision="bf16", master_weights="bf16",
        ...                   optimizer_states="bf16")
        {'params': 2000000, 'grads': 250000, 'optimizer': 750000, 'total': 3000000}
    """
    name = "model_state_bytes"
    num_params, world_size = _rank_share(name, num_params, world_size, tp, pp)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ValueError(f"{name}: stage must be 0, 1, 2 or 3, got {stage!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"{name}: precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    opt = str(optimizer).lower().replace("_", "-")
    if opt not in OPTIMIZER_STATES:
        raise ValueError(f"{name}: optimizer must be one of {', '.join(OPTIMIZER_STATES)}, got {optimizer!r}")

    for key, value in (("master_weights", master_weights), ("optimizer_states", optimizer_states)):
        if value not in KEPT:
            raise ValueError(f"{name}: {key} must be 'fp32' or 'bf16', got {value!r}")
    if master_weights == "bf16" and precision != "bf16":
        raise ValueError(f"{name}: master_weights='bf16' needs precision='bf16', got {precision!r}")
    if optimizer_states == "bf16" and master_weights != "bf16":
        raise ValueError(f"{name}: optimizer_states='bf16' needs master_weights='bf16'")
    if rounding not in ("nearest", "stochastic", "kahan"):
        raise ValueError(f"{name}: rounding must be 'nearest', 'stochastic' or 'kahan', got {rounding!r}")
    if rounding != "nearest" and master_weights != "bf16":
        raise ValueError(f"{name}: rounding={rounding!r} needs master_weights='bf16'")

    p = g = PRECISIONS[precision]
    masters = KEPT[master_weights] if precision != "fp32" else 0  # the masters beside the 16-bit parameters
    k = KEPT[optimizer_states] * OPTIMIZER_STATES[opt] + masters + (KEPT["bf16"] if rounding == "kahan" else 0)
    shard = -(-num_params // world_size)  # ceil: the flat buffer is padded to a multiple of N
    params = p * (shard if stage >= 3 else num_params)
    grads = g * (shard if stage >= 2 else num_params)
    optim = k * (shard if stage >= 1 else num_params)
    return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}


def reduce_buffer_bytes(num_params: int, *, world_size: int, stage: int, precision: Precision = "fp32",
                        bucket_bytes: int | None = None, tp: int = 1, pp: int = 1) -> int:
    """Bytes a rank holds at the step's peak beyond the model states: the gradient reduce
    buffers, and at stage 3 the gathered parameters.

    * Stage 0 all-reduces the gradients in their flat groups and keeps the groups between
      steps (as DDP keeps its buckets): the fp32 gradients are views of them; bf16/fp16
      gradients are reduced in fp32 there and copied out (4 bytes per parameter beside the
      formula's 2-byte gradients).
    * Stage 1 under accumulation holds the whole sum until the update's last micro-batch
      (the formula's whole gradient, in fp32) and reduce-scatters it into this rank's fp32
      partition, alive beside it at the peak: what this counts. Without accumulation it
      reduces bucket by bucket as stage 2 does and holds stage 2's bytes, less than this.
    * Stages 2-3 copy each bucket into a reduce buffer (fp32 for bf16/fp16) and
      reduce-scatter it; up to :data:`REDUCE_BUFFERS` are in use at once and kept between
      steps, never more than the whole gradient (a group of another size, such as the
      loose parameters beside stage 3's units, adds its own buffer). The reduced partition stays in fp32 until
      the last bucket is in (2 bytes per partitioned parameter more than the formula's).
    * Stage 3 holds the unit being computed and the one prefetched, gathered.

    ``bucket_bytes`` ``None`` is ``shard_state``'s default: 1/32 of the parameters' bytes, at
    most 25 MiB and at least 64 KiB (:func:`fzero.transforms._checks.default_bucket_bytes`); a parameter larger
    than that is a bucket of its own, which this count, knowing no shapes, does not see.
    At stage 3 a bucket is a ZeRO-3 unit (a transformer block): pass its size in bytes of
    parameters as ``bucket_bytes``. ``world_size``, ``tp`` and ``pp`` are as in
    :func:`model_state_bytes`: a rank's buffers hold its Ψ' = Ψ/(tp·pp) parameters,
    reduced over dp.

    Example:
        >>> reduce_buffer_bytes(10**9, world_size=1, stage=2)  # 2 buckets of 25 MiB (the cap)
        52428800
        >>> reduce_buffer_bytes(10**6, world_size=1, stage=2)  # 2 buckets of 1/32 of the model
        250000
        >>> reduce_buffer_bytes(1000, world_size=1, stage=2, bucket_bytes=2**20)  # a bucket above the model
        4000
    """
    num_params, world_size = _rank_share("reduce_buffer_bytes", num_params, world_size, tp, pp)
    p = PRECISIONS[precision]
    if stage == 0:
        return 0 if p == 4 else 4 * num_params
    if stage == 1:
        return (4 - p) * num_params + 4 * -(-num_params // world_size)
    if bucket_bytes is None:
        bucket_bytes = default_bucket_bytes(p * num_params)
    per_bucket = -(-bucket_bytes // p)
    total = 4 * min(num_params, REDUCE_BUFFERS * per_bucket) + (4 - p) * -(-num_params // world_size)
    if stage == 3:
        total += p * min(num_params, 2 * per_bucket)
    return total


def coefficients(*, stage: int, precision: Precision = "fp32", optimizer: str = "adam", master_weights: Kept = "fp32",
                 optimizer_states: Kept = "fp32", rounding: str = "nearest") -> tuple[int, int]:
    """``(a, b)`` such that the per-rank bytes are ``aΨ + bΨ/N`` (before padding); with
    tensor or pipeline parallelism, ``aΨ' + bΨ'/dp`` with Ψ' = Ψ/(tp·pp).

    Example:
        >>> coefficients(stage=2, precision="bf16", master_weights="bf16")
        (2, 12)
    """
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ValueError(f"coefficients: stage must be 0, 1, 2 or 3, got {stage!r}")
    one = model_state_bytes(1, world_size=1, stage=0, precision=precision, optimizer=optimizer,
                            master_weights=master_weights, optimizer_states=optimizer_states, rounding=rounding)
    parts = [("params", 3), ("grads", 2), ("optimizer", 1)]
    a = sum(one[k] for k, s in parts if stage < s)
    b = sum(one[k] for k, s in parts if stage >= s)
    return a, b


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units: ``'2.42 GiB'``, ``'976.56 KiB'``, ``'12 B'``.

    Example:
        >>> format_bytes(2_600_000_000), format_bytes(1_000_000), format_bytes(12)
        ('2.42 GiB', '976.56 KiB', '12 B')
    """
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
