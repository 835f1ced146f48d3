"""No silent NaN, and bad input named: an update whose gradient is not finite is skipped
(the default), raises naming the gradient's key path, or is applied as plain PyTorch would;
a params leaf that is not a tensor, an integer parameter that would be trained and a
gradient of the wrong shape are each named by key path at world 1.

The reference for the skipped update is plain PyTorch: a module trained by
``torch.optim.AdamW`` on the clean batches only.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist

import fzero
from fzero import optim

NAN = float("nan")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _train_step(state, batch):
    x, y = batch
    loss, grads = fzero.value_and_grad(lambda p: (state.apply_fn(p, x) - y).pow(2).mean())(state.params)
    return state.apply_gradients(grads), {"loss": loss}


def _batches(n, bad_at=(), size=4):
    gen = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        x, y = torch.randn(size, 3, generator=gen), torch.randn(size, 2, generator=gen)
        if i in bad_at:
            x = x.clone()
            x[0, 0] = NAN
        out.append((x, y))
    return out


def _state(model):
    apply, params = fzero.functionalize(model)
    return fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-2, weight_decay=0.1))


def _snapshot(state):
    return {k: v.clone() for k, v in fzero.gather(state.params).items()}, int(state.step)


@pytest.mark.parametrize("donate,clip_norm", [(True, None), (False, None), (True, 0.5), (False, 0.5)])
def test_fp32_skips_a_non_finite_update_by_default_as_if_its_batch_were_not_there(donate, clip_norm):
    """With ``clip_norm`` the verdict is the clip's global norm, taken once for both."""
    module = _model()
    reference = copy.deepcopy(module)
    step = fzero.compile(_train_step, donate=donate, clip_norm=clip_norm)
    state = step.init(_state(module))
    batches = _batches(5, bad_at=(2,))
    skipped = []
    for i, batch in enumerate(batches):
        before = _snapshot(state)
        state, metrics = step(state, batch)
        skipped.append(bool(metrics["skipped"]))
        if i == 2:
            after = _snapshot(state)
            assert after[1] == before[1]  # state.step did not count the skipped update
            assert all(torch.equal(after[0][k], before[0][k]) for k in after[0])
    assert skipped == [False, False, True, False, False]
    assert int(state.step) == 4
    # plain PyTorch on the clean batches only
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    for i, (x, y) in enumerate(batches):
        if i == 2:
            continue
        opt.zero_grad()
        (reference(x) - y).pow(2).mean().backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), clip_norm)
        opt.step()
    got = fzero.gather(state.params)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-6, atol=1e-7)


def test_under_accumulation_one_bad_micro_batch_skips_the_whole_update():
    step = fzero.compile(_train_step, accumulate=2)
    state = step.init(_state(_model()))
    x, y = _batches(1, size=8)[0]
    x = x.clone()
    x[5, 1] = float("inf")  # in the second micro-batch
    before = _snapshot(state)
    state, metrics = step(state, (x, y))
    assert bool(metrics["skipped"]) and int(state.step) == 0
    after = _snapshot(state)
    assert all(torch.equal(after[0][k], before[0][k]) for k in after[0])


def test_raise_names_every_non_finite_gradient_and_changes_nothing():
    step = fzero.compile(_train_step, nonfinite="raise")
    state = step.init(_state(_model()))
    state, _ = step(state, _batches(1)[0])
    bad = _batches(1, bad_at=(0,))[0]
    before = _snapshot(state)
    with pytest.raises(fzero.NonFiniteGradientError) as e:
        step(state, bad)
    # x[0, 0] is NaN: every gradient downstream of the first layer's input is NaN
    assert e.value.paths == ["['0.bias']", "['0.weight']", "['2.bias']", "['2.weight']"]  # the tree's order
    assert "update 2" in str(e.value) and "grads['0.weight']" in str(e.value)
    after = _snapshot(state)
    assert after[1] == before[1] and all(torch.equal(after[0][k], before[0][k]) for k in after[0])
    # the state is still usable: the next clean batch steps from it
    state, metrics = step(state, _batches(1)[0])
    assert int(state.step) == 2


