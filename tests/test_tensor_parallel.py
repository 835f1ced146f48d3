"""fzero.tensor_parallel on real gloo ranks: Megatron's column/row split of Linear layers gives
the plain single-process trajectory, alone and under ZeRO over dp, with the reductions across
parameters (global-norm clipping, LAMB's trust ratios, mixed precision's overflow verdict)
exact; a plan that does not fit the model fails at init naming every parameter and size."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fzero
import fzero.testing as ft
from fzero import optim
from fzero.core import collecting_metrics


class Block(torch.nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, hidden)
        self.proj = torch.nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.ln(x))))


class Net(torch.nn.Module):
    def __init__(self, d_in: int = 5, d: int = 8, hidden: int = 16, depth: int = 2, d_out: int = 3):
        super().__init__()
        self.inp = torch.nn.Linear(d_in, d)
        self.blocks = torch.nn.ModuleList(Block(d, hidden) for _ in range(depth))
        self.head = torch.nn.Linear(d, d_out)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


PLAN = {"blocks.*.fc": fzero.ColwiseParallel(), "blocks.*.proj": fzero.RowwiseParallel()}


# Below every step's gradient norm (1.4 to 2.2 on these batches; _tp_equals_plain checks), so
# the clip acts at every step and its coefficient depends on the norm of the whole model.
CLIP = 0.5

TXS = {
    "sgd": lambda: optim.sgd(0.1, momentum=0.9),
    "adamw": lambda: optim.adamw(1e-2),
    "clipped": lambda: optim.chain(optim.clip_by_global_norm(CLIP), optim.adamw(1e-2)),
    "clipped sgd": lambda: optim.chain(optim.clip_by_global_norm(CLIP), optim.sgd(0.1, momentum=0.9)),
    "lamb": lambda: optim.lamb(1e-2, weight_decay=0.01),  # per-leaf norms of split and whole leaves
}


def _state(tx_name: str, frozen: tuple[str, ...] = ()):
    torch.manual_seed(3)
    net = Net()
    for name, p in net.named_parameters():
        p.requires_grad_(name not in frozen)
    apply, params = fzero.functionalize(net)
    return fzero.TrainState.create(apply_fn=apply, params=params, tx=TXS[tx_name]())


def _batches(n: int, rows: int):
    g = torch.Generator().manual_seed(11)
    return [{"x": torch.randn(rows, 5, generator=g), "y": torch.randn(rows, 3, generator=g)} for _ in range(n)]


def _wrap(step, precision, accumulate):
    """``step`` under the transforms tensor_parallel puts inside shard_state, in compile's order."""
    if accumulate:
        step = fzero.accumulate(step, accumulate)
    if precision:
        step = fzero.mixed_precision(step, precision)
    return fzero.transforms.as_step(step)


def _run(step, state, batches):
    """The last state, the losses and the ``grad_norm`` each step emitted."""
    losses, norms = [], []
    for b in batches:
        with collecting_metrics() as emitted:
            state, m = step(state, b)
        losses.append(m["loss"].float())
        if "grad_norm" in emitted:
            norms.append(emitted["grad_norm"].float())
    return state, torch.stack(losses), norms


