"""Elastic jobs: ``fzero launch --nproc-min K`` loses nodes and gains them, and the run goes on
as if nothing happened.

The run: ``tests/harness/elastic_job.py`` under ``fzero launch --nproc 4 --nproc-min 2``
(four torchrun agents of one rank each, an elastic c10d rendezvous hosted by the launcher).
At step 2 two ranks SIGKILL their agents and themselves; the two survivors rendezvous again
and resume from ``fzero.checkpoint.latest()`` on 2 ranks; at step 5 a node is added and the
job resumes on 3. The job runs ZeRO 3 on 4 ranks, ZeRO 2 on 2 and ZeRO 3 on 3, so each
resume reshards onto another world size and another stage, and both stages run elastic.
The loss of every step each world ran, and the final parameters, must equal an
uninterrupted one-process run of the same global batches (fp32, relative 1e-5):
dropout, the token-mean loss and the data order do not depend on the layout, and
``fzero.data``'s position is resumed exactly across the world sizes.

The reference (``elastic_job.reference``) builds its global batches from the documented
rule (epoch ``e``'s order is ``torch.randperm`` seeded with ``seed + e``; batch ``b`` its rows
``[bB, (b+1)B)``), not through ``fzero.data``, and runs the step in one process
(``fzero.Step``: no transform).

The launcher's plan (the agents' commands, option errors, the exit code) is checked without
starting anything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import fzero
import fzero.testing as ft
from fzero.cli import _elastic, launch
from harness import elastic_job
from harness.commands import run_command

STEPS = 8


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fzero")
    launch.add_parser(parser.add_subparsers())
    return parser.parse_args(["launch", *argv])


# --------------------------------------------------------------------------- the plan


def test_nproc_min_starts_one_agent_of_one_rank_per_node_on_an_elastic_rendezvous():
    p = launch.plan(_parse("--nproc", "4", "--nproc-min", "2", "--master-port", "4321", "t.py", "--lr", "1"), env={})
    assert isinstance(p, _elastic.ElasticPlan)
    assert (p.min_nodes, p.max_nodes, len(p.nodes), p.world_size, p.host_store) == (2, 4, 4, 4, True)
    argv = p.nodes[0].argv
    assert argv[1:] == ["-m", "torch.distributed.run", "--nproc-per-node", "1", "--nnodes", "2:4", "--rdzv-backend",
                        "c10d", "--rdzv-endpoint", "127.0.0.1:4321", "--rdzv-id", "fzero-4321", "--rdzv-conf",
                        "is_host=false,keep_alive_interval=5,keep_alive_max_attempt=3,last_call_timeout=2",
                        "--max-restarts", "3", "--local-addr", "127.0.0.1", "t.py", "--lr", "1"]
    assert all(n.argv == argv for n in p.nodes)
    env = p.nodes[0].env
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # no store that dies with one agent
    assert env[_elastic.JOIN_VAR].split()[1:] == [
        "-m", "fzero.cli", "launch", "--nnodes", "2:4", "--nproc", "1", "--master-addr", "127.0.0.1",
        "--master-port", "4321", "--max-restarts", "3", "t.py", "--lr", "1"]


def test_nnodes_min_max_runs_one_agent_of_nproc_ranks_here():
    p = launch.plan(_parse("--nnodes", "2:3", "--nproc", "8", "--master-addr", "10.9.8.7", "--max-restarts", "5",
                           "t.py"), env={"A": "1"})
    (node,) = p.nodes
    assert node.nproc == 8 and node.env["A"] == "1" and not p.host_store  # the store is on 10.9.8.7
    assert node.argv[node.argv.index("--nnodes") + 1] == "2:3"
    assert node.argv[node.argv.index("--rdzv-endpoint") + 1] == f"10.9.8.7:{launch.DEFAULT_MULTINODE_PORT}"
    assert node.argv[node.argv.index("--max-restarts") + 1] == "5" and "--local-addr" not in node.argv


def test_on_a_gpu_host_each_one_rank_agent_sees_its_own_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    p = launch.plan(_parse("--nproc", "2", "--nproc-min", "1", "t.py"), env={})
    assert [n.env["CUDA_VISIBLE_DEVICES"] for n in p.nodes] == ["3", "5"]
    with pytest.raises(launch.LaunchError, match=r"--nproc 3 exceeds the 2 visible GPU\(s\) \(3,5\)"):
        launch.plan(_parse("--nproc", "3", "--nproc-min", "1", "t.py"), env={})


@pytest.mark.parametrize("argv, says", [
    (["--nproc", "2", "--nproc-min", "3"], "--nproc-min 3 must be between 1 and --nproc 2"),
    (["--nproc", "2", "--nproc-min", "1", "--max-restarts", "0", "--node-rank", "1"],
     "--node-rank: the rendezvous numbers the nodes of an elastic job; --max-restarts 0: the survivors of a lost "
     "node need at least 1 restart"),
    (["--nnodes", "1:2", "--nproc", "1"], "--nnodes 1:2 needs --master-addr"),
    (["--nproc", "4", "--nproc-min", "2", "--nnodes", "2"], "--nproc-min cannot be combined with --nnodes (2)"),
])
def test_contradicting_elastic_options_are_refused_naming_each(argv, says):
    with pytest.raises(launch.LaunchError) as info:
        launch.plan(_parse(*argv, "t.py"), env={})
    assert says in str(info.value)


def test_nnodes_must_be_n_or_min_max():
    assert _elastic.parse_nnodes("3") == 3 and _elastic.parse_nnodes("1:4") == (1, 4)
    for bad in ("3:2", "0:2", "a:b", "2:"):
        with pytest.raises(argparse.ArgumentTypeError, match="MIN:MAX"):
            _elastic.parse_nnodes(bad)


def test_the_exit_code_forgives_lost_nodes_only_when_the_job_finished():
    assert _elastic.exit_code([0, -9, -9, 0]) == 0  # two nodes lost, the others finished
    assert _elastic.exit_code([1, -9]) == 1  # the survivor failed
    assert _elastic.exit_code([-9, -15]) == 137  # nothing finished
    assert _elastic.exit_code([0, 2]) == 2


# --------------------------------------------------------------------------- a real elastic run


@pytest.mark.multirank
@pytest.mark.slow
def test_a_job_that_loses_two_of_four_nodes_and_gains_one_is_the_uninterrupted_run(tmp_path):
    env = {**os.environ, "FZERO_TIMEOUT": "30", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(fzero.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    # ZeRO 3 on 4 ranks, 2 on 2, 3 on 3: each checkpoint is loaded onto another world size
    # and another stage.
    done = run_command([sys.executable, "-m", "fzero.cli", "launch", "--nproc", "4", "--nproc-min", "2",
                        elastic_job.__file__, str(tmp_path), "--zero", "4:3,2:2,3:3", "--steps", str(STEPS),
                        "--shrink-at", "2", "--grow-at", "5"], env=env, timeout_s=400)
    assert not done.timed_out, done.output[-6000:]
    assert done.returncode == 0, done.output[-6000:]
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    worlds = [rec["world"] for rec in log if "start" in rec]
    assert [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]][-3:] == [4, 2, 3], log
    last = {rec["step"]: rec for rec in log if "step" in rec}
    assert sorted(last) == list(range(STEPS))
    # (The first round may complete before a slow node arrives: then steps 0-1 ran on fewer
    # ranks, and the job waited at step 2 for the fourth node.)
    assert (last[2]["world"], last[STEPS - 1]["world"]) == (2, 3), log
    assert "fzero launch: node 2 (agent pid" in done.output and "fzero launch: node 3 (agent pid" in done.output
    assert "was lost (SIGKILL)" in done.output

    ref_losses, ref_params = elastic_job.reference(STEPS)
    for rec in log:  # every run of a step, on each world that ran it
        if "step" in rec:
            ft.assert_trees_close(torch.tensor(float.fromhex(rec["loss"])), torch.tensor(ref_losses[rec["step"]]),
                                  what=f"loss of step {rec['step']} on {rec['world']} ranks")
    newest = fzero.checkpoint.latest(str(tmp_path / "ckpt"))
    assert newest == str(tmp_path / "ckpt" / f"step_{STEPS:04d}")
    fzero.checkpoint.export(newest, tmp_path / "final.safetensors")
    ft.assert_trees_close(load_file(tmp_path / "final.safetensors"), ref_params, tol="fp32 small values",
                          what="final parameters")
