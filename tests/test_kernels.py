"""fzero_kernels: every Triton kernel against its torch reference, on CPU under Triton's
interpreter (``TRITON_INTERPRET=1``), plus the references against torch.optim.

Triton fixes interpreted-or-compiled when it is first imported, so this module imports it
with ``TRITON_INTERPRET=1`` and then restores the environment: tests in other modules keep
running the torch reference on CPU tensors; the ``_interpreter`` fixture switches the
interpreter on for the tests here only.
"""
from __future__ import annotations

import doctest
import os
import subprocess
import sys
import textwrap

from harness.interpreted import import_triton_interpreted

import_triton_interpreted()

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fzero.testing as ft  # noqa: E402
import fzero_kernels as fk  # noqa: E402
from fzero_kernels import _common  # noqa: E402

if not fk.HAS_TRITON:
    _SKIP_KERNELS = "triton is not installed: only the torch references are tested"
elif not _common.triton_interpreted():
    _SKIP_KERNELS = "triton was imported in compiled mode before this module could set TRITON_INTERPRET=1"
else:
    _SKIP_KERNELS = ""
needs_triton = pytest.mark.skipif(bool(_SKIP_KERNELS), reason=_SKIP_KERNELS or "-")
# numpy, inside the interpreter, warns when a test overflows fp16/bf16 or adds inf/nan on purpose.
pytestmark = [pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]

# Tolerances: the rows "kernel state", "kernel sumsq", "kernel norm" and "kernel lamb" of the
# one table (fzero/testing/tolerances.py), with the measurements behind them.
# Exact (bit for bit): lowp_param vs the cast of the kernel's own new param; the flags;
# unscale_and_check_ vs grad.div_(scale); the references vs torch.optim over 5 steps.

