"""benchmarks/gpu_check.py (``make gpu-check``) on the CPU: the dry run writes the JSON a GPU
run writes, with the GPU-only phases recorded as skipped, and benchmarks/gpu_table.py renders
it; the tests phase records each test's outcome, a test past its timeout, a file that does
not import and a test cut by the phase's time limit included; a rerun of one phase with
``--merge`` keeps the others.

The GPU run itself is in docs/performance.md, section GPU.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402
import gpu_table  # noqa: E402

KEYS = {"device", "versions", "bench", "fzero_vs_plain_step", "mfu_350m", "offload_size_ratio", "tests_passed",
        "tests_failed", "tests_skipped", "tests", "phases"}


def _check(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The driver's dry run into ``tmp_path``, its logs too (nothing copied to a device tool's
    $OUT, nothing left in the system's temporary directory)."""
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu",
                           "--preset", "tiny", "--out", str(tmp_path / "gpu.json"), "--work", str(tmp_path / "work"),
                           *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_check")
    done = _check(tmp)
    assert done.returncode == 0, done.stdout + done.stderr
    return tmp, json.loads((tmp / "gpu.json").read_text()), done.stdout


def test_the_dry_run_writes_every_key_with_the_gpu_phases_skipped(dry_run):
    _, report, _ = dry_run
    assert KEYS <= set(report), KEYS - set(report)
    assert report["dry_run"] is True and report["device"] == "cpu"
    assert report["versions"]["torch"] and report["versions"]["fzero"]
    phases = report["phases"]
    assert list(phases) == ["env", "offload", "tests", "bench_tiny"]
    assert phases["env"]["status"] == "ok" and phases["bench_tiny"]["status"] == "ok"
    assert phases["tests"]["status"] == phases["offload"]["status"] == "skipped"
    assert report["tests"] == {} and report["tests_passed"] == report["tests_failed"] == 0
    assert report["offload"]["status"] == "skipped" and report["offload_size_ratio"] is None
    assert report["mfu_350m"] is None and report["targets"] == {}  # no verdicts on a dry run's figures


def test_the_dry_run_keeps_its_logs_in_the_work_directory_given(dry_run):
    tmp, _, stdout = dry_run
    logs = {p.name for p in (tmp / "work").iterdir()}
    assert {"gpu_check.log", "env.log", "gpu_table.md"} <= logs, logs
    assert str(tmp / "work" / "gpu_check.log") in stdout


def test_the_dry_run_times_every_contestant(dry_run):
    _, report, _ = dry_run
    contestants = report["bench"]["tiny"]["contestants"]
    assert {n: e["status"] for n, e in contestants.items()} == {
        "plain": "ok", "fzero": "ok", "compiled": "ok", "fzero-jit": "ok"}
    for name in ("plain", "fzero", "compiled", "fzero-jit"):
        e = contestants[name]
        assert isinstance(e["step_ms"], float) and e["step_ms"] > 0, (name, e)
        assert e["tokens_per_s"] > 0 and e["vs_plain"] > 0 and e["mfu"] is None, (name, e)
    assert contestants["plain"]["vs_plain"] == 1.0
    assert report["fzero_vs_plain_step"] == contestants["fzero"]["vs_plain"]


def test_the_table_renders_the_report_and_the_cli_prints_it(dry_run):
    tmp, report, stdout = dry_run
    table = gpu_table.render(report)
    assert "| tiny | fzero | " in table and "| tiny | fzero-jit | " in table and "unavailable" not in table
    # A contestant this fzero cannot build (an option it lacks) is a row of n/a with the reason.
    cut = copy.deepcopy(report)
    cut["bench"]["tiny"]["contestants"]["fzero-jit"] = {"status": "unavailable", "error": "fzero.compile(jit=...): no"}
    shown = gpu_table.render(cut)
    assert "| tiny | fzero-jit | n/a |" in shown and "unavailable" in shown and "jit=...): no" in shown
    assert "a dry run on the CPU" in table and "Offload search: skipped" in table
    assert table in stdout  # the driver prints it at its end
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_table.py"), str(tmp / "gpu.json")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == table, done.stderr


def test_a_rerun_of_one_phase_with_merge_keeps_the_others(dry_run, tmp_path):
    tmp, report, _ = dry_run
    (tmp_path / "gpu.json").write_text(json.dumps({**report, "phases": {**report["phases"], "tests": {"status": "x"}}}))
    done = _check(tmp_path, "--phases", "tests", "--merge")  # on the CPU: skipped at once
    assert done.returncode == 0, done.stdout + done.stderr
    merged = json.loads((tmp_path / "gpu.json").read_text())
    assert merged["phases"]["tests"]["status"] == "skipped"
    for kept in ("env", "offload", "bench_tiny"):
        assert merged["phases"][kept] == report["phases"][kept], kept
    assert merged["bench"] == report["bench"] and merged["versions"] == report["versions"]


