"""The device check of collectives: on CPU-only CI, ``device_check.pretend()`` tells host
tensors from device tensors as a GPU would, so a CPU tensor handed to what would be an NCCL
collective fails here; ZeRO 0-3, fp16, accumulation, clipping, the pipeline and checkpoints
run clean under it, with the same numbers as without it.

The reference for what is a host tensor is what CUDA does (written out by hand below);
the reference for the numbers is the same run without the check.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fzero
import fzero.checkpoint as ckpt
import fzero.testing as ft
from fzero import optim
from fzero.distributed import comm, device_check
from fzero.distributed.device_check import DeviceMismatchError, is_host
from fzero.core import psum

MULTI = [pytest.mark.multirank, pytest.mark.slow]


# --------------------------------------------------------------------------- one process


def test_pretend_tells_host_tensors_from_device_tensors_as_cuda_would():
    with device_check.pretend() as dev:
        h = torch.zeros(3)  # no device given: torch's default, the host
        d = torch.zeros(3, device=dev)
        assert is_host(h) and not is_host(d)
        assert not is_host(h.to(dev)) and is_host(h)  # a copy onto the device; h stays where it was
        assert is_host(d.cpu()) and is_host(d.to("cpu")) and not is_host(d)
        assert not is_host(d.to(torch.float64)) and is_host(h.to(torch.float64))  # a dtype change stays put
        assert not is_host(h + d) and is_host(h * 2) and is_host(torch.stack([h, h]))
        assert not is_host(torch.zeros_like(d)) and is_host(torch.zeros_like(h))
        assert not is_host(torch.empty(2, device=d.device)) and is_host(torch.empty(2, device=h.device))
        assert is_host(torch.tensor([1, 2])) and not is_host(torch.tensor([1, 2], device=dev))
        lin = nn.Linear(2, 2)  # a module built on the host: its parameters, their views and detached copies
        assert is_host(lin.weight) and is_host(lin.weight.detach()) and is_host(lin.weight[0])
        buf = torch.zeros(3, device=dev)
        buf.copy_(h)  # a copy into a device buffer leaves it on the device
        assert not is_host(buf) and torch.equal(buf, h)
        assert d.device is dev and h.device is not dev and h.device == dev  # still the CPU
        assert fzero.Mesh(dp=-1).device is dev
        with pytest.raises(RuntimeError, match="already running"):
            with device_check.pretend():
                pass
    assert not device_check.pretending() and not is_host(h) and fzero.Mesh(dp=-1).device is not dev


# --------------------------------------------------------------------------- the transforms under the check


def _mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(k, n):
    g = torch.Generator().manual_seed(k)
    return {"x": torch.randn(n, 4, generator=g), "y": torch.randn(n, 3, generator=g)}


def _compiled(zero, precision, check, root):
    """Three steps of compile(zero=, precision=, accumulate=2, clip_norm=), a checkpoint saved
    and loaded; the losses and the gathered parameters."""
    with device_check.pretend() if check else contextlib.nullcontext():
        mesh = fzero.Mesh(dp=-1)
        r, n = mesh.rank, mesh.world_size
        apply, params = fzero.functionalize(_mlp(0))
        step = fzero.compile(ft.mse_step, mesh, zero=zero, precision=precision, accumulate=2, clip_norm=0.5)
        state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-2)))
        if check:  # step.init placed the state: all but the host scalars (step, counts, loss scaler)
            placed = [state.params, state.master, state.opt_state]
            assert not any(is_host(x) for x in fzero.tree.leaves(placed) if x.dim() > 0)
            assert all(is_host(x) for x in fzero.tree.leaves([state.step, state.opt_state, state.loss_scaler])
                       if x.dim() == 0)
        losses = []
        for k in range(3):
            state, m = step(state, ft.local_batch(_batch(k, 8), n, r))
            losses.append(m["loss"].item())
        path = f"{root}/{'checked' if check else 'plain'}-{zero}-{precision}"
        ckpt.save(path, state)  # host messages on the checkpoint's own gloo group
        state = ckpt.load(path, like=state)
        state, m = step(state, ft.local_batch(_batch(3, 8), n, r))
        losses.append(m["loss"].item())
        return losses, {k: v.clone() for k, v in fzero.gather(state.params).items()}


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_fp16_accumulate_and_checkpoints_hand_collectives_device_tensors_only(ranks, tmp_path, zero):
    pool = ranks(2)
    checked = pool.run(_compiled, zero, "fp16", True, str(tmp_path))
    plain = pool.run(_compiled, zero, "fp16", False, str(tmp_path))
    for (losses, params), (ref_losses, ref_params) in zip(checked, plain):
        assert losses == ref_losses  # the check changes no number
        for k in ref_params:
            assert torch.equal(params[k], ref_params[k]), k


def _pipelined(zero, check):
    from fzero.transforms.pipeline import pipeline, split

    with device_check.pretend() if check else contextlib.nullcontext():
        mesh = fzero.Mesh(pp=2, dp=2)
        model = _mlp(1)
        apply, params = fzero.functionalize(model)
        pipe = pipeline(split(model, [2]), F.mse_loss, mesh, micro_batches=2)

        def train_step(state, batch):
            loss, grads = pipe(state.params, batch["x"], batch["y"])
            return state.apply_gradients(grads), {"loss": loss}

        step = pipe.transform(fzero.shard_state(fzero.mixed_precision(fzero.accumulate(train_step, 2), "fp16"),
                                                mesh, zero, bucket_bytes=64))
        tx = optim.chain(optim.clip_by_global_norm(0.5), optim.sgd(0.1, momentum=0.9))  # a psum over pp and dp
        state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=tx))
        j = mesh.coords["dp"]
        losses = []
        for k in range(3):
            state, m = step(state, ft.local_batch(_batch(k, 16), 2, j))
            losses.append(m["loss"].item())
        whole = pipe.gather(state.params)
        assert all(torch.equal(v, whole[k]) for k, v in fzero.gather(state).params.items())  # every stage's
        return losses, {k: v.clone() for k, v in whole.items()}


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("zero", [1, 3])
def test_a_pipeline_over_zero_hands_collectives_and_sends_device_tensors_only(ranks, zero):
    pool = ranks(4)
    checked, plain = pool.run(_pipelined, zero, True), pool.run(_pipelined, zero, False)
    for (losses, params), (ref_losses, ref_params) in zip(checked, plain):
        assert losses == ref_losses
        for k in ref_params:
            assert torch.equal(params[k], ref_params[k]), k


def _tensor_parallel(check):
    """tp=2 through compile (Linear(4, 8) by columns, Linear(8, 8) by rows, bf16, clipped):
    the batch check, the split forwards, the gather of the whole state and load_into."""
    with device_check.pretend() if check else contextlib.nullcontext():
        mesh = fzero.Mesh(dp=1, tp=2)
        model = _mlp(2)
        apply, params = fzero.functionalize(model)
        step = fzero.compile(ft.mse_step, mesh, tp={"0": fzero.ColwiseParallel(), "2": fzero.RowwiseParallel()},
                             precision="bf16", clip_norm=0.5)
        state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-2)))
        losses = []
        for k in range(2):
            state, m = step(state, _batch(k, 8))  # a host batch, as a loader hands it
            losses.append(m["loss"].item())
        whole = fzero.gather(state)
        fzero.load_into(model, state)  # the fp32 masters, whole, into the module's fp32 parameters
        assert all(torch.equal(p.detach(), whole.master[k]) for k, p in model.named_parameters())
        return losses, {k: v.clone() for k, v in whole.master.items()}


@pytest.mark.multirank
def test_tensor_parallel_hands_collectives_device_tensors_only(ranks):
    pool = ranks(2)
    checked, plain = pool.run(_tensor_parallel, True), pool.run(_tensor_parallel, False)
    for (losses, masters), (ref_losses, ref_masters) in zip(checked, plain):
        assert losses == ref_losses
        assert all(torch.equal(masters[k], ref_masters[k]) for k in ref_masters)
        assert tuple(masters["0.weight"].shape) == (8, 4)  # whole


def _batchnormed(zero, sync, check):
    """A BatchNorm model under compile(zero=, buffer_sync=): its buffers (running stats and the
    0-dim integer ``num_batches_tracked``) are placed with the state and synced over dp."""
    with device_check.pretend() if check else contextlib.nullcontext():
        mesh = fzero.Mesh(dp=-1)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
        apply, params = fzero.functionalize(model)
        step = fzero.compile(ft.mse_step, mesh, zero=zero, buffer_sync=sync)
        state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1)))
        if check:
            assert not any(is_host(b) for b in state.buffers.values())
        for k in range(2):
            state, _ = step(state, ft.local_batch(_batch(k, 8), mesh.world_size, mesh.rank))
        return {k: v.clone() for k, v in state.buffers.items()}


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("zero,sync", [(0, "broadcast"), (3, "mean")])
def test_buffers_are_placed_on_the_device_and_synced_with_device_tensors(ranks, zero, sync):
    pool = ranks(2)
    checked, plain = pool.run(_batchnormed, zero, sync, True), pool.run(_batchnormed, zero, sync, False)
    for bufs, ref in zip(checked, plain):
        assert bufs.keys() == ref.keys() and "1.num_batches_tracked" in bufs
        for k in ref:
            assert torch.equal(bufs[k], ref[k]), k
    assert int(checked[0]["1.num_batches_tracked"]) == 2
    for k in checked[0]:  # synced: every rank holds the same buffers
        assert torch.equal(checked[0][k], checked[1][k]), k


# --------------------------------------------------------------------------- the check fires


def _handed(case):
    """Runs ``case`` under pretend(); the DeviceMismatchError's message, or "ok"."""
    with device_check.pretend():
        mesh = fzero.Mesh(dp=-1)
        dev = mesh.device
        try:
            if case == "a host tensor":
                comm.run("all_reduce(a host flag)", lambda: dist.all_reduce(torch.zeros(1), async_op=True),
                         timeout_s=30, where="test")
            elif case == "a device tensor":
                comm.run("all_reduce(a device flag)", lambda: dist.all_reduce(torch.zeros(1, device=dev),
                                                                              async_op=True), timeout_s=30, where="test")
            elif case == ".cpu() of a device tensor":
                x = torch.ones(2, device=dev)
                comm.run("all_reduce(x.cpu())", lambda: dist.all_reduce(x.cpu(), async_op=True), timeout_s=30,
                         where="test")
            elif case == "ints made on the host":  # all_gather_ints without the group's device
                comm.all_gather_ints("all_gather(batch sizes)", [4], None, timeout_s=30, where="test")
            elif case == "ints made on the device":
                assert comm.all_gather_ints("all_gather(batch sizes)", [4], None, timeout_s=30, where="test",
                                            device=dev).tolist() == [[4], [4]]
            elif case == "a host psum under ZeRO":  # what fp16's overflow flag was: torch.zeros(()) + .cpu()
                def flag_step(state, batch):
                    psum(torch.zeros(()))
                    return ft.mse_step(state, batch)
                _two_steps(fzero.shard_state(flag_step, mesh, 1), mesh)
            elif case == "a state step.init does not place":
                mesh.place = lambda state: state  # the state stays where the module made it: the host
                _two_steps(fzero.compile(ft.mse_step, mesh, zero=1), mesh)
            elif case == "a host reduce buffer in a gradient hook":
                # Buckets of 64 bytes: each group's reduce-scatter starts from a gradient hook,
                # inside backward, where the autograd engine drops the step's torch-function
                # modes (fzero.core.keeping_function_modes puts pretend's back).
                from fzero.transforms.shard_state._reduce import BufferPool

                take = BufferPool.take
                BufferPool.take = lambda self, n, dtype, device, **kw: take(self, n, dtype, torch.device("cpu"), **kw)
                try:
                    _two_steps(fzero.compile(ft.mse_step, mesh, zero=2, bucket_bytes=64), mesh)
                finally:
                    BufferPool.take = take
            elif case == "a host send":
                from fzero.distributed.p2p import Channel

                ch = Channel(dist.group.WORLD, timeout_s=30, where="test")
                ch.isend(torch.zeros(2), 1 - mesh.rank, "an activation")
            elif case == "a host message on the host":
                with device_check.on_host():
                    comm.run("all_reduce(a host message)", lambda: dist.all_reduce(torch.zeros(1), async_op=True),
                             timeout_s=30, where="test")
        except DeviceMismatchError as e:
            return str(e)
        return "ok"


