"""Megatron sequence parallelism (``compile(..., tp=plan, sequence_parallel=True)``) on real
gloo ranks: the example GPT at tp=2, with dropout on and LayerNorms between the split pairs,
trains as plain PyTorch does on one process (its module, ``backward`` and
``torch.optim.AdamW`` on the whole batch); its checkpoint loads whole onto one process; the
activations each rank saves for backward inside the blocks are half the one-process model's.

The reference's dropout masks are fzero's counter-based ones (``fzero.rng``: each element's
bit keyed by its position in the whole tensor, whatever slice a rank holds), drawn for the
plain module's own ``F.dropout`` calls: the masks are the definition of the run, and the
property under test is that a rank holding a sequence shard draws its slice of them.
"""

from __future__ import annotations

import os
import sys
import tempfile
import types

import pytest
import torch
import torch.nn.functional as F

import fzero
import fzero.testing as ft
from fzero import optim
from fzero.rng import _step_randomness
from fzero.transforms import tp_plans

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

B, T = 4, 16
LR, WD = 1e-3, 0.1


def _gpt(dropout: float = 0.1, n_layer: int = 2) -> GPT:
    torch.manual_seed(7)
    return GPT(GPTConfig(vocab_size=64, block_size=T, n_layer=n_layer, n_head=4, n_embd=32, dropout=dropout))


def _batches(n: int):
    g = torch.Generator().manual_seed(9)
    return [{"ids": torch.randint(0, 64, (B, T), generator=g), "y": torch.randint(0, 64, (B, T), generator=g)}
            for _ in range(n)]


def _loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def train_step(state, batch):
    loss, grads = fzero.value_and_grad(lambda p: _loss(state.apply_fn(p, batch["ids"]), batch["y"]))(state.params)
    return state.apply_gradients(grads), {"loss": loss}


def _masks(update: int, batch):
    """fzero's dropout masks for update ``update`` (seed 0), for code that runs outside a step."""
    return _step_randomness(types.SimpleNamespace(seed=torch.tensor(0), step=update), batch)


def _train(step, state, batches):
    """``step`` over ``batches``: the last state and every step's loss."""
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(m["loss"])
    return state, losses


def _torch_trained(batches, make=None):
    """Plain PyTorch: the module (``make()``, default the example GPT), backward and
    torch.optim.AdamW on the whole batch."""
    model = (make or _gpt)()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for i, b in enumerate(batches):
        opt.zero_grad()
        with _masks(i, b):
            loss = _loss(model(b["ids"]), b["y"])
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), dict(model.named_parameters())


def _state(model):
    apply, params = fzero.functionalize(model)
    return fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(LR, weight_decay=WD))


def _sp_equals_torch_and_checkpoints():
    """tp=2 with sequence parallelism against plain PyTorch; saved, loaded onto one process."""
    batches = _batches(3)
    ref_losses, ref_params = _torch_trained(batches)
    model = _gpt()
    step = fzero.compile(train_step, fzero.Mesh(dp=1, tp=2), tp=tp_plans.gpt(model, sequence_parallel=True),
                         sequence_parallel=True)
    state = step.init(_state(model))
    state, losses = _train(step, state, batches)
    ft.assert_trees_close(torch.stack(losses), ref_losses, tol="fp32", what="losses")
    _check_params(fzero.gather(state.params), ref_params)

    # The same under accumulation (two micro-batches of two sequences) at ZeRO stage 1.
    model = _gpt()
    acc = fzero.compile(train_step, fzero.Mesh(dp=1, tp=2), tp=tp_plans.gpt(model, sequence_parallel=True),
                        sequence_parallel=True, accumulate=2, zero=1)
    acc_state = acc.init(_state(model))
    acc_state, acc_losses = _train(acc, acc_state, batches)
    ft.assert_trees_close(torch.stack(acc_losses), ref_losses, tol="fp32", what="losses (accumulate=2)")
    _check_params(fzero.gather(acc_state.params), ref_params)
    # the module is its own again outside the step: no forward of the plan's left on it
    assert not [n for n, m in model.named_modules() if "forward" in m.__dict__]

    path = os.path.join(tempfile.gettempdir(), f"fzero-sp-gpt-{os.getppid()}")
    fzero.checkpoint.save(path, state, overwrite=True)
    one = fzero.checkpoint.load(path, like=_state(_gpt()))  # a plain, unsplit one-process state
    ft.assert_trees_close(dict(one.params), fzero.gather(state.params), tol="exact", what="loaded at tp=1")
    return tuple(state.params["blocks.0.mlp.c_fc.weight"].shape)


