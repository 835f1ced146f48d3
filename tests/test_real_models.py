"""What real models bring, in one process, against plain PyTorch: frozen parameters,
buffers, activation checkpointing inside the model, tied weights through Hugging Face's
save/load, and the module's own memory after ``step.init``.

Every reference is the module itself: ``forward``, ``backward``, ``torch.optim``,
``torch.utils.checkpoint`` -- never fzero's code.
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

import fzero
import fzero.testing as ft
from fzero import optim

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from finetune_lora import add_lora  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402


def _step(state, batch):
    def loss_fn(p):
        return F.cross_entropy(state.apply_fn(p, batch["x"]).flatten(0, -2), batch["y"].flatten())

    loss, grads = fzero.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads), {"loss": loss}


def _torch_losses(model, batches, opt):
    losses = []
    for b in batches:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(b["x"]).flatten(0, -2), b["y"].flatten())
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _gpt_batches(n, batch=4, T=8, vocab=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randint(0, vocab, (batch, T), generator=g),
             "y": torch.randint(0, vocab, (batch, T), generator=g)} for _ in range(n)]


# --------------------------------------------------------------------------- frozen


def _lora_gpt(seed=0):
    torch.manual_seed(seed)
    return add_lora(GPT(GPTConfig(block_size=8, n_layer=2, n_head=2, n_embd=16)), rank=2)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_frozen_parameters_train_as_torch_and_stay_bit_identical(precision):
    model = _lora_gpt()
    ref = copy.deepcopy(model)
    # torch trains the adapters (B starts at zero) with a nonzero lr on every trainable param
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if p.requires_grad:
                p.normal_(0, 0.02)
    model.load_state_dict(ref.state_dict())
    batches = _gpt_batches(4)
    apply, params = fzero.functionalize(model)
    assert params.frozen == {n for n, p in model.named_parameters() if not p.requires_grad}
    before = {k: params[k].clone() for k in params.frozen}
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-2, weight_decay=0.1))
    step = fzero.compile(_step, precision=precision)
    state = step.init(state)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(m["loss"])
    # No optimizer state for frozen parameters: two moments per trainable element.
    trainable = sum(v.numel() for k, v in params.items() if k not in params.frozen)
    moments = sum(x.numel() for x in fzero.tree.leaves(state.opt_state) if x.dim() > 0)
    assert moments == 2 * trainable
    out = fzero.gather(state.params)
    for k in params.frozen:
        assert torch.equal(out[k], before[k]), k  # bit-identical, same dtype
        assert out[k].dtype == before[k].dtype
    if precision == "fp32":
        ref_losses = _torch_losses(ref, batches, torch.optim.AdamW(
            [p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1))
        ft.assert_trees_close(losses, ref_losses)
        ft.assert_trees_close({k: v for k, v in out.items()}, dict(ref.named_parameters()))


def test_frozen_gradients_are_none_and_leaves_are_the_trainable_ones():
    model = _lora_gpt()
    apply, params = fzero.functionalize(model)
    b = _gpt_batches(1)[0]
    _, grads = fzero.value_and_grad(lambda p: F.cross_entropy(apply(p, b["x"]).flatten(0, 1), b["y"].flatten()))(params)
    assert all(grads[k] is None for k in params.frozen)
    assert len(fzero.tree.leaves(grads)) == len(params) - len(params.frozen)
    # The same gradient torch computes for the trainable parameters.
    loss = F.cross_entropy(model(b["x"]).flatten(0, 1), b["y"].flatten())
    loss.backward()
    ft.assert_trees_close({k: g for k, g in grads.items() if g is not None},
                          {n: p.grad for n, p in model.named_parameters() if p.requires_grad})


def test_integer_parameter_is_frozen_and_kept():
    class WithInt(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)
            self.code = nn.Parameter(torch.tensor([3, 1, 2]), requires_grad=False)

        def forward(self, x):
            return self.lin(x[:, self.code])

    apply, params = fzero.functionalize(WithInt())
    assert params.frozen == {"code"}
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(0.1))
    step = fzero.compile(lambda s, b: (s.apply_gradients(fzero.grad(lambda p: s.apply_fn(p, b).sum())(s.params)), {}))
    state, _ = step(step.init(state), torch.randn(4, 4))
    assert torch.equal(state.params["code"], torch.tensor([3, 1, 2]))


# --------------------------------------------------------------------------- buffers


class BNNet(nn.Module):
    """A BatchNorm CNN: float running statistics and an int64 batch counter."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 4 * 4, 5)

    def forward(self, x):
        return self.head(F.relu(self.bn(self.conv(x))).flatten(1))


