"""comm's traffic on real ranks: the bytes each rank sends per step, by collective kind and by
what it carried, against the formulas of docs/zero.md.

Every expected count is computed here, from the model's parameter shapes and the world size
by the documented layout rule (below), never from fzero's layout or counter. A rank's count
is what it sends on the wire under the ring algorithms (``comm.sent_bytes``): with a payload
of ``S`` bytes over ``N`` ranks, an all-reduce sends ``2 S (N-1)/N``, a reduce-scatter of an
``S``-byte input ``S (N-1)/N``, an all-gather of an ``s``-byte input ``s (N-1)``, a
broadcast ``S (N-1)/N`` and a send ``S``.

The layout rule (docs/zero.md): parameters are packed into flat groups, each padded to a
multiple of N. At stages 0-2 the groups are buckets of consecutive parameters up to
``bucket_bytes``: one group for the whole model with a large bucket, one group per parameter
with ``bucket_bytes=1``. At stage 3 each element of an ``nn.ModuleList`` (a *unit*) is a
group of its own and the other parameters are bucketed as above. ``Ψp`` below is the sum of
the padded group sizes, in elements.
"""

import datetime
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fzero
import fzero.testing as ft
from fzero import optim
from fzero.distributed import comm


def multirank(test):
    """Spawns real ranks: left out of ``make test-fast``."""
    return pytest.mark.slow(pytest.mark.multirank(test))


N = 2  # ranks
MODEL = (4, 5, 2, 3)  # d_in, width, depth, d_out: odd sizes, so padding shows
BUCKETS = {"one": 2**20, "each": 1}  # bucket_bytes: one group for every loose parameter, or one group each
KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send", "recv")
WHATS = ("gradients", "parameters", "loss", "psum", "metadata", "buffers", "activations", "activation_gradients",
         "attention")


Blocks = ft.Blocks


def _make_model():
    torch.manual_seed(0)
    return Blocks(*MODEL)


def _batches(steps, rows):
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(rows, MODEL[0], generator=g), "y": torch.randn(rows, MODEL[3], generator=g)}
            for _ in range(steps)]


def _by_what(spent: comm.Traffic) -> dict:
    """What a step's traffic sent, by (kind, what), the zero entries left out."""
    out = {(k, w): spent.sent(k, w) for k in KINDS for w in WHATS if spent.sent(k, w)}
    assert sum(out.values()) == spent.sent(), f"a what outside {WHATS}: {spent!r}"  # nothing else was sent
    return out


# --------------------------------------------------------------------------- one process


