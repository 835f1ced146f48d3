"""The user's step keeps single-device semantics under ZeRO.

What a user does with gradients and parameters inside ``train_step`` -- a global norm
summed over ``fzero.tree.leaves(grads)``, manual clipping, an inf-norm, a finiteness check,
logging a parameter norm, ``argnums`` -- gives the answer the same ``train_step`` gives in
one process on the whole batch (the reference: plain tensors, no fzero transform), or an
error naming the operation and the fix. Never a rank-local value.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fzero
import fzero.testing as ft
from fzero import optim, tree

pytestmark = [pytest.mark.multirank, pytest.mark.slow]


class _Real(nn.Module):
    """What real models bring: a frozen input layer, a float buffer and an integer buffer
    used (and updated) in forward, and two blocks of a ModuleList sharing one weight (a tie
    across ZeRO-3 units)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 7).requires_grad_(False)
        self.blocks = nn.ModuleList([nn.Linear(7, 7), nn.Linear(7, 7)])
        self.blocks[1].weight = self.blocks[0].weight
        self.out = nn.Linear(7, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 7))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        h = torch.tanh(self.inp(x)) * self.scale
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.out(h)


def _model(kind="mlp"):
    torch.manual_seed(0)
    if kind == "real":
        return _Real()
    # Odd sizes: the leaves' pieces are uneven, and a rank's piece of a small leaf is empty.
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(4 * n, 5, generator=g), "y": torch.randn(4 * n, 3, generator=g)} for _ in range(3)]


def _statistics_step(state, batch):
    """A step written for one device, as a user writes it: statistics over the gradient and
    parameter trees, then manual clipping by the global norm, then the update."""

    def loss_fn(p):
        return F.mse_loss(state.apply_fn(p, batch["x"]), batch["y"])

    loss, grads = fzero.value_and_grad(loss_fn)(state.params)
    leaves = tree.leaves(grads)  # frozen parameters have None: not leaves
    trained = sorted(k for k, g in grads.items() if g is not None)
    gnorm = torch.sqrt(sum(g.pow(2).sum() for g in leaves))
    stats = {
        "loss": loss,
        "grad_norm": gnorm,
        "grad_norm_stacked": torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in leaves])),
        "grad_inf_norm": torch.stack([g.norm(float("inf")) for g in leaves]).max(),
        "grad_max": torch.stack([torch.max(g) for g in leaves]).max(),
        "grad_min": torch.stack([g.amin() for g in leaves]).min(),
        "first_grad_mean": grads[trained[0]].mean(),
        "last_grad_sum": torch.sum(grads[trained[-1]]),
        "finite": torch.stack([torch.isfinite(g).all() for g in leaves]).all(),
        "positive": sum(torch.count_nonzero(g > 0) for g in leaves),
        "param_sq": sum((p * p).sum() for p in tree.leaves(state.params)),
        "decayed_dot": sum((grads[k] * state.params[k]).sum() for k in trained),
        "numel": torch.tensor(float(sum(g.numel() for g in leaves))),
        "ndims": torch.tensor([float(g.ndim) for g in leaves]),
    }
    scale = torch.clamp(0.05 / (gnorm + 1e-6), max=1.0)
    grads = tree.map(lambda g: g * scale, grads)
    grads = tree.map(lambda g: g.clamp(-0.01, 0.01), grads)
    return state.apply_gradients(grads), stats


def _create(tx=None, kind="mlp"):
    apply, params = fzero.functionalize(_model(kind))
    return fzero.TrainState.create(apply_fn=apply, params=params, tx=tx or optim.adamw(1e-2, weight_decay=0.1))


