"""fzero.optim: optimizers against torch.optim and reference formulas, masks, chains, errors.

Tolerances: rows of ``fzero.testing.TOLERANCES`` ("optimizer fp64 vs torch.optim",
"optimizer fp32 vs torch.optim" plus a slack, "fp64 vs numpy reference", "norm", "exact"),
each with its reason there.
"""

from __future__ import annotations

import copy
import dataclasses
import doctest
import re

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero.testing as ft
from fzero import optim, tree
from fzero.optim import _known, alias, base, clipping, transform
from fzero.core import collecting_metrics, installed

# The row of fzero.testing.TOLERANCES an optimizer is held to against torch.optim, by dtype.
VS_TORCH = {torch.float32: "optimizer fp32 vs torch.optim", torch.float64: "optimizer fp64 vs torch.optim"}

STEPS = 50
SETTINGS = settings(max_examples=25, deadline=None)


# --------------------------------------------------------------------------- strategies
# A small local strategy of random pytrees (dicts and lists) of random shapes.


@dataclasses.dataclass(frozen=True)
class _Shape:
    dims: tuple


_shapes = st.lists(st.integers(1, 4), min_size=0, max_size=3).map(lambda d: _Shape(tuple(d)))
_keys = st.sampled_from(["w", "b", "emb", "ln", "head", "blocks"])
_shape_trees = st.dictionaries(
    _keys,
    st.recursive(
        _shapes,
        lambda children: st.one_of(
            st.lists(children, min_size=1, max_size=3),
            st.dictionaries(_keys, children, min_size=1, max_size=3),
        ),
        max_leaves=6,
    ),
    min_size=1,
    max_size=3,
)


def _materialize(shape_tree, gen: torch.Generator, dtype=torch.float32, scale: float = 1.0):
    if isinstance(shape_tree, _Shape):
        return (torch.randn(shape_tree.dims, generator=gen, dtype=torch.float64) * scale).to(dtype)
    if isinstance(shape_tree, dict):
        return {k: _materialize(v, gen, dtype, scale) for k, v in shape_tree.items()}
    return [_materialize(v, gen, dtype, scale) for v in shape_tree]


@st.composite
def problems(draw, dtypes=(torch.float32, torch.float64)):
    """(params, [grads] * STEPS) of one random structure."""
    shape_tree = draw(_shape_trees)
    dtype = draw(st.sampled_from(dtypes))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    params = _materialize(shape_tree, gen, dtype)
    grads = [_materialize(shape_tree, gen, dtype) for _ in range(STEPS)]
    return params, grads


def _clone(t):
    return tree.map(lambda x: x.clone(), t)


def _run(tx, params, grads):
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = optim.apply_updates(params, updates)
    return params, state


def _run_torch(make_opt, params, grads, lr_schedule=None):
    leaves = [p.clone().requires_grad_(True) for p in tree.leaves(params)]
    opt = make_opt(leaves)
    for i, g in enumerate(grads):
        if lr_schedule is not None:
            for group in opt.param_groups:
                group["lr"] = lr_schedule(i)
        for p, gl in zip(leaves, tree.leaves(g)):
            p.grad = gl.clone()
        opt.step()
    return [p.detach() for p in leaves], opt


def _assert_matches_torch(ours_trees, make_opt, params, grads, lr_schedule=None, state_keys=()):
    """``ours_trees`` (final params, then one tree per torch state key) equal torch.optim's.

    To the table's row VS_TORCH[dtype]; in fp32 plus twice torch's own fp32 rounding error,
    measured by running torch.optim again in fp64 on the same values: rounding differs
    between any two fp32 implementations, and after 50 updates it exceeds 1e-6 by itself.
    """
    theirs, opt = _run_torch(make_opt, params, grads, lr_schedule)
    dtype = tree.leaves(params)[0].dtype
    to64 = lambda t: tree.map(lambda x: x.double(), t)  # noqa: E731
    if dtype == torch.float32:
        exact, opt64 = _run_torch(make_opt, to64(params), [to64(g) for g in grads], lr_schedule)
    refs = [(theirs, None if dtype != torch.float32 else exact)]
    for key in state_keys:
        refs.append(
            (
                [opt.state[p][key] for p in opt.param_groups[0]["params"]],
                None if dtype != torch.float32 else [opt64.state[p][key] for p in opt64.param_groups[0]["params"]],
            )
        )
    tol = ft.tolerance(VS_TORCH[dtype])
    for ours, (ref, ref64) in zip(ours_trees, refs):
        ours = tree.leaves(ours)
        assert len(ours) == len(ref)
        for i, (a, b) in enumerate(zip(ours, ref)):
            assert a.dtype == b.dtype
            bound = tol["atol"] + tol["rtol"] * b.double().abs()
            if ref64 is not None:
                bound = bound + 2 * (b.double() - ref64[i]).abs()
            excess = ((a.double() - b.double()).abs() - bound).max().item() if a.numel() else 0.0
            assert excess <= 0, f"leaf {i}: |ours - torch| exceeds the bound by {excess:.3g}\n{a}\n{b}"
    return opt


