"""compile(jit=): the model's forward under torch.compile, fzero's transforms eager around it.

The compiled step against the eager one (aot_eager runs the same aten operations, forward
and AOTAutograd's backward, in the same order: bit for bit, measured) and against plain
PyTorch (the module, ``backward``, ``torch.optim.AdamW``: fp32 rounding order); no
recompilation after the second step; dropout's masks; bf16; ZeRO 1-3 on two ranks; one
inductor case.
"""

import contextlib
import os
import shutil
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

import fzero
import fzero.testing as ft
from fzero import optim

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
DEEPER = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32)  # ZeRO-3 runs of blocks
# eps=1e-3: the key projection's bias gets a gradient that is zero in exact arithmetic
# (softmax does not see a shift of every score of a query), so with torch's 1e-8 Adam's step
# there is rounding noise divided by itself, a +-lr move whose sign depends on the summation
# order (measured: 1.8e-5 against plain PyTorch after 3 steps); tests/test_transforms.py's
# AdamW does the same for the same reason.
LR, WD, EPS = 1e-2, 0.1, 1e-3


class DropoutGPT(nn.Module):
    """The GPT with a dropout on its residual stream before the last norm (a graph break
    in the middle of the compiled forward, outside the loop over blocks)."""

    def __init__(self, p: float):
        super().__init__()
        self.gpt = GPT(CFG)
        self.gpt.ln_f = nn.Sequential(nn.Dropout(p), self.gpt.ln_f)

    def forward(self, idx):
        return self.gpt(idx)


def _model(dropout=None, cfg=CFG):
    torch.manual_seed(0)
    return GPT(cfg) if dropout is None else DropoutGPT(dropout)


def _state(dropout=None, cfg=CFG):
    apply, params = fzero.functionalize(_model(dropout, cfg))
    return fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(LR, weight_decay=WD, eps=EPS))


def _batches(n, rows=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, CFG.vocab_size, (rows, CFG.block_size + 1), generator=g)
        out.append({"x": x[:, :-1], "y": x[:, 1:]})
    return out


def train_step(state, batch):
    # A fresh closure every step: the compiled forward is the module's, not this function's.
    def loss_fn(p):
        logits = state.apply_fn(p, batch["x"])
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["y"].flatten())

    loss, grads = fzero.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads), {"loss": loss}


def _run(batches, dropout=None, cfg=CFG, units=None, **options):
    """The losses and final parameters of ``batches`` under ``fzero.compile(**options)``;
    ``units``, a list, receives the step's ZeRO-3 units (each module's group) and kept ones."""
    step = fzero.compile(train_step, **options)
    state = step.init(_state(dropout, cfg))
    if units is not None:
        held = ft.shard_handler(step).units
        units.append(([gi for _, gi in held.modules], set(held.keep)) if held is not None else None)
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(metrics["loss"])
    return torch.stack(losses), {k: v.clone() for k, v in fzero.gather(state.params).items()}


