"""Step time of a training step from its FLOPs, its bytes communicated and per-op overheads.

``fzero estimate --time`` prints :func:`step_time`. The model, for one update on a world of
``pp × dp × tp`` ranks (the layout of :class:`fzero.Mesh`):

* **compute** = matmul FLOPs / the machine's matmul FLOP/s + elementwise bytes / its
  elementwise bandwidth, per rank: the FLOPs and bytes of a token divided by ``tp·pp``
  (Megatron's split), times the tokens a dp rank sees. A pipeline adds its bubble: the
  compute is stretched by ``(m + p - 1) / m`` (GPipe and 1F1B alike, Huang et al. 2019).
* **communication**: the bytes fzero's collectives send, exactly the table of
  docs/zero.md "Communication per step" (the ring algorithms' bytes, what
  :func:`fzero.distributed.comm.sent_bytes` counts): stage 0 ``2Ψ'gf`` once per update,
  stage 1 ``Ψ'gf + Ψ'pf``, stage 2 ``kΨ'gf + Ψ'pf``, stage 3 ``kΨ'gf + 2kΨ_u pf + kΨ_o pf``
  with ``f = (N-1)/N``, ``g`` = 4 (gradients reduced in fp32), ``p`` the parameters' bytes,
  ``k`` micro-batches; each collective costs ``sent / bandwidth + steps × latency``, ``steps``
  = ``N - 1`` for a reduce-scatter or all-gather, ``2(N - 1)`` for an all-reduce; a machine
  may carry measured bandwidth and latency per kind instead (``Machine.collectives``: gloo's
  reduce-scatter is not a ring; ``Machine.pair_collectives`` for a group of two ranks, where
  fzero exchanges point-to-point on gloo) and a latency for collectives issued one at a time
  (``Machine.serial_latency``, tensor parallelism's). Tensor
  parallelism all-reduces the activations 4 times per block per micro-batch, forward and
  backward (Megatron, Shoeybi et al. 2019, sec. 3), on the critical path, each with the
  machine's ``tp_overhead`` (measured from a real tensor-parallel step; 0 on the presets); a pipeline sends a
  micro-batch's activations forward and its gradient back at each stage boundary.
* **overlap**: gradient reductions run while backward goes on, and stage 3's gathers are
  prefetched, so up to ``overlap`` × that compute hides them; what does not fit is exposed,
  and at least the last bucket (stage 3: the first unit's gather) always is. Stage 1-2's
  all-gather after the update is exposed whole.
* **reduction**: on a machine that was measured, a data-parallel step (dp > 1) also pays
  ``Machine.reduce_byte_overhead`` seconds per byte of its fp32 gradient, once per reduction,
  exposed: what a real 2-rank fzero step took beyond its parts as this model counts them
  (the sink's passes over its reduce buffer, the collective's slowdown inside a step, the
  step's small all-reduces).
* **optimizer**: the bytes of the update's elementwise pass (:data:`OPTIMIZER_BYTES` per
  parameter a rank updates) over the machine's optimizer bandwidth.
* **host**: a per-step, a per-leaf and a per-collective overhead. On a CPU the host is the
  device: every term adds. On a GPU (``host_async``) the host launches ahead of the device,
  so the step is the larger of the two.

Everything here is arithmetic on numbers: no torch. The machine is a :class:`Machine`: a
datasheet preset (:data:`PRESETS`, ``h100``/``h200``), or one measured by
``fzero estimate --calibrate`` (:mod:`fzero.perf_calibrate`) and read back with
:func:`load_machine`. Validated against fzero's measured steps by ``benchmarks/perf_model.py``
(docs/performance.md, "Performance model").

Example:
    >>> w = gpt_workload(layers=24, hidden=2048, seq=2048, vocab=50257)
    >>> t = step_time(w, Layout(world_size=64, stage=2, precision="bf16"), PRESETS["h100"], global_batch=512)
    >>> round(t.total, 2), round(t.mfu, 2)
    (0.4, 0.38)
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

from fzero.memory import PRECISIONS

__all__ = ["Link", "Machine", "Workload", "Layout", "StepTime", "PRESETS", "OPTIMIZER_BYTES", "ELEMENTWISE",
           "gpt_workload", "ring_seconds", "dp_collectives", "step_time", "load_machine", "save_machine",
           "GPT3"]

# Bytes the optimizer's elementwise pass moves per parameter a rank updates (AdamW): fp32
# reads the parameter, gradient and two moments and writes three of them back (7 × 4);
# mixed precision reads and writes the fp32 master instead and writes the 16-bit copy too
# (7 × 4 + 2).
OPTIMIZER_BYTES = {"fp32": 28, "bf16": 30, "fp16": 30}

# Elements of non-matmul traffic (inputs + outputs of every elementwise op, forward and
# backward) per token, for examples/gpt.py's GPT: 69·d per block, 10·d outside the blocks and
# 8·V for the head's log-softmax and loss. Counted with a TorchDispatchMode over a real CPU
# step (torch 2.13, scaled_dot_product_attention's fused CPU kernel; batch 1 and 2, the
# difference per token) at d = 64..256, L = 1..2, V = 256..512, s = 32..64: the count fit
# these coefficients to within 0.1%, independent of s. Under tp, 46·d of a block's 69·d are
# in tensors tp splits (the MLP's 4d hidden, q/k/v, attention) and 23·d replicated (the
# LayerNorms, the residual adds). tests/test_perf_model.py counts them again.
ELEMENTWISE = {"block_split": 46, "block_replicated": 23, "outside": 10, "vocab": 8}

# GPT-3's shapes (Brown et al. 2020, table 2.1): parameters, layers, d_model, heads.
GPT3 = {
    "1.3B": dict(layers=24, hidden=2048, heads=16),
    "2.7B": dict(layers=32, hidden=2560, heads=32),
    "6.7B": dict(layers=32, hidden=4096, heads=32),
    "13B": dict(layers=40, hidden=5140, heads=40),
}


@dataclass(frozen=True, kw_only=True)
class Link:
    """A ring's link: ``bandwidth`` bytes/s each rank sends (NCCL's bus bandwidth) and
    ``latency`` seconds per ring step."""

    bandwidth: float
    latency: float


@dataclass(frozen=True, kw_only=True)
class Machine:
    """What a rank's device and its links can do. Rates are *achieved* ones (what a step
    gets), not peaks; ``peak_flops`` is the peak MFU is reported against."""

    name: str
    """A short name, printed."""
    source: str
    """Where the numbers come from: a datasheet, or a measurement (command, load, date)."""
    matmul_flops: dict
    """Achieved dense matmul FLOP/s per rank by compute precision (``fp32``, ``bf16``, ``fp16``)."""
    peak_flops: dict
    """Peak FLOP/s per rank by precision: MFU's denominator."""
    elementwise_bandwidth: float
    """Bytes/s of the forward's and backward's elementwise ops (norms, activations, adds)."""
    optimizer_bandwidth: float
    """Bytes/s of the optimizer's elementwise pass (:data:`OPTIMIZER_BYTES` per parameter)."""
    intra: Link
    """Links between the ranks of one node."""
    inter: Link
    """Links between nodes (per rank: one NIC per GPU, as on rail-optimised clusters)."""
    ranks_per_node: int
    """Ranks that share a node (and its ``intra`` links)."""
    cores: float = 0
    """CPU only: cores the node's ranks get (measured: other jobs may hold some), one thread
    each; with more ranks than that, every rate (compute, bandwidths) is divided by
    ``ranks / cores`` (latency is not). 0: not shared (a GPU per rank)."""
    overlap: float = 1.0
    """The share of the compute a collective may run behind (0: none hides, 1: all can)."""
    step_overhead: float = 0.0
    """Host seconds per step beyond the work counted (Python of the step, the loss read)."""
    leaf_overhead: float = 0.0
    """Host seconds per parameter leaf per step (the per-tensor dispatches)."""
    collective_overhead: float = 0.0
    """Host seconds per collective call."""
    tp_overhead: float = 0.0
    """Seconds per tensor-parallel all-reduce beyond its modelled time (the collective's
    slowdown inside a step, the host work tensor parallelism adds per split layer). Measured
    on a CPU host as a 2-rank tensor-parallel fzero step less its parts
    (:mod:`fzero.perf_calibrate`); 0 on the datasheet presets."""
    reduce_byte_overhead: float = 0.0
    """Seconds per byte of gradient a data-parallel step reduces (dp > 1), beyond its
    collectives' modelled time: the sink's passes over its reduce buffer (zeroing, averaging),
    the collective's slowdown inside a step against one alone, the step's small all-reduces
    (the loss, the non-finite count). Measured on a CPU host as a 2-rank fzero step less its
    parts (:mod:`fzero.perf_calibrate`); 0 on the datasheet presets."""
    host_async: bool = False
    """The host launches ahead of the device (a GPU): the step is max(host, device), not their sum."""
    collectives: dict = field(default_factory=dict)
    """Measured costs by collective kind (``all_reduce``, ``reduce_scatter``, ``all_gather``):
    ``{"bandwidth": B/s, "latency": s per step}`` each, in the ring's terms (bytes sent per
    rank, steps of the ring). A backend whose algorithm is not the ring's (gloo's
    reduce-scatter costs what its all-reduce does) is described by these; a kind not here
    uses the ``intra``/``inter`` link. Empty on the datasheet presets: NCCL's rings."""
    pair_collectives: dict = field(default_factory=dict)
    """As ``collectives``, for a group of two ranks where fzero's collectives are exchanges of
    point-to-point messages rather than the backend's (a gloo pair:
    ``fzero/distributed/_pair.py``). A kind not here uses ``collectives``."""
    serial_latency: float = 0.0
    """Seconds per ring step of a collective issued alone and waited for at once after a
    stretch of compute (tensor parallelism's all-reduces on the critical path: the wait
    includes how far apart the ranks drifted since the last one), when it is more than the
    in-flight ``latency`` (0: the same)."""
    attention_flops: dict = field(default_factory=dict)
    """Achieved FLOP/s of attention's scores and values (``scaled_dot_product_attention``,
    forward and backward) per precision, where they run slower than the dense matmuls (small
    per-head products; measured on a CPU host by :mod:`fzero.perf_calibrate`). A precision
    not here takes its ``matmul_flops`` (the datasheet presets: fused attention at the dense
    rate)."""

    def share(self, ranks_on_node: int) -> float:
        """The fraction of one core's rates a rank gets when ``ranks_on_node`` ranks run."""
        return 1.0 if not self.cores else min(1.0, self.cores / ranks_on_node)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one token of the model costs, and the model's parameters."""

    params: int
    """Ψ, trainable parameters of the whole model."""
    leaves: int
    """Parameter tensors of the whole model."""
    layers: int
    """Transformer blocks (ZeRO-3 units and pipeline-stage slices)."""
    hidden: int
    """Width of the residual stream: tp's and pp's activations are tokens × hidden."""
    seq: int
    """Tokens per sequence."""
    matmul_flops_per_token: float
    """Matmul FLOPs per token, forward and backward."""
    attention_flops_per_token: float = 0.0
    """The part of ``matmul_flops_per_token`` that is attention's scores and values, at the
    machine's ``attention_flops`` rate where it has one."""
    elementwise_bytes_per_token: float
    """Bytes of non-matmul traffic per token, forward and backward, at fp32."""
    elementwise_split: float = 1.0
    """The share of ``elementwise_bytes_per_token`` tensor parallelism splits (the rest is
    replicated on every tp rank)."""
    unit_params: int = 0
    """Parameters in the blocks (ZeRO-3's units); the rest are gathered once per micro-batch."""

    def __post_init__(self):
        for name in ("params", "leaves", "layers", "hidden", "seq"):
            if getattr(self, name) < 1:
                raise ValueError(f"Workload: {name} must be at least 1, got {getattr(self, name)!r}")
        if not 0 <= self.attention_flops_per_token <= self.matmul_flops_per_token:
            raise ValueError(f"Workload: attention_flops_per_token={self.attention_flops_per_token!r} must lie "
                             f"between 0 and matmul_flops_per_token={self.matmul_flops_per_token!r} (it is a part of it)")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How the step runs: ``world_size`` ranks = pp × dp × tp, a ZeRO stage over dp, the
    micro-batches of an update (accumulation; a pipeline's micro-batches) and the compute
    precision. ``bucket_bytes`` None is shard_state's default (25 MiB or the whole model;
    at stage 3 1/32 of the parameters' bytes, at most 25 MiB); ``max_reuse_distance`` None
    is stage 3's default window (25 MiB of parameters), as ``fzero.compile`` takes it."""

    world_size: int
    stage: int
    tp: int = 1
    pp: int = 1
    micro_batches: int = 1
    precision: str = "fp32"
    bucket_bytes: int | None = None
    max_reuse_distance: float | None = None

    def __post_init__(self):
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"Layout: stage must be 0, 1, 2 or 3, got {self.stage!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"Layout: precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        for name in ("world_size", "tp", "pp", "micro_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"Layout: {name} must be at least 1, got {getattr(self, name)!r}")
        if self.world_size % (self.tp * self.pp):
            raise ValueError(f"Layout: world_size={self.world_size} is not a multiple of tp={self.tp} × "
                             f"pp={self.pp}: the world is pp × dp × tp ranks")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)


@dataclass(frozen=True)
class StepTime:
    """Seconds of one update, split; ``total`` is what a step takes."""

    compute: float
    bubble: float
    comm: float
    exposed_comm: float
    optimizer: float
    host: float
    total: float
    tokens_per_s: float
    mfu: float
    sent_bytes: dict = field(default_factory=dict)
    """Bytes one rank sends per update, by axis (``dp``, ``tp``, ``pp``)."""


def gpt_workload(*, layers: int, hidden: int, seq: int, vocab: int = 50257, params: int | None = None,
                 tied: bool = True) -> Workload:
    """A GPT's workload from its shape: ``12·L·d²`` parameters in the blocks (plus biases and
    LayerNorms), embeddings ``V·d + s·d``; FLOPs per token ``6Ψ + 12·L·s·d`` (Kaplan et al.
    2020 and Narayanan et al. 2021: the dense matmuls, and attention's scores and values,
    forward and backward, ``12·L·s·d`` of them, also its ``attention_flops_per_token``);
    elementwise bytes from :data:`ELEMENTWISE`.

    ``params`` replaces the count of the shape (the head is tied to the embedding unless
    ``tied=False``). Leaves: 12 per block (GPT-2's, with biases), 4 outside.

    Example:
        >>> w = gpt_workload(layers=24, hidden=2048, seq=2048)
        >>> w.params, round(w.matmul_flops_per_token / 1e9, 2)
        (1315723264, 9.1)
    """
    d = hidden
    block = 12 * d * d + 13 * d
    unit = layers * block
    psi = unit + vocab * d + seq * d + 2 * d + (0 if tied else vocab * d) if params is None else params
    e = ELEMENTWISE
    per_token = (layers * (e["block_split"] + e["block_replicated"]) + e["outside"]) * d + e["vocab"] * vocab
    return Workload(params=psi, leaves=12 * layers + 4, layers=layers, hidden=d, seq=seq,
                    matmul_flops_per_token=6 * psi + 12 * layers * seq * d,
                    attention_flops_per_token=12 * layers * seq * d,
                    elementwise_bytes_per_token=4.0 * per_token,
                    elementwise_split=layers * e["block_split"] * d / per_token, unit_params=min(unit, psi))


def ring_seconds(kind: str, payload: float, n: int, link: Link) -> float:
    """Seconds of one ring collective over ``n`` ranks: bytes sent / bandwidth + steps ×
    latency (``payload`` as :func:`fzero.distributed.comm.sent_bytes` takes it: an
    all-reduce's tensor, a reduce-scatter's whole input, an all-gather's own piece).

    Example:
        >>> round(ring_seconds("all_reduce", 8e9, 8, Link(bandwidth=1e11, latency=1e-5)), 6)  # 2·7/8·8 GB at 100 GB/s
        0.14014
    """
    if n <= 1:
        return 0.0
    sent = {"all_reduce": 2 * payload * (n - 1) / n, "reduce_scatter": payload * (n - 1) / n,
            "all_gather": payload * (n - 1), "send": payload}[kind]
    steps = {"all_reduce": 2 * (n - 1), "send": 1}.get(kind, n - 1)
    return sent / link.bandwidth + steps * link.latency


def dp_collectives(workload: Workload, layout: Layout) -> list[tuple[str, float, str]]:
    """fzero's data-parallel collectives of one update as ``(kind, payload bytes, when)``,
    ``when`` being ``"backward"`` (hidden behind backward up to the overlap), ``"forward"``
    (stage 3's prefetched gathers) or ``"after"`` (exposed). The payloads are the table of
    docs/zero.md "Communication per step"; a group is one bucket (``bucket_bytes``) or, at
    stage 3, one unit: consecutive blocks in runs within ``max_reuse_distance`` (default
    25 MiB of parameters; ``_checks.unit_runs``), each gathered for its forward and again
    for its backward except the last run, the reuse window, which stays gathered in between.
    When every block is within it there are no units: the whole model is gathered before
    each micro-batch and reduce-scattered in stage 2's buckets.

    Example (ZeRO-2, Ψ' = 1000 fp32 parameters in one bucket, 1 micro-batch: the gradient
    reduce-scattered, 4000 B, and the parameters all-gathered, this rank's 1000/N each):
        >>> w = Workload(params=1000, leaves=1, layers=1, hidden=1, seq=1, matmul_flops_per_token=0,
        ...              elementwise_bytes_per_token=0)
        >>> dp_collectives(w, Layout(world_size=4, stage=2, bucket_bytes=4000))
        [('reduce_scatter', 4000.0, 'backward'), ('all_gather', 1000.0, 'after')]
    """
    n, k, st = layout.dp, layout.micro_batches, layout.stage
    if n == 1:
        return []
    psi = -(-workload.params // (layout.tp * layout.pp))
    p, g = PRECISIONS[layout.precision], 4
    from fzero.transforms._checks import default_bucket_bytes, default_reuse_distance, unit_runs, units_within_reuse

    out = []
    if st == 3:
        units = max(1, workload.layers // layout.pp)
        psi_u = -(-workload.unit_params // (layout.tp * layout.pp))
        psi_o = psi - psi_u
        window = default_reuse_distance(p, layout.max_reuse_distance)
        runs = [k * psi_u / units for k in unit_runs([psi_u / units] * units, window)]  # shard_state's rules
        kept = units_within_reuse(runs, window)
        if kept == len(runs):  # no units: the whole model gathered for each micro-batch, in stage 2's buckets
            buckets = max(1, -(-p * psi // (layout.bucket_bytes or default_bucket_bytes(p * psi))))
            for _ in range(k):
                out += [("all_gather", p * psi / n, "after")]
                out += [("reduce_scatter", g * psi / buckets, "backward")] * buckets
            return out
        for _ in range(k):
            out += [("all_gather", p * psi_o / n, "after")] if psi_o else []
            out += [("all_gather", p * r / n, "forward") for r in runs]
            out += [("all_gather", p * r / n, "forward") for r in runs[:len(runs) - kept][::-1]]
            out += [("reduce_scatter", g * r, "backward") for r in runs[::-1]]
            out += [("reduce_scatter", g * psi_o, "backward")] if psi_o else []
        return out
    bucket = layout.bucket_bytes or default_bucket_bytes(p * psi, st)
    buckets = max(1, -(-p * psi // bucket))
    reductions = 1 if st in (0, 1) else k  # stages 0-1 reduce the sum once per update
    kind = "all_reduce" if st == 0 else "reduce_scatter"
    out += [(kind, g * psi / buckets, "backward")] * (buckets * reductions)
    if st in (1, 2):
        out += [("all_gather", p * psi / n, "after")]
    return out


def step_time(workload: Workload, layout: Layout, machine: Machine, *, global_batch: int) -> StepTime:
    """The modelled time of one update of ``global_batch`` sequences (of ``workload.seq``
    tokens), split into compute, pipeline bubble, exposed communication, optimizer and host.

    Raises:
        ValueError: ``global_batch`` does not split into ``dp × micro_batches`` whole sequences.
    """
    lay, w, m = layout, workload, machine
    dp, tp, pp, k = lay.dp, lay.tp, lay.pp, lay.micro_batches
    if global_batch < 1 or global_batch % (dp * k):
        raise ValueError(f"step_time: global_batch={global_batch} sequences do not split into dp={dp} × "
                         f"micro_batches={k} whole micro-batches")
    on_node = min(lay.world_size, m.ranks_per_node)
    share = m.share(on_node)
    tokens = global_batch * w.seq / dp  # a dp rank's tokens per update; its tp ranks share them
    flops = w.matmul_flops_per_token * tokens / (tp * pp)
    attention = w.attention_flops_per_token * tokens / (tp * pp)  # among flops; tp splits the heads
    dense_rate = m.matmul_flops[lay.precision]
    attention_rate = m.attention_flops.get(lay.precision, dense_rate)
    elem_fraction = (w.elementwise_split / tp + (1 - w.elementwise_split)) / pp
    elem_bytes = w.elementwise_bytes_per_token * PRECISIONS[lay.precision] / 4 * tokens * elem_fraction
    compute = ((flops - attention) / dense_rate + attention / attention_rate
               + elem_bytes / m.elementwise_bandwidth) / share
    bubble = compute * (pp - 1) / k

    def link(span: int, kind: str | None = None, serial: bool = False, group: int = 0) -> Link:
        base = m.intra if span <= m.ranks_per_node else m.inter
        if group == 2 and kind in m.pair_collectives:
            base = Link(**m.pair_collectives[kind])
        elif kind in m.collectives:
            base = Link(**m.collectives[kind])
        latency = max(base.latency, m.serial_latency) if serial else base.latency
        return Link(bandwidth=base.bandwidth * share, latency=latency)

    # data parallel: the dp group's ranks are tp apart, so it spans dp·tp ranks
    colls = dp_collectives(w, lay)
    secs = {"backward": 0.0, "forward": 0.0, "after": 0.0}
    last = {"backward": 0.0, "forward": 0.0}
    for kind, payload, when in colls:
        t = ring_seconds(kind, payload, dp, link(dp * tp, kind, group=dp))
        secs[when] += t
        last[when] = t  # the last reduce, the first gather: never behind compute
    # the reduction's in-step cost beyond its collectives, once per reduction of the gradient
    psi_local = -(-w.params // (tp * pp))
    reductions = 0 if dp == 1 else 1 if lay.stage in (0, 1) else k
    reduce_extra = m.reduce_byte_overhead * 4 * psi_local * reductions / share
    dp_comm = sum(secs.values()) + reduce_extra
    per_micro = compute / k
    # backward is 2/3 of compute; stages 0-1 reduce in the last micro-batch's backward only
    window = m.overlap * 2 / 3 * (per_micro if lay.stage in (0, 1) else compute)
    if lay.stage == 3:
        hide = secs["backward"] + secs["forward"]
        exposed_dp = max(last["forward"] + last["backward"], hide - m.overlap * compute) + secs["after"]
    else:
        exposed_dp = max(last["backward"], secs["backward"] - window) + secs["after"]
    exposed_dp += reduce_extra
    # tensor parallel: 4 all-reduces of a micro-batch's (tokens × hidden) per block, on the critical path
    micro_tokens = tokens / k
    act = micro_tokens * w.hidden * PRECISIONS[lay.precision]
    blocks = w.layers / pp
    n_tp = int(4 * blocks * k) if tp > 1 else 0
    tp_comm = n_tp * (ring_seconds("all_reduce", act, tp, link(tp, "all_reduce", serial=True, group=tp))
                      + m.tp_overhead / share)
    # pipeline: a micro-batch's activations forward and its gradient back, per slot of the schedule
    n_pp = 2 * (k + pp - 1) if pp > 1 else 0
    pp_comm = n_pp * ring_seconds("send", act, 2, link(tp * dp * pp))
    comm = dp_comm + tp_comm + pp_comm
    exposed = exposed_dp + tp_comm + pp_comm

    updated = -(-w.params // (tp * pp))
    if lay.stage >= 1:
        updated = -(-updated // dp)
    optimizer = updated * OPTIMIZER_BYTES[lay.precision] / (m.optimizer_bandwidth * share)
    n_coll = len(colls) + n_tp + n_pp
    host = (m.step_overhead + m.leaf_overhead * math.ceil(w.leaves / pp) + m.collective_overhead * n_coll) / share
    device = compute + bubble + exposed + optimizer
    total = max(device, host) if m.host_async else device + host
    model_flops = w.matmul_flops_per_token * global_batch * w.seq
    peak = m.peak_flops[lay.precision]
    sent = {"dp": sum(_sent(kind, payload, dp) for kind, payload, _ in colls),
            "tp": n_tp * _sent("all_reduce", act, tp), "pp": n_pp / 2 * act}
    return StepTime(compute=compute, bubble=bubble, comm=comm, exposed_comm=exposed, optimizer=optimizer,
                    host=host, total=total, tokens_per_s=global_batch * w.seq / total,
                    mfu=model_flops / (lay.world_size * peak * total), sent_bytes=sent)


def _sent(kind: str, payload: float, n: int) -> float:
    return {"all_reduce": 2 * payload * (n - 1) / n, "reduce_scatter": payload * (n - 1) / n,
            "all_gather": payload * (n - 1)}[kind] if n > 1 else 0.0


# --------------------------------------------------------------------------- machines

_T = 1e12
# Vendor datasheet figures, not measured by us, except where a comment says so.
# H100 SXM: dense BF16 989.4 TFLOP/s, HBM3 3.35 TB/s, NVLink 4 900 GB/s both directions (450 per
# direction); H200 SXM: the same compute, HBM3e 4.8 TB/s. InfiniBand NDR 400 Gb/s = 50 GB/s per GPU.
# Achieved fractions (ours, stated): matmul 0.8 of peak -- an H200 here measured 788 TFLOP/s on
# an 8192³ bf16 matmul, 0.80 of 989.4; HBM 0.9 -- an H100 here measured 3020 GB/s of copy
# bandwidth (docs/performance.md, Kernels), 0.90 of 3.35 TB/s, and fzero's adamw_ kernel ran at
# 99% of it; an H200 measured 4.3 TB/s device-to-device copy (read + write), 0.90 of 4.8.
# NCCL bus bandwidth 0.8 of the link (NVLink ~360 GB/s, IB ~40 GB/s); latencies 10 µs per ring
# step in a node, 20 µs between nodes. The host's overheads (not measured on a GPU): 5 ms per
# step, 30 µs per leaf, 20 µs per collective, hidden behind the device's work (host_async).
def _gpu(name: str, hbm: float) -> Machine:
    peak = {"bf16": 989.4 * _T, "fp16": 989.4 * _T, "fp32": 494.7 * _T}  # fp32 counted at TF32's
    return Machine(
        name=name, source="vendor datasheet figures × stated achievable fractions (fzero/perf_model.py); "
                          "not measured, except the matmul and copy fractions",
        matmul_flops={k: 0.8 * v for k, v in peak.items()}, peak_flops=peak,
        elementwise_bandwidth=0.9 * hbm, optimizer_bandwidth=0.9 * hbm,
        intra=Link(bandwidth=0.8 * 450e9, latency=10e-6), inter=Link(bandwidth=0.8 * 50e9, latency=20e-6),
        ranks_per_node=8, overlap=1.0, step_overhead=5e-3, leaf_overhead=30e-6, collective_overhead=20e-6,
        host_async=True)


PRESETS = {"h100": _gpu("h100", 3.35e12), "h200": _gpu("h200", 4.8e12)}


def load_machine(path: str) -> Machine:
    """A :class:`Machine` from the JSON ``fzero estimate --calibrate`` writes (or one by hand).

    Raises:
        ValueError: a field missing or unknown, or a collective's cost malformed, naming it
            and the file.
    """
    with open(path) as f:
        data = json.load(f)
    names = {f.name for f in dataclasses.fields(Machine)}
    unknown = sorted(set(data) - names - {"measured"})
    if unknown:
        raise ValueError(f"load_machine: {path}: unknown field(s) {', '.join(unknown)}; a machine has "
                         f"{', '.join(sorted(names))}")
    try:
        machine = Machine(**{k: Link(**v) if k in ("intra", "inter") else v for k, v in data.items() if k in names})
    except TypeError as e:
        raise ValueError(f"load_machine: {path}: {e}") from None
    for field_name in ("collectives", "pair_collectives"):
        bad = sorted(k for k, v in getattr(machine, field_name).items()
                     if k not in ("all_reduce", "reduce_scatter", "all_gather") or not isinstance(v, dict)
                     or set(v) != {"bandwidth", "latency"})
        if bad:
            raise ValueError(f"load_machine: {path}: {field_name}: {', '.join(bad)}: each must be one of "
                             f"all_reduce, reduce_scatter, all_gather with exactly bandwidth and latency")
    return machine


def save_machine(machine: Machine, path: str, **measured) -> None:
    """Write ``machine`` as :func:`load_machine` reads it; ``measured`` is kept beside it, as
    the raw measurements it was fitted from."""
    data = dataclasses.asdict(machine) | ({"measured": measured} if measured else {})
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