def _tp_equals_plain(tp: int, stage: int, tx_name: str, steps: int, *, precision=None, accumulate=None,
                     fused="off", frozen: tuple[str, ...] = ()):
    """On every rank: the tp (x dp, ZeRO stage) trajectory equals the plain one, under
    ``mixed_precision(accumulate(...))`` when asked (the plain step under the same two), and
    so does the ``grad_norm`` a clip reports."""
    world = dist.get_world_size()
    mesh = fzero.Mesh(dp=world // tp, tp=tp)
    batches = _batches(steps, 4 * mesh.size("dp") * (accumulate or 1))
    with optim.use_fused(fused):
        ref_step = _wrap(ft.mse_step, precision, accumulate)
        ref, ref_losses, ref_norms = _run(ref_step, ref_step.init(_state(tx_name, frozen)), batches)
        inner = _wrap(ft.mse_step, precision, accumulate)
        if mesh.size("dp") > 1 or stage:
            inner = fzero.shard_state(inner, mesh, stage)
        step = fzero.tensor_parallel(inner, mesh, PLAN)
        state = step.init(_state(tx_name, frozen))
        # this rank holds its slice of the split layers, whole copies of the rest
        if stage < 3:
            assert tuple(state.params["blocks.0.fc.weight"].shape) == (16 // tp, 8)
        local = [ft.local_batch(b, mesh.size("dp"), mesh.coords["dp"]) for b in batches]
        state, losses, norms = _run(step, state, local)
    tol = precision or "fp32"  # low precision: the row of the compute dtype, as the plain step casts alike
    ft.assert_trees_close(losses, ref_losses, tol=tol, what="losses")
    ft.assert_trees_close(fzero.gather(state.params), dict(ref.params), tol=tol, what="parameters")
    if precision:
        ft.assert_trees_close(fzero.gather(state.master), dict(ref.master), tol=tol,
                              what="master weights")
    start = _state(tx_name, frozen).params
    for name in frozen:  # frozen, split or whole: bit-identical
        assert torch.equal(fzero.gather(state.params)[name], start[name]), name
    if "clipped" in tx_name:
        assert len(norms) == len(ref_norms) == steps
        assert all(float(n) > CLIP for n in ref_norms)  # the clip acted at every step
        ft.assert_trees_close(torch.stack(norms), torch.stack(ref_norms), tol=tol, what="grad_norm")
    return fzero.distributed.comm.traffic.bytes(what="tp")


@pytest.mark.multirank
def test_frozen_parameters_split_or_whole_stay_frozen_under_tp(ranks):
    """A frozen split layer and a frozen whole norm, with a clip (whose norm names the
    trainable leaves only): tp=2 gives the plain step, the frozen ones bit-identical."""
    ranks(2).run(_tp_equals_plain, 2, 0, "clipped", 3, frozen=("blocks.0.fc.weight", "blocks.1.ln.weight"))


@pytest.mark.multirank
@pytest.mark.parametrize("tx_name", ["sgd", "adamw"])
def test_tp2_equals_the_plain_step(ranks, tx_name):
    sent = ranks(2).run(_tp_equals_plain, 2, 0, tx_name, 3)
    assert all(n > 0 for n in sent)  # the activations and their gradients crossed the ranks


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_tp2_by_dp2_under_zero_equals_the_plain_step(ranks, stage):
    ranks(4).run(_tp_equals_plain, 2, stage, "adamw", 3)


@pytest.mark.multirank
@pytest.mark.parametrize("fused", ["off", "on"])
def test_tp2_clips_by_the_norm_of_the_whole_model(ranks, fused):
    """The split layers' slices are summed over tp, the whole layers counted once: the clip
    coefficient, and the grad_norm reported, are the plain step's (on the fused path too)."""
    ranks(2).run(_tp_equals_plain, 2, 0, "clipped", 3, fused=fused)


@pytest.mark.multirank
def test_tp2_lamb_trust_ratios_are_the_whole_tensors(ranks):
    ranks(2).run(_tp_equals_plain, 2, 0, "lamb", 3)


@pytest.mark.multirank
@pytest.mark.parametrize("precision, tx_name", [(None, "clipped"), ("bf16", "clipped sgd")])
def test_tp2_clips_under_accumulation_and_bf16_as_the_plain_step(ranks, precision, tx_name):
    """A clip of the accumulated gradient over 2 micro-batches, under mixed_precision's overflow
    check too. bf16 under SGD: Adam divides by sqrt(v), so one bf16 rounding of a near-zero
    gradient can flip an update."""
    ranks(2).run(_tp_equals_plain, 2, 0, tx_name, 3, precision=precision, accumulate=2)


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("tx_name", ["clipped", "lamb"])
def test_tp2_by_dp2_at_stage_2_clips_and_lamb_as_the_plain_step(ranks, tx_name):
    ranks(4).run(_tp_equals_plain, 2, 2, tx_name, 3)


def _leaf_norms_under_tp(flattened: bool):
    """``optim.leaf_norms`` of the parameters, from inside a tp=2 step (or the error it raises)."""
    mesh = fzero.Mesh(dp=1, tp=2)

    def norms_step(state, batch):
        params = list(state.params.values()) if flattened else state.params
        return state, {"loss": torch.zeros(()), "norms": optim.leaf_norms(params)[0]}

    step = fzero.tensor_parallel(norms_step, mesh, PLAN)
    try:
        return step(step.init(_state("sgd")), None)[1]["norms"]
    except ValueError as e:
        return str(e)


@pytest.mark.multirank
def test_leaf_norms_under_tp2_are_the_whole_tensors_norms(ranks):
    """LAMB's trust ratios are ratios of these: a split leaf's slices summed over tp, a whole
    leaf counted once (counted on both tp ranks, its norm would be sqrt(2) too large)."""
    params = _state("sgd").params
    expect = torch.stack([torch.linalg.vector_norm(params[k]) for k in sorted(params)])
    for got in ranks(2).run(_leaf_norms_under_tp, False):
        ft.assert_trees_close(got, expect, tol="norm", what="leaf norms")


@pytest.mark.multirank
def test_leaves_not_named_by_parameter_are_refused_under_tp(ranks):
    for msg in ranks(2).run(_leaf_norms_under_tp, True):
        assert "named leaves that are not parameters: None" in msg
        assert "pass the trees keyed by parameter, not their flattened leaves" in msg


def _one_tp_rank_overflows():
    """tp rank 1 alone sees an inf in its slice of a split layer's gradient."""
    mesh = fzero.Mesh(dp=1, tp=2)

    def poisoned(state, batch):
        loss, grads = fzero.value_and_grad(lambda p: F.mse_loss(state.apply_fn(p, batch["x"]), batch["y"]))(
            state.params)
        if mesh.coords["tp"] == 1:
            grads["blocks.0.fc.weight"][0, 0] = float("inf")
        return state.apply_gradients(grads), {"loss": loss}

    step = fzero.tensor_parallel(fzero.mixed_precision(poisoned, "bf16"), mesh, PLAN)
    state = step.init(_state("adamw"))
    with collecting_metrics() as emitted:
        new, _ = step(state, _batches(1, 4)[0])
    same = all(torch.equal(new.params[k], state.params[k]) for k in state.params)
    return bool(emitted["skipped"]), int(new.step), same


@pytest.mark.multirank
def test_a_non_finite_gradient_on_one_tp_rank_skips_the_update_on_every_rank(ranks):
    assert ranks(2).run(_one_tp_rank_overflows) == [(True, 0, True)] * 2


def _bytes_per_step(tp: int):
    """Bytes this rank sends to tp collectives in one step: Megatron's count is one all-reduce
    of the (rows x d) activation per row-parallel layer forward, and one of the same size per
    column-parallel layer's input gradient backward."""
    mesh = fzero.Mesh(dp=1, tp=tp)
    step = fzero.tensor_parallel(ft.mse_step, mesh, PLAN)
    state = step.init(_state("sgd"))
    batch = _batches(1, 4)[0]
    fzero.distributed.comm.traffic.reset()
    step(state, batch)
    return fzero.distributed.comm.traffic.bytes(what="tp")


@pytest.mark.multirank
def test_bytes_sent_are_megatrons_count(ranks):
    rows, d, depth = 4, 8, 2
    expect = depth * 2 * rows * d * 4  # per block: g forward + f backward, fp32 activations
    assert ranks(2).run(_bytes_per_step, 2) == [expect, expect]


class Attention(torch.nn.Module):
    """Self-attention with separate q, k and v projections (Llama's layout), reading the head
    count from the tensors' shapes, so it runs unchanged on a rank's heads."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.head_dim = d // heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        def heads(t):
            return t.view(*x.shape[:-1], -1, self.head_dim).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True)
        return self.o(y.transpose(1, 2).flatten(2))


class AttnBlock(torch.nn.Module):
    def __init__(self, d: int, heads: int, hidden: int):
        super().__init__()
        self.ln, self.attn, self.mlp = torch.nn.LayerNorm(d), Attention(d, heads), Block(d, hidden)

    def forward(self, x):
        return self.mlp(x + self.attn(self.ln(x)))  # Block: x + proj(gelu(fc(ln(x))))


def _attn_state():
    torch.manual_seed(7)
    apply, params = fzero.functionalize(torch.nn.Sequential(torch.nn.Linear(5, 8), AttnBlock(8, 4, 16),
                                                            AttnBlock(8, 4, 16), torch.nn.Linear(8, 3)))
    return fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1, momentum=0.9))


ATTN_PLAN = {"*.attn.q": fzero.ColwiseParallel(unit=2), "*.attn.k": fzero.ColwiseParallel(unit=2),
             "*.attn.v": fzero.ColwiseParallel(unit=2), "*.attn.o": fzero.RowwiseParallel(unit=2),
             "*.mlp.fc": fzero.ColwiseParallel(), "*.mlp.proj": fzero.RowwiseParallel()}


def _separate_qkv_bytes():
    """One step of two attention + MLP blocks at tp=2, against the plain step; this rank's
    bytes handed to tp collectives in it, and their sizes."""
    mesh = fzero.Mesh(dp=1, tp=2)
    g = torch.Generator().manual_seed(2)
    batches = [{"x": torch.randn(2, 3, 5, generator=g), "y": torch.randn(2, 3, 3, generator=g)} for _ in range(2)]
    ref, ref_losses = ft.run_steps(ft.mse_step, _attn_state(), batches)
    step = fzero.tensor_parallel(ft.mse_step, mesh, ATTN_PLAN)
    state = step.init(_attn_state())
    traffic = fzero.distributed.comm.traffic
    sent = []
    for b in batches:
        before = traffic.copy()
        state, _ = step(state, b)
        sent.append((traffic - before).bytes(what="tp"))
    ft.assert_trees_close(fzero.gather(state.params), dict(ref.params), tol="fp32", what="parameters")
    return sent


@pytest.mark.multirank
def test_separate_q_k_v_all_reduce_their_input_gradient_once(ranks):
    """Megatron's count for a block of self-attention and an MLP (Shoeybi et al. 2019, sec. 3):
    per step, two all-reduces of the (tokens x d) activation forward (g after the attention's
    output projection and after the MLP's contraction) and two backward (f: the input gradient
    of q, k and v summed, then of the MLP's expansion): 4 x tokens x d x 4 bytes per block in
    fp32. Separate q, k and v read one input, so their gradients add up before one all-reduce
    (one each would send 6 x tokens x d x 4 bytes per block, 1.5 times the formula)."""
    tokens, d, blocks = 2 * 3, 8, 2
    expect = blocks * 4 * tokens * d * 4
    assert ranks(2).run(_separate_qkv_bytes) == [[expect, expect]] * 2


def _peers_handed(case: str):
    """tp=2 where the two ranks are handed different batches: the error each rank raises."""
    mesh = fzero.Mesh(dp=1, tp=2)
    step = fzero.tensor_parallel(ft.mse_step, mesh, PLAN)
    state = step.init(_state("sgd"))
    b = _batches(1, 4)[0]
    if mesh.coords["tp"] == 1:
        if case == "values":
            b = {**b, "x": b["x"].flip(0)}  # the same rows, in another order
        elif case == "rows":
            b = {"x": b["x"][:3], "y": b["y"][:3]}
        else:  # a leaf more
            b = {**b, "mask": torch.ones(4, dtype=torch.bool)}
    try:
        step(state, b)
    except fzero.transforms.BatchMismatchError as e:
        # the pool's ranks go on: the next step, with the same batch, runs
        step(state, _batches(1, 4)[0])
        return str(e)
    return "no error"


@pytest.mark.multirank
@pytest.mark.parametrize("case, says", [
    ("values", ["batch['x'] is (4, 5) float32 on both, with different values on rank 0 and rank 1"]),
    ("rows", ["batch['x'] is (4, 5) float32 on rank 0 and (3, 5) float32 on rank 1",
              "batch['y'] is (4, 3) float32 on rank 0 and (3, 3) float32 on rank 1"]),
    ("leaves", ["batch['mask'] is absent on rank 0 and (4,) bool on rank 1"]),
])
def test_tp_peers_handed_different_batches_fail_naming_the_leaf_both_ranks_and_shapes(ranks, case, says):
    """Same shapes, other values (the replicated weights would drift apart silently), other
    sizes (gloo would abort on the all-reduce) or other leaves: every peer raises the same
    BatchMismatchError before any tp collective."""
    msgs = ranks(2).run(_peers_handed, case)
    assert msgs[0] == msgs[1]
    assert msgs[0].startswith("fzero.tensor_parallel: the ranks of a tp group must be handed the same batch")
    assert all(line in msgs[0] for line in says), msgs[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool,
                                   torch.complex64])
def test_the_batch_fingerprint_sees_one_changed_element_and_moved_blocks(dtype):
    """Peers compare one number per leaf; it changes when any one element does, or when
    elements move between positions further apart than a block (n / 4096 elements)."""
    from fzero.transforms.tensor_parallel._batch import _fingerprint

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 300, generator=g) * 50
    x = x > 0 if dtype == torch.bool else x.to(dtype)
    fp = int(_fingerprint(x))
    assert int(_fingerprint(x.clone())) == fp and int(_fingerprint(x.t().contiguous().t())) == fp
    for i in (0, 12345, x.numel() - 1):
        y = x.clone().view(-1)
        y[i] = (y[i] == 0).to(dtype) if dtype == torch.bool else y[i] + 1
        assert int(_fingerprint(y.view_as(x))) != fp, i
    assert int(_fingerprint(x.roll(1, 0))) != fp  # whole rows moved (swapped rows, as a shuffled batch)


def test_the_rewrite_is_in_place_only_inside_its_block_whatever_the_block_raises():
    """The split forwards, the shared-input scopes and the divided attributes are the step's:
    on exit (here by an error) the module holds exactly what it held before, an attribute it
    never held itself included (a class attribute stays the class's)."""
    from fzero.transforms.tensor_parallel._rewrite import Rewrite

    class Heads(torch.nn.Module):
        n_head = 4  # a class attribute

        def __init__(self):
            super().__init__()
            self.q, self.k, self.o = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
            self.width = 8  # an instance attribute

    model = torch.nn.Sequential(Heads())
    chosen = {"0.q": fzero.ColwiseParallel(), "0.k": fzero.ColwiseParallel(), "0.o": fzero.RowwiseParallel(),
              "0": fzero.DivideAttributes("n_head", "width")}
    rewrite = Rewrite(model, chosen, 2, None, 1.0)
    before = {name: dict(m.__dict__) for name, m in model.named_modules()}
    with pytest.raises(RuntimeError, match="the step failed"):
        with rewrite.applied():
            heads = model[0]
            assert (heads.n_head, heads.width) == (2, 4)
            assert all("forward" in m.__dict__ for m in (heads, heads.q, heads.k, heads.o))  # heads: the scope
            raise RuntimeError("the step failed")
    assert {name: dict(m.__dict__) for name, m in model.named_modules()} == before
    assert type(model[0]).n_head == model[0].n_head == 4 and "n_head" not in model[0].__dict__


def test_a_plan_that_does_not_fit_names_every_problem():
    state = _state("sgd")
    plan = {"blocks.*.fc": fzero.ColwiseParallel(), "blocks.*.ln": fzero.RowwiseParallel(),
            "decoder.*": fzero.ColwiseParallel()}
    step = fzero.tensor_parallel(ft.mse_step, fzero.Mesh(dp=-1), plan)
    with pytest.raises(ValueError) as e:
        step.init(state)
    msg = str(e.value)
    assert "glob 'decoder.*' matches no module" in msg
    assert "module 'blocks.0.ln' is a LayerNorm" in msg and "module 'blocks.1.ln' is a LayerNorm" in msg


def _init_error(step, state) -> str:
    """The message of the ValueError ``step.init(state)`` raises (on a rank: returned to the test)."""
    try:
        step.init(state)
    except ValueError as e:
        return str(e)
    return "no error"


def _indivisible():
    mesh = fzero.Mesh(dp=1, tp=2)
    torch.manual_seed(0)
    apply, params = fzero.functionalize(Net(hidden=15))
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
    return _init_error(fzero.tensor_parallel(ft.mse_step, mesh, PLAN), state)


@pytest.mark.multirank
def test_a_dim_that_does_not_divide_by_tp_is_named_with_its_size(ranks):
    msg = ranks(2).run(_indivisible)[0]
    assert "parameter 'blocks.0.fc.weight' of shape (15, 8): dim 0 (15) does not divide by tp=2" in msg
    assert "parameter 'blocks.1.proj.weight' of shape (8, 15): dim 1 (15) does not divide by tp=2" in msg


def test_plans_are_checked_when_the_transform_is_built():
    with pytest.raises(TypeError, match="plan entries must be 'glob': ColwiseParallel"):
        fzero.tensor_parallel(ft.mse_step, fzero.Mesh(dp=-1), {"fc": "colwise"})


def _compiled_equals_plain(stage: int):
    world = dist.get_world_size()
    mesh = fzero.Mesh(dp=world // 2, tp=2)
    batches = _batches(3, 4 * mesh.size("dp"))
    ref, ref_losses = ft.run_steps(ft.mse_step, _state("adamw"), batches)
    step = fzero.compile(ft.mse_step, mesh, zero=stage, tp=PLAN, comm_bytes=True)
    state = step.init(_state("adamw"))
    losses, sent = [], []
    for b in batches:
        state, m = step(state, ft.local_batch(b, mesh.size("dp"), mesh.coords["dp"]))
        losses.append(m["loss"])
        assert sum(m["comm_bytes_by_axis"].values()) == m["comm_bytes"]["total"]
        sent.append(m["comm_bytes_by_axis"])
    ft.assert_trees_close(torch.stack(losses), ref_losses, tol="fp32", what="losses")
    ft.assert_trees_close(fzero.gather(state.params), dict(ref.params), tol="fp32", what="parameters")
    try:
        fzero.compile(ft.mse_step, mesh)
    except ValueError as e:
        return str(e), sent
    return "no error", sent


@pytest.mark.multirank
def test_compile_builds_the_tp_step_from_a_plan(ranks):
    """And its comm_bytes metrics tell tp traffic from dp traffic. Over tp, per step and rank,
    sent on the wire (an all-reduce of S bytes over 2 ranks sends S, an all-gather S): the
    activations, Megatron's 2 x rows x d x 4 B per block; the batch check's four int64s; and
    the non-finite verdict's fp32 flag (compile's nonfinite='skip'), summed over tp."""
    msg, sent = ranks(2).run(_compiled_equals_plain, 0)[0]
    assert "has a tp axis of 2: pass tp={...}" in msg
    rows, d, depth = 4, 8, 2
    assert sent == [{"pp": 0, "dp": 0, "sp": 0, "tp": depth * 2 * rows * d * 4 + 4 * 8 + 4, "other": 0}] * 3


def _llama(tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(4)
    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=32, max_position_embeddings=16, tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(4)
    cfg = GPT2Config(n_embd=16, n_layer=2, n_head=4, vocab_size=32, n_positions=16, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def _lm_loss(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _hf_equals_torch(make: str, plan: str, hf_loss: bool = False):
    """A Hugging Face model at tp=2 under ``compile(tp=...)`` against the module's own
    forward, backward and torch.optim.SGD with momentum on one process. (SGD, not Adam:
    the split sums partial products in another order, and Adam's normalisation turns that
    last-bit difference of a near-zero gradient into a difference of a whole step.)"""
    from fzero.transforms import tp_plans

    make = {"llama": _llama, "gpt2": _gpt2}[make]
    plans = {"llama vocab": lambda m: tp_plans.llama(m, vocab=True)}

    def loss_of(model_fn, b):  # the test's loss, or the model's own (labels= shifts them inside)
        if hf_loss:
            return model_fn(b, labels=b).loss
        return _lm_loss(model_fn(b[:, :-1]).logits, b[:, 1:])

    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 32, (2, 9), generator=g) for _ in range(3)]
    ref = make()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_losses = []
    for b in batches:
        opt.zero_grad()
        loss = loss_of(ref, b)
        loss.backward()
        opt.step()
        ref_losses.append(loss.detach())

    model = make()
    apply, params = fzero.functionalize(model)
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1, momentum=0.9))

    def train_step(state, batch):
        loss, grads = fzero.value_and_grad(
            lambda p: loss_of(lambda *a, **k: state.apply_fn(p, *a, **k), batch))(state.params)
        return state.apply_gradients(grads), {"loss": loss}

    step = fzero.compile(train_step, fzero.Mesh(dp=1, tp=2),
                         tp="auto" if plan == "auto" else plans.get(plan, getattr(tp_plans, plan, None))(model))
    state = step.init(state)
    shapes = {k: tuple(v.shape) for k, v in state.params.items()}
    losses, traffic = [], fzero.distributed.comm.traffic
    for b in batches:
        before = traffic.copy()
        state, m = step(state, b)
        losses.append(m["loss"])
        shapes.setdefault("tp bytes", set()).add((traffic - before).bytes(what="tp"))
    ft.assert_trees_close(torch.stack(losses), torch.stack(ref_losses), tol="fp32", what="losses")
    ft.assert_trees_close(fzero.gather(state.params), dict(ref.named_parameters()), tol="fp32",
                          what="parameters")
    if plan == "gpt2":  # the fused q/k/v split block by block: saved, exported whole, loaded back
        import os
        import tempfile

        path = os.path.join(tempfile.gettempdir(), f"fzero-tp-gpt2-{os.getppid()}")
        fzero.checkpoint.save(path, state, overwrite=True)
        whole = fzero.gather(state.params)
        if dist.get_rank() == 0:
            from safetensors.torch import load_file

            fzero.checkpoint.export(path, path + ".safetensors")
            exported = load_file(path + ".safetensors")
            ft.assert_trees_close({k: exported[k] for k in whole}, whole, tol="exact", what="exported")
        again = fzero.checkpoint.load(path, like=state)  # the same tp=2 layout
        ft.assert_trees_close(dict(again.params), dict(state.params), tol="exact", what="reloaded at tp=2")
        plain = _gpt2()  # and into one process's unsplit state
        papply, pparams = fzero.functionalize(plain)
        one = fzero.checkpoint.load(path, like=fzero.TrainState.create(apply_fn=papply, params=pparams,
                                                                         tx=optim.sgd(0.1, momentum=0.9)))
        ft.assert_trees_close(dict(one.params), whole, tol="exact", what="loaded unsplit")
        shapes["ckpt"] = "ok"
    return shapes


@pytest.mark.multirank
def test_hugging_face_llama_under_the_automatic_plan_equals_torch(ranks):
    shapes = ranks(2).run(_hf_equals_torch, "llama", "auto")[0]
    # AutoTP splits the MLPs (gate and up by columns, down by rows) and the attention by
    # heads: 4 query heads of 4, two per rank; 2 key/value heads, one per rank (the head
    # counts from the attention's config); Megatron's bytes, as the shipped plan
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (16, 16)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (16, 16)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (8, 16)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (4, 16)
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (16, 8)
    assert shapes["tp bytes"] == {2 * 4 * (2 * 8) * 16 * 4}


@pytest.mark.multirank
def test_hugging_face_gpt2_under_the_automatic_plan_comes_back_whole(ranks):
    """AutoTP on GPT-2: the fused c_attn by heads block by block, c_proj by rows, the
    attention's split_size, num_heads and embed_dim divided while the step runs, the MLP
    by columns then rows; trained, gathered and loaded back as with its shipped plan."""
    from transformers.pytorch_utils import Conv1D

    from fzero.transforms.tensor_parallel import auto_plan

    model = _gpt2()
    plan = auto_plan(model)
    assert plan["transformer.h.0.attn.c_attn"] == fzero.ColwiseParallel(parts=3, unit=4)
    assert plan["transformer.h.0.attn.c_proj"] == fzero.RowwiseParallel(unit=4)
    assert plan["transformer.h.0.attn"].names == ("split_size", "num_heads", "embed_dim")
    assert isinstance(model.transformer.h[0].mlp.c_fc, Conv1D)
    assert ranks(2).run(_gpt2_comes_back, "auto") == [True, True]


@pytest.mark.multirank
@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_hugging_face_blocks_under_their_shipped_plans_equal_torch(ranks, model):
    """And each step sends Megatron's bytes over tp: per layer, the attention's and the MLP's
    g forward and f backward, 4 x tokens x d x 4 bytes (tokens = 2 x 8, d = 16, 2 layers).
    Llama's q, k and v (and its gate and up) read one input each: one f per input."""
    shapes = ranks(2).run(_hf_equals_torch, model, model)[0]
    assert shapes["tp bytes"] == {2 * 4 * (2 * 8) * 16 * 4}
    if model == "llama":  # 4 heads of 4: two per rank; 2 key/value heads: one per rank
        assert shapes["model.layers.0.self_attn.q_proj.weight"] == (8, 16)
        assert shapes["model.layers.0.self_attn.k_proj.weight"] == (4, 16)
        assert shapes["model.layers.0.self_attn.o_proj.weight"] == (16, 8)
    else:  # Conv1D weights are (in, out): q, k and v each give this rank two heads of 4
        assert shapes["transformer.h.0.attn.c_attn.weight"] == (16, 24)
        assert shapes["transformer.h.0.attn.c_proj.weight"] == (8, 16)
        assert shapes["transformer.h.0.mlp.c_fc.weight"] == (16, 32)
        assert shapes["ckpt"] == "ok"


def _heads_cut():
    from transformers import LlamaConfig, LlamaForCausalLM

    from fzero.transforms import tp_plans

    torch.manual_seed(0)  # 2 key/value heads of 8 at tp=4 would cut a head: 16 / 4 = 4 < 8
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=32))
    apply, params = fzero.functionalize(model)
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
    return _init_error(fzero.tensor_parallel(ft.mse_step, fzero.Mesh(dp=1, tp=4), tp_plans.llama(model)), state)


@pytest.mark.multirank
def test_heads_that_do_not_divide_by_tp_are_named(ranks):
    msg = ranks(4).run(_heads_cut)[0]
    assert ("parameter 'model.layers.0.self_attn.k_proj.weight' of shape (16, 32): dim 0 (16) as 1 block(s) "
            "of units of 8 (heads) does not split over tp=4 without cutting one") in msg



# --------------------------------------------------------------------------- vocab parallelism


class TinyLM(torch.nn.Module):
    """An embedding, blocks and an untied LM head with a bias: a language model's layout. The
    last id pads (no gradient on its row), and tp rank 1 holds it."""

    def __init__(self, vocab: int = 32, d: int = 8, hidden: int = 16, depth: int = 2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d, padding_idx=vocab - 1)
        self.blocks = torch.nn.ModuleList(Block(d, hidden) for _ in range(depth))
        self.ln = torch.nn.LayerNorm(d)
        self.lm_head = torch.nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln(x))


def lm_step(state, batch):
    """The user's step, written for one process: the plain cross-entropy of the flattened logits."""
    def loss_fn(p):
        logits = state.apply_fn(p, batch["x"])
        return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())

    loss, grads = fzero.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads), {"loss": loss}