def _assert_leaves_close(ours_tree, theirs_leaves, **tol):
    ours = tree.leaves(ours_tree)
    assert len(ours) == len(theirs_leaves)
    for a, b in zip(ours, theirs_leaves):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol)


# --------------------------------------------------------------------------- torch.optim


@SETTINGS
@given(
    problems(),
    st.sampled_from([1e-3, 1e-2, 0.1]),
    st.sampled_from([0.0, 0.5, 0.9]),
    st.sampled_from([0.9, 0.99, 0.999]),
    st.sampled_from([1e-8, 1e-6, 1e-3]),
    st.sampled_from([0.0, 0.1]),
    st.booleans(),
)
def test_adam_matches_torch(problem, lr, b1, b2, eps, wd, foreach):
    params, grads = problem
    ours, state = _run(optim.adam(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd), params, grads)
    adam_state = state[1]
    assert int(adam_state.count) == STEPS
    _assert_matches_torch(
        (ours, adam_state.mu, adam_state.nu),
        lambda ps: torch.optim.Adam(ps, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, foreach=foreach),
        params,
        grads,
        state_keys=("exp_avg", "exp_avg_sq"),
    )


@SETTINGS
@given(
    problems(),
    st.sampled_from([1e-3, 1e-2, 0.1]),
    st.sampled_from([0.5, 0.9]),
    st.sampled_from([0.99, 0.999]),
    st.sampled_from([1e-8, 1e-3]),
    st.sampled_from([0.0, 1e-2, 0.3]),
    st.booleans(),
)
def test_adamw_matches_torch(problem, lr, b1, b2, eps, wd, foreach):
    params, grads = problem
    ours, _ = _run(optim.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd), params, grads)
    _assert_matches_torch(
        (ours,),
        lambda ps: torch.optim.AdamW(ps, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, foreach=foreach),
        params,
        grads,
    )


@SETTINGS
@given(
    problems(),
    st.sampled_from([1e-3, 1e-2, 0.1]),
    st.sampled_from([None, 0.0, 0.5, 0.9]),
    st.booleans(),
    st.sampled_from([0.0, 1e-2, 0.1]),
    st.booleans(),
)
def test_sgd_matches_torch(problem, lr, momentum, nesterov, wd, foreach):
    nesterov = nesterov and bool(momentum)
    params, grads = problem
    ours, _ = _run(optim.sgd(lr, momentum=momentum, nesterov=nesterov, weight_decay=wd), params, grads)
    _assert_matches_torch(
        (ours,),
        lambda ps: torch.optim.SGD(
            ps, lr=lr, momentum=momentum or 0.0, nesterov=nesterov, weight_decay=wd, foreach=foreach
        ),
        params,
        grads,
    )


def _schedule(count: int) -> float:
    return 0.1 * (count + 1) / (count + 10)


@SETTINGS
@given(problems(), st.sampled_from(["adam", "adamw", "sgd"]))
def test_schedules_as_learning_rates_match_torch(problem, kind):
    params, grads = problem
    sched = lambda count: _schedule(count)  # noqa: E731 - a lambda schedule, as users write them
    if kind == "adam":
        tx = optim.adam(sched, weight_decay=0.1)
        make = lambda ps: torch.optim.Adam(ps, lr=0.0, weight_decay=0.1)  # noqa: E731
    elif kind == "adamw":
        tx = optim.adamw(sched, weight_decay=0.1)
        make = lambda ps: torch.optim.AdamW(ps, lr=0.0, weight_decay=0.1)  # noqa: E731
    else:
        tx = optim.sgd(sched, momentum=0.9, nesterov=True, weight_decay=0.1)
        make = lambda ps: torch.optim.SGD(ps, lr=0.0, momentum=0.9, nesterov=True, weight_decay=0.1)  # noqa: E731
    ours, state = _run(tx, params, grads)
    _assert_matches_torch((ours,), make, params, grads, lr_schedule=_schedule)
    assert int(state[-1].count) == STEPS


def test_schedule_sees_zero_based_counts():
    seen = []
    tx = optim.sgd(lambda c: seen.append(c) or 1.0)
    params = {"w": torch.zeros(1)}
    _run(tx, params, [{"w": torch.ones(1)}] * 3)
    assert seen == [0, 1, 2]


# --------------------------------------------------------------------------- lamb, lion


def _np(t):
    return [x.numpy().astype(np.float64) for x in tree.leaves(t)]


def _lamb_reference(params, grads, lr, b1, b2, eps, eps_root, wd, mask):
    """optax.lamb: scale_by_adam, add_decayed_weights, scale_by_trust_ratio, -lr."""
    p = _np(params)
    mu = [np.zeros_like(x) for x in p]
    nu = [np.zeros_like(x) for x in p]
    for t, g_tree in enumerate(grads, start=1):
        g = _np(g_tree)
        rate = lr(t - 1) if callable(lr) else lr
        for i in range(len(p)):
            mu[i] = b1 * mu[i] + (1 - b1) * g[i]
            nu[i] = b2 * nu[i] + (1 - b2) * g[i] ** 2
            mu_hat = mu[i] / (1 - b1**t)
            nu_hat = nu[i] / (1 - b2**t)
            a = mu_hat / (np.sqrt(nu_hat + eps_root) + eps)
            if mask[i]:
                a = a + wd * p[i]
            p_norm, a_norm = np.linalg.norm(p[i]), np.linalg.norm(a)
            ratio = 1.0 if p_norm == 0 or a_norm == 0 else p_norm / a_norm
            p[i] = p[i] - rate * ratio * a
    return p


