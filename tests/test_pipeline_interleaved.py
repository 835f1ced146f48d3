"""Interleaved 1F1B (``schedule="interleaved"``, ``virtual_stages=v``): the schedule's order
and its bubble ``(p - 1) / (v m)`` counted in unit slots, and, on real gloo ranks, the
trajectory of plain PyTorch (``nn.Module`` + ``backward`` + ``torch.optim`` on the full
batch) under ZeRO over ``dp``, with a weight tied across ranks, and the activation bytes
each model-stage boundary sends."""

import re
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fzero
from fzero import optim
from fzero.distributed import comm
from fzero.transforms.pipeline import pipeline, schedule, split
from fzero.transforms.pipeline._schedule import slots

# --------------------------------------------------------------------------- the schedule (pure)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [1, 2, 3])
def test_interleaved_runs_every_op_once_in_stream_order_with_bubble_p_minus_1_over_vm(p, v):
    for m in (p, 2 * p, 3 * p):
        n = p * v
        for r in range(p):
            ops = schedule("interleaved", p, m, r, virtual_stages=v)
            chunks = range(r, n, p)
            assert sorted(ops) == sorted((op, j, c) for op in "FB" for j in range(m) for c in chunks), (p, v, m, r)
            for c in chunks:  # each model stage runs its micro-batches in order (one FIFO stream per boundary)
                for op in "FB":
                    assert [j for o, j, cc in ops if o == op and cc == c] == list(range(m)), (p, v, m, r, c, op)
                # a micro-batch's backward after its forward
                assert all(ops.index(("F", j, c)) < ops.index(("B", j, c)) for j in range(m))
        timeline = slots("interleaved", p, m, v)  # raises on a deadlock
        for r, t in enumerate(timeline):
            assert Fraction(t["idle"], t["busy"]) == Fraction(p - 1, v * m), (p, v, m, r, t)
            assert t["busy"] == 3 * v * m  # a forward 1 slot, a backward 2, per model stage
        if v == 1:  # one chunk per rank: 1F1B's bubble
            assert [Fraction(t["idle"], t["busy"]) for t in slots("1f1b", p, m)] == [Fraction(p - 1, m)] * p


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [2, 3])
def test_each_pair_of_ranks_receives_in_the_order_it_sends(p, v):
    """What rank a sends rank b (activations out of a's stages, gradients back out of them),
    in a's op order, is what b receives from a in b's op order: the messages match without
    tags (NCCL has none), and no receive waits on a later send of the same peer."""
    n = p * v
    for m in (p, 2 * p, 3 * p):
        orders = [schedule("interleaved", p, m, r, virtual_stages=v) for r in range(p)]
        for a in range(p):
            for b in set(range(p)) - {a}:
                sent = [("act", j, c) if op == "F" else ("grad", j, c) for op, j, c in orders[a]
                        if (op == "F" and c < n - 1 and (c + 1) % p == b) or (op == "B" and c > 0 and (c - 1) % p == b)]
                received = [("act", j, c - 1) if op == "F" else ("grad", j, c + 1) for op, j, c in orders[b]
                            if (op == "F" and c > 0 and (c - 1) % p == a)
                            or (op == "B" and c < n - 1 and (c + 1) % p == a)]
                assert sent == received, (p, v, m, a, b)


def test_interleaved_options_are_checked_by_name():
    with pytest.raises(ValueError, match=r"micro_batches=3 is not a multiple of pp=2"):
        schedule("interleaved", 2, 3, 0, virtual_stages=2)
    with pytest.raises(ValueError, match=r"virtual_stages=2 needs schedule='interleaved'"):
        schedule("1f1b", 2, 4, 0, virtual_stages=2)
    with pytest.raises(ValueError, match=r"virtual_stages=0 must be a positive int"):
        schedule("interleaved", 2, 4, 0, virtual_stages=0)
    with pytest.raises(ValueError, match=r"schedule='zigzag' must be one of"):
        schedule("zigzag", 2, 4, 0)


# --------------------------------------------------------------------------- on ranks


def _mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 5), nn.Tanh(),
                         nn.Linear(5, 2))