def test_only_the_non_finite_leaf_is_named():
    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(2, 1)
            self.b = torch.nn.Linear(2, 1)

        def forward(self, x):
            return self.a(x[:, :2]) + self.b(x[:, 2:])

    apply, params = fzero.functionalize(Two())
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))

    def train_step(state, x):
        loss, g = fzero.value_and_grad(lambda p: state.apply_fn(p, x).sum())(state.params)
        return state.apply_gradients(g), {"loss": loss}

    step = fzero.compile(train_step, nonfinite="raise")
    state = step.init(state)
    with pytest.raises(fzero.NonFiniteGradientError, match=re.escape("at grads['b.weight']; the state")):
        step(state, torch.tensor([[1.0, 2.0, float("inf"), 0.0]]))


def test_apply_lets_the_nan_through_as_plain_pytorch_does():
    step = fzero.compile(_train_step, nonfinite="apply")
    state = step.init(_state(_model()))
    state, metrics = step(state, _batches(1, bad_at=(0,))[0])
    assert "skipped" not in metrics and int(state.step) == 1
    assert torch.isnan(fzero.gather(state.params)["0.weight"]).any()


def test_mixed_precision_combinations():
    state = _state(_model())
    step = fzero.compile(_train_step, precision="bf16", nonfinite="raise")
    state = step.init(state)
    with pytest.raises(fzero.NonFiniteGradientError):
        step(state, _batches(1, bad_at=(0,))[0])
    with pytest.raises(ValueError, match="fp16's loss scaler"):
        fzero.compile(_train_step, precision="fp16", nonfinite="raise")
    with pytest.raises(ValueError, match="contradicts check_grad_overflow=True"):
        fzero.compile(_train_step, precision="bf16", nonfinite="apply")
    with pytest.raises(ValueError, match="nonfinite='sometimes'"):
        fzero.compile(_train_step, nonfinite="sometimes")


def _one_rank_nan(stage, mode, clip_norm=None):
    rank = dist.get_rank()
    step = fzero.compile(_train_step, zero=stage, nonfinite=mode, clip_norm=clip_norm)
    state = step.init(_state(_model()))
    batches = _batches(3, size=4)
    out = []
    for i, (x, y) in enumerate(batches):
        x = x[rank * 2:(rank + 1) * 2].clone()
        y = y[rank * 2:(rank + 1) * 2]
        if i == 1 and rank == 1:
            x[0, 0] = NAN
        try:
            state, metrics = step(state, (x, y))
            out.append(bool(metrics["skipped"]) if mode == "skip" else "applied")
        except fzero.NonFiniteGradientError as e:
            out.append(e.paths)
    return out, int(state.step), {k: v.clone() for k, v in fzero.gather(state.params).items()}


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("stage,clip_norm", [(0, None), (2, None), (3, None), (1, 0.5), (3, 0.5)])
def test_a_nan_on_one_rank_is_skipped_by_every_rank(ranks, stage, clip_norm):
    results = ranks(2).run(_one_rank_nan, stage, "skip", clip_norm)
    for skipped, count, _ in results:
        assert skipped == [False, True, False] and count == 2, skipped
    a, b = results[0][2], results[1][2]
    assert all(torch.equal(a[k], b[k]) for k in a)


def _scaled_step(state, batch):
    x, y, scale = batch
    loss, grads = fzero.value_and_grad(lambda p: scale * (state.apply_fn(p, x) - y).pow(2).mean())(state.params)
    return state.apply_gradients(grads), {"loss": loss}


