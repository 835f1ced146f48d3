"""accumulate and mixed_precision in one process, and their compositions, against the
plain step (fp32) or a plain step that casts the same way (bf16 / fp16)."""

import copy
import itertools
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import fzero
import fzero.testing as ft
from fzero import optim
from fzero.transforms.mixed_precision._scaler import LossScaler, update_scaler

# AdamW's eps at 1e-3, not torch's 1e-8: a gradient component that cancels to ~0 in exact
# arithmetic (a LayerNorm over one feature, a saturated unit) is left with rounding noise whose
# size depends on the summation order, and Adam divides it by sqrt(v) + eps ~ eps: with 1e-8 the
# noise becomes a full-size step and two correct orders differ by far more than fp32's 1e-5
# (seen on drawn models, 2.4e-5 relative after 6 steps). With 1e-3 the update's sensitivity to
# that noise is bounded, and a wrong average of the micro-batches still fails by orders of
# magnitude; SGD beside it sees the gradient's scale directly.
TXS = {"sgd": lambda: optim.sgd(0.05, momentum=0.9), "adamw": lambda: optim.adamw(1e-2, eps=1e-3, weight_decay=0.1)}


def make(case, tx_name):
    apply, params = fzero.functionalize(case.make())
    return fzero.TrainState.create(apply_fn=apply, params=params, tx=TXS[tx_name]())


@settings(max_examples=20, deadline=None)
@given(ft.models(), st.integers(1, 4), st.integers(1, 3), st.sampled_from(sorted(TXS)))
def test_accumulate_equals_the_full_batch_step(case, k, per_micro, tx_name):
    batches = [case.batch(k * per_micro, i) for i in range(6)]
    ref, ref_losses = ft.run_steps(ft.mse_step, make(case, tx_name), batches)
    step = fzero.accumulate(ft.mse_step, micro_batches=k)
    state, losses = ft.run_steps(step, step.init(make(case, tx_name)), batches)
    ft.assert_trees_close(losses, ref_losses)
    ft.assert_trees_close(state.params, ref.params)
    assert int(state.step) == 6


def test_accumulate_bad_batch_names_both_numbers():
    step = fzero.accumulate(ft.mse_step, micro_batches=3)
    case = ft.ModelCase((2, 2), "tanh", False, True, 0)
    with pytest.raises(ValueError, match=r"leading size 4 \(at \['x'\]\) does not divide into 3 micro-batches"):
        step(make(case, "sgd"), case.batch(4))
    with pytest.raises(ValueError, match="micro_batches=0"):
        fzero.accumulate(ft.mse_step, micro_batches=0)


def lowp(p, dtype):
    return fzero.tree.map(lambda x: x.to(dtype), p)


def autocast_step(dtype):
    """The reference mixed-precision step: the fp32 module under torch.autocast, with its
    parameters rounded to ``dtype`` once (as fzero's low-precision copies are), so autocast's
    casts give the same bits and its norms take the same fp32 values."""

    def step(state, batch):
        def loss_fn(p):
            with torch.autocast("cpu", dtype=dtype):
                return F.mse_loss(state.apply_fn(fzero.tree.map(torch.Tensor.float, lowp(p, dtype)), batch["x"]),
                                  batch["y"])

        loss, grads = fzero.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads), {"loss": loss}

    return step


@settings(max_examples=10, deadline=None)
@given(ft.models(), st.sampled_from(sorted(TXS)))
def test_bf16_equals_a_plain_step_under_autocast(case, tx_name):
    batches = [case.batch(6, i) for i in range(5)]
    ref, ref_losses = ft.run_steps(autocast_step(torch.bfloat16), make(case, tx_name), batches)
    step = fzero.mixed_precision(ft.mse_step, "bf16")
    state, losses = ft.run_steps(step, step.init(make(case, tx_name)), batches)
    ft.assert_trees_close(losses, ref_losses, rtol=0, atol=0)
    ft.assert_trees_close(state.master, ref.params, rtol=0, atol=0)  # fp32 masters
    ft.assert_trees_close(state.params, lowp(ref.params, torch.bfloat16), rtol=0, atol=0)
    # and within bf16's tolerance of the fp32 trajectory -- under SGD: Adam divides by
    # sqrt(v), so a gradient component near zero flips its update on one bf16 rounding
    _, bf16_sgd = ft.run_steps(step, step.init(make(case, "sgd")), batches)
    _, fp32_sgd = ft.run_steps(ft.mse_step, make(case, "sgd"), batches)
    ft.assert_trees_close(bf16_sgd.float(), fp32_sgd, tol="bf16 params vs fp32")


