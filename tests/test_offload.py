"""ZeRO-Offload of the optimizer (fzero/transforms/offload.py) on real ranks: the same
trajectory as the step that keeps everything on the device, host state of its own, and the
bytes copied each way each step derived from the parameter shapes and the world size.

On this CPU machine the host is the device: the copies are still made between distinct
tensors, so the code path is the one a GPU runs.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fzero
import fzero.checkpoint as ckpt
import fzero.testing as ft
from fzero import optim

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

# 4*5 + 5 + 5*3 + 3 = 43 parameters: one flat group padded to 44 over 2 ranks, so rank 0
# owns 22 of them and rank 1 21 (and a pad element).
SHAPES = [(5, 4), (5,), (3, 5), (3,)]
BIG_BUCKET = 2**20  # one group


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def _state():
    apply, params = fzero.functionalize(_model())
    return fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-2, weight_decay=0.1))


def _batches(n, steps=3, rows=4):
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(rows * n, 4, generator=g), "y": torch.randn(rows * n, 3, generator=g)}
            for _ in range(steps)]


def _owned(rank, world):
    """Elements of the parameters rank ``rank`` owns: its slice of the one flat group."""
    total = sum(torch.Size(s).numel() for s in SHAPES)
    chunk = -(-total // world)
    return min(total, (rank + 1) * chunk) - min(total, rank * chunk)


def _storages(*trees):
    out = set()
    for x in fzero.tree.leaves(trees):
        x = x.local if fzero.distributed.flat.is_shard(x) else x
        if isinstance(x, torch.Tensor) and x.numel() > 0:
            out.add(x.untyped_storage().data_ptr())
    return out


def _run(offload, stage, precision, donate):
    n, r = dist.get_world_size(), dist.get_rank()
    step = fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), zero=stage, dtype=precision, accumulate=2, clip_norm=1.0,
                         bucket_bytes=BIG_BUCKET, offload_optimizer=offload, comm_bytes=True, donate=donate)
    state, spent = step.init(_state()), []
    for b in _batches(n):
        state, m = step(state, ft.local_batch(b, n, r))
        spent.append(m.get("offload_bytes"))
    return state, spent


def _offloaded_equals_on_device(stage, precision, donate):
    n, r = dist.get_world_size(), dist.get_rank()
    ref, _ = _run("none", stage, precision, donate)
    state, spent = _run("cpu", stage, precision, donate)
    # The same foreach ops on the same values: the same bits.
    for a, b in zip(fzero.tree.leaves(fzero.gather(state.params)), fzero.tree.leaves(fzero.gather(ref.params))):
        assert torch.equal(a, b), f"rank {r}: offloaded parameters differ at stage {stage} {precision}"
    for a, b in zip(fzero.tree.leaves(fzero.gather(state.opt_state)), fzero.tree.leaves(fzero.gather(ref.opt_state))):
        assert torch.equal(a, b), f"rank {r}: offloaded optimizer state differs at stage {stage} {precision}"
    # Masters and optimizer state have storage of their own, apart from the device parameters,
    # so no byte is counted twice; the device keeps exactly what the non-offloaded state's
    # parameters hold.
    host, device = _storages(state.opt_state, state.extra["master"]), _storages(state.params)
    assert not host & device, f"rank {r}: host state shares storage with the device parameters"
    assert ft.storage_bytes(state.params, state.opt_state, state.extra["master"]) == \
        ft.storage_bytes(state.params) + ft.storage_bytes(state.opt_state, state.extra["master"])
    assert ft.storage_bytes(state.params) == ft.storage_bytes(ref.params)
    owned = _owned(r, n)
    assert ft.storage_bytes(state.extra["master"]) == 4 * owned
    # Each update: the fp32 gradient pieces to the host, the new pieces back in the
    # parameters' dtype; nothing else crosses.
    low = 4 if precision == "fp32" else 2
    assert spent == [{"d2h": 4 * owned, "h2d": low * owned}] * len(spent), (r, spent, owned)
    return True


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_trajectory_equals_the_on_device_one_bit_for_bit(ranks, stage, precision):
    assert ranks(2).run(_offloaded_equals_on_device, stage, precision, True) == [True, True]


def test_offload_without_donation_computes_the_same_bits(ranks):
    assert ranks(2).run(_offloaded_equals_on_device, 2, "bf16", False) == [True, True]


def _deepspeed_config():
    n, r = dist.get_world_size(), dist.get_rank()
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
              "bf16": {"enabled": True},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    step = fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), config=config)
    assert step.options.offload_optimizer == "cpu" and step.options.pin_memory
    state = step.init(_state())
    without = fzero.compile(ft.mse_step, fzero.Mesh(dp=-1),
                            config={**config, "zero_optimization": {"stage": 2}})
    ref = without.init(_state())
    for b in _batches(n):
        state, m = step(state, ft.local_batch(b, n, r))
        ref, _ = without(ref, ft.local_batch(b, n, r))
    # No CUDA here, so nothing is pinned (it cannot be).
    assert not any(x.is_pinned() for x in fzero.tree.leaves(state.extra["master"]) if x.numel())
    return all(torch.equal(a, b) for a, b in zip(fzero.tree.leaves(fzero.gather(state.params)),
                                                  fzero.tree.leaves(fzero.gather(ref.params))))


def test_a_deepspeed_config_with_offload_optimizer_trains(ranks):
    assert ranks(2).run(_deepspeed_config) == [True, True]


def _checkpoint(path, stage):
    n, r = dist.get_world_size(), dist.get_rank()
    batches = _batches(n, steps=4)

    def compiled():
        return fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), zero=stage, dtype="bf16", bucket_bytes=BIG_BUCKET,
                             offload_optimizer="cpu")

    step = compiled()
    state = step.init(_state())
    for b in batches[:2]:
        state, _ = step(state, ft.local_batch(b, n, r))
    ckpt.save(path, state).wait()
    for b in batches[2:]:
        state, _ = step(state, ft.local_batch(b, n, r))
    # A fresh run: init, then load into it. The loaded masters and moments land where the
    # offload keeps them (the host), apart from the device parameters.
    step2 = compiled()
    loaded = ckpt.load(path, like=step2.init(_state()))
    assert not _storages(loaded.opt_state, loaded.extra["master"]) & _storages(loaded.params)
    assert all(x.device.type == "cpu" for x in fzero.tree.leaves((loaded.opt_state, loaded.extra["master"])))
    for b in batches[2:]:
        loaded, _ = step2(loaded, ft.local_batch(b, n, r))
    return all(torch.equal(a, b) for a, b in zip(fzero.tree.leaves(fzero.gather((loaded.params, loaded.extra))),
                                                  fzero.tree.leaves(fzero.gather((state.params, state.extra)))))


@pytest.mark.parametrize("stage", [1, 3])
def test_an_offloaded_state_saves_and_loads_and_trains_on_alike(ranks, tmp_path, stage):
    assert ranks(2).run(_checkpoint, str(tmp_path / "ck"), stage) == [True, True]