def _counting_psums(stage, model, train_step, n, batch):
    """``n`` updates at ``stage`` on two ranks, each rank half of every batch
    (``batch(i, rank, x, y)`` gives update ``i``'s): what each update did and how many
    all-reduces the non-finite check made itself, the parameters and the buffers."""
    import fzero.transforms.finite as finite

    rank = dist.get_rank()
    calls, real = [], finite.psum
    finite.psum = lambda x: calls.append(1) or real(x)
    try:
        step = fzero.compile(train_step, zero=stage)
        state = step.init(_state(model))
        out = []
        for i, (x, y) in enumerate(_batches(n, size=4)):
            before = len(calls)
            state, metrics = step(state, batch(i, rank, x[rank * 2:(rank + 1) * 2].clone(), y[rank * 2:(rank + 1) * 2]))
            out.append((bool(metrics["skipped"]), len(calls) - before))
    finally:
        finite.psum = real
    return out, {k: v.clone() for k, v in fzero.gather(state.params).items()}, _buffers(state)


def _check_psums(stage, scale):
    """Three updates, the second's gradient on rank 1 scaled by ``scale`` (1e20: finite, its
    sum of squares not; NaN)."""
    return _counting_psums(stage, _model(), _scaled_step, 3, lambda i, rank, x, y: (
        x, y, torch.tensor(scale if i == 1 and rank == 1 else 1.0)))[:2]


@pytest.mark.slow
@pytest.mark.multirank
def test_zero_on_gloo_certifies_finite_gradients_without_an_all_reduce_of_the_check(ranks):
    """At stages 1-3 on gloo the reduction all-reduces, beside its reduce-scatter, whether
    any rank's local gradient had a sum of squares that is not finite: when none had, the
    check makes no all-reduce of its own; when one had, the exact count decides -- a NaN is
    skipped, finite gradients of 1e20 (sum of squares beyond fp32) are applied, as at stage 0,
    whose check is on the whole reduced gradient (same values to 1e-6)."""
    for stage in (1, 2, 3):
        for (steps, got), (ref_steps, ref) in zip(ranks(2).run(_check_psums, stage, 1e20),
                                                  ranks(2).run(_check_psums, 0, 1e20)):
            assert steps == [(False, 0), (False, 1), (False, 0)], (stage, steps)
            assert [s for s, _ in ref_steps] == [False, False, False]
            for k in ref:
                torch.testing.assert_close(got[k], ref[k], rtol=1e-6, atol=1e-6)
        for steps, _ in ranks(2).run(_check_psums, stage, NAN):
            assert steps == [(False, 0), (True, 1), (False, 0)], (stage, steps)


class _Frozen(torch.nn.Module):
    """What the certificate's handoff must see past: a frozen weight (no gradient piece), a
    weight tied to two places (one gradient), a float buffer and an integer one in forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = torch.nn.Linear(3, 8)
        self.stem.weight.requires_grad_(False)
        self.mid = torch.nn.Linear(8, 8)
        self.again = torch.nn.Linear(8, 8)
        self.again.weight = self.mid.weight
        self.head = torch.nn.Linear(8, 2)
        self.register_buffer("scale", torch.tensor(0.5))
        self.register_buffer("shift", torch.tensor(2, dtype=torch.int64))

    def forward(self, x):
        h = torch.tanh(self.stem(x)) * self.scale
        h = torch.tanh(self.again(torch.tanh(self.mid(h)))) + self.shift
        return self.head(h)


def _frozen_nan(stage):
    """Four updates, rank 1's half of the second holding a NaN."""
    def batch(i, rank, x, y):
        if i == 1 and rank == 1:
            x[0, 0] = NAN
        return x, y

    return _counting_psums(stage, _Frozen(), _train_step, 4, batch)


@pytest.mark.slow
@pytest.mark.multirank
def test_the_certificate_on_a_model_with_frozen_tied_weights_and_buffers_matches_plain_pytorch(ranks):
    """ZeRO 1-3 on gloo: the reduction's certificate covers the trainable pieces only (the
    frozen weight has none, the tied one one), a finite update makes no all-reduce of its
    own, the NaN update is skipped everywhere, and the result is torch.optim.AdamW's on the
    clean batches, whole, frozen weight and buffers as they were."""
    reference = _Frozen()
    opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    batches = _batches(4, size=4)
    for x, y in batches[:1] + batches[2:]:
        opt.zero_grad()
        (reference(x) - y).pow(2).mean().backward()
        opt.step()
    for stage in (1, 2, 3):
        for steps, got, buffers in ranks(2).run(_frozen_nan, stage):
            assert steps == [(False, 0), (True, 1), (False, 0), (False, 0)], (stage, steps)
            assert set(got) == {n for n, _ in reference.named_parameters()}, sorted(got)  # tied: once
            for name, p in reference.named_parameters():
                torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"stage {stage}, {name}: {m}")
            assert torch.equal(got["stem.weight"], _Frozen().stem.weight.detach())
            assert _same(buffers, {k: v for k, v in reference.named_buffers()})