def _lion_reference(params, grads, lr, b1, b2, wd, mask):
    """optax.lion: scale_by_lion, add_decayed_weights, -lr."""
    p = _np(params)
    mu = [np.zeros_like(x) for x in p]
    for t, g_tree in enumerate(grads, start=1):
        g = _np(g_tree)
        rate = lr(t - 1) if callable(lr) else lr
        for i in range(len(p)):
            u = np.sign(b1 * mu[i] + (1 - b1) * g[i])
            mu[i] = b2 * mu[i] + (1 - b2) * g[i]
            if mask[i]:
                u = u + wd * p[i]
            p[i] = p[i] - rate * u
    return p


def _random_mask(params, seed):
    rng = np.random.default_rng(seed)
    return tree.map(lambda _: bool(rng.integers(2)), params)


def _assert_np_close(ours_tree, ref, **tol):
    for a, b in zip(tree.leaves(ours_tree), ref):
        torch.testing.assert_close(a, torch.as_tensor(np.asarray(b)), **tol)


@SETTINGS
@given(
    problems(dtypes=(torch.float64,)),
    st.sampled_from([1e-3, 1e-2, _schedule]),
    st.sampled_from([0.9, 0.5]),
    st.sampled_from([0.999, 0.99]),
    st.sampled_from([1e-6, 1e-3]),
    st.sampled_from([0.0, 1e-8]),
    st.sampled_from([0.0, 0.1]),
    st.one_of(st.none(), st.integers(0, 100)),
)
def test_lamb_matches_optax_definition(problem, lr, b1, b2, eps, eps_root, wd, mask_seed):
    params, grads = problem
    mask = None if mask_seed is None else _random_mask(params, mask_seed)
    tx = optim.lamb(lr, b1=b1, b2=b2, eps=eps, eps_root=eps_root, weight_decay=wd, mask=mask)
    ours, _ = _run(tx, params, grads)
    flags = [True] * len(tree.leaves(params)) if mask is None else tree.leaves(mask)
    ref = _lamb_reference(params, grads, lr, b1, b2, eps, eps_root, wd, flags)
    _assert_np_close(ours, ref, **ft.tolerance("fp64 vs numpy reference"))


@SETTINGS
@given(
    problems(dtypes=(torch.float64,)),
    st.sampled_from([1e-4, 1e-3, _schedule]),
    st.sampled_from([0.9, 0.5, 0.0]),
    st.sampled_from([0.99, 0.9]),
    st.sampled_from([0.0, 1e-3, 0.1]),
    st.one_of(st.none(), st.integers(0, 100)),
)
def test_lion_matches_optax_definition(problem, lr, b1, b2, wd, mask_seed):
    params, grads = problem
    mask = None if mask_seed is None else _random_mask(params, mask_seed)
    ours, _ = _run(optim.lion(lr, b1=b1, b2=b2, weight_decay=wd, mask=mask), params, grads)
    flags = [True] * len(tree.leaves(params)) if mask is None else tree.leaves(mask)
    ref = _lion_reference(params, grads, lr, b1, b2, wd, flags)
    _assert_np_close(ours, ref, **ft.tolerance("fp64 vs numpy reference"))


def test_lamb_and_lion_take_optax_defaults():
    assert optim.fused_spec_of(optim.lamb(1e-3)) == optim.FusedSpec("lamb", 1e-3, b1=0.9, b2=0.999, eps=1e-6,
                                                                     eps_root=0.0)
    assert optim.fused_spec_of(optim.lion(1e-3)) == optim.FusedSpec("lion", 1e-3, b1=0.9, b2=0.99, weight_decay=1e-3)


def test_trust_ratio_is_one_for_zero_params():
    tx = optim.scale_by_trust_ratio()
    p = {"w": torch.zeros(3), "b": torch.ones(2)}
    u = {"w": torch.ones(3), "b": torch.zeros(2)}
    out, _ = tx.update(u, tx.init(p), p)
    torch.testing.assert_close(out["w"], u["w"], **ft.tolerance("exact"))
    torch.testing.assert_close(out["b"], u["b"], **ft.tolerance("exact"))


# --------------------------------------------------------------------------- clipping


@SETTINGS
@given(problems(dtypes=(torch.float32,)), st.sampled_from([0.1, 1.0, 5.0, 1e3]), st.sampled_from([1e-3, 1.0, 10.0]))
def test_clip_by_global_norm_matches_torch(problem, max_norm, scale):
    _, grads = problem
    g = tree.map(lambda x: x * scale, grads[0])
    tx = optim.clip_by_global_norm(max_norm)
    before = _clone(g)
    with collecting_metrics() as metrics:
        ours, _ = tx.update(g, tx.init(g))
    theirs = [x.clone().requires_grad_(True) for x in tree.leaves(g)]
    for t in theirs:
        t.grad = t.detach().clone()
    total = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
    _assert_leaves_close(ours, [t.grad for t in theirs], **ft.tolerance("norm"))
    assert metrics["grad_norm"].dim() == 0
    torch.testing.assert_close(metrics["grad_norm"], total, **ft.tolerance("norm"))
    _assert_leaves_close(g, tree.leaves(before), **ft.tolerance("exact"))  # pure


