"""fzero.global_mean: a token-mean loss gives the one-process full-batch loss and gradient
whatever the accumulation, checked against plain PyTorch (``F.cross_entropy(...,
ignore_index=-100)`` on the full batch, ``backward``, ``torch.optim``); its errors."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fzero
import fzero.testing as ft
from fzero import optim


class Tagger(nn.Module):
    def __init__(self, vocab=11, d=8, classes=5):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, ids):
        return self.head(self.ln(self.emb(ids)))


def _batches(steps=3, rows=4, T=7):
    """Micro-batches of very different valid-token counts: rows 0-1 hold 1 valid token each,
    rows 2-3 all of theirs (2 and 14 valid tokens under accumulate=2)."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 11, (rows, T), generator=g)
        y = torch.randint(0, 5, (rows, T), generator=g)
        y[: rows // 2, 1:] = -100
        out.append({"ids": ids, "y": y})
    return out


def _plain(steps):
    torch.manual_seed(0)
    model = Tagger()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for b in _batches(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(b["ids"]).flatten(0, 1), b["y"].flatten(), ignore_index=-100)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), dict(model.named_parameters())


_token_mean_step = ft.token_mean_step


def _fzero(steps, step_fn=_token_mean_step, **options):
    torch.manual_seed(0)
    apply, params = fzero.functionalize(Tagger())
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.5))
    step = fzero.compile(step_fn, **options)
    state, losses = step.init(state), []
    for b in _batches(steps):
        state, m = step(state, b)
        losses.append(m["loss"])
    return torch.stack(losses), fzero.gather(state.params)


@pytest.mark.parametrize("accumulate", [1, 2, 4])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_token_mean_loss_is_the_full_batch_loss_at_any_accumulation(accumulate, precision):
    ref_losses, ref_params = _plain(3)
    losses, params = _fzero(3, accumulate=accumulate, precision=precision)
    tol = "fp32" if precision == "fp32" else "bf16 vs fp32"
    ft.assert_trees_close(losses, ref_losses, tol=tol, what="losses")
    ft.assert_trees_close({k: params[k] for k in ref_params}, {k: v.detach() for k, v in ref_params.items()},
                          tol=tol, what="params")


def test_the_mean_of_each_micro_batch_is_what_the_bug_computes():
    """The check above can fail: a per-micro-batch token mean (F.cross_entropy's own
    ignore_index mean) under accumulate=2 is far from the full batch's."""
    def per_micro_batch(state, batch):
        def loss_fn(p):
            logits = state.apply_fn(p, batch["ids"]).flatten(0, 1)
            return F.cross_entropy(logits, batch["y"].flatten(), ignore_index=-100)

        loss, g = fzero.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(g), {"loss": loss}

    ref_losses, _ = _plain(1)
    losses, _ = _fzero(1, per_micro_batch, accumulate=2)
    assert (losses - ref_losses).abs().max() > 0.05


def test_a_linear_combination_of_global_means_is_exact_under_accumulation():
    def two_terms(state, batch):
        def loss_fn(p):
            logits = state.apply_fn(p, batch["ids"]).flatten(0, 1)
            y = batch["y"].flatten()
            ce = F.cross_entropy(logits, y.clamp(min=0), reduction="none")
            z = torch.logsumexp(logits, -1) ** 2
            return fzero.global_mean(ce, where=y != -100) + 0.1 * fzero.global_mean(z, where=y != -100) / 2

        loss, g = fzero.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(g), {"loss": loss}

    l1, p1 = _fzero(2, two_terms)
    l2, p2 = _fzero(2, two_terms, accumulate=2)
    ft.assert_trees_close(l2, l1)
    ft.assert_trees_close(p2, p1)


def _bad_loss_step(make_loss):
    def step(state, batch):
        def loss_fn(p):
            logits = state.apply_fn(p, batch["ids"]).flatten(0, 1)
            y = batch["y"].flatten()
            ce = F.cross_entropy(logits, y.clamp(min=0), reduction="none")
            return make_loss(fzero.global_mean(ce, where=y != -100), p, y, ce)

        loss, g = fzero.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(g), {"loss": loss}
    return step


@pytest.mark.parametrize("make_loss, named", [
    (lambda m, p, y, ce: m ** 2, "PowBackward0"),
    (lambda m, p, y, ce: m + p["head.weight"].square().sum(), "PowBackward0"),
    (lambda m, p, y, ce: m + 1e-3 * p["head.bias"].sum(), "a path to the parameters"),
    (lambda m, p, y, ce: m + 1.0, "constant"),
    (lambda m, p, y, ce: m * fzero.global_mean(ce), "product"),
])
def test_a_loss_not_linear_in_its_global_means_is_refused_under_accumulation(make_loss, named):
    with pytest.raises(ValueError, match=f"fzero.global_mean: .*linear combination.*{named}"):
        _fzero(1, _bad_loss_step(make_loss), accumulate=2)
    _fzero(1, _bad_loss_step(make_loss))  # without accumulation the count is known at the call: any loss


def test_global_means_of_different_counts_are_refused_under_accumulation():
    make = lambda m, p, y, ce: m + fzero.global_mean(ce)  # noqa: E731
    with pytest.raises(ValueError, match="every global_mean of a step must count the same elements"):
        _fzero(1, _bad_loss_step(make), accumulate=2)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"where of shape \(3,\) does not broadcast to values of shape \(2,\)"):
        fzero.global_mean(torch.ones(2), where=torch.ones(3, dtype=torch.bool))
    with pytest.raises(TypeError, match="where must be a bool tensor, got a torch.int64 tensor"):
        fzero.global_mean(torch.ones(2), where=torch.ones(2, dtype=torch.int64))
    with pytest.raises(TypeError, match="values must be a floating-point tensor"):
        fzero.global_mean(torch.ones(2, dtype=torch.int64))


def test_no_counted_element_gives_zero_and_no_nan():
    x = torch.ones(3, requires_grad=True)
    out = fzero.global_mean(x * 2, where=torch.zeros(3, dtype=torch.bool))
    out.backward()
    assert out.item() == 0.0 and x.grad.abs().sum() == 0
