"""1-bit Adam on real gloo ranks: the warm-up is Adam without bias correction bit for bit;
after it the momentum crosses the ranks 1-bit compressed, with the bytes of the formula in
docs/optim.md, and the trajectory equals an independent single-process simulation of the
workers written from the paper's equations (plain torch, below)."""

from __future__ import annotations

import contextlib
import math
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fzero
import fzero.testing as ft
from fzero import optim
from fzero.distributed import comm

LR, B1, B2, EPS, WD = 1e-2, 0.9, 0.999, 1e-3, 0.01
FREEZE, STEPS, ROWS_PER_RANK = 3, 8, 3
MODEL = (4, 64, 2, 3)  # Blocks(d_in, width, depth, d_out): 8 leaves, 3 to 4,096 elements


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return ft.Blocks(*MODEL)


def _batches(world: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = ROWS_PER_RANK * world
    return [{"x": torch.randn(rows, MODEL[0], generator=g), "y": torch.randn(rows, MODEL[3], generator=g)}
            for _ in range(STEPS)]


def _run(tx, world: int, rank: int):
    """Params after every update, and each update's bytes sent by kind of payload."""
    apply, params = fzero.functionalize(_model())
    step = fzero.shard_state(ft.mse_step, fzero.Mesh(dp=-1), 0)
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=tx))
    trajectory, sent = [], []
    for b in _batches(world):
        before = comm.traffic.copy()
        state, _ = step(state, ft.local_batch(b, world, rank))
        spent = comm.traffic - before
        trajectory.append({k: v.clone() for k, v in state.params.items()})
        sent.append({w: spent.sent(what=w) for w in ("gradients", "compressed")})
    return trajectory, sent


def _onebit_on_ranks():
    world, rank = dist.get_world_size(), dist.get_rank()
    onebit, _ = _run(optim.onebit_adam(LR, B1, B2, EPS, WD, freeze_step=FREEZE), world, rank)
    adam, _ = _run(optim.adamw(LR, B1, B2, EPS, WD, bias_correction=False), world, rank)
    onebit_again, sent = _run(optim.onebit_adam(LR, B1, B2, EPS, WD, freeze_step=FREEZE), world, rank)
    return {"onebit": onebit, "adam": adam, "again": onebit_again, "sent": sent}


# --------------------------------------------------------------------------- the reference


def _signs(x):
    return torch.where(x >= 0, 1.0, -1.0)


