"""functionalize, value_and_grad, grad, remat against torch's own autograd on the module."""

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings

import fzero
import fzero.testing as ft


def module_grads(module, loss_of_module):
    module.zero_grad()
    loss = loss_of_module(module)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}


@settings(max_examples=25, deadline=None)
@given(ft.models(), ft.seeds())
def test_value_and_grad_equals_module_backward(case, seed):
    model = case.make()
    batch = case.batch(5, seed % 1000)
    apply, params = fzero.functionalize(model)

    def loss_fn(p):
        return F.mse_loss(apply(p, batch["x"]), batch["y"])

    loss, grads = fzero.value_and_grad(loss_fn)(params)
    ref_loss, ref_grads = module_grads(model, lambda m: F.mse_loss(m(batch["x"]), batch["y"]))
    ft.assert_trees_close(loss, ref_loss, rtol=0, atol=0)
    ft.assert_trees_close(grads, ref_grads, what="grads")


def test_params_are_named_parameters_without_copy():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    apply, params = fzero.functionalize(model)
    assert list(params) == [n for n, _ in model.named_parameters()]
    for n, p in model.named_parameters():
        assert params[n].data_ptr() == p.data_ptr() and not params[n].requires_grad
    x = torch.randn(2, 3)
    torch.testing.assert_close(apply(params, x), model(x), rtol=0, atol=0)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("shift", torch.full((4,), 0.5))

    def forward(self, idx, *, scale=1.0):
        return self.head((self.emb(idx) + self.shift) * scale)


def test_tied_weights_stay_tied_and_get_both_gradients():
    torch.manual_seed(0)
    model = Tied()
    apply, params = fzero.functionalize(model)
    assert list(params) == ["emb.weight"]  # one parameter, two uses
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    y = torch.tensor([[2, 3, 4], [5, 6, 0]])

    def loss_fn(p):
        return F.cross_entropy(apply(p, idx, scale=2.0).flatten(0, 1), y.flatten())

    loss, g = fzero.value_and_grad(loss_fn)(params)
    ref_loss, ref = module_grads(model, lambda m: F.cross_entropy(m(idx, scale=2.0).flatten(0, 1), y.flatten()))
    ft.assert_trees_close(g, ref)
    # New values for the tied parameter reach both uses.
    zeros = {"emb.weight": torch.zeros(7, 4)}
    assert torch.count_nonzero(apply(zeros, idx)) == 0


def test_apply_restores_the_modules_own_tensors_and_binds_shared_submodules():
    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.Tanh(), shared)  # one submodule reached by two names
    apply, params = fzero.functionalize(model)
    own = {n: p for n, p in model.named_parameters()}
    x = torch.randn(2, 3)
    new = {k: torch.randn_like(v) for k, v in params.items()}
    out = apply(new, x)
    assert all(p is own[n] for n, p in model.named_parameters())  # the module's own are back
    # torch's functional_call on a copy (on a module holding one submodule twice it does
    # not put the module's own tensors back, so it runs last here)
    torch.testing.assert_close(out, torch.func.functional_call(copy.deepcopy(model), new, (x,)))
    torch.testing.assert_close(apply(params, x), model(x))


def test_a_parametrized_module_runs_with_the_given_parameters():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    torch.nn.utils.parametrize.register_parametrization(model[2], "weight", _Doubled())
    apply, params = fzero.functionalize(model)
    assert "2.parametrizations.weight.original" in params
    x = torch.randn(5, 3)
    new = {k: v + 1 for k, v in params.items()}
    torch.testing.assert_close(apply(new, x), torch.func.functional_call(model, new, (x,)))
    torch.testing.assert_close(apply(params, x), model(x))


class _Doubled(nn.Module):
    def forward(self, w):
        return 2 * w


def test_buffers_are_carried_and_kwargs_pass():
    model = Tied()
    apply, params = fzero.functionalize(model)
    idx = torch.tensor([[0, 1]])
    torch.testing.assert_close(apply(params, idx, scale=3.0), model(idx, scale=3.0))
    model.shift.fill_(2.0)  # a buffer the module changes is what apply uses next
    torch.testing.assert_close(apply(params, idx), model(idx))


def test_batchnorm_running_stats_update():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    apply, params = fzero.functionalize(model)
    before = model[1].running_mean.clone()
    apply(params, torch.randn(8, 3) + 5)
    assert not torch.equal(before, model[1].running_mean)


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    extra: dict


class ManyOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x, mode="tuple"):
        y = self.lin(x)
        if mode == "tuple":
            return y, y.sum()
        if mode == "dict":
            return {"logits": y}
        return Out(y, {"n": 1})