SIZES = [1, 7, 1000, 4097]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SCALES = [1.0, 1024.0]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
LAMB_HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01)
LION_HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.99, weight_decay=0.01)
SMALL = settings(max_examples=10, deadline=None, derandomize=True)


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(_common.BACKEND_ENV, raising=False)


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 256 and chunks of 512 elements: many programs, several per segment."""
    monkeypatch.setattr(_common, "elementwise_config", lambda n: (256, 4))
    monkeypatch.setattr(_common, "REDUCTION_BLOCKS", 2)


# --------------------------------------------------------------------------- helpers
def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _grad(n, dtype, scale, seed):
    return (torch.randn(n, generator=_gen(seed)) * scale).to(dtype)


def _state(n, seed, k=3):
    g = _gen(seed)
    out = [torch.randn(n, generator=g)]  # param
    if k >= 2:
        out.append(torch.randn(n, generator=g) * 0.1)  # exp_avg / momentum
    if k >= 3:
        out.append(torch.rand(n, generator=g) * 0.01)  # exp_avg_sq
    return out


def _lowp_dtype(grad_dtype):
    return torch.float16 if grad_dtype == torch.float16 else torch.bfloat16


def _clone(ts):
    return [t.clone() for t in ts]


def _close(got, want, kind="state"):
    torch.testing.assert_close(got, want, **ft.tolerance(f"kernel {kind}"), equal_nan=True)


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _assert_lowp_is_cast(lowp, param):
    want = param.to(lowp.dtype)
    nan = torch.isnan(param)
    assert torch.equal(torch.isnan(lowp), nan)
    assert torch.equal(_bits(lowp)[~nan], _bits(want)[~nan])


def _run_both(kernel, reference, tensors, *, lowp_param=None, **kw):
    """Run ``kernel`` and ``reference`` on copies of ``tensors`` (and of lowp_param)."""
    a, b = _clone(tensors), _clone(tensors)
    la = lb = None
    if lowp_param is not None:
        la, lb = lowp_param.clone(), lowp_param.clone()
    fa = kernel(*a, lowp_param=la, **kw)
    fb = reference(*b, lowp_param=lb, **kw)
    return a, b, fa, fb, la, lb


# --------------------------------------------------------------------------- AdamW / Adam
@needs_triton
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("gdtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_adamw_matches_reference(n, gdtype, scale):
    p, m, v = _state(n, seed=n)
    g = _grad(n, gdtype, scale, seed=n + 1)
    lowp = torch.empty(n, dtype=_lowp_dtype(gdtype))
    before = _common.CALLS[("fzero_kernels.adamw_", "triton")]
    (pa, _, ma, va), (pb, _, mb, vb), fa, fb, la, lb = _run_both(
        fk.adamw_, fk.adamw_reference, [p, g, m, v], **HYPER, step=3, grad_scale=scale, lowp_param=lowp)
    assert _common.CALLS[("fzero_kernels.adamw_", "triton")] == before + 1
    for got, want in ((pa, pb), (ma, mb), (va, vb)):
        _close(got, want)
    assert fa.shape == () and fa.dtype == torch.float32 and fa.item() == fb.item() == 0.0
    _assert_lowp_is_cast(la, pa)


@needs_triton
@pytest.mark.parametrize("gdtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("n", [7, 4097])
def test_adam_l2_matches_reference(n, gdtype):
    p, m, v = _state(n, seed=2 * n)
    g = _grad(n, gdtype, 1.0, seed=3)
    (pa, _, ma, va), (pb, _, mb, vb), *_ = _run_both(fk.adam_, fk.adam_reference, [p, g, m, v], **HYPER, step=1)
    for got, want in ((pa, pb), (ma, mb), (va, vb)):
        _close(got, want)


@needs_triton
@SMALL
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**16), gdtype=st.sampled_from(GRAD_DTYPES),
       scale=st.sampled_from(SCALES), step=st.integers(1, 1000), tensor_scale=st.booleans())
def test_adamw_random_sizes(n, seed, gdtype, scale, step, tensor_scale):
    p, m, v = _state(n, seed)
    g = _grad(n, gdtype, scale, seed + 1)
    gs = torch.tensor(scale) if tensor_scale else scale
    (pa, _, ma, va), (pb, _, mb, vb), fa, fb, la, lb = _run_both(
        fk.adamw_, fk.adamw_reference, [p, g, m, v], **HYPER, step=step, grad_scale=gs,
        lowp_param=torch.empty(n, dtype=_lowp_dtype(gdtype)))
    for got, want in ((pa, pb), (ma, mb), (va, vb)):
        _close(got, want)
    _assert_lowp_is_cast(la, pa)


def test_adamw_reference_is_torch_adamw():
    """Bit for bit against torch.optim.AdamW / Adam (single-tensor and foreach) over 5 steps."""
    n = 500
    for cls, ref in ((torch.optim.AdamW, fk.adamw_reference), (torch.optim.Adam, fk.adam_reference)):
        for foreach in (False, True):
            p0, _ = _state(n, 5, k=2)
            p, q = p0.clone().requires_grad_(), p0.clone()
            m, v = torch.zeros(n), torch.zeros(n)
            opt = cls([p], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, foreach=foreach)
            for step in range(1, 6):
                g = torch.randn(n, generator=_gen(step))
                p.grad = g.clone()
                opt.step()
                ref(q, g, m, v, **HYPER, step=step)
            assert torch.equal(p.detach(), q)
            assert torch.equal(opt.state[p]["exp_avg"], m) and torch.equal(opt.state[p]["exp_avg_sq"], v)


@needs_triton
def test_adamw_kernel_tracks_torch_fused_adamw():
    n = 3000
    p0 = torch.randn(n, generator=_gen(0))
    p, q = p0.clone().requires_grad_(), p0.clone()
    m, v = torch.zeros(n), torch.zeros(n)
    opt = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, fused=True)
    for step in range(1, 4):
        g = torch.randn(n, generator=_gen(step))
        p.grad = g.clone()
        opt.step()
        fk.adamw_(q, g * 256, m, v, **HYPER, step=step, grad_scale=256.0)
    _close(q, p.detach())


# --------------------------------------------------------------------------- multi-tensor AdamW / Adam
MULTI_SIZES = [1, 17, 1000, _common.MULTI_CHUNK + 4465]  # the last takes two programs
MULTI_CASES = [  # (kernel, grad dtype, grad_scale, clip max_norm, found_inf, lowp, a nan gradient)
    ("adamw", torch.float32, 1.0, None, None, False, False),
    ("adamw", torch.bfloat16, 1024.0, None, None, True, False),
    ("adamw", torch.float16, "tensor", None, None, True, False),
    ("adamw", torch.bfloat16, "tensor", 0.5, None, True, False),
    ("adamw", torch.float32, 1024.0, 1e6, None, False, False),
    ("adamw", torch.float32, 1.0, None, 0.0, True, False),
    ("adamw", torch.bfloat16, 1.0, None, 1.0, True, False),
    ("adamw", torch.float32, 1.0, None, None, False, True),
    ("adamw", torch.bfloat16, 1.0, 0.5, None, True, True),
    ("adam", torch.float32, 1.0, None, None, False, False),
    ("adam", torch.bfloat16, "tensor", 0.5, 0.0, True, False),
]


def _multi_operands(sizes, gdtype, scale, lowp, nan, seed=0):
    states = [_state(n, seed + i) for i, n in enumerate(sizes)]
    s = 1024.0 if scale == "tensor" else scale
    grads = [_grad(n, gdtype, s, seed + 100 + i) for i, n in enumerate(sizes)]
    if nan:
        grads[-1][3] = float("nan")
    lowps = [torch.full((n,), 7.0, dtype=_lowp_dtype(gdtype)) for n in sizes] if lowp else None
    gs = torch.tensor(1024.0) if scale == "tensor" else scale
    return states, grads, lowps, gs


def _multi_kwargs(grads, gs, clip, found):
    kw = dict(**HYPER, step=3, grad_scale=gs)
    if clip is not None:
        kw.update(grad_sumsq=fk.sum_of_squares_reference(grads, grad_scale=gs), max_norm=clip)
    if found is not None:
        kw.update(found_inf=torch.tensor(found))
    return kw


@needs_triton
@pytest.mark.parametrize("case", MULTI_CASES, ids=lambda c: "-".join(str(x).replace("torch.", "") for x in c))
def test_multi_tensor_adamw_is_the_per_tensor_kernel_bit_for_bit(case):
    """One launch over tensors of sizes 1, 17, 1000 and one past a program's chunk gives
    every bit the per-tensor kernel gives (param, moments, lowp copy, flag), and the
    torch reference within the kernels' tolerance."""
    kind, gdtype, scale, clip, found, lowp, nan = case
    states, grads, lowps, gs = _multi_operands(MULTI_SIZES, gdtype, scale, lowp, nan)
    kw = _multi_kwargs(grads, gs, clip, found)
    multi, single, ref = (fk.adamw_multi_, fk.adamw_, fk.adamw_multi_reference) if kind == "adamw" else \
        (fk.adam_multi_, fk.adam_, fk.adam_multi_reference)
    a = [_clone(s) for s in states]
    la = _clone(lowps) if lowp else None
    before = _common.CALLS[(f"fzero_kernels.{kind}_multi_", "triton")]
    fa = multi([x[0] for x in a], grads, [x[1] for x in a], [x[2] for x in a], lowp_params=la, **kw)
    assert _common.CALLS[(f"fzero_kernels.{kind}_multi_", "triton")] == before + 1
    b = [_clone(s) for s in states]
    lb = _clone(lowps) if lowp else [None] * len(states)
    fb = [single(x[0], g, x[1], x[2], lowp_param=l, **kw) for x, g, l in zip(b, grads, lb)]
    for i, (x, y) in enumerate(zip(a, b)):
        for got, want in zip(x, y):
            assert torch.equal(_bits(got), _bits(want)), (case, MULTI_SIZES[i])
        if lowp:
            assert torch.equal(_bits(la[i]), _bits(lb[i])), (case, MULTI_SIZES[i])
    want_flag = max(f.item() for f in fb)
    assert fa.shape == () and fa.dtype == torch.float32 and fa.item() == want_flag == float(nan or clip is not None
                                                                                               and nan)
    c = [_clone(s) for s in states]
    lc = _clone(lowps) if lowp else None
    fc = ref([x[0] for x in c], grads, [x[1] for x in c], [x[2] for x in c], lowp_params=lc, **kw)
    assert fc.item() == fa.item()
    for x, y in zip(a, c):
        for got, want in zip(x, y):
            _close(got, want)
    if found or nan and clip is not None:  # skipped: every state bit kept
        for x, s in zip(a, states):
            for got, want in zip(x, s):
                assert torch.equal(_bits(got), _bits(want))
        assert la is None or all(torch.equal(_bits(x), _bits(y)) for x, y in zip(la, lowps))