@pytest.mark.slow
@pytest.mark.multirank
def test_raise_on_one_ranks_nan_raises_on_every_rank_naming_the_path(ranks):
    results = ranks(2).run(_one_rank_nan, 2, "raise")
    for outcome, count, _ in results:
        assert outcome[1] == ["['0.bias']", "['0.weight']", "['2.bias']", "['2.weight']"]
        assert outcome[0] == outcome[2] == "applied"
        assert count == 2  # the failed update changed nothing; the next one stepped


# ---------------------------------------------------------------- buffers of a skipped update


def _bn_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8, bias=False), torch.nn.BatchNorm1d(8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 2))


def _buffers(state):
    return {k: v.clone() for k, v in state.buffers.items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("precision,accumulate", [("fp32", 1), ("fp32", 2), ("bf16", 1), ("bf16", 2), ("fp16", 2)])
def test_a_skipped_update_leaves_the_buffers_as_they_were_before_its_first_micro_batch(precision, accumulate):
    step = fzero.compile(_train_step, precision=precision, accumulate=accumulate,
                         **({"loss_scale": 8.0} if precision == "fp16" else {}))
    state = step.init(_state(_bn_model()))
    batches = _batches(3, size=8)
    x, y = batches[1]
    x = x.clone()
    x[-1, 0] = NAN  # in the update's last micro-batch: the earlier ones' forwards ran on clean data
    state, _ = step(state, batches[0])
    before = _buffers(state)
    state, metrics = step(state, (x, y))
    assert bool(metrics["skipped"]) and int(state.step) == 1
    assert _same(_buffers(state), before)  # running statistics and the batch counter, bit for bit
    state, metrics = step(state, batches[2])
    assert not bool(metrics["skipped"]) and int(state.buffers["1.num_batches_tracked"]) == 2 * accumulate


def test_fp32_with_batchnorm_trains_as_if_the_skipped_batch_were_not_there():
    """The reference: plain PyTorch, a BatchNorm model trained by torch's AdamW on the clean
    batches only (their forwards alone move the running statistics)."""
    module = _bn_model()
    reference = copy.deepcopy(module)
    step = fzero.compile(_train_step)
    state = step.init(_state(module))
    batches = _batches(4, bad_at=(1, 2))
    for batch in batches:
        state, _ = step(state, batch)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in batches[:1] + batches[3:]:
        opt.zero_grad()
        (reference(x) - y).pow(2).mean().backward()
        opt.step()
    got = fzero.gather(state.params)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-6, atol=1e-7)
    for name, b in reference.named_buffers():
        torch.testing.assert_close(state.buffers[name], b, rtol=1e-6, atol=1e-7)


def test_raise_leaves_the_buffers_as_they_were():
    step = fzero.compile(_train_step, nonfinite="raise")
    state = step.init(_state(_bn_model()))
    state, _ = step(state, _batches(1)[0])
    before = _buffers(state)
    with pytest.raises(fzero.NonFiniteGradientError):
        step(state, _batches(1, bad_at=(0,))[0])
    assert _same(_buffers(state), before)