def _img_batches(n, batch=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(batch, 3, 4, 4, generator=g), "y": torch.randint(0, 5, (batch,), generator=g)}
            for _ in range(n)]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_buffers_are_state_updated_per_forward_as_torch(accumulate):
    torch.manual_seed(0)
    model = BNNet()
    ref = copy.deepcopy(model)
    batches = _img_batches(3)
    apply, params = fzero.functionalize(model)
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1, momentum=0.9))
    assert sorted(state.buffers) == ["bn.num_batches_tracked", "bn.running_mean", "bn.running_var"]
    step = fzero.compile(_step, accumulate=accumulate)
    state = step.init(state)
    for b in batches:
        state, _ = step(state, b)
    # torch: the same updates, each micro-batch's forward updating the running statistics.
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for b in batches:
        opt.zero_grad()
        for x, y in zip(b["x"].chunk(accumulate), b["y"].chunk(accumulate)):
            (F.cross_entropy(ref(x), y) / accumulate).backward()
        opt.step()
    ft.assert_trees_close(fzero.gather(state.params), dict(ref.named_parameters()))
    ft.assert_trees_close(dict(state.buffers), dict(ref.named_buffers()))
    assert int(state.buffers["bn.num_batches_tracked"]) == 3 * accumulate


def test_the_state_owns_its_buffers_and_load_into_gives_the_module_copies():
    torch.manual_seed(0)
    model = BNNet()
    initial = {k: v.clone() for k, v in model.named_buffers()}
    apply, params = fzero.functionalize(model)
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
    other = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
    step = fzero.compile(_step)
    state = step.init(state)
    for b in _img_batches(2):
        state, _ = step(state, b)
    # the module and a second state made from it did not move with the steps
    for k, v in initial.items():
        assert torch.equal(dict(model.named_buffers())[k], v) and torch.equal(other.buffers[k], v), k
    fzero.load_into(model, state)
    trained = {k: v.clone() for k, v in state.buffers.items()}
    for k, v in model.named_buffers():
        assert torch.equal(v, trained[k]) and v is not state.buffers[k], k
    state, _ = step(state, _img_batches(1, seed=7)[0])  # a donated step writes the state's, not the module's
    ft.assert_trees_close(dict(model.named_buffers()), trained, rtol=0, atol=0)
    # a state that shares its buffers with the module: load_into still leaves copies
    shared = dict(model.named_buffers())
    fzero.load_into(model, fzero.TrainState.create(apply_fn=apply, params=fzero.gather(state.params),
                                                   tx=optim.sgd(0.1), buffers=shared))
    assert all(v is not shared[k] for k, v in model.named_buffers())


def test_checkpoint_saves_and_restores_buffers(tmp_path):
    torch.manual_seed(0)
    apply, params = fzero.functionalize(BNNet())
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
    step = fzero.compile(_step)
    state = step.init(state)
    for b in _img_batches(2):
        state, _ = step(state, b)
    fzero.checkpoint.save(tmp_path / "c", state)
    saved = {k: v.clone() for k, v in state.buffers.items()}
    state, _ = step(state, _img_batches(1, seed=5)[0])  # moves the buffers on
    loaded = fzero.checkpoint.load(tmp_path / "c", like=state)
    ft.assert_trees_close(dict(loaded.buffers), saved)
    # and the loaded state's apply runs with the loaded buffers, not the live ones
    assert loaded.apply_fn.buffers["bn.running_mean"] is loaded.buffers["bn.running_mean"]


# --------------------------------------------------------------------------- remat inside a module


class CheckpointedMLP(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(6, 5)

    def forward(self, x):
        for b in self.blocks:
            if self.how == "remat":
                x = fzero.remat(b)(x)
            elif self.how == "torch":
                x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
            else:
                x = b(x)
        return self.out(x)


@pytest.mark.parametrize("how", ["remat", "torch"])
def test_recomputation_inside_the_model_uses_the_params_of_the_forward(how):
    torch.manual_seed(0)
    model = CheckpointedMLP(how)
    plain = copy.deepcopy(model)
    plain.how = "none"
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 5, (8,), generator=g)
    apply, params = fzero.functionalize(model)
    # Parameters that differ from the module's own: a stale recomputation would show.
    params = {k: v * 1.5 for k, v in params.items()}
    with torch.no_grad():
        for k, p in plain.named_parameters():
            p.mul_(1.5)
    _, grads = fzero.value_and_grad(lambda p: F.cross_entropy(apply(p, x), y))(params)
    F.cross_entropy(plain(x), y).backward()
    ft.assert_trees_close(grads, {n: p.grad for n, p in plain.named_parameters()})
    # The module's own parameters are back in place afterwards.
    assert all(not torch.equal(p, params[n]) for n, p in model.named_parameters())