@needs_triton
@SMALL
@given(sizes=st.lists(st.integers(0, 3000), min_size=1, max_size=6), seed=st.integers(0, 2**16),
       gdtype=st.sampled_from(GRAD_DTYPES))
def test_multi_tensor_adamw_random_sizes_and_small_chunks(sizes, seed, gdtype):
    """Chunks of 512 elements in blocks of 256: most tensors span several programs, and
    empty tensors none; still the per-tensor kernel's bits."""
    states, grads, lowps, gs = _multi_operands(sizes, gdtype, 1.0, True, False, seed)
    a, b, la, lb = [_clone(s) for s in states], [_clone(s) for s in states], _clone(lowps), _clone(lowps)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_common, "MULTI_CHUNK", 512)
        mp.setattr(_common, "elementwise_config", lambda n: (256, 4))
        fk.adamw_multi_([x[0] for x in a], grads, [x[1] for x in a], [x[2] for x in a], lowp_params=la, **HYPER,
                        step=2)
    for x, g, lp in zip(b, grads, lb):
        fk.adamw_(x[0], g, x[1], x[2], lowp_param=lp, **HYPER, step=2)
    for x, y, lx, ly in zip(a, b, la, lb):
        assert all(torch.equal(_bits(u), _bits(w)) for u, w in zip([*x, lx], [*y, ly])), sizes


@needs_triton
def test_multi_tensor_adamw_falls_back_once_when_the_kernel_does_not_build(monkeypatch):
    """A Triton that refuses the kernel (here: a stand-in raising as a build would) gives one
    RuntimeWarning naming the error; that call and later ones launch per tensor, same bits."""
    from fzero_kernels import adamw_multi

    class Refused:
        tries = 0

        def __getitem__(self, grid):
            Refused.tries += 1
            raise RuntimeError("int-to-pointer cast refused")

    monkeypatch.setattr(adamw_multi, "BROKEN", [])
    monkeypatch.setattr(adamw_multi, "_adam_multi_kernel", Refused())
    monkeypatch.setattr(adamw_multi, "_compiled", lambda: True)
    states, grads, _, _ = _multi_operands([5, 40], torch.float32, 1.0, False, False)
    want = [_clone(s) for s in states]
    for x, g in zip(want, grads):
        fk.adamw_(*x[:1], g, *x[1:], **HYPER, step=1)
    with pytest.warns(RuntimeWarning, match="failed to build .*int-to-pointer cast refused"):
        a = [_clone(s) for s in states]
        fk.adamw_multi_([x[0] for x in a], grads, [x[1] for x in a], [x[2] for x in a], **HYPER, step=1)
    before = _common.CALLS[("fzero_kernels.adamw_", "triton")]
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fk.adamw_multi_([x[0] for x in a], grads, [x[1] for x in a], [x[2] for x in a], **HYPER, step=2)
    assert Refused.tries == 1 and _common.CALLS[("fzero_kernels.adamw_", "triton")] == before  # not counted
    for x, g in zip(want, grads):
        fk.adamw_(*x[:1], g, *x[1:], **HYPER, step=2)
    for x, y in zip(a, want):
        assert all(torch.equal(u, w) for u, w in zip(x, y))


def test_multi_tensor_reference_is_adamw_reference_per_tensor():
    """Without the interpreter (the CPU's reference path): each tensor as adamw_reference
    updates it, bit for bit, and the flags or'ed."""
    states, grads, lowps, gs = _multi_operands([3, 50], torch.bfloat16, 1.0, True, True)
    with fk.force_backend("reference"):
        a, la = [_clone(s) for s in states], _clone(lowps)
        flag = fk.adamw_multi_([x[0] for x in a], grads, [x[1] for x in a], [x[2] for x in a], lowp_params=la,
                               **HYPER, step=4)
    b, lb = [_clone(s) for s in states], _clone(lowps)
    flags = [fk.adamw_reference(x[0], g, x[1], x[2], lowp_param=lp, **HYPER, step=4) for x, g, lp in zip(b, grads, lb)]
    assert flag.item() == 1.0 and [f.item() for f in flags] == [0.0, 1.0]
    for x, y, lx, ly in zip(a, b, la, lb):
        assert all(torch.equal(_bits(u), _bits(w)) for u, w in zip([*x, lx], [*y, ly]))


# --------------------------------------------------------------------------- LAMB
def _segments(n, seed, k):
    """k segment offsets over [0, n], some segments empty."""
    g = _gen(seed)
    cuts = sorted(torch.randint(0, n + 1, (k - 1,), generator=g).tolist())
    return (0, *cuts, n)