def _two_steps(step, mesh):
    apply, params = fzero.functionalize(_mlp(0))
    state = step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1)))
    for k in range(2):
        state, _ = step(state, ft.local_batch(_batch(k, 4), 2, mesh.rank))


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("case,collective", [
    ("a host tensor", "all_reduce(a host flag)"),
    (".cpu() of a device tensor", "all_reduce(x.cpu())"),
    ("ints made on the host", "all_gather(batch sizes)"),
    ("a host psum under ZeRO", "all_reduce(psum)"),
    # the first collective of a step: the loss's mean over the ranks, launched before backward
    ("a state step.init does not place", "all_reduce(loss and batch sizes)"),
    ("a host send", "send of an activation"),
    # the first group a gradient hook completes: the last layer's bias (3 elements, padded to 4)
    ("a host reduce buffer in a gradient hook", "reduce_scatter(gradient group 0, 4 elements)"),
])
def test_a_host_tensor_handed_to_a_collective_is_named(ranks, case, collective):
    for r, msg in enumerate(ranks(2).run(_handed, case)):
        assert f"collective {collective} on rank {r}" in msg, msg
        assert "made on the host (cpu)" in msg and "mesh.device" in msg, msg


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("case", ["a device tensor", "ints made on the device", "a host message on the host"])
def test_device_tensors_and_host_messages_on_the_host_pass(ranks, case):
    assert ranks(2).run(_handed, case) == ["ok", "ok"]


