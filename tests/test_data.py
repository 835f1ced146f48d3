"""fzero.data: the loader's batches against torch's own DataLoader over the same seeded
permutation, its sharding on real ranks, and exact resume of a real training run killed by
SIGKILL.

The reference is always built here from torch alone: ``torch.randperm`` under a
``torch.Generator`` seeded with ``seed + epoch`` (``DistributedSampler``'s rule), fed to
``torch.utils.data.DataLoader`` as its sampler.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
import torch.utils.data as tud

import fzero
import fzero.checkpoint as ckpt
import fzero.testing as ft
from fzero import optim
from fzero.data import DataLoader, GlobalBatchSampler
from harness.ranks import RankError


class Rows(tud.Dataset):
    """``n`` rows ``{"i": index, "x": ..., "y": ...}`` drawn from a fixed seed; records which
    indices were loaded."""

    def __init__(self, n: int, d_in: int = 3, d_out: int = 2, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.x, self.y = torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)
        self.loaded: list[int] = []

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.loaded.append(i)
        return {"i": i, "x": self.x[i], "y": self.y[i]}


class _Stream(tud.IterableDataset):
    def __iter__(self):
        return iter(range(3))


def _reference(dataset, batch_size, epoch, *, seed=0, shuffle=True, drop_last=True):
    """Epoch ``epoch``'s global batches by torch alone: its DataLoader over the seeded permutation."""
    n = len(dataset)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)) if shuffle else range(n)
    return list(tud.DataLoader(dataset, batch_size=batch_size, sampler=list(order), drop_last=drop_last))


def _ids(batches):
    return [b["i"].tolist() for b in batches]


# --------------------------------------------------------------------------- one process


@pytest.mark.parametrize("n, b, shuffle", [(20, 4, True), (23, 5, True), (12, 3, False), (7, 7, True)])
def test_batches_are_torch_dataloader_batches_over_the_seeded_permutation(n, b, shuffle):
    data = Rows(n)
    loader = DataLoader(data, batch_size=b, seed=11, shuffle=shuffle)
    for epoch in range(3):
        got, want = list(loader), _reference(data, b, epoch, seed=11, shuffle=shuffle)
        assert len(got) == len(want) == len(loader) == n // b
        for g, w in zip(got, want):
            assert g.keys() == w.keys()
            for k in w:
                assert torch.equal(g[k], w[k]), (epoch, k)


def test_epochs_differ_and_the_seed_alone_decides_the_order():
    data = Rows(32)
    a, b, c = (DataLoader(data, batch_size=8, seed=s) for s in (3, 3, 4))
    ea = [_ids(a) for _ in range(3)]
    assert ea == [_ids(b) for _ in range(3)]  # same seed, same order, epoch after epoch
    assert ea[0] != ea[1] != ea[2] != ea[0]  # each epoch reshuffles
    assert _ids(c) != ea[0]  # another seed, another order
    for e in ea:  # every epoch is a permutation
        assert sorted(sum(e, [])) == list(range(32))


def test_drop_last_false_keeps_the_short_last_batch_as_torch_does():
    data = Rows(10)
    kept = _ids(DataLoader(data, batch_size=4, seed=1, drop_last=False))
    assert kept == _ids(_reference(data, 4, 0, seed=1, drop_last=False))
    assert [len(x) for x in kept] == [4, 4, 2]
    assert _ids(DataLoader(data, batch_size=4, seed=1)) == kept[:2]  # drop_last=True by default


def test_drop_last_false_refuses_a_short_batch_that_does_not_split_over_the_ranks():
    with pytest.raises(ValueError, match=r"9 % 4 = 1 samples.*dp_size=2"):
        GlobalBatchSampler(9, 4, dp_size=2, drop_last=False)
    assert [len(x) for x in GlobalBatchSampler(10, 4, dp_size=2, dp_rank=1, drop_last=False)] == [2, 2, 1]


def test_global_rng_is_untouched_and_workers_give_the_same_batches():
    data = Rows(24)
    before = torch.get_rng_state()
    plain = _ids(DataLoader(data, batch_size=6, seed=5))
    assert torch.equal(torch.get_rng_state(), before)  # torch's own DataLoader draws from it unless given a generator
    workers = DataLoader(data, batch_size=6, seed=5, num_workers=2, collate_fn=tud.default_collate)
    assert [_ids(workers) for _ in range(2)] == [plain, _ids(_reference(data, 6, 1, seed=5))]