@needs_triton
@pytest.mark.parametrize("gdtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_lamb_matches_reference(n, gdtype, small_blocks):
    p, m, v = _state(n, seed=n)
    g = _grad(n, gdtype, 1024.0, seed=1)
    segs = _segments(n, seed=n, k=4)
    kw = dict(segments=segs, **LAMB_HYPER, step=2, grad_scale=1024.0)
    na = fk.lamb_partial_norms(p, g, m, v, **{k: kw[k] for k in kw if k != "lr"})
    nb = fk.lamb_partial_norms_reference(p, g, m, v, **{k: kw[k] for k in kw if k != "lr"})
    _close(na.param_sq, nb.param_sq, "sumsq")
    _close(na.update_sq, nb.update_sq, "sumsq")
    assert na.param_sq.dtype == torch.float64 and na.found_inf.item() == nb.found_inf.item() == 0.0
    lowp = torch.empty(n, dtype=_lowp_dtype(gdtype))
    (pa, _, ma, va), (pb, _, mb, vb), fa, fb, la, lb = _run_both(
        fk.lamb_, fk.lamb_reference, [p, g, m, v], **kw, lowp_param=lowp)
    for got, want in ((pa, pb), (ma, mb), (va, vb)):
        _close(got, want)
    _assert_lowp_is_cast(la, pa)


@needs_triton
@SMALL
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**16), k=st.integers(1, 6),
       gdtype=st.sampled_from(GRAD_DTYPES), scale=st.sampled_from(SCALES))
def test_lamb_random_sizes(n, seed, k, gdtype, scale):
    p, m, v = _state(n, seed)
    g = _grad(n, gdtype, scale, seed + 1)
    kw = dict(segments=_segments(n, seed, k), **LAMB_HYPER, step=1 + seed % 50, grad_scale=scale)
    (pa, _, ma, va), (pb, _, mb, vb), *_ = _run_both(fk.lamb_, fk.lamb_reference, [p, g, m, v], **kw)
    for got, want in ((pa, pb), (ma, mb), (va, vb)):
        _close(got, want)


def _lamb_by_hand(p, g, m, v, segs, lr, beta1, beta2, eps, weight_decay, step):
    """optax.lamb written out tensor by tensor (eps_root = 0)."""
    p, m, v = p.clone(), m.clone(), v.clone()
    for a, b in zip(segs[:-1], segs[1:]):
        m[a:b] = (1 - beta1) * g[a:b] + beta1 * m[a:b]
        v[a:b] = (1 - beta2) * g[a:b] ** 2 + beta2 * v[a:b]
        u = (m[a:b] / (1 - beta1 ** step)) / ((v[a:b] / (1 - beta2 ** step)).sqrt() + eps) + weight_decay * p[a:b]
        pn, un = p[a:b].norm(), u.norm()
        ratio = 1.0 if pn == 0 or un == 0 else pn / un
        p[a:b] = p[a:b] - lr * ratio * u
    return p, m, v


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_lamb_is_optax_lamb(backend):
    if backend == "triton" and _SKIP_KERNELS:
        pytest.skip(_SKIP_KERNELS)
    n, segs = 600, (0, 10, 10, 300, 600)
    p, m, v = _state(n, 9)
    p[10:300] = 0.0  # a tensor with zero norm: ratio 1
    g = torch.randn(n, generator=_gen(10))
    want = _lamb_by_hand(p, g, m, v, segs, **LAMB_HYPER, step=3)
    with fk.force_backend(backend):
        fk.lamb_(p, g, m, v, segments=segs, **LAMB_HYPER, step=3)
    for got, w in zip((p, m, v), want):
        torch.testing.assert_close(got, w, **ft.tolerance("kernel lamb"))


@needs_triton
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_lamb_zero_shards_sum_to_single_process(backend):
    """Two 'ranks' own halves of the buffer (the cut splits a tensor): partial norms with
    global tensor ids, summed (the all-reduce), then applied, equal one process's lamb_."""
    n, segs, cut = 1000, (0, 300, 700, 1000), 500
    p, m, v = _state(n, 4)
    g = _grad(n, torch.bfloat16, 1.0, 5)
    kw = dict(**{k: LAMB_HYPER[k] for k in LAMB_HYPER if k != "lr"}, step=2)
    full = _clone([p, m, v])
    with fk.force_backend(backend):
        fk.lamb_(full[0], g, full[1], full[2], segments=segs, lr=LAMB_HYPER["lr"], **kw)
        ranks = [(slice(0, cut), (0, 300, 500), (0, 1)), (slice(cut, n), (0, 200, 500), (1, 2))]
        parts = [fk.lamb_partial_norms(p[s], g[s], m[s], v[s], segments=o, tensor_ids=i, num_tensors=3, **kw)
                 for s, o, i in ranks]
        psq = parts[0].param_sq + parts[1].param_sq
        usq = parts[0].update_sq + parts[1].update_sq
        for s, o, i in ranks:
            fk.lamb_apply_(p[s], g[s], m[s], v[s], segments=o, tensor_ids=i, param_sq=psq, update_sq=usq,
                           lr=LAMB_HYPER["lr"], **kw)
    for got, want in zip((p, m, v), full):
        _close(got, want)


