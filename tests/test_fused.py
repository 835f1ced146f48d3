"""The fused optimizer path (fzero_kernels under fzero.optim) equals the unfused chain."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
import fzero.testing as ft
import fzero_kernels
from fzero import optim
from fzero.optim.fused import fused_update


def _txs():
    sched = optim.schedules.warmup_cosine(1e-2, warmup=2, total=8)
    return {
        "adamw": lambda: optim.adamw(1e-2, weight_decay=0.1),
        "adamw_masked_sched": lambda: optim.adamw(sched, weight_decay=0.1, mask=lambda p: {k: k.endswith("weight") for k in p}),
        "adam_l2": lambda: optim.adam(3e-3, weight_decay=0.05),
        "clip_adamw": lambda: optim.chain(optim.clip_by_global_norm(0.1), optim.adamw(1e-2)),
    }


def train_step(state, batch):
    loss, g = fzero.value_and_grad(lambda p: F.mse_loss(state.apply_fn(p, batch["x"]), batch["y"]))(state.params)
    return state.apply_gradients(g), {"loss": loss}


@settings(max_examples=12, deadline=None)
@given(ft.models(), st.sampled_from(sorted(_txs())))
def test_fused_equals_unfused(case, name):
    """Along the unfused trajectory, each fused update equals the unfused one within fp32
    rounding (comparing whole trajectories would compare rounding amplified by training)."""
    apply, params = fzero.functionalize(case.make())
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=_txs()[name]())
    for i in range(8):
        batch = case.batch(6, i)
        loss, g = fzero.value_and_grad(lambda p: F.mse_loss(apply(p, batch["x"]), batch["y"]))(state.params)
        with optim.use_fused("on"), fzero_kernels.force_backend("reference"):
            fused = fused_update(state.tx, g, state.opt_state, state.params)
        assert fused is not None
        with optim.use_fused("off"):
            plain = state.apply_gradients(g)
        ft.assert_trees_close(fused[0], plain.params, what=f"params after update {i}")
        ft.assert_trees_close(fused[1], plain.opt_state, what=f"opt_state after update {i}")
        state = plain


def test_compiled_step_reports_grad_norm_on_both_paths():
    case = ft.ModelCase((3, 4, 2), "tanh", False, True, 0)
    for mode in ("on", "off"):
        apply, params = fzero.functionalize(case.make())
        state = fzero.TrainState.create(apply_fn=apply, params=params, tx=_txs()["clip_adamw"]())
        step = fzero.compile(train_step)
        with optim.use_fused(mode), fzero_kernels.force_backend("reference"):
            _, m = step(step.init(state), case.batch(4))
        assert "grad_norm" in m


def test_fused_path_is_taken_and_auto_skips_cpu():
    tx = optim.adamw(1e-3)
    params = {"w": torch.ones(4)}
    grads = {"w": torch.ones(4)}
    state = tx.init(params)
    with optim.use_fused("on"), fzero_kernels.force_backend("reference"):
        assert fused_update(tx, grads, state, params) is not None
    with optim.use_fused("auto"):
        assert fused_update(tx, grads, state, params) is None  # CPU tensors: the chain runs
    with optim.use_fused("on"):
        assert fused_update(optim.sgd(0.1), grads, optim.sgd(0.1).init(params), params) is None  # not adam
    with pytest.raises(ValueError, match="use_fused"):
        with optim.use_fused("sometimes"):
            pass


TRITON_CHECK = r"""
import os, torch, torch.nn.functional as F
import fzero, fzero_kernels, fzero.testing as ft
from fzero import optim
case = ft.ModelCase((3, 5, 2), "tanh", True, True, 3)
def train_step(state, batch):
    loss, g = fzero.value_and_grad(lambda p: F.mse_loss(state.apply_fn(p, batch["x"]), batch["y"]))(state.params)
    return state.apply_gradients(g), {"loss": loss}
out = []
for mode in ("on", "off"):
    apply, params = fzero.functionalize(case.make())
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.chain(optim.clip_by_global_norm(0.5), optim.adamw(1e-2)))
    with optim.use_fused(mode):
        assert fzero_kernels.backend_for(params["0.weight"]) == "triton"
        for i in range(3):
            state, _ = train_step(state, case.batch(4, i))
    out.append(state.params)
ft.assert_trees_close(out[0], out[1])
print("triton-ok")
"""


@pytest.mark.slow
def test_fused_triton_kernel_under_the_interpreter_equals_unfused():
    pytest.importorskip("triton", reason="triton is in the test extras")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "triton-ok" in r.stdout, r.stderr[-3000:]
