"""fzero.checkpoint under SIGKILL: a rank killed at a random moment of a save never damages
the last committed checkpoint (Promise 4).

Twenty trials, each a fresh world of 2 real ranks (a killed rank ends its world) joined in a
gloo process group. One rank arms a timer that SIGKILLs it a random 0-80 ms into a save
with ``keep=2`` (such a save takes 40-80 ms here, so kills land in every phase: writing,
gathering, committing, deleting old checkpoints, or after the save). After each trial,
``latest`` must be the previous checkpoint or the new one, complete, and it must load with
the right values and pass ``verify``.

The worlds are forked from one launcher process that imported torch and fzero once (a rank
pool's start costs seconds; a fork and a gloo rendezvous, a tenth of one). The launcher
never computes with torch between forks, so the children inherit no thread pools.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import signal
import sys
import threading
import time
import traceback

import pytest
import torch
import torch.distributed as dist

import fzero.checkpoint as ckpt
from fzero import tree
from fzero.checkpoint import _comm
from fzero.transforms.shard_state._layout import build_layout
from harness.commands import run_command

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

N = 300_000
TRIALS = 20


def _full(i):
    return {"step": torch.tensor(i),
            "params": {"w": torch.full((N,), float(i)), "b": torch.full((7,), float(i))},
            "opt_state": {"count": torch.tensor(i), "mu": {"w": torch.full((N,), -float(i)),
                                                           "b": torch.full((7,), -float(i))}}}


def _stage1(state, world, rank):
    """ZeRO-1's layout: ``opt_state['mu']`` cut into Shards, the rest replicated."""
    leaves, spec = tree.flatten(state["opt_state"]["mu"])
    named = {f"{i}": x for i, x in enumerate(leaves)}
    shards = build_layout(named, world=world, rank=rank).shard_params(named)
    mu = tree.unflatten(spec, [shards[k] for k in named])
    return {**state, "opt_state": {**state["opt_state"], "mu": mu}}


def _rank_main(rank, store_path, root, i, victim, delay):
    """Body of a forked rank: join the world, save, maybe die; never returns."""
    code = 1
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(store_path, 2)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=20))
        state = _stage1(_full(i), 2, rank)
        _comm.world("test")  # the checkpoint's process group, as every save after a job's first finds it
        if rank == victim:
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
        ckpt.save(f"{root}/step_{i:03d}", state, keep=2, timeout_s=20)
        if rank == victim:
            time.sleep(delay + 5)  # the kill comes, after the save if not during it
        code = 0
    except BaseException:  # noqa: BLE001  (the survivor of a kill mid-save lands here)
        traceback.print_exc(limit=2)
    finally:
        os._exit(code)


def _trial(root, i, victim, delay):
    store_path = os.path.join(root, f".store-{i}")
    pids = []
    for r in range(2):
        pid = os.fork()
        if pid == 0:
            _rank_main(r, store_path, root, i, victim, delay)
        pids.append(pid)
    codes, deadline = {}, time.monotonic() + 60
    while len(codes) < 2 and time.monotonic() < deadline:
        for r, pid in enumerate(pids):
            if r not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[r] = os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    for r, pid in enumerate(pids):  # a rank stuck for a minute: the test fails on its code
        if r not in codes:
            os.kill(pid, signal.SIGKILL)
            codes[r] = "hung"
            os.waitpid(pid, 0)
    os.remove(store_path)
    return codes


def _launcher(root):
    """Run the trials; after each, check latest; print one JSON line of results."""
    torch.set_num_threads(1)
    ckpt.save(f"{root}/step_000", _stage1(_full(0), 1, 0))  # the first good checkpoint
    like = tree.map(torch.zeros_like, _full(0))  # loaded by one process, unpartitioned
    rng = random.Random(0)
    good, results = 0, []
    for i in range(1, TRIALS + 1):
        victim, delay = rng.randrange(2), rng.uniform(0.0, 0.08)
        codes = _trial(root, i, victim, delay)
        path = ckpt.latest(root)
        rec = {"trial": i, "victim": victim, "delay": round(delay, 3), "codes": codes, "latest": path,
               "previous": f"{root}/step_{good:03d}", "new": f"{root}/step_{i:03d}"}
        try:
            j = int(path.rsplit("_", 1)[1])
            out = ckpt.load(path, like)
            rec["values_ok"] = (int(out["step"]) == j and torch.equal(out["params"]["w"], torch.full((N,), float(j)))
                                and torch.equal(out["opt_state"]["mu"]["w"], torch.full((N,), -float(j))))
            ckpt.verify(path)
            good = j
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"{type(e).__name__}: {e}"
        results.append(rec)
    print("RESULTS " + json.dumps(results), flush=True)


def test_sigkill_at_random_moments_never_damages_the_last_checkpoint(tmp_path):
    root = str(tmp_path)
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import test_checkpoint_kill as t; t._launcher({root!r})"
    t0 = time.time()
    # The launcher forks the ranks; whatever is left of them when it ends or times out is killed.
    proc = run_command([sys.executable, "-c", code], timeout_s=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = next((ln for ln in proc.output.splitlines() if ln.startswith("RESULTS ")), None)
    assert proc.returncode == 0 and line, proc.output[-6000:]
    results = json.loads(line[len("RESULTS "):])
    outcomes = []
    for rec in results:
        assert "error" not in rec and rec["values_ok"], rec
        assert rec["latest"] in (rec["previous"], rec["new"]), rec
        assert rec["codes"][str(rec["victim"])] == -signal.SIGKILL, rec  # the victim did die by SIGKILL
        outcomes.append("committed" if rec["latest"] == rec["new"] else "kept previous")
    assert len(results) == TRIALS
    assert outcomes.count("kept previous") >= 3, results  # some kills did land mid-save
    visible = [d for d in os.listdir(root) if not d.startswith(".")]
    assert all(os.path.exists(os.path.join(root, d, "COMMITTED")) for d in visible), visible
    assert len(visible) <= 3, visible  # keep=2, plus at most one whose retention was killed
    last = ckpt.latest(root)
    ckpt.verify(last)
    print(f"{TRIALS} kills in {time.time() - t0:.1f} s: {outcomes.count('committed')} after the commit, "
          f"{outcomes.count('kept previous')} before it")