def test_clip_by_global_norm_leaves_small_updates_alone():
    tx = optim.clip_by_global_norm(10.0)
    g = {"w": torch.tensor([3.0, 4.0])}
    with collecting_metrics() as metrics:
        out, _ = tx.update(g, tx.init(g))
    assert float(metrics["grad_norm"]) == 5.0
    torch.testing.assert_close(out["w"], g["w"], **ft.tolerance("exact"))


@SETTINGS
@given(problems(dtypes=(torch.float32,)), st.sampled_from([0.5, 100.0]))
def test_clip_norm_is_exact_on_shards(problem, max_norm):
    _, grads = problem
    g = grads[0]
    tx = optim.clip_by_global_norm(max_norm)
    full, _ = tx.update(g, tx.init(g))
    with collecting_metrics() as m_full:
        tx.update(g, ())
    a, b = ft.halves(g)
    rec_a, rec_b = ft.RecordPsum(), ft.RecordPsum()
    with installed(rec_a):
        tx.update(a, ())
    with installed(rec_b):
        tx.update(b, ())
    assert len(rec_a.calls) == 1 and rec_a.calls[0].dim() == 0  # one 0-dim partial sum
    with installed(ft.AddOtherShard(rec_b.calls)), collecting_metrics() as m_a:
        out_a, _ = tx.update(a, ())
    torch.testing.assert_close(m_a["grad_norm"], m_full["grad_norm"], **ft.tolerance("norm"))
    expect_a, _ = ft.halves(full)
    _assert_leaves_close(out_a, tree.leaves(expect_a), **ft.tolerance("norm"))


@SETTINGS
@given(problems(dtypes=(torch.float32,)))
def test_trust_ratio_is_exact_on_shards(problem):
    params, grads = problem
    tx = optim.scale_by_trust_ratio()
    full, _ = tx.update(grads[0], (), params)
    (pa, pb), (ga, gb) = ft.halves(params), ft.halves(grads[0])
    rec_b = ft.RecordPsum()
    with installed(rec_b):
        tx.update(gb, (), pb)
    assert len(rec_b.calls) == 1 and rec_b.calls[0].shape == (2 * len(tree.leaves(params)),)
    with installed(ft.AddOtherShard(rec_b.calls)):
        out_a, _ = tx.update(ga, (), pa)
    expect_a, _ = ft.halves(full)
    _assert_leaves_close(out_a, tree.leaves(expect_a), **ft.tolerance("norm"))


# --------------------------------------------------------------------------- masks


@SETTINGS
@given(problems(dtypes=(torch.float32,)), st.integers(0, 100), st.booleans())
def test_adamw_mask_matches_torch_param_groups(problem, mask_seed, as_callable):
    params, grads = problem
    grads = grads[:10]
    mask = _random_mask(params, mask_seed)
    tx = optim.adamw(1e-2, weight_decay=0.2, mask=(lambda p: mask) if as_callable else mask)
    ours, _ = _run(tx, params, grads)
    flags = tree.leaves(mask)

    def make(ps):
        decay = [p for p, f in zip(ps, flags) if f]
        rest = [p for p, f in zip(ps, flags) if not f]
        groups = [g for g in ({"params": decay, "weight_decay": 0.2}, {"params": rest, "weight_decay": 0.0}) if g["params"]]
        return torch.optim.AdamW(groups, lr=1e-2)

    _assert_matches_torch((ours,), make, params, grads)


@pytest.mark.parametrize("as_callable", [False, True])
def test_the_fused_step_reads_a_pytree_mask_once_and_calls_a_callable_every_update(as_callable, monkeypatch):
    """A mask is the optimizer's, fixed when made (optax's too): the step resolves a
    pytree mask once for the parameters' structure, not at every update, and calls a callable
    mask at every update; the parameters decay as torch's param groups say either way."""
    import fzero

    transform._MASK_FLAGS.values.clear()
    resolved, called = [], []
    real = transform._mask_flags
    monkeypatch.setattr(transform, "_mask_flags", lambda *a: resolved.append(1) or real(*a))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 3))
    reference = copy.deepcopy(model)
    flags = {n: p.dim() > 1 for n, p in model.named_parameters()}
    mask = (lambda p: called.append(1) or flags) if as_callable else flags
    apply, params = fzero.functionalize(model)
    step = fzero.compile(ft.mse_step)
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params,
                                              tx=optim.adamw(1e-2, weight_decay=0.5, mask=mask)))
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(8, 4, generator=g), "y": torch.randn(8, 3, generator=g)} for _ in range(4)]
    with optim.use_fused("on"):
        state, _ = ft.run_steps(step, state, batches)
    decay = [p for n, p in reference.named_parameters() if flags[n]]
    rest = [p for n, p in reference.named_parameters() if not flags[n]]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.5}, {"params": rest, "weight_decay": 0.0}], lr=1e-2)
    for b in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(reference(b["x"]), b["y"]).backward()
        opt.step()
    ft.assert_trees_close(dict(state.params), dict(reference.named_parameters()), tol="optimizer fp32 vs torch.optim")
    if as_callable:  # resolved at every call of it: each update's, and init's
        assert len(resolved) == len(called) >= 4, (resolved, called)
    else:  # once, whatever the number of updates
        assert len(resolved) == 1 and not called, (resolved, called)


