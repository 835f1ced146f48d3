"""ZeRO against PyTorch's own data parallelism, on real gloo ranks: stage 0 against
``DistributedDataParallel`` and stage 3 against FSDP2's ``fully_shard``, each with
``torch.optim``, on the same local batches.

``tests/test_zero.py`` holds every stage to fzero's own one-process step; these hold the
two ends to independent implementations of the same algorithm, written by others: the loss
every step (the mean over ranks), the parameters and the buffers at the end, fp32, within
the ``"fp32"`` row of the tolerance table. The model has what data parallelism must get
right beyond a gradient average: a LayerNorm, a frozen parameter (no gradient, no optimizer
state, bit-identical at the end) and a buffer the forward updates from its local batch.

How the buffer agrees across ranks is a choice on both sides: DDP's
``broadcast_buffers=True`` (rank 0's buffers before every forward) is fzero's default
``buffer_sync="broadcast"`` (rank 0's after every step); ``broadcast_buffers=False`` and
FSDP2, which never syncs buffers, are ``buffer_sync="local"``.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import fzero
import fzero.testing as ft
from fzero import optim

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

D_IN, WIDTH, DEPTH, D_OUT = 6, 16, 2, 4
STEPS, PER_RANK = 4, 3
LR, MOMENTUM, WEIGHT_DECAY = 0.05, 0.9, 0.1


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class Net(nn.Module):
    """An input layer with a frozen bias, ``DEPTH`` pre-norm residual blocks (ZeRO-3's units
    and FSDP2's groups alike), a final LayerNorm and a head; the buffer ``mean`` is a
    running mean of the inputs, which the forward subtracts and then updates."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, WIDTH)
        self.inp.bias.requires_grad_(False)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(DEPTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, D_OUT)
        self.register_buffer("mean", torch.zeros(D_IN))

    def forward(self, x):
        h = self.inp(x - self.mean)
        with torch.no_grad():
            self.mean.lerp_(x.mean(0), 0.25)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def _model():
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():  # a frozen bias far from its initialisation: a wrong update would show
        model.inp.bias.fill_(0.5)
    return model


def _batches():
    """``STEPS`` global batches, each rank's rows taken with ``ft.local_batch``."""
    g = torch.Generator().manual_seed(1)
    n = PER_RANK * dist.get_world_size()
    return [{"x": torch.randn(n, D_IN, generator=g) + 1.0, "y": torch.randn(n, D_OUT, generator=g)}
            for _ in range(STEPS)]


def _torch_optimizer(name, params):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _fzero_tx(name):
    return optim.adamw(LR, weight_decay=WEIGHT_DECAY) if name == "adamw" else optim.sgd(LR, momentum=MOMENTUM)


def _torch_run(model, forward, tx_name, after_step=None):
    """``STEPS`` updates of ``model`` (wrapped as ``forward``) on this rank's rows; the mean
    of the ranks' losses at each step."""
    n, r = dist.get_world_size(), dist.get_rank()
    opt = _torch_optimizer(tx_name, [p for p in model.parameters() if p.requires_grad])
    losses = []
    for batch in _batches():
        local = ft.local_batch(batch, n, r)
        opt.zero_grad()
        loss = F.mse_loss(forward(local["x"]), local["y"])
        loss.backward()
        opt.step()
        if after_step is not None:
            after_step(model)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean / n)
    return torch.stack(losses)


def _fzero_run(stage, tx_name, buffer_sync):
    """The same updates with ``fzero.compile(zero=stage)``; the losses, the whole parameters
    and the buffers at the end."""
    n, r = dist.get_world_size(), dist.get_rank()
    apply, params = fzero.functionalize(_model())
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=_fzero_tx(tx_name))
    step = fzero.compile(ft.mse_step, fzero.Mesh(dp=-1), zero=stage, buffer_sync=buffer_sync)
    state, losses = step.init(state), []
    for batch in _batches():
        state, metrics = step(state, ft.local_batch(batch, n, r))
        losses.append(metrics["loss"])
    return torch.stack(losses), fzero.gather(state.params), dict(state.buffers)


def _compare(stage, tx_name, buffer_sync, ref_losses, ref_params, ref_buffers):
    r = dist.get_rank()
    losses, params, buffers = _fzero_run(stage, tx_name, buffer_sync)
    ft.assert_trees_close(losses, ref_losses, what=f"losses on rank {r}")
    ft.assert_trees_close(params, ref_params, what=f"parameters on rank {r}")
    ft.assert_trees_close(buffers, ref_buffers, what=f"buffers on rank {r}")
    assert torch.equal(params["inp.bias"], torch.full((WIDTH,), 0.5)), "the frozen bias moved"
    return [float(x) for x in losses]


# --------------------------------------------------------------------------- stage 0: DDP


def _against_ddp(tx_name, broadcast_buffers):
    model = _model()
    ddp = nn.parallel.DistributedDataParallel(model, broadcast_buffers=broadcast_buffers)
    ref_losses = _torch_run(model, ddp, tx_name)
    ref_buffers = {k: v.clone() for k, v in model.named_buffers()}
    if broadcast_buffers:  # DDP hands rank 0's to the next forward; fzero's step ends with them
        for v in ref_buffers.values():
            dist.broadcast(v, src=0)
    ref_params = {k: v.detach() for k, v in model.named_parameters()}
    return _compare(0, tx_name, "broadcast" if broadcast_buffers else "local", ref_losses, ref_params, ref_buffers)


@pytest.mark.parametrize("broadcast_buffers", [True, False])
@pytest.mark.parametrize("tx_name", ["adamw", "sgd"])
def test_stage_0_trains_as_distributed_data_parallel(ranks, tx_name, broadcast_buffers):
    results = ranks(2).run(_against_ddp, tx_name, broadcast_buffers)
    assert results[0] == results[1]  # every rank reports the global loss


# --------------------------------------------------------------------------- stage 3: FSDP2


def _broadcast_buffers(model):
    for v in model.buffers():
        dist.broadcast(v, src=0)


def _against_fsdp2(tx_name, buffer_sync):
    model = _model()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:  # FSDP2's per-block groups: ZeRO-3's units
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # FSDP2 leaves buffers to each rank; under "broadcast" every rank goes on from rank 0's.
    ref_losses = _torch_run(model, model, tx_name, _broadcast_buffers if buffer_sync == "broadcast" else None)
    ref_params = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach()
                  for k, v in model.named_parameters()}
    ref_buffers = {k: v.clone() for k, v in model.named_buffers()}
    return _compare(3, tx_name, buffer_sync, ref_losses, ref_params, ref_buffers)


@pytest.mark.parametrize("buffer_sync", ["broadcast", "local"])
@pytest.mark.parametrize("tx_name", ["adamw", "sgd"])
def test_stage_3_trains_as_fully_shard(ranks, tx_name, buffer_sync):
    results = ranks(2).run(_against_fsdp2, tx_name, buffer_sync)
    assert results[0] == results[1]
