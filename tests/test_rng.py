"""fzero.rng: dropout masks are a correct dropout, and a row's mask does not depend on where
the row is held (which micro-batch, which rank, which slice of a split tensor).

The statistical checks compare with what dropout must be: each element kept with
probability 1 - p, independently, scaled by 1/(1 - p) (torch's definition), tested at five
standard deviations so that a correct generator fails about once in 3.5 million runs.
"""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

import fzero
from fzero import optim
from fzero.rng import Slice, dropout_keep, hash32, mix32

Z = 5.0  # standard deviations


def _binomial_ok(kept: int, n: int, q: float) -> bool:
    return abs(kept - n * q) <= Z * math.sqrt(n * q * (1 - q))


@pytest.mark.parametrize("p", [0.05, 0.1, 0.5, 0.9])
def test_masks_keep_each_element_with_probability_one_minus_p(p):
    keep = dropout_keep((64, 4096), p, key=hash32(3, 1), start=0, rows=64)
    assert _binomial_ok(int(keep.sum()), keep.numel(), 1 - p)
    # Every row and every column position on its own is a dropout of rate p too.
    per_row = keep.float().mean(1)
    assert float(per_row.std()) < 3 * math.sqrt(p * (1 - p) / 4096)


def test_masks_are_uncorrelated_between_neighbours_rows_keys_and_updates():
    p, n = 0.5, 1 << 18
    a = dropout_keep((32, n // 32), p, key=hash32(0, 0, 0), start=0, rows=32).float().flatten()
    b = dropout_keep((32, n // 32), p, key=hash32(0, 0, 1), start=0, rows=32).float().flatten()  # the next call
    c = dropout_keep((32, n // 32), p, key=hash32(0, 1, 0), start=0, rows=32).float().flatten()  # the next update
    d = dropout_keep((32, n // 32), p, key=hash32(1, 0, 0), start=0, rows=32).float().flatten()  # another seed
    def corr(x, y):
        x, y = x - x.mean(), y - y.mean()
        return float((x * y).mean() / (x.std() * y.std()))
    bound = Z / math.sqrt(n)
    assert abs(corr(a[1:], a[:-1])) < bound  # neighbouring positions
    assert abs(corr(a[n // 32:], a[:-n // 32])) < bound  # the same position in the next row
    for other in (b, c, d):
        assert abs(corr(a, other)) < bound


def test_a_rows_mask_depends_on_its_global_index_only():
    full = dropout_keep((8, 6, 5), 0.3, key=11, start=0, rows=8)
    # Rows 4..7 held alone (another rank, another micro-batch): the same bits.
    assert torch.equal(dropout_keep((4, 6, 5), 0.3, key=11, start=4, rows=4), full[4:])
    assert torch.equal(dropout_keep((1, 6, 5), 0.3, key=11, start=3, rows=1), full[3:4])  # a micro-batch of one
    # Flattened (B*T, C): the same bits as (B, T, C).
    assert torch.equal(dropout_keep((48, 5), 0.3, key=11, start=0, rows=8), full.reshape(48, 5))


def test_a_slice_of_a_split_tensor_is_the_slice_of_the_whole_mask():
    full = dropout_keep((4, 3, 8, 8), 0.5, key=5, start=2, rows=4)
    # Two ranks holding two heads each (dim 1 split): each one's mask is its slice of the whole.
    halves = [dropout_keep((4, 2, 8, 8), 0.5, key=5, start=2, rows=4, slice=Slice(1, 2 * r, 4)) for r in range(2)]
    whole = dropout_keep((4, 4, 8, 8), 0.5, key=5, start=2, rows=4)
    assert torch.equal(torch.cat(halves, 1), whole)
    assert torch.equal(full, whole[:, :3])  # positions count row-major: the leading heads' are the same
    wider = dropout_keep((4, 4, 8, 9), 0.5, key=5, start=2, rows=4)
    assert not torch.equal(wider[..., :8], whole)  # a split last dim is counted in the whole width
    # A fused projection's last dim: 3 blocks of 12 split over 2 ranks, each holding 6 of each.
    fused = dropout_keep((4, 36), 0.5, key=5, start=0, rows=4)
    mine = [dropout_keep((4, 18), 0.5, key=5, start=0, rows=4, slice=Slice(1, 6 * r, 36, parts=3)) for r in range(2)]
    assert torch.equal(torch.cat([torch.cat([m[:, 6 * b: 6 * b + 6] for m in mine], 1) for b in range(3)], 1), fused)


def test_the_hash_is_a_bijection_of_32_bit_values_on_a_sample():
    xs = torch.randint(0, 2 ** 32, (1 << 16,), dtype=torch.int64, generator=torch.Generator().manual_seed(0)).unique()
    from fzero.rng import _mix
    assert _mix(xs).unique().numel() == xs.numel()
    assert all(_mix(torch.tensor([int(x)])).item() == mix32(int(x)) for x in xs[:50])


# --------------------------------------------------------------------------- inside a step


class Net(nn.Module):
    def __init__(self, d=12, heads=2, p=0.25, remat=False):
        super().__init__()
        self.heads, self.p, self.remat = heads, p, remat
        self.inp = nn.Linear(5, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.drop = nn.Dropout(p)
        self.ln = nn.LayerNorm(d)
        self.out = nn.Linear(d, 3)

    def block(self, h):
        B, T, D = h.shape
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(h).chunk(3, -1))
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        return self.ln(h + self.drop(a.transpose(1, 2).reshape(B, T, D)))

    def forward(self, x):
        h = F.dropout(self.inp(x), self.p, self.training)
        h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False) if self.remat else self.block(h)
        return self.out(h)


def _step(state, batch):
    def loss_fn(p):
        logits = state.apply_fn(p, batch["x"])
        ce = F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten().clamp(min=0), reduction="none")
        return fzero.global_mean(ce, where=batch["y"].flatten() != -100)

    loss, g = fzero.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(g), {"loss": loss}


def _batches(steps=3, rows=8, T=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps):
        y = torch.randint(0, 3, (rows, T), generator=g)
        y[: rows // 2 + i % 2] = -100  # uneven valid tokens across micro-batches
        out.append({"x": torch.randn(rows, T, 5, generator=g), "y": y})
    return out


def _run(accumulate=1, seed=0, remat=False, rank_seed=0, **net):
    torch.manual_seed(0)
    model = Net(remat=remat, **net)
    apply, params = fzero.functionalize(model)
    # SGD, not Adam: the key bias gets a zero gradient in exact arithmetic (softmax ignores a
    # per-query shift), and Adam would blow its rounding noise up to full-size steps.
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1, momentum=0.9), seed=seed)
    step = fzero.compile(_step, accumulate=accumulate)
    state, losses = step.init(state), []
    for b in _batches():
        torch.manual_seed(rank_seed)  # what a program seeding per rank does: must change nothing
        state, m = step(state, b)
        losses.append(m["loss"])
    return torch.stack(losses), fzero.gather(state.params)


def test_dropout_in_a_step_is_the_same_at_every_accumulation_and_under_activation_checkpointing():
    losses, params = _run()
    for kw in (dict(accumulate=2), dict(accumulate=4), dict(remat=True), dict(accumulate=2, remat=True),
               dict(rank_seed=7)):
        l2, p2 = _run(**kw)
        fzero.testing.assert_trees_close(l2, losses, what=str(kw))
        fzero.testing.assert_trees_close(p2, params, what=str(kw))


def test_the_seed_decides_the_masks_and_dropout_is_on():
    l0, _ = _run(seed=0)
    l1, _ = _run(seed=1)
    lnone, _ = _run(p=0.0)
    assert not torch.allclose(l0, l1) and not torch.allclose(l0, lnone)


def test_a_dropout_in_a_step_is_torchs_dropout_in_law():
    """In a step, F.dropout keeps each element with probability 1 - p and scales by 1/(1 - p),
    and its gradient is the same mask times the same scale."""
    p = 0.3
    seen = {}

    def step(state, batch):
        x = batch.clone().requires_grad_(True)
        y = F.dropout(x, p, True)
        (g,) = torch.autograd.grad(y.sum(), x)
        seen.update(x=x.detach(), y=y.detach(), g=g)
        return state, {}

    apply, params = fzero.functionalize(nn.Linear(1, 1))
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
    fzero.compile(step, nonfinite="apply")(state, torch.rand(64, 1024) + 0.5)
    y, x, g = seen["y"], seen["x"], seen["g"]
    kept = y != 0
    assert _binomial_ok(int(kept.sum()), y.numel(), 1 - p)
    torch.testing.assert_close(y[kept], x[kept] / (1 - p))
    torch.testing.assert_close(g, kept.float() / (1 - p))


def test_sdpa_dropout_is_the_attention_math_with_the_steps_mask():
    """scaled_dot_product_attention(dropout_p=p) in a step is softmax(QKᵀ/√d + causal) with a
    dropout of rate p on the probabilities, then ·V: with p = 0 the same as torch's."""
    q, k, v = (torch.randn(2, 3, 5, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    got = {}

    def step(state, batch):
        got["p0"] = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        got["p"] = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, is_causal=True)
        mask = torch.ones(5, 5, dtype=torch.bool).tril()
        got["m"] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=1e-9)
        return state, {}

    apply, params = fzero.functionalize(nn.Linear(1, 1))
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
    fzero.compile(step, nonfinite="apply")(state, torch.zeros(2, 1))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(got["p0"], ref)
    torch.testing.assert_close(got["m"], ref, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got["p"], ref)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_hugging_face_gpt2s_dropouts_are_the_same_at_every_accumulation_and_with_its_checkpointing(attn):
    transformers = pytest.importorskip("transformers")

    def run(accumulate, checkpointing=False, pdrop=0.2):
        cfg = transformers.GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=2, n_head=2,
                                      resid_pdrop=pdrop, embd_pdrop=pdrop, attn_pdrop=pdrop)
        cfg._attn_implementation = attn
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(cfg)
        assert model.config._attn_implementation == attn
        if checkpointing:  # Hugging Face's own activation checkpointing (torch.utils.checkpoint)
            (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
        model.train()
        apply, params = fzero.functionalize(model)
        state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1, momentum=0.9), seed=3)

        def step_fn(state, batch):
            def loss_fn(p):
                logits = state.apply_fn(p, input_ids=batch["x"]).logits
                y = batch["y"].flatten()
                ce = F.cross_entropy(logits.flatten(0, 1), y.clamp(min=0), reduction="none")
                return fzero.global_mean(ce, where=y != -100)

            loss, g = fzero.value_and_grad(loss_fn)(state.params)
            return state.apply_gradients(g), {"loss": loss}

        step = fzero.compile(step_fn, accumulate=accumulate)
        state, losses = step.init(state), []
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            x = torch.randint(0, 32, (4, 6), generator=g)
            y = torch.roll(x, -1, 1)
            y[:2, 2:] = -100
            state, m = step(state, {"x": x, "y": y})
            losses.append(m["loss"])
        return torch.stack(losses), fzero.gather(state.params)

    losses, params = run(1)
    for kw in (dict(accumulate=2), dict(accumulate=4, checkpointing=True)):
        l2, p2 = run(**kw)
        ft_close = fzero.testing.assert_trees_close
        ft_close(l2, losses, what=f"{attn} {kw}")
        ft_close(p2, params, what=f"{attn} {kw}")
    assert not torch.allclose(run(1, pdrop=0.0)[0], losses)  # the dropouts are on