def test_masked_passes_masked_out_leaves_through_unchanged():
    params = {"w": torch.randn(3), "b": torch.randn(2), "blocks": [torch.randn(2, 2)]}
    mask = {"w": True, "b": False, "blocks": [False]}
    tx = optim.masked(optim.scale_by_adam(), mask)
    state = tx.init(params)
    assert tree.leaves(state.inner_state.mu) and len(tree.leaves(state.inner_state.mu)) == 1
    grads = tree.map(torch.randn_like, params)
    out, _ = tx.update(grads, state, params)
    assert out["b"] is grads["b"] and out["blocks"][0] is grads["blocks"][0]
    assert not torch.equal(out["w"], grads["w"])


def test_mask_with_wrong_structure_names_the_key_path():
    params = {"w": torch.ones(2), "b": torch.ones(2)}
    tx = optim.adamw(1e-3, mask={"w": True, "bias": False})
    with pytest.raises(ValueError, match=r"^fzero\.optim\.adamw: mask does not have the structure of params") as e:
        tx.init(params)
    assert "['bias']" in str(e.value) and "['b']" in str(e.value)


@pytest.mark.parametrize("fused", ["off", "on"])
def test_a_callable_mask_over_params_with_frozen_entries_decays_as_torch_param_groups(fused):
    """``mask=lambda p: {k: v.ndim > 1 ...}`` on a model with a frozen weight: the callable
    sees the trainable parameters (no ``None`` for the frozen one), and training equals
    torch's AdamW with a decay group and a no-decay group, the frozen weight untouched."""
    import fzero

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    model[2].weight.requires_grad_(False)
    ref, frozen = copy.deepcopy(model), model[2].weight.detach().clone()
    apply, params = fzero.functionalize(model)
    seen = []

    def decay(p):
        seen.append(sorted(p))
        return {k: v.ndim > 1 for k, v in p.items()}

    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-2, weight_decay=0.3, mask=decay))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(5, 3, generator=g), torch.randn(5, 2, generator=g)) for _ in range(4)]
    with optim.use_fused(fused):
        step = fzero.compile(lambda s, b: (s.apply_gradients(fzero.grad(
            lambda p: torch.nn.functional.mse_loss(s.apply_fn(p, b[0]), b[1]))(s.params)), {}))
        state = step.init(state)
        for b in batches:
            state, _ = step(state, b)
    assert seen[0] == ["0.bias", "0.weight", "2.bias"]
    opt = torch.optim.AdamW([{"params": [ref[0].weight], "weight_decay": 0.3},
                             {"params": [ref[0].bias, ref[2].bias], "weight_decay": 0.0}], lr=1e-2)
    for x, y in batches:
        opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        opt.step()
    ft.assert_trees_close(fzero.gather(state.params), {k: v.detach() for k, v in ref.named_parameters()},
                          tol="optimizer fp32 vs torch.optim")
    assert torch.equal(state.params["2.weight"], frozen)


def test_a_mask_by_name_over_params_with_frozen_entries_names_what_is_missing():
    import fzero

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model[1].weight.requires_grad_(False)
    apply, params = fzero.functionalize(model)
    ok = optim.adamw(1e-2, mask={"0.weight": True, "0.bias": False, "1.bias": False, "1.weight": True})
    fzero.TrainState.create(apply_fn=apply, params=params, tx=ok)  # a frozen name's flag is ignored
    bad = optim.adamw(1e-2, mask=lambda p: {"0.weight": True, "1.biass": False})
    with pytest.raises(tree.StructureError, match=re.escape(
            "fzero.optim.adamw: mask does not have the structure of params: it has no flag for the trainable "
            "parameters ['0.bias', '1.bias'] and flags for ['1.biass'], which are not parameters (frozen, so "
            "never decayed: ['1.weight'])")):
        fzero.TrainState.create(apply_fn=apply, params=params, tx=bad)


def test_mask_leaves_must_be_bools():
    params = {"w": torch.ones(2)}
    tx = optim.add_decayed_weights(0.1, mask={"w": "yes"})
    with pytest.raises(TypeError, match=r"^fzero\.optim\.add_decayed_weights: mask leaves must be bools.*got str at \['w'\]"):
        tx.init(params)


# --------------------------------------------------------------------------- chain, state