# --------------------------------------------------------------------------- Lion / SGD
@needs_triton
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("gdtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_lion_matches_reference(n, gdtype, scale):
    p, m = _state(n, seed=n, k=2)
    g = _grad(n, gdtype, scale, seed=7)
    lowp = torch.empty(n, dtype=_lowp_dtype(gdtype))
    (pa, _, ma), (pb, _, mb), fa, fb, la, _ = _run_both(
        fk.lion_, fk.lion_reference, [p, g, m], **LION_HYPER, grad_scale=scale, lowp_param=lowp)
    _close(pa, pb)
    _close(ma, mb)
    _assert_lowp_is_cast(la, pa)


def test_lion_reference_is_optax_lion():
    n = 500
    p, m = _state(n, 3, k=2)
    g = torch.randn(n, generator=_gen(4))
    b1, b2, lr, wd = 0.9, 0.99, 1e-3, 0.01
    want_p = p - lr * (torch.sign((1 - b1) * g + b1 * m) + wd * p)
    want_m = (1 - b2) * g + b2 * m
    fk.lion_reference(p, g, m, lr=lr, beta1=b1, beta2=b2, weight_decay=wd)
    torch.testing.assert_close(p, want_p, **ft.tolerance("kernel state"))
    torch.testing.assert_close(m, want_m, **ft.tolerance("kernel state"))


SGD_CASES = [
    dict(momentum=0.0),
    dict(momentum=0.9, step=1),
    dict(momentum=0.9, step=2, weight_decay=0.01),
    dict(momentum=0.9, step=2, nesterov=True),
    dict(momentum=0.9, step=1, dampening=0.3),
    dict(momentum=0.9, step=5, dampening=0.3, weight_decay=0.01),
]


@needs_triton
@pytest.mark.parametrize("case", SGD_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("n", [1, 4097])
def test_sgd_matches_reference(n, case):
    p, buf = _state(n, seed=n, k=2)
    for gdtype, scale in ((torch.float32, 1.0), (torch.bfloat16, 1024.0), (torch.float16, 1024.0)):
        g = _grad(n, gdtype, scale, seed=11)
        (pa, _, ba), (pb, _, bb), *_ , la, _ = _run_both(
            fk.sgd_, fk.sgd_reference, [p, g, buf], lr=0.1, **case, grad_scale=scale,
            lowp_param=torch.empty(n, dtype=_lowp_dtype(gdtype)))
        _close(pa, pb)
        _close(ba, bb)
        _assert_lowp_is_cast(la, pa)


@needs_triton
@SMALL
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**16), gdtype=st.sampled_from(GRAD_DTYPES),
       case=st.sampled_from(SGD_CASES), family=st.sampled_from(["sgd", "lion"]))
def test_sgd_lion_random_sizes(n, seed, gdtype, case, family):
    p, buf = _state(n, seed, k=2)
    g = _grad(n, gdtype, 1.0, seed + 1)
    if family == "sgd":
        (pa, _, ba), (pb, _, bb), *_ = _run_both(fk.sgd_, fk.sgd_reference, [p, g, buf], lr=0.1, **case)
    else:
        (pa, _, ba), (pb, _, bb), *_ = _run_both(fk.lion_, fk.lion_reference, [p, g, buf], **LION_HYPER)
    _close(pa, pb)
    _close(ba, bb)


def test_sgd_reference_is_torch_sgd():
    n = 500
    for case in SGD_CASES[1:]:
        kw = {k: val for k, val in case.items() if k != "step"}
        for foreach in (False, True):
            p0, _ = _state(n, 6, k=2)
            p, q, buf = p0.clone().requires_grad_(), p0.clone(), torch.empty(n)
            opt = torch.optim.SGD([p], lr=0.1, foreach=foreach, **kw)
            for step in range(1, 6):
                g = torch.randn(n, generator=_gen(step))
                p.grad = g.clone()
                opt.step()
                fk.sgd_reference(q, g, buf, lr=0.1, step=step, **kw)
            assert torch.equal(p.detach(), q) and torch.equal(opt.state[p]["momentum_buffer"], buf)


# --------------------------------------------------------------------------- norms, unscale
@needs_triton
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("gdtype", GRAD_DTYPES, ids=str)
def test_norms_match_reference(gdtype, scale, small_blocks):
    xs = [_grad(n, gdtype, scale, seed=n) for n in SIZES]
    for x in xs:
        _close(fk.sum_of_squares(x, grad_scale=scale), fk.sum_of_squares_reference(x, grad_scale=scale), "sumsq")
    got = fk.l2_norm(xs, grad_scale=scale)
    assert got.shape == () and got.dtype == torch.float32
    _close(got, fk.l2_norm_reference(xs, grad_scale=scale), "norm")
    want = torch.linalg.vector_norm(torch.cat([x.double() / scale for x in xs])).float()
    _close(got, want, "norm")
    flat = torch.cat(xs)
    segs = (0, 1, 8, 8, 1008, len(flat))
    kw = dict(segments=segs, grad_scale=torch.tensor(scale), tensor_ids=(2, 0, 1, 0, 3), num_tensors=4)
    _close(fk.segment_sum_of_squares(flat, **kw), fk.segment_sum_of_squares_reference(flat, **kw), "sumsq")


@needs_triton
@SMALL
@given(n=st.integers(1, 6000), seed=st.integers(0, 2**16), k=st.integers(1, 5),
       gdtype=st.sampled_from(GRAD_DTYPES), scale=st.sampled_from(SCALES))
def test_norms_random_sizes(n, seed, k, gdtype, scale):
    x = _grad(n, gdtype, scale, seed)
    _close(fk.l2_norm(x, grad_scale=scale), fk.l2_norm_reference(x, grad_scale=scale), "norm")
    kw = dict(segments=_segments(n, seed, k), grad_scale=scale)
    _close(fk.segment_sum_of_squares(x, **kw), fk.segment_sum_of_squares_reference(x, **kw), "sumsq")


