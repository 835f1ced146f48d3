"""ZeRO-Offload of the optimizer (fzero/transforms/offload.py) on real ranks: the same
trajectory as the step that keeps everything on the device, host state of its own, and the
bytes copied each way each step derived from the parameter shapes and the world size.

On this CPU machine the host is the device: the copies are still made between distinct
tensors, so the code path is the one a GPU runs.
"""

import json
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fzero
import fzero.checkpoint as ckpt
import fzero.testing as ft
from fzero import optim
from fzero.distributed import comm
from fzero.transforms.shard_state import is_shard
from harness.marks import REACHED_FIRST_LAYER, BackwardReached


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
        x = x.local if is_shard(x) else x
        if isinstance(x, torch.Tensor) and x.numel() > 0:
            out.add(x.untyped_storage().data_ptr())
    return out


def _run(offload, stage, precision, donate):
    n, r = dist.get_world_size(), dist.get_rank()
    step = fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), zero=stage, precision=precision, accumulate=2, clip_norm=1.0,
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
    host, device = _storages(state.opt_state, state.master), _storages(state.params)
    assert not host & device, f"rank {r}: host state shares storage with the device parameters"
    assert ft.storage_bytes(state.params, state.opt_state, state.master) == \
        ft.storage_bytes(state.params) + ft.storage_bytes(state.opt_state, state.master)
    assert ft.storage_bytes(state.params) == ft.storage_bytes(ref.params)
    owned = _owned(r, n)
    assert ft.storage_bytes(state.master) == 4 * owned
    # Each update: the fp32 gradient pieces to the host, the new pieces back in the
    # parameters' dtype; nothing else crosses.
    low = 4 if precision == "fp32" else 2
    assert spent == [{"d2h": 4 * owned, "h2d": low * owned}] * len(spent), (r, spent, owned)
    return True


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_trajectory_equals_the_on_device_one_bit_for_bit(ranks, stage, precision):
    assert ranks(2).run(_offloaded_equals_on_device, stage, precision, True) == [True, True]


@pytest.mark.multirank
@pytest.mark.slow
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
    assert not any(x.is_pinned() for x in fzero.tree.leaves(state.master) if x.numel())
    return all(torch.equal(a, b) for a, b in zip(fzero.tree.leaves(fzero.gather(state.params)),
                                                  fzero.tree.leaves(fzero.gather(ref.params))))


@pytest.mark.multirank
@pytest.mark.slow
def test_a_deepspeed_config_with_offload_optimizer_trains(ranks):
    assert ranks(2).run(_deepspeed_config) == [True, True]


def _checkpoint(path, stage, offload_param="none"):
    n, r = dist.get_world_size(), dist.get_rank()
    batches = _batches(n, steps=4)

    def compiled():
        return fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), zero=stage, precision="bf16", bucket_bytes=BIG_BUCKET,
                             offload_optimizer="cpu", offload_param=offload_param)

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
    assert not _storages(loaded.opt_state, loaded.master) & _storages(loaded.params)
    assert all(x.device.type == "cpu" for x in fzero.tree.leaves((loaded.opt_state, loaded.master)))
    for b in batches[2:]:
        loaded, _ = step2(loaded, ft.local_batch(b, n, r))
    return all(torch.equal(a, b) for a, b in zip(fzero.tree.leaves(fzero.gather((loaded.params, loaded.master))),
                                                  fzero.tree.leaves(fzero.gather((state.params, state.master)))))


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("stage, offload_param", [(1, "none"), (3, "none"), (3, "cpu")])
def test_an_offloaded_state_saves_and_loads_and_trains_on_alike(ranks, tmp_path, stage, offload_param):
    assert ranks(2).run(_checkpoint, str(tmp_path / "ck"), stage, offload_param) == [True, True]


# --------------------------------------------------------------------------- offload_param
#
# ZeRO-3's parameter offload: this rank's pieces of the parameters live on the host between
# uses. The model has two blocks in a ModuleList (two units, gathered one at a time) and
# loose layers around them (one group, gathered for the whole step).


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.h = nn.ModuleList([nn.Linear(6, 6) for _ in range(2)])
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        x = self.inp(x)
        for block in self.h:
            x = torch.tanh(block(x))
        return self.out(x)


UNIT = 6 * 6 + 6  # elements of one block: one group each
LOOSE = 4 * 6 + 6 + 6 * 3 + 3  # inp and out: one group
MICRO = 2  # accumulate=2


