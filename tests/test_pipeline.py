"""pipeline on real ranks: the plain step's trajectory for every schedule, stage count and
micro-batch count, composed with shard_state, mixed_precision, accumulate and remat, tied
weights kept in sync, constant activation memory under 1F1B, and clear errors.

The reference is always the plain single-process step on the full global batch, computed on
each rank in the same job; each pipeline rank sees its ``dp`` replica's slice of that batch.
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
from fzero.transforms.pipeline import Stage, StageError, pipeline, schedule, split

TXS = {
    "sgd": lambda: optim.sgd(0.05, momentum=0.9),  # sensitive to a wrong gradient average
    "adamw": lambda: optim.adamw(1e-2, weight_decay=0.1),
    "clipped": lambda: optim.chain(optim.clip_by_global_norm(0.05), optim.sgd(0.1)),  # psum over pp
}


# --------------------------------------------------------------------------- models


def _mlp(d_in, width, depth, d_out, seed):
    torch.manual_seed(seed)
    layers = [nn.Linear(d_in, width), nn.Tanh()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, d_out))


def _tied(vocab, d, seed):
    """An embedding whose weight is used again as the head: stage 0 and the last stage."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(vocab, d), nn.Linear(d, d), nn.Tanh(), nn.Linear(d, vocab, bias=False))
    model[3].weight = model[0].weight
    return model


def _cuts(model, p):
    """Boundaries cutting ``model``'s children into ``p`` non-empty slices."""
    n = len(model)
    return [round(i * n / p) for i in range(1, p)]


def _mse(out, y):
    return F.mse_loss(out, y)


def _xent(logits, y):
    return F.cross_entropy(logits, y)


def _plain_step(loss_fn):
    def train_step(state, batch):
        loss, grads = fzero.value_and_grad(lambda p: loss_fn(state.apply_fn(p, batch["x"]), batch["y"]))(state.params)
        return state.apply_gradients(grads), {"loss": loss}

    return train_step


def _pipe_step(pipe):
    def train_step(state, batch):
        loss, grads = pipe(state.params, batch["x"], batch["y"])
        return state.apply_gradients(grads), {"loss": loss}

    return train_step


def _wrap(step, precision, accumulate):
    if accumulate:
        step = fzero.accumulate(step, accumulate)
    if precision:
        step = fzero.mixed_precision(step, precision)
    return step


# --------------------------------------------------------------------------- the trajectory


def _same_as_plain(p, m, kind, tx_name, *, steps=3, per_mb=2, width=6, depth=2, seed=0, dp=1, zero=None,
                   units=False, precision=None, accumulate=None, remat=False, tied=False, freeze=False):
    """Runs on every rank: the pipelined trajectory equals the plain one."""
    r = dist.get_rank()
    mesh = fzero.Mesh(pp=p, dp=dp)
    d_in, d_out, vocab = 3, 2, 7
    make = (lambda: _tied(vocab, width, seed)) if tied else (lambda: _mlp(d_in, width, depth, d_out, seed))
    if freeze:  # the second Linear's weight is frozen in both models
        make_unfrozen = make
        make = lambda: _freeze(make_unfrozen())  # noqa: E731
    loss_fn = _xent if tied else _mse
    k = accumulate or 1
    n = per_mb * m * k * dp
    g = torch.Generator().manual_seed(seed + 1)
    if tied:
        batches = [{"x": torch.randint(vocab, (n,), generator=g), "y": torch.randint(vocab, (n,), generator=g)}
                   for _ in range(steps)]
    else:
        batches = [{"x": torch.randn(n, d_in, generator=g), "y": torch.randn(n, d_out, generator=g)}
                   for _ in range(steps)]

    ref_model = make()
    apply, params = fzero.functionalize(ref_model)
    # fp16 with a dynamic scale: cutting the batch changes which updates overflow (a
    # micro-batch's mean divides by fewer rows, so its scaled gradients are larger), so the
    # reference is the plain step cut into the same micro-batches by fzero.accumulate.
    ref_step = _wrap(_plain_step(loss_fn), precision, m * k if precision == "fp16" else None)
    ref = ref_step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=TXS[tx_name]())) \
        if precision else fzero.TrainState.create(apply_fn=apply, params=params, tx=TXS[tx_name]())
    ref_losses, ref_skipped = [], []
    for b in batches:
        ref, metrics = ref_step(ref, b)
        ref_losses.append(metrics["loss"])
        ref_skipped.append(bool(metrics.get("skipped", False)))

    model = make()
    apply, params = fzero.functionalize(model)
    stages = split(model, _cuts(model, p))
    if remat:
        stages = [Stage(fzero.remat(s.fn), s.keys, s.in_shape) for s in stages]
    pipe = pipeline(stages, loss_fn, mesh, micro_batches=m, schedule=kind)
    inner = _wrap(_pipe_step(pipe), precision, accumulate)
    if zero is not None:
        inner = fzero.shard_state(inner, mesh, zero, bucket_bytes=64,
                                  units=(lambda mod: isinstance(mod, nn.Linear)) if units else None)
    step = pipe.transform(inner)
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=TXS[tx_name]()))
    assert set(fzero.gather(state.params)) == set(pipe.keys)  # only this stage's parameters are kept
    losses, skipped = [], []
    j = mesh.coords["dp"]
    for b in batches:
        state, metrics = step(state, ft.local_batch(b, dp, j))
        losses.append(metrics["loss"])
        skipped.append(bool(metrics.get("skipped", False)))
    assert skipped == ref_skipped, (skipped, ref_skipped)  # fp16: the same updates overflow

    # Low precision: the table's row for the compute dtype (the plain step rounds in other
    # places when the batch is cut); masters are fp32 but carry that rounding too. fp32: the
    # row of the leaves' dtype.
    ft.assert_trees_close(torch.stack(losses), torch.stack(ref_losses), tol=precision, what=f"losses on rank {r}")
    full = pipe.gather(state.params)
    ft.assert_trees_close(full, ref.params, tol=precision, what=f"params on rank {r}")
    if precision:
        ft.assert_trees_close(pipe.gather(state.master), ref.master, tol=precision,
                              what=f"master weights on rank {r}")
    if tied and pipe.stage == p - 1:
        # The last stage's copy of the tied weight equals the first stage's, bit for bit.
        mine = fzero.gather(state.params)["0.weight"]
        assert torch.equal(mine, full["0.weight"]), "the tied copies drifted apart"
    assert int(state.step) == int(ref.step) == steps - sum(skipped)
    if freeze and "2.weight" in full:
        assert torch.equal(full["2.weight"], _freeze(make_unfrozen()).get_parameter("2.weight"))
    return [float(x) for x in losses]