def _run_sharded(stage, precision, kind="mlp"):
    n, r = dist.get_world_size(), dist.get_rank()
    step = fzero.compile(_statistics_step, fzero.Mesh(dp=-1), zero=stage, precision=precision)
    state = step.init(_create(kind=kind))
    stats = []
    for b in _batches(n):
        state, m = step(state, ft.local_batch(b, n, r))
        stats.append({k: v.detach().clone() for k, v in m.items()})
    return stats, fzero.gather(state.params), {k: v.clone() for k, v in state.buffers.items()}


@pytest.mark.parametrize("kind", ["mlp", "real"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_statistics_and_manual_clipping_in_the_step_match_one_process(ranks, stage, kind):
    ref_state, ref_stats = _create(kind=kind), []
    for b in _batches(2):  # one process, the whole batch, plain tensors
        ref_state, m = _statistics_step(ref_state, b)
        ref_stats.append(m)
    for stats, params, buffers in ranks(2).run(_run_sharded, stage, "fp32", kind):
        for got, want in zip(stats, ref_stats):
            assert not got.pop("skipped")  # fzero's own metric: the update was applied
            assert got.keys() == want.keys()
            for k in want:
                torch.testing.assert_close(got[k], want[k], **ft.tolerance("fp32"), msg=k)
        ft.assert_trees_close(params, ref_state.params, tol="fp32")
        assert buffers.keys() == ref_state.buffers.keys()
        for k in buffers:
            assert torch.equal(buffers[k], ref_state.buffers[k]), k


@pytest.mark.parametrize("kind", ["mlp", "real"])
def test_statistics_under_bf16_are_the_global_ones(ranks, kind):
    """Under mixed precision the step sees the fp32 gradients, whole or partitioned: the
    statistics agree on every rank and with each other."""
    trainable = sum(p.numel() for p in _model(kind).parameters() if p.requires_grad)  # a tie counts once
    for stats, _, _ in ranks(2).run(_run_sharded, 2, "bf16", kind):
        for s in stats:
            assert bool(s["finite"]) and s["numel"].item() == trainable
            torch.testing.assert_close(s["grad_norm"], s["grad_norm_stacked"])
    a, b = ranks(2).run(_run_sharded, 2, "bf16", kind)
    for sa, sb in zip(a[0], b[0]):
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


def _refused(stage):
    """What cannot be done piece by piece raises, naming the operation."""
    n, r = dist.get_world_size(), dist.get_rank()
    errors = {}

    def train_step(state, batch):
        loss, grads = fzero.value_and_grad(lambda p: F.mse_loss(state.apply_fn(p, batch["x"]), batch["y"]))(
            state.params)
        g = grads["0.weight"]
        uses = {
            "indexing": lambda: g[0],
            "a sum over a dim": lambda: g.sum(dim=0),
            "a matmul": lambda: g @ torch.ones(5),
            "torch.cat": lambda: torch.cat([g, g]),
            "a broadcast": lambda: g * torch.ones(5),
            "a transpose": lambda: g.t(),
            "bool": lambda: bool(g),
        }
        for what, use in uses.items():
            try:
                use()
                errors[what] = None
            except (TypeError, AttributeError) as e:
                errors[what] = str(e)
        return state.apply_gradients(grads), {"loss": loss}

    step = fzero.compile(train_step, fzero.Mesh(dp=-1), zero=stage)
    b = _batches(n)[0]
    step(step.init(_create()), ft.local_batch(b, n, r))
    return errors


@pytest.mark.parametrize("stage", [1, 3])
def test_what_cannot_be_done_piece_by_piece_is_refused_by_name(ranks, stage):
    for errors in ranks(2).run(_refused, stage):
        for what, e in errors.items():
            assert e is not None, what
            assert "global shape (7, 5)" in e and "fzero.gather" in e, (what, e)
        assert "indexing" in errors["indexing"] and "over a dim" in errors["a sum over a dim"]
        assert "matmul" in errors["a matmul"] and "cat" in errors["torch.cat"]
        assert "shape (5,)" in errors["a broadcast"] and "'.t'" in errors["a transpose"]


# --------------------------------------------------------------------------- argnums


def _two_trees_step(state, batch):
    """``argnums=(0, 1)``: the gradient of the parameters and of a per-rank input (an
    adversarial perturbation's direction, as FGSM takes it)."""

    def loss_fn(p, x):
        return F.mse_loss(state.apply_fn(p, x), batch["y"])

    loss, (grads, gx) = fzero.value_and_grad(loss_fn, argnums=(0, 1))(state.params, batch["x"])
    return state.apply_gradients(grads), {"loss": loss, "gx": gx}


def _argnums(stage):
    n, r = dist.get_world_size(), dist.get_rank()
    step = fzero.compile(_two_trees_step, fzero.Mesh(dp=-1), zero=stage)
    state = step.init(_create(optim.sgd(0.1)))
    try:
        b = _batches(n)[0]
        state, m = step(state, ft.local_batch(b, n, r))
    except TypeError as e:
        return str(e)
    return m["gx"], fzero.gather(state.params)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_argnums_gives_the_global_batch_gradients_of_every_argument(ranks, stage):
    ref_state = _create(optim.sgd(0.1))
    b = _batches(2)[0]
    ref_state, ref = _two_trees_step(ref_state, b)
    for r, out in enumerate(ranks(2).run(_argnums, stage)):
        assert not isinstance(out, str), out
        gx, params = out
        # this rank's rows of the one-process input gradient (the loss is the global batch's mean)
        torch.testing.assert_close(gx, ref["gx"].chunk(2)[r], **ft.tolerance("fp32 small values"))
        ft.assert_trees_close(params, ref_state.params, tol="fp32")


def _replicated_argument(stage):
    """A tensor that is the same on every rank, differentiated beside the parameters."""
    n, r = dist.get_world_size(), dist.get_rank()
    temperature = torch.tensor([1.5])  # replicated: its gradient would be a mean over ranks

    def train_step(state, batch):
        def loss_fn(p, t):
            return F.mse_loss(state.apply_fn(p, batch["x"]) / t, batch["y"])

        loss, (grads, _) = fzero.value_and_grad(loss_fn, argnums=(0, 1))(state.params, temperature)
        return state.apply_gradients(grads), {"loss": loss}

    step = fzero.compile(train_step, fzero.Mesh(dp=-1), zero=stage)
    try:
        step(step.init(_create(optim.sgd(0.1))), ft.local_batch(_batches(n)[0], n, r))
    except TypeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("stage", [0, 3])
def test_a_replicated_argument_beside_the_parameters_is_refused_by_name(ranks, stage):
    for msg in ranks(2).run(_replicated_argument, stage):
        assert msg and "argument 1 of argnums" in msg and "same values on every one of the 2 dp ranks" in msg, msg
        assert "state.params" in msg


def _input_gradient_only(stage):
    n, r = dist.get_world_size(), dist.get_rank()
    b = ft.local_batch(_batches(n)[0], n, r)

    def train_step(state, batch):
        gx = fzero.grad(lambda x: F.mse_loss(state.apply_fn(state.params, x), batch["y"]))(batch["x"])
        return state, {"gx": gx}

    step = fzero.compile(train_step, fzero.Mesh(dp=-1), zero=stage)
    state = step.init(_create(optim.sgd(0.1)))
    return step(state, b)[1]["gx"]


@pytest.mark.parametrize("stage", [0, 2])
def test_the_gradient_of_the_input_alone_is_this_ranks_rows_of_the_global_one(ranks, stage):
    state, b = _create(optim.sgd(0.1)), _batches(2)[0]
    ref = fzero.grad(lambda x: F.mse_loss(state.apply_fn(state.params, x), b["y"]))(b["x"])
    for r, gx in enumerate(ranks(2).run(_input_gradient_only, stage)):
        torch.testing.assert_close(gx, ref.chunk(2)[r], **ft.tolerance("fp32 small values"))