def _blocks_state():
    torch.manual_seed(0)
    apply, params = fzero.functionalize(_Blocks())
    return fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-2, weight_decay=0.1))


def _chunk(numel, world):
    """Elements of a group's slice each rank sends to its all-gather (the group padded to a
    multiple of the world size)."""
    return max(world, -(-numel // world) * world) // world


def _held(numel, world, rank):
    """Elements of a group rank ``rank`` holds pieces of (the padding excluded)."""
    chunk = _chunk(numel, world)
    return max(0, min(numel, (rank + 1) * chunk) - rank * chunk)


def _expected_copies(world, rank, precision, offload_optimizer, max_reuse_distance=None):
    """Bytes copied each way in one update: each gather copies the rank's slice of its group
    to the device (each unit once a micro-batch, for its forward, where it stays gathered
    until its backward -- this model is within the default ``max_reuse_distance``, a bucket's
    worth -- and with ``max_reuse_distance=0`` again for its backward; the loose group
    once), and the update's new pieces go where the pieces live."""
    item = 4 if precision == "fp32" else 2
    per_unit = 2 if max_reuse_distance == 0 else 1
    gathers = MICRO * (per_unit * 2 * _chunk(UNIT, world) + _chunk(LOOSE, world)) * item
    held = 2 * _held(UNIT, world, rank) + _held(LOOSE, world, rank)
    if offload_optimizer == "cpu":  # the gradient pieces to the host; the update writes the pieces there
        return {"d2h": 4 * held, "h2d": gathers}
    if precision == "fp32":  # the update runs on a device copy of the pieces, written back to the host
        return {"d2h": 4 * held, "h2d": gathers + 4 * held}
    return {"d2h": item * held, "h2d": gathers}  # the masters' new low-precision pieces to the host


def _run_blocks(offload_param, offload_optimizer, precision, donate, world, rank, steps=3, max_reuse_distance=None):
    step = fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), zero=3, precision=precision, accumulate=MICRO, clip_norm=1.0,
                         offload_param=offload_param, offload_optimizer=offload_optimizer, comm_bytes=True,
                         donate=donate, max_reuse_distance=max_reuse_distance)
    state, spent, gathered = step.init(_blocks_state()), [], []
    for b in _batches(world, steps=steps):
        before = comm.traffic.copy()
        state, m = step(state, ft.local_batch(b, world, rank))
        spent.append(m.get("offload_bytes"))
        gathered.append((comm.traffic - before).bytes("all_gather", "parameters"))
    return step, state, spent, gathered


def _param_offload_equals_stage_3(precision, offload_optimizer, donate=True, max_reuse_distance=None):
    """On each rank, under device_check.pretend() (host tensors told from device tensors as on
    a GPU: a collective handed a host tensor raises): the offloaded run's parameters and
    optimizer state equal stage 3's without offload bit for bit; the pieces are host tensors
    and nothing else of the state is; every copy is counted as the formula says."""
    from fzero.distributed import device_check

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    with device_check.pretend():
        _, ref, _, _ = _run_blocks("none", offload_optimizer, precision, donate, world, rank,
                                   max_reuse_distance=max_reuse_distance)
        _, state, spent, gathered = _run_blocks("cpu", offload_optimizer, precision, donate, world, rank,
                                                max_reuse_distance=max_reuse_distance)
        for what, a, b in (("parameters", state.params, ref.params), ("optimizer state", state.opt_state,
                                                                       ref.opt_state),
                           ("masters", state.master, ref.master)):
            for x, y in zip(fzero.tree.leaves(fzero.gather(a)), fzero.tree.leaves(fzero.gather(b))):
                assert torch.equal(x, y), f"rank {rank}: {what} differ ({precision}, offload_optimizer=" \
                                          f"{offload_optimizer}, donate={donate})"
        pieces = fzero.tree.leaves(state.params)
        assert pieces and all(device_check.is_host(p) for p in pieces), f"rank {rank}: a piece is not on the host"
        kept = [x for x in fzero.tree.leaves((state.opt_state, state.master)) if x.dim() > 0]
        if dist.is_initialized():
            # With a process group the state is placed on the device (Mesh.place; a process
            # without one keeps it where it was made, on the host): the device keeps the
            # moments (and bf16's masters) unless offload_optimizer moved them, never the pieces.
            assert kept and all(device_check.is_host(x) == (offload_optimizer == "cpu") for x in kept), rank
        assert not _storages(state.params) & _storages(state.opt_state, state.master)
    expected = _expected_copies(world, rank, precision, offload_optimizer, max_reuse_distance)
    assert spent == [expected] * len(spent), (rank, spent, expected)
    if world > 1:  # every byte a gather copied to the device went into an all-gather of parameters
        gather_h2d = expected["h2d"] - (4 * (2 * _held(UNIT, world, rank) + _held(LOOSE, world, rank))
                                        if precision == "fp32" and offload_optimizer == "none" else 0)
        assert gathered == [gather_h2d] * len(gathered), (rank, gathered, gather_h2d)
    return True