def test_sent_bytes_per_kind_is_exact_for_any_group_size():
    s = 12
    assert comm.sent_bytes("all_to_all", s, world=3) == Fraction(s * 2, 3)  # two of three blocks leave
    assert [comm.sent_bytes(k, s, world=3) for k in ("all_reduce", "reduce_scatter", "all_gather", "broadcast")] == \
        [16, 8, 24, 8]
    assert comm.sent_bytes("broadcast", 4, world=3) == Fraction(8, 3)  # a ring's average: the root and one rank send 4
    assert comm.sent_bytes("send", s, world=5) == s and comm.sent_bytes("recv", s, world=5) == 0
    assert all(comm.sent_bytes(k, s, world=1) == 0 for k in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"))
    with pytest.raises(ValueError, match="unknown kind 'allreduce'"):
        comm.sent_bytes("allreduce", s, world=2)


def test_a_difference_of_traffic_is_what_was_added_in_between():
    t = comm.Traffic()
    t.add("all_reduce", "loss", torch.zeros(()), world=3)
    before = t.copy()
    t.add("all_gather", "parameters", torch.zeros(5, dtype=torch.bfloat16), world=3)
    t.add("recv", "activations", torch.zeros(4))
    step = t - before
    assert (step.bytes(), step.bytes("recv"), step.sent(), step.sent("all_reduce")) == (26, 16, 20, 0)
    assert step.comm_bytes() == {"all_reduce": 0, "reduce_scatter": 0, "all_gather": 20, "all_to_all": 0,
                                 "broadcast": 0, "send": 0, "total": 20}
    assert t.sent() == Fraction(8 * 2, 3) + 20 and before.sent() == Fraction(16, 3)  # neither is changed


# --------------------------------------------------------------------------- the formulas


def _padded(numel: int) -> int:
    return -(-numel // N) * N


def _psi(stage: int, bucket: str, whole: bool = False) -> tuple[int, int]:
    """``(Ψp of the units, Ψp of every other parameter)`` by the layout rule, in elements;
    ``whole``: stage 3 with every unit within the reuse window, which has no units."""
    model = Blocks(*MODEL)
    units = [list(b.parameters()) for b in model.blocks] if stage == 3 and not whole else []
    in_units = {id(p) for u in units for p in u}
    loose = [p.numel() for p in model.parameters() if id(p) not in in_units]
    loose_groups = [sum(loose)] if bucket == "one" else loose
    return sum(_padded(sum(p.numel() for p in u)) for u in units), sum(_padded(g) for g in loose_groups)


def _expected(stage: int, *, k: int = 1, grad_bytes: int = 4, param_bytes: int = 4, bucket: str = "one",
              overflow_check: bool = True, kept: bool | None = None) -> dict:
    """Bytes one rank sends in one update of ``k`` micro-batches, by (kind, what).

    Gradients and parameters (``f = (N-1)/N``, ``g``/``p`` the bytes per element of the
    reduced gradient and of the gathered parameter):

    * stage 0: all-reduce of the gradients, ``2 Ψp g f``, once per update (the micro-batches'
      sum is held and reduced at the last);
    * stage 1: reduce-scatter of the gradients, ``Ψp g f``, once per update (the sum is held
      whole, as at stage 0), then the updated parameters all-gathered from the owned slices,
      ``Ψp p f``: the paper's ``2 Ψp f`` with ``g = p``;
    * stage 2: reduce-scatter of the gradients every micro-batch, ``k Ψp g f``, and the
      all-gather of the parameters once, ``Ψp p f``: the paper's ``2 Ψp f`` at ``k = 1``;
    * stage 3, every micro-batch: a unit is gathered before its forward and again when
      backward first needs it (a prefetch only starts that same gather earlier), and its
      gradient reduce-scattered: ``3 Ψu f`` -- unless it is within ``max_reuse_distance``,
      when it stays gathered from its forward to its backward: ``2 Ψu f``;
      the parameters outside every unit are gathered once for the whole micro-batch and
      reduce-scattered: ``2 Ψo f``. With every unit within the window (the default, 25 MiB
      of parameters, holds this whole model; ``0``: none) there are no units: the whole
      model is gathered once and reduce-scattered, in stage 2's groups: ``2 Ψp f``.

    And the small collectives of every step: the loss with the batch-size check, all-reduced
    every micro-batch (three fp64 scalars: the loss, ``n`` and ``n²``, ``2·24 f``); and at
    stages 1-3 the non-finite flag (fp32's ``nonfinite="skip"``, the default, or mixed
    precision's overflow check), one fp32 scalar all-reduced through ``psum`` per update.
    """
    kept = True if kept is None else kept  # the default window holds this whole model
    units, other = _psi(stage, bucket, whole=stage == 3 and kept)
    psi = units + other
    f = Fraction(N - 1, N)
    out = {("all_reduce", "loss"): k * 2 * 24 * f}
    if stage == 0:
        out[("all_reduce", "gradients")] = 2 * psi * grad_bytes * f
    elif stage == 1:
        out[("reduce_scatter", "gradients")] = psi * grad_bytes * f
    elif stage == 2:
        out[("reduce_scatter", "gradients")] = k * psi * grad_bytes * f
    else:
        out[("reduce_scatter", "gradients")] = k * (units + other) * grad_bytes * f
        gathers = 1 if kept else 2  # kept from forward to backward, or gathered again
        out[("all_gather", "parameters")] = k * (gathers * units + other) * param_bytes * f
    if stage in (1, 2):
        out[("all_gather", "parameters")] = psi * param_bytes * f
    if overflow_check and stage >= 1:
        out[("all_reduce", "psum")] = 2 * 4 * f
    return out


def _by_kind(by_what: dict) -> dict:
    out = {kind: sum((v for (k, _), v in by_what.items() if k == kind), Fraction(0)) for kind in KINDS[:-1]}
    out["total"] = sum(out.values(), Fraction(0))
    return out


def test_the_formulas_padding_by_hand():
    """The rule above on MODEL = Blocks(4, 5, 2, 3): inp 4·5+5 = 25, each block 5·5+5 = 30,
    out 5·3+3 = 18 elements."""
    assert _psi(0, "one") == (0, 104)  # 103 padded to 104
    assert _psi(0, "each") == (0, 20 + 6 + 2 * (26 + 6) + 16 + 4)  # 20, 5, 25, 5, 25, 5, 15, 3 each padded
    assert _psi(3, "one") == (60, 44)  # two units of 30; inp and out, 43, padded to 44
    stage2 = _expected(2)
    assert stage2[("reduce_scatter", "gradients")] + stage2[("all_gather", "parameters")] == 2 * 104 * 4 // 2


# --------------------------------------------------------------------------- ZeRO stages


def _zero_traffic(stage, bucket, k, dtype, reduce_in, steps=2):
    """Each step's bytes sent by this rank, by (kind, what) and as the step's
    ``metrics["comm_bytes"]``; the counted run's parameters equal the uncounted run's."""
    n, r = dist.get_world_size(), dist.get_rank()
    batches = _batches(steps, 2 * k * n)
    out, params = [], {}
    for on in (True, False):
        apply, p = fzero.functionalize(_make_model())
        state = fzero.TrainState.create(apply_fn=apply, params=p, tx=optim.adamw(1e-2))
        step = fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), zero=stage, accumulate=k, precision=dtype,
                             reduce_in=reduce_in, bucket_bytes=BUCKETS[bucket], comm_bytes=on)
        state = step.init(state)
        for b in batches:
            before = comm.traffic.copy()
            state, metrics = step(state, ft.local_batch(b, n, r))
            if on:
                out.append((_by_what(comm.traffic - before), metrics["comm_bytes"]))
            else:
                assert "comm_bytes" not in metrics
        params[on] = fzero.gather(state.params)
    ft.assert_trees_close(params[True], params[False], tol="exact", what=f"params counted or not, rank {r}")
    return out


