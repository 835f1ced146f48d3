"""fzero.monitor: the step's timers, FLOPs and memory in its metrics, and the monitors that
write them (TensorBoard, CSV, W&B, JSON lines) on rank 0 only.

References are independent of fzero: TensorBoard's own event reader, the csv and json
modules, FLOPs counted by hand or by ``FlopCounterMode`` around plain PyTorch, bytes summed
from the tensors' shapes, wall-clock time read around the step from outside.
"""

from __future__ import annotations

import copy
import csv
import importlib.util
import json
import math
import os
import time

import pytest
import torch
import torch.nn.functional as F

import fzero
from fzero import monitor, optim
from fzero.distributed import comm
from fzero.core import handlers

D_IN, HIDDEN, D_OUT, ROWS = 8, 16, 4, 32


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, D_OUT))


def _batch(seed: int, rows: int = ROWS) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(rows, D_IN, generator=g), "y": torch.randn(rows, D_OUT, generator=g)}


def _train_step(state, batch):
    def loss_fn(p):
        return F.mse_loss(state.apply_fn(p, batch["x"]), batch["y"])

    loss, grads = fzero.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads), {"loss": loss}


def _remat_step(state, batch):
    def loss_fn(p):
        return F.mse_loss(state.apply_fn(p, batch["x"]), batch["y"])

    loss, grads = fzero.value_and_grad(fzero.remat(loss_fn))(state.params)
    return state.apply_gradients(grads), {"loss": loss}


def _compiled(step_fn=_train_step, module=None, tx=None, **options):
    apply, params = fzero.functionalize(module if module is not None else _mlp())
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=tx or optim.adamw(1e-2))
    step = fzero.compile(step_fn, **options)
    return step, step.init(state)


def _run(step, state, n: int, rows: int = ROWS):
    out = []
    for i in range(n):
        state, metrics = step(state, _batch(i, rows))
        out.append(metrics)
    return state, out


# --------------------------------------------------------------------------- writers