def _tied(seed, vocab=7, d=6):
    """An embedding whose weight is the head's too: model stage 0 (rank 0) and 3 (rank 1)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(vocab, d), nn.Linear(d, d), nn.Tanh(), nn.Linear(d, vocab, bias=False))
    model[3].weight = model[0].weight
    return model


TORCH_TX = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)}
FZERO_TX = {"sgd": lambda: optim.sgd(0.05, momentum=0.9), "adamw": lambda: optim.adamw(1e-2, weight_decay=0.1)}


def _interleaved_as_plain_torch(m, tx, zero, tied, *, steps=3, per_mb=2, save=None):
    """Runs on every rank of pp=2 x dp=2: v=2 model stages per rank (4 in all) under
    ``fzero.compile(pipeline=..., zero=...)``; returns what the test checks on the host."""
    p, v = 2, 2
    mesh = fzero.Mesh(pp=p, dp=2)
    dp, j = mesh.size("dp"), mesh.coords["dp"]
    n = per_mb * m * dp
    g = torch.Generator().manual_seed(7 + m)
    if tied:
        batches = [{"x": torch.randint(7, (n,), generator=g), "y": torch.randint(7, (n,), generator=g)}
                   for _ in range(steps)]
        loss_fn, make, cuts = F.cross_entropy, _tied, [1, 2, 3]
    else:
        batches = [{"x": torch.randn(n, 3, generator=g), "y": torch.randn(n, 2, generator=g)} for _ in range(steps)]
        loss_fn, make, cuts = F.mse_loss, _mlp, [2, 4, 6]

    ref = make(m)  # plain PyTorch on the full global batch
    ref_opt = TORCH_TX[tx](ref.parameters())
    ref_losses = []
    for b in batches:
        ref_opt.zero_grad()
        loss = loss_fn(ref(b["x"]), b["y"])
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())

    model = make(m)
    apply, params = fzero.functionalize(model)
    pipe = pipeline(split(model, cuts), loss_fn, mesh, micro_batches=m, schedule="interleaved", virtual_stages=v)

    def train_step(state, batch):
        loss, grads = pipe(state.params, batch["x"], batch["y"])
        return state.apply_gradients(grads), {"loss": loss}

    step = fzero.compile(train_step, mesh, pipeline=pipe, zero=zero, comm_bytes=True)
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=FZERO_TX[tx]()))
    losses, sent = [], []
    for b in batches:
        before = comm.traffic.copy()
        local = fzero.tree.map(lambda t: t.chunk(dp)[j], b)
        state, metrics = step(state, local)
        spent = comm.traffic - before
        losses.append(float(metrics["loss"]))
        sent.append({w: spent.bytes("send", w) for w in ("activations", "activation_gradients")})
    full = pipe.gather(state.params)
    expected = dict(ref.named_parameters())
    assert set(full) == set(expected), (sorted(full), sorted(expected))
    for name, t in expected.items():
        torch.testing.assert_close(full[name], t.detach(), rtol=1e-5, atol=1e-6,
                                   msg=lambda s, name=name: f"rank {dist.get_rank()}, {name}: {s}")
    if tied and pipe.stage == p - 1:  # the last rank's copy of the tied weight, bit for bit the first's
        assert torch.equal(fzero.gather(state.params)["0.weight"], full["0.weight"])
    if save is not None:
        fzero.checkpoint.save(save, state)
    return {"full": full, "stage": pipe.stage, "chunks": pipe.chunks, "losses": losses, "ref_losses": ref_losses,
            "stats": {k: pipe.stats[k] for k in ("busy_slots", "idle_slots", "max_in_flight")}, "sent": sent}


def _option_errors():
    """The constructor's messages (every rank raises them, before any communication)."""
    model, out = _mlp(0), []
    for stages, mesh, kw in [(split(model, [2, 4]), fzero.Mesh(pp=2, dp=2), {"micro_batches": 2}),
                             (split(model, [2, 4, 6]), fzero.Mesh(pp=2, dp=2), {"micro_batches": 3}),
                             (split(model, [2, 4, 6]), fzero.Mesh(pp=2, dp=2), {"schedule": "1f1b"}),
                             (split(model, [4]), fzero.Mesh(pp=1, dp=4), {"micro_batches": 2})]:
        kw = {"schedule": "interleaved", "virtual_stages": 2, "micro_batches": 2, **kw}
        with pytest.raises(ValueError) as e:
            pipeline(stages, F.mse_loss, mesh, **kw)
        out.append(str(e.value))
    return out


