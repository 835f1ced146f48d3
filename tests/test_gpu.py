"""The GPU subset: skipped without CUDA (CI has none), run on a machine with one.

* the example GPT trains under ``fzero launch`` on the GPU, the process group on NCCL;
* every ZeRO stage in a world of one over NCCL gives stage 0's losses, fp32 and bf16;
* the fused optimizer path compiled for the GPU gives the unfused path's parameters;
* a bf16 step waits for the GPU once, after its update is enqueued.

Each run's command, device and table belong in docs/performance.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import fzero
from fzero import optim
from harness.commands import run_command

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

ROOT = Path(__file__).resolve().parents[1]


def _train(tmp_path: Path, zero: int, precision: str, steps: int = 6) -> list[float]:
    out = tmp_path / f"losses_z{zero}_{precision}.json"
    done = run_command([sys.executable, "-m", "fzero.cli.main", "launch", "--nproc", "1",
                        str(ROOT / "examples" / "train_gpt.py"), "--steps", str(steps), "--zero", str(zero),
                        "--precision", precision, "--no-progress", "--sample-len", "8", "--max-bytes", "200000",
                        "--log-losses", str(out)], timeout_s=600, cwd=str(ROOT))
    assert done.returncode == 0, done.output
    return json.loads(out.read_text())["losses"]


def test_the_fused_path_on_the_gpu_equals_the_unfused_path():
    def run(mode):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()
        apply, params = fzero.functionalize(model)
        state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-3, weight_decay=0.1))

        def train_step(state, batch):
            loss, g = fzero.value_and_grad(lambda p: (state.apply_fn(p, batch) - batch).pow(2).mean())(state.params)
            return state.apply_gradients(g), {"loss": loss}

        with optim.use_fused(mode):
            step = fzero.compile(train_step, fzero.Mesh(dp=1), clip_norm=1.0)
            state = step.init(state)
            gen = torch.Generator(device="cuda").manual_seed(1)
            for _ in range(5):
                state, _ = step(state, torch.randn(32, 64, device="cuda", generator=gen))
        return fzero.gather(state.params)

    fused, plain = run("on"), run("off")
    for k in plain:
        torch.testing.assert_close(fused[k], plain[k], rtol=1e-6, atol=1e-7, msg=k)


def test_a_bf16_step_on_the_gpu_synchronizes_once_after_enqueuing_its_update():
    """``torch.cuda.set_sync_debug_mode("warn")`` over the third step of ``benchmarks/gpu_step.py``'s
    bf16 step (a GPT, AdamW by the fused kernel, a clip at 1.0): one synchronizing
    operation, the read of the verdict on the gradients once the update is enqueued, as
    ``device_check.host_syncs`` finds on the CPU
    (``tests/test_device_check.py::test_a_step_on_the_gpu_path_waits_for_the_device_once_after_enqueuing_its_update``)."""
    import warnings

    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32)).cuda()

    def train_step(state, batch):
        def loss_fn(p):
            return F.cross_entropy(state.apply_fn(p, batch["x"]).float().flatten(0, 1), batch["y"].flatten())

        loss, grads = fzero.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads), {"loss": loss}

    apply, params = fzero.functionalize(model)
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(3e-4, 0.9, 0.95, 1e-8, 0.1))
    step = fzero.compile(train_step, fzero.Mesh(dp=1, device="cuda"), precision="bf16", clip_norm=1.0)
    state = step.init(state)
    x = torch.randint(0, 64, (2, 8), device="cuda")
    for _ in range(2):
        state, _ = step(state, {"x": x, "y": x})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            state, metrics = step(state, {"x": x, "y": x})
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, "\n".join(syncs)
    assert torch.isfinite(metrics["loss"]).item()


def test_the_nonfinite_check_sees_nan_and_inf_on_the_gpu():
    """The check is one multi-tensor max-abs per dtype: CUDA's must propagate NaN."""
    from test_nonfinite import _flags_case

    _flags_case("cuda")


def test_offload_init_never_holds_the_optimizer_state_on_the_gpu():
    """ZeRO-Offload's init cuts the masters' pieces into host memory and builds the moments
    there: the GPU's peak during init is the module's fp32 weights (the user's), their bf16
    copies and one fp32 flat group in passing -- not the 12 bytes per parameter of masters and
    moments built on the device and then copied (which kept offload from training a larger
    model than no offload: docs/performance.md, GPU)."""
    torch.manual_seed(0)
    dev = torch.device("cuda", torch.cuda.current_device())
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)]).to(dev)
    apply, params = fzero.functionalize(model)
    psi = sum(p.numel() for p in params.values())
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-3))
    step = fzero.compile(lambda s, b: (s, {}), fzero.Mesh(dp=1), zero=1, precision="bf16", offload_optimizer="cpu")
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    new = step.init(state)
    peak = torch.cuda.max_memory_allocated(dev) - base
    assert all(x.device.type == "cpu" for x in fzero.tree.leaves(new.opt_state) + fzero.tree.leaves(new.master)
               if isinstance(x, torch.Tensor) and x.dim() > 0)
    # Beyond what the caller holds (the module's weights, the state it passed): the bf16
    # copies (2 bytes per parameter) and one fp32 flat group of the masters in passing.
    assert peak <= 6.5 * psi, peak / psi