def test_resume_skips_the_consumed_batches_without_loading_them():
    data = Rows(20)
    full = DataLoader(data, batch_size=4, seed=2)
    uninterrupted = [_ids(full) for _ in range(3)]  # 5 batches an epoch
    first = DataLoader(data, batch_size=4, seed=2)
    it, seen = iter(first), []
    for _ in range(5 + 2):  # all of epoch 0, two batches of epoch 1
        try:
            seen.append(next(it)["i"].tolist())
        except StopIteration:
            it = iter(first)
            seen.append(next(it)["i"].tolist())
    pos = first.state_dict()
    assert (pos["epoch"], pos["batch"]) == (1, 2)
    pos = json.loads(json.dumps(pos))  # plain JSON, as a checkpoint's manifest carries it
    data.loaded.clear()
    second = DataLoader(data, batch_size=4, seed=2)
    second.load_state_dict(pos)
    rest = _ids(second) + _ids(second)
    assert seen + rest == sum(uninterrupted, [])
    assert sorted(data.loaded) == sorted(sum(rest, []))  # the skipped batches were never loaded


def test_a_position_after_an_epochs_last_batch_goes_on_with_the_next_epoch():
    data = Rows(8)
    a = DataLoader(data, batch_size=4)
    it = iter(a)
    next(it), next(it)
    assert (a.state_dict()["epoch"], a.state_dict()["batch"]) == (1, 0)
    b = DataLoader(data, batch_size=4)
    b.load_state_dict(a.state_dict())
    assert _ids(b) == _ids(_reference(data, 4, 1))


def test_the_position_travels_in_a_checkpoint(tmp_path):
    data = Rows(12)
    a = DataLoader(data, batch_size=3, seed=9)
    next(iter(a))
    ckpt.save(tmp_path / "step_1", {"step": torch.tensor(1)}, metadata={"loader": a.state_dict()})
    b = DataLoader(data, batch_size=3, seed=9)
    b.load_state_dict(ckpt.metadata(ckpt.latest(tmp_path))["loader"])
    assert _ids(b) == _ids(_reference(data, 3, 0, seed=9))[1:]


def test_a_config_gives_the_batch_sizes_and_drop_last():
    data = Rows(14)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}
    loader = DataLoader(data, config=cfg)
    assert (loader.global_batch_size, loader.local_batch_size, len(loader)) == (6, 6, 2)
    kept = DataLoader(data, config={**cfg, "dataloader_drop_last": False}, seed=4)
    assert _ids(kept) == _ids(_reference(data, 6, 0, seed=4, drop_last=False))
    assert fzero.Config.load({**cfg, "dataloader_drop_last": False}).ignored == ()
    with pytest.raises(ValueError, match=r"batch_size=4 but the config's train_batch_size is 6; "
                                         r"drop_last=True but the config's dataloader_drop_last is False"):
        DataLoader(data, 4, config={**cfg, "dataloader_drop_last": False}, drop_last=True)


def test_bad_input_is_named():
    data = Rows(12)
    with pytest.raises(ValueError, match="global_batch_size=5 does not split evenly over dp_size=2"):
        GlobalBatchSampler(12, 5, dp_size=2)
    with pytest.raises(ValueError, match="dataset_length=12 < global_batch_size=16"):
        DataLoader(data, 16)
    with pytest.raises(ValueError, match="give batch_size="):
        DataLoader(data)
    with pytest.raises(ValueError, match="sampler, generator are decided by fzero's loader"):
        DataLoader(data, 4, generator=None, sampler=None)
    with pytest.raises(TypeError, match="map-style"):
        DataLoader(_Stream(), 4)
    with pytest.raises(TypeError, match="batch_size must be an int, got float 4.0"):
        DataLoader(data, 4.0)
    saved = DataLoader(Rows(13), 3, seed=1).state_dict()
    with pytest.raises(ValueError, match=r"seed: saved 1, this loader 0; global_batch_size: saved 3, this loader 4; "
                                         r"dataset_length: saved 13, this loader 12"):
        DataLoader(data, 4).load_state_dict(saved)
    with pytest.raises(ValueError, match=r"missing: batch; unknown: index"):
        DataLoader(data, 4).load_state_dict({**{k: v for k, v in saved.items() if k != "batch"}, "index": 0})
    with pytest.raises(ValueError, match="batch=9 is past the epoch's 3 global batches"):
        DataLoader(data, 4).load_state_dict({**DataLoader(data, 4).state_dict(), "batch": 9})


def test_an_older_iterator_stops_when_a_newer_one_starts():
    loader = DataLoader(Rows(12), 4)
    old = iter(loader)
    next(old)
    assert _ids(loader) and loader.state_dict()["epoch"] == 1
    with pytest.raises(RuntimeError, match="superseded by a newer iter"):
        next(old)


# --------------------------------------------------------------------------- real ranks


