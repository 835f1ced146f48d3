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

import math
from typing import Literal

from fzero.transforms._checks import BUCKETS_PER_MODEL, default_bucket_bytes, default_reuse_distance, run_elements

__all__ = ["model_state_bytes", "optimizer_state_bytes", "reduce_buffer_bytes", "coefficients", "rank_share",
           "format_bytes", "KEPT", "OPTIMIZER_STATES", "PRECISIONS", "REDUCE_BUFFERS"]

Precision = Literal["fp32", "bf16", "fp16"]
Kept = Literal["fp32", "bf16"]

# fp32 state tensors per parameter element that each optimizer keeps (docs/optim.md's table);
# any other optimizer, Adafactor's factored moments included: optimizer_state_bytes.
OPTIMIZER_STATES = {
    "adam": 2,  # exp_avg, exp_avg_sq
    "adamw": 2,
    "lamb": 2,
    "adadelta": 2,  # square_avg, acc_delta
    "rprop": 2,  # prev, step_size
    "lion": 1,  # momentum
    "sgd-momentum": 1,  # momentum buffer
    "muon": 1,  # momentum (torch's Muon; fzero's muon keeps Adam's 2 on the non-matrices)
    "adagrad": 1,  # sum
    "rmsprop": 1,  # square_avg (+1 with momentum, +1 centered)
    "sgd": 0,
}
# Bytes of the parameters (and gradients) a step computes with.
PRECISIONS = {"fp32": 4, "bf16": 2, "fp16": 2}
# Bytes per element of master weights and optimizer state, by the dtype they are kept in.
KEPT = {"fp32": 4, "bf16": 2}
# Reduce buffers fzero's shard_state holds at once at stages 2-3: MAX_IN_FLIGHT (2), the bucket
# being filled and the one sent before it; a bucket's buffer is taken only once fewer
# reduce-scatters are outstanding, and the pool allocates only when none of its buffers fits
# (fzero/transforms/shard_state/_reduce.py). Between steps the pool keeps them, or with the
# default bucket at stages 1-2 at most 1/16 of the model's bytes of them (kept_reduce_bytes).
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
    optimizer_bytes: float | None = None,
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
        optimizer: a name of :data:`OPTIMIZER_STATES`: ``adam``, ``adamw``, ``lamb``,
            ``adadelta``, ``rprop`` (2 fp32 states per parameter), ``lion``,
            ``sgd-momentum``, ``muon``, ``adagrad``, ``rmsprop`` (1) or ``sgd`` (0).
        optimizer_bytes: instead of ``optimizer``, the optimizer's own bytes of state per
            parameter (without the masters), measured:
            ``optimizer_state_bytes(tx, params) / num_params`` for any optimizer (Adafactor's
            factored moments, a ``from_torch`` class). Counted ``·/N`` at stages 1-3 (a
            whole-tensor optimizer's owners hold about that; ``optimizer_state_bytes(tx,
            params, world_size=N)`` gives the busiest owner exactly).
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
    p = g = PRECISIONS[precision]
    k = _optimizer_k(name, precision, optimizer, optimizer_bytes, master_weights, optimizer_states, rounding)
    shard = -(-num_params // world_size)  # ceil: the flat buffer is padded to a multiple of N
    params = p * (shard if stage >= 3 else num_params)
    grads = g * (shard if stage >= 2 else num_params)
    optim = math.ceil(k * (shard if stage >= 1 else num_params))
    return {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}


def optimizer_state_bytes(tx, params, *, world_size: int = 1, bucket_bytes: int | None = None) -> int:
    """Bytes of the optimizer state ``tx.init`` makes for ``params``, measured, not tabled:
    ``tx.init`` runs on meta stand-ins of the parameters (same shapes and dtypes, no memory),
    so any optimizer counts exactly -- ``from_torch`` of any class, Adafactor's factored
    moments, scalars such as ``step``.

    With ``world_size`` N > 1: the busiest rank's bytes under ZeRO 1-3 over N data-parallel
    ranks. A per-element state tensor (one per parameter element, as Adam's moments) is cut
    as ``shard_state`` cuts its parameter (its layout of these parameters at ``bucket_bytes``,
    ``None`` its default: groups of loose parameters, each padded to N equal runs; ZeRO-3's
    units are not modelled); a scalar is kept on every rank. For a
    whole-tensor optimizer (``fzero.optim._known.needs_whole_tensors``: ``adafactor``,
    ``muon``, ``from_torch(Adafactor / Muon)``) each parameter's state, scalars included,
    lives on its owner rank, assigned as ZeRO assigns it (largest first, to the least loaded
    rank); a chain that mixes it with element-wise members counts every member's state on the
    owners. A state tensor belongs to the parameter whose key path ends its own (``mu['w']``)
    or ends it but for one entry (``state['w']['exp_avg']``); the update count belongs to none.

    Args:
        tx: a :class:`fzero.optim.GradientTransformation`.
        params: an ``nn.Module`` (its trainable parameters) or a pytree of tensors, on any
            device (``torch.device("meta")`` included: build the model under
            ``with torch.device("meta"):`` to count a model that does not fit).
        world_size: N, the data-parallel ranks ZeRO partitions over (1: the whole state).

    Divide by the number of parameters for ``model_state_bytes``'s ``optimizer_bytes``.

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> params = {"w": torch.empty(1024, 512, device="meta"), "b": torch.empty(512, device="meta")}
        >>> optimizer_state_bytes(optim.adamw(1e-3), params)  # 2 fp32 moments, an int64 count
        4198408
        >>> tx = optim.from_torch(torch.optim.Adafactor, lr=1e-2)
        >>> optimizer_state_bytes(tx, params)  # 4 x (1024 + 512 row/column means, 512 for b) + steps, count
        8208
    """
    import torch

    from fzero import tree
    from fzero.optim import _known
    from fzero.optim._owners import assign_owners

    _positive("optimizer_state_bytes", "world_size", world_size)
    if isinstance(params, torch.nn.Module):
        params = {k: v for k, v in params.named_parameters() if v.requires_grad}
    p_paths, p_leaves, spec = tree.flatten_with_path(params)
    bad = [tree.keystr(k) for k, v in zip(p_paths, p_leaves) if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"optimizer_state_bytes: params must be an nn.Module or a pytree of tensors; "
                        f"not tensors: {bad}")
    meta_leaves = [torch.empty(v.shape, dtype=v.dtype, device="meta") for v in p_leaves]
    meta = tree.unflatten(spec, meta_leaves)
    state = tx.init(meta)
    s_paths, s_leaves, _ = tree.flatten_with_path(state)
    tensors = [(k, v) for k, v in zip(s_paths, s_leaves) if isinstance(v, torch.Tensor)]
    total = sum(v.numel() * v.element_size() for _, v in tensors)
    if world_size == 1:
        return total
    names = [tree.keystr(k) for k in p_paths]

    def owner_of(path) -> int | None:
        """The parameter of a state tensor: the longest parameter path that ends the state's
        path (``mu['w']``) or ends it but for one entry (``state['w']['exp_avg']``)."""
        found = [i for i, k in enumerate(p_paths) if k and len(path) > len(k) - 1 and names[i] in (
            tree.keystr(path[len(path) - len(k):]), tree.keystr(path[len(path) - len(k) - 1: len(path) - 1]))]
        return max(found, key=lambda i: len(p_paths[i])) if found else None

    whole = _whole_tensor_state(tx, state, _known)
    owners = assign_owners([v.numel() for v in p_leaves], world_size) if whole else []
    owned = [0] * world_size
    per_element = [0] * len(p_leaves)  # bytes of state per element of each parameter
    replicated = 0
    for path, v in tensors:
        i = owner_of(path)
        if i is not None and id(v) in whole:
            owned[owners[i]] += v.numel() * v.element_size()
        elif i is not None and v.dim() > 0 and v.numel() == p_leaves[i].numel():
            per_element[i] += v.element_size()
        else:
            replicated += v.numel() * v.element_size()
    # shard_state's own layout of these parameters: groups cut by bucket_bytes, each padded to
    # N equal runs, one per rank.
    from fzero.transforms.shard_state._layout import build_layout

    named = dict(zip(names, meta_leaves))
    if isinstance(params, dict) and all(isinstance(v, torch.Tensor) for v in params.values()):
        # shard_state lays out a flat dict in its own order (a module's registration order)
        named = {tree.keystr((k,)): named[tree.keystr((k,))] for k in params}
    if bucket_bytes is None:
        bucket_bytes = default_bucket_bytes(sum(v.numel() * v.element_size() for v in meta_leaves))
    layout = build_layout(named, world=world_size, rank=0, bucket_bytes=bucket_bytes)
    load = [0] * world_size
    for i, (name, k) in enumerate(zip(names, per_element)):
        if not k:
            continue
        gi, j = layout.where[name]
        g = layout.groups[gi]
        start = g.offsets[j]
        end = start + meta_leaves[i].numel()
        for r in range(world_size):
            load[r] += k * max(0, min(end, (r + 1) * g.chunk) - max(start, r * g.chunk))
    return replicated + max(a + b for a, b in zip(load, owned))


def _whole_tensor_state(tx, state, known) -> set[int]:
    """The ids of the tensors in ``state`` that a whole-tensor member of ``tx`` keeps (chains
    and masks opened: a chain's state is its members' states in order, a mask's its inner's)."""
    from fzero import tree

    what = known.known(tx)
    if what is None or not what.whole_tensors:
        return set()
    if isinstance(what, known.Chain):
        return set().union(*(_whole_tensor_state(t, s, known) for t, s in zip(what.transforms, state)))
    if isinstance(what, known.Masked):
        return _whole_tensor_state(what.inner, state.inner_state, known)
    return {id(t) for t in tree.leaves(state)}


def reduce_buffer_bytes(num_params: int, *, world_size: int, stage: int, precision: Precision = "fp32",
                        bucket_bytes: int | None = None, tp: int = 1, pp: int = 1, block_params: int | None = None,
                        max_reuse_distance: float | None = None) -> int:
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
      reduce-scatter it; up to :data:`REDUCE_BUFFERS` are in use at once, never more than
      the whole gradient (between steps at most 1/16 of it is kept with the default
      bucket: :func:`fzero.transforms._checks.kept_reduce_bytes`; a group of another size, such as the
      loose parameters beside stage 3's units, adds its own buffer). The reduced partition stays in fp32 until
      the last bucket is in (2 bytes per partitioned parameter more than the formula's).
    * Stage 3 holds the unit being computed and the one prefetched, gathered; its buckets
      are its units. A unit is a run of consecutive blocks within the reuse window
      (``max_reuse_distance`` in elements, default 25 MiB of parameters:
      :func:`fzero.transforms._checks.default_reuse_distance`), or one block larger than
      it (:func:`fzero.transforms._checks.run_elements`); ``block_params`` is a block's
      elements (tp splits it as the rest), by default 1/32 of the model's; ``0`` says the
      model has no blocks (no ``ModuleList`` for ``shard_state`` to find), so stage 3 gathers
      it whole for the step, as a model within the window. The last run of forward stays gathered from
      its forward until its own backward, alive with the activations as those are and freed
      before this peak: like the activations, it is not counted here. A model within the
      window has no units (``shard_state`` gathers it whole for the step, in stage 2's
      buckets, ``bucket_bytes`` given or not): at the peak it holds stage 2's buffers and
      its parameters gathered whole.

    ``bucket_bytes`` ``None`` is ``shard_state``'s default: 25 MiB or the whole model when
    smaller (:func:`fzero.transforms._checks.default_bucket_bytes`), and at stage 3 the
    units above; a parameter larger than that is a bucket of its own, which this count,
    knowing no shapes, does not see. Given at stage 3, it is a unit's bytes of parameters,
    or, for a model within the window, the bucket of its stage-2 reduction.
    ``world_size``, ``tp`` and ``pp`` are as in :func:`model_state_bytes`: a rank's buffers
    hold its Ψ' = Ψ/(tp·pp) parameters, reduced over dp.

    Example:
        >>> reduce_buffer_bytes(10**9, world_size=1, stage=2)  # 2 buckets of 25 MiB (the cap)
        52428800
        >>> reduce_buffer_bytes(10**6, world_size=1, stage=2)  # one bucket: the whole model
        4000000
        >>> reduce_buffer_bytes(10**8, world_size=1, stage=3)  # blocks of 1/32, units of 2: 2 buffers, 2 gathered
        100000000
        >>> reduce_buffer_bytes(10**8, world_size=1, stage=3, block_params=10**7)  # a block above the window
        160000000
        >>> reduce_buffer_bytes(10**6, world_size=1, stage=3)  # within the window: stage 2's bucket, gathered whole
        8000000
        >>> reduce_buffer_bytes(10**8, world_size=1, stage=3, block_params=0)  # no blocks: 2 buckets, gathered whole
        452428800
        >>> reduce_buffer_bytes(1000, world_size=1, stage=2, bucket_bytes=2**20)  # a bucket above the model
        4000
        >>> reduce_buffer_bytes(10**6, world_size=1, stage=3, bucket_bytes=2**20)  # 2 buckets of 1 MiB, gathered whole
        6097152
    """
    num_params, world_size = _rank_share("reduce_buffer_bytes", num_params, world_size, tp, pp)
    p = PRECISIONS[precision]
    if stage == 0:
        return 0 if p == 4 else 4 * num_params
    if stage == 1:
        return (4 - p) * num_params + 4 * -(-num_params // world_size)
    whole, per_bucket = False, None
    if stage == 3:
        window = default_reuse_distance(p, max_reuse_distance)
        whole = num_params <= window or block_params == 0  # no units: stage 2's buckets, the model gathered whole
        if not whole and bucket_bytes is None:
            block = -(-block_params // tp) if block_params is not None else -(-num_params // BUCKETS_PER_MODEL)
            per_bucket = run_elements(block, window)
    if per_bucket is None:
        if bucket_bytes is None:
            bucket_bytes = default_bucket_bytes(p * num_params)
        per_bucket = -(-bucket_bytes // p)
    total = 4 * min(num_params, REDUCE_BUFFERS * per_bucket) + (4 - p) * -(-num_params // world_size)
    if stage == 3:
        total += p * (num_params if whole else min(num_params, 2 * per_bucket))
    return int(total)


def _optimizer_k(name: str, precision: str, optimizer: str, optimizer_bytes: float | None, master_weights: str,
                 optimizer_states: str, rounding: str) -> float:
    """K, the optimizer-side bytes per parameter: its state (measured or tabled, halved when kept
    in bf16), the master weights beside 16-bit parameters and a Kahan compensation."""
    state = _state_bytes(name, optimizer, optimizer_bytes)  # as fp32; halved when the moments are kept in bf16
    for key, value in (("master_weights", master_weights), ("optimizer_states", optimizer_states)):
        if value not in KEPT:
            raise ValueError(f"{name}: {key} must be 'fp32' or 'bf16', got {value!r}")
    if master_weights == "bf16" and precision != "bf16":
        raise ValueError(f"{name}: master_weights='bf16' needs precision='bf16', got {precision!r}")
    if optimizer_states == "bf16" and master_weights != "bf16":
        raise ValueError(f"{name}: optimizer_states='bf16' needs master_weights='bf16'")
    if rounding not in ("nearest", "stochastic", "kahan"):
        raise ValueError(f"{name}: rounding={rounding!r} must be 'nearest', 'stochastic' or 'kahan'")
    if rounding != "nearest" and master_weights != "bf16":
        raise ValueError(f"{name}: rounding={rounding!r} needs master_weights='bf16'")

    masters = KEPT[master_weights] if precision != "fp32" else 0  # the masters beside the 16-bit parameters
    k = state * KEPT[optimizer_states] / 4 + masters + (KEPT["bf16"] if rounding == "kahan" else 0)
    k = int(k) if float(k).is_integer() else k
    return k


def _state_bytes(name: str, optimizer: str, optimizer_bytes: float | None) -> float:
    """Bytes of optimizer state per parameter: measured (``optimizer_bytes``) or tabled."""
    if optimizer_bytes is not None:
        if isinstance(optimizer_bytes, bool) or not isinstance(optimizer_bytes, (int, float)) or \
                not 0 <= optimizer_bytes < math.inf:
            raise ValueError(f"{name}: optimizer_bytes must be a finite number >= 0 (bytes of optimizer state "
                             f"per parameter), got {optimizer_bytes!r}")
        return optimizer_bytes
    opt = str(optimizer).lower().replace("_", "-")
    if opt not in OPTIMIZER_STATES:
        raise ValueError(f"{name}: optimizer must be one of {', '.join(OPTIMIZER_STATES)}, got {optimizer!r} "
                         f"(any other optimizer: optimizer_bytes=optimizer_state_bytes(tx, params) / num_params)")
    return 4 * OPTIMIZER_STATES[opt]


def coefficients(*, stage: int, precision: Precision = "fp32", optimizer: str = "adam", master_weights: Kept = "fp32",
                 optimizer_states: Kept = "fp32", rounding: str = "nearest",
                 optimizer_bytes: float | None = None) -> tuple[float, float]:
    """``(a, b)`` such that the per-rank bytes are ``aΨ + bΨ/N`` (before padding); with
    tensor or pipeline parallelism, ``aΨ' + bΨ'/dp`` with Ψ' = Ψ/(tp·pp).

    Example:
        >>> coefficients(stage=2, precision="bf16", master_weights="bf16")
        (2, 12)
    """
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise ValueError(f"coefficients: stage must be 0, 1, 2 or 3, got {stage!r}")
    p = PRECISIONS.get(precision)
    if p is None:
        raise ValueError(f"coefficients: precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    one = {"params": p, "grads": p, "optimizer": _optimizer_k("coefficients", precision, optimizer, optimizer_bytes,
                                                             master_weights, optimizer_states, rounding)}
    parts = [("params", 3), ("grads", 2), ("optimizer", 1)]
    a = sum(one[part] for part, s in parts if stage < s)
    b = sum(one[part] for part, s in parts if stage >= s)
    return tuple(int(x) if float(x).is_integer() else x for x in (a, b))


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