@needs_triton
@pytest.mark.parametrize("scale", [1.0, 1024.0, 0.37])
@pytest.mark.parametrize("gdtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_unscale_and_check_is_div(n, gdtype, scale):
    x = _grad(n, gdtype, scale, seed=n)
    a, b = x.clone(), x.clone()
    fa = fk.unscale_and_check_(a, scale)
    fb = fk.unscale_and_check_reference(b, scale)
    assert torch.equal(_bits(a), _bits(b)) and torch.equal(_bits(a), _bits(x.div(scale)))
    assert fa.item() == fb.item() == 0.0
    assert fk.nonfinite_check(x, grad_scale=scale).item() == 0.0


@needs_triton
def test_unscale_overflow_is_flagged():
    """Dividing by a scale < 1 can overflow fp16/bf16: the flag checks the stored value."""
    for dtype, big in ((torch.float16, 60000.0), (torch.bfloat16, 3.0e38)):
        x = torch.tensor([1.0, big], dtype=dtype)
        a = x.clone()
        assert fk.unscale_and_check_(a, 0.5).item() == 1.0
        assert torch.isinf(a[1]) and fk.unscale_and_check_reference(x.clone(), 0.5).item() == 1.0
        assert fk.nonfinite_check(x).item() == 0.0


@needs_triton
def test_bf16_rounding_is_torch_cast():
    """lowp_param is param.to(bf16) bit for bit (round to nearest even, by integer ops in
    the kernel since the interpreter's cast truncates), over random bit patterns, ties,
    subnormals, the largest finite values, infinities, signed zeros and nan."""
    bits = torch.randint(-(2**31), 2**31 - 1, (4096,), generator=_gen(0), dtype=torch.int64).to(torch.int32)
    p = bits.view(torch.float32).clone()
    specials = [0.0, -0.0, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 3.3961e38, 3.4028234e38,
                -3.4028234e38, 1e-40, -1e-45, 65504.0, 65520.0, 6e-8, float("inf"), float("-inf"), float("nan")]
    p[: len(specials)] = torch.tensor(specials)
    for dtype in (torch.bfloat16, torch.float16):
        q, lowp = p.clone(), torch.empty(p.numel(), dtype=dtype)
        fk.sgd_(q, torch.zeros_like(q), lr=0.0, lowp_param=lowp)  # lr 0: param unchanged
        nan = torch.isnan(p)  # (nan + 0 may quiet a signalling nan's payload)
        assert torch.equal(torch.isnan(q), nan) and torch.equal(_bits(q)[~nan], _bits(p)[~nan])
        _assert_lowp_is_cast(lowp, p)


# --------------------------------------------------------------------------- non-finite gradients
def _family_calls(n, g, lowp):
    """(name, state tensors, call(**kw) -> flag) for each update kernel."""
    p, m, v = _state(n, 1)
    buf = m.clone()
    segs = (0, n // 3, n)
    return [
        ("adamw_", [p, m, v, lowp], lambda **kw: fk.adamw_(p, g, m, v, **HYPER, step=2, lowp_param=lowp, **kw)),
        ("adam_", [p, m, v, lowp], lambda **kw: fk.adam_(p, g, m, v, **HYPER, step=2, lowp_param=lowp, **kw)),
        ("lamb_", [p, m, v, lowp], lambda **kw: fk.lamb_(p, g, m, v, segments=segs, **LAMB_HYPER, step=2,
                                                         lowp_param=lowp, **kw)),
        ("lion_", [p, m, lowp], lambda **kw: fk.lion_(p, g, m, **LION_HYPER, lowp_param=lowp, **kw)),
        ("sgd_", [p, buf, lowp], lambda **kw: fk.sgd_(p, g, buf, lr=0.1, momentum=0.9, step=3, lowp_param=lowp,
                                                      **kw)),
    ]


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("gdtype", GRAD_DTYPES, ids=str)
def test_nonfinite_flag_and_skip(gdtype, bad, backend):
    """A non-finite gradient sets the flag; passing a set flag as found_inf (the caller
    skipping), or the non-finite sum of squares as grad_sumsq (clipping), leaves every state
    tensor bit-identical; a zero found_inf writes as usual."""
    if backend == "triton" and _SKIP_KERNELS:
        pytest.skip(_SKIP_KERNELS)
    n = 1500
    g = _grad(n, gdtype, 1024.0, 2)
    g[777] = bad
    lowp = torch.zeros(n, dtype=_lowp_dtype(gdtype))
    with fk.force_backend(backend):
        sumsq = fk.sum_of_squares(g, grad_scale=1024.0)
        assert not torch.isfinite(sumsq)
        for name, state, call in _family_calls(n, g, lowp):
            check = fk.nonfinite_check(g)  # pass 1: the check, no writes
            assert check.item() == 1.0, name
            before = _clone(state)
            for skip in (dict(found_inf=check), dict(grad_sumsq=sumsq, max_norm=1.0)):
                flag = call(grad_scale=1024.0, **skip)  # pass 2: skipped
                assert flag.shape == () and flag.item() == 1.0, (name, skip)
                for t, b in zip(state, before):
                    assert torch.equal(_bits(t), _bits(b)), (name, skip)
            call(found_inf=torch.tensor(0.0))  # not skipped: writes (nan/inf spread into param)
            assert not torch.equal(_bits(state[0]), _bits(before[0])), name
    gf = g.float().nan_to_num(0.0, 0.0, 0.0)
    with fk.force_backend(backend):
        assert fk.nonfinite_check(gf).item() == 0.0
        assert not torch.isfinite(fk.l2_norm(g))


# --------------------------------------------------------------------------- clip by global norm
@needs_triton
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("max_norm", [0.5, 1e6])  # clipping, and not (coefficient 1)
def test_clip_matches_reference(gdtype, max_norm):
    n = 1000
    g = _grad(n, gdtype, 1024.0, 3)
    scale = torch.tensor(1024.0)
    sumsq = fk.sum_of_squares(g, grad_scale=scale)
    clip = dict(grad_scale=scale, grad_sumsq=sumsq, max_norm=max_norm)
    p, m, v = _state(n, 4)
    lowp = torch.empty(n, dtype=torch.bfloat16)
    cases = [
        (fk.adamw_, fk.adamw_reference, [p, g, m, v], dict(**HYPER, step=2)),
        (fk.adam_, fk.adam_reference, [p, g, m, v], dict(**HYPER, step=2)),
        (fk.lamb_, fk.lamb_reference, [p, g, m, v], dict(segments=(0, 300, n), **LAMB_HYPER, step=2)),
        (fk.lion_, fk.lion_reference, [p, g, m], dict(**LION_HYPER)),
        (fk.sgd_, fk.sgd_reference, [p, g, m], dict(lr=0.1, momentum=0.9, step=2)),
    ]
    for kernel, reference, tensors, kw in cases:
        a, b, fa, fb, la, _ = _run_both(kernel, reference, tensors, lowp_param=lowp, **kw, **clip)
        for i, (x, y) in enumerate(zip(a, b)):
            if i != 1:
                _close(x, y)
        assert fa.item() == fb.item() == 0.0
        _assert_lowp_is_cast(la, a[0])


def test_clip_reference_is_torch_unscale_clip_step():
    """adamw_reference with grad_scale, grad_sumsq and max_norm equals torch's unscale
    (division), clip_grad_norm_ and AdamW, to the ulp of the norm's summation order."""
    n = 1000
    p0 = torch.randn(n, generator=_gen(1))
    g = torch.randn(n, generator=_gen(2)) * 1024.0
    p, q = p0.clone().requires_grad_(), p0.clone()
    m, v = torch.zeros(n), torch.zeros(n)
    opt = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, foreach=False)
    p.grad = g / 1024.0
    torch.nn.utils.clip_grad_norm_([p], 0.5)
    opt.step()
    sumsq = fk.sum_of_squares_reference(g, grad_scale=1024.0)
    fk.adamw_reference(q, g, m, v, **HYPER, step=1, grad_scale=1024.0, grad_sumsq=sumsq, max_norm=0.5)
    _close(q, p.detach())
    _close(m, opt.state[p]["exp_avg"])


# --------------------------------------------------------------------------- backend choice, import
def test_reference_runs_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    p, m, v = _state(10, 0)
    assert fk.backend_for(p) == "reference"
    before = dict(_common.CALLS)
    fk.adamw_(p, torch.randn(10), m, v, **HYPER, step=1)
    fk.l2_norm(p)
    assert _common.CALLS[("fzero_kernels.adamw_", "reference")] == before.get(("fzero_kernels.adamw_", "reference"), 0) + 1
    assert _common.CALLS[("fzero_kernels.adamw_", "triton")] == before.get(("fzero_kernels.adamw_", "triton"), 0)
    with pytest.raises(RuntimeError, match=r"fzero_kernels\.adamw_: the triton backend was forced but .*TRITON_INTERPRET"):
        with fk.force_backend("triton"):
            fk.adamw_(p, torch.randn(10), m, v, **HYPER, step=1)


@needs_triton
def test_backend_can_be_forced(monkeypatch):
    p = torch.zeros(3)
    assert fk.backend_for(p) == "triton"
    with fk.force_backend("reference"):
        assert fk.backend_for(p) == "reference"
    monkeypatch.setenv(_common.BACKEND_ENV, "reference")
    assert fk.backend_for(p) == "reference"
    monkeypatch.setenv(_common.BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match="fzero_kernels.l2_norm: backend must be one of"):
        fk.l2_norm(p)


_IMPORT_CHECK = textwrap.dedent("""
    import os, sys
    block = sys.argv[1] == "block"
    if block:
        sys.modules["triton"] = None  # as if triton were not installed
    os.environ.pop("TRITON_INTERPRET", None)
    import torch, fzero_kernels as fk, fzero  # noqa: F401
    assert "triton" not in sys.modules or sys.modules["triton"] is None, "importing imported triton"
    assert fk.HAS_TRITON is (not block)
    p, m, v = torch.ones(8), torch.zeros(8), torch.zeros(8)
    flag = fk.adamw_(p, torch.ones(8), m, v, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    assert torch.allclose(p, torch.full((8,), 0.9)) and flag.item() == 0.0
    assert "triton" not in sys.modules or sys.modules["triton"] is None, "a CPU step imported triton"
    if block:
        os.environ["TRITON_INTERPRET"] = "1"
        assert fk.backend_for(p) == "reference"
        fk.lamb_(p, torch.ones(8), m, v, segments=(0, 8), lr=0.1, beta1=0.9, beta2=0.999, eps=1e-6,
                 weight_decay=0.0, step=2)
        try:
            with fk.force_backend("triton"):
                fk.l2_norm(p)
        except RuntimeError as e:
            assert "triton is not installed" in str(e), e
        else:
            raise AssertionError("forcing triton without triton did not raise")
    print("ok")
""")


def test_import_and_step_without_triton():
    """fzero_kernels and fzero import and step on CPU with triton absent, and importing
    them (or a CPU step) never imports triton when it is present."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = [subprocess.Popen([sys.executable, "-c", _IMPORT_CHECK, mode], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env) for mode in ("block", "present")]
    for proc in procs:
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0 and out.strip().endswith("ok"), out


# --------------------------------------------------------------------------- input checks
@pytest.mark.parametrize("bad, message", [
    (dict(exp_avg=torch.zeros(999)), r"fzero_kernels\.adamw_: exp_avg has 999 elements, param has 1000"),
    (dict(grad=torch.zeros(1000, dtype=torch.float64)),
     r"fzero_kernels\.adamw_: grad has dtype float64, expected float32, bfloat16, float16"),
    (dict(param=torch.zeros(1000, dtype=torch.bfloat16)), r"fzero_kernels\.adamw_: param has dtype bfloat16"),
    (dict(exp_avg_sq=torch.zeros(2000)[::2]), r"fzero_kernels\.adamw_: exp_avg_sq must be contiguous"),
    (dict(param=torch.zeros(10, 100)), r"fzero_kernels\.adamw_: param must be 1-D \(a flat shard\), got shape \(10, 100\)"),
    (dict(step=0), r"fzero_kernels\.adamw_: step must be an int >= 1"),
    (dict(beta2=1.0), r"fzero_kernels\.adamw_: beta2 must be in \[0, 1\), got 1.0"),
    (dict(grad_scale=0.0), r"fzero_kernels\.adamw_: grad_scale must be positive and finite, got 0.0"),
    (dict(grad_scale=torch.ones(2)), r"fzero_kernels\.adamw_: grad_scale must be a float or a 1-element tensor"),
    (dict(lowp_param=torch.zeros(1000, dtype=torch.float16)[:999]),
     r"fzero_kernels\.adamw_: lowp_param has 999 elements, param has 1000"),
    (dict(lowp_param=torch.zeros(1000)), r"fzero_kernels\.adamw_: lowp_param has dtype float32, expected bfloat16, float16"),
    (dict(found_inf=torch.zeros(3)), r"fzero_kernels\.adamw_: found_inf must be None or a 1-element tensor"),
    (dict(max_norm=1.0), r"fzero_kernels\.adamw_: grad_sumsq and max_norm go together"),
    (dict(grad_sumsq=torch.ones(1), max_norm=-1.0), r"fzero_kernels\.adamw_: max_norm must be a positive finite"),
])
def test_adamw_input_errors(bad, message):
    args = dict(param=torch.zeros(1000), grad=torch.zeros(1000), exp_avg=torch.zeros(1000),
                exp_avg_sq=torch.zeros(1000), **HYPER, step=1)
    args.update(bad)
    with pytest.raises((TypeError, ValueError), match=message):
        fk.adamw_(**args)


@pytest.mark.parametrize("bad, message", [
    (dict(grads=[torch.zeros(4), torch.zeros(6)]), r"fzero_kernels\.adamw_multi_: grads\[1\] has 6 elements, params\[1\] has 5"),
    (dict(grads=[torch.zeros(4), torch.zeros(5, dtype=torch.bfloat16)]),
     r"fzero_kernels\.adamw_multi_: grads\[1\] has dtype bfloat16, grads\[0\] has float32: one launch takes one grads dtype"),
    (dict(exp_avgs=[torch.zeros(4)]), r"fzero_kernels\.adamw_multi_: exp_avgs has 1 tensors, params has 2"),
    (dict(exp_avg_sqs=[torch.zeros(4), torch.zeros(10)[::2]]),
     r"fzero_kernels\.adamw_multi_: exp_avg_sqs\[1\] must be contiguous"),
    (dict(params=[torch.zeros(4), torch.zeros(5, dtype=torch.float64)]),
     r"fzero_kernels\.adamw_multi_: params\[1\] has dtype float64"),
    (dict(params=[torch.zeros(4), torch.zeros(5, device="meta")]),
     r"fzero_kernels\.adamw_multi_: params\[1\] is on meta, params\[0\] is on cpu"),
    (dict(lowp_params=[torch.zeros(4, dtype=torch.bfloat16), torch.zeros(5, dtype=torch.float16)]),
     r"fzero_kernels\.adamw_multi_: lowp_params\[1\] has dtype float16, lowp_params\[0\] has bfloat16"),
    (dict(params=torch.zeros(9)), r"fzero_kernels\.adamw_multi_: params must be a list or tuple of tensors, got Tensor"),
    (dict(params=[], grads=[], exp_avgs=[], exp_avg_sqs=[]), r"fzero_kernels\.adamw_multi_: params is empty"),
    (dict(step=0), r"fzero_kernels\.adamw_multi_: step must be an int >= 1"),
])
def test_multi_tensor_input_errors(bad, message):
    args = dict(params=[torch.zeros(4), torch.zeros(5)], grads=[torch.zeros(4), torch.zeros(5)],
                exp_avgs=[torch.zeros(4), torch.zeros(5)], exp_avg_sqs=[torch.zeros(4), torch.zeros(5)],
                **HYPER, step=1)
    args.update(bad)
    with pytest.raises((TypeError, ValueError), match=message):
        fk.adamw_multi_(**args)


def test_other_input_errors():
    p = torch.zeros(10)
    with pytest.raises(ValueError, match=r"fzero_kernels\.lamb_partial_norms: segments must start at 0 and end at 10"):
        fk.lamb_partial_norms(p, p, p, p, segments=(0, 5, 9), beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0,
                              step=1)
    with pytest.raises(ValueError, match=r"fzero_kernels\.segment_sum_of_squares: segments must be non-decreasing"):
        fk.segment_sum_of_squares(p, segments=(0, 6, 4, 10))
    with pytest.raises(ValueError, match=r"tensor_ids needs num_tensors"):
        fk.segment_sum_of_squares(p, segments=(0, 10), tensor_ids=(0,))
    with pytest.raises(ValueError, match=r"fzero_kernels\.lamb_apply_: param_sq must be a 1-D float tensor of 2 sums"):
        fk.lamb_apply_(p, p, p, p, segments=(0, 4, 10), param_sq=torch.zeros(3), update_sq=torch.zeros(2),
                       lr=0.1, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0, step=1)
    with pytest.raises(ValueError, match=r"fzero_kernels\.sgd_: momentum=0.9 needs a momentum_buffer"):
        fk.sgd_(p, p, lr=0.1, momentum=0.9, step=1)
    with pytest.raises(ValueError, match=r"fzero_kernels\.sgd_: nesterov needs momentum > 0 and dampening == 0"):
        fk.sgd_(p, p, p.clone(), lr=0.1, momentum=0.9, dampening=0.1, nesterov=True, step=1)
    with pytest.raises(ValueError, match=r"fzero_kernels\.lion_: grad is on meta, param is on cpu"):
        fk.lion_(p, torch.zeros(10, device="meta"), p.clone(), **LION_HYPER)
    with pytest.raises(TypeError, match=r"fzero_kernels\.l2_norm_reference|fzero_kernels\.sum_of_squares_reference"):
        fk.l2_norm_reference([torch.zeros(3, dtype=torch.int32)])


def test_docstring_examples_run():
    import fzero_kernels._common as c
    import fzero_kernels.adamw as a
    import fzero_kernels.adamw_multi as am
    import fzero_kernels.lamb as la
    import fzero_kernels.lion as li
    import fzero_kernels.norm as no
    import fzero_kernels.sgd as s
    for mod in (c, a, am, la, li, no, s):
        for backend in (["auto", "reference"] if not _SKIP_KERNELS else ["reference"]):
            with fk.force_backend(backend):
                result = doctest.testmod(mod, optionflags=doctest.NORMALIZE_WHITESPACE)
            assert result.failed == 0, (mod.__name__, backend)