def _one_rank_nan_buffers(precision):
    """ZeRO 0-3: rank 1's micro-batch holds a NaN; every rank skips and keeps its buffers."""
    rank = dist.get_rank()
    out = []
    for stage in range(4):
        step = fzero.compile(_train_step, zero=stage, precision=precision, accumulate=2)
        state = step.init(_state(_bn_model()))
        (x0, y0), (x1, y1) = _batches(2, size=8)
        state, _ = step(state, (x0[rank * 4:(rank + 1) * 4], y0[rank * 4:(rank + 1) * 4]))
        before = _buffers(state)
        x1 = x1[rank * 4:(rank + 1) * 4].clone()
        if rank == 1:
            x1[3, 0] = NAN
        state, metrics = step(state, (x1, y1[rank * 4:(rank + 1) * 4]))
        out.append((bool(metrics["skipped"]), _same(_buffers(state), before), _buffers(state)))
    return out


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_nan_on_one_rank_leaves_every_ranks_buffers_as_they_were_at_every_stage(ranks, precision):
    results = ranks(2).run(_one_rank_nan_buffers, precision)
    for stage in range(4):
        (skip0, kept0, b0), (skip1, kept1, b1) = results[0][stage], results[1][stage]
        assert skip0 and skip1 and kept0 and kept1, (stage, skip0, skip1, kept0, kept1)
        assert _same(b0, b1), stage


def test_a_streak_of_skipped_updates_is_reported_once_with_its_reason():
    from fzero.transforms._skip import WARN_AFTER

    step = fzero.compile(_train_step)
    state = step.init(_state(_model()))
    bad, good = _batches(1, bad_at=(0,))[0], _batches(1)[0]
    with pytest.warns(RuntimeWarning, match=r"10 updates in a row were skipped: their gradients held inf or "
                                            r"NaN .* since the start: the model is not training") as seen:
        for _ in range(WARN_AFTER + 2):
            state, _ = step(state, bad)
    assert len([w for w in seen if issubclass(w.category, RuntimeWarning)]) == 1
    state, _ = step(state, good)  # the streak ends; the next one is reported again
    with pytest.warns(RuntimeWarning, match="since update 1"):
        for _ in range(WARN_AFTER):
            state, _ = step(state, bad)
    step16 = fzero.compile(_train_step, precision="fp16", loss_scale=4.0)
    state = step16.init(_state(_model()))
    with pytest.warns(RuntimeWarning, match="overflow at the fixed loss scale 4"):
        for _ in range(WARN_AFTER):
            state, _ = step16(state, bad)


# ---------------------------------------------------------------- bad input at world 1


def test_a_params_leaf_that_is_not_a_tensor_is_named():
    params = {"w": torch.zeros(2), "n": 3, "nested": {"s": "text", "ok": torch.ones(1)}}
    with pytest.raises(TypeError, match=re.escape("params['n'] is int; params['nested']['s'] is str")):
        fzero.TrainState.create(apply_fn=None, params=params, tx=optim.adamw(1e-3))


def test_an_integer_parameter_is_named_unless_frozen():
    params = {"w": torch.zeros(2), "k": torch.zeros(2, dtype=torch.long)}
    with pytest.raises(TypeError, match=re.escape("integer parameters cannot be trained by gradients: "
                                                  "params['k'] (torch.int64)")):
        fzero.TrainState.create(apply_fn=None, params=params, tx=optim.adamw(1e-3))

    class WithCounter(torch.nn.Module):  # a frozen integer Parameter is fine: never updated
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 2)
            self.count = torch.nn.Parameter(torch.tensor([7]), requires_grad=False)

        def forward(self, x):
            return self.lin(x)

    step = fzero.compile(_train_step)
    state = step.init(_state(WithCounter()))
    state, _ = step(state, (torch.ones(2, 3), torch.zeros(2, 2)))
    assert torch.equal(fzero.gather(state.params)["count"], torch.tensor([7]))


def test_a_gradient_of_the_wrong_shape_is_named_with_both_shapes():
    state = fzero.TrainState.create(apply_fn=None, params={"w": torch.zeros(2), "b": torch.zeros(3)},
                                    tx=optim.adamw(1e-3))
    with pytest.raises(ValueError, match=re.escape("grads['b'] has shape (2,), the parameter (3,); "
                                                   "grads['w'] has shape (3,), the parameter (2,)")):
        state.apply_gradients({"w": torch.ones(3), "b": torch.ones(2)})
    # a gradient that would broadcast is refused too
    with pytest.raises(ValueError, match=re.escape("grads['b'] has shape (1,), the parameter (3,)")):
        state.apply_gradients({"w": torch.ones(2), "b": torch.ones(1)})