def _check(results, expected):
    for r, steps in enumerate(results):
        for i, (by_what, metric) in enumerate(steps):
            assert by_what == expected, f"rank {r}, step {i}: {by_what} != {expected}"
            assert metric == _by_kind(expected), f"rank {r}, step {i}: metrics {metric}"


@multirank
@pytest.mark.parametrize("bucket", ["one", "each"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_stage_sends_the_zero_formula_per_step_and_rank(ranks, stage, bucket):
    _check(ranks(N).run(_zero_traffic, stage, bucket, 1, "fp32", None), _expected(stage, bucket=bucket))


@multirank
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_accumulation_reduces_once_per_update_at_stages_0_1_and_every_micro_batch_at_2_3(ranks, stage):
    k = 3
    _check(ranks(N).run(_zero_traffic, stage, "one", k, "fp32", None), _expected(stage, k=k))


@multirank
@pytest.mark.parametrize("reduce_in, grad_bytes", [(None, 4), ("bf16", 2)])
@pytest.mark.parametrize("stage", [2, 3])
def test_bf16_gradient_bytes_follow_the_reduce_dtype(ranks, stage, reduce_in, grad_bytes):
    """bf16 parameters are gathered in bf16 (2 bytes); gradients are summed in fp32 unless
    ``reduce_in="bf16"``."""
    expected = _expected(stage, grad_bytes=grad_bytes, param_bytes=2, overflow_check=True)
    _check(ranks(N).run(_zero_traffic, stage, "one", 1, "bf16", reduce_in), expected)


def _stage3_traffic(prefetch, max_reuse_distance=None, steps=2):
    n, r = dist.get_world_size(), dist.get_rank()
    apply, p = fzero.functionalize(_make_model())
    step = fzero.shard_state(ft.mse_step, fzero.Mesh(dp=-1), 3, bucket_bytes=BUCKETS["one"], prefetch=prefetch,
                             max_reuse_distance=max_reuse_distance)
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=p, tx=optim.adamw(1e-2)))
    out = []
    for b in _batches(steps, 2 * n):
        before = comm.traffic.copy()
        state, _ = step(state, ft.local_batch(b, n, r))
        out.append(_by_what(comm.traffic - before))
    return out


