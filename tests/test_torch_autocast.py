"""``torch_autocast`` (DeepSpeed's ``torch_autocast`` section) on real gloo ranks against plain
PyTorch, and configs that name the bf16 modes and ``torch_autocast`` training on 2 ranks.

Reference, on every rank in the same job: the fp32 module, each rank's slice of the global
batch run forward under ``torch.autocast("cpu", torch.bfloat16)`` and backward, the
gradients averaged over the slices the way DeepSpeed 0.19 reduces them: in fp32 without
ZeRO; at ZeRO 1-3 the gradients of parameters whose module's class is listed in
``lower_precision_safe_modules`` (default Linear, Conv1d/2d/3d) in bf16 (each slice's
gradient rounded to bf16, the mean rounded to bf16), the others in fp32; then
``torch.optim.AdamW`` on the fp32 parameters.

Tolerance: fp32 reduction order (the order two fp32 values are summed), relative 1e-5 on
parameters and losses (``fzero.testing.TOLERANCES``' "same math" bound over 10 steps).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fzero
import fzero.testing as ft
from fzero import optim

BF16 = torch.bfloat16
CONFIGS = Path(__file__).parent / "data" / "ds_configs"


class _Net(nn.Module):
    """Linear layers (the default safe modules) and LayerNorms (not), the hidden ones in a
    ModuleList: ZeRO-3 gathers them block by block (its units) and frees them after use."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32)) for _ in range(2))
        self.out = nn.Linear(32, 4)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.out(x)


def _names_of(cls) -> set[str]:
    """The parameters of modules of exactly ``cls``, by name (as DeepSpeed marks them)."""
    return {f"{m_name}.{n}" for m_name, m in _Net().named_modules() if type(m) is cls
            for n, _ in m.named_parameters(recurse=False)}


def _model():
    torch.manual_seed(0)
    return _Net()


def _batches(steps=4, rows=8):
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(rows, 8, generator=g), "y": torch.randn(rows, 4, generator=g)} for _ in range(steps)]


def _reference(batches, world, low: set[str]):
    ref = copy.deepcopy(_model())
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for b in batches:
        loss, slices = ft.torch_rank_grads(ref, b, world, autocast=BF16)
        for n, p in ref.named_parameters():
            if n in low:
                p.grad = (sum(s[n].to(BF16).float() for s in slices) / world).to(BF16).float()
            else:
                p.grad = sum(s[n] for s in slices) / world
        opt.step()
        losses.append(loss)
    return losses, {n: p.detach().clone() for n, p in ref.named_parameters()}


def _close(a, b, rtol=1e-5):
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)) for k in b) <= rtol


def _against_torch():
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = _batches()
    linear, norm = _names_of(nn.Linear), _names_of(nn.LayerNorm)
    out = {}
    for zero, modules, low in [(0, None, set()), (2, None, linear), (3, None, linear),
                               (2, ["torch.nn.LayerNorm"], norm), (1, [], set())]:
        apply, params = fzero.functionalize(_model())
        state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-2, weight_decay=0.1))
        step = fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), zero=zero, torch_autocast="bf16",
                             lower_precision_safe_modules=modules)
        state = step.init(state)
        losses = []
        for b in batches:
            rows = b["x"].shape[0] // world
            state, metrics = step(state, {k: v[rank * rows:(rank + 1) * rows] for k, v in b.items()})
            losses.append(float(metrics["loss"]))
        got = fzero.gather(state.params)
        want_losses, want = _reference(batches, world, low)
        _, other = _reference(batches, world, linear if not low else set())  # the other rounding: must differ
        out[(zero, str(modules))] = {
            "params": _close(got, want), "losses": all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, want_losses)),
            "other_differs": not _close(got, other, rtol=1e-6), "dtypes": {str(v.dtype) for v in got.values()},
            "master": state.master is None,
        }
    return out