def _flags_case(device):
    """Leaves of several dtypes, an empty one, a huge finite one, one NaN or inf among many."""
    from fzero.transforms.finite import count_nonfinite, nonfinite_flags

    big = torch.randn(1 << 16, device=device)
    big[12345] = float("nan")
    half = torch.randn(300, device=device, dtype=torch.bfloat16)
    half[-1] = float("-inf")
    leaves = [torch.randn(7, 3, device=device), big, torch.zeros(0, device=device),
              torch.full((5,), 3e38, device=device), half, torch.randn(4, device=device, dtype=torch.bfloat16)]
    want = torch.tensor([(~torch.isfinite(x)).any().item() for x in leaves], dtype=torch.float32)
    got = nonfinite_flags(leaves, None)
    assert got.device == leaves[0].device and got.tolist() == want.tolist() == [0, 1, 0, 0, 1, 0]
    assert nonfinite_flags(leaves[:1] + leaves[3:4], None).tolist() == [0, 0]  # one group, in order
    assert count_nonfinite(leaves, None).item() == 2 and count_nonfinite(leaves[:1] + leaves[3:], None).item() == 1
    # Both ways the check is made (the device picks one): each leaf's verdict is isfinite's.
    from fzero.transforms.finite import _bad_by_norm, _bad_by_peak

    for bad in (_bad_by_norm, _bad_by_peak):  # 3e38: finite, its sum of squares is not
        for group in (leaves[:2] + leaves[3:4], leaves[4:]):
            assert bad(group).tolist() == [bool((~torch.isfinite(x)).any()) for x in group], (bad, group)


def test_the_nonfinite_check_is_isfinite_per_leaf():
    _flags_case("cpu")


def test_the_count_checks_views_of_one_buffer_in_one_pass_and_nothing_between_them():
    """Gradients as views of one flat buffer (stage 0's reduced groups) are checked as runs
    of back-to-back leaves: every element of every leaf, and none of what lies between or
    after them (padding), whatever the views' layouts."""
    from fzero.transforms.finite import _spans, count_nonfinite

    flat = torch.zeros(40)
    leaves = [flat[0:6].view(2, 3), flat[6:10], flat[12:20].view(4, 2).t(), flat[20:24], flat[24:30], torch.zeros(3)]
    spans = _spans(leaves)
    assert sorted((x.storage_offset(), x.numel()) for x in spans) == [(0, 3), (0, 10), (12, 8), (20, 10)]
    assert count_nonfinite(leaves, None).item() == 0
    for gap in (10, 11, 30, 39):  # between the leaves, and the padding after them
        flat.zero_()
        flat[gap] = float("nan")
        assert count_nonfinite(leaves, None).item() == 0, gap
    for inside in (0, 5, 9, 12, 19, 20, 29):
        flat.zero_()
        flat[inside] = float("inf")
        assert count_nonfinite(leaves, None).item() == 1, inside
    leaves[-1][1] = float("nan")
    assert count_nonfinite(leaves, None).item() == 2


def _huge_step(state, batch):
    """Gradients of about 1e20 per element, all finite: their sum of squares is not (fp32)."""
    loss, grads = fzero.value_and_grad(lambda p: 1e20 * state.apply_fn(p, batch[0]).sum())(state.params)
    return state.apply_gradients(grads), {"loss": loss}