@multirank
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("max_reuse_distance", [None, 0])
def test_a_prefetched_unit_is_gathered_once_for_its_use(ranks, prefetch, max_reuse_distance):
    """Prefetching starts the next unit's gather early; it is not a second gather (in forward,
    and in backward where the units are freed after their forward: max_reuse_distance=0)."""
    for r, steps in enumerate(ranks(N).run(_stage3_traffic, prefetch, max_reuse_distance)):
        want = _expected(3, overflow_check=False, kept=max_reuse_distance is None)  # shard_state alone: no flag
        assert steps == [want] * 2, (r, steps)


# --------------------------------------------------------------------------- pipeline


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2))


def _pipeline_traffic(schedule, m, rows, steps=3):
    """Each step's bytes by (kind, what) on this rank of a 2-stage pipeline, its
    ``metrics["comm_bytes"]``, the payload it received, and its stage."""
    from fzero.transforms.pipeline import pipeline, split

    mesh = fzero.Mesh(pp=2, dp=1)
    model = _mlp()
    apply, params = fzero.functionalize(model)
    pipe = pipeline(split(model, [2]), F.mse_loss, mesh, micro_batches=m, schedule=schedule)

    def train_step(state, batch):
        loss, grads = pipe(state.params, batch["x"], batch["y"])
        return state.apply_gradients(grads), {"loss": loss}

    step = fzero.compile(train_step, mesh, pipeline=pipe, comm_bytes=True)
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1)))
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        before = comm.traffic.copy()
        state, metrics = step(state, {"x": torch.randn(rows, 3, generator=g), "y": torch.randn(rows, 2, generator=g)})
        spent = comm.traffic - before
        out.append((_by_what(spent), metrics["comm_bytes"], spent.bytes("recv")))
    return mesh.coords["pp"], out