@pytest.mark.parametrize("offload_optimizer", ["none", "cpu"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("max_reuse_distance", [None, 0])
def test_parameter_offload_on_one_process_equals_stage_3_bit_for_bit(precision, offload_optimizer, max_reuse_distance):
    assert _param_offload_equals_stage_3(precision, offload_optimizer, max_reuse_distance=max_reuse_distance)


def test_parameter_offload_without_donation_computes_the_same_bits():
    assert _param_offload_equals_stage_3("bf16", "none", donate=False)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("offload_optimizer", ["none", "cpu"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_parameter_offload_on_two_ranks_equals_stage_3_bit_for_bit(ranks, precision, offload_optimizer):
    assert ranks(2).run(_param_offload_equals_stage_3, precision, offload_optimizer) == [True, True]


EVENTS: list[str] = []


class _Deep(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.h = nn.ModuleList([nn.Linear(6, 6) for _ in range(4)])
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        x = BackwardReached.apply(self.inp(x), EVENTS)
        for block in self.h:
            x = torch.tanh(block(x))
        return self.out(x)


def _streamed_equals_on_device(stage, precision):
    """On each rank, under device_check.pretend() (host tensors told from device tensors as on
    a GPU), a state placed on the device (``Mesh(device=)`` in a world of one): with
    ``offload_optimizer`` each group's reduced gradient piece is copied to the host as its
    reduction completes, while backward is still running, and the update reads those copies
    (nothing copied twice: d2h is the pieces once, in the dtype the non-offloaded update gets
    them); the trajectory equals the on-device one bit for bit."""
    from fzero.distributed import device_check
    from fzero.transforms.shard_state import _reduce

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    item = 4 if precision == "fp32" else 2  # the parameters' bytes, the gradients' too
    copies, copy = [], _reduce.HostGradients.copy

    def noted(self, gi, r, valid):
        EVENTS.append("gradient piece to the host")
        copies.append(device_check.is_host(r))
        return copy(self, gi, r, valid)

    def run(offload):
        torch.manual_seed(0)
        apply, params = fzero.functionalize(_Deep())
        state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-2, weight_decay=0.1))
        step = fzero.compile(ft.mse_step, fzero.Mesh(dp=-1, device="cpu"), zero=stage, precision=precision,
                             clip_norm=1.0, bucket_bytes=item * (UNIT + 1), offload_optimizer=offload, comm_bytes=True)
        state, spent, orders = step.init(state), [], []
        for b in _batches(world):
            EVENTS.clear()
            state, m = step(state, ft.local_batch(b, world, rank))
            spent.append(m.get("offload_bytes"))
            orders.append(list(EVENTS))
        return state, spent, orders

    _reduce.HostGradients.copy = noted
    try:
        with device_check.pretend():
            ref, _, _ = run("none")
            state, spent, orders = run("cpu")
            for what, a, b in (("parameters", state.params, ref.params), ("optimizer state", state.opt_state,
                                                                           ref.opt_state)):
                for x, y in zip(fzero.tree.leaves(fzero.gather(a)), fzero.tree.leaves(fzero.gather(b))):
                    assert torch.equal(x, y), f"rank {rank}: {what} differ (stage {stage}, {precision})"
            assert not any(device_check.is_host(p) for p in fzero.tree.leaves(state.params)), rank
    finally:
        _reduce.HostGradients.copy = copy
    assert copies and not any(copies), f"rank {rank}: a piece copied to the host was not on the device"
    for order in orders:  # the last blocks' pieces left before backward reached the first layer
        assert order.index("gradient piece to the host") < order.index(REACHED_FIRST_LAYER), order
    groups = 1 + 4 + 1  # inp, each block, out: one group each at this bucket
    assert all(order.count("gradient piece to the host") == groups for order in orders), orders
    owned = sum(_held(n, world, rank) for n in (4 * 6 + 6, *[UNIT] * 4, 6 * 3 + 3))
    assert spent == [{"d2h": item * owned, "h2d": item * owned}] * len(spent), (rank, spent, owned)
    return True


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_copies_each_gradient_piece_to_the_host_as_its_reduction_completes(stage, precision):
    assert _streamed_equals_on_device(stage, precision)


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_offload_on_two_ranks_copies_each_gradient_piece_as_its_reduce_scatter_completes(ranks, stage):
    assert ranks(2).run(_streamed_equals_on_device, stage, "bf16") == [True, True]


def test_an_offloaded_step_holds_on_the_device_the_parameters_and_one_group_in_flight():
    """What an offloaded step holds on the device at its peak (every live device tensor after
    every allocating operation, under device_check.pretend(); benchmarks/offload_memory.py):
    the bf16 parameters and the group being reduced -- its fp32 buffer, its cast, one leaf's
    gradient -- not this rank's whole gradient. It read 8.02 bytes per parameter when the
    gradients reached the host only at the update (fp32 reduce results, their bf16 casts),
    2.79 now, against 20.01 without offload (benchmarks/offload_memory.py's model)."""
    import subprocess
    import sys
    from pathlib import Path

    # In a process of its own: the count starts from every tensor the process holds, and in a
    # test session every earlier test's tensors would be added up again after each operation.
    root = Path(__file__).resolve().parents[1]
    groups = 4  # a group holds one layer, a quarter of the model: 1 byte per parameter in fp32
    code = ("import json, sys; sys.path.insert(0, 'benchmarks'); from offload_memory import step_device_peak; "
            f"print(json.dumps([step_device_peak(128, 4, {groups}, zero=1, precision='bf16', offload_optimizer='cpu'), "
            f"step_device_peak(128, 4, {groups}, zero=1, precision='bf16')]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    (psi, peak), (psi_whole, whole) = json.loads(out.stdout.strip().splitlines()[-1])
    params, group_fp32 = 2 * psi, 4 * psi / groups
    # The group's fp32 buffer, its bf16 cast and a layer's bf16 gradient (and a few rows of
    # activations) stay under three groups' fp32 bytes; the whole fp32 gradient alone is 4.
    assert peak <= params + 3 * group_fp32, peak / psi
    # 2 + 4 + 8 bytes of states and 4 of fp32 gradient at least: the count sees them.
    assert whole >= 18 * psi_whole, whole / psi_whole


@pytest.mark.parametrize("donate", [True, False])
def test_an_offloaded_bf16_update_casts_into_host_buffers_kept_between_steps(donate, monkeypatch):
    """The new bf16 parameters are cast on the host into buffers made once and copied to the
    device from there (a fresh host tensor a parameter every step would be page-faulted in
    every step; under pin_memory on a GPU they are page-locked and the copies asynchronous):
    every step's host-to-device copies read the same buffers, each in the parameter's dtype."""
    from fzero.distributed import device_check

    sources = []
    copy = comm.copy_

    def noted(dst, src, *, kind, non_blocking=False):
        if kind == "h2d":
            sources[-1].append((src.data_ptr(), src.dtype, dst.dtype))
        return copy(dst, src, kind=kind, non_blocking=non_blocking)

    monkeypatch.setattr(comm, "copy_", noted)
    with device_check.pretend():
        torch.manual_seed(0)
        apply, params = fzero.functionalize(_Deep())
        state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-2))
        step = fzero.compile(ft.mse_step, fzero.Mesh(dp=1, device=device_check.PRETEND_DEVICE), zero=1,
                             precision="bf16", offload_optimizer="cpu", donate=donate)
        state = step.init(state)
        for b in _batches(1)[:3]:
            sources.append([])
            state, _ = step(state, b)
    assert len(sources) == 3 and len(sources[0]) == len(params), sources
    assert sources[1] == sources[0] and sources[2] == sources[0]
    assert {(s, d) for _, s, d in sources[0]} == {(torch.bfloat16, torch.bfloat16)}


def _zero(**zero):
    return {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "bf16": {"enabled": True}, "zero_optimization": zero}


def test_a_deepspeed_offload_param_section_decides_compile_offload_param():
    from fzero.config import Config

    cfg = Config.load(_zero(stage=3, offload_param={"device": "cpu", "pin_memory": True, "buffer_count": 5,
                                                    "buffer_size": 1e8, "max_in_cpu": 1e9}), world_size=1)
    assert cfg.decided_options()["offload_param"] == "cpu" and cfg.decided_options()["pin_memory"] is True
    assert cfg.compile_options().offload_param == "cpu"
    off = Config.load(_zero(stage=2, offload_param={"device": "none"}), world_size=1)
    assert off.compile_options().offload_param == "none"
    assert "offload_param" not in Config.load(_zero(stage=3), world_size=1).decided_options()
    # either section asking pins fzero's host buffers
    both = Config.load(_zero(stage=3, offload_optimizer={"device": "cpu"},
                             offload_param={"device": "cpu", "pin_memory": True}), world_size=1)
    assert both.compile_options().pin_memory and both.compile_options().offload_optimizer == "cpu"
    # the compiled step from it offloads the parameters, and frees each unit after its
    # forward as stage3_max_reuse_distance 0 says
    step = fzero.compile(ft.mse_step, config=_zero(stage=3, offload_param={"device": "cpu"},
                                                   stage3_max_reuse_distance=0))
    state = step.init(_blocks_state())
    assert step.options.offload_param == "cpu" and step.options.max_reuse_distance == 0
    before = comm.traffic.copy()
    state, _ = step(state, {"x": torch.ones(2, 4), "y": torch.zeros(2, 3)})
    # one micro-batch in bf16 on one process: each unit gathered twice, the loose group once;
    # the new low-precision pieces written back to the host
    assert (comm.traffic - before).copy_bytes() == {"h2d": (2 * 2 * UNIT + LOOSE) * 2, "d2h": (2 * UNIT + LOOSE) * 2}


@pytest.mark.parametrize("zero, error, message", [
    ({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/local"}}, NotImplementedError,
     r"zero_optimization\.offload_param\.device='nvme': NVMe offload is not supported"),
    ({"stage": 2, "offload_param": {"device": "cpu"}}, ValueError,
     r"zero_optimization\.offload_param\.device=\"cpu\" needs zero_optimization\.stage 3.*got stage 2"),
    ({"stage": 3, "offload_param": {"device": "disk"}}, ValueError,
     r"zero_optimization\.offload_param\.device must be \"none\", \"cpu\" or \"nvme\""),
    ({"stage": 3, "offload_param": {"device": "cpu", "pin_memroy": True}}, KeyError,
     r"did you mean 'zero_optimization\.offload_param\.pin_memory'"),
    ({"stage": 3, "cpu_offload_param": True}, NotImplementedError,
     r"zero_optimization\.cpu_offload_param=True.*write offload_param: \{\"device\": \"cpu\"\}"),
])
def test_offload_param_settings_fzero_does_not_run_are_named_by_key_path(zero, error, message):
    from fzero.config import Config

    with pytest.raises(error, match=message):
        Config.load(_zero(**zero), world_size=1)


def test_offload_param_needs_stage_3_in_compile_and_shard_state():
    with pytest.raises(ValueError, match=r"fzero\.compile: offload_param='cpu' needs ZeRO stage 3.*got stage=2"):
        fzero.compile(ft.mse_step, zero=2, offload_param="cpu")
    with pytest.raises(ValueError, match=r"fzero\.shard_state: offload_param='cpu' needs stage=3.*got stage=1"):
        fzero.shard_state(ft.mse_step, stage=1, offload_param="cpu")
    with pytest.raises(ValueError, match=r"offload_param='disk' must be 'none' or 'cpu'"):
        fzero.compile(ft.mse_step, zero=3, offload_param="disk")


def test_config_check_says_what_happens_to_each_offload_key(tmp_path, capsys):
    from fzero.cli.main import main as cli

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_zero(stage=3, offload_optimizer={"device": "cpu", "pin_memory": True},
                                     offload_param={"device": "cpu", "pin_memory": True, "buffer_count": 5,
                                                    "max_in_cpu": 1e9})))
    assert cli(["config", "check", str(path)]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert re.search(r"used\s+'cpu' -> offload_param$", lines["zero_optimization.offload_param.device"])
    assert re.search(r"used\s+True -> pin_memory$", lines["zero_optimization.offload_param.pin_memory"])
    assert re.search(r"used\s+'cpu' -> offload_optimizer$", lines["zero_optimization.offload_optimizer.device"])
    for key in ("buffer_count", "max_in_cpu"):
        assert re.search(r"no effect", lines[f"zero_optimization.offload_param.{key}"])
    path.write_text(json.dumps(_zero(stage=2, offload_param={"device": "cpu"})))
    assert cli(["config", "check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "zero_optimization.offload_param" in out and "needs zero_optimization.stage 3" in out