def _freeze(model):
    model[2].weight.requires_grad_(False)
    return model


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=st.sampled_from([2, 3]), m=st.integers(1, 8), kind=st.sampled_from(["gpipe", "1f1b"]),
       tx_name=st.sampled_from(sorted(TXS)), per_mb=st.integers(1, 3), width=st.integers(1, 6),
       depth=st.integers(1, 2), seed=st.integers(0, 1000))
@pytest.mark.multirank
@pytest.mark.slow
def test_pipelined_step_equals_plain_step(ranks, p, m, kind, tx_name, per_mb, width, depth, seed):
    results = ranks(p).run(_same_as_plain, p, m, kind, tx_name, per_mb=per_mb, width=width, depth=depth,
                           seed=seed, timeout_s=120)
    assert all(r == results[0] for r in results)  # every rank reports the last stage's loss


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [2, 3])
def test_every_schedule_every_stage_count(ranks, p, kind):
    for m in (1, 4, 8):
        ranks(p).run(_same_as_plain, p, m, kind, "sgd")


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("zero,units", [(0, False), (1, False), (2, False), (3, False), (3, True)])
def test_dp_by_pp_with_shard_state(ranks, zero, units):
    """dp x pp = 2 x 2 on 4 ranks: each stage's dp pair shards that stage's parameters."""
    results = ranks(4).run(_same_as_plain, 2, 4, "1f1b", "adamw", dp=2, zero=zero, units=units)
    assert all(r == results[0] for r in results)


@pytest.mark.multirank
@pytest.mark.slow
def test_dp_by_pp_gpipe_clipped(ranks):
    """A global-norm clip sees every stage's gradients (psum over pp and dp)."""
    ranks(4).run(_same_as_plain, 2, 3, "gpipe", "clipped", dp=2, zero=2)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_and_accumulate(ranks, precision):
    """Against the plain step under the same mixed_precision (autocast). SGD: Adam divides by
    sqrt(v), so one low-precision rounding of a near-zero gradient can flip an update."""
    ranks(2).run(_same_as_plain, 2, 2, "1f1b", "sgd", precision=precision, accumulate=2, steps=5)


@pytest.mark.multirank
@pytest.mark.slow
def test_mixed_precision_on_dp_by_pp(ranks):
    ranks(4).run(_same_as_plain, 2, 2, "gpipe", "sgd", dp=2, zero=3, precision="bf16")


