"""Ulysses sequence parallelism (``Mesh(sp=)``) on real gloo ranks against plain PyTorch.

The reference is the Hugging Face module itself, trained in the same process by
``loss.backward()`` and ``torch.optim`` on the whole global batch (every row, every token);
fzero's ranks each hold a slice of the rows (``dp``) and of the sequence (``sp``), with the
model's attention exchanged by all-to-all. Losses every step and whole parameters at the
end agree to fp32 reduction-order error.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fzero
import fzero.testing as ft
from fzero import optim

transformers = pytest.importorskip("transformers")

STEPS = 3
ROWS, SEQ, VOCAB = 4, 16, 64


def _model(kind: str) -> torch.nn.Module:
    """Tiny configs from transformers' own classes, SDPA attention, no dropout, no download."""
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="sdpa")
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                   attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg)


def _batches():
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)
        out.append({"x": tokens[:, :-1], "y": tokens[:, 1:]})  # labels shifted once, before any split
    return out


def train_step(state, batch):
    def loss_fn(p):
        logits = state.apply_fn(p, batch["x"]).logits
        return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())

    loss, grads = fzero.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads), {"loss": loss}


def masked_step(state, batch):
    """A token mean over the labels that count, however they fall across the ranks."""
    def loss_fn(p):
        y = batch["y"].flatten()
        ce = F.cross_entropy(state.apply_fn(p, batch["x"]).logits.flatten(0, 1), y, reduction="none",
                             ignore_index=-100)
        return fzero.global_mean(ce, where=y != -100)

    loss, grads = fzero.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads), {"loss": loss}


def _masked(batches):
    """Labels ignored unevenly: most of the first half of each sequence (one sp slice at sp=2)."""
    out = []
    for b in batches:
        y = b["y"].clone()
        y[:, 1:7] = -100
        y[0, 9] = -100
        out.append({**b, "y": y})
    return out


# SGD shows a gradient of the wrong scale (a mean over the wrong ranks) at once. AdamW's eps is
# raised from 1e-8: with the default, an element whose gradient is ~1e-7 takes a step of about
# lr whatever its sign's reduction-order noise says (measured: one element in 2048 off by
# 2.3e-6 after 3 updates of a sequence-parallel Llama), which no rtol of 1e-5 survives.
OPTIMIZERS = {"sgd": (lambda: optim.sgd(0.5, momentum=0.9), lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9)),
              "adamw": (lambda: optim.adamw(1e-2, weight_decay=0.1, eps=1e-4),
                        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, eps=1e-4))}


def _reference(kind, opt, masked=False):
    model = _model(kind)
    torch_opt = OPTIMIZERS[opt][1](model.parameters())
    losses = []
    for b in _masked(_batches()) if masked else _batches():
        loss = F.cross_entropy(model(b["x"]).logits.flatten(0, 1), b["y"].flatten(), ignore_index=-100)
        torch_opt.zero_grad()
        loss.backward()
        torch_opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def _case(kind, opt, dp, sp, zero, save_to=None, masked=False):
    mesh = fzero.Mesh(dp=dp, sp=sp)
    model = _model(kind)
    apply, params = fzero.functionalize(model)
    step = fzero.compile(masked_step if masked else train_step, mesh, zero=zero, comm_bytes=True)
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=OPTIMIZERS[opt][0]()))
    losses, traffic = [], []
    for b in _masked(_batches()) if masked else _batches():
        state, m = step(state, ft.local_batch(b, dp, mesh.coords["dp"]))  # sp peers: the same rows
        losses.append(float(m["loss"]))
        traffic.append((m["comm_bytes"], m["comm_bytes_by_axis"]))
    if save_to is not None:
        fzero.checkpoint.save(save_to, state)
    return losses, fzero.gather(state.params), traffic


def _cases(cases):
    return [_case(*c) for c in cases]


def _check(kind, opt, got_losses, got_params, masked=False):
    losses, params = _reference(kind, opt, masked)
    ft.assert_trees_close(torch.tensor(got_losses), torch.tensor(losses), tol="fp32", what=f"{kind} losses")
    ft.assert_trees_close(dict(got_params), params, tol="fp32", what=f"{kind} parameters")


def _error(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return "no error"


def _gpt2_step(mesh, batch, step_fn=train_step, **config):
    cfg = dict(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=1, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
               attn_pdrop=0.0, attn_implementation="sdpa")
    torch.manual_seed(0)
    apply, params = fzero.functionalize(transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**cfg, **config})))
    step = fzero.compile(step_fn, mesh)
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1)))
    step(state, batch)


def _masked_step(state, batch):
    def loss_fn(p):
        logits = state.apply_fn(p, batch["x"], attention_mask=batch["mask"]).logits
        return F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())

    loss, grads = fzero.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads), {"loss": loss}


def _labels_step(state, batch):
    loss, grads = fzero.value_and_grad(lambda p: state.apply_fn(p, batch["x"], labels=batch["x"]).loss)(state.params)
    return state.apply_gradients(grads), {"loss": loss}


def _shift_labels_step(state, batch):
    def loss_fn(p):
        return state.apply_fn(p, batch["x"], labels=batch["x"], shift_labels=batch["y"]).loss

    loss, grads = fzero.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads), {"loss": loss}