@pytest.mark.parametrize("mode", ["tuple", "dict", "dataclass"])
def test_outputs_of_any_shape(mode):
    apply, params = fzero.functionalize(ManyOutputs())
    x = torch.randn(4, 3)

    def loss_fn(p):
        out = apply(p, x, mode=mode)
        y = out[0] if mode == "tuple" else out["logits"] if mode == "dict" else out.logits
        return y.pow(2).mean(), out

    (loss, aux), g = fzero.value_and_grad(loss_fn, has_aux=True)(params)
    assert loss.shape == () and set(g) == {"lin.weight", "lin.bias"}
    assert g["lin.weight"].shape == (2, 3)


def test_huggingface_gpt2_from_config():
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extras")
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=50, n_positions=32, bos_token_id=0,
                                   eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    apply, params = fzero.functionalize(model)
    assert "lm_head.weight" not in params  # tied to transformer.wte.weight
    ids = torch.randint(0, 50, (2, 10))

    def loss_fn(p):
        return apply(p, input_ids=ids, labels=ids).loss  # kwargs in, a ModelOutput out

    loss, g = fzero.value_and_grad(loss_fn)(params)
    ref_loss, ref = module_grads(model, lambda m: m(input_ids=ids, labels=ids).loss)
    ft.assert_trees_close(loss, ref_loss)
    ft.assert_trees_close(g, ref)


def test_strict_keys():
    apply, params = fzero.functionalize(nn.Linear(2, 2))
    with pytest.raises(KeyError, match=r"missing: \['bias'\]"):
        apply({"weight": params["weight"]}, torch.ones(1, 2))
    with pytest.raises(KeyError, match=r"unexpected: \['bogus'\]"):
        apply({**params, "bogus": torch.ones(1)}, torch.ones(1, 2))
    with pytest.raises(TypeError, match="fzero.functionalize: expected a torch.nn.Module"):
        fzero.functionalize(lambda x: x)


def test_has_aux_grad_and_argnums():
    f = lambda w, x: ((w * x).sum(), {"n": x.numel()})  # noqa: E731
    w, x = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    (v, aux), g = fzero.value_and_grad(f, has_aux=True)(w, x)
    assert v.item() == 11.0 and aux == {"n": 2} and g.tolist() == [3.0, 4.0]
    (gw, gx), aux = fzero.grad(f, argnums=(0, 1), has_aux=True)(w, x)
    assert gw.tolist() == [3.0, 4.0] and gx.tolist() == [1.0, 2.0]
    gx = fzero.grad(lambda w, x: (w * x).sum(), argnums=1)(w, x)
    assert gx.tolist() == [1.0, 2.0]


def test_unused_and_integer_leaves_get_zeros():
    p = {"used": torch.ones(2), "unused": torch.ones(3), "count": torch.tensor(4)}
    g = fzero.grad(lambda p: p["used"].sum())(p)
    assert g["unused"].tolist() == [0.0] * 3 and g["count"].item() == 0
    g = fzero.grad(lambda p: torch.tensor(1.0))(p)  # no dependence at all
    assert g["used"].tolist() == [0.0, 0.0]


def test_value_and_grad_errors():
    with pytest.raises(TypeError, match=r"fzero.value_and_grad: fn must return a floating-point scalar tensor.*shape \(2,\)"):
        fzero.value_and_grad(lambda w: w * 2)(torch.ones(2))
    with pytest.raises(TypeError, match="has_aux=True"):
        fzero.value_and_grad(lambda w: (w.sum(), 1))(torch.ones(2))
    with pytest.raises(TypeError, match="must return a pair"):
        fzero.value_and_grad(lambda w: w.sum(), has_aux=True)(torch.ones(2))
    with pytest.raises(TypeError, match="argnums=1"):
        fzero.value_and_grad(lambda w: w.sum(), argnums=1)(torch.ones(2))


def test_inputs_are_not_mutated_or_marked():
    w = torch.ones(3)
    fzero.grad(lambda w: (w ** 2).sum())(w)
    assert not w.requires_grad and w.grad is None


def test_remat_same_gradients_and_recomputes():
    calls = {"n": 0}

    def block(x, w):
        calls["n"] += 1
        return torch.tanh(x @ w) @ w.T

    x = torch.randn(4, 3)
    w = torch.randn(3, 5)
    g_plain = fzero.grad(lambda w: block(x, w).pow(2).sum())(w)
    calls["n"] = 0
    g_remat = fzero.grad(lambda w: fzero.remat(block)(x, w).pow(2).sum())(w)
    assert calls["n"] == 2  # forward, then again in backward
    torch.testing.assert_close(g_remat, g_plain, rtol=0, atol=0)


def test_remat_keeps_dropout_mask():
    w = torch.randn(6, 6)
    x = torch.randn(8, 6)

    def block(x, w):
        return F.dropout(x @ w, p=0.5, training=True)

    torch.manual_seed(3)
    g1 = fzero.grad(lambda w: block(x, w).sum())(w)
    torch.manual_seed(3)
    g2 = fzero.grad(lambda w: fzero.remat(block)(x, w).sum())(w)
    torch.testing.assert_close(g1, g2, rtol=0, atol=0)
