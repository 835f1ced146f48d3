"""The fused optimizer path (fzero_kernels under fzero.optim) equals the unfused chain."""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
import fzero.testing as ft
import fzero_kernels
import fzero_kernels._common
from fzero import optim
from fzero.optim.fused import fused_update



def _adamw_calls() -> int:
    """Launches of the fused AdamW so far, per leaf or multi-tensor, reference backend."""
    import fzero_kernels._common

    return sum(n for (name, backend), n in fzero_kernels._common.CALLS.items()
               if name in ("fzero_kernels.adamw_", "fzero_kernels.adamw_multi_") and backend == "reference")

def _txs():
    sched = optim.schedules.warmup_cosine(1e-2, warmup=2, total=8)
    return {
        "adamw": lambda: optim.adamw(1e-2, weight_decay=0.1),
        "adamw_masked_sched": lambda: optim.adamw(sched, weight_decay=0.1, mask=lambda p: {k: k.endswith("weight") for k in p}),
        "adam_l2": lambda: optim.adam(3e-3, weight_decay=0.05),
        "clip_adamw": lambda: optim.chain(optim.clip_by_global_norm(0.1), optim.adamw(1e-2)),
    }


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
        step = fzero.compile(ft.mse_step)
        with optim.use_fused(mode), fzero_kernels.force_backend("reference"):
            _, m = step(step.init(state), case.batch(4))
        assert "grad_norm" in m


def test_torch_adamw_on_donated_leaves_updates_in_place_and_owns_nothing_gracefully():
    """On the CPU, a donated state of dense leaves goes to torch's fused AdamW as it is: the
    leaves are updated in place, as ``torch.optim.AdamW(fused=True)`` updates them, one of
    them with its decay masked off; and a rank whose pieces are all empty (it owns nothing
    of a small model under ZeRO) has nothing to update."""
    torch.manual_seed(0)
    params = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    grads = {"w": torch.randn(3, 4), "b": torch.randn(4)}
    tx = optim.adamw(1e-2, weight_decay=0.1, mask={"w": True, "b": False})
    ref = {k: nn.Parameter(v.clone()) for k, v in params.items()}
    torch_opt = torch.optim.AdamW([{"params": [ref["w"]], "weight_decay": 0.1},
                                   {"params": [ref["b"]], "weight_decay": 0.0}], lr=1e-2, fused=True)
    for k in ref:
        ref[k].grad = grads[k].clone()
    torch_opt.step()
    where = {k: v.data_ptr() for k, v in params.items()}
    with optim.use_fused("auto"):
        new, _ = fused_update(tx, grads, tx.init(params), params, donate=True)
    assert {k: v.data_ptr() for k, v in new.items()} == where  # in place
    for k in params:
        assert torch.equal(new[k], ref[k].detach()), k
    empty = {"w": torch.empty(0), "b": torch.empty(0)}
    with optim.use_fused("auto"):
        new, _ = fused_update(tx, empty, tx.init(empty), empty, donate=True)
    assert all(v.numel() == 0 for v in new.values())


def test_fused_path_is_taken_and_auto_on_the_cpu_only_for_adam():
    tx = optim.adamw(1e-3)
    params = {"w": torch.ones(4)}
    grads = {"w": torch.ones(4)}
    state = tx.init(params)
    with optim.use_fused("on"), fzero_kernels.force_backend("reference"):
        assert fused_update(tx, grads, state, params) is not None
    with optim.use_fused("auto"):  # CPU tensors: torch's own fused kernel for Adam(W), the chain for the rest
        assert fused_update(tx, grads, state, params) is not None
        lion = optim.lion(1e-3)
        assert fused_update(lion, grads, lion.init(params), params) is None
    with optim.use_fused("on"):  # a chain that is not an alias (after a clip) runs unfused
        tx = optim.chain(optim.scale(2.0), optim.sgd(0.1))
        assert fused_update(tx, grads, tx.init(params), params) is None
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


# --------------------------------------------------------------------------- parameter layouts


class _Strided(nn.Module):
    """Parameters whose memory is not in row-major order: a transposed matrix, and a
    strided view with gaps between its elements."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.w = nn.Parameter(torch.randn(4, 3).t())  # shape (3, 4), stride (1, 3)
        self.v = nn.Parameter(torch.randn(4, 9).as_strided((4, 2), (9, 4)))
        self.b = nn.Parameter(torch.randn(2))

    def forward(self, x):
        return torch.tanh(x @ self.w) @ self.v + self.b


def _strided_batches(n):
    g = torch.Generator().manual_seed(6)
    return [{"x": torch.randn(n, 3, generator=g), "y": torch.randn(n, 2, generator=g)} for _ in range(5)]


def _torch_adamw_params(batches):
    ref = _Strided()
    assert not ref.w.is_contiguous() and not ref.v.is_contiguous()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for b in batches:
        opt.zero_grad()
        F.mse_loss(ref(b["x"]), b["y"]).backward()
        opt.step()
    return {k: v.detach() for k, v in ref.named_parameters()}


def _train_strided(step, batches, mode):
    apply, params = fzero.functionalize(_Strided())
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-2, weight_decay=0.1))
    calls = _adamw_calls()
    with optim.use_fused(mode), fzero_kernels.force_backend("reference"):
        state = step.init(state)
        for b in batches:
            state, _ = step(state, b)
    ran_fused = _adamw_calls() > calls
    assert ran_fused == (mode == "on"), (mode, ran_fused)
    return fzero.gather(state.params)


@pytest.mark.parametrize("mode", ["on", "off"])
def test_non_contiguous_parameters_train_like_torch_adamw(mode):
    batches = _strided_batches(8)
    got = _train_strided(fzero.compile(ft.mse_step), batches, mode)
    ft.assert_trees_close(got, _torch_adamw_params(batches), what=f"params, fused {mode}")


def _strided_data_parallel(mode):
    n, r = dist.get_world_size(), dist.get_rank()
    batches = _strided_batches(4 * n)
    step = fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), zero=0)
    got = _train_strided(step, [ft.local_batch(b, n, r) for b in batches], mode)
    ft.assert_trees_close(got, _torch_adamw_params(batches), what=f"params, fused {mode}, rank {r}")
    return True


@pytest.mark.multirank
@pytest.mark.slow
def test_non_contiguous_parameters_under_data_parallelism(ranks):
    for mode in ("on", "off"):
        assert ranks(2).run(_strided_data_parallel, mode) == [True, True]
