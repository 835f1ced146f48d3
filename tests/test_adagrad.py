"""fzero.optim.adagrad against torch.optim.Adagrad, and the config's Adagrad section against
what DeepSpeed builds for it (torch.optim.Adagrad with the section's params)."""

from __future__ import annotations

import pytest
import torch

import fzero
import fzero.testing as ft
from fzero import optim

CASES = [dict(lr=0.1), dict(lr=0.05, lr_decay=0.01), dict(lr=0.1, weight_decay=0.1),
         dict(lr=0.1, initial_accumulator_value=0.2, eps=1e-3),
         dict(lr=0.02, lr_decay=0.1, weight_decay=0.01, initial_accumulator_value=0.5, eps=1e-6)]


def _torch_trajectory(hp, p0, grads):
    p = torch.nn.Parameter(p0.clone())
    opt = torch.optim.Adagrad([p], **hp)
    out = []
    for g in grads:
        p.grad = g.clone()
        opt.step()
        out.append(p.detach().clone())
    return out


def _fzero_trajectory(tx, p0, grads):
    params, out = {"w": p0.clone()}, []
    state = tx.init(params)
    for g in grads:
        u, state = tx.update({"w": g}, state, params)
        params = optim.apply_updates(params, u)
        out.append(params["w"])
    return out


@pytest.mark.parametrize("hp", CASES, ids=str)
def test_adagrad_equals_torch_where_the_hyperparameters_agree(hp):
    torch.manual_seed(0)
    p0, grads = torch.randn(40, 30), [torch.randn(40, 30) for _ in range(8)]
    tx = optim.adagrad(hp["lr"], hp.get("initial_accumulator_value", 0.0), hp.get("eps", 1e-10),
                       weight_decay=hp.get("weight_decay", 0.0), lr_decay=hp.get("lr_decay", 0.0))
    # torch divides -lr * g by the root, fzero multiplies g / root by -lr: one rounding apart
    for k, (a, b) in enumerate(zip(_fzero_trajectory(tx, p0, grads), _torch_trajectory(hp, p0, grads))):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"update {k}")


def test_adagrad_takes_optax_defaults_and_differs_from_torch_defaults():
    torch.manual_seed(1)
    p0, grads = torch.randn(10), [torch.randn(10) for _ in range(3)]
    ours = _fzero_trajectory(optim.adagrad(0.01), p0, grads)  # initial 0.1, eps 1e-7: optax's
    theirs = _torch_trajectory(dict(lr=0.01), p0, grads)  # initial 0, eps 1e-10
    assert not torch.allclose(ours[-1], theirs[-1], rtol=1e-4, atol=0)
    state = optim.adagrad(0.01).init({"w": p0})
    assert torch.equal(state[1].sum_of_squares["w"], torch.full((10,), 0.1))


def test_the_config_adagrad_is_what_deepspeed_builds():
    """DeepSpeed: torch.optim.Adagrad(params, **optimizer.params), torch's defaults for the rest."""
    torch.manual_seed(2)
    model = ft.Blocks(3, 5, 1, 2)
    params_hp = {"lr": 0.05, "lr_decay": 0.01, "weight_decay": 0.001}
    g = torch.Generator().manual_seed(3)
    batches = [{"x": torch.randn(4, 3, generator=g), "y": torch.randn(4, 2, generator=g)} for _ in range(4)]
    expected = ft.torch_mse_steps(model, lambda ps: torch.optim.Adagrad(ps, **params_hp), batches)
    apply, params = fzero.functionalize(model)
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
           "optimizer": {"type": "Adagrad", "params": params_hp}}
    step = fzero.compile(ft.mse_step, config=cfg)
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.0)))
    state, _ = ft.run_steps(step, state, batches)
    ft.assert_trees_close(state.params, expected, rtol=1e-6, atol=1e-7)
    assert step.config.optimizer.type == "Adagrad" and step.config.optimizer.hyperparameters()["eps"] == 1e-10
