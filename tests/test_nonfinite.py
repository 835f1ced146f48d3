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


@pytest.mark.parametrize("donate", [True, False])
def test_fp32_skips_a_non_finite_update_by_default_as_if_its_batch_were_not_there(donate):
    module = _model()
    reference = copy.deepcopy(module)
    step = fzero.compile(_train_step, donate=donate)
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


def _one_rank_nan(stage, mode):
    rank = dist.get_rank()
    step = fzero.compile(_train_step, zero=stage, nonfinite=mode)
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
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_nan_on_one_rank_is_skipped_by_every_rank(ranks, stage):
    results = ranks(2).run(_one_rank_nan, stage, "skip")
    for skipped, count, _ in results:
        assert skipped == [False, True, False] and count == 2, skipped
    a, b = results[0][2], results[1][2]
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_raise_on_one_ranks_nan_raises_on_every_rank_naming_the_path(ranks):
    results = ranks(2).run(_one_rank_nan, 2, "raise")
    for outcome, count, _ in results:
        assert outcome[1] == ["['0.bias']", "['0.weight']", "['2.bias']", "['2.weight']"]
        assert outcome[0] == outcome[2] == "applied"
        assert count == 2  # the failed update changed nothing; the next one stepped


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