def scaled_fp16_step(scale):
    def step(state, batch):
        def loss_fn(p):
            with torch.autocast("cpu", dtype=torch.float16):
                return F.mse_loss(state.apply_fn(lowp(p, torch.float16), batch["x"]), batch["y"]).float() * scale

        loss, grads = fzero.value_and_grad(loss_fn)(state.params)
        grads = fzero.tree.map(lambda g: g / scale, grads)
        return state.apply_gradients(grads), {"loss": loss / scale}

    return step


def test_fp16_static_scale_equals_a_step_that_scales_the_same_way():
    case = ft.ModelCase((3, 4, 2), "tanh", False, True, 1)
    batches = [case.batch(4, i) for i in range(3)]
    ref, ref_losses = ft.run_steps(scaled_fp16_step(128.0), make(case, "sgd"), batches)
    step = fzero.mixed_precision(ft.mse_step, "fp16", loss_scale=128.0)
    state, losses = ft.run_steps(step, step.init(make(case, "sgd")), batches)
    ft.assert_trees_close(losses, ref_losses, rtol=0, atol=0)
    ft.assert_trees_close(state.master, ref.params, rtol=0, atol=0)
    _, m = step(state, batches[0])
    assert float(m["loss_scale"]) == 128.0 and not bool(m["skipped"])


def test_fp16_dynamic_scale_starts_at_2_16_and_skips_overflowing_updates():
    case = ft.ModelCase((3, 4, 2), "tanh", False, True, 1)
    step = fzero.mixed_precision(ft.mse_step, "fp16")
    state = step.init(make(case, "sgd"))
    assert float(state.loss_scaler.scale) == 2.0 ** 16
    _, m = step(state, case.batch(4, 0))
    assert float(m["loss_scale"]) == 2.0 ** 16


def test_fp16_overflow_skips_everything_and_hysteresis_then_halves():
    case = ft.ModelCase((3, 2), "tanh", False, True, 2)
    step = fzero.mixed_precision(ft.mse_step, "fp16")
    state = step.init(make(case, "adamw"))
    state, _ = step(state, case.batch(4, 0))  # one clean update
    bad = case.batch(4, 1)
    bad["y"][0, 0] = float("inf")
    before = fzero.gather(state)
    assert all(p.dtype == torch.float16 for p in state.params.values())
    scales = []
    for _ in range(3):
        state, m = step(state, bad)
        assert bool(m["skipped"])
        scales.append(float(m["loss_scale"]))
    # hysteresis 2: the first overflow only spends it; then the scale halves each time
    assert scales == [2.0 ** 16, 2.0 ** 16, 2.0 ** 15]
    assert float(state.loss_scaler.scale) == 2.0 ** 14
    ft.assert_trees_close(state.params, before.params, rtol=0, atol=0)
    ft.assert_trees_close(state.opt_state, before.opt_state, rtol=0, atol=0)
    assert int(state.step) == 1


# Sequences recorded from DeepSpeed 0.19.8 itself (a real engine at ZeRO stages 1-3, one
# rank): benchmarks/record_deepspeed_loss_scaler.py wrote them; see "about" in the file.
DEEPSPEED = json.loads((Path(__file__).parent / "data" / "deepspeed_loss_scaler.json").read_text())
assert DEEPSPEED["recorded_with"]["deepspeed"] == "0.19.8"
FP16_CASES = {c["name"]: c for c in DEEPSPEED["fp16"]}
BF16_CASES = {c["name"]: c for c in DEEPSPEED["bf16"]}
# Cases of over 1000 updates. The scaler replays them all; a compiled step (~10 ms an update
# here) replays DeepSpeed's defaults only, as a slow test: 2600 updates, two rises.
LONG = {name for name, c in FP16_CASES.items() if c["updates"] > 1000}
COMPILED_LONG = "window1000_defaults_long"