def test_chain_equals_applying_in_sequence():
    gen = torch.Generator().manual_seed(0)
    params = {"a": torch.randn(3, generator=gen), "b": [torch.randn(2, 2, generator=gen)]}
    grads = [tree.map(lambda x: torch.randn(x.shape, generator=gen) * 3, params) for _ in range(5)]
    clip, adamw = optim.clip_by_global_norm(1.0), optim.adamw(1e-2)
    tx = optim.chain(clip, adamw)
    ours, state = _run(tx, params, grads)
    p, s1, s2 = params, clip.init(params), adamw.init(params)
    for g in grads:
        u, s1 = clip.update(g, s1, p)
        u, s2 = adamw.update(u, s2, p)
        p = optim.apply_updates(p, u)
    _assert_leaves_close(ours, tree.leaves(p), **ft.tolerance("exact"))
    assert isinstance(state, tuple) and len(state) == 2
    names = [tree.keystr(path) for path in tree.paths(state)]
    assert "[1][0].mu['a']" in names and "[1][0].nu['b'][0]" in names


def test_state_counts_are_cpu_int64_and_moments_follow_params():
    params = {"w": torch.ones(2, dtype=torch.float64)}
    state = optim.adam(1e-3).init(params)
    adam_state = state[1]
    assert adam_state.count.dtype == torch.int64 and adam_state.count.device.type == "cpu"
    assert adam_state.count.dim() == 0
    assert adam_state.mu["w"].dtype == torch.float64
    _, state = optim.adam(1e-3).update({"w": torch.ones(2, dtype=torch.float64)}, state, params)
    assert int(state[1].count) == 1 and state[1].count.dtype == torch.int64


@pytest.mark.parametrize(
    "tx",
    [
        optim.adam(1e-2, weight_decay=0.1),
        optim.adamw(1e-2, weight_decay=0.1),
        optim.sgd(1e-2, momentum=0.9, nesterov=True, weight_decay=0.1),
        optim.lamb(1e-2, weight_decay=0.1),
        optim.lion(1e-2),
        optim.chain(optim.clip_by_global_norm(0.1), optim.adamw(_schedule)),
        optim.chain(optim.clip_by_global_norm(0.1), optim.lamb(1e-2, weight_decay=0.1, mask={"w": True, "b": [False]})),
        optim.chain(optim.trace(0.9), optim.scale(-0.1), optim.add_decayed_weights(0.1)),
        optim.chain(optim.sgd(0.1, momentum=0.9), optim.chain(optim.scale(2.0), optim.clip_by_global_norm(1.0))),
    ],
    ids=["adam", "adamw", "sgd", "lamb", "lion", "clip+adamw", "clip+masked-lamb", "trace+scale", "nested"],
)
def test_updates_are_pure(tx):
    gen = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(4, 3, generator=gen), "b": [torch.randn(3, generator=gen)]}
    state = tx.init(params)
    for _ in range(2):
        grads = tree.map(lambda x: torch.randn(x.shape, generator=gen), params)
        snap = _clone((grads, state, params))
        updates, new_state = tx.update(grads, state, params)
        new_params = optim.apply_updates(params, updates)
        for a, b in zip(tree.leaves((grads, state, params)), tree.leaves(snap)):
            torch.testing.assert_close(a, b, **ft.tolerance("exact"))
        state, params = new_state, new_params


def test_chain_never_overwrites_a_state_it_shares():
    # trace's update is its new state; the scale after it must not write into it.
    tx = optim.chain(optim.trace(0.5), optim.scale(2.0))
    g = [torch.ones(3)]
    updates, state = tx.update(g, tx.init(g))
    torch.testing.assert_close(updates[0], torch.full((3,), 2.0), **ft.tolerance("exact"))
    torch.testing.assert_close(state[0].trace[0], torch.ones(3), **ft.tolerance("exact"))


def test_fused_specs():
    sched = lambda c: 1e-3  # noqa: E731
    spec = optim.fused_spec_of(optim.adamw(sched, b2=0.95, weight_decay=0.1))
    assert (spec.kind, spec.learning_rate, spec.b1, spec.b2, spec.eps, spec.weight_decay) == ("adamw", sched, 0.9, 0.95, 1e-8, 0.1)
    assert optim.fused_spec_of(optim.adam(1e-3, weight_decay=0.1)).kind == "adam"
    sgd = optim.fused_spec_of(optim.sgd(0.1, momentum=0.9, nesterov=True))
    assert (sgd.kind, sgd.momentum, sgd.nesterov) == ("sgd", 0.9, True)
    # An optimizer is optax's pair and nothing more; what it is, is read from its members.
    assert optim.adamw(1e-3)._fields == optim.chain(optim.adamw(1e-3))._fields == ("init", "update")
    assert optim.fused_spec_of(optim.chain(optim.adamw(1e-3))) == optim.fused_spec_of(optim.adamw(1e-3))
    assert optim.fused_spec_of(optim.lion(1e-4)).kind == "lion"
    clipped = optim.fused_spec_of(optim.chain(optim.clip_by_global_norm(2.0), optim.lamb(1e-3)))
    assert (clipped.kind, clipped.clip_norm) == ("lamb", 2.0)
    assert optim.fused_spec_of(optim.chain(optim.scale(0.5), optim.adamw(1e-3))) is None
    assert optim.fused_spec_of(optim.scale(0.5)) is None
    # Equal specs hash alike, dict masks included.
    a, b = (optim.fused_spec_of(optim.adamw(1e-3, mask={"w": True})) for _ in range(2))
    assert a == b and hash(a) == hash(b)