def test_tensorboard_event_files_hold_each_steps_metrics(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = monitor.TensorBoard(str(tmp_path), "job")
    step, state = _compiled(clip_norm=1.0, timers=True, monitors=[tb])
    _, metrics = _run(step, state, 3)
    tb.close()
    acc = EventAccumulator(str(tmp_path / "job"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"Train/Samples/train_loss", "Train/Samples/grad_norm", "Train/Samples/time/forward"} <= set(tags)
    loss = acc.Scalars("Train/Samples/train_loss")
    assert [e.step for e in loss] == [ROWS, 2 * ROWS, 3 * ROWS]  # DeepSpeed's x-axis: samples
    for event, m in zip(loss, metrics):
        assert event.value == pytest.approx(m["loss"].item(), rel=1e-6)
    for event, m in zip(acc.Scalars("Train/Samples/grad_norm"), metrics):
        assert event.value == pytest.approx(m["grad_norm"].item(), rel=1e-6)
    for event, m in zip(acc.Scalars("Train/Samples/time/backward"), metrics):
        assert event.value == pytest.approx(m["time"]["backward"], rel=1e-6)


def test_csv_files_follow_deepspeeds_layout_and_hold_each_steps_metrics(tmp_path):
    writer = monitor.CSV(str(tmp_path), "job")
    step, state = _compiled(comm_bytes=True, monitors=[writer])
    _, metrics = _run(step, state, 3)
    writer.close()
    files = set(os.listdir(tmp_path / "job"))
    assert {"Train_Samples_train_loss.csv", "Train_Samples_comm_bytes_total.csv"} <= files
    with open(tmp_path / "job" / "Train_Samples_train_loss.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "train_loss"]
    assert [int(r[0]) for r in rows[1:]] == [ROWS, 2 * ROWS, 3 * ROWS]
    assert [float(r[1]) for r in rows[1:]] == [m["loss"].item() for m in metrics]
    with open(tmp_path / "job" / "Train_Samples_comm_bytes_total.csv", newline="") as f:
        assert list(csv.reader(f))[0] == ["step", "total"]


def test_jsonl_lines_hold_every_scalar_metric(tmp_path):
    path = tmp_path / "logs" / "metrics.jsonl"
    writer = monitor.JSONL(path)
    step, state = _compiled(memory=True, monitors=[writer])
    _, metrics = _run(step, state, 2)
    writer.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["samples"]) for r in lines] == [(1, ROWS), (2, 2 * ROWS)]
    for r, m in zip(lines, metrics):
        assert r["loss"] == m["loss"].item()
        assert r["memory/state_bytes"] == m["memory"]["state_bytes"]


def test_writers_create_nothing_until_they_write(tmp_path):
    monitor.CSV(str(tmp_path), "a")
    monitor.TensorBoard(str(tmp_path), "b")
    monitor.JSONL(tmp_path / "c" / "m.jsonl")
    assert os.listdir(tmp_path) == []


def test_config_sections_make_the_writers_and_the_measurements(tmp_path):
    config = {
        "train_batch_size": ROWS,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
        "gradient_clipping": 0,
        "wall_clock_breakdown": True,
        "memory_breakdown": True,
        "flops_profiler": {"enabled": True},
        "tensorboard": {"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "run"},
        "csv_monitor": {"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "run"},
    }
    step, state = _compiled(config=config)
    assert [type(m).__name__ for m in step.monitors] == ["TensorBoard", "CSV"]
    _, metrics = _run(step, state, 2)
    for m in step.monitors:
        m.close()
    assert {"time", "memory", "flops", "flops_per_s"} <= set(metrics[0])
    assert os.listdir(tmp_path / "tb" / "run")
    with open(tmp_path / "csv" / "run" / "Train_Samples_lr.csv", newline="") as f:
        assert [float(r[1]) for r in list(csv.reader(f))[1:]] == [0.01, 0.01]  # the optimizer section's lr
    with open(tmp_path / "csv" / "run" / "Train_Samples_time_step.csv", newline="") as f:
        assert [float(r[1]) for r in list(csv.reader(f))[1:]] == [m["time"]["step"] for m in metrics]


def test_disabled_sections_make_no_writer():
    cfg = fzero.Config.load({"train_batch_size": 4, "tensorboard": {"enabled": False, "output_path": "x"},
                             "csv_monitor": {"output_path": "y"}, "wandb": {"enabled": False}})
    assert cfg.make_monitors() == []


def test_a_missing_tensorboard_package_is_named_with_the_config_key(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ImportError, match=r"config's 'tensorboard' section\) needs the tensorboard package"):
        _compiled(config={"train_batch_size": ROWS, "tensorboard": {"enabled": True}})


def test_bad_monitor_sections_and_options_are_named_all_at_once():
    with pytest.raises(TypeError, match=r"tensorboard.job_name must be a string.*csv_monitor.enabled must be"):
        fzero.Config.load({"train_batch_size": 4, "tensorboard": {"enabled": True, "job_name": 3},
                           "csv_monitor": {"enabled": "yes"}})
    with pytest.raises(ValueError, match="monitors=.*must be a list of monitors"):
        fzero.compile(_train_step, monitors=["logs/"])
    with pytest.raises(ValueError, match="peak_flops=0 must be a positive number"):
        fzero.compile(_train_step, flops=True, peak_flops=0)


def test_wandb_writes_an_offline_run_or_says_it_is_missing(tmp_path, monkeypatch):
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(ImportError, match=r"config's 'wandb' section\) needs the wandb package"):
            fzero.Config.load({"train_batch_size": 4, "wandb": {"enabled": True}}).make_monitors()
        return
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (writer,) = fzero.Config.load({"train_batch_size": 4, "wandb": {"enabled": True, "project": "p"}}).make_monitors()
    step, state = _compiled(monitors=[writer])
    _, metrics = _run(step, state, 2)
    assert writer.run.summary["Train/Samples/train_loss"] == pytest.approx(metrics[-1]["loss"].item())
    writer.close()
    assert any(name.startswith("offline-run-") for name in os.listdir(tmp_path / "wandb"))


# --------------------------------------------------------------------------- timers


def test_timed_phases_are_non_negative_and_fit_in_the_step_measured_from_outside():
    step, state = _compiled(timers=True, clip_norm=1.0)
    for i in range(3):
        t0 = time.perf_counter()
        state, metrics = step(state, _batch(i))
        outside = time.perf_counter() - t0
        t = metrics["time"]
        assert set(t) == set(monitor.PHASES) | {"step"}
        assert all(v >= 0 for v in t.values()), t
        assert t["forward"] > 0 and t["backward"] > 0 and t["update"] > 0, t
        assert t["reduce"] == 0 and t["gather"] == 0, t  # one process: nothing to wait for
        assert sum(t[p] for p in monitor.PHASES) <= t["step"] <= outside, (t, outside)


def test_timers_count_each_micro_batch_and_remat():
    step, state = _compiled(_remat_step, timers=True, accumulate=4)
    _, (metrics,) = _run(step, state, 1)
    t = metrics["time"]
    assert t["forward"] > 0 and t["backward"] > 0 and sum(t[p] for p in monitor.PHASES) <= t["step"]


def _spy_step(seen):
    def train_step(state, batch):
        seen.append((comm.WAIT_TIMER.get(), len(handlers())))
        return _train_step(state, batch)

    return train_step


def test_without_measurements_nothing_is_installed_and_metrics_are_the_users():
    seen = []
    step, state = _compiled(_spy_step(seen))
    _, (metrics,) = _run(step, state, 1)
    assert not {"time", "flops", "flops_per_s", "tokens_per_s", "mfu", "memory"} & set(metrics), metrics
    plain = seen[0]
    assert plain[0] is None
    step, state = _compiled(_spy_step(seen), timers=True)
    _run(step, state, 1)
    assert seen[1][0] is not None and seen[1][1] == plain[1] + 1  # one handler more: the timer


# --------------------------------------------------------------------------- FLOPs


def test_flops_equal_the_hand_count_of_the_mlps_matmuls():
    # Forward: 2·rows·in·out per Linear. Backward: the last layer's input gradient and both
    # weight gradients (the first layer's input needs none): one more forward's worth each.
    forward = 2 * ROWS * (D_IN * HIDDEN + HIDDEN * D_OUT)
    backward = 2 * ROWS * HIDDEN * D_OUT + 2 * ROWS * (D_IN * HIDDEN + HIDDEN * D_OUT)
    step, state = _compiled(flops=True)
    _, metrics = _run(step, state, 2)
    assert [m["flops"] for m in metrics] == [forward + backward] * 2
    assert "mfu" not in metrics[0] and "tokens_per_s" not in metrics[0]  # a CPU; no integer tokens


def _gpt_step(state, batch):
    def loss_fn(p):
        return F.cross_entropy(state.apply_fn(p, batch["x"]).flatten(0, 1), batch["y"].flatten())

    loss, grads = fzero.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads), {"loss": loss}


def _gpt_remat_step(state, batch):
    def loss_fn(p):
        return F.cross_entropy(state.apply_fn(p, batch["x"]).flatten(0, 1), batch["y"].flatten())

    loss, grads = fzero.value_and_grad(fzero.remat(loss_fn))(state.params)
    return state.apply_gradients(grads), {"loss": loss}


@pytest.fixture
def gpt():
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    try:
        from gpt import GPT, GPTConfig
    finally:
        sys.path.pop(0)
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=32))


