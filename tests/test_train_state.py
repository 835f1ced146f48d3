"""TrainState: creation, the pytree it is, and the plain update."""

import pytest
import torch

import fzero
import fzero.testing as ft
from fzero import optim, tree


def make_state(tx=None):
    torch.manual_seed(0)
    apply, params = fzero.functionalize(torch.nn.Linear(3, 2))
    return fzero.TrainState.create(apply_fn=apply, params=params, tx=tx or optim.adam(1e-2))


def test_create():
    state = make_state()
    assert state.step.dtype == torch.int64 and state.step.shape == () and int(state.step) == 0
    ft.assert_trees_close(state.opt_state, state.tx.init(state.params), rtol=0, atol=0)
    assert state.extra == {}


def test_is_a_pytree_with_static_fields():
    state = make_state()
    names = [tree.keystr(p) for p in tree.paths(state)]
    assert ".step" in names and ".params['weight']" in names
    assert any(n.startswith(".opt_state") for n in names)
    doubled = tree.map(lambda x: x * 2, state)
    assert doubled.apply_fn is state.apply_fn and doubled.tx is state.tx


def test_apply_gradients_is_the_optimizer_update():
    state = make_state()
    g = tree.map(torch.randn_like, state.params)
    with optim.use_fused("off"):  # the chain itself, bit for bit
        new = state.apply_gradients(g)
    updates, opt = state.tx.update(g, state.opt_state, state.params)
    ft.assert_trees_close(new.params, optim.apply_updates(state.params, updates), rtol=0, atol=0)
    ft.assert_trees_close(new.opt_state, opt, rtol=0, atol=0)
    assert int(new.step) == 1 and int(state.step) == 0  # pure: the old state is unchanged
    fused = state.apply_gradients(g)  # Adam on the CPU: torch's fused kernel, within rounding
    ft.assert_trees_close((fused.params, fused.opt_state), (new.params, new.opt_state))


def test_apply_gradients_structure_error_names_paths():
    state = make_state()
    with pytest.raises(tree.StructureError, match=r"(?s)fzero.TrainState.apply_gradients.*grads.*\['bias'\]"):
        state.apply_gradients({"weight": torch.zeros(2, 3)})


def test_create_rejects_non_transformations():
    apply, params = fzero.functionalize(torch.nn.Linear(1, 1))
    with pytest.raises(TypeError, match="fzero.TrainState.create: tx must be"):
        fzero.TrainState.create(apply_fn=apply, params=params, tx=torch.optim.SGD)