def _checked_as(device_type, on_host):
    os.environ[device_check.ENV] = device_type
    try:
        with device_check.on_host() if on_host else contextlib.nullcontext():
            comm.run("all_reduce(flag)", lambda: dist.all_reduce(torch.zeros(1), async_op=True), timeout_s=30,
                     where="test")
    except DeviceMismatchError as e:
        return str(e)
    finally:
        del os.environ[device_check.ENV]
    return "ok"


@pytest.mark.multirank
@pytest.mark.slow
def test_fzero_check_device_names_the_device_a_tensor_should_be_on(ranks):
    """What a GPU run sets: FZERO_CHECK_DEVICE=cuda; a CPU tensor then fails before NCCL sees it."""
    for r, msg in enumerate(ranks(2).run(_checked_as, "cuda", False)):
        assert f"collective all_reduce(flag) on rank {r} was handed a float32 tensor of shape (1,) on cpu" in msg, msg
        assert "moves tensors on cuda (FZERO_CHECK_DEVICE=cuda)" in msg, msg
    assert ranks(2).run(_checked_as, "cpu", False) == ["ok", "ok"]
    assert ranks(2).run(_checked_as, "cuda", True) == ["ok", "ok"]


# --------------------------------------------------------------------------- host syncs
# What makes a GPU's host wait for the device, found on the CPU: the reference is CUDA's
# behaviour, written out by hand in the first test (a read of a value waits; a copy with
# non_blocking=True does not; a pageable copy without it does).