def test_a_known_chain_is_recognised_by_its_members_whoever_chained_them():
    by_hand = optim.chain(optim.clip_by_global_norm(1.0), optim.scale_by_adam(b2=0.95),
                          optim.add_decayed_weights(0.1, mask={"w": True}), optim.scale_by_learning_rate(1e-3))
    spec = optim.fused_spec_of(by_hand)
    assert spec == optim.fused_spec_of(optim.chain(optim.clip_by_global_norm(1.0),
                                                   optim.adamw(1e-3, b2=0.95, weight_decay=0.1, mask={"w": True})))
    assert (spec.kind, spec.clip_norm, spec.mask) == ("adamw", 1.0, {"w": True})
    lamb = optim.chain(optim.scale_by_adam(), optim.add_decayed_weights(), optim.scale_by_trust_ratio(),
                       optim.scale_by_learning_rate(1e-3))
    assert optim.fused_spec_of(lamb).kind == "lamb"
    # Not the kernels' math: another trust ratio, an ascent step, eps_root outside LAMB, a
    # momentum of 0, a transformation of one's own.
    for tx in [optim.chain(optim.scale_by_adam(), optim.add_decayed_weights(), optim.scale_by_trust_ratio(min_norm=1.0),
                           optim.scale_by_learning_rate(1e-3)),
               optim.chain(optim.scale_by_adam(), optim.add_decayed_weights(),
                           optim.scale_by_learning_rate(1e-3, flip_sign=False)),
               optim.chain(optim.scale_by_adam(eps_root=1e-8), optim.add_decayed_weights(),
                           optim.scale_by_learning_rate(1e-3)),
               optim.chain(optim.add_decayed_weights(), optim.trace(0.0), optim.scale_by_learning_rate(1e-3)),
               optim.chain(optim.GradientTransformation(lambda p: optim.EmptyState(), lambda u, s, p=None: (u, s)),
                           optim.scale_by_adam(), optim.add_decayed_weights(), optim.scale_by_learning_rate(1e-3)),
               optim.masked(optim.adamw(1e-3), {"w": True})]:
        assert optim.fused_spec_of(tx) is None, tx


# --------------------------------------------------------------------------- apply_updates


def test_apply_updates_keeps_param_dtypes_and_rounds_once():
    p = {"h": torch.randn(64).to(torch.bfloat16), "f": torch.randn(64)}
    u = {"h": torch.randn(64) * 1e-2, "f": torch.randn(64, dtype=torch.float64)}
    before = _clone((p, u))
    out = optim.apply_updates(p, u)
    assert out["h"].dtype == torch.bfloat16 and out["f"].dtype == torch.float32
    torch.testing.assert_close(out["h"], (p["h"].float() + u["h"]).to(torch.bfloat16), **ft.tolerance("exact"))
    torch.testing.assert_close(out["f"], (p["f"].double() + u["f"]).float(), **ft.tolerance("exact"))
    for a, b in zip(tree.leaves((p, u)), tree.leaves(before)):
        torch.testing.assert_close(a, b, **ft.tolerance("exact"))


def test_apply_updates_same_dtype_is_plain_addition():
    p = [torch.randn(5), torch.randn(2, 3)]
    u = [torch.randn(5), torch.randn(2, 3)]
    out = optim.apply_updates(p, u)
    for o, a, b in zip(out, p, u):
        torch.testing.assert_close(o, a + b, **ft.tolerance("exact"))


def test_apply_updates_structure_mismatch_names_key_paths():
    with pytest.raises(ValueError, match=r"^fzero\.optim\.apply_updates: updates does not have the structure of params") as e:
        optim.apply_updates({"w": torch.ones(1), "b": torch.ones(1)}, {"w": torch.ones(1)})
    assert "['b']" in str(e.value)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "make, exc, pattern",
    [
        (lambda: optim.adamw("fast"), TypeError, r"^fzero\.optim\.adamw: learning_rate must be a float or a schedule .*got str 'fast'"),
        (lambda: optim.sgd(None), TypeError, r"^fzero\.optim\.sgd: learning_rate must be a float or a schedule .*got NoneType"),
        (lambda: optim.adam(-1e-3), ValueError, r"^fzero\.optim\.adam: learning_rate must be >= 0, got -0\.001"),
        (lambda: optim.adam(1e-3, eps=-1.0), ValueError, r"^fzero\.optim\.adam: eps must be >= 0, got -1\.0"),
        (lambda: optim.adamw(1e-3, b1=1.0), ValueError, r"^fzero\.optim\.adamw: b1 must lie in \[0, 1\), got 1\.0"),
        (lambda: optim.lamb(1e-3, b2="0.9"), TypeError, r"^fzero\.optim\.lamb: b2 must be a number, got str"),
        (lambda: optim.lion(1e-3, weight_decay=-0.1), ValueError, r"^fzero\.optim\.lion: weight_decay must be >= 0"),
        (lambda: optim.sgd(0.1, nesterov=True), ValueError, r"^fzero\.optim\.sgd: nesterov=True needs a momentum > 0"),
        (lambda: optim.sgd(0.1, momentum=1.5), ValueError, r"^fzero\.optim\.sgd: momentum must lie in \[0, 1\]"),
        (lambda: optim.clip_by_global_norm(0.0), ValueError, r"^fzero\.optim\.clip_by_global_norm: max_norm must be > 0, got 0\.0"),
        (lambda: optim.scale_by_adam(eps_root=-1), ValueError, r"^fzero\.optim\.scale_by_adam: eps_root must be >= 0"),
        (lambda: optim.scale_by_learning_rate([1e-3]), TypeError, r"^fzero\.optim\.scale_by_learning_rate: learning_rate must be"),
        (lambda: optim.scale_by_schedule(0.1), TypeError, r"^fzero\.optim\.scale_by_schedule: step_size_fn must be callable"),
        (lambda: optim.chain(optim.sgd(0.1), 3), TypeError, r"^fzero\.optim\.chain: argument 1 must be a GradientTransformation"),
        (lambda: optim.masked(optim.sgd, {}), TypeError, r"^fzero\.optim\.masked: inner must be a GradientTransformation"),
    ],
)
def test_constructor_errors(make, exc, pattern):
    with pytest.raises(exc, match=pattern):
        make()