def test_offload_from_a_state_built_on_the_host_keeps_the_optimizer_off_the_gpu():
    """ZeRO-Offload as DeepSpeed users run it: the model built on the host, the step on the
    GPU (``Mesh(device="cuda")``). ``init`` moves the parameters there but not the moments
    ``TrainState.create`` made (they are built again on the host); between steps the GPU
    holds the bf16 parameters (2 bytes a parameter) and the reduce buffers ZeRO keeps (at most
    1/16 of the fp32 gradient's bytes: ``_checks.kept_reduce_bytes``); the first loss is the
    module's own under ``torch.autocast``."""
    torch.manual_seed(0)
    dev = torch.device("cuda", torch.cuda.current_device())
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    x, y = torch.randn(64, 1024), torch.randn(64, 1024)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        expected = torch.nn.functional.mse_loss(model.to(dev)(x.to(dev)).float(), y.to(dev)).item()
    model.to("cpu")
    apply, params = fzero.functionalize(model)
    psi = sum(p.numel() for p in params.values())
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-3))

    def train_step(state, batch):
        loss, grads = fzero.value_and_grad(
            lambda p: torch.nn.functional.mse_loss(state.apply_fn(p, batch["x"]).float(), batch["y"]))(state.params)
        return state.apply_gradients(grads), {"loss": loss}

    step = fzero.compile(train_step, fzero.Mesh(dp=1, device="cuda"), zero=1, precision="bf16",
                         offload_optimizer="cpu")
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    new = step.init(state)
    peak = torch.cuda.max_memory_allocated(dev) - base
    assert {x.device.type for x in fzero.tree.leaves(new.params)} == {"cuda"}
    assert all(x.device.type == "cpu" for x in fzero.tree.leaves(new.opt_state) + fzero.tree.leaves(new.master)
               if isinstance(x, torch.Tensor) and x.dim() > 0)
    # The fp32 parameters moved (4 bytes a parameter), their bf16 copies (2) and one fp32
    # flat group in passing; never the moments (8 more).
    assert peak <= 6.5 * psi, peak / psi
    batch = {"x": x.to(dev), "y": y.to(dev)}
    new, metrics = step(new, batch)
    assert abs(float(metrics["loss"]) - expected) <= 2e-2 * abs(expected), (float(metrics["loss"]), expected)
    new, _ = step(new, batch)
    torch.cuda.synchronize(dev)
    assert torch.cuda.memory_allocated(dev) - base <= 2.3 * psi, (torch.cuda.memory_allocated(dev) - base) / psi


def test_offload_with_page_locked_buffers_trains_as_without_them_bit_for_bit():
    """``pin_memory=True``: the gradient pieces reach the host, and the new bf16 parameters
    the GPU, through page-locked buffers kept between steps, the host-to-device copies queued
    asynchronously (``offload.HostStaging``); the trajectory is the one of pageable buffers
    and synchronous copies, bit for bit (both update on the host alike), with and without
    donation."""
    dev = torch.device("cuda", torch.cuda.current_device())

    def run(pin: bool, donate: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).to(dev)
        apply, params = fzero.functionalize(model)
        state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-2, weight_decay=0.1))

        def train_step(state, batch):
            loss, grads = fzero.value_and_grad(
                lambda p: torch.nn.functional.mse_loss(state.apply_fn(p, batch["x"]).float(), batch["y"]))(state.params)
            return state.apply_gradients(grads), {"loss": loss}

        step = fzero.compile(train_step, fzero.Mesh(dp=1), zero=1, precision="bf16", offload_optimizer="cpu",
                             pin_memory=pin, donate=donate)
        state, losses = step.init(state), []
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            batch = {"x": torch.randn(32, 256, generator=g).to(dev), "y": torch.randn(32, 256, generator=g).to(dev)}
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        return losses, {k: v.cpu() for k, v in fzero.gather(state.params).items()}

    for donate in (True, False):
        (pinned_losses, pinned), (losses, params) = run(True, donate), run(False, donate)
        assert pinned_losses == losses, (donate, pinned_losses, losses)
        assert all(torch.equal(pinned[k], params[k]) for k in params), donate


# The launches last: they take minutes together, and make gpu-check runs this file in order
# within a time limit (the quick tests' outcomes first).
@pytest.mark.multirank
@pytest.mark.slow
def test_the_example_trains_on_the_gpu_over_nccl(tmp_path):
    losses = _train(tmp_path, 0, "bf16", steps=20)
    assert len(losses) == 20 and all(map(lambda v: v == v, losses))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5  # it learns


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_stage_in_a_world_of_one_gives_stage_0s_losses(tmp_path, precision):
    ref = _train(tmp_path, 0, precision)
    for zero in (1, 2, 3):
        got = _train(tmp_path, zero, precision)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5 if precision == "fp32" else 2e-2,
                                   atol=1e-6 if precision == "fp32" else 1e-2, msg=f"stage {zero}")