def _errors():
    """Each refusal under sp=2, raised alike on every rank before any rank waits in a collective."""
    mesh = fzero.Mesh(dp=1, sp=2)
    b = _batches()[0]
    padded = {**b, "mask": torch.ones(ROWS, SEQ, dtype=torch.long).index_fill_(1, torch.tensor([0]), 0)}
    return {
        "sequence": _error(lambda: _gpt2_step(mesh, {"x": b["x"][:, :15], "y": b["y"][:, :15]})),
        "heads": _error(lambda: _gpt2_step(mesh, b, n_embd=24, n_head=3)),
        "mask": _error(lambda: _gpt2_step(mesh, padded, step_fn=_masked_step)),
        "dropout": _error(lambda: _gpt2_step(mesh, b, resid_pdrop=0.1)),
        "no attention": _error(lambda: _plain_step(mesh)),
        "labels": _error(lambda: _gpt2_step(mesh, b, step_fn=_labels_step)),
        "shift_labels": _error(lambda: _gpt2_step(mesh, b, step_fn=_shift_labels_step)),
        "heads at the call": _error(lambda: _three_heads_step(mesh)),
    }


class _ThreeHeads(torch.nn.Module):
    """Attention of three heads through F.scaled_dot_product_attention, with no config to say so."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(6, 18), torch.nn.Linear(6, 1)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 3, 2).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, 6))


def _three_heads_step(mesh):
    torch.manual_seed(0)
    apply, params = fzero.functionalize(_ThreeHeads())
    step = fzero.compile(ft.mse_step, mesh)
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1)))
    step(state, {"x": torch.randn(2, 8, 6), "y": torch.randn(2, 8, 1)})


def _plain_step(mesh):
    torch.manual_seed(0)
    apply, params = fzero.functionalize(torch.nn.Linear(4, 1))
    step = fzero.compile(ft.mse_step, mesh)
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1)))
    step(state, {"x": torch.randn(2, 8, 4), "y": torch.randn(2, 8, 1)})


def _sp_beside_tp():
    mesh = fzero.Mesh(dp=1, sp=2, tp=2)
    return _error(lambda: fzero.compile(train_step, mesh, tp={"transformer.h.*.mlp.c_fc": fzero.ColwiseParallel()}))


def _loaded_on_one_rank(kind, opt, path):
    """The checkpoint loaded by a plain process (no mesh axes, no process group)."""
    apply, params = fzero.functionalize(_model(kind))
    like = fzero.TrainState.create(apply_fn=apply, params=params, tx=OPTIMIZERS[opt][0]())
    return fzero.checkpoint.load(path, like=like)


@pytest.mark.multirank
@pytest.mark.slow
def test_gpt2_and_llama_under_sp2_give_the_one_process_losses_and_parameters(ranks, tmp_path):
    cases = [("gpt2", "sgd", 1, 2, 0, str(tmp_path / "gpt2")), ("llama", "adamw", 1, 2, 1, str(tmp_path / "llama"))]
    results = ranks(2).run(_cases, cases)
    # fzero.global_mean counts over dp x sp: sp slices holding different numbers of labels
    for losses, params, _ in ranks(2).run(_case, "gpt2", "sgd", 1, 2, 2, None, True):
        _check("gpt2", "sgd", losses, params, masked=True)
    for errors in ranks(2).run(_errors):
        assert "sequence length 15 (dim 1 of ['x']) does not divide into sp=2" in errors["sequence"], errors
        assert "heads must divide by sp=2" in errors["heads"] and "config.num_attention_heads=3" in errors["heads"], errors
        assert "GPT2LMHeadModel.forward was given an attention_mask of shape (4, 8) under sequence parallelism " \
               "(sp=2)" in errors["mask"], errors
        assert "dropout of p=0.1 under Ulysses sequence parallelism (sp=2)" in errors["dropout"], errors
        assert "ran no F.scaled_dot_product_attention under sp=2" in errors["no attention"], errors
        assert "GPT2LMHeadModel.forward was given labels= under sequence parallelism (sp=2)" in errors["labels"]
        assert errors["shift_labels"] == "no error", errors  # labels shifted before the cut are taken
        assert "heads must divide by sp=2" in errors["heads at the call"] \
               and "query: 3 heads, key: 3 heads, value: 3 heads" in errors["heads at the call"], errors
    for (kind, opt, *_, path), *per_rank in zip(cases, *results):
        for losses, params, _ in per_rank:
            _check(kind, opt, losses, params)
        # Saved by the sp ranks (ZeRO-1's optimizer state cut over them), loaded whole by one process.
        loaded = _loaded_on_one_rank(kind, opt, path)
        ft.assert_trees_close(dict(loaded.params), per_rank[0][1], tol="exact")
        assert int(loaded.step) == STEPS


@pytest.mark.multirank
@pytest.mark.slow
def test_gpt2_and_llama_under_sp2_by_dp2_zero2_give_the_one_process_losses_and_parameters(ranks):
    cases = [("gpt2", "adamw", 2, 2, 2), ("llama", "sgd", 2, 2, 2)]
    results = ranks(4).run(_cases, cases)
    for message in ranks(4).run(_sp_beside_tp):
        assert "has an sp axis of 2 (Ulysses sequence parallelism), which does not run with tp=" in message, message
    for (kind, opt, *_), *per_rank in zip(cases, *results):
        for losses, params, traffic in per_rank:
            _check(kind, opt, losses, params)
            # Ulysses' all-to-alls cross sp; ZeRO's traffic crosses dp x sp; nothing else is sent
            for sent, by_axis in traffic:
                assert by_axis["sp"] == sent["all_to_all"] > 0 and by_axis["dp_sp"] > 0, by_axis
                assert by_axis["other"] == by_axis["dp"] == 0 and sum(by_axis.values()) == sent["total"], by_axis