def _configs():
    """Each config trains 4 steps on 2 ranks; what it kept and whether the loss fell."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in ("bf16_master_weights_zero2", "bf16_master_weights_offload_zero3", "torch_autocast_zero2"):
        apply, params = fzero.functionalize(_model())
        state = fzero.TrainState.create(apply_fn=apply, params=params)
        step = fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), config=str(CONFIGS / f"{name}.json"))
        state = step.init(state)
        b = _batches(1, 4 * world)[0]
        local = {k: v[rank * 4:(rank + 1) * 4] for k, v in b.items()}
        losses = []
        for _ in range(6):
            state, metrics = step(state, local)
            losses.append(float(metrics["loss"]))
        master = None if state.master is None else fzero.gather(state.master)
        moments = {str(x.dtype) for x in fzero.tree.leaves(state.opt_state)
                   if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel() > 1}
        out[name] = {"losses": losses, "params": {str(v.dtype) for v in fzero.gather(state.params).values()},
                     "master": None if master is None else {str(v.dtype) for v in master.values()},
                     "moments": moments, "options": (step.options.precision, step.options.master_weights,
                                                     step.options.optimizer_states, step.options.torch_autocast)}
    return out


@pytest.mark.multirank
@pytest.mark.slow
def test_torch_autocast_equals_plain_torch_autocast_with_deepspeeds_gradient_reduction(ranks):
    for res in ranks(2).run(_against_torch):
        for case, r in res.items():
            assert r["params"] and r["losses"], (case, r)
            assert r["dtypes"] == {"torch.float32"} and r["master"], (case, r)  # fp32 weights, no copies
            # The reference with the other rounding is another trajectory: the check can fail.
            assert r["other_differs"], (case, r)


@pytest.mark.multirank
@pytest.mark.slow
def test_configs_naming_the_bf16_modes_and_torch_autocast_train(ranks):
    for res in ranks(2).run(_configs):
        r = res["bf16_master_weights_zero2"]
        assert r["options"] == ("bf16", "bf16", "bf16", None), r
        assert r["params"] == r["master"] == r["moments"] == {"torch.bfloat16"}, r
        r = res["bf16_master_weights_offload_zero3"]
        assert r["options"] == ("bf16", "bf16", "fp32", None), r
        assert r["params"] == r["master"] == {"torch.bfloat16"} and r["moments"] == {"torch.float32"}, r
        r = res["torch_autocast_zero2"]
        assert r["options"] == ("fp32", "fp32", "fp32", "bf16") and r["master"] is None, r
        assert r["params"] == r["moments"] == {"torch.float32"}, r
        for name, r in res.items():
            assert r["losses"][-1] < r["losses"][0], (name, r)


def test_config_reads_the_torch_autocast_section_as_deepspeed_does():
    cfg = fzero.Config.load(str(CONFIGS / "torch_autocast_zero2.json"))
    opts = cfg.compile_options()
    assert opts.torch_autocast == "bf16"
    assert opts.lower_precision_safe_modules == ("torch.nn.modules.linear.Linear", "torch.nn.Conv2d")
    default = json.loads((CONFIGS / "torch_autocast_zero2.json").read_text())
    del default["torch_autocast"]["lower_precision_safe_modules"], default["torch_autocast"]["dtype"]
    opts = fzero.Config.load(default).compile_options()
    assert opts.torch_autocast == "bf16" and opts.lower_precision_safe_modules is None


@pytest.mark.parametrize("section, says", [
    ({"enabled": True, "lower_precision_safe_modules": ["torch.nn.Lineer", "nope"]},
     "'torch.nn.Lineer' does not import"),
    ({"enabled": True, "dtype": "int8"}, "torch_autocast.dtype must be one of"),
])
def test_a_bad_torch_autocast_section_is_named(section, says):
    with pytest.raises(ValueError, match=says):
        fzero.Config.load({"train_micro_batch_size_per_gpu": 4, "torch_autocast": section})


def test_torch_autocast_excludes_low_precision_weights():
    with pytest.raises(ValueError, match="torch_autocast computes with fp32 weights"):
        fzero.Config.load({"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
                           "torch_autocast": {"enabled": True}})
    with pytest.raises(ValueError, match="excludes precision='bf16'"):
        fzero.compile(ft.mse_step, precision="bf16", torch_autocast="bf16")
    with pytest.raises(ValueError, match="lower_precision_safe_modules= needs torch_autocast='bf16'"):
        fzero.compile(ft.mse_step, lower_precision_safe_modules=["torch.nn.Linear"])