def test_host_syncs_records_reads_and_blocking_copies_and_not_asynchronous_work():
    with device_check.pretend() as dev:
        x = torch.arange(4.0).to(dev, non_blocking=True)
        h = torch.ones(4)
        with device_check.host_syncs() as syncs:
            y = (x * 2 + 1).sum()                # device work, enqueued
            x.to(dev, non_blocking=True)          # already there
            h.to(dev, non_blocking=True)          # an asynchronous copy
            h.sum().item()                        # a host value: no device involved
            torch.zeros(3, device=dev)            # a fill on the device
            float(y)
            x.tolist()
            x.nonzero()
            x.cpu()
            h.to(dev)
            x.copy_(h)
            torch.tensor([1.0, 2.0], device=dev)
    assert [s.what for s in syncs] == [
        "read (Tensor.__float__)", "read (Tensor.tolist)", "read (Tensor.nonzero)",
        "blocking copy to the host (Tensor.cpu)", "blocking copy to the device (Tensor.to)",
        "blocking copy to the device (Tensor.copy_)", "copy to the device (torch.tensor(data, device=...))"]
    assert all(s.where[-1].startswith("tests/test_device_check.py:") for s in syncs), syncs
    assert "(test_host_syncs_records_reads_and_blocking_copies_and_not_asynchronous_work)" in str(syncs[0])
    with pytest.raises(RuntimeError, match="only inside pretend"):
        with device_check.host_syncs():
            pass