def test_with_a_clip_the_verdict_is_the_global_norm_and_is_taken_once():
    """``compile(clip_norm=)`` in fp32: the non-finite check takes the clip's global norm
    (one pass over the gradients and one reduction, the clip reuses it), so finite gradients
    whose sum of squares overflows are skipped too, where the check without a clip (an
    exact per-leaf one) applies them."""
    import fzero.optim.clipping as clipping

    x = torch.ones(2, 3)
    passes, real = [], clipping._leaf_norms
    clipping._leaf_norms = lambda xs, device: passes.append(len(xs)) or real(xs, device)
    try:
        step = fzero.compile(_train_step, clip_norm=1.0)
        state = step.init(_state(_model()))
        state, metrics = step(state, _batches(1)[0])
        assert passes == [4] and not bool(metrics["skipped"])  # 4 leaves, one pass: the clip reused it
        # the same norm: torch's clip_grad_norm_ on the same gradients
        ref = _model()
        (ref(_batches(1)[0][0]) - _batches(1)[0][1]).pow(2).mean().backward()
        torch.testing.assert_close(metrics["grad_norm"], torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0))
    finally:
        clipping._leaf_norms = real
    clipped = fzero.compile(_huge_step, clip_norm=1.0)
    state = clipped.init(_state(_model()))
    state, metrics = clipped(state, (x,))
    assert bool(metrics["skipped"]) and int(state.step) == 0
    exact = fzero.compile(_huge_step)
    state = exact.init(_state(_model()))
    state, metrics = exact(state, (x,))
    assert not bool(metrics["skipped"]) and int(state.step) == 1


@pytest.mark.parametrize("zero", [0, 1])
def test_under_bf16_with_a_clip_the_overflow_check_is_the_clip_s_norm(zero):
    """``compile(precision="bf16", clip_norm=)``: mixed precision's overflow check takes the
    clip's global norm, which the clip then reuses -- one pass over the gradients a step
    (``torch._foreach_norm`` is called once), where the check and the clip made one each;
    an inf gradient still skips the update, and gradients whose sum of squares overflows
    are skipped too, as in fp32 with a clip; without a clip the check stays exact."""
    calls, real = [], torch._foreach_norm

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    step = fzero.compile(_train_step, zero=zero, precision="bf16", clip_norm=1.0)
    state = step.init(_state(_model()))
    batches = _batches(2, bad_at=(1,))
    torch._foreach_norm = counted
    try:
        state, metrics = step(state, batches[0])
    finally:
        torch._foreach_norm = real
    assert len(calls) == 1 and not bool(metrics["skipped"]) and int(state.step) == 1, calls
    state, metrics = step(state, batches[1])  # an inf in the input: inf/nan gradients
    assert bool(metrics["skipped"]) and int(state.step) == 1
    x = torch.ones(2, 3)
    for clip_norm, skipped in ((1.0, True), (None, False)):
        huge = fzero.compile(_huge_step, zero=zero, precision="bf16", clip_norm=clip_norm)
        state = huge.init(_state(_model()))
        state, metrics = huge(state, (x,))
        assert bool(metrics["skipped"]) is skipped and int(state.step) == int(not skipped), clip_norm


def test_a_known_norm_serves_only_the_same_unchanged_leaves():
    from fzero.optim import global_sumsq, known_sumsq

    g = {"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}
    with known_sumsq(g, torch.tensor(7.0)):
        assert global_sumsq(g).item() == 7.0
        assert global_sumsq({"a": g["a"].clone(), "b": g["b"]}).item() == 25.0  # another tensor
        assert global_sumsq({"b": g["a"], "a": g["b"]}).item() == 25.0  # other names
        g["a"].mul_(2)  # written in place since
        assert global_sumsq(g).item() == 52.0
    assert global_sumsq({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}).item() == 25.0


def test_a_certificate_answers_once_for_the_same_unchanged_tensors():
    from fzero.transforms._skip import Certificate

    a, b = torch.ones(2), torch.ones(3)
    cert = Certificate()
    assert cert.take([a, b]) is None  # nothing given
    cert.give(torch.tensor(0.0), [a, b])
    assert cert.take([b, a]).item() == 0.0  # any order
    assert cert.take([a, b]) is None  # taken once
    for other in ([a], [a, b.clone()], [a, b, torch.ones(1)]):
        cert.give(torch.tensor(0.0), [a, b])
        assert cert.take(other) is None, other
    cert.give(torch.tensor(0.0), [a, b])
    a.add_(1)  # written in place since
    assert cert.take([a, b]) is None