CASES = [(2, "sgd", 0, False), (4, "adamw", 2, False), (4, "adamw", 3, True)]  # (m, optimizer, ZeRO, tied)


@pytest.mark.multirank
@pytest.mark.slow
def test_interleaved_1f1b_gives_plain_torch_losses_and_parameters(ranks, tmp_path):
    """pp=2 x dp=2, v=2, m in {2, 4}, ZeRO 0/2/3 over dp (the last with a weight tied
    across ranks), one launch: the losses and whole parameters of plain PyTorch (fp32, rel
    1e-5); every rank idles ``(p-1)/(v m)`` of its busy slots; each model-stage boundary
    carries one activation per micro-batch forward and its gradient back. The last case's
    checkpoint loads onto the plain state of the whole model, in this process, and exports."""
    pool = ranks(4)
    per_mb = 2
    for m, tx, zero, tied in CASES:
        save = str(tmp_path / "ck") if tied else None
        results = pool.run(_interleaved_as_plain_torch, m, tx, zero, tied, per_mb=per_mb, save=save, timeout_s=120)
        # Features crossing the boundaries after model stages 0, 1, 2 (fp32).
        width = [6, 6, 6] if tied else [6, 6, 5]
        for res in results:
            torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(res["ref_losses"]),
                                       rtol=1e-5, atol=1e-6)
            assert res["chunks"] == (res["stage"], res["stage"] + 2)  # rank r holds stages r and r + p
            st = res["stats"]
            assert Fraction(st["idle_slots"], st["busy_slots"]) == Fraction(2 - 1, 2 * m), (m, res)
            # (model stage, micro-batch) pairs held at once: the warm-up forwards and one more
            # (all m v when m == p), 2 (p - r - 1) + (v - 1) p + 1 on rank r.
            r = res["stage"]
            assert st["max_in_flight"] == (2 * m if m == 2 else 2 * (2 - r - 1) + 2 + 1), (m, res)
            # Per step: one activation per micro-batch out of each of this rank's stages but
            # the last, one gradient back out of each but the first.
            act = sum(m * per_mb * 4 * width[c] for c in res["chunks"] if c < 3)
            grad = sum(m * per_mb * 4 * width[c - 1] for c in res["chunks"] if c > 0)
            assert res["sent"] == [{"activations": act, "activation_gradients": grad}] * 3, (m, res)
        assert len({tuple(r["losses"]) for r in results}) == 1  # every rank reports the last stage's loss
    for msgs in pool.run(_option_errors):
        assert [re.sub(r"\(Mesh\([^)]*\)\)", "(MESH)", m) for m in msgs] == [
            "fzero.pipeline: 3 stages, but the mesh's pp axis has 2 ranks (MESH); "
            "give 2 stages per pp rank (virtual_stages=2)",
            "fzero.pipeline: schedule='interleaved' runs micro-batches in groups of the pp size: "
            "micro_batches=3 is not a multiple of pp=2",
            "fzero.pipeline: virtual_stages=2 needs schedule='interleaved' (schedule='1f1b' runs one model "
            "chunk per rank)",
            "fzero.pipeline: schedule='interleaved' needs a pp axis of 2 ranks or more (MESH); "
            "with one rank, run the stages as one (schedule='1f1b')",
        ], msgs
    # The last case's checkpoint (pp=2 x dp=2, v=2, ZeRO-3, tied) onto the plain state.
    full = results[0]["full"]
    model = _tied(99)  # other values: every parameter must come from the file
    apply, params = fzero.functionalize(model)
    plain = fzero.checkpoint.load(str(tmp_path / "ck"), like=fzero.TrainState.create(
        apply_fn=apply, params=params, tx=FZERO_TX["adamw"]()))
    assert set(plain.params) == set(full)
    for name, t in full.items():
        assert torch.equal(plain.params[name], t), name
    assert int(plain.step) == 3
    from safetensors.torch import load_file

    fzero.checkpoint.export(str(tmp_path / "ck"), tmp_path / "model.safetensors")
    exported = load_file(str(tmp_path / "model.safetensors"))
    assert set(exported) == set(full) and all(torch.equal(exported[k], full[k]) for k in full)