@multirank
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_two_stage_pipeline_sends_one_boundary_tensor_per_micro_batch_each_way(ranks, schedule):
    """Stage 0 sends each micro-batch's activation (rows/m × 6 fp32, the output of
    Linear(3, 6) + Tanh) forward, stage 1 its gradient back; each receives the other's. The
    last stage broadcasts the loss with what a deferred ``fzero.global_mean`` counted (four
    fp64: loss, flag, count, divisor; ``32 (N-1)/N`` over the 2 stages).
    The first step also agrees on the stages' shapes (a few metadata broadcasts, once per
    input signature). And the non-finite flag (fp32's ``nonfinite="skip"``) is all-reduced
    over the stages, one fp32 scalar, so that every stage skips an update alike."""
    m, rows = 3, 12
    boundary = (rows // m) * 6 * 4
    for stage, steps in ranks(2).run(_pipeline_traffic, schedule, m, rows):
        sends = {("send", "activations" if stage == 0 else "activation_gradients"): Fraction(m * boundary)}
        expected = {**sends, ("broadcast", "loss"): Fraction(8 * 4, 2), ("all_reduce", "psum"): 2 * 4 * Fraction(1, 2)}
        for i, (by_what, metric, received) in enumerate(steps):
            first = {key: v for key, v in by_what.items() if key != ("broadcast", "metadata")}
            assert (first if i == 0 else by_what) == expected, (stage, i, by_what)
            assert metric == _by_kind(by_what), (stage, i, metric)
            assert received == m * boundary, (stage, i, received)
        assert ("broadcast", "metadata") in steps[0][0]


# --------------------------------------------------------------------------- tensor and sequence parallelism


def _tp_step_bytes(sequence_parallel: bool, rows: int, seq: int, d: int, layers: int):
    """One step of the example GPT at tp=2 (no dropout), ``metrics["comm_bytes"]``."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from gpt import GPT, GPTConfig

    from fzero.transforms import tp_plans

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=seq, n_layer=layers, n_head=2, n_embd=d))
    apply, params = fzero.functionalize(model)
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))

    def train_step(state, batch):
        def loss_fn(p):
            return F.cross_entropy(state.apply_fn(p, batch["x"]).flatten(0, 1), batch["y"].flatten())
        loss, grads = fzero.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads), {"loss": loss}

    step = fzero.compile(train_step, fzero.Mesh(dp=1, tp=2), tp=tp_plans.gpt(model, sequence_parallel=sequence_parallel),
                         sequence_parallel=sequence_parallel, comm_bytes=True)
    g = torch.Generator().manual_seed(1)
    batch = {"x": torch.randint(0, 32, (rows, seq), generator=g), "y": torch.randint(0, 32, (rows, seq), generator=g)}
    _, metrics = step(step.init(state), batch)
    return metrics["comm_bytes"]


def _tp_and_sp_bytes(rows, seq, d, layers):
    return _tp_step_bytes(False, rows, seq, d, layers), _tp_step_bytes(True, rows, seq, d, layers)


@multirank
def test_sequence_parallel_sends_tensor_parallels_bytes_as_all_gathers_and_reduce_scatters(ranks):
    """Megatron's count, per rank and step at tp=2, for the example GPT (``L`` blocks, each an
    attention and an MLP pair; ``S = rows x seq x d x 4`` bytes of one activation).

    Tensor parallelism: per pair one all-reduce of ``S`` forward (*g*) and one backward (*f*),
    each sending ``2 S (N-1)/N = S``: ``4 S`` per block. Sequence parallelism: per pair an
    all-gather of the ``S/N`` shard into the column-parallel layer and a reduce-scatter of
    ``S`` out of the row-parallel one, forward, and the reverse backward, each sending ``S/2``
    -- the same ``4 S`` per block, as a ring all-reduce is a reduce-scatter then an
    all-gather. On top: the column-parallel layers' shards all-gathered again in backward for
    their weight gradients (``S/2`` each, 2 per block), the residual stream cut into shards
    at the first block (its gradient all-gathered, ``S/2``) and gathered whole for the LM head
    (``S/2``), and the whole parameters used on shards summed over tp: each LayerNorm's
    weight and bias (``2 d`` fp32, 2 per block and the final one) and each row-parallel
    layer's bias (``d``, 2 per block), as all-reduces sending their payload. Both steps also
    check the batch (4 int64 all-gathered per rank) and all-reduce the non-finite flag (one
    fp32)."""
    rows, seq, d, layers, n = 3, 8, 16, 2, 2
    S = rows * seq * d * 4
    check, flag = 4 * 8 * (n - 1), Fraction(2 * 4 * (n - 1), n)
    for tp, sp in ranks(n).run(_tp_and_sp_bytes, rows, seq, d, layers):
        pairs_tp = layers * 4 * S  # two pairs per block, two all-reduces each
        assert tp["all_reduce"] == pairs_tp + flag and tp["all_gather"] == check and tp["reduce_scatter"] == 0, tp
        half = Fraction(S, n)
        regather, ends = layers * 2 * half, 2 * half
        pairs_sp = sp["all_gather"] - check - regather - ends + sp["reduce_scatter"]
        assert pairs_sp == pairs_tp, (sp, tp)  # the same bytes, another pair of collectives
        assert sp["reduce_scatter"] == layers * 4 * half
        assert sp["all_gather"] == check + layers * 4 * half + regather + ends
        norms, biases = (2 * layers + 1) * 2 * d * 4, 2 * layers * d * 4
        assert sp["all_reduce"] == flag + norms + biases, sp


# --------------------------------------------------------------------------- Ulysses sequence parallelism


class _SelfAttention(nn.Module):
    """A causal self-attention block through ``F.scaled_dot_product_attention``, written here
    (not fzero's, not a library's), whose q, k, v and output are ``(batch, heads, seq, dim)``."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, t, d))