@pytest.mark.multirank
@pytest.mark.slow
def test_accumulate_fp32(ranks):
    ranks(2).run(_same_as_plain, 2, 3, "gpipe", "sgd", accumulate=2)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_remat_inside_stages(ranks, kind):
    ranks(3).run(_same_as_plain, 3, 4, kind, "adamw", remat=True)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("dp,zero", [(1, None), (2, 2), (2, 3)])
def test_frozen_parameters_in_a_pipeline(ranks, dp, zero):
    ranks(2 * dp).run(_same_as_plain, 2, 2, "1f1b", "adamw", dp=dp, zero=zero, freeze=True)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("p", [2, 3])
def test_tied_weights_stay_in_sync(ranks, p):
    """An embedding used again as the head: first and last stage (neighbours at p=2, not at p=3)."""
    ranks(p).run(_same_as_plain, p, 4, "1f1b", "adamw", tied=True)


@pytest.mark.multirank
@pytest.mark.slow
def test_a_tied_weight_counts_once_in_a_clip_over_stages(ranks):
    """The global norm a clip takes over pp counts a weight tied across stages once."""
    ranks(2).run(_same_as_plain, 2, 4, "1f1b", "clipped", tied=True)


@pytest.mark.multirank
@pytest.mark.slow
def test_tied_weights_on_dp_by_pp(ranks):
    ranks(4).run(_same_as_plain, 2, 2, "1f1b", "sgd", tied=True, dp=2, zero=3)


# --------------------------------------------------------------------------- memory


def _saved_bytes(kind, m, remat=False):
    """Peak bytes autograd saved on this stage, and the most micro-batches in flight."""
    mesh = fzero.Mesh(pp=2, dp=1)
    model = _mlp(16, 64, 3, 4, 0)
    apply, params = fzero.functionalize(model)
    stages = split(model, _cuts(model, 2))
    if remat:
        stages = [Stage(fzero.remat(s.fn), s.keys, s.in_shape) for s in stages]
    pipe = pipeline(stages, _mse, mesh, micro_batches=m, schedule=kind, measure_memory=True)
    x, y = torch.randn(8 * m, 16), torch.randn(8 * m, 4)  # 8 rows per micro-batch, whatever m
    pipe(pipe.stage_params(params), x, y)
    return pipe.stats["peak_saved_bytes"], pipe.stats["max_in_flight"]


@pytest.mark.multirank
@pytest.mark.slow
def test_1f1b_holds_constant_activations_on_the_first_stage(ranks):
    pool = ranks(2)
    got = {(kind, m): pool.run(_saved_bytes, kind, m)[0] for kind in ("gpipe", "1f1b") for m in (4, 16)}
    (g4, g4n), (g16, g16n) = got["gpipe", 4], got["gpipe", 16]
    (f4, f4n), (f16, f16n) = got["1f1b", 4], got["1f1b", 16]
    assert (g4n, g16n, f4n, f16n) == (4, 16, 2, 2), got  # micro-batches in flight on stage 0
    assert f4 == f16, got  # 1F1B: constant in m
    assert g16 == 4 * g4, got  # GPipe: grows with m
    assert f4 == g4 // 2, got  # 2 of 4 micro-batches (p - s = 2 on stage 0)
    remat = pool.run(_saved_bytes, "1f1b", 16, True)[0][0]
    assert remat < f16 / 2, (remat, f16)  # remat keeps stage inputs only


# --------------------------------------------------------------------------- errors


def _catch(fn):
    try:
        fn()
    except (ValueError, TypeError, KeyError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _wrong_stage_count():
    model = _mlp(3, 4, 1, 2, 0)
    return _catch(lambda: pipeline(split(model, [1, 2]), _mse, fzero.Mesh(pp=2, dp=1), micro_batches=2))


def _indivisible_batch():
    model = _mlp(3, 4, 1, 2, 0)
    apply, params = fzero.functionalize(model)
    pipe = pipeline(split(model, _cuts(model, 2)), _mse, fzero.Mesh(pp=2, dp=1), micro_batches=4)
    return _catch(lambda: pipe(pipe.stage_params(params), torch.randn(6, 3), torch.randn(6, 2)))


def _shape_mismatch(p, declared):
    """Stage p-2 gives 8 features per row; stage p-1 starts with Linear(6, 2)."""
    torch.manual_seed(0)
    if p == 2:
        model, cuts = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(6, 2)), [2]
    else:
        model, cuts = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 8), nn.Linear(6, 2)), [1, 2]
    apply, params = fzero.functionalize(model)
    stages = split(model, cuts)
    if not declared:  # stage functions that say nothing of their input
        stages = [Stage(s.fn, s.keys) for s in stages]
    pipe = pipeline(stages, _mse, fzero.Mesh(pp=p, dp=1), micro_batches=2, timeout_s=20)
    return _catch(lambda: pipe(pipe.stage_params(params), torch.randn(4, 3), torch.randn(4, 2)))