LM_PLAN = {"embed": fzero.RowwiseParallel(), "lm_head": fzero.ColwiseParallel(output="vocab"), **PLAN}
ROWS, SEQ, VOCAB, D, DEPTH = 4, 6, 32, 8, 2


def _lm_state(tx_name: str):
    torch.manual_seed(3)
    apply, params = fzero.functionalize(TinyLM(VOCAB, D, 16, DEPTH))
    return fzero.TrainState.create(apply_fn=apply, params=params, tx=TXS[tx_name]())


def _lm_batches(n: int):
    g = torch.Generator().manual_seed(12)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
        out.append({"x": ids[:, :-1], "y": ids[:, 1:]})
    return out


def _lm_tp_equals_plain(tx_name: str, path: str):
    """The vocab-split trajectory against the plain one, and every tp collective's size; the
    last state saved to ``path``."""
    mesh = fzero.Mesh(dp=1, tp=2)
    batches = _lm_batches(3)
    ref, ref_losses = ft.run_steps(lm_step, _lm_state(tx_name), batches)
    step = fzero.tensor_parallel(lm_step, mesh, LM_PLAN)
    state = step.init(_lm_state(tx_name))
    shapes = {k: tuple(state.params[k].shape) for k in ("embed.weight", "lm_head.weight", "lm_head.bias")}
    traffic = fzero.distributed.comm.traffic
    sizes, add = [], traffic.add
    traffic.add = lambda kind, what, t, **kw: (sizes.append((kind, what, t.numel() * t.element_size())),
                                               add(kind, what, t, **kw))[1]
    try:
        state, losses, _ = _run(step, state, batches)
    finally:
        del traffic.add  # the class's method again
    ft.assert_trees_close(losses, ref_losses, tol="fp32", what="losses")
    ft.assert_trees_close(fzero.gather(state.params), dict(ref.params), tol="fp32", what="parameters")
    fzero.checkpoint.save(path, state)
    return shapes, [s for s in sizes if s[1] == "tp"]


