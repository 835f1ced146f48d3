"""fzero.autotune and ``fzero autotune``: the search, the trial-side profiler, the console command.

References are independent of the code under test: the ZeRO paper's per-rank bytes
(16Ψ, 8Ψ+8Ψ/N, 4Ψ+12Ψ/N, 16Ψ/N for fp32 Adam) written out here, ``nn.Module.parameters()``
for Ψ, the config's train_batch_size for the samples a step consumes. No test asserts a
time: where a trial must win, it does a whole multiple less work than the one it beats.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import fzero
from fzero import optim
from fzero.autotune import (AutotuningConfig, Candidate, TrialDone, TrialSpec, apply, estimate_bytes, grid, search)
from fzero.cli.autotune import _why, trial_args
from fzero.config import ConfigKeyError


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 16))


def _train_step(state, batch):
    x, y = batch
    loss, g = fzero.value_and_grad(lambda p: (state.apply_fn(p, x) - y).pow(2).mean())(state.params)
    return state.apply_gradients(g), {"loss": loss}


def _run_trial(config: dict, trial: TrialSpec, max_steps: int = 20):
    """One trial in this process (a rank of the pool, or the test itself): the step compiled
    with trial= runs until it ends the trial; rank 0's metric file, or None."""
    mesh = fzero.Mesh(dp=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        cfg = fzero.Config.load(config, world_size=mesh.size("dp"))
    apply_fn, params = fzero.functionalize(_model())
    state = fzero.TrainState.create(apply_fn=apply_fn, params=params, tx=optim.adam(1e-3))
    step = fzero.compile(_train_step, mesh, config=cfg, trial=trial)
    gen = torch.Generator().manual_seed(mesh.rank)
    try:
        state = step.init(state)
        for _ in range(max_steps):
            x = torch.randn(cfg.local_batch_size, 64, generator=gen)
            state, _ = step(state, (x, x[:, :16]))
    except TrialDone as done:
        assert done.code == 0
        return json.loads(Path(trial.metric_path).read_text()) if mesh.rank == 0 else None
    raise AssertionError(f"the step did not end the trial in {max_steps} steps")


def _spec(tmp_path: Path, name: str, **fields) -> TrialSpec:
    d = tmp_path / name
    d.mkdir(parents=True, exist_ok=True)
    return TrialSpec(**{"mode": "profile", "metric_path": str(d / "metrics.json"), "shutdown": False, **fields})


# --------------------------------------------------------------------------- the known best


@pytest.mark.slow
@pytest.mark.multirank
def test_autotune_picks_the_known_best_of_a_small_grid_on_a_tiny_model(ranks, tmp_path):
    """Stages 0-3 × micro-batch {1, 8} at train_batch_size 16 on 2 real ranks, fp32 Adam.

    The budget, 11Ψ bytes per rank, prunes all but stage 2: stages 0 and 1 hold 16Ψ and 12Ψ
    by the ZeRO paper's formula (stage 1 more: it is estimated under accumulation); this model has no blocks for ZeRO-3 to gather one at a time
    (no ModuleList), so stage 3 gathers it whole for the step and holds its 8Ψ and the 4Ψ
    gathered; stage 2 holds 10Ψ (+ two 256-element reduce buckets, 2 KiB, well under the Ψ
    bytes of margin). Of the two stage-2 trials, micro-batch 8 runs one forward/backward per
    update where micro-batch 1 runs eight: it is the known best by an 8× difference in work."""
    psi = sum(p.numel() for p in _model().parameters())
    base = {"train_batch_size": 16, "zero_optimization": {"reduce_bucket_size": 256}}
    candidates = grid(world_size=2, train_batch_size=16, micro_batches=(1, 8))
    assert [c.name for c in candidates] == [f"z{s}_tp1_mbs{m}_gas{16 // (2 * m)}" for s in range(4) for m in (1, 8)]
    budget = 11 * psi
    estimate = lambda c: estimate_bytes(c, num_params=psi, world_size=2, bucket_bytes=4 * 256)  # noqa: E731
    held = {s: estimate(Candidate(s, 1, 8, 16)) for s in range(4)}
    assert held[3] >= 16 * psi // 2 + 4 * psi > held[2] >= 4 * psi + 12 * psi // 2, held
    assert [s for s in range(4) if held[s] <= budget] == [2]
    ran = []

    def run_trial(c):
        ran.append(c.name)
        out = ranks(2).run(_run_trial, apply(base, c), _spec(tmp_path, c.name, start_profile_step=2,
                                                             end_profile_step=4))
        return out[0]

    result = search(candidates, run_trial, budget, estimate=estimate)
    assert ran == ["z2_tp1_mbs1_gas8", "z2_tp1_mbs8_gas1"]
    assert [t.status for t in result.trials] == ["pruned"] * 4 + ["ok", "ok"] + ["pruned"] * 2
    assert result.best.candidate == Candidate(2, 8, 1, 16)
    # What the profiler counted: 3 profiled steps of train_batch_size samples, Ψ from the module.
    for t in result.trials[4:6]:
        assert t.result["samples"] == 16 * 3 and t.result["profiled_steps"] == 3
        assert t.result["num_params"] == psi and t.result["world_size"] == 2
        assert t.result["throughput"] == pytest.approx(t.result["samples"] / t.result["seconds"])
    table = result.table()
    assert "*  z2_tp1_mbs8_gas1" in table
    assert table.count("pruned") == 6


def test_profiler_counts_the_trainable_parameters_at_init_and_ends_the_trial(tmp_path):
    model = _model()
    model[0].bias.requires_grad_(False)
    psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
    apply_fn, params = fzero.functionalize(model)
    step = fzero.compile(_train_step, zero=1, trial=_spec(tmp_path, "info", mode="model_info"))
    with pytest.raises(TrialDone):
        step.init(fzero.TrainState.create(apply_fn=apply_fn, params=params, tx=optim.sgd(0.1)))
    assert json.loads((tmp_path / "info" / "metrics.json").read_text()) == {"num_params": psi, "block_params": 0,
                                                                            "world_size": 1}


def test_model_info_writes_the_largest_blocks_trainable_parameters(tmp_path):
    """ZeRO-3's blocks are a ModuleList's elements; the count is of each block's trainable
    parameters (a frozen bias left out), read off the module here, and the tuner's config
    reads it back from the file for the estimate."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ModuleList(
        [torch.nn.Linear(32, 32), torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 32))]))
    model[1][1][0].bias.requires_grad_(False)
    model.forward = lambda x: model[1][1](model[1][0](model[0](x)))
    want = max(sum(p.numel() for p in block.parameters() if p.requires_grad) for block in model[1])
    assert want == 32 * 48 + 48 * 32 + 32
    apply_fn, params = fzero.functionalize(model)
    step = fzero.compile(_train_step, zero=3, trial=_spec(tmp_path, "info", mode="model_info"))
    with pytest.raises(TrialDone):
        step.init(fzero.TrainState.create(apply_fn=apply_fn, params=params, tx=optim.sgd(0.1)))
    written = json.loads((tmp_path / "info" / "metrics.json").read_text())
    assert written["block_params"] == want
    cfg = AutotuningConfig.from_dict({"model_info_path": "info/metrics.json"}, base_dir=tmp_path)
    assert (cfg.num_params, cfg.block_params) == (written["num_params"], want)
    (tmp_path / "bad.json").write_text(json.dumps({"num_params": 10, "block_params": -1}))
    with pytest.raises(ValueError, match="bad.json.*block_params must be an integer >= 0"):
        AutotuningConfig.from_dict({"model_info_path": "bad.json"}, base_dir=tmp_path)


def test_profiled_step_measures_the_samples_of_the_profile_steps_on_one_process(tmp_path):
    res = _run_trial({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
                     _spec(tmp_path, "one", start_profile_step=3, end_profile_step=6))
    assert res["samples"] == 8 * 4 and res["profiled_steps"] == 4
    assert res["latency"] == pytest.approx(res["seconds"] / 4)


def test_without_a_trial_the_step_is_untouched():
    assert fzero.compile(_train_step).options.trial is None
    assert "FZERO_AUTOTUNE" not in os.environ  # no environment variable changes what a step does
    apply_fn, params = fzero.functionalize(_model())
    step = fzero.compile(_train_step, config={"train_batch_size": 2, "autotuning": {"enabled": True,
                                                                                     "start_profile_step": 1}})
    state = step.init(fzero.TrainState.create(apply_fn=apply_fn, params=params, tx=optim.sgd(0.1)))
    for _ in range(8):  # past any default profile window
        state, m = step(state, (torch.ones(2, 64), torch.ones(2, 16)))
    assert int(state.step) == 8


def test_a_bad_trial_spec_is_named(tmp_path):
    with pytest.raises(ValueError, match="trial=.*must be None or an fzero.autotune.TrialSpec"):
        fzero.compile(_train_step, trial={"mode": "profile", "metric_path": "m.json"})
    with pytest.raises(ValueError, match="start_profile_step=5, end_profile_step=2"):
        TrialSpec(mode="profile", metric_path="m.json", start_profile_step=5, end_profile_step=2)
    with pytest.raises(ValueError, match="autotuning: .*start_profile_step=5, end_profile_step=2"):
        fzero.compile(_train_step, config={"train_batch_size": 2, "autotuning": {
            "enabled": True, "metric_path": "m.json", "start_profile_step": 5, "end_profile_step": 2}})


def test_the_trial_config_fzero_autotune_writes_asks_the_step_for_the_trial(tmp_path):
    """DeepSpeed's keys, as its autotuner writes each experiment's config: enabled with
    metric_path (profile) or with model_info.profile and model_info_path (Ψ at init)."""
    metrics = str(tmp_path / "metrics.json")
    profile = {"train_batch_size": 2, "autotuning": {"enabled": True, "metric_path": metrics,
                                                     "start_profile_step": 2, "end_profile_step": 4}}
    assert fzero.compile(_train_step, config=profile).options.trial == TrialSpec(
        mode="profile", metric_path=metrics, start_profile_step=2, end_profile_step=4)
    info = {"train_batch_size": 2, "autotuning": {"enabled": True, "model_info": {"profile": True},
                                                  "model_info_path": metrics}}
    assert fzero.compile(_train_step, config=info).options.trial == TrialSpec(mode="model_info", metric_path=metrics)
    # A keyword may not contradict the config's trial; without one in the config it adds it.
    with pytest.raises(ValueError, match="trial=.* contradicts the config's trial="):
        fzero.compile(_train_step, config=info, trial=TrialSpec(mode="profile", metric_path=metrics))
    # the section's other keys are the tuner's: no trial, and no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = fzero.Config.load({"train_batch_size": 2, "autotuning": {"enabled": True, "metric": "latency",
                                                                         "model_info": {"profile": True}}})
    assert plain.trial is None and "trial" not in plain.decided_options()


def test_a_trial_config_makes_the_step_profile_itself_and_end_the_run(tmp_path):
    metrics = tmp_path / "metrics.json"
    step = fzero.compile(_train_step, config={"train_micro_batch_size_per_gpu": 4, "autotuning": {
        "enabled": True, "metric_path": str(metrics), "start_profile_step": 2, "end_profile_step": 3}})
    apply_fn, params = fzero.functionalize(_model())
    state = step.init(fzero.TrainState.create(apply_fn=apply_fn, params=params, tx=optim.sgd(0.1)))
    calls = 0
    with pytest.raises(TrialDone):
        for calls in range(1, 10):
            state, _ = step(state, (torch.ones(4, 64), torch.ones(4, 16)))
    assert calls == 3
    res = json.loads(metrics.read_text())
    assert res["samples"] == 4 * 2 and res["profiled_steps"] == 2 and res["world_size"] == 1


# --------------------------------------------------------------------------- the search loop


def _c(stage, micro=1, gas=1):
    return Candidate(stage, micro, gas, micro * gas)


def test_failed_trials_are_recorded_and_the_search_goes_on():
    speed = {0: 5.0, 1: 7.0, 3: 6.0}

    def run(c):
        if c.stage == 2:
            raise ValueError("does not split")
        if c.micro_batch == 64:
            raise torch.OutOfMemoryError("CUDA out of memory")
        if c.micro_batch == 32:
            return {"loss": 1.0}
        return {"throughput": speed[c.stage]}

    res = search([_c(0), _c(1), _c(2), _c(3), _c(0, 64), _c(0, 32)], run)
    assert [t.status for t in res.trials] == ["ok", "ok", "failed", "ok", "oom", "failed"]
    assert res.trials[2].error == "ValueError: does not split"
    assert "no 'throughput'" in res.trials[5].error
    assert res.best.candidate == _c(1)


def test_latency_is_lower_better_and_ties_go_to_the_first():
    lat = {0: 0.5, 1: 0.2, 2: 0.2, 3: 0.9}
    res = search([_c(s) for s in range(4)], lambda c: {"latency": lat[c.stage], "throughput": 1.0}, metric="latency")
    assert res.best.candidate == _c(1)
    res = search([_c(s) for s in range(4)], lambda c: {"throughput": 1.0})
    assert res.best.candidate == _c(0)


def test_early_stopping_and_trial_cap_leave_the_rest_not_run():
    values = [3.0, 1.0, 1.0, 9.0, 1.0]
    res = search([_c(0, m) for m in range(1, 6)], lambda c: {"throughput": values[c.micro_batch - 1]},
                 early_stopping=2)
    assert [t.status for t in res.trials] == ["ok", "ok", "ok", "not run", "not run"]
    res = search([_c(0, m) for m in range(1, 6)], lambda c: {"throughput": values[c.micro_batch - 1]}, num_trials=4)
    assert [t.status for t in res.trials] == ["ok"] * 4 + ["not run"] and res.best.value == 9.0
    assert search([], lambda c: {}).best is None


def test_random_order_is_a_seeded_permutation():
    cands = [_c(s, m) for s in range(4) for m in (1, 2, 4)]
    order = lambda seed: [t.candidate for t in search(cands, lambda c: {"throughput": 1.0}, order="random",  # noqa: E731
                                                      seed=seed).trials]
    assert order(3) == order(3) and sorted(order(3), key=cands.index) == cands and order(3) != cands


def test_budget_prunes_by_the_zero_formula_at_scale():
    """Ψ = 10^9 on 8 ranks, fp32 Adam: 16, 9, 5.5 and 2 GB by the paper; a 6 GB budget keeps
    stages 2 and 3 (the 25 MiB reduce buckets add under 0.11 GB, less than the margins)."""
    psi = 10**9
    est = lambda c: estimate_bytes(c, num_params=psi, world_size=8)  # noqa: E731
    paper = [16 * psi, 8 * psi + psi, 4 * psi + 12 * psi // 8, 16 * psi // 8]
    for s in range(4):
        assert abs(est(_c(s)) - paper[s]) < 0.6e9
    res = search([_c(s) for s in range(4)], lambda c: {"throughput": float(c.stage)}, 6 * 10**9, estimate=est)
    assert [t.status for t in res.trials] == ["pruned", "pruned", "ok", "ok"]
    with pytest.raises(ValueError, match="needs estimate="):
        search([_c(0)], lambda c: {}, 10)
    with pytest.raises(ValueError, match="metric must be one of"):
        search([_c(0)], lambda c: {}, metric="speed")


def test_the_stage_3_estimate_follows_the_configs_reuse_window():
    """Ψ = 10^8 fp32 on 8 ranks, blocks taken as 1/32 (3.125M parameters): at the default
    window (25 MiB, 6,553,600 elements) stage 3's units are runs of two blocks, with
    ``stage3_max_reuse_distance: 0`` single blocks; two units gathered and two units'
    reduce buffers, 8 bytes per unit parameter, follow."""
    c = _c(3)
    runs = estimate_bytes(c, num_params=10**8, world_size=8)
    blocks = estimate_bytes(c, num_params=10**8, world_size=8, max_reuse_distance=0)
    assert runs - blocks == 8 * 2 * (6_250_000 - 3_125_000)


def test_grid_keeps_the_batch_fixed_or_searches_it():
    g = grid(world_size=4, stages=(1,), tp=(1, 2), train_batch_size=16, num_micro_batches=10)
    assert {(c.tp, c.micro_batch, c.accumulation) for c in g} == {
        (1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 8), (2, 2, 4), (2, 4, 2), (2, 8, 1)}
    assert all(c.micro_batch * c.accumulation * (4 // c.tp) == 16 for c in g)
    g = grid(world_size=2, stages=(0,), accumulation=2, max_micro_batch=8, max_train_batch_size=24)
    assert [(c.micro_batch, c.train_batch_size) for c in g] == [(1, 4), (2, 8), (4, 16)]
    with pytest.raises(ValueError, match="tp=3"):
        grid(world_size=4, tp=(3,))


def test_apply_writes_a_config_that_loads():
    base = {"train_batch_size": 32, "zero_optimization": True, "bf16": {"enabled": True},
            "autotuning": {"enabled": True, "metric": "latency"}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the autotuning section is accepted without a warning
        cfg = fzero.Config.load(apply(base, Candidate(2, 4, 4, 32)), world_size=2)
    assert (cfg.zero_optimization.stage, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == \
        (2, 4, 4)
    assert apply(base, Candidate(1, 8, 1, 16, tp=2))["tensor_parallel"] == {"autotp_size": 2}
    assert base["zero_optimization"] is True  # the base is not changed


# --------------------------------------------------------------------------- DeepSpeed's section


def test_deepspeed_autotuning_section_is_read_with_its_defaults(tmp_path):
    cfg = AutotuningConfig.from_dict(None)
    assert (cfg.metric, cfg.start_profile_step, cfg.end_profile_step, cfg.tuner_early_stopping,
            cfg.num_tuning_micro_batch_sizes, cfg.results_dir) == ("throughput", 3, 5, 5, 3, "autotuning_results")
    (tmp_path / "info.json").write_text(json.dumps({"num_params": 1234}))
    cfg = AutotuningConfig.from_dict({"fast": False, "model_info_path": "info.json", "tuner_type": "model_based",
                                      "model_info": {"hidden_size": 8}, "mp_size": 2}, base_dir=tmp_path)
    assert cfg.num_params == 1234 and cfg.mp_size == 2
    assert [k.split(" ")[0] for k in cfg.ignored] == ["autotuning.fast", "autotuning.model_info.hidden_size",
                                                     "autotuning.tuner_type='model_based'"]


def test_unknown_and_bad_autotuning_keys_are_named_together():
    with pytest.raises(ConfigKeyError) as e:
        AutotuningConfig.from_dict({"metrc": "latency", "start_profile_stp": 1, "bogus": 1})
    msg = str(e.value)
    assert "autotuning.metrc (did you mean autotuning.metric?)" in msg
    assert "autotuning.start_profile_stp (did you mean autotuning.start_profile_step?)" in msg
    assert "autotuning.bogus" in msg
    with pytest.raises(ValueError, match="autotuning.metric must be one of"):
        AutotuningConfig.from_dict({"metric": "speed"})
    with pytest.raises(ValueError, match="start_profile_step=6 is after end_profile_step=5"):
        AutotuningConfig.from_dict({"start_profile_step": 6})


# --------------------------------------------------------------------------- the console command


def test_trial_args_replace_the_config_and_mapped_flags():
    assert trial_args(["--config=a.json", "--lr", "1"], "b.json", {"gradient_accumulation_steps": 4},
                      {"gradient_accumulation_steps": "--gas"}) == ["--config=b.json", "--lr", "1", "--gas", "4"]
    assert trial_args(["x"], "b.json", {}, None) == ["x"]


def test_why_a_trial_failed_is_its_last_exception():
    log = "[rank0]: ValueError: fzero.Config: inconsistent batch sizes\n" \
          "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n===="
    assert _why(log) == "ValueError: fzero.Config: inconsistent batch sizes"
    assert _why("Root Cause\n  traceback : Signal 9 (SIGKILL) received by PID 7\n") == \
        "Signal 9 (SIGKILL) received by PID 7"


SCRIPT = textwrap.dedent('''
    import argparse, torch, fzero
    from fzero import optim
    p = argparse.ArgumentParser()
    p.add_argument("--deepspeed_config", required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    mesh = fzero.Mesh(dp=-1)
    cfg = fzero.Config.load(args.deepspeed_config, world_size=mesh.size("dp"))
    apply, params = fzero.functionalize(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                                            torch.nn.Linear(32, 1)))
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adam(1e-3))
    def train_step(state, batch):
        x, y = batch
        loss, g = fzero.value_and_grad(lambda p: (state.apply_fn(p, x) - y).pow(2).mean())(state.params)
        return state.apply_gradients(g), {"loss": loss}
    step = fzero.compile(train_step, mesh, config=cfg)
    state = step.init(state)
    for i in range(100):
        x = torch.randn(cfg.local_batch_size, 8)
        state, m = step(state, (x, x.sum(1, keepdim=True)))
''')


def _fzero_cli(args, cwd, timeout=300):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(fzero.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from fzero.cli.main import main; sys.exit(main())",
                             *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"fzero {' '.join(args)} did not finish in {timeout} s")
    return proc.returncode, out


@pytest.mark.slow
@pytest.mark.multirank
def test_cli_end_to_end_on_two_ranks(tmp_path):
    """Ψ = 321 is measured by a first trial. With reduce buckets of 10 elements, stage 0
    holds 16Ψ = 5136 bytes and stage 3 8Ψ + 160 = 2728: a budget of 4000 bytes prunes stage 0.
    Micro-batch 3 does not divide train_batch_size 16 on 2 ranks: its trial's config fails to
    load, which is reported, not fatal."""
    (tmp_path / "train.py").write_text(SCRIPT)
    (tmp_path / "ds.json").write_text(json.dumps({
        "train_batch_size": 16, "zero_optimization": {"stage": 0, "reduce_bucket_size": 10},
        "autotuning": {"enabled": True, "start_profile_step": 2, "fast": True}}))
    rc, out = _fzero_cli(["autotune", "--nproc", "2", "--memory", f"{4000 / 2**30:.15f}", "--steps", "2",
                          "--stages", "0,3", "--micro-batches", "8,3", "--out", "best.json",
                          "train.py", "--deepspeed_config", "ds.json"], cwd=tmp_path)
    assert rc == 0, out
    assert "Ψ = 321 parameters" in out and "profiling steps 2-3" in out
    lines = out.splitlines()
    head = next(i for i, ln in enumerate(lines) if ln.split()[:3] == ["trial", "stage", "tp"])
    rows = {}
    for ln in lines[head + 1:]:
        if ln.startswith("fzero autotune:"):
            break
        rows[next(w for w in ln.split() if w.startswith("z"))] = ln
    assert len(rows) == 4, out
    assert "pruned" in rows["z0_tp1_mbs8_gas1"] and "pruned" in rows["z0_tp1_mbs3_gas2"]
    assert rows["z3_tp1_mbs8_gas1"].startswith("*") and " ok " in rows["z3_tp1_mbs8_gas1"]
    assert "failed" in rows["z3_tp1_mbs3_gas2"] and "inconsistent batch sizes" in rows["z3_tp1_mbs3_gas2"]
    best = fzero.Config.load(str(tmp_path / "best.json"), world_size=2)
    assert (best.zero_optimization.stage, best.train_micro_batch_size_per_gpu, best.gradient_accumulation_steps,
            best.train_batch_size) == (3, 8, 1, 16)
    assert json.loads((tmp_path / "best.json").read_text())["zero_optimization"]["reduce_bucket_size"] == 10
    trials = json.loads((tmp_path / "autotuning_results" / "trials.json").read_text())
    assert [t["status"] for t in trials] == ["pruned", "pruned", "ok", "failed"]
    assert trials[2]["result"]["samples"] == 16 * 2
    # Only the two stage-3 trials (and the parameter count's) ran.
    assert sorted(p.name for p in (tmp_path / "autotuning_exps").iterdir()) == \
        ["model_info", "z3_tp1_mbs3_gas2", "z3_tp1_mbs8_gas1"]


def test_cli_usage_errors_name_the_option(tmp_path, capsys):
    (tmp_path / "t.py").write_text("")
    (tmp_path / "ds.json").write_text(json.dumps({"train_batch_size": 8, "autotuning": {"metrc": "latency"}}))
    from fzero.cli.main import main

    for argv, msg in [(["autotune", "--config", "ds.json", "t.py"], "autotuning.metrc"),
                      (["autotune", "--nproc", "2", "--tp", "0", "t.py"], "--tp must be positive"),
                      (["autotune", "--config", "nope.json", "t.py"], "nope.json"),
                      (["autotune", "--nproc", "2", "missing.py"], "missing.py")]:
        cwd = os.getcwd()
        os.chdir(tmp_path)
        try:
            with pytest.raises(SystemExit) as e:
                main(argv)
        finally:
            os.chdir(cwd)
        assert e.value.code == 2, argv
        assert msg in capsys.readouterr().err, argv