def scaler_options(case):
    o = case["fp16"]
    return dict(window=o["loss_scale_window"], hysteresis=o["hysteresis"],
                consecutive=o["consecutive_hysteresis"], min_scale=float(o["min_loss_scale"]))


@pytest.mark.parametrize("name", sorted(FP16_CASES))
def test_scaler_replays_deepspeed(name):
    case = FP16_CASES[name]
    o = case["fp16"]
    s = LossScaler.create(o["initial_scale_power"], o["hysteresis"])
    bad = set(case["overflow_at"])
    scales, hysteresis = [], []
    for u in range(case["updates"]):
        if u == case["raises_at"]:
            with pytest.raises(FloatingPointError, match="minimum loss scale"):
                update_scaler(s, u in bad, **scaler_options(case))
            break
        scales.append(float(s.scale))
        s = update_scaler(s, u in bad, **scaler_options(case))
        hysteresis.append(int(s.hysteresis))
    assert scales == case["loss_scale"]
    assert hysteresis == case["hysteresis"]
    final = case["final"]
    assert (float(s.scale), int(s.iter), int(s.last_overflow), int(s.hysteresis)) == (
        final["cur_scale"], final["cur_iter"], final["last_overflow_iter"], final["cur_hysteresis"])


def tiny_linear_step(state, batch):
    # Linear in the outputs, as in the recording: d loss / d out is a constant, so no
    # gradient overflows at any scale the cases reach, and an inf in the input makes
    # gradients non-finite exactly where it is injected.
    loss, grads = fzero.value_and_grad(lambda p: 1e-6 * state.apply_fn(p, batch["x"]).float().sum())(state.params)
    return state.apply_gradients(grads), {"loss": loss}


def replay_batches(updates, overflow_at, micro_batches, per_micro=2):
    g = torch.Generator().manual_seed(0)
    for u in range(updates):
        x = torch.randn(micro_batches * per_micro, 4, generator=g)
        if u in overflow_at:
            x[-per_micro, 0] = float("inf")  # the first row of the last micro-batch
        yield {"x": x}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == COMPILED_LONG else n
                                  for n in sorted(FP16_CASES) if n not in LONG or n == COMPILED_LONG])
@pytest.mark.filterwarnings("ignore:fzero.mixed_precision. 10 updates in a row:RuntimeWarning")  # the bursts
def test_compiled_fp16_step_replays_deepspeed(name):
    case = FP16_CASES[name]
    options = {**case["fp16"], "min_loss_scale": float(case["fp16"]["min_loss_scale"])}
    gas = case["gradient_accumulation_steps"]
    step = fzero.compile(tiny_linear_step, precision="fp16", accumulate=gas, **options)
    torch.manual_seed(0)
    apply, params = fzero.functionalize(torch.nn.Linear(4, 2))
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1)))
    scales, skipped = [], []
    for u, batch in enumerate(replay_batches(case["updates"], set(case["overflow_at"]), gas)):
        if u == case["raises_at"]:
            with pytest.raises(FloatingPointError, match="minimum loss scale"):
                step(state, batch)
            break
        state, m = step(state, batch)
        scales.append(float(m["loss_scale"]))
        skipped.append(bool(m["skipped"]))
    assert scales == case["loss_scale"]
    assert skipped == case["skipped"]
    assert int(state.step) == skipped.count(False)
    s, final = state.loss_scaler, case["final"]
    assert (float(s.scale), int(s.iter), int(s.last_overflow), int(s.hysteresis)) == (
        final["cur_scale"], final["cur_iter"], final["last_overflow_iter"], final["cur_hysteresis"])


def test_overflow_at_min_scale_is_an_error():
    s = LossScaler(torch.tensor(1.0, dtype=torch.float64), torch.tensor(5), torch.tensor(4), torch.tensor(1))
    with pytest.raises(FloatingPointError, match="minimum loss scale 1"):
        update_scaler(s, True, window=1000, hysteresis=2, consecutive=False, min_scale=1.0)