def test_schedule_returning_no_number_names_the_count():
    tx = optim.adamw(lambda c: "warm" if c == 1 else 1e-3)
    params = {"w": torch.ones(1)}
    state = tx.init(params)
    _, state = tx.update(params, state, params)
    with pytest.raises(TypeError, match=r"^fzero\.optim\.adamw: the schedule must return a float, got str 'warm' at count 1"):
        tx.update(params, state, params)


def test_grads_with_wrong_structure_name_the_key_path():
    params = {"w": torch.ones(2), "b": torch.ones(2)}
    tx = optim.adamw(1e-3)
    state = tx.init(params)
    with pytest.raises(ValueError, match=r"^fzero\.optim\.adamw: updates does not have the structure") as e:
        tx.update({"w": torch.ones(2), "bias": torch.ones(2)}, state, params)
    assert "['bias']" in str(e.value)


def test_weight_decay_needs_params():
    tx = optim.adamw(1e-3)
    params = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match=r"^fzero\.optim\.adamw: needs the parameters"):
        tx.update(params, tx.init(params))


def test_chain_rejects_a_foreign_state():
    tx = optim.adamw(1e-3)
    with pytest.raises(ValueError, match=r"^fzero\.optim\.chain: the state must be the tuple of 3 states"):
        tx.update({"w": torch.ones(1)}, {}, {"w": torch.ones(1)})


# --------------------------------------------------------------------------- docs


@pytest.mark.parametrize("module", [optim, base, _known, transform, clipping, alias], ids=lambda m: m.__name__)
def test_docstring_examples_run(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
    assert result.attempted > 0


def test_public_names():
    for name in optim.__all__:
        assert hasattr(optim, name), name
    assert re.fullmatch(r"fzero\.optim\.schedules", optim.schedules.__name__)


# --------------------------------------------------------------------------- Adam without bias correction


@pytest.mark.parametrize("decoupled", [True, False], ids=["adamw", "adam"])
def test_adam_without_bias_correction_is_deepspeeds_fused_adam_formula(decoupled):
    """FusedAdam(bias_correction=False): u = m / (sqrt(v) + eps), decay decoupled (AdamW mode)
    or added to the gradient (L2), written here from DeepSpeed's formula in plain torch."""
    torch.manual_seed(0)
    lr, b1, b2, eps, wd = 1e-2, 0.8, 0.95, 1e-6, 0.1
    p0, grads = torch.randn(6, 5), [torch.randn(6, 5) for _ in range(5)]
    make = optim.adamw if decoupled else optim.adam
    tx = make(lr, b1, b2, eps, wd, bias_correction=False)
    assert optim.fused_spec_of(tx) is None  # the kernels correct the bias: the chain runs
    assert optim.fused_spec_of(make(lr, b1, b2, eps, wd)) is not None
    params, state = {"w": p0.clone()}, tx.init({"w": p0})
    p, m, v = p0.clone().double(), torch.zeros(6, 5, dtype=torch.float64), torch.zeros(6, 5, dtype=torch.float64)
    for g in grads:
        u, state = tx.update({"w": g}, state, params)
        params = optim.apply_updates(params, u)
        g = g.double() + (0.0 if decoupled else wd * p)
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (v.sqrt() + eps) + (wd * p if decoupled else 0.0))
    torch.testing.assert_close(params["w"], p.float(), rtol=1e-5, atol=1e-6)


def test_adam_bias_correction_false_from_a_config():
    import fzero

    cfg = fzero.Config.load({"train_micro_batch_size_per_gpu": 2, "optimizer": {
        "type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.1, "bias_correction": False}}})
    tx = cfg.make_optimizer()
    params = {"w": torch.ones(3)}
    ref = optim.adamw(1e-3, weight_decay=0.1, bias_correction=False)
    g = {"w": torch.tensor([1.0, -2.0, 3.0])}
    assert torch.equal(tx.update(g, tx.init(params), params)[0]["w"], ref.update(g, ref.init(params), params)[0]["w"])
    with pytest.raises(TypeError, match="fzero.optim.adam: bias_correction must be a bool"):
        optim.adam(1e-3, bias_correction=0)
