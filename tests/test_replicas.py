"""Silent divergence: ``compile(check_replicas=N)`` on real ranks finds replicas that drifted
apart, names the leaves, the ranks and the step, and says nothing of replicas that agree."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fzero
from fzero import optim, replicas

pytestmark = pytest.mark.multirank


def _train(stage: int, every: int, drift_at: int | None, steps: int = 4, tp: bool = False,
           leaf: str = "2.weight"):
    """Train a tiny model on 2 ranks (dp=2, or tp=2 with the tensor-parallel tests' ``Net``);
    in the step from update ``drift_at``, rank 1 nudges element 3 of the updated ``leaf`` by
    one ulp (a user's per-rank code). Returns the error's text, or the losses."""
    torch.manual_seed(0)
    if tp:
        from test_tensor_parallel import PLAN, Net

        model, mesh, d_in, d_out, extra = Net(), fzero.Mesh(dp=1, tp=2), 5, 3, {"tp": PLAN}
    else:
        model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        mesh, d_in, d_out, extra = fzero.Mesh(dp=-1), 6, 2, {}
    apply, params = fzero.functionalize(model)
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-2))

    def train_step(state, batch):
        loss, g = fzero.value_and_grad(lambda p: F.mse_loss(state.apply_fn(p, batch["x"]), batch["y"]))(state.params)
        new = state.apply_gradients(g)
        if int(state.step) == drift_at and dist.get_rank() == 1:  # after the update (and ZeRO's gather)
            w = new.params[leaf].view(-1)
            w[3] = torch.nextafter(w[3], torch.tensor(10.0))
        return new, {"loss": loss}

    step = fzero.compile(train_step, mesh, zero=stage, check_replicas=every, **extra)
    state = step.init(state)
    losses = []
    try:
        for i in range(steps):
            g = torch.Generator().manual_seed(100 * i + (0 if tp else dist.get_rank()))
            x, y = torch.randn(4, d_in, generator=g), torch.randn(4, d_out, generator=g)
            state, m = step(state, {"x": x, "y": y})
            losses.append(float(m["loss"]))
    except fzero.ReplicaDivergenceError as e:
        return f"{e}\nstep={e.step} leaves={sorted(e.leaves)}"
    return losses


@pytest.mark.parametrize("stage", [0, 2])
def test_a_replica_nudged_by_one_ulp_is_named_with_the_leaf_ranks_and_step(ranks, stage):
    said = ranks(2).run(_train, stage, 2, 1)
    assert said[0] == said[1] and isinstance(said[0], str), said
    # Nudged in the step to update 2; the check at update 2 sees it.
    assert said[0].startswith("fzero.compile(check_replicas=): replicas diverged at step 2: 1 leaf that should be "
                              "identical on the ranks holding it differs:\n  .params['2.weight'] differs between its "
                              "holders (rank 0: sum "), said[0]
    assert said[0].endswith("step=2 leaves=[\".params['2.weight']\"]"), said[0]


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_replicas_that_agree_pass_every_check(ranks, stage):
    said = ranks(2).run(_train, stage, 1, None)
    assert said[0] == said[1] and len(said[0]) == 4, said


def test_under_tp_the_whole_weights_are_compared_across_the_peers_and_each_slice_alone(ranks):
    assert len(ranks(2).run(_train, 0, 1, None, 3, True)[0]) == 3  # tp peers that agree pass
    # A whole weight (the head) nudged on rank 1: named. A split weight's slice has one holder at dp=1.
    said = ranks(2).run(_train, 0, 1, 1, 3, True, "head.weight")
    assert said[0] == said[1] and "  .params['head.weight'] differs between its holders (rank 0: sum " in said[0], said
    assert said[0].startswith("fzero.compile(check_replicas=): replicas diverged at step 2: "), said[0]
    assert len(ranks(2).run(_train, 0, 1, 1, 3, True, "blocks.0.fc.weight")[0]) == 3


def _holders(drift: bool):
    """Rank 0 holds {a, tied}, rank 1 {b, tied} (two pipeline stages with a tied weight)."""
    r = dist.get_rank()
    tied = torch.arange(6.0)
    if drift and r == 1:
        tied[5] += 1e-3
    state = {"tied": tied, "step": torch.tensor(7), ("a" if r == 0 else "b"): torch.full((3,), float(r))}
    try:
        replicas.check(state, 7, timeout_s=30)
    except fzero.ReplicaDivergenceError as e:
        return str(e), e.leaves
    return "no error"


def test_leaves_are_compared_among_the_ranks_holding_them(ranks):
    assert ranks(2).run(_holders, False) == ["no error"] * 2  # a and b differ, but each has one holder
    said = ranks(2).run(_holders, True)
    assert said[0] == said[1], said
    text, leaves = said[0]
    drifted = 10.0 + float(torch.tensor(5.0) + 1e-3)  # 0 + 1 + 2 + 3 + 4 + float32(5.001), in float64
    assert text == ("fzero.compile(check_replicas=): replicas diverged at step 7: 1 leaf that should be identical "
                    "on the ranks holding it differs:\n  ['tied'] differs between its holders (rank 0: sum 15.0; "
                    f"rank 1: sum {drifted!r})"), text
    assert leaves == {"['tied']": {0: 15.0, 1: drifted}}


def test_the_fingerprint_is_exact_and_order_free():
    x = torch.randn(1000)
    _, a = replicas.fingerprints({"x": x})
    _, b = replicas.fingerprints({"x": x.flip(0).flip(0).clone()})
    y = x.clone()
    y[500] = torch.nextafter(y[500], torch.tensor(float("inf")))
    _, c = replicas.fingerprints({"x": y})
    assert torch.equal(a, b) and a[0, 0] != c[0, 0]
    keys, fp = replicas.fingerprints({"w": torch.ones(3, dtype=torch.bfloat16), "m": torch.tensor([True, False])})
    assert keys == ["['m']", "['w']"] and fp.tolist()[0][0] == 1 and fp.tolist()[1][0] == 3 * 0x3F80  # bf16 1.0


def test_the_config_key_is_fzero_check_replicas():
    apply, params = fzero.functionalize(torch.nn.Linear(2, 1))
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
    cfg = {"train_batch_size": 4, "fzero": {"check_replicas": 100}}
    step = fzero.compile(lambda s, b: (s, {}), config=cfg)
    assert step.options.check_replicas == 100 and fzero.Config.load(cfg).check_replicas == 100
    with pytest.raises(ValueError, match=r"check_replicas=5 contradicts the config's check_replicas=100 "
                                         r"\(fzero.check_replicas\)"):
        fzero.compile(lambda s, b: (s, {}), config=cfg, check_replicas=5)
    with pytest.raises(ValueError, match=r"fzero.check_replicas must be >= 1, got 0"):
        fzero.Config.load({"train_batch_size": 4, "fzero": {"check_replicas": 0}})
    with pytest.raises(ValueError, match=r"check_replicas=0 must be"):
        fzero.compile(lambda s, b: (s, {}), check_replicas=0)
    step.init(state)  # one process: nothing to compare, nothing to fail