# --------------------------------------------------------------------------- the module after init


def test_module_holds_no_weights_after_init_and_load_into_restores_trained_ones():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=16))
    ref = copy.deepcopy(model)
    apply, params = fzero.functionalize(model)
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1, momentum=0.9))
    step = fzero.compile(_step)
    state = step.init(state)
    assert all(p.is_meta for p in model.parameters())  # no dead copy of the model
    batches = _gpt_batches(2, vocab=256)
    for b in batches:
        state, _ = step(state, b)
    fzero.load_into(model, state)
    assert model.lm_head.weight is model.wte.weight  # the tie survives
    # SGD: sensitive to a wrong gradient, not to rounding (Adam would magnify the fp32
    # reduction-order noise of the near-zero key-bias gradients into visible updates).
    _torch_losses(ref, batches, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9))
    ft.assert_trees_close(dict(model.named_parameters()), dict(ref.named_parameters()))


def test_load_into_names_every_mismatch():
    model = nn.Linear(2, 3)
    with pytest.raises(KeyError, match=r"missing from the state: \['bias'\][\s\S]*not in the module: \['b2'\]"):
        fzero.load_into(model, {"weight": torch.zeros(3, 2), "b2": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"'weight': module \(3, 2\), state \(2, 2\)[\s\S]*'bias'"):
        fzero.load_into(model, {"weight": torch.zeros(2, 2), "bias": torch.zeros(4)})


def test_hugging_face_gpt2_tied_round_trips_through_save_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ref = copy.deepcopy(model)
    batches = _gpt_batches(2, vocab=64, T=8)
    apply, params = fzero.functionalize(model)
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1, momentum=0.9))
    step = fzero.compile(_hf_step)
    state = step.init(state)
    for b in batches:
        state, _ = step(state, b)
    fzero.load_into(model, state)
    model.save_pretrained(tmp_path / "hf")
    back = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert back.lm_head.weight.data_ptr() == back.transformer.wte.weight.data_ptr()
    _torch_losses_hf(ref, batches)
    ft.assert_trees_close(dict(back.named_parameters()), dict(ref.named_parameters()))


def _hf_step(state, batch):
    def loss_fn(p):
        logits = state.apply_fn(p, input_ids=batch["x"]).logits
        return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())

    loss, grads = fzero.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads), {"loss": loss}


def _torch_losses_hf(model, batches):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for b in batches:
        opt.zero_grad()
        F.cross_entropy(model(input_ids=b["x"]).logits.flatten(0, 1), b["y"].flatten()).backward()
        opt.step()


@pytest.mark.parametrize("precision,jit", [("fp32", False), ("bf16", False), pytest.param("bf16", True, marks=pytest.mark.slow)])
def test_hugging_face_gradient_checkpointing_trains_as_the_plain_model(precision, jit):
    """A Hugging Face GPT-2 with its activation (gradient) checkpointing enabled (non-reentrant,
    transformers' default here): the blocks recomputed in backward, their LayerNorms under bf16 in fp32 as
    in the forward, train as the same model without checkpointing does in plain PyTorch
    (under torch.autocast for bf16), eagerly and compiled (jit=True, inductor). Under bf16 it
    failed with torch's CheckpointError."""
    transformers = pytest.importorskip("transformers")
    if jit and shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("inductor compiles C++ on a CPU: no C++ compiler (g++ or $CXX) on this machine")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ref = copy.deepcopy(model)
    # (transformers 5 renames it; the old name warns)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    batches = _gpt_batches(3, vocab=64, T=8)
    apply, params = fzero.functionalize(model)
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1, momentum=0.9))
    step = fzero.compile(_hf_step, precision=precision, jit=jit)
    state, losses = ft.run_steps(step, step.init(state), batches)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_losses = []
    for b in batches:
        opt.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
            logits = ref(input_ids=b["x"]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), b["y"].flatten())
        loss.backward()
        opt.step()
        ref_losses.append(loss.detach())
    ft.assert_trees_close(losses, torch.stack(ref_losses), tol=precision)
    trained = state.master if precision == "bf16" else state.params
    ft.assert_trees_close(dict(trained), dict(ref.named_parameters()), tol=precision)