def _local_ids(n, b, axes, epochs, seed):
    mesh = fzero.Mesh(**axes)
    loader = DataLoader(Rows(n), batch_size=b, mesh=mesh, seed=seed)
    return [_ids(loader) for _ in range(epochs)]


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("axes, n_dp", [({"dp": -1}, 2), ({"dp": 1, "tp": 2}, 1), ({"dp": 1, "pp": 2}, 1)])
def test_ranks_local_batches_concatenate_to_the_one_process_batches(ranks, axes, n_dp):
    n, b, seed = 22, 6, 7
    per_rank = ranks(2).run(_local_ids, n, b, axes, 2, seed)
    for epoch in range(2):
        want = _ids(_reference(Rows(n), b, epoch, seed=seed))
        if n_dp == 2:  # rank 0's rows then rank 1's: the global batch
            got = [r0 + r1 for r0, r1 in zip(per_rank[0][epoch], per_rank[1][epoch])]
        else:  # one dp coordinate: both ranks get the whole batch
            assert per_rank[0][epoch] == per_rank[1][epoch]
            got = per_rank[0][epoch]
        assert got == want, (axes, epoch)


STEPS, EVERY, KILL_AFTER = 12, 3, 8
CONFIG = {"train_batch_size": 8, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2},
          "gradient_clipping": 0.5}


def _fresh(mesh):
    torch.manual_seed(0)
    apply, params = fzero.functionalize(ft.Blocks(3, 8, 1, 2))
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(3e-2, weight_decay=0.1))
    step = fzero.compile(ft.mse_step, mesh, config=CONFIG)
    return step, step.init(state)


def _train(root, log, kill_after=None, resume_from=None):
    """Train to STEPS, saving (state, loader position) every EVERY steps under ``root``; append
    each step's loss to ``log`` (rank 0). ``kill_after``: SIGKILL this rank after that step.
    ``resume_from``: a checkpoint to go on from, state and loader position."""
    mesh = fzero.Mesh(dp=-1)
    step, state = _fresh(mesh)
    data = Rows(44)  # 5 global batches an epoch: the checkpoint falls mid-epoch, the run crosses two
    loader = DataLoader(_XY(data), config=CONFIG, mesh=mesh, seed=3)
    if resume_from:
        state = ckpt.load(resume_from, like=state)
        loader.load_state_dict(ckpt.metadata(resume_from)["loader"])
    losses = []

    def batches():
        while True:
            yield from loader

    for batch in batches():
        if int(state.step) == STEPS:
            break
        state, m = step(state, batch)
        k = int(state.step)
        losses.append((k, float(m["loss"]).hex()))
        if mesh.rank == 0 and log:
            with open(log, "a") as f:
                f.write(json.dumps([k, float(m["loss"]).hex()]) + "\n")
        if k % EVERY == 0:
            ckpt.save(f"{root}/step_{k}", state, metadata={"loader": loader.state_dict()})
        if k == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    return losses


class _XY(tud.Dataset):
    """The ``x`` and ``y`` of :class:`Rows` (what ``mse_step`` reads)."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return {"x": r["x"], "y": r["y"]}


@pytest.mark.multirank
@pytest.mark.slow
def test_a_run_killed_mid_training_resumes_with_the_identical_loss_curve(ranks, tmp_path):
    pool = ranks(2)
    straight = pool.run(_train, str(tmp_path / "straight"), None)
    assert straight[0] == straight[1] and [k for k, _ in straight[0]] == list(range(1, STEPS + 1))
    log = tmp_path / "killed.jsonl"
    with pytest.raises(RankError) as e:
        pool.run(_train, str(tmp_path / "killed"), str(log), KILL_AFTER)
    assert e.value.exit_codes == {0: -signal.SIGKILL, 1: -signal.SIGKILL}, e.value
    before = [tuple(json.loads(line)) for line in log.read_text().splitlines()]
    assert [k for k, _ in before] == list(range(1, KILL_AFTER + 1))
    start = KILL_AFTER // EVERY * EVERY
    last = ckpt.latest(tmp_path / "killed")
    assert last.endswith(f"step_{start}") and ckpt.metadata(last)["loader"]["batch"] > 0  # mid-epoch
    resumed = pool.run(_train, str(tmp_path / "resumed"), None, None, last)
    assert resumed[0] == resumed[1] and [k for k, _ in resumed[0]] == list(range(start + 1, STEPS + 1))
    # Bit for bit: the killed run up to its death, then the resumed run, is the straight run;
    # the steps done twice (after the last checkpoint, before the kill) agree too.
    assert before[:start] + resumed[0] == straight[0]
    assert before[start:] == resumed[0][:KILL_AFTER - start]

    # Onto one process (the same global batch, no ranks): the same batches, so the same curve
    # up to the order of the reduction over ranks.
    one = _train(str(tmp_path / "one"), None, None, last)
    ft.assert_trees_close(torch.tensor([float.fromhex(v) for _, v in one]),
                          torch.tensor([float.fromhex(v) for _, v in straight[0][start:]]), what="losses on 1 rank")