def test_check_grad_overflow_off_with_a_loss_scaler_is_an_error():
    with pytest.raises(ValueError, match=r"fzero.mixed_precision: check_grad_overflow=False with loss_scale='dynamic'"):
        fzero.mixed_precision(ft.mse_step, "fp16", check_grad_overflow=False)
    with pytest.raises(ValueError, match=r"check_grad_overflow='yes' must be True or False"):
        fzero.mixed_precision(ft.mse_step, "bf16", check_grad_overflow="yes")


def finite(tree_):
    return all(bool(torch.isfinite(x).all()) for x in fzero.tree.leaves(tree_) if isinstance(x, torch.Tensor))


@pytest.mark.parametrize("name", sorted(BF16_CASES))
def test_compiled_bf16_step_replays_deepspeed(name):
    case = BF16_CASES[name]
    check = case["bf16"].get("check_grad_overflow", True)
    # fzero follows DeepSpeed's ZeRO stages 1-2 (which agree); with the check off, its
    # stage 3 still skips, on the non-finite gradient norm it computes anyway.
    ds = case["by_zero_stage"]["1"]
    assert case["by_zero_stage"]["2"] == ds
    step = fzero.compile(tiny_linear_step, precision="bf16", check_grad_overflow=check)
    torch.manual_seed(0)
    apply, params = fzero.functionalize(torch.nn.Linear(4, 2))
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1)))
    skipped, params_finite = [], []
    for batch in replay_batches(case["updates"], set(case["overflow_at"]), 1):
        state, m = step(state, batch)
        assert "loss_scale" not in m  # bf16 scales nothing
        assert ("skipped" in m) == check
        skipped.append(bool(m.get("skipped", False)))
        params_finite.append(finite(state.params) and finite(state.master))
    assert skipped == ds["skipped"]
    assert params_finite == ds["params_finite"]


@pytest.mark.parametrize("order", ["compile", "accumulate outside"])
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_bf16_skipped_update_leaves_params_optimizer_state_and_step_bit_identical(order, micro_batches):
    case = ft.ModelCase((3, 4, 2), "tanh", False, True, 2)
    if order == "compile":
        step = fzero.compile(ft.mse_step, precision="bf16", accumulate=micro_batches)
    else:
        step = fzero.accumulate(fzero.mixed_precision(ft.mse_step, "bf16"), micro_batches)
    tx = optim.adamw(optim.schedules.linear_warmup(1e-2, warmup=10))  # a schedule: its count must hold
    apply, params = fzero.functionalize(case.make())
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=tx))
    state, m = step(state, case.batch(4, 0))
    assert not bool(m["skipped"]) and int(state.step) == 1
    before = fzero.gather(state)
    bad = case.batch(4, 1)
    bad["y"][0, 0] = float("inf")  # in the first micro-batch only: the whole update is skipped
    state, m = step(state, bad)
    assert bool(m["skipped"]) and "loss_scale" not in m
    for what in ("params", "opt_state"):
        ft.assert_trees_close(getattr(state, what), getattr(before, what), rtol=0, atol=0, what=what)
    ft.assert_trees_close(state.master, before.master, rtol=0, atol=0, what="master")
    assert int(state.step) == 1
    state, m = step(state, case.batch(4, 2))
    assert not bool(m["skipped"]) and int(state.step) == 2 and finite(state.master)


def test_bf16_with_the_check_off_applies_a_non_finite_update():
    """The documented choice: check_grad_overflow=False trusts the gradients, as DeepSpeed's
    ZeRO stages 1-2 do with bf16.check_grad_overflow false."""
    case = ft.ModelCase((3, 4, 2), "tanh", False, True, 2)
    step = fzero.mixed_precision(ft.mse_step, "bf16", check_grad_overflow=False)
    state = step.init(make(case, "sgd"))
    bad = case.batch(4, 1)
    bad["y"][0, 0] = float("inf")
    state, m = step(state, bad)
    assert "skipped" not in m and int(state.step) == 1
    assert not finite(state.master) and not finite(state.params)