@pytest.mark.multirank
@pytest.mark.parametrize("tx_name", ["sgd", "adamw"])
def test_a_vocab_split_embedding_and_lm_head_equal_the_plain_step(ranks, tx_name, tmp_path):
    """The user's F.cross_entropy(logits.flatten(0, 1), y.flatten()) runs unchanged on the
    logits split by vocabulary, and the logits are never gathered: the largest tp collective
    is an activation (tokens x d), the loss's three are tokens long. The checkpoint of the
    split state loads whole into a plain one (the embedding is split on dim 0 as any row)."""
    path = str(tmp_path / "vocab")
    results = ranks(2).run(_lm_tp_equals_plain, tx_name, path)
    ref, _ = ft.run_steps(lm_step, _lm_state(tx_name), _lm_batches(3))
    whole = fzero.checkpoint.load(path, like=_lm_state(tx_name))
    assert tuple(whole.params["embed.weight"].shape) == (VOCAB, D)
    ft.assert_trees_close(dict(whole.params), dict(ref.params), tol="fp32", what="parameters loaded at tp=1")
    for shapes, sizes in results:
        assert shapes == {"embed.weight": (16, D), "lm_head.weight": (16, D), "lm_head.bias": (16,)}
        assert {kind for kind, _, _ in sizes} == {"all_reduce"}  # no all-gather of anything
        tokens, logits_bytes = ROWS * SEQ, ROWS * SEQ * VOCAB * 4
        assert max(n for _, _, n in sizes) == tokens * D * 4 < logits_bytes
        # per step: the embedding's g, each block's g and f, the head's f; the loss's max, then
        # the sum of exp and the target's logit in one
        per_step = tokens * D * 4 * (1 + 2 * DEPTH + 1) + tokens * 4 * 3
        assert sum(n for _, _, n in sizes) == 3 * per_step