def _ulysses_traffic(rows, seq, d, heads, layers, steps=2):
    torch.manual_seed(0)
    model = nn.Sequential(*[_SelfAttention(d, heads) for _ in range(layers)], nn.Linear(d, 1))
    apply, p = fzero.functionalize(model)
    step = fzero.compile(ft.mse_step, fzero.Mesh(dp=1, sp=2), comm_bytes=True)
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=p, tx=optim.sgd(0.1)))
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        before = comm.traffic.copy()
        batch = {"x": torch.randn(rows, seq, d, generator=g), "y": torch.randn(rows, seq, 1, generator=g)}
        state, m = step(state, batch)
        out.append((_by_what(comm.traffic - before), m["comm_bytes"], m["comm_bytes_by_axis"]))
    return out


@multirank
def test_ulysses_sends_eight_all_to_alls_of_a_layers_activations_per_step(ranks):
    """Per attention layer and step, each of q, k, v and the output is exchanged once forward
    and its gradient once backward: 8 all-to-alls, each of this rank's (rows, heads, seq/sp,
    dim) block, ``rows·seq/sp·d·4`` bytes, of which ``(sp-1)/sp`` leave the rank. Over a
    dp=1 mesh ZeRO's group is the sp group, so everything crosses sp."""
    sp, rows, seq, d, heads, layers = 2, 2, 8, 8, 4, 2
    block = rows * (seq // sp) * d * 4
    expected = layers * 8 * Fraction(block * (sp - 1), sp)
    for r, steps in enumerate(ranks(sp).run(_ulysses_traffic, rows, seq, d, heads, layers)):
        for i, (by_what, metric, by_axis) in enumerate(steps):
            assert by_what[("all_to_all", "attention")] == expected, (r, i, by_what)
            assert metric["all_to_all"] == expected, (r, i, metric)
            assert by_axis["sp"] == metric["total"] and by_axis["other"] == 0, (r, i, by_axis)


# --------------------------------------------------------------------------- a gloo pair's exchanges


def _pair_against_gloo():
    """Each helper on a pair (one exchange of point-to-point messages) against gloo's own
    collective (``dist.*`` called directly) on the same inputs: bit-equal results, the same
    on both ranks for a reduction, and ``traffic`` counting the collective's kind. Several
    exchanges in flight at once are waited on out of order."""
    from fzero.distributed import _pair

    r = dist.get_rank()
    assert _pair.peer(None, torch.zeros(1)) == _pair.Peer(rank=1 - r, me=r)
    g = torch.Generator().manual_seed(10 + r)  # every rank's inputs differ
    out = []
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.int64):
        for n in (1, 7, 4096):
            x = (torch.randn(2 * n, generator=g) * 100).to(dtype)
            got, ref = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
            comm.reduce_scatter_flat(got, x.clone())
            dist.reduce_scatter_tensor(ref, x.clone())
            assert torch.equal(got, ref), (dtype, n, "reduce_scatter")
            half = x[:n].clone()
            got2, ref2 = torch.empty(2 * n, dtype=dtype), torch.empty(2 * n, dtype=dtype)
            comm.all_gather_flat(got2, half)
            dist.all_gather_into_tensor(ref2, half)
            assert torch.equal(got2, ref2), (dtype, n, "all_gather")
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN):
                a, b = x.clone(), x.clone()
                comm.all_reduce(a, op=op)
                dist.all_reduce(b, op=op)
                assert torch.equal(a, b), (dtype, n, op)
                out.append(a)
    # In place: this rank's half of the output is the all-gather's input.
    buf = torch.arange(8.0) + 100 * r
    comm.all_gather_flat(buf, buf[4 * r: 4 * r + 4])
    assert torch.equal(buf, torch.cat([torch.arange(4.0), torch.arange(4.0, 8.0) + 100])), buf
    # Three in flight, waited on last first.
    xs = [torch.full((2 * k + 2,), float(r + k)) for k in range(3)]
    outs = [torch.empty(k + 1) for k in range(3)]
    works = [comm.reduce_scatter_flat(o, x, async_op=True) for o, x in zip(outs, xs)]
    assert all(isinstance(w, _pair.PairWork) for w in works)
    for w in reversed(works):
        w.wait(datetime.timedelta(seconds=30))
    assert [o.tolist() for o in outs] == [[2.0 * k + 1] * (k + 1) for k in range(3)], outs
    # Counted as the collective's kind: a reduce-scatter of 8 floats sends half of them.
    before = comm.traffic.copy()
    comm.reduce_scatter_flat(torch.empty(4), torch.ones(8), what="gradients")
    assert (comm.traffic - before).sent("reduce_scatter") == 16
    return out