def _bf16_inf_in_one_ranks_batch(stage):
    import torch.distributed as dist

    r = dist.get_rank()
    torch.manual_seed(0)
    # 16 weights in one flat group: rank 0 owns the first half at stages 1-3, so an inf at
    # input column 0 of rank 0's batch makes only rank 0's gradient piece non-finite;
    # rank 1 must skip on rank 0's word.
    apply, params = fzero.functionalize(torch.nn.Linear(16, 1, bias=False))
    step = fzero.compile(tiny_linear_step, fzero.Mesh(dp=-1), zero=stage, precision="bf16")
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-2)))
    g = torch.Generator().manual_seed(r)
    state, m = step(state, {"x": torch.randn(2, 16, generator=g)})
    first_skipped = bool(m["skipped"])
    before = fzero.gather(state)
    bad = torch.randn(2, 16, generator=g)
    if r == 0:
        bad[0, 0] = float("inf")
    state, m = step(state, {"x": bad})
    after = fzero.gather(state)
    same = all(torch.equal(a, b) for a, b in zip(
        fzero.tree.leaves((after.params, after.opt_state, after.master)),
        fzero.tree.leaves((before.params, before.opt_state, before.master))))
    return first_skipped, bool(m["skipped"]), same, int(state.step)


@pytest.mark.multirank
@pytest.mark.slow
def test_bf16_inf_in_one_ranks_batch_skips_on_every_rank(ranks):
    for stage in (0, 1, 2, 3):
        assert ranks(2).run(_bf16_inf_in_one_ranks_batch, stage) == [(False, True, True, 1)] * 2, stage


# --------------------------------------------------------------------------- what torch.autocast trains

NORMS = {"layer": lambda: torch.nn.LayerNorm(6), "batch": lambda: torch.nn.BatchNorm1d(6),
         "group": lambda: torch.nn.GroupNorm(2, 6)}


class _NormNet(torch.nn.Module):
    """Norm layers fed fp32 activations under autocast: the raw input, and a residual that
    stays fp32 (fp32 input + a bf16 Linear's output)."""

    def __init__(self, kind):
        super().__init__()
        self.norm_in, self.lin, self.norm_mid = NORMS[kind](), torch.nn.Linear(6, 6), NORMS[kind]()
        self.head = torch.nn.Linear(6, 2)

    def forward(self, x):
        r = x + self.lin(self.norm_in(x))
        return self.head(self.norm_mid(r))


def _norm_batches(n, rows=8):
    g = torch.Generator().manual_seed(5)
    return [{"x": torch.randn(rows, 6, generator=g) * 3 + 1, "y": torch.randn(rows, 2, generator=g)}
            for _ in range(n)]