def _plain(batches):
    """The module, loss.backward() and torch.optim.AdamW: no fzero."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    losses = []
    for b in batches:
        loss = F.cross_entropy(model(b["x"]).flatten(0, 1), b["y"].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), {k: v.detach() for k, v in model.named_parameters()}


def test_jit_equals_eager_fzero_bit_for_bit_and_plain_pytorch_to_fp32_rounding():
    batches = _batches(3)
    losses, params = _run(batches, jit="aot_eager")
    eager_losses, eager_params = _run(batches)
    ft.assert_trees_close(losses, eager_losses, tol="exact")
    ft.assert_trees_close(params, eager_params, tol="exact")
    plain_losses, plain_params = _plain(batches)
    ft.assert_trees_close(losses, plain_losses, tol="fp32")
    ft.assert_trees_close(params, plain_params, tol="optimizer fp32 vs torch.optim")


def test_nothing_compiles_again_after_the_second_step():
    counters.clear()
    step = fzero.compile(train_step, jit="aot_eager")
    state = step.init(_state())
    graphs = []
    for b in _batches(5):
        state, _ = step(state, b)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] >= 1 and graphs[1:] == [graphs[1]] * 4, graphs
    assert not counters["graph_break"], dict(counters["graph_break"])  # the GPT compiles whole


def test_a_new_batch_shape_compiles_once_even_after_a_step_under_a_dispatch_mode():
    """Dynamo stops compiling code it once met under a dispatch mode; the FLOP counter of
    fzero.monitor wraps a shape's first step in one. The step under the mode runs the model
    eagerly, so the jit keeps compiling: one new (dynamic) graph at the first change of the
    sequence length, none at the next."""
    from torch.utils.flop_counter import FlopCounterMode

    counters.clear()
    step = fzero.compile(train_step, jit="aot_eager")
    state = step.init(_state())
    batch = _batches(1)[0]
    graphs = []
    for i, length in enumerate((None, None, 8, 4)):
        b = batch if length is None else {k: v[:, :length] for k, v in batch.items()}
        with FlopCounterMode(display=False) if i == 1 else contextlib.nullcontext():
            state, _ = step(state, b)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [graphs[0], graphs[0], graphs[0] + 1, graphs[0] + 1], graphs


def test_dropout_draws_the_eager_masks_under_jit():
    batches = _batches(3)
    losses, params = _run(batches, dropout=0.2, jit="aot_eager")
    eager_losses, eager_params = _run(batches, dropout=0.2)
    ft.assert_trees_close(losses, eager_losses, tol="exact")
    ft.assert_trees_close(params, eager_params, tol="exact")
    off, _ = _run(batches[:1], dropout=0.0, jit="aot_eager")
    assert not torch.equal(losses[0], off[0])  # the dropout did drop


def test_bf16_under_jit_equals_eager_bf16():
    batches = _batches(3)
    losses, params = _run(batches, jit="aot_eager", precision="bf16")
    eager_losses, eager_params = _run(batches, precision="bf16")
    ft.assert_trees_close(losses, eager_losses, tol="exact")
    ft.assert_trees_close(params, eager_params, tol="exact")


def test_jit_option_is_checked_and_read_from_a_deepspeed_config():
    with pytest.raises(ValueError, match=r"jit=\{'backnd': 'eager'\} has keys torch.compile does not take"):
        fzero.compile(train_step, jit={"backnd": "eager"})
    with pytest.raises(ValueError, match=r"jit=3 must be True/False"):
        fzero.CompileOptions(jit=3)
    base = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}
    cfg = fzero.Config.load({**base, "compile": {"enabled": True, "backend": "aot_eager"}})
    assert cfg.compile_options().jit == "aot_eager"
    assert fzero.Config.load({**base, "compile": {"enabled": True}}).compile_options().jit is True
    assert fzero.Config.load({**base, "compile": {"enabled": True, "backend": "eager", "kwargs": {"mode": "x"}}}
                             ).compile_options().jit == {"backend": "eager", "mode": "x"}
    assert "jit" not in fzero.Config.load(base).decided_options()


def _zero_jit_vs_eager(stages):
    """On every rank: each stage's jit step against its eager step, each rank its own rows."""
    from harness.ranks import current

    out = {}
    rank = current().rank
    batches = [{k: v[2 * rank:2 * rank + 2] for k, v in b.items()} for b in _batches(3)]
    mesh = fzero.Mesh(dp=2)
    for stage in stages:
        counters.clear()
        jit_losses, jit_params = _run(batches, jit="aot_eager", zero=stage, mesh=mesh)
        eager_losses, eager_params = _run(batches, zero=stage, mesh=mesh)
        out[stage] = (max(float((jit_params[k] - eager_params[k]).abs().max()) for k in jit_params),
                      float((jit_losses - eager_losses).abs().max()), counters["stats"]["unique_graphs"])
    # Stage 3 with units, each block compiled between the eager gathers: three blocks in runs
    # within a window of two, the first block a unit gathered again in backward, the last two
    # one unit kept from its forward to its backward.
    block = sum(p.numel() for p in _model(cfg=DEEPER).blocks[0].parameters())
    counters.clear()
    units = []
    options = dict(zero=3, mesh=mesh, cfg=DEEPER, max_reuse_distance=2 * block, units=units)
    jit_losses, jit_params = _run(batches, jit="aot_eager", **options)
    eager_losses, eager_params = _run(batches, **options)
    out["3 units"] = (max(float((jit_params[k] - eager_params[k]).abs().max()) for k in jit_params),
                      float((jit_losses - eager_losses).abs().max()), counters["stats"]["unique_graphs"])
    out["units"] = units
    # Tensor parallel over the same two ranks: each rank compiles its half of every block
    # (the rewritten layers' collectives run between the compiled pieces).
    from fzero.transforms import tp_plans

    counters.clear()
    mesh, whole = fzero.Mesh(tp=2), _batches(3)
    options = dict(mesh=mesh, tp=tp_plans.gpt(_model()))
    jit_losses, jit_params = _run(whole, jit="aot_eager", **options)
    eager_losses, eager_params = _run(whole, **options)
    out["tp"] = (max(float((jit_params[k] - eager_params[k]).abs().max()) for k in jit_params),
                 float((jit_losses - eager_losses).abs().max()), counters["stats"]["unique_graphs"])
    # A drawn dropout inside the compiled model cannot know its slice: refused, not guessed.
    try:
        _run(whole[:1], dropout=0.5, jit="aot_eager", mesh=mesh, tp={f"gpt.{k}": v for k, v in tp_plans.gpt(_model(0.5).gpt).items()})
        out["tp dropout"] = "ran"
    except ValueError as e:
        out["tp dropout"] = str(e)
    return out