def _score_matmul_flops(q_shape, s_k):
    """FLOPs of attention's ``q @ k.T`` (b, h, s_q, d) x (b, h, d, s_k)."""
    b, h, s_q, d = q_shape
    return 2 * b * h * s_q * d * s_k


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_attention_counts_as_its_matmuls_written_out(causal):
    """torch's counter gives 0 for scaled_dot_product_attention's CPU kernel; fzero counts its
    forward as the same attention written as matmuls counts, and its backward as torch
    counts its CUDA flash kernels: the matmuls' backward plus the recomputed scores."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from fzero.monitor._flops import FlopCounter

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g, requires_grad=True) for _ in range(3))

    def counted(run):
        with FlopCounterMode(display=False) as plain:
            out = run()
        counter = FlopCounter()
        with counter.counting(q):
            out = run()
        fwd = counter.flops(q)
        counter = FlopCounter()
        with counter.counting(q):
            out.sum().backward()
        return plain.get_total_flops(), fwd, counter.flops(q)

    fused = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    plain_fused, fwd, bwd = counted(fused)
    with sdpa_kernel(SDPBackend.MATH):  # plain PyTorch, attention as bmm's the counter knows
        _, fwd_math, bwd_math = counted(fused)
    assert plain_fused == 0, "torch's counter now counts the CPU kernel: drop fzero's formula"
    assert fwd == fwd_math == 2 * _score_matmul_flops(q.shape, 16)
    assert bwd == bwd_math + _score_matmul_flops(q.shape, 16)


def test_gpt_flops_equal_flop_counter_around_plain_pytorch_and_remat_adds_one_forward(gpt):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    batch = {"x": torch.randint(0, 256, (4, 16)), "y": torch.randint(0, 256, (4, 16))}
    ref = copy.deepcopy(gpt)
    # Attention as plain PyTorch's matmuls (torch's counter sees nothing of the CPU's fused
    # kernel); fzero counts that kernel's backward as torch counts its CUDA flash kernels:
    # the scores recomputed, one more q @ k.T per layer.
    with sdpa_kernel(SDPBackend.MATH):
        with FlopCounterMode(display=False) as fwd:
            logits = ref(batch["x"])
        with FlopCounterMode(display=False) as bwd:
            F.cross_entropy(logits.flatten(0, 1), batch["y"].flatten()).backward()
    recomputed = 2 * _score_matmul_flops((4, 2, 16, 16), 16)  # 2 layers, 2 heads of 16 channels
    plain, forward = fwd.get_total_flops() + bwd.get_total_flops() + recomputed, fwd.get_total_flops()
    # The 6·N·tokens estimate (N: the matmul weights; attention's score FLOPs come on top).
    n = sum(p.numel() for name, p in ref.named_parameters() if p.dim() == 2 and "wpe" not in name)
    assert 6 * n * 64 <= plain <= 1.5 * 6 * n * 64

    step, state = _compiled(_gpt_step, module=copy.deepcopy(gpt), flops=True, peak_flops=1e12)
    state, metrics = step(state, batch)
    assert metrics["flops"] == plain
    assert metrics["mfu"] == pytest.approx(metrics["flops_per_s"] / 1e12)
    # tokens_per_s and flops_per_s share the step's time: their ratio is tokens / FLOPs.
    assert metrics["tokens_per_s"] / metrics["flops_per_s"] == pytest.approx(64 / plain)

    step, state = _compiled(_gpt_remat_step, module=copy.deepcopy(gpt), flops=True, tokens_per_batch=1000)
    state, metrics = step(state, batch)
    assert metrics["flops"] == plain + forward  # the recomputed forward runs, and counts
    assert metrics["tokens_per_s"] / metrics["flops_per_s"] == pytest.approx(1000 / (plain + forward))


def test_flops_are_counted_once_per_batch_shape(monkeypatch):
    from torch.utils import flop_counter

    made = []

    class Counting(flop_counter.FlopCounterMode):
        def __init__(self, *a, **kw):
            made.append(1)
            super().__init__(*a, **kw)

    monkeypatch.setattr(flop_counter, "FlopCounterMode", Counting)
    step, state = _compiled(flops=True)
    state, first = _run(step, state, 3, rows=ROWS)
    state, second = _run(step, state, 2, rows=ROWS // 2)
    assert len(made) == 2
    assert {m["flops"] for m in first} == {2 * {m["flops"] for m in second}.pop()}  # FLOPs scale with rows


def test_peak_flops_table_by_device_name():
    from fzero.monitor._flops import _model

    assert _model("NVIDIA H100 80GB HBM3") == "H100 SXM"
    assert _model("NVIDIA H100 PCIe") == "H100 PCIe"
    assert _model("NVIDIA H200 NVL") == "H200 NVL"
    assert _model("NVIDIA A100 80GB PCIe") == "A100"
    assert _model("NVIDIA L40S") == "L40S" and _model("NVIDIA L4") == "L4"
    assert _model("Tesla V100-SXM2-16GB") == "V100 SXM2"
    assert _model("NVIDIA GeForce RTX 4090") == "RTX 4090"
    assert _model("NVIDIA A10G") is None and _model("NVIDIA A10") == "A10"
    for peaks in monitor.PEAK_FLOPS.values():  # dense figures: 16-bit at least the TF32 one, TF32 at least FP32
        assert peaks["16"] >= peaks["tf32"] >= peaks["fp32"] > 1e12
    assert monitor.peak_flops("cpu", "bf16") is None


# --------------------------------------------------------------------------- memory


def test_state_bytes_are_parameters_and_adam_moments():
    step, state = _compiled(memory=True, tx=optim.adam(1e-2))
    _, (metrics,) = _run(step, state, 1)
    psi = D_IN * HIDDEN + HIDDEN + HIDDEN * D_OUT + D_OUT
    mem = metrics["memory"]
    # fp32 parameters and two fp32 moments: 12 bytes a parameter, plus Adam's step counter.
    assert 12 * psi <= mem["state_bytes"] <= 12 * psi + 64, mem
    assert mem["peak_rss_bytes"] >= mem["state_bytes"]
    assert "cuda_peak_bytes" not in mem


# --------------------------------------------------------------------------- ranks


def _stage3_on_ranks(root: str):
    rank = torch.distributed.get_rank()
    paths = {"csv": os.path.join(root, f"csv{rank}"), "jsonl": os.path.join(root, f"m{rank}.jsonl")}
    step, state = _compiled(zero=3, timers=True, memory=True, flops=True,
                            monitors=[monitor.CSV(paths["csv"], "job"), monitor.JSONL(paths["jsonl"])])
    g = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(2):
        batch = {"x": torch.randn(ROWS, D_IN, generator=g), "y": torch.randn(ROWS, D_OUT, generator=g)}
        state, metrics = step(state, batch)
        out.append({"time": metrics["time"], "state_bytes": metrics["memory"]["state_bytes"],
                    "flops": metrics["flops"], "loss": metrics["loss"].item()})
    for m in step.monitors:
        m.close()
    return out


@pytest.mark.slow
@pytest.mark.multirank
def test_stage_3_on_two_ranks_times_gather_and_reduce_and_only_rank_0_writes(ranks, tmp_path):
    results = ranks(2).run(_stage3_on_ranks, str(tmp_path), timeout_s=120)
    psi = D_IN * HIDDEN + HIDDEN + HIDDEN * D_OUT + D_OUT
    for rank, steps in enumerate(results):
        for m in steps:
            t = m["time"]
            assert t["gather"] > 0 and t["reduce"] > 0, (rank, t)
            assert sum(t[p] for p in monitor.PHASES) <= t["step"], (rank, t)
            # Each rank holds half of the parameters and moments (padding aside).
            assert 12 * psi / 2 <= m["state_bytes"] <= 12 * psi / 2 + 512, (rank, m)
    assert sorted(os.listdir(tmp_path)) == ["csv0", "m0.jsonl"]  # rank 1 wrote nothing
    lines = [json.loads(line) for line in (tmp_path / "m0.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in lines] == [2 * ROWS, 4 * ROWS]  # both ranks' samples
    assert [r["loss"] for r in lines] == [m["loss"] for m in results[0]]
    assert all(math.isfinite(r["time/gather"]) for r in lines)
