"""A run is the same run whatever its layout: with dropout on and a token-mean loss, the
losses and parameters at any data-parallel size, ZeRO stage and accumulation equal the
one-process full-batch run's, on real gloo ranks; so does a run resumed from a checkpoint on
another layout.

The reference on every rank is the user's step run by fzero in a world of one
(``fzero.Step(train_step)``: no transform, the whole global batch), computed in the same
job. Its dropout masks are fzero's (the point of the property: they do not depend on the
layout); the loss is ``fzero.global_mean`` (checked against ``F.cross_entropy`` on the full
batch in tests/test_means.py).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fzero
import fzero.testing as ft
from fzero import optim

pytestmark = [pytest.mark.multirank, pytest.mark.slow]


class Block(nn.Module):
    def __init__(self, d, hidden, heads, p):
        super().__init__()
        self.heads, self.p = heads, p
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(self.ln1(x)).chunk(3, -1))
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(B, T, -1)))  # -1: a tp rank holds its heads
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class TinyLM(nn.Module):
    def __init__(self, vocab=13, d=8, hidden=16, heads=2, depth=2, p=0.2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d, hidden, heads, p) for _ in range(depth)])
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
        self.p = p

    def forward(self, ids):
        x = F.dropout(self.emb(ids), self.p, self.training)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


lm_step = ft.token_mean_step


def _batches(rows, T, steps, seed, vocab=13):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (rows, T), generator=g)
        y = torch.roll(ids, -1, 1)
        # Padding of random length per row: micro-batches and ranks hold very different counts.
        valid = torch.randint(0, T + 1, (rows, 1), generator=g)
        y[torch.arange(T).expand(rows, T) >= valid] = -100
        out.append({"ids": ids, "y": y})
    return out


def _state(model_args, seed):
    torch.manual_seed(1000 + seed)
    apply, params = fzero.functionalize(TinyLM(*model_args))
    # SGD with momentum: it sees a wrong gradient scale (Adam would hide one), and it does not
    # blow the rounding noise of zero-in-exact-arithmetic gradients (an attention key's bias)
    # up to full-size steps.
    return fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.2, momentum=0.9), seed=seed)


def _reference(model_args, batches, seed):
    state, losses = _state(model_args, seed), []
    step = fzero.Step(lm_step)  # fzero's randomness, one process, the whole global batch
    for b in batches:
        state, m = step(state, b)
        losses.append(m["loss"])
    return torch.stack(losses), dict(state.params)


def tp_plan(head_dim):
    """Megatron's split of TinyLM's blocks: q/k/v (one fused projection) by heads, the
    attention's output by rows, the MLP by columns then rows; each block's head count divided."""
    return {"blocks.*.qkv": fzero.ColwiseParallel(parts=3, unit=head_dim),
            "blocks.*.proj": fzero.RowwiseParallel(unit=head_dim),
            "blocks.*.fc": fzero.ColwiseParallel(), "blocks.*.out": fzero.RowwiseParallel(),
            "blocks.?": fzero.DivideAttributes("heads")}  # ? : the blocks themselves, not their layers


def _layout(model_args, per_rank, T, steps, seed, stage, accumulate, tp=1):
    """On every rank: the layout's run equals the one-process run."""
    n, r = dist.get_world_size(), dist.get_rank()
    mesh = fzero.Mesh(dp=n // tp, tp=tp)
    dp, j = mesh.size("dp"), mesh.coords["dp"]
    batches = _batches(per_rank * dp, T, steps, seed)
    ref_losses, ref_params = _reference(model_args, batches, seed)
    torch.manual_seed(r)  # per-rank seeding, as programs do: must change nothing
    plan = tp_plan(model_args[1] // model_args[3]) if tp > 1 else None
    step = fzero.compile(lm_step, mesh, zero=stage, accumulate=accumulate, tp=plan)
    state, losses = step.init(_state(model_args, seed)), []
    for b in batches:
        state, m = step(state, ft.local_batch(b, dp, j))
        losses.append(m["loss"])
    what = f"dp {dp}, tp {tp}, stage {stage}, accumulate {accumulate}, rank {r}"
    ft.assert_trees_close(torch.stack(losses), ref_losses, what=f"losses ({what})")
    ft.assert_trees_close(fzero.gather(state).params, ref_params, what=f"params ({what})")
    return [float(x) for x in losses]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(dp_tp=st.sampled_from([(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]), stage=st.sampled_from([0, 1, 2, 3]),
       accumulate=st.sampled_from([1, 2, 4]), d_heads=st.sampled_from([(8, 2), (16, 4), (8, 1)]),
       hidden=st.sampled_from([4, 8, 16]), depth=st.integers(1, 2), p=st.sampled_from([0.1, 0.5]),
       rows=st.integers(1, 2), T=st.integers(2, 5), seed=st.integers(0, 99))
def test_a_run_with_dropout_and_a_token_mean_is_the_same_at_every_layout(ranks, dp_tp, stage, accumulate, d_heads,
                                                                          hidden, depth, p, rows, T, seed):
    (dp, tp), (d, heads) = dp_tp, d_heads
    if tp > 1 and heads % tp:
        heads = tp  # tensor parallelism splits whole heads
    results = ranks(dp * tp).run(_layout, (13, d, hidden, heads, depth, p), rows * accumulate, T, 3, seed, stage,
                                 accumulate, tp)
    assert all(res == results[0] for res in results)


@pytest.mark.parametrize("stage, accumulate", [(0, 1), (3, 2)])
def test_tensor_parallel_runs_with_dropout_are_the_one_process_run(ranks, stage, accumulate):
    ranks(2).run(_layout, (13, 8, 16, 2, 2, 0.3), 2 * accumulate, 4, 3, 7, stage, accumulate, 2)
    ranks(4).run(_layout, (13, 8, 16, 2, 1, 0.3), 2 * accumulate, 3, 2, 8, stage, accumulate, 2)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_on_four_ranks_with_accumulation(ranks, stage):
    ranks(4).run(_layout, (13, 8, 16, 2, 2, 0.3), 2, 4, 3, 5, stage, 2)


# --------------------------------------------------------------------------- resumed on another layout


def _resumed(path, model_args, per_rank, T, seed, first, second):
    """Two steps on layout ``first`` (stage, accumulate[, tp]), saved; loaded on ``second``,
    two more: the four steps of the one-process run."""
    n, r = dist.get_world_size(), dist.get_rank()
    batches = _batches(per_rank * n, T, 4, seed)
    ref_losses, ref_params = _reference(model_args, batches, seed)
    losses = []
    for half, (stage, acc, *tp) in enumerate((first, second)):
        tp = tp[0] if tp else 1
        mesh = fzero.Mesh(dp=n // tp, tp=tp)
        plan = tp_plan(model_args[1] // model_args[3]) if tp > 1 else None
        step = fzero.compile(lm_step, mesh, zero=stage, accumulate=acc, tp=plan)
        state = step.init(_state(model_args, seed))
        if half == 1:
            state = fzero.checkpoint.load(path, like=state)
            assert int(state.step) == 2
        for b in batches[2 * half: 2 * half + 2]:
            state, m = step(state, ft.local_batch(b, mesh.size("dp"), mesh.coords["dp"]))
            losses.append(m["loss"])
        if half == 0:
            fzero.checkpoint.save(path, state)
    ft.assert_trees_close(torch.stack(losses), ref_losses, what=f"losses resumed {first} -> {second}")
    ft.assert_trees_close(fzero.gather(state).params, ref_params, what=f"params resumed {first} -> {second}")


@pytest.mark.parametrize("first, second", [((0, 1), (3, 2)), ((2, 4), (1, 1)), ((1, 2, 2), (3, 1)),
                                           ((0, 1), (2, 2, 2))])
def test_a_run_resumed_on_another_layout_is_the_same_run(ranks, tmp_path, first, second):
    ranks(2).run(_resumed, str(tmp_path / "ckpt"), (13, 8, 16, 2, 1, 0.3), 4, 3, 11, first, second)


def _resumed_on_one(path, model_args, seed):
    """The second half on one process, from a checkpoint the two ranks saved."""
    batches = _batches(8, 3, 4, seed)
    ref_losses, ref_params = _reference(model_args, batches, seed)
    step = fzero.compile(lm_step, zero=0)
    state = fzero.checkpoint.load(path, like=step.init(_state(model_args, seed)))
    losses = []
    for b in batches[2:]:
        state, m = step(state, b)
        losses.append(m["loss"])
    ft.assert_trees_close(torch.stack(losses), ref_losses[2:], what="losses resumed on one process")
    ft.assert_trees_close(dict(state.params), ref_params, what="params resumed on one process")


def test_a_run_saved_on_two_ranks_resumes_on_one_process(ranks, tmp_path):
    path = str(tmp_path / "ckpt")

    ranks(2).run(_save_half, path, (13, 8, 16, 2, 1, 0.3), 11)
    _resumed_on_one(path, (13, 8, 16, 2, 1, 0.3), 11)


def _save_half(path, model_args, seed):
    n, r = dist.get_world_size(), dist.get_rank()
    batches = _batches(8, 3, 4, seed)
    step = fzero.compile(lm_step, fzero.Mesh(dp=-1), zero=2, accumulate=2)
    state = step.init(_state(model_args, seed))
    for b in batches[:2]:
        state, _ = step(state, ft.local_batch(b, n, r))
    fzero.checkpoint.save(path, state)


# --------------------------------------------------------------------------- pipelines


def _seq_lm(seed, vocab=13, d=8, p=0.3):
    torch.manual_seed(2000 + seed)
    return nn.Sequential(nn.Embedding(vocab, d), nn.Dropout(p), nn.Linear(d, 2 * d), nn.GELU(), nn.Dropout(p),
                         nn.Linear(2 * d, d), nn.LayerNorm(d), nn.Dropout(p), nn.Linear(d, vocab))


def token_mean(logits, y):
    y = y.flatten()
    ce = F.cross_entropy(logits.flatten(0, 1), y.clamp(min=0), reduction="none")
    return fzero.global_mean(ce, where=y != -100)


def _seq_step(state, batch):
    loss, g = fzero.value_and_grad(lambda p: token_mean(state.apply_fn(p, batch["x"]), batch["y"]))(state.params)
    return state.apply_gradients(g), {"loss": loss}


def _pipelined(pp, m, kind, accumulate, zero, seed, steps=3, per=2, T=3):
    """On every rank: a pipeline over ``pp`` stages (the rest of the world data-parallel),
    with dropout and a token-mean loss, equals the one-process run."""
    world, r = dist.get_world_size(), dist.get_rank()
    dp = world // pp
    batches = [{"x": b["ids"], "y": b["y"]} for b in _batches(per * m * accumulate * dp, T, steps, seed)]
    apply, params = fzero.functionalize(_seq_lm(seed))
    ref_state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.2, momentum=0.9), seed=seed)
    ref_step, ref_losses = fzero.Step(_seq_step), []
    for b in batches:
        ref_state, mt = ref_step(ref_state, b)
        ref_losses.append(mt["loss"])

    mesh = fzero.Mesh(pp=pp, dp=dp)
    model = _seq_lm(seed)
    # Interleaved: 4 model stages, 2 per rank, three of them with a dropout.
    v, cuts = (2, [2, 5, 7]) if kind == "interleaved" else (1, [3])
    pipe = fzero.pipeline(fzero.transforms.pipeline.split(model, cuts), token_mean, mesh, micro_batches=m,
                          schedule=kind, virtual_stages=v)

    def train_step(state, batch):
        loss, grads = pipe(state.params, batch["x"], batch["y"])
        return state.apply_gradients(grads), {"loss": loss}

    step = fzero.compile(train_step, mesh, zero=zero, accumulate=accumulate, pipeline=pipe)
    torch.manual_seed(r)
    apply, params = fzero.functionalize(model)
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.2, momentum=0.9),
                                              seed=seed))
    losses = []
    for b in batches:
        state, mt = step(state, ft.local_batch(b, dp, mesh.coords["dp"]))
        losses.append(mt["loss"])
    what = f"pp {pp}, dp {dp}, m {m}, {kind}, accumulate {accumulate}, zero {zero}, rank {r}"
    ft.assert_trees_close(torch.stack(losses), torch.stack(ref_losses), what=f"losses ({what})")
    ft.assert_trees_close(pipe.gather(state.params), dict(ref_state.params), what=f"params ({what})")


@pytest.mark.parametrize("world, m, kind, accumulate, zero", [
    (2, 1, "1f1b", 1, 0), (2, 3, "gpipe", 1, 0), (2, 2, "1f1b", 2, 0), (4, 2, "1f1b", 2, 2),
    (2, 4, "interleaved", 1, 0)])
def test_a_pipelined_run_with_dropout_and_a_token_mean_is_the_one_process_run(ranks, world, m, kind, accumulate,
                                                                               zero):
    ranks(world).run(_pipelined, 2, m, kind, accumulate, zero, 3)