def _autocast_reference(model, batches, dtype):
    """Plain PyTorch: the fp32 module, its forward under torch.autocast, backward, torch's SGD."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for b in batches:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            out = model(b["x"])
        loss = F.mse_loss(out.float(), b["y"])
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _norm_step(state, batch):
    loss, grads = fzero.value_and_grad(lambda p: F.mse_loss(state.apply_fn(p, batch["x"]).float(), batch["y"]))(
        state.params)
    return state.apply_gradients(grads), {"loss": loss}


def _trains_as_under_autocast(model, steps, precision, **options):
    """``model`` trained by the fzero step at ``precision`` (and ``options`` of
    ``fzero.compile``) and, from the same weights, by plain PyTorch under torch.autocast: the
    same losses and weights. Returns the fzero state and the reference module."""
    reference = copy.deepcopy(model)
    batches = _norm_batches(steps)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    ref_losses = _autocast_reference(reference, batches, dtype)
    apply, params = fzero.functionalize(model)
    step = fzero.compile(_norm_step, precision=precision, **({"loss_scale": None} if precision == "fp16" else {}),
                         **options)
    state, losses = ft.run_steps(step, step.init(fzero.TrainState.create(
        apply_fn=apply, params=params, tx=optim.sgd(0.05, momentum=0.9))), batches)
    ft.assert_trees_close(losses, torch.stack(ref_losses), tol=precision)
    ft.assert_trees_close(fzero.gather(state.master), {n: p for n, p in reference.named_parameters() if p.requires_grad},
                          tol=precision)
    return state, reference


@pytest.mark.parametrize("kind", sorted(NORMS))
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_norm_layers_fed_fp32_train_as_under_torch_autocast(kind, precision):
    torch.manual_seed(0)
    state, reference = _trains_as_under_autocast(_NormNet(kind), 4, precision)
    # BatchNorm's running statistics stay fp32, as the module's under autocast
    ft.assert_trees_close(dict(state.buffers), dict(reference.named_buffers()), tol=precision)
    assert all(b.dtype == r.dtype for b, r in zip(state.buffers.values(), reference.buffers()))


@pytest.mark.parametrize("kind", ["layer", "group"])
def test_a_frozen_bf16_norm_fed_fp32_trains_as_an_fp32_norm_under_torch_autocast(kind):
    """A frozen norm held in bf16 (a frozen base model loaded in 16 bits beside trained
    layers): its weights are no differentiated leaves, so no NormWeight is made for them with
    the leaves, and the forward's own pass over the parameters must make them NormWeights --
    else the norm's CPU kernel refuses 16-bit weights beside the fp32 raw input. The
    reference: the fp32 module, its frozen norm holding the same bf16 values, under
    torch.autocast."""
    torch.manual_seed(0)
    reference = _NormNet(kind)
    reference.norm_in.requires_grad_(False)
    with torch.no_grad():
        for p in reference.norm_in.parameters():
            p.normal_().copy_(p.to(torch.bfloat16))  # values a bf16 tensor holds exactly
    model = copy.deepcopy(reference)
    model.norm_in.to(torch.bfloat16)
    batches = _norm_batches(3)
    ref_losses = _autocast_reference(reference, batches, torch.bfloat16)
    apply, params = fzero.functionalize(model)
    step = fzero.compile(_norm_step, precision="bf16")
    state, losses = ft.run_steps(step, step.init(fzero.TrainState.create(
        apply_fn=apply, params=params, tx=optim.sgd(0.05, momentum=0.9))), batches)
    ft.assert_trees_close(losses, torch.stack(ref_losses), tol="bf16")
    ft.assert_trees_close(fzero.gather(state.master),
                          {n: p for n, p in reference.named_parameters() if p.requires_grad}, tol="bf16")
    assert sorted(state.params.frozen) == ["norm_in.bias", "norm_in.weight"]
    for name in state.params.frozen:  # untrained, and still bf16
        assert state.params[name].dtype == torch.bfloat16, name
        assert torch.equal(state.params[name].float(), reference.get_parameter(name)), name


class _CheckpointedNormNet(_NormNet):
    """:class:`_NormNet` with its second norm and head checkpointed (torch.utils.checkpoint):
    recomputed in backward, where the norm must compute in fp32 as its forward did."""

    def __init__(self, kind, reentrant):
        super().__init__(kind)
        self.reentrant = reentrant

    def forward(self, x):
        r = x + self.lin(self.norm_in(x))
        return torch.utils.checkpoint.checkpoint(lambda t: self.head(self.norm_mid(t)), r,
                                                 use_reentrant=self.reentrant)


@pytest.mark.parametrize("entry", ["engine", "edges"])
@pytest.mark.parametrize("kind", ["layer", "group"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_norm_recomputed_in_backward_trains_as_under_torch_autocast(kind, precision, entry, monkeypatch):
    """Activation checkpointing inside the model: the recomputation runs in backward, and its
    norm takes the 16-bit weight in fp32 as the forward's did. (It ran in bf16/fp16 when the
    backward ran inside the norm weights' own __torch_function__, and the checkpoint refused
    the recomputed tensors.) ``edges``: the way for a torch without the engine's entry."""
    if entry == "edges":
        from fzero import core

        monkeypatch.setattr(core, "_engine_run_backward", None)
    torch.manual_seed(0)
    _trains_as_under_autocast(_CheckpointedNormNet(kind, reentrant=False), 3, precision)