def _padded(n: int, world: int) -> int:
    """``n`` elements rounded up to whole packed bytes in every rank's chunk (DeepSpeed's padding)."""
    unit = world * math.lcm(world, 8)
    return -(-n // unit) * unit


def _new_errors(n: int, world: int):
    """The zero error-feedback buffers of one exchanged tensor of ``n`` elements: each worker's
    (padded) and each server's (its chunk)."""
    padded = _padded(n, world)
    return [torch.zeros(padded) for _ in range(world)], [torch.zeros(padded // world) for _ in range(world)]


def _worker_grads(model, params, batch, world: int) -> list:
    """Module + backward for each simulated worker: worker ``w``'s gradients of the loss on its
    rows of ``batch``, at its parameters ``params[w]`` loaded into ``model``."""
    local = []
    for w in range(world):
        with torch.no_grad():
            for q, x in zip(model.parameters(), params[w]):
                q.copy_(x)
        rows = ft.local_batch(batch, world, w)
        local.append(torch.autograd.grad(F.mse_loss(model(rows["x"]), rows["y"]), list(model.parameters())))
    return local


def _simulated_compressed_allreduce(ms, worker_err, server_err, world):
    """Tang et al. (2021), Algorithm 1 with DeepSpeed's chunking: every worker compresses its
    momentum plus its error to scale * sign (scale = ||b|| / sqrt(P)); the server of chunk r
    averages the workers' compressed chunks, adds its own error, compresses again; everyone
    receives every server's compressed chunk. ``ms``: the workers' tensors (same shape)."""
    n = ms[0].numel()
    padded = _padded(n, world)
    sent = []
    for w in range(world):
        b = torch.cat([ms[w].reshape(-1), torch.zeros(padded - n)]) + worker_err[w]
        scale = b.norm() / math.sqrt(padded)
        worker_err[w] = b - scale * _signs(b)
        sent.append(scale * _signs(b))
    chunk = padded // world
    out = torch.empty(padded)
    for r in range(world):
        c = sum(s[r * chunk:(r + 1) * chunk] for s in sent) / world + server_err[r]
        scale = c.norm() / math.sqrt(chunk)
        server_err[r] = c - scale * _signs(c)
        out[r * chunk:(r + 1) * chunk] = scale * _signs(c)
    return out[:n].reshape(ms[0].shape), padded


def _ema(m, g):
    """b1 * m + (1 - b1) * g, written as the interpolation m + (1 - b1) (g - m) that rounds as
    torch.lerp does: a sign decided on an element within rounding of 0 would otherwise flip
    and move that element by twice its scale (1-bit compression is not continuous)."""
    return m + (1 - B1) * (g - m)


def _reference(world: int, feedback: bool = True):
    """1-bit Adam over ``world`` simulated workers in one process: module + backward for each
    worker's rows, DeepSpeed's OnebitAdam update (no bias correction, decoupled decay); without
    ``feedback`` the errors are dropped after every exchange."""
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    p = [q.detach().clone() for q in model.parameters()]
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    errors = {}
    out = []
    for k, b in enumerate(_batches(world)):
        local = _worker_grads(model, [p] * world, b, world)
        for i in range(len(p)):
            if k < FREEZE:
                g = sum(gs[i] for gs in local) / world
                m[i] = _ema(m[i], g)
                v[i] = B2 * v[i] + (1 - B2) * g * g
            else:
                ms = [_ema(m[i], gs[i]) for gs in local]
                if i not in errors:
                    errors[i] = _new_errors(p[i].numel(), world)
                m[i], _ = _simulated_compressed_allreduce(ms, *errors[i], world)
                if not feedback:
                    errors.pop(i)
            p[i] = p[i] - LR * (m[i] / (v[i].sqrt() + EPS) + WD * p[i])
        out.append(dict(zip(names, [x.clone() for x in p])))
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def runs(request, ranks):
    return request.param, ranks(request.param).run(_onebit_on_ranks)


@pytest.mark.multirank
@pytest.mark.slow
def test_the_warm_up_is_adam_without_bias_correction_bit_for_bit(runs):
    for rank, res in enumerate(runs[1]):
        for k in range(FREEZE):
            for name, x in res["onebit"][k].items():
                assert torch.equal(x, res["adam"][k][name]), f"rank {rank}, update {k}, {name}"
        # and then it is not Adam any more: the momentum was compressed
        assert not all(torch.equal(x, res["adam"][FREEZE][n]) for n, x in res["onebit"][FREEZE].items())


@pytest.mark.multirank
@pytest.mark.slow
def test_every_rank_holds_the_same_parameters_and_runs_are_deterministic(runs):
    world, res = runs
    for k in range(STEPS):
        for name, x in res[0]["onebit"][k].items():
            assert all(torch.equal(x, res[r]["onebit"][k][name]) for r in range(world)), (k, name)
            assert torch.equal(x, res[0]["again"][k][name]), (k, name)


@pytest.mark.multirank
@pytest.mark.slow
def test_the_compressed_trajectory_equals_a_simulation_of_the_workers(runs):
    world, res = runs
    ref = _reference(world)
    for k in range(STEPS):
        ft.assert_trees_close(res[0]["onebit"][k], ref[k], rtol=1e-5, atol=1e-6, what=f"update {k}")
    # the error feedback is exercised: without it the trajectory is another one
    lossy = _reference(world, feedback=False)[-1]
    assert max((res[0]["onebit"][-1][n] - lossy[n]).abs().max() for n in lossy) > 1e-4


@pytest.mark.multirank
@pytest.mark.slow
def test_after_the_warm_up_the_bytes_are_the_formula(runs):
    world, res = runs
    numels = [p.numel() for p in _model().parameters()]
    formula = _formula(numels, world)
    for sent in res[0]["sent"][FREEZE:]:
        assert sent["gradients"] == 0
        assert sent["compressed"] == formula
    warm = res[0]["sent"][0]
    assert warm["compressed"] == 0 and warm["gradients"] > 0
    # about 1/32 of the warm-up's fp32 gradient all-reduce (the scales and the padding of
    # the small leaves are the rest)
    assert Fraction(1, 32) < Fraction(formula) / warm["gradients"] < Fraction(1, 24)


# --------------------------------------------------------------------------- 0/1 Adam, 1-bit LAMB, configs

ZO = dict(var_freeze_step=4, var_update_scaler=2, local_step_scaler=1, local_step_clipper=2)
LAMB_FREEZE = 3


def _family_on_ranks(configs):
    """0/1 Adam and 1-bit LAMB trajectories beside the optimizers their warm-ups are, and the
    public-style configs of the family trained by fzero.compile on these ranks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    (zo, zo_sent), (lamb1, lamb1_sent) = (
        _run(optim.zero_one_adam(LR, B1, B2, EPS, WD, **ZO), world, rank),
        _run(optim.onebit_lamb(LR, B1, B2, EPS, WD, freeze_step=LAMB_FREEZE), world, rank))
    out = {
        "zo": zo, "zo_sent": zo_sent, "lamb1": lamb1, "lamb1_sent": lamb1_sent,
        "adam": _run(optim.adamw(LR, B1, B2, EPS, WD, bias_correction=False), world, rank)[0],
        "lamb": _run(optim.deepspeed_lamb(LR, B1, B2, EPS, WD, bias_correction=False), world, rank)[0],
    }
    losses = {}
    for path in configs:
        apply, params = fzero.functionalize(_model())
        state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.0))
        step = fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), config=path)
        state = step.init(state)
        g = torch.Generator().manual_seed(5)
        x, y = torch.randn(8 * world, MODEL[0], generator=g), torch.randn(8 * world, MODEL[3], generator=g)
        batch = ft.local_batch({"x": x, "y": y}, world, rank)
        curve = []
        for _ in range(12):
            state, m = step(state, batch)
            curve.append(float(m["loss"]))
        losses[path] = (curve, {k: v.clone() for k, v in state.params.items()})
    out["configs"] = losses
    return out


CONFIG_DIR = Path(__file__).parent / "data" / "ds_configs"
FAMILY_CONFIGS = [str(CONFIG_DIR / f"{n}.json") for n in ("onebit_adam", "zero_one_adam", "onebit_lamb")]


@pytest.fixture(scope="module")
def family(ranks):
    return ranks(2).run(_family_on_ranks, FAMILY_CONFIGS)


@pytest.mark.multirank
@pytest.mark.slow
def test_zero_one_adam_is_adam_until_its_variance_schedule_leaves_it(family):
    # var_interval 1 for the first var_update_scaler updates: every one is an averaged Adam step
    for res in family:
        for k in range(ZO["var_update_scaler"]):
            assert all(torch.equal(x, res["adam"][k][n]) for n, x in res["zo"][k].items()), k
        assert not all(torch.equal(x, res["adam"][-1][n]) for n, x in res["zo"][-1].items())


@pytest.mark.multirank
@pytest.mark.slow
def test_zero_one_adam_ranks_agree_at_every_synchronisation(family):
    # variance phase: every update agrees bit for bit; local steps (updates var_freeze_step + 1
    # on, synchronised at updates 5 and 7 here): the ranks' parameters are their own between
    # synchronisations and agree at each up to rounding (p - buffer is the parameter of the
    # last synchronisation to rounding only, in DeepSpeed as here)
    first_local = ZO["var_freeze_step"] + 1
    a, b = family[0]["zo"], family[1]["zo"]
    for k in range(first_local):
        assert all(torch.equal(x, b[k][n]) for n, x in a[k].items()), k
    for k in (5, 7):
        ft.assert_trees_close(a[k], b[k], rtol=1e-6, atol=1e-7, what=f"synchronised update {k}")
    assert max((a[6][n] - b[6][n]).abs().max() for n in a[6]) > 1e-4  # a local step: each rank its own


@pytest.mark.multirank
@pytest.mark.slow
def test_onebit_lamb_warm_up_is_deepspeeds_lamb_without_bias_correction(family):
    for res in family:
        for k in range(LAMB_FREEZE):
            ft.assert_trees_close(res["lamb1"][k], res["lamb"][k], rtol=1e-6, atol=1e-7, what=f"update {k}")
        for k in range(STEPS):  # compressed or not, every rank holds the same parameters
            assert all(torch.equal(x, family[1]["lamb1"][k][n]) for n, x in res["lamb1"][k].items())
        assert not all(torch.equal(x, res["lamb"][-1][n]) for n, x in res["lamb1"][-1].items())


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("path", FAMILY_CONFIGS, ids=lambda p: p.rsplit("/", 1)[-1])
def test_the_family_trains_from_deepspeed_configs_on_two_ranks(family, path):
    curve, params = family[0]["configs"][path]
    assert all(math.isfinite(x) for x in curve)
    assert curve[-1] < curve[0]  # past the warm-up, compressed, fp16, clipped: still descending
    assert curve == family[1]["configs"][path][0]


def test_the_family_refuses_zero_naming_the_stage_and_the_optimizer():
    for tx, name in [(optim.onebit_adam(1e-3), "onebit_adam"), (optim.zero_one_adam(1e-3), "zero_one_adam"),
                     (optim.chain(optim.clip_by_global_norm(1.0), optim.onebit_lamb(1e-3)), "onebit_lamb")]:
        apply, params = fzero.functionalize(_model())
        state = fzero.TrainState.create(apply_fn=apply, params=params, tx=tx)
        with pytest.raises(ValueError, match=rf"fzero.optim.{name} .* ZeRO stage 0 only .* got stage=2"):
            fzero.compile(ft.mse_step, zero=2).init(state)
    apply, params = fzero.functionalize(_model())
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "OneBitAdam"}, "zero_optimization": {"stage": 1}}
    with pytest.raises(ValueError, match=r"fzero.optim.onebit_adam .* got stage=1"):
        fzero.compile(ft.mse_step, config=cfg).init(state)


def test_in_a_world_of_one_onebit_adam_is_adam_with_its_variance_frozen():
    params = {"w": torch.randn(5)}
    tx, ref = optim.onebit_adam(0.1, freeze_step=2), optim.adamw(0.1, weight_decay=0.0, bias_correction=False)
    s, r = tx.init(params), ref.init(params)
    g = [torch.randn(5) for _ in range(4)]
    for k in range(4):
        u, s = tx.update({"w": g[k]}, s, params)
        v, r = ref.update({"w": g[k]}, r, params)
        if k < 2:
            assert torch.equal(u["w"], v["w"]) and torch.equal(s[0].nu["w"], r[0].nu["w"])
        else:
            assert torch.equal(s[0].nu["w"], nu_frozen) and torch.equal(s[0].mu["w"], r[0].mu["w"])
        nu_frozen = s[0].nu["w"]
    assert optim.exchange_of(tx, s).local_gradients and not optim.exchange_of(tx, tx.init(params)).local_gradients


def _reference_zero_one(world: int):
    """0/1 Adam (Lu et al., 2022, Algorithm 1 as DeepSpeed's ZeroOneAdam runs it) over
    ``world`` simulated workers, each with its own parameters and momentum: the variance
    schedule, compressed gradients off it, then local steps and compressed synchronisations."""
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    p = [[q.detach().clone() for q in model.parameters()] for _ in range(world)]
    m = [[torch.zeros_like(x) for x in p[0]] for _ in range(world)]
    buf = [[torch.zeros_like(x) for x in p[0]] for _ in range(world)]
    v = [torch.zeros_like(x) for x in p[0]]
    vi, vc, lsi, lsc, lrs, errors, out = 1, 0, 1, 0, 0.0, {}, []

    def compress(tag, i, xs):
        if (tag, i) not in errors:
            errors[tag, i] = _new_errors(xs[0].numel(), world)
        return _simulated_compressed_allreduce(xs, *errors[tag, i], world)[0]

    for k, b in enumerate(_batches(world)):
        t = k + 1
        local = _worker_grads(model, p, b, world)
        variance_step = k <= ZO["var_freeze_step"] and t % vi == 0
        for i in range(len(v)):
            if k <= ZO["var_freeze_step"]:
                if variance_step:
                    g = [sum(gs[i] for gs in local) / world] * world
                    v[i] = B2 * v[i] + (1 - B2) * g[0] * g[0]
                else:
                    g = [compress("g", i, [gs[i] for gs in local])] * world
                for w in range(world):
                    m[w][i] = _ema(m[w][i], g[w])
                    p[w][i] = p[w][i] - LR * (m[w][i] / (v[i].sqrt() + EPS) + WD * p[w][i])
            else:
                denom = v[i].sqrt() + EPS
                for w in range(world):
                    m[w][i] = _ema(m[w][i], local[w][i])
                    step = -LR * (m[w][i] / denom + WD * p[w][i])
                    p[w][i], buf[w][i] = p[w][i] + step, buf[w][i] + step
                if t % lsi == 0:
                    avg = compress("local", i, [buf[w][i] * denom for w in range(world)])
                    for w in range(world):
                        p[w][i] = p[w][i] - buf[w][i] + avg / denom
                        m[w][i] = -avg / (lrs + LR)
                        buf[w][i] = torch.zeros_like(buf[w][i])
        if variance_step:
            vc += 1
            if vc == ZO["var_update_scaler"]:
                vc, vi = 0, vi * 2
        if k > ZO["var_freeze_step"]:
            lrs = 0.0 if t % lsi == 0 else lrs + LR
            lsc += 1
            if lsc == ZO["local_step_scaler"]:
                lsc, lsi = 0, min(ZO["local_step_clipper"], lsi * 2)
        out.append([dict(zip(names, [x.clone() for x in p[w]])) for w in range(world)])
    return out


@pytest.mark.multirank
@pytest.mark.slow
def test_zero_one_adam_equals_a_simulation_of_the_workers(family):
    ref = _reference_zero_one(2)
    for k in range(STEPS):
        for rank in range(2):
            ft.assert_trees_close(family[rank]["zo"][k], ref[k][rank], rtol=1e-5, atol=1e-6,
                                  what=f"rank {rank}, update {k}")


def _reference_onebit_lamb(world: int, coeff_beta=0.9, factor_max=4.0, factor_min=0.5, threshold=0.1,
                           max_coeff=10.0, min_coeff=0.01):
    """1-bit LAMB (Li et al., 2021, Algorithm 1 as DeepSpeed's OnebitLamb runs it) over
    ``world`` simulated workers: LAMB's warm-up keeping a running trust ratio, then the scaled
    momenta of every leaf compressed as one tensor, and the frozen ratio times a clamped factor."""
    model = _model()
    names = [n for n, _ in model.named_parameters()]
    p = [q.detach().clone() for q in model.parameters()]
    m, v, fresh = ([torch.zeros_like(x) for x in p] for _ in range(3))
    frozen, last, scaling, errors, out = [0.0] * len(p), [1.0] * len(p), None, None, []
    for k, b in enumerate(_batches(world)):
        local = _worker_grads(model, [p] * world, b, world)
        if k < LAMB_FREEZE:
            for i in range(len(p)):
                g = sum(gs[i] for gs in local) / world
                m[i] = _ema(m[i], g)
                v[i] = B2 * v[i] + (1 - B2) * g * g
                if k + 1 == LAMB_FREEZE:
                    fresh[i] = v[i].clone()
                u = m[i] / (v[i].sqrt() + EPS) + WD * p[i]
                wn, un = float(p[i].norm()), float(u.norm())
                c = min(max(wn / un, min_coeff), max_coeff) if wn and un else 1.0
                if c != 1.0:
                    frozen[i] = coeff_beta * frozen[i] + (1 - coeff_beta) * c
                p[i] = p[i] - LR * c * u
            out.append(dict(zip(names, [x.clone() for x in p])))
            continue
        if scaling is None:
            scales = [float(x.norm()) / math.sqrt(x.numel()) for x in m]
            scaling = [sum(scales) / len(scales) / s for s in scales]
        # concatenated in the pytree's leaf order (sorted key paths), fzero's order of the leaves
        order = sorted(range(len(p)), key=lambda i: names[i])
        flats = [torch.cat([(_ema(m[i], gs[i]) * scaling[i]).reshape(-1) for i in order]) for gs in local]
        if errors is None:
            errors = _new_errors(flats[0].numel(), world)
        flat = _simulated_compressed_allreduce(flats, *errors, world)[0]
        parts = dict(zip(order, flat.split([m[i].numel() for i in order])))
        new_m = [parts[i].reshape(m[i].shape) / scaling[i] for i in range(len(p))]
        for i in range(len(p)):
            rebuilt = (new_m[i] - m[i] * B1) / (1 - B1)
            fresh[i] = B2 * fresh[i] + (1 - B2) * rebuilt * rebuilt
            denom = v[i].sqrt() + EPS
            prelim = new_m[i] / denom
            u = prelim + WD * p[i]
            factor = float((denom / (fresh[i].sqrt() + EPS)).max())
            ratio = min(1.0, float(prelim.norm()) / float(u.norm()))
            factor = factor * ratio + (1.0 - ratio)
            factor = min(max(factor, factor_min), factor_max)
            factor = min(max(factor, last[i] * (1 - threshold)), last[i] * (1 + threshold))
            last[i] = factor
            p[i] = p[i] - LR * frozen[i] * factor * u
        m = new_m
        out.append(dict(zip(names, [x.clone() for x in p])))
    return out


@pytest.mark.multirank
@pytest.mark.slow
def test_onebit_lamb_equals_a_simulation_of_the_workers(family):
    ref = _reference_onebit_lamb(2)
    for k in range(STEPS):
        ft.assert_trees_close(family[0]["lamb1"][k], ref[k], rtol=1e-5, atol=1e-6, what=f"update {k}")


def _under_device_check(check: bool):
    """Each of the family through compile(precision="fp16", accumulate=2, clip_norm=) past its
    warm-up, with or without the device check (every tensor a collective is handed made on the
    mesh's device, as NCCL needs): the losses and the parameters."""
    from fzero.distributed import device_check

    out = {}
    for name, make in [("onebit_adam", lambda: optim.onebit_adam(LR, freeze_step=2)),
                       ("zero_one_adam", lambda: optim.zero_one_adam(LR, var_freeze_step=2, var_update_scaler=1,
                                                                     local_step_scaler=1, local_step_clipper=2)),
                       ("onebit_lamb", lambda: optim.onebit_lamb(LR, freeze_step=2))]:
        with device_check.pretend() if check else contextlib.nullcontext():
            mesh = fzero.Mesh(dp=-1)
            apply, params = fzero.functionalize(_model())
            step = fzero.compile(ft.mse_step, mesh, precision="fp16", accumulate=2, clip_norm=1.0)
            state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=make()))
            losses, g = [], torch.Generator().manual_seed(7)
            for _ in range(6):
                b = {"x": torch.randn(4 * mesh.world_size, MODEL[0], generator=g),
                     "y": torch.randn(4 * mesh.world_size, MODEL[3], generator=g)}
                state, m = step(state, ft.local_batch(b, mesh.world_size, mesh.rank))
                losses.append(m["loss"].item())
            assert optim.exchange_of(state.tx, state.opt_state).local_gradients, name  # past the warm-up
            out[name] = (losses, {k: v.clone() for k, v in state.params.items()})
    return out


@pytest.mark.multirank
@pytest.mark.slow
def test_the_compressed_exchange_hands_collectives_device_tensors_only(ranks):
    pool = ranks(2)
    checked, plain = pool.run(_under_device_check, True), pool.run(_under_device_check, False)
    for mine, ref in zip(checked, plain):
        for name in ref:
            assert mine[name][0] == ref[name][0], name  # the check changes no number
            assert all(torch.equal(mine[name][1][k], v) for k, v in ref[name][1].items()), name


def _formula(numels: list[int], world: int) -> int:
    """docs/optim.md: (N - 1) (2 B + 8 T), B = sum_i P_i / (8 N) over the T tensors exchanged."""
    return (world - 1) * (2 * sum(_padded(n, world) // (8 * world) for n in numels) + 8 * len(numels))


@pytest.mark.multirank
@pytest.mark.slow
def test_the_bytes_of_zero_one_adam_and_onebit_lamb_are_the_formula(family):
    numels = [p.numel() for p in _model().parameters()]
    # 1-bit LAMB: one tensor, every leaf's momentum concatenated
    assert [s["compressed"] for s in family[0]["lamb1_sent"]] == \
        [0] * LAMB_FREEZE + [_formula([sum(numels)], 2)] * (STEPS - LAMB_FREEZE)
    assert all(s["gradients"] == 0 for s in family[0]["lamb1_sent"][LAMB_FREEZE:])
    # 0/1 Adam: variance steps all-reduce the gradients, the others compress them; the local
    # steps send nothing but at a synchronisation (updates 5 and 7 here)
    kinds = ["gradients" if s["gradients"] else "compressed" if s["compressed"] else "none"
             for s in family[0]["zo_sent"]]
    assert kinds == ["gradients", "gradients", "compressed", "gradients", "compressed", "compressed", "none",
                     "compressed"]
    assert {s["compressed"] for s in family[0]["zo_sent"] if s["compressed"]} == {_formula(numels, 2)}


def test_signs_pack_eight_to_a_byte_and_come_back():
    from fzero.distributed.compressed import pack_signs, padded_numel, unpack_signs

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3 * 64, generator=g)
    x[::7] = 0.0  # a zero is +1, as DeepSpeed's sign().add_(1).bool() makes it
    packed = pack_signs(x >= 0)
    assert packed.dtype == torch.uint8 and packed.numel() == x.numel() // 8
    assert torch.equal(unpack_signs(packed), torch.where(x >= 0, 1.0, -1.0))
    for world in range(1, 7):
        for n in (1, 7, 8, 63, 1000):
            p = padded_numel(n, world)
            assert p >= n and p % world == 0 and (p // world) % 8 == 0 and p - n < world * math.lcm(world, 8)