@pytest.mark.multirank
@pytest.mark.parametrize("hf_loss", [False, True])
def test_hugging_face_llama_split_by_vocabulary_equals_torch(ranks, hf_loss):
    """tp_plans.llama(model, vocab=True) with the test's loss, or the model's own (labels=)."""
    shapes = ranks(2).run(_hf_equals_torch, "llama", "llama vocab", hf_loss)[0]
    assert shapes["model.embed_tokens.weight"] == (16, 16)
    assert shapes["lm_head.weight"] == (16, 16)


def _tied_vocab_split():
    from fzero.transforms import tp_plans

    model = _llama(tie=True)
    apply, params = fzero.functionalize(model)
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
    try:
        fzero.tensor_parallel(ft.mse_step, fzero.Mesh(dp=1, tp=2), tp_plans.llama(model, vocab=True)).init(state)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.multirank
def test_a_tied_embedding_and_lm_head_split_is_refused_at_init(ranks):
    msg = ranks(2).run(_tied_vocab_split)[0]
    assert "parameter 'model.embed_tokens.weight' is tied to ['lm_head.weight']: a split parameter cannot be " \
           "shared (untie them -- Hugging Face: tie_word_embeddings=False -- or leave them whole)" in msg


def _logits():
    return fzero.transforms.VocabShardedLogits(torch.randn(2, 3, 16), vocab=32, tp=2, rank=1, group=None)