def test_a_reentrant_checkpoint_is_refused_naming_the_non_reentrant_one():
    """torch's reentrant checkpoint cannot run under torch.autograd.grad, which
    value_and_grad differentiates with: the error says what to use instead."""
    apply, params = fzero.functionalize(_CheckpointedNormNet("layer", reentrant=True))
    b = _norm_batches(1)[0]
    with pytest.raises(RuntimeError, match=r"fzero.value_and_grad.*use_reentrant=False.*gradient_checkpointing_kwargs"):
        fzero.value_and_grad(lambda p: F.mse_loss(apply(p, b["x"]), b["y"]))(params)


def _norms_at_every_stage():
    import torch.distributed as dist

    rank, out = dist.get_rank(), []
    for stage in range(4):
        for kind in ("layer", "group", "batch"):
            torch.manual_seed(0)
            apply, params = fzero.functionalize(_NormNet(kind))
            step = fzero.compile(_norm_step, fzero.Mesh(dp=-1), zero=stage, precision="bf16")
            state = step.init(fzero.TrainState.create(apply_fn=apply, params=params,
                                                      tx=optim.sgd(0.05, momentum=0.9)))
            losses = []
            for b in _norm_batches(3, rows=8):
                state, m = step(state, {k: v[rank * 4:(rank + 1) * 4] for k, v in b.items()})
                losses.append(m["loss"])
            out.append((stage, kind, losses, fzero.gather(state.master), dict(state.buffers)))
    return out


@pytest.mark.multirank
@pytest.mark.slow
def test_norm_layers_fed_fp32_train_as_under_torch_autocast_at_every_zero_stage(ranks):
    """Two ranks, half the batch each: LayerNorm and GroupNorm give the one-process autocast
    run on the whole batch; BatchNorm (statistics of each rank's half) trains, its buffers
    the same on both ranks."""
    results = ranks(2).run(_norms_at_every_stage)
    for i, (stage, kind, losses, masters, buffers) in enumerate(results[0]):
        other = results[1][i]
        ft.assert_trees_close(other[2:], (losses, masters, buffers), rtol=0, atol=0, what=f"rank 1, {kind}, {stage}")
        if kind == "batch":
            assert all(torch.isfinite(x).all() for x in losses + list(masters.values())), stage
            continue
        torch.manual_seed(0)
        reference = _NormNet(kind)
        ref_losses = _autocast_reference(reference, _norm_batches(3, rows=8), torch.bfloat16)
        ft.assert_trees_close(losses, ref_losses, tol="bf16", what=f"losses, {kind}, stage {stage}")
        ft.assert_trees_close(masters, dict(reference.named_parameters()), tol="bf16", what=f"{kind}, stage {stage}")


ORDERS = list(itertools.permutations(["acc", "mp"]))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_compositions_in_any_order_agree(order, dtype):
    case = ft.ModelCase((4, 6, 3), "gelu", True, True, 3)
    batches = [case.batch(8, i) for i in range(4)]
    results = []
    for o in (order, order[::-1]):
        step = ft.mse_step
        for t in o:
            step = fzero.accumulate(step, 2) if t == "acc" else fzero.mixed_precision(step, dtype)
        state, losses = ft.run_steps(step, step.init(make(case, "adamw")), batches)
        results.append((state.params, losses))
    ft.assert_trees_close(results[0], results[1], rtol=0, atol=0)


def test_compile_precision_and_accumulate_options():
    case = ft.ModelCase((4, 6, 3), "tanh", False, True, 4)
    batches = [case.batch(8, i) for i in range(3)]
    step = fzero.compile(ft.mse_step, precision="fp16", accumulate=2, clip_norm=1.0)
    state, _ = ft.run_steps(step, step.init(make(case, "adamw")), batches)
    _, m = step(state, batches[0])
    assert {"loss", "loss_scale", "skipped", "grad_norm"} <= set(m)


# --------------------------------------------------------------------------- the NotApplied contract


def _installing(handler, step):
    """``step`` as a transform that installs ``handler`` around it (a user-written transform)."""
    from fzero.transforms import Step, as_step, installed

    inner = as_step(step)

    def call(state, batch):
        with installed(handler):
            return inner(state, batch)

    return Step(call, inner=inner)