def _gpt_syncs(zero: int, precision: str, mesh_dp: int) -> list[tuple[str, str]]:
    """``(what, innermost function)`` of each host sync in the third step of a tiny GPT, as
    ``benchmarks/gpu_step.py`` trains it (AdamW, a clip at 1.0, cross-entropy on the logits in
    fp32), its state on the device, the update by the fused Triton kernels (interpreted: the
    caller sets ``TRITON_INTERPRET=1`` before triton's first import)."""
    import sys

    from fzero_kernels import _common

    why_not = _common._why_not_triton(torch.device("cpu"))  # (imports triton, in the interpreter's mode)
    assert why_not is None, f"the Triton kernels cannot run interpreted here: {why_not}"

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32))  # made on "the device"

    def train_step(state, batch):
        def loss_fn(p):
            return F.cross_entropy(state.apply_fn(p, batch["x"]).float().flatten(0, 1), batch["y"].flatten())

        loss, grads = fzero.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads), {"loss": loss}

    options = {"zero": zero, "clip_norm": 1.0} | ({} if precision == "fp32" else {"precision": precision})
    with device_check.pretend() as dev, optim.use_fused("on"):
        apply, params = fzero.functionalize(model)
        state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(3e-4, 0.9, 0.95, 1e-8, 0.1))
        step = fzero.compile(train_step, fzero.Mesh(dp=mesh_dp), **options)
        state = step.init(state)
        x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)).to(dev, non_blocking=True)
        for _ in range(3):
            with device_check.host_syncs() as syncs:
                state, metrics = step(state, {"x": x, "y": x})
    return [(s.what, s.where[-1].rsplit(" ", 1)[-1]) for s in syncs]


VERDICT = ("read (Tensor.__bool__)", "(update_under_verdict)")


@pytest.mark.parametrize("zero, precision", [(0, "bf16"), (1, "bf16"), (2, "bf16"), (3, "bf16"), (3, "fp16"),
                                             (0, "fp32")])
def test_a_step_on_the_gpu_path_waits_for_the_device_once_after_enqueuing_its_update(monkeypatch, zero, precision):
    """In a world of one, the whole step -- forward, backward, the non-finite check, the
    clip, the fused Triton update (interpreted here), the loss scaler -- runs ahead of the
    device until its one read: the verdict on the gradients, taken once the update is
    enqueued (a skipped update is discarded on the device). A read or a blocking copy added
    anywhere on the way would make a GPU's host wait mid-step; this names it. (The unfused
    optimizers read the verdict before their update instead, as DeepSpeed's fp16 optimizer
    reads its overflow flag: ``fzero.core``'s ``update``.)"""
    from fzero_kernels import _common

    if not _common.triton_interpreted():
        pytest.skip("triton was imported compiled (a CUDA machine): the Triton kernels cannot run on the CPU here")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _gpt_syncs(zero, precision, 1) == [VERDICT]


@pytest.mark.multirank
@pytest.mark.slow
def test_a_data_parallel_step_waits_for_the_device_only_after_enqueuing_its_update(ranks):
    """Across ranks one more read, also after the update is enqueued: the verdict on the
    batch sizes every rank's loss was averaged over (summed with the loss in one
    all-reduce; it rides in the update's skip flag, so a mismatch discards the update on the
    device), then the verdict on the gradients. No collective's wait holds the host. (Ranks
    of their own, whose triton is imported interpreted.)"""
    sizes = ("read (Tensor.__bool__)", "(check_sizes)")
    pool = ranks(2, env={"TRITON_INTERPRET": "1"})
    for zero in (1, 2, 3):
        assert pool.run(_gpt_syncs, zero, "bf16", -1) == [[sizes, VERDICT]] * 2, zero