def _check_params(whole, ref_params, d: int = 32):
    ref_params = {k: v.detach() for k, v in ref_params.items()}
    # The key projection's bias has an exact gradient of zero (softmax over the keys does not
    # see a shift common to every key): both runs move it only by rounding noise, which AdamW
    # divides by its own square root. Every other element, fp32's tolerance.
    key = slice(d, 2 * d)
    for name in [n for n in whole if n.endswith("attn.c_attn.bias")]:
        ft.assert_trees_close(whole[name][key], ref_params[name][key], rtol=0.0, atol=1e-5, what=f"{name} (keys)")
        for t in (whole, ref_params):
            t[name] = torch.cat([t[name][:d], t[name][2 * d:]])
    ft.assert_trees_close(whole, ref_params, tol="fp32", what="parameters")


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(4)
    # No dropout on the attention's probabilities: Hugging Face's attention reaches them
    # through an operation the tensor-parallel slice tracker has no rule for (refused by
    # name under tp with or without sequence parallelism). The residual branches' dropouts
    # are the ones on sequence shards.
    cfg = GPT2Config(n_embd=16, n_layer=2, n_head=4, vocab_size=32, n_positions=T, resid_pdrop=0.1,
                     embd_pdrop=0.1, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


def _gpt2_sp_equals_torch():
    """Hugging Face GPT-2 (dropout on its embeddings and residual branches) at tp=2 with
    sequence parallelism against its own module, backward and torch.optim.AdamW."""
    g = torch.Generator().manual_seed(5)
    batches = [{"ids": torch.randint(0, 32, (B, T), generator=g), "y": torch.randint(0, 32, (B, T), generator=g)}
               for _ in range(3)]
    ref = _gpt2()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    ref_losses = []
    for i, b in enumerate(batches):
        opt.zero_grad()
        with _masks(i, b):
            loss = _loss(ref(b["ids"]).logits, b["y"])
        loss.backward()
        opt.step()
        ref_losses.append(loss.detach())
    model = _gpt2()
    apply, params = fzero.functionalize(model)
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(LR, weight_decay=WD))

    def step_fn(state, batch):
        loss, grads = fzero.value_and_grad(
            lambda p: _loss(state.apply_fn(p, batch["ids"]).logits, batch["y"]))(state.params)
        return state.apply_gradients(grads), {"loss": loss}

    step = fzero.compile(step_fn, fzero.Mesh(dp=1, tp=2), tp=tp_plans.gpt2(model, sequence_parallel=True),
                         sequence_parallel=True)
    state = step.init(state)
    state, losses = _train(step, state, batches)
    ft.assert_trees_close(torch.stack(losses), torch.stack(ref_losses), tol="fp32", what="losses")
    _check_params(fzero.gather(state.params), dict(ref.named_parameters()), d=16)
    return "ok"


class _SavedBytes:
    """Bytes of the distinct storages autograd saves for backward between a pre-hook on the
    first block and a hook on the last."""

    def __init__(self, model: GPT):
        self.storages: dict[int, int] = {}
        self.ctx = None

        def pack(t):
            s = t.untyped_storage()
            self.storages[s.data_ptr()] = s.nbytes()
            return t

        def start(module, args):
            self.ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
            self.ctx.__enter__()

        def stop(module, args, out):
            self.ctx.__exit__(None, None, None)

        model.blocks[0].register_forward_pre_hook(start)
        model.blocks[-1].register_forward_hook(stop)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _saved_in_blocks(how: str, rows: int) -> int:
    """The bytes saved inside the blocks in one step on ``rows`` sequences: the plain module
    (one process), or this rank's at tp=2 (``"tp"``) or tp=2 with sequence parallelism."""
    batch = {k: v[:rows] for k, v in _batches(1)[0].items()} if rows <= B else \
        {k: v.repeat(2, 1)[:rows] for k, v in _batches(1)[0].items()}
    model = _gpt()
    counter = _SavedBytes(model)
    if how == "plain":
        with _masks(0, batch):
            _loss(model(batch["ids"]), batch["y"]).backward()
        return counter.total
    sp = how == "sp"
    step = fzero.compile(train_step, fzero.Mesh(dp=1, tp=2), tp=tp_plans.gpt(model, sequence_parallel=sp),
                         sequence_parallel=sp)
    step(step.init(_state(model)), batch)
    return counter.total