@multirank
def test_a_gloo_pairs_exchanges_equal_gloos_collectives_bit_for_bit(ranks):
    a, b = ranks(2).run(_pair_against_gloo)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _pair_timeout():
    """Rank 1 sends nothing: rank 0's exchange times out as its collective, by name."""
    if dist.get_rank() == 1:
        return "absent"
    t = torch.ones(4)
    try:
        comm.run("all_reduce(the test's value)", lambda: comm.all_reduce(t, async_op=True, what="loss"),
                 timeout_s=2, where="test")
    except comm.CollectiveError as e:
        return str(e)
    return "completed"


def _rank_0_alone(ranks, fn) -> str:
    """What ``fn`` said on rank 0 while rank 1 stayed out; the pool is restarted after (what
    rank 0 started, a send or a group, is left half done: the world is spent)."""
    pool = ranks(2)
    try:
        said, absent = pool.run(fn)
    finally:
        pool.restart()
    assert absent == "absent"
    return said


@multirank
def test_a_pair_exchange_that_never_completes_times_out_by_name(ranks):
    said = _rank_0_alone(ranks, _pair_timeout)
    assert said.startswith("test: collective all_reduce(the test's value) did not complete on rank 0 within 2 s"), said


def _lonely_group():
    """Only rank 0 makes the group: it gives up after the timeout, naming the group."""
    if dist.get_rank() == 1:
        return "absent"
    try:
        comm.new_gloo_group("the test's group (on rank 0 only)", timeout_s=1, where="test")
    except comm.CollectiveError as e:
        return str(e)
    return "made"


@multirank
def test_a_gloo_group_a_rank_never_joins_is_named_after_the_timeout(ranks):
    said = _rank_0_alone(ranks, _lonely_group)
    assert said.startswith("test: creating the test's group (on rank 0 only) did not complete on rank 0 within 1 s ("), said


def test_tensors_of_a_finished_collective_are_held_until_the_backend_lets_go_at_exit():
    """A collective's tensors its caller drops at once are held; at exit ``_release_held``
    waits until nothing but the hold references them -- here a view stands for the backend's
    reference, dropped by another thread a moment later -- so that it is not gloo's worker
    thread that frees them during the interpreter's finalization (std::terminate); and the
    wait is bounded: a reference that never goes does not hold the exit."""
    import threading

    t = torch.zeros(4)
    other = {"ref": t.view(-1)}  # a second reference to t's TensorImpl, as a work's would be
    comm.hold_until_released(t)
    threading.Timer(0.2, other.clear).start()
    comm._release_held(timeout_s=30.0)
    assert not other and not comm._HELD  # it waited for the other reference to go
    stuck = torch.zeros(2)
    forever = stuck.view(-1)
    comm.hold_until_released(stuck)
    comm._release_held(timeout_s=0.05)  # returns: bounded
    assert stuck._use_count() == 2 and forever is not None and not comm._HELD