@pytest.mark.multirank
@pytest.mark.slow
def test_stage_count_must_match_pp(ranks):
    for msg in ranks(2).run(_wrong_stage_count):
        assert msg and "3 stages" in msg and "pp axis has 2 ranks" in msg, msg


@pytest.mark.multirank
@pytest.mark.slow
def test_micro_batches_must_divide_the_batch(ranks):
    for msg in ranks(2).run(_indivisible_batch):
        assert msg and "leading size 6" in msg and "4 micro-batches" in msg and "fzero.pipeline" in msg, msg


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("declared", [True, False])
@pytest.mark.parametrize("p", [2, 3])
def test_stage_shapes_that_disagree_are_named_on_every_rank(ranks, p, declared):
    msgs = ranks(p).run(_shape_mismatch, p, declared)
    for msg in msgs:
        assert msg and msg.startswith("StageError: fzero.pipeline: stage"), msgs
        bad = 1 if p == 2 else 2
        assert f"stage {bad - 1}" in msg and f"stage {bad}" in msg, msg
        assert "(4, 8)" not in msg and "(2, 8)" in msg, msg  # per micro-batch: 4 rows / 2
        assert "6" in msg, msg
    assert len(set(msgs)) == 1, msgs  # the same message everywhere


def _loss_that_fails_later(calls):
    def loss_fn(out, y):
        calls.append(1)
        if len(calls) > 2:  # the handshake and the first step pass; the second step raises
            raise RuntimeError("loss_fn: something broke")
        return _mse(out, y)

    return loss_fn


def _stage_raises_mid_step():
    model = _mlp(3, 4, 1, 2, 0)
    apply, params = fzero.functionalize(model)
    pipe = pipeline(split(model, _cuts(model, 2)), _loss_that_fails_later([]), fzero.Mesh(pp=2, dp=1),
                    micro_batches=1, timeout_s=3)
    local = pipe.stage_params(params)
    pipe(local, torch.randn(2, 3), torch.randn(2, 2))
    try:
        pipe(local, torch.randn(2, 3), torch.randn(2, 2))
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


@pytest.mark.multirank
@pytest.mark.slow
def test_a_stage_that_raises_mid_step_ends_its_neighbours_wait(ranks):
    pool = ranks(2)
    first, last = pool.run(_stage_raises_mid_step)
    pool.restart()  # a timed-out receive closes gloo's connection: start afresh next time
    assert last.startswith("RuntimeError: loss_fn: something broke"), last
    assert "CollectiveError" in first and "the gradient of micro-batch 0 (stage 1 -> 0)" in first, first
    assert "from rank 1" in first and "3 s" in first, first


def test_bad_options():
    model = _mlp(3, 4, 1, 2, 0)
    with pytest.raises(ValueError, match="schedule='interleaved'"):
        pipeline(split(model, []), _mse, micro_batches=2, schedule="interleaved")
    with pytest.raises(ValueError, match="micro_batches=0"):
        pipeline(split(model, []), _mse, micro_batches=0)
    with pytest.raises(TypeError, match="stage 0 must be"):
        pipeline([lambda p, x: x], _mse)
    with pytest.raises(ValueError, match="2 stages, but the mesh's pp axis has 1"):
        pipeline(split(model, [2]), _mse, fzero.Mesh(dp=-1))
    with pytest.raises(TypeError, match="nn.Sequential"):
        split(nn.Linear(2, 2), [1])


def test_one_stage_is_accumulation():
    """With one stage the pipeline is micro-batched value_and_grad: same loss and gradient."""
    model = _mlp(3, 5, 1, 2, 0)
    apply, params = fzero.functionalize(model)
    x, y = torch.randn(12, 3), torch.randn(12, 2)
    for kind in ("gpipe", "1f1b"):
        pipe = pipeline(split(model, []), _mse, micro_batches=3, schedule=kind)
        loss, grads = pipe(params, x, y)
        ref_loss, ref_grads = fzero.value_and_grad(lambda p: _mse(apply(p, x), y))(params)
        ft.assert_trees_close(loss, ref_loss)
        ft.assert_trees_close(grads, ref_grads)


# --------------------------------------------------------------------------- schedules