@pytest.mark.parametrize("op, name", [
    (lambda x: x.argmax(-1), "argmax"),
    (lambda x: torch.softmax(x, -1), "softmax"),
    (lambda x: F.log_softmax(x, -1), "log_softmax"),
    (lambda x: x @ torch.randn(32, 2), "__matmul__"),
    (lambda x: x.tolist(), "tolist"),
    (lambda x: x[..., 0], "indexing with (Ellipsis, 0)"),
    (lambda x: x.reshape(-1), "reshape(-1,)"),
    (lambda x: F.cross_entropy(x, torch.zeros(2, 3, dtype=torch.long)), "F.cross_entropy of logits (2, 3, 32)"),
])
def test_an_op_that_needs_the_whole_vocabulary_is_refused_by_name(op, name):
    with pytest.raises(TypeError) as e:
        op(_logits())
    msg = str(e.value)
    assert name in msg and "split over tp by vocabulary (this rank holds [16, 32))" in msg


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_of_vocab_split_logits_is_torchs_at_tp1(reduction):
    """Values and gradients against F.cross_entropy, ignored targets included (tp=2: the
    trajectories above)."""
    x = torch.randn(2, 5, 32, requires_grad=True)
    y = torch.randint(0, 32, (2, 4))
    y[0, 1] = y[1, 3] = -100
    split = fzero.transforms.VocabShardedLogits(x, vocab=32, tp=1, rank=0, group=None)
    got = F.cross_entropy(split[..., :-1, :].flatten(0, 1), y.flatten(), reduction=reduction)
    want = F.cross_entropy(x[..., :-1, :].flatten(0, 1), y.flatten(), reduction=reduction)
    g_got, = torch.autograd.grad(got.sum(), x)
    g_want, = torch.autograd.grad(want.sum(), x)
    ft.assert_trees_close(got, want, tol="fp32", what="loss")
    ft.assert_trees_close(g_got, g_want, tol="fp32 small values", what="gradient")


def test_vocab_split_logits_slice_and_reshape_over_the_token_dims():
    x = _logits()
    assert x[..., :-1, :].shape == (2, 2, 32) and x[..., :-1, :].local.shape == (2, 2, 16)
    assert x.float().contiguous().view(-1, 32).shape == (6, 32)
    assert torch.flatten(x, 0, 1).shape == (6, 32) and x[0].shape == (3, 32) and x.size(-1) == 32
    assert "VocabShardedLogits(shape=(2, 3, 32)" in repr(x)  # no values: this rank has half of them


def _pp_model():
    torch.manual_seed(6)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.GELU(), torch.nn.Linear(16, 8),
                               torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))


def _pp_plain(dp: int):
    """The plain one-process state of ``_pp_model`` after the batches the pp tests train on."""
    apply, params = fzero.functionalize(_pp_model())
    return ft.run_steps(ft.mse_step, fzero.TrainState.create(apply_fn=apply, params=params,
                                                             tx=optim.sgd(0.1, momentum=0.9)), _batches(3, 8 * dp))


def _tp_by_pp_equals_plain(dp: int, stage: int, compiled: bool = False, save_to: str | None = None):
    """pp=2 x dp x tp=2: each stage's Linear pair split over tp, the stages pipelined, ZeRO
    over dp."""
    mesh = fzero.Mesh(pp=2, dp=dp, tp=2)
    make = _pp_model
    batches = _batches(3, 8 * dp)
    ref, ref_losses = _pp_plain(dp)
    model = make()
    apply, params = fzero.functionalize(model)
    pipe = fzero.pipeline(fzero.pipeline.split(model, [3]), F.mse_loss, mesh, micro_batches=2)

    def train_step(state, batch):
        loss, grads = pipe(state.params, batch["x"], batch["y"])
        return state.apply_gradients(grads), {"loss": loss}

    plan = {"0": fzero.ColwiseParallel(), "2": fzero.RowwiseParallel(), "3": fzero.ColwiseParallel(),
            "5": fzero.RowwiseParallel()}
    if compiled:  # one call: pipeline outermost, then tensor parallelism, then ZeRO
        with pytest.raises(ValueError, match="has a pp axis of 2: pass pipeline=fzero.pipeline"):
            fzero.compile(train_step, mesh, zero=stage, tp=plan)
        # the DeepSpeed config's way: its pipeline and ZeRO sections, checked against the mesh
        config = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.0,
                  "pipeline": {"stages": 2}, "zero_optimization": {"stage": stage}}
        step = fzero.compile(train_step, mesh, config=config, tp=plan, pipeline=pipe)
        assert step.options.zero == stage
        tp_step = step.inner.inner
        assert tp_step.__name__.startswith("tensor_parallel(")
    else:
        inner = fzero.shard_state(train_step, mesh, stage) if dp > 1 else train_step
        tp_step = fzero.tensor_parallel(inner, mesh, plan)
        step = pipe.transform(tp_step)
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1, momentum=0.9)))
    assert sorted(state.params) == sorted(pipe.keys)  # this stage's parameters only, split over tp
    losses = []
    for b in batches:
        state, m = step(state, ft.local_batch(b, dp, mesh.coords["dp"]))
        losses.append(m["loss"])
    ft.assert_trees_close(torch.stack(losses), ref_losses, tol="fp32", what="losses")
    # every stage's whole parameters on every rank, from the state alone; then back in the module
    ft.assert_trees_close(dict(fzero.gather(state).params), dict(ref.params), tol="fp32", what="parameters")
    fzero.load_into(model, state)
    plain, _ = _torch_trained(_pp_model, batches, lambda m, b: F.mse_loss(m(b["x"]), b["y"]))
    with torch.no_grad():
        ft.assert_trees_close(model(batches[0]["x"]), plain(batches[0]["x"]), tol="fp32", what="reloaded outputs")
    if save_to is not None:
        fzero.checkpoint.save(save_to, state)
    return True