@pytest.mark.slow
@pytest.mark.multirank
def test_zero_stages_under_jit_equal_eager_on_two_ranks(ranks):
    """One launch, stages 1-3 (stage 3 also with units: runs of blocks, each block compiled
    on its own) and tp=2: ZeRO's gradient hooks, reductions and (stage 3) gathers, and the
    tensor-parallel layers' collectives, run eagerly around the compiled forward; the
    trajectory is the eager one."""
    for rank, res in enumerate(ranks(2).run(_zero_jit_vs_eager, (1, 2, 3), timeout_s=300)):
        assert "a dropout inside a model compiled by compile(jit=) under tensor parallelism" in \
            res.pop("tp dropout"), rank
        for modules, keep in res.pop("units"):  # jit's and eager's: block 0 alone, blocks 1-2 kept
            assert modules[1] == modules[2] != modules[0] and keep == {modules[1]}, (rank, modules, keep)
        for stage, (param_err, loss_err, graphs) in res.items():
            assert param_err == 0.0 and loss_err == 0.0, (rank, stage, param_err, loss_err)
            assert graphs >= 1, (rank, stage)  # it did compile


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                    reason="inductor compiles C++ on a CPU: no C++ compiler (g++ or $CXX) on this machine")
def test_inductor_matches_eager_to_fp32_rounding():
    """jit=True, torch's default backend: inductor fuses and reorders the fp32 reductions."""
    batches = _batches(2)
    losses, params = _run(batches, jit=True)
    eager_losses, eager_params = _run(batches)
    ft.assert_trees_close(losses, eager_losses, tol="fp32")
    ft.assert_trees_close(params, eager_params, tol="fp32")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "g++")) is None,
                    reason="inductor compiles C++ on a CPU: no C++ compiler (g++ or $CXX) on this machine")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_block_checkpointed_inside_the_model_under_inductor_trains_as_under_torch_autocast(precision):
    """jit=True with torch.utils.checkpoint inside the model under bf16/fp16: the block is
    recomputed inside the compiled backward, and the model trains as the plain module under
    torch.autocast (under the "eager" and "aot_eager" backends the recomputation runs without
    the norms' rule and fails: docs/guide.md)."""
    from test_transforms import _CheckpointedNormNet, _trains_as_under_autocast

    torch.manual_seed(0)
    counters.clear()
    _trains_as_under_autocast(_CheckpointedNormNet("layer", reentrant=False), 3, precision, jit=True)
    assert counters["stats"]["unique_graphs"] >= 1  # it compiled