def _simulate(kind, p, m, t_f=1, t_b=2):
    """Run every stage's schedule with unit-cost ops and free communication.

    Returns the step's length and each stage's most micro-batches in flight; raises on a
    deadlock (no stage can start its next op)."""
    ops = [schedule(kind, p, m, s) for s in range(p)]
    pos, free = [0] * p, [0] * p
    done: dict = {}
    flight, peak = [0] * p, [0] * p
    while any(pos[s] < len(ops[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if pos[s] == len(ops[s]):
                continue
            op, j = ops[s][pos[s]]
            dep = (("F", s - 1, j) if s > 0 else None) if op == "F" else (("B", s + 1, j) if s < p - 1 else ("F", s, j))
            if dep is not None and dep not in done:
                continue
            start = max(free[s], done[dep] if dep else 0)
            free[s] = done[(op, s, j)] = start + (t_f if op == "F" else t_b)
            flight[s] += 1 if op == "F" else -1
            peak[s] = max(peak[s], flight[s])
            pos[s] += 1
            progressed = True
        assert progressed, f"{kind} p={p} m={m}: deadlock at {pos}"
    return max(free), peak


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_schedules_run_every_micro_batch_without_deadlock(kind):
    for p in range(1, 5):
        for m in range(1, 10):
            for s in range(p):
                ops = schedule(kind, p, m, s)
                assert sorted(ops) == sorted([("F", j) for j in range(m)] + [("B", j) for j in range(m)])
                assert all(ops.index(("F", j)) < ops.index(("B", j)) for j in range(m))
            length, peak = _simulate(kind, p, m)
            # Bubble: (p - 1) / (m + p - 1) of the step, for both schedules.
            assert length == (m + p - 1) * 3, (kind, p, m, length)
            if kind == "1f1b":
                assert peak == [min(p - s, m) for s in range(p)], (p, m, peak)
            else:
                assert peak == [m] * p


def test_doctests():
    import doctest
    import importlib
    import pkgutil

    package = importlib.import_module("fzero.transforms.pipeline")  # the package, not the function
    failed = attempted = 0
    for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        result = doctest.testmod(importlib.import_module(info.name), optionflags=doctest.NORMALIZE_WHITESPACE)
        failed, attempted = failed + result.failed, attempted + result.attempted
    assert failed == 0 and attempted >= 3, (failed, attempted)


# --------------------------------------------------------------------------- buffers


def _bn_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 6), nn.BatchNorm1d(6),
                         nn.Linear(6, 2))


def _pipelined_buffers(kind, m, steps=3, seed=4):
    """On every rank: a pipeline's stages run on the state's buffers (BatchNorm's running
    statistics), which equal the plain step's cut into the same micro-batches, are whole
    again after fzero.gather, and come back in the module after load_into."""
    r = dist.get_rank()
    g = torch.Generator().manual_seed(seed + 1)
    batches = [{"x": torch.randn(4 * m, 3, generator=g), "y": torch.randn(4 * m, 2, generator=g)}
               for _ in range(steps)]
    apply, params = fzero.functionalize(_bn_model(seed))
    ref = fzero.TrainState.create(apply_fn=apply, params=params, tx=TXS["sgd"]())
    ref_step = fzero.accumulate(_plain_step(_mse), m)  # BatchNorm sees the same micro-batches
    for b in batches:
        ref, _ = ref_step(ref, b)

    model = _bn_model(seed)
    mesh = fzero.Mesh(pp=2, dp=1)
    pipe = pipeline(split(model, [3]), _mse, mesh, micro_batches=m, schedule=kind)
    step = pipe.transform(_pipe_step(pipe))
    apply, params = fzero.functionalize(model)
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=TXS["sgd"]()))
    mine = {"1.running_mean", "1.running_var", "1.num_batches_tracked"} if pipe.stage == 0 else \
        {"4.running_mean", "4.running_var", "4.num_batches_tracked"}
    assert set(state.buffers) == mine  # a stage keeps its own buffers, as its parameters
    for b in batches:
        state, _ = step(state, b)
    whole = fzero.gather(state)
    ft.assert_trees_close(whole.buffers, dict(ref.buffers), what=f"buffers on rank {r}")
    ft.assert_trees_close(dict(whole.params), dict(ref.params), what=f"params on rank {r}")
    fzero.load_into(model, state)
    ft.assert_trees_close(dict(model.named_buffers()), dict(ref.buffers), what=f"the module's buffers on rank {r}")


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("kind, m", [("1f1b", 2), ("gpipe", 3)])
def test_pipeline_stages_run_on_the_states_buffers(ranks, kind, m):
    ranks(2).run(_pipelined_buffers, kind, m)