@pytest.mark.slow
@pytest.mark.multirank
def test_tp2_by_pp2_equals_the_plain_step_and_checkpoints_onto_one_process(ranks, tmp_path):
    path = str(tmp_path / "pp2-tp2")
    assert ranks(4).run(_tp_by_pp_equals_plain, 1, 0, False, path) == [True] * 4
    # every stage's tp slices, put back together in one process: the plain run's state
    ref, _ = _pp_plain(1)
    apply, params = fzero.functionalize(_pp_model())
    like = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1, momentum=0.9))
    loaded = fzero.checkpoint.load(path, like=like)
    ft.assert_trees_close(dict(loaded.params), dict(ref.params), tol="fp32", what="parameters")
    ft.assert_trees_close(loaded.opt_state, ref.opt_state, tol="fp32", what="momentum")
    assert int(loaded.step) == int(ref.step) == 3


@pytest.mark.slow
@pytest.mark.multirank
def test_dp2_by_pp2_by_tp2_under_zero_2_equals_the_plain_step(ranks):
    assert ranks(8).run(_tp_by_pp_equals_plain, 2, 2) == [True] * 8


@pytest.mark.slow
@pytest.mark.multirank
def test_compile_builds_dp2_by_pp2_by_tp2_in_one_call(ranks):
    assert ranks(8).run(_tp_by_pp_equals_plain, 2, 3, True) == [True] * 8


# --------------------------------------------------------------------------- the trained model back


def _torch_trained(make, batches, loss_of, lr: float = 0.1, momentum: float = 0.9):
    """The reference: ``make()`` trained by plain PyTorch (``loss.backward()``,
    ``torch.optim.SGD``) on each whole batch, in this process; the module and its optimizer."""
    ref = make()
    opt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=momentum)
    for b in batches:
        opt.zero_grad()
        loss_of(ref, b).backward()
        opt.step()
    return ref, opt


def _own(module) -> list[str]:
    """The submodules that hold a forward of their own (none, in a module fzero handed back)."""
    return [name for name, m in module.named_modules() if "forward" in m.__dict__]


def _gpt2_loss(model, ids):
    return _lm_loss(model(ids[:, :-1]).logits, ids[:, 1:])


def _gpt2_comes_back(plan: str):
    """GPT-2 trained at tp=2 (its fused q/k/v split block by block, the attention's
    split_size and num_heads divided while the step runs): outside the step the module is its
    own, fzero.gather gives every tensor whole, and fzero.load_into makes the module compute
    what the plain-torch trained module computes."""
    from fzero.transforms import tp_plans

    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 32, (2, 9), generator=g) for _ in range(3)]
    ref, ref_opt = _torch_trained(_gpt2, batches, _gpt2_loss)
    model = _gpt2()
    attn = model.transformer.h[0].attn
    sizes = (attn.split_size, attn.num_heads)
    apply, params = fzero.functionalize(model)
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1, momentum=0.9))

    def train_step(state, ids):
        loss, grads = fzero.value_and_grad(lambda p: _lm_loss(state.apply_fn(p, ids[:, :-1]).logits,
                                                               ids[:, 1:]))(state.params)
        return state.apply_gradients(grads), {"loss": loss}

    step = fzero.compile(train_step, fzero.Mesh(dp=1, tp=2),
                         tp="auto" if plan == "auto" else tp_plans.gpt2(model))
    state = step.init(state)
    seen = {"after init": (_own(model), (attn.split_size, attn.num_heads))}
    for b in batches:
        state, _ = step(state, b)
    seen["after the steps"] = (_own(model), (attn.split_size, attn.num_heads))
    assert all(v == ([], sizes) for v in seen.values()), seen
    assert tuple(state.params["transformer.h.0.attn.c_attn.weight"].shape) == (16, 24)  # this rank's slice
    whole = fzero.gather(state)  # every tensor of the state, the momentum too
    want = dict(ref.named_parameters())
    ft.assert_trees_close(dict(whole.params), want, tol="fp32", what="gathered parameters")
    momentum = whole.opt_state[1].trace  # optim.sgd's state: (scale, trace, scale)
    ft.assert_trees_close(dict(momentum), {k: ref_opt.state[p]["momentum_buffer"] for k, p in want.items()},
                          tol="fp32", what="gathered momentum")
    assert "tensor_parallel" not in whole.extra  # whole: the record of the split is gone
    ft.assert_trees_close(fzero.gather(state.params), want, tol="fp32", what="gathered params dict")
    fzero.load_into(model, state)
    ft.assert_trees_close(dict(model.named_parameters()), want, tol="fp32", what="loaded parameters")
    x = batches[0][:, :-1]
    with torch.no_grad():
        ft.assert_trees_close(model(x).logits, ref(x).logits, tol="fp32", what="the reloaded module's logits")
    return True


@pytest.mark.multirank
def test_a_tp2_trained_gpt2_comes_back_whole_into_its_own_module(ranks):
    assert ranks(2).run(_gpt2_comes_back, "gpt2") == [True, True]


def _net():
    torch.manual_seed(3)
    return Net()


def _net_comes_back(stage: int):
    """tp=2 x dp=2 at a ZeRO stage, through compile: fzero.gather of the params dict and
    fzero.load_into put the whole trained weights (pieces over dp, slices over tp) into the
    module on every rank, which then computes what plain PyTorch's trained module computes."""
    mesh = fzero.Mesh(dp=2, tp=2)
    batches = _batches(3, 8)
    ref, _ = _torch_trained(_net, batches, lambda m, b: F.mse_loss(m(b["x"]), b["y"]))
    model = _net()
    apply, params = fzero.functionalize(model)
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1, momentum=0.9))
    step = fzero.compile(ft.mse_step, mesh, zero=stage, tp=PLAN, comm_bytes=True)
    state = step.init(state)
    for b in batches:
        state, m = step(state, ft.local_batch(b, 2, mesh.coords["dp"]))
        # tp apart from dp: Megatron's activations (4 rows per tp group, 2 blocks), the batch
        # check and the non-finite flag over tp; ZeRO's traffic over dp; nothing else
        by_axis = m["comm_bytes_by_axis"]
        assert by_axis["tp"] == 2 * 2 * 4 * 8 * 4 + 4 * 8 + 4 and by_axis["dp"] > 0 and by_axis["other"] == 0, by_axis
    ft.assert_trees_close(fzero.gather(state.params), dict(ref.named_parameters()), tol="fp32", what="gathered")
    fzero.load_into(model, state)
    assert _own(model) == []
    x = batches[0]["x"]
    with torch.no_grad():
        ft.assert_trees_close(model(x), ref(x), tol="fp32", what="the reloaded module's outputs")
    return True


@pytest.mark.slow
@pytest.mark.multirank
def test_a_tp2_by_dp2_zero3_trained_net_comes_back_into_its_module(ranks):
    assert ranks(4).run(_net_comes_back, 3) == [True] * 4


