"""fzero.clip: clipping an update's gradients to a global L2 norm.

The reference is plain torch: ``loss.backward()``, ``torch.nn.utils.clip_grad_norm_`` (whose
return value is the norm before clipping), ``torch.optim.SGD.step()``, on a copy of the
same module with the same batches.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import fzero
import fzero.testing as ft
from fzero import optim


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _batches(n=3, rows=6, scale=3.0):
    g = torch.Generator().manual_seed(1)
    return [{"x": scale * torch.randn(rows, 4, generator=g), "y": scale * torch.randn(rows, 2, generator=g)}
            for _ in range(n)]


def _torch_run(model, batches, clip_norm, lr=0.1):
    """torch's own loop: the parameters after each step and the norms clip_grad_norm_ returned."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    norms = []
    for b in batches:
        opt.zero_grad()
        F.mse_loss(model(b["x"]), b["y"]).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm))
        opt.step()
    return dict(model.named_parameters()), torch.stack(norms)


def _fzero_run(step, model, batches, lr=0.1):
    apply, params = fzero.functionalize(model)
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(lr)))
    norms = []
    for b in batches:
        state, metrics = step(state, b)
        norms.append(metrics["grad_norm"])
    return state.params, torch.stack(norms)


@pytest.mark.parametrize("clip_norm", [0.05, 1e3], ids=["clipping", "below-the-bound"])
def test_clip_is_torchs_clip_grad_norm_before_the_optimizer(clip_norm):
    model = _model()
    batches = _batches()
    ref_params, ref_norms = _torch_run(copy.deepcopy(model), batches, clip_norm)
    params, norms = _fzero_run(fzero.clip(ft.mse_step, clip_norm), model, batches)
    ft.assert_trees_close(norms, ref_norms.detach())
    ft.assert_trees_close(dict(params), {k: v.detach() for k, v in ref_params.items()})
    if clip_norm < 1:  # the bound was active: the runs would differ without it
        unclipped, _ = _torch_run(copy.deepcopy(_model()), batches, float("inf"))
        assert not torch.allclose(unclipped["0.weight"], ref_params["0.weight"])


def test_compile_clips_the_accumulated_update_as_torch_clips_the_full_batch():
    """clip_norm= under accumulate=2: the norm is the one of the update's averaged gradient,
    which for a mean loss over equal micro-batches is the full batch's."""
    model = _model()
    batches = _batches(rows=8)
    ref_params, ref_norms = _torch_run(copy.deepcopy(model), batches, 0.05)
    step = fzero.compile(ft.mse_step, clip_norm=0.05, accumulate=2)
    params, norms = _fzero_run(step, model, batches)
    ft.assert_trees_close(norms, ref_norms.detach())
    ft.assert_trees_close(dict(params), {k: v.detach() for k, v in ref_params.items()})


def test_compile_puts_the_clip_innermost_and_reports_the_norm_once():
    step = fzero.compile(ft.mse_step, clip_norm=1.0, accumulate=2, precision="bf16")
    names = []
    s = step.inner
    while s is not None:
        names.append(s.__name__.split("(")[0])
        s = s.inner
    assert names == ["mixed_precision", "accumulate", "clip", "mse_step"]
    apply, params = fzero.functionalize(_model())
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1)))
    _, metrics = step(state, _batches(1)[0])
    assert sorted(metrics) == ["grad_norm", "loss", "skipped"]
    assert metrics["grad_norm"].dim() == 0


def test_a_bad_clip_norm_is_named():
    with pytest.raises(ValueError, match=r"fzero.clip: clip_norm=0 must be a positive number"):
        fzero.clip(ft.mse_step, 0)
    with pytest.raises(ValueError, match=r"fzero.compile: clip_norm=-1.0 must be a positive number or None"):
        fzero.compile(ft.mse_step, clip_norm=-1.0)