def _activation_bytes_per_sequence():
    """Per rank, the activations saved inside the blocks per sequence of the batch: what the
    saved bytes grow by from 2 to 4 sequences, halved. (What does not grow with the batch --
    parameters, their copies, a causal mask -- is not an activation and cancels.)"""
    return {how: (_saved_in_blocks(how, 4) - _saved_in_blocks(how, 2)) // 2 for how in ("plain", "tp", "sp")}


@pytest.mark.multirank
def test_sequence_parallel_gpt_with_dropout_equals_torch_and_loads_onto_one_process(ranks):
    shapes = ranks(2).run(_sp_equals_torch_and_checkpoints)
    assert shapes == [(64, 32), (64, 32)]  # each rank trained its half of the MLP's expansion


@pytest.mark.multirank
def test_sequence_parallel_hugging_face_gpt2_with_dropout_equals_torch(ranks):
    assert ranks(2).run(_gpt2_sp_equals_torch) == ["ok", "ok"]


class _VocabLM(torch.nn.Module):
    """Untied embedding and head, pre-norm MLP blocks with dropout, a final norm."""

    def __init__(self, vocab: int = 32, d: int = 16, depth: int = 2):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.lns = torch.nn.ModuleList(torch.nn.LayerNorm(d) for _ in range(depth))
        self.fcs = torch.nn.ModuleList(torch.nn.Linear(d, 4 * d) for _ in range(depth))
        self.projs = torch.nn.ModuleList(torch.nn.Linear(4 * d, d) for _ in range(depth))
        self.ln_f, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        for ln, fc, proj in zip(self.lns, self.fcs, self.projs):
            x = x + F.dropout(proj(F.gelu(fc(ln(x)))), 0.1, self.training)
        return self.head(self.ln_f(x))


def _vocab_lm():
    torch.manual_seed(6)
    return _VocabLM()


def _vocab_split_sp_equals_torch():
    """A vocabulary-split embedding begins the shards (its output reduce-scattered) and a
    vocabulary-split head gathers them; the loss is computed on the split logits."""
    batches = _batches(3)
    for b in batches:
        b["ids"], b["y"] = b["ids"] % 32, b["y"] % 32
    ref_losses, ref_named = _torch_trained(batches, _vocab_lm)
    model = _vocab_lm()
    plan = {"emb": fzero.RowwiseParallel(), "lns.*": fzero.SequenceParallel(), "fcs.*": fzero.ColwiseParallel(),
            "projs.*": fzero.RowwiseParallel(), "ln_f": fzero.SequenceParallel(),
            "head": fzero.ColwiseParallel(output="vocab")}
    step = fzero.compile(train_step, fzero.Mesh(dp=1, tp=2), tp=plan, sequence_parallel=True)
    state = step.init(_state(model))
    state, losses = _train(step, state, batches)
    ft.assert_trees_close(torch.stack(losses), ref_losses, tol="fp32", what="losses")
    ref_params = {k: v.detach() for k, v in ref_named.items()}
    ft.assert_trees_close(fzero.gather(state.params), ref_params, tol="fp32", what="parameters")
    return tuple(state.params["emb.weight"].shape)


@pytest.mark.multirank
def test_a_vocabulary_split_embedding_and_head_begin_and_end_the_shards(ranks):
    assert ranks(2).run(_vocab_split_sp_equals_torch) == [(16, 16), (16, 16)]


@pytest.mark.multirank
def test_activations_saved_in_the_blocks_divide_by_tp_under_sequence_parallelism(ranks):
    for saved in ranks(2).run(_activation_bytes_per_sequence):
        # Every activation inside the blocks is this rank's half: its heads, its features or
        # its tokens (Korthikanti et al. 2022, eq. 4: sbh(34 + 5as/h) / t per layer).
        assert saved["sp"] * 2 == saved["plain"], saved
        # Plain tensor parallelism keeps the norms' inputs, the pairs' inputs and the
        # dropout masks whole on every rank: more than half.
        assert saved["plain"] > saved["tp"] > saved["sp"], saved


def test_sequence_parallel_styles_without_the_option_and_the_option_without_a_shard_are_refused():
    model = _gpt()
    with pytest.raises(ValueError, match=r"'blocks.0'.*sequence_parallel is off: pass sequence_parallel=True"):
        fzero.compile(train_step, fzero.Mesh(dp=-1), tp=tp_plans.gpt(model, sequence_parallel=True)).init(
            _state(model))
    with pytest.raises(ValueError, match=r"sequence_parallel=True, but the plan shards no activation"):
        fzero.compile(train_step, fzero.Mesh(dp=-1), tp=tp_plans.gpt(model), sequence_parallel=True).init(
            _state(model))
    with pytest.raises(ValueError, match=r"sequence_parallel=True shards the activations .* pass tp=plan"):
        fzero.compile(train_step, fzero.Mesh(dp=-1), sequence_parallel=True)
    with pytest.raises(ValueError, match=r"sequence_parallel=True with jit=True: .* use jit=False"):
        fzero.compile(train_step, fzero.Mesh(dp=-1), tp=tp_plans.gpt(model, sequence_parallel=True),
                      sequence_parallel=True, jit=True)