# --------------------------------------------------------------------------- properties

from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fzero.transforms.tensor_parallel._styles import _local, _whole  # noqa: E402


@settings(max_examples=8, deadline=None)
@given(shape=st.lists(st.integers(1, 4), min_size=1, max_size=3), data=st.data())
def test_a_split_and_its_inverse_round_trip(shape, data):
    """Every rank's slice, put back in rank order, is the whole tensor, for any dim, number
    of blocks (a fused projection) and tp; each slice holds 1/tp of each block."""
    dim = data.draw(st.integers(0, len(shape) - 1))
    parts, tp = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    shape[dim] *= parts * tp
    whole = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    pieces = [_local(whole, dim, tp, r, parts) for r in range(tp)]
    assert all(p.shape[dim] == shape[dim] // tp for p in pieces)
    assert torch.equal(_whole(pieces, dim, parts), whole)
    block = shape[dim] // parts  # rank r's share of block b is that block's r-th chunk
    for r, p in enumerate(pieces):
        for b, got in enumerate(p.chunk(parts, dim)):
            want = whole.narrow(dim, b * block, block).chunk(tp, dim)[r]
            assert torch.equal(got, want)


def _random_mlp(d: int, hidden: int, depth: int, d_out: int, rows: int, seed: int):
    """The drawn model's maker (seeded) and its two batches."""
    def make():
        torch.manual_seed(seed)
        return Net(d_in=3, d=d, hidden=hidden, depth=depth, d_out=d_out)

    g = torch.Generator().manual_seed(seed)
    return make, [{"x": torch.randn(rows, 3, generator=g), "y": torch.randn(rows, d_out, generator=g)}
                  for _ in range(2)]


def _layer_norm_conditioning(make, batches) -> float:
    """How much the drawn example's LayerNorms magnify an error in their input, over plain
    PyTorch's two steps: the largest |x| / sqrt(var(x) + eps) of a row of features entering
    one (``rms(x)`` over its standard deviation: an error of e |x| in x is one of about
    e |x| / sqrt(var + eps) in its output and in the gradient through it). Over one feature
    x - mean(x) is exactly 0, so nothing is magnified."""
    model, worst = make(), [1.0]

    def hook(m, args, out):
        x = args[0].detach().double()
        if x.shape[-1] > 1:
            ratio = x.pow(2).mean(-1).sqrt() / (x.var(-1, unbiased=False) + m.eps).sqrt()
            worst[0] = max(worst[0], float(ratio.max()))

    for m in model.modules():
        if isinstance(m, torch.nn.LayerNorm):
            m.register_forward_hook(hook)
    _torch_trained(lambda: model, batches, lambda m, b: F.mse_loss(m(b["x"]), b["y"]))
    return worst[0]


def _random_mlp_equals_plain(d: int, hidden: int, depth: int, d_out: int, rows: int, seed: int):
    make, batches = _random_mlp(d, hidden, depth, d_out, rows, seed)
    apply, params = fzero.functionalize(make())
    ref, ref_losses = ft.run_steps(ft.mse_step, fzero.TrainState.create(apply_fn=apply, params=params,
                                                                         tx=optim.sgd(0.1, momentum=0.9)), batches)
    apply, params = fzero.functionalize(make())
    step = fzero.tensor_parallel(ft.mse_step, fzero.Mesh(dp=1, tp=2), "auto" if depth else PLAN)
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1, momentum=0.9))) \
        if depth else None
    if state is None:  # no block: the plan's globs match nothing, and init says so
        state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1, momentum=0.9))
        return _init_error(step, state)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(m["loss"])
    ft.assert_trees_close(torch.stack(losses), ref_losses, tol="fp32", what="losses")
    ft.assert_trees_close(fzero.gather(state.params), dict(ref.params), tol="fp32", what="parameters")
    return "ok"


@pytest.mark.multirank
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(d=st.integers(1, 6), h=st.integers(1, 3), depth=st.integers(0, 3),
       d_out=st.integers(1, 4), rows=st.integers(1, 5), seed=st.integers(0, 1000))
def test_any_mlp_under_the_automatic_plan_equals_the_plain_step(ranks, d, h, depth, d_out, rows, seed):
    """Any widths (the hidden width even, so tp=2 divides it, and wider than d, so the pair
    is an expansion AutoTP splits), any depth, any batch: tp=2 gives the plain step.

    Drawn out: examples whose LayerNorms see rows of nearly equal features (d = 2 or 3 makes
    them likely). The tp step sums the row-parallel partial products in another order than
    the plain one (a few ulps, ~1e-7 relative), and such a LayerNorm magnifies that by its
    conditioning, |x| / sqrt(var(x) + eps): the two trajectories then differ by more than
    the fp32 row's 1e-5 (the flaky failure: a LayerNorm bias 1.5e-4 apart after 2 steps of
    SGD) as much as either differs from exact arithmetic, which tests LayerNorm, not tensor
    parallelism. Measured on this strategy's examples at tp=2: failures from a conditioning
    of 48 upward (12 of the 30 worst of 2,500 drawn, 6 of 27 between 48 and 100), none of 20
    between 13 and 44; examples up to 10 are kept, a margin of about 5."""
    hidden = 2 * (d // 2 + h)
    assume(depth == 0 or _layer_norm_conditioning(*_random_mlp(d, hidden, depth, d_out, rows, seed)) <= 10)
    out = ranks(2).run(_random_mlp_equals_plain, d, hidden, depth, d_out, rows, seed)
    if depth == 0:
        assert "glob 'blocks.*.fc' matches no module" in out[0]
    else:
        assert out == ["ok", "ok"]


def _evaluated_inside_the_step():
    """On each of 2 ranks (tp=2): a step that evaluates the model on a held-out batch (a
    forward outside value_and_grad, under no_grad) before it trains, against the plain
    module trained by torch.optim.SGD in lockstep."""
    torch.manual_seed(3)
    ref = Net()
    state = _state("sgd")
    ref.load_state_dict({k: v.detach().clone() for k, v in state.params.items()})
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    seen = []

    def train_step(state, batch):
        with torch.no_grad():
            seen.append(state.apply_fn(state.params, batch["x_eval"]))
        return ft.mse_step(state, batch)

    step = fzero.compile(train_step, fzero.Mesh(tp=2), tp=PLAN)
    state = step.init(state)
    g = torch.Generator().manual_seed(5)
    for i, b in enumerate(_batches(3, 4)):
        x_eval = torch.randn(6, 5, generator=g)
        with torch.no_grad():
            expected = ref(x_eval)
        state, _ = step(state, {**b, "x_eval": x_eval})
        ft.assert_trees_close(seen[-1], expected, tol="fp32", what=f"evaluation {i}")
        F.mse_loss(ref(b["x"]), b["y"]).backward()
        opt.step()
        opt.zero_grad()
    return True


@pytest.mark.multirank
def test_an_evaluation_inside_a_tensor_parallel_step_equals_the_plain_module(ranks):
    assert ranks(2).run(_evaluated_inside_the_step) == [True, True]