def test_the_tests_phase_records_each_outcome_a_timeout_and_a_cut(tmp_path):
    (tmp_path / "test_sample.py").write_text(textwrap.dedent("""
        import time, pytest

        def test_passes():
            pass

        def test_fails():
            assert 1 == 2

        @pytest.mark.skip(reason="not here")
        def test_skipped():
            pass

        def test_hangs_past_its_timeout():
            time.sleep(60)
    """))
    (tmp_path / "test_broken.py").write_text("import a_module_that_is_not_there\n")
    log = gpu_check.Log(tmp_path / "work" / "log")
    res = gpu_check.run_tests(sys.executable, ["test_broken.py", "test_sample.py"], 40, 3, tmp_path / "work", log,
                              cwd=tmp_path)
    outcomes = {nid: t["outcome"] for nid, t in res["tests"].items()}
    assert outcomes == {"test_broken.py": "error", "test_sample.py::test_passes": "passed",
                        "test_sample.py::test_fails": "failed", "test_sample.py::test_skipped": "skipped",
                        "test_sample.py::test_hangs_past_its_timeout": "failed"}, res
    assert "Timeout" in res["tests"]["test_sample.py::test_hangs_past_its_timeout"]["message"]
    assert "a_module_that_is_not_there" in res["tests"]["test_broken.py"]["message"]
    assert (res["passed"], res["failed"], res["skipped"], res["status"]) == (1, 3, 1, "failed")

    # The phase's time runs out while a test runs: that test is unfinished, not failed.
    (tmp_path / "test_slow.py").write_text("import time\n\ndef test_slow():\n    time.sleep(120)\n")
    # 12 s: pytest's start took 5 s on the development machine at load 8, and the test must have begun
    res = gpu_check.run_tests(sys.executable, ["test_slow.py"], 12, 60, tmp_path / "work2", log, cwd=tmp_path)
    assert res["tests"]["test_slow.py::test_slow"]["outcome"] == "unfinished", res
    assert (res["failed"], res["unfinished"], res["status"]) == (0, 1, "timeout")


def test_the_offload_search_builds_its_models_on_the_host_and_trains_them_with_blocks_checkpointed():
    """gpu_step.py --largest's offload contestant: the GPT made a part at a time (the whole
    fp32 model need not fit in the device's memory cap), with GPT's parameters, tying and
    init; it trains two steps with every block checkpointed, as the search runs it."""
    import torch

    import gpu_step
    from gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=32, remat=True)
    module = gpu_step.host_model(cfg, torch.device("cpu"))
    reference = GPT(cfg)
    assert [(n, p.shape) for n, p in module.named_parameters()] == \
        [(n, p.shape) for n, p in reference.named_parameters()]
    assert module.lm_head.weight is module.wte.weight
    params = {n: p.detach() for n, p in module.named_parameters()}
    assert torch.equal(params["blocks.2.ln_2.weight"], torch.ones(32))
    assert abs(float(params["blocks.0.mlp.c_proj.weight"].std()) - 0.02 / 6 ** 0.5) < 0.002
    run = gpu_step.build("fzero-offload", cfg, torch.device("cpu"))
    batch = gpu_step.batches(cfg, 2, 1, torch.device("cpu"))[0]
    losses = [float(run(batch)) for _ in range(2)]
    assert losses[1] < losses[0], losses


def test_host_phases_times_each_phase_of_both_steps():
    """benchmarks/host_phases.py: the host time of a step before its forward, in forward and
    backward, and after, for plain PyTorch and fzero (and ZeRO stages in a world of one); the
    phases add up to the step, and
    torch's and fzero's backward entries are theirs again afterwards."""
    import torch

    import host_phases
    from fzero import core

    before = torch.autograd._engine_run_backward, core._engine_run_backward
    result = host_phases.main(["--rounds", "2", "--n-layer", "2", "--zero", "1,3"])
    assert set(result) == {"plain", "fzero", "fzero zero=1", "fzero zero=3"}
    for name, phases in result.items():
        assert all(phases[p] > 0 for p in host_phases.PHASES), (name, phases)
        parts = sum(phases[p] for p in host_phases.PHASES[:3])
        assert abs(parts - phases["step"]) < 0.5 * phases["step"], (name, phases)  # medians of each
    assert (torch.autograd._engine_run_backward, core._engine_run_backward) == before