def test_an_update_not_applied_is_an_explicit_value_through_the_handlers():
    """A handler inside accumulate (so seeing what accumulate answers) gets NotApplied("deferred")
    for the micro-batches before the last, and inside mixed_precision NotApplied("skipped")
    for a non-finite gradient; the user's step always gets a TrainState."""
    from fzero.transforms import Handler, NotApplied

    seen = []

    class Watch(Handler):
        def apply_gradients(self, state, grads, *, next):
            out = next(state, grads)
            seen.append(out.reason if isinstance(out, NotApplied) else "applied")
            return out

    def watched(step):
        return _installing(Watch(), step)

    got = []

    def train_step(state, batch):
        loss, g = fzero.value_and_grad(lambda p: (state.apply_fn(p, batch) ** 2).mean())(state.params)
        new = state.apply_gradients(g)
        got.append(type(new).__name__)
        return new, {"loss": loss}

    apply, params = fzero.functionalize(torch.nn.Linear(3, 1))
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
    step = fzero.accumulate(watched(train_step), 3)
    state = step.init(state)
    state, _ = step(state, torch.ones(6, 3))
    assert seen == ["deferred", "deferred", "applied"] and int(state.step) == 1
    seen.clear()
    step = fzero.mixed_precision(watched(train_step), "fp16")
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1)))
    state, m = step(state, torch.full((2, 3), float("inf")))
    assert seen == ["skipped"] and bool(m["skipped"]) and int(state.step) == 0
    assert set(got) == {"TrainState"}


@pytest.mark.parametrize("outside", [False, True])
def test_the_optimizer_steps_the_fp32_masters_whatever_the_nesting(outside):
    """mixed_precision swaps its masters in around the ``update`` primitive: a handler of
    ``update`` outside it sees fp32 parameters and gradients (one inside, the bf16 ones
    before the swap), the result equals torch's SGD on the fp32 weights with the bf16
    forward's gradient, and the model's parameters are the masters' bf16 copies."""
    from fzero.transforms import Handler

    seen = []

    class Watch(Handler):
        def update(self, state, grads, *, next):
            seen.append({p.dtype for p in fzero.tree.leaves(state.params)} | {g.dtype for g in fzero.tree.leaves(grads)})
            return next(state, grads)

    def watched(step):
        return _installing(Watch(), step)

    torch.manual_seed(0)
    apply, params = fzero.functionalize(torch.nn.Linear(3, 2))
    start = {k: v.detach().clone() for k, v in params.items()}
    step = watched(fzero.mixed_precision(ft.mse_step, "bf16")) if outside else \
        fzero.mixed_precision(watched(ft.mse_step), "bf16")
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.5)))
    batch = {"x": torch.randn(4, 3), "y": torch.randn(4, 2)}
    state, _ = step(state, batch)
    assert seen == [{torch.float32 if outside else torch.bfloat16}]
    assert {p.dtype for p in state.params.values()} == {torch.bfloat16}
    # the reference: torch's SGD on fp32 weights, with the gradient the bf16 forward gives
    ref = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for k, p in ref.named_parameters():
            p.copy_(start[k])
    lowp = {k: v.to(torch.bfloat16) for k, v in start.items()}
    loss_fn = lambda p: F.mse_loss(torch.func.functional_call(ref, p, (batch["x"].to(torch.bfloat16),)).float(),
                                   batch["y"])
    lowp = {k: v.requires_grad_(True) for k, v in lowp.items()}
    grads = torch.autograd.grad(loss_fn(lowp), list(lowp.values()))
    sgd = torch.optim.SGD(ref.parameters(), lr=0.5)
    for p, g in zip(ref.parameters(), grads):
        p.grad = g.float()
    sgd.step()
    for k, p in ref.named_parameters():
        torch.testing.assert_close(state.master[k], p.detach(), rtol=0, atol=0)
        torch.testing.assert_close(state.params[k], p.detach().to(torch.bfloat16), rtol=0, atol=0)
