"""Faults on real ranks: ranks killed, stopped, preempted (SIGTERM) and restarted at chosen
points (init, mid-backward, mid-save, exit), and ranks given inputs that disagree.

Two kinds of job. Whole training jobs run under ``fzero launch`` (torchrun) with
``tests/harness/fault_job.py``, a tiny MLP that checkpoints asynchronously and resumes from
``latest()``: the tests assert the job's exit, its message and, after a restart, that the
loss curve equals an uninterrupted run's bit for bit. Faults inside one collective run on
fresh :func:`~harness.ranks.run_ranks` worlds, where a stopped rank costs no
launcher's 30 s grace. Every subprocess is bounded and reaped (``run_command``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fzero
from fzero import optim
from fzero.distributed import checkin, comm, watchdog
from harness import fault_job
from harness.commands import run_command
from harness.ranks import RankError, run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

TIMEOUT_S = 4  # FZERO_TIMEOUT in the jobs: a hang is found in seconds
STEPS = 6


def _launch(out: Path, *args: str, restarts: int = 0, timeout_s: float = 150, launcher: tuple[str, ...] = ()):
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "FZERO_TIMEOUT": str(TIMEOUT_S), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(fzero.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = run_command([sys.executable, "-m", "fzero.cli.main", "launch", "--nproc", "2", "--max-restarts",
                        str(restarts), *launcher, fault_job.__file__, str(out), "--steps", str(STEPS), *args],
                       env=env, timeout_s=timeout_s)
    assert not done.timed_out, f"the job did not end in {timeout_s} s:\n{done.output[-4000:]}"
    return done


def _seconds_since_fault(out: Path, started: float, done) -> float:
    """Seconds from the fault (the time the failing rank wrote) to the end of ``fzero launch``."""
    return started + done.seconds - float((out / "fault_time").read_text())


def _curve(out: Path) -> dict[int, str]:
    """Step -> loss (``float.hex``) of the last attempt that ran the step."""
    curve = {}
    for line in (out / "losses.jsonl").read_text().splitlines():
        rec = json.loads(line)
        curve[rec["step"]] = rec["loss"]
    return curve


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The loss curve of a run with no fault (ZeRO-3), and its exit: a clean run ends with 0."""
    out = tmp_path_factory.mktemp("clean")
    done = _launch(out, "--zero", "3")
    return done, _curve(out), out


def test_a_clean_run_exits_0_with_its_last_asynchronous_save_committed(uninterrupted):
    done, curve, out = uninterrupted
    assert done.returncode == 0, done.output[-4000:]
    assert "terminate called" not in done.output and "failed" not in done.output, done.output[-4000:]
    assert sorted(curve) == list(range(STEPS))
    # The save of the last step was started asynchronously just before the program ended.
    assert fzero.checkpoint.latest(str(out / "ckpt")) == str(out / "ckpt" / f"step_{STEPS:04d}")


@pytest.mark.parametrize("at, step", [("backward", 3), ("save", 4)])  # the save of step 4, as it runs
def test_a_rank_killed_mid_step_is_restarted_and_resumes_the_same_loss_curve(tmp_path, uninterrupted, at, step):
    _, reference, _ = uninterrupted
    done = _launch(tmp_path, "--zero", "3", "--fault", f"kill:rank=1:at={at}:step={step}", restarts=1)
    assert done.returncode == 0, done.output[-4000:]
    assert f"fault_job: rank 1: kill at {at} (attempt 0)" in done.output
    assert "fault_job: rank 0: done (attempt 1)" in done.output and "fault_job: rank 1: done (attempt 1)" in done.output
    attempts = {json.loads(ln)["attempt"] for ln in (tmp_path / "losses.jsonl").read_text().splitlines()}
    assert attempts == {0, 1}  # it did resume, and from a checkpoint: attempt 1 did not start at step 0
    assert json.loads((tmp_path / "losses.jsonl").read_text().splitlines()[0])["attempt"] == 0
    first_of_1 = min(json.loads(ln)["step"] for ln in (tmp_path / "losses.jsonl").read_text().splitlines()
                     if json.loads(ln)["attempt"] == 1)
    assert first_of_1 > 0
    assert _curve(tmp_path) == reference  # bit for bit


def test_a_rank_killed_at_init_is_restarted_at_stage_2(tmp_path):
    # Restarted ranks used to read the dead attempt's gloo addresses ("Connection refused").
    done = _launch(tmp_path, "--zero", "2", "--fault", "kill:rank=0:at=init:attempt=0", restarts=2)
    assert done.returncode == 0, done.output[-4000:]
    assert "fault_job: rank 0: done (attempt 1)" in done.output


def test_a_rank_killed_at_exit_fails_the_job_naming_it_and_loses_no_checkpoint(tmp_path):
    done = _launch(tmp_path, "--zero", "2", "--fault", "kill:rank=1:at=exit")
    assert done.returncode != 0
    assert "rank      : 1 (local_rank: 1)" in done.output and "(SIGKILL)" in done.output, done.output[-3000:]
    assert fzero.checkpoint.latest(str(tmp_path / "ckpt")) == str(tmp_path / "ckpt" / f"step_{STEPS:04d}")


def test_a_rank_whose_disk_is_full_fails_the_job_naming_it_and_latest_stays_on_the_last_good_one(tmp_path):
    # Rank 1's writes fail from the save of step 4 on (a 1 KiB file size limit: EFBIG, as a
    # full disk's ENOSPC); the save of step 6 reports the failed asynchronous save and ends the job.
    done = _launch(tmp_path, "--zero", "3", "--fault", "full:rank=1:at=save:step=4")
    assert done.returncode != 0, done.output[-4000:]
    ckpt = tmp_path / "ckpt"
    said = (f"fzero.checkpoint._format.CheckpointError: fzero.checkpoint.save: the previous asynchronous save to "
            f"{ckpt}/step_0004 failed: "
            f"fzero.checkpoint.save: nothing was committed to {ckpt}/step_0004: writing failed on rank 1: the file "
            f"size limit was reached (EFBIG: File too large) writing {ckpt}/.step_0004.tmp-")
    # Each rank raises it; the first to end the job is shown (torchrun stops the other).
    assert f"[rank0]: {said}" in done.output or f"[rank1]: {said}" in done.output, done.output[-4000:]
    assert f"the newest committed checkpoint in {ckpt} is unchanged: step_0002" in done.output
    assert fzero.checkpoint.latest(str(ckpt), verify=True) == str(ckpt / "step_0002")
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_0002"]  # no partial files left behind


def test_a_checkpoint_damaged_after_commit_is_skipped_and_the_run_resumes_from_the_last_intact_one(
        tmp_path, uninterrupted):
    _, reference, _ = uninterrupted
    # Killed in step 5, after step_0004 committed; the restart finds step_0004 damaged.
    done = _launch(tmp_path, "--zero", "3", "--fault", "kill:rank=1:at=backward:step=5", "--damage", "flip",
                   "--verify-latest", restarts=1)
    assert done.returncode == 0, done.output[-4000:]
    ckpt = tmp_path / "ckpt"
    assert (f"CorruptCheckpointWarning: fzero.checkpoint.latest: skipped the damaged checkpoint {ckpt}/step_0004: "
            f"checksum mismatch in {ckpt}/step_0004/rank00000.safetensors, bytes [") in done.output, done.output[-4000:]
    assert "fault_job: resuming from step_0002 (attempt 1)" in done.output, done.output[-4000:]
    assert _curve(tmp_path) == reference  # bit for bit, from the last intact checkpoint
    # The resumed run saved step 4 again, over the damaged one (overwrite=True).
    assert fzero.checkpoint.latest(str(ckpt), verify=True) == str(ckpt / "step_0006")
    fzero.checkpoint.verify(str(ckpt / "step_0004"))


@pytest.mark.parametrize("flag, says", [
    ("--tree-differs", "rank 1 has '3.weight', '3.bias', which rank 0 has not"),
    ("--stage-differs", "ZeRO stage: rank 0 compiled stage 2, rank 1 compiled stage 3"),
    ("--path-differs", "the ranks passed different checkpoint paths (rank 0: "),
])
def test_ranks_that_disagree_are_refused_on_every_rank_naming_the_difference(tmp_path, flag, says):
    done = _launch(tmp_path, "--zero", "2", flag)
    assert done.returncode != 0
    assert f"[rank0]: ValueError: " in done.output and f"[rank1]: ValueError: " in done.output, done.output[-4000:]
    assert says in done.output, done.output[-4000:]
    assert "SIGABRT" not in done.output and "differs in values" not in done.output
    if flag == "--path-differs":
        assert "ckpt-rank1/step_0002" in done.output and not (tmp_path / "ckpt" / "step_0002").exists()


# --------------------------------------------------------------------------- preemption


GRACE_S = 20  # fzero launch --grace in the preemption jobs
# The bounds below are the contract (the grace period; the collective timeout plus 5 s) with
# room for this loaded machine, where a rank's start or exit alone can take seconds.
LOAD_MARGIN_S = 15


def test_a_sigterm_to_the_launcher_saves_at_the_step_every_rank_agreed_on_and_the_next_launch_resumes_exactly(
        tmp_path, uninterrupted):
    _, reference, _ = uninterrupted
    started = time.time()
    # Rank 0 sends fzero launch a SIGTERM inside the backward pass of step 2 (after step_0002
    # committed): step 2 finishes on both ranks, and they save step_0003, off the schedule.
    done = _launch(tmp_path, "--zero", "3", "--fault", "term:rank=0:at=backward:step=2:to=launcher",
                   launcher=("--grace", str(GRACE_S)))
    assert done.returncode == 0, done.output[-4000:]
    assert _seconds_since_fault(tmp_path, started, done) < GRACE_S
    assert "fzero launch: SIGTERM: passed on to the ranks as SIGTERM (rank 0 (pid " in done.output, done.output[-4000:]
    assert "fzero.preempted: SIGTERM on ranks 0, 1: every rank stops after this step" in done.output
    for r in (0, 1):
        assert f"fault_job: rank {r}: preempted, saved step_0003 (attempt 0)" in done.output, done.output[-4000:]
    ckpt = tmp_path / "ckpt"
    assert fzero.checkpoint.latest(str(ckpt), verify=True) == str(ckpt / "step_0003")
    assert sorted(_curve(tmp_path)) == [0, 1, 2]

    again = _launch(tmp_path, "--zero", "3")
    assert again.returncode == 0, again.output[-4000:]
    assert "fault_job: resuming from step_0003 (attempt 0)" in again.output, again.output[-4000:]
    assert _curve(tmp_path) == reference  # bit for bit, as if never interrupted


def test_a_sigterm_to_one_rank_stops_every_rank_at_the_same_step_with_exit_0(tmp_path):
    done = _launch(tmp_path, "--zero", "2", "--fault", "term:rank=1:at=backward:step=2")
    assert done.returncode == 0, done.output[-4000:]
    assert "fzero.preempted: rank 1 received SIGTERM" in done.output
    assert "fzero.preempted: rank 0 received SIGTERM" not in done.output  # nothing told rank 0 but rank 1
    assert "fzero.preempted: SIGTERM on rank 1: every rank stops after this step" in done.output, done.output[-4000:]
    for r in (0, 1):
        assert f"fault_job: rank {r}: preempted, saved step_0003 (attempt 0)" in done.output, done.output[-4000:]
    ckpt = tmp_path / "ckpt"
    assert fzero.checkpoint.latest(str(ckpt), verify=True) == str(ckpt / "step_0003")
    assert fzero.checkpoint.manifest(str(ckpt / "step_0003"))["step"] == 3


def test_a_second_sigterm_during_the_save_exits_at_once_and_leaves_the_last_good_checkpoint(tmp_path):
    started = time.time()
    done = _launch(tmp_path, "--zero", "3", "--fault", "term:rank=0:at=backward:step=2:to=launcher:again=1",
                   launcher=("--grace", str(GRACE_S)))
    assert done.returncode != 0, done.output[-4000:]
    assert "fzero launch: a second SIGTERM: passed on to the ranks" in done.output, done.output[-4000:]
    for r in (0, 1):
        assert f"fzero.preempted: rank {r} received a second SIGTERM: exiting at once" in done.output
    assert done.output.count("exitcode  : 143") == 2, done.output[-4000:]  # 128 + SIGTERM, both ranks
    assert _seconds_since_fault(tmp_path, started, done) < GRACE_S  # at once: not the grace period
    ckpt = tmp_path / "ckpt"
    assert fzero.checkpoint.latest(str(ckpt), verify=True) == str(ckpt / "step_0002")
    assert not (ckpt / "step_0003").exists()  # only its hidden temporary directory, which latest() ignores


def test_ranks_that_outlast_the_grace_period_are_killed_and_the_launcher_says_so(tmp_path):
    started = time.time()
    done = _launch(tmp_path, "--zero", "3", "--fault", "term:rank=0:at=backward:step=2:to=launcher",
                   "--slow-preempt-save", "120", launcher=("--grace", "2"))
    assert done.returncode == 128 + signal.SIGTERM, done.output[-4000:]
    assert re.search(r"fzero launch: the ranks did not stop within the grace period of 2 s \(--grace\) after "
                     r"SIGTERM: killed rank 0 \(pid \d+\), rank 1 \(pid \d+\) \(SIGKILL\)", done.output), \
        done.output[-4000:]
    assert _seconds_since_fault(tmp_path, started, done) < 2 + LOAD_MARGIN_S
    ckpt = tmp_path / "ckpt"
    assert fzero.checkpoint.latest(str(ckpt), verify=True) == str(ckpt / "step_0002")


def test_a_stopped_rank_ends_the_job_within_the_timeout_plus_5_s_not_torchruns_30_s(tmp_path):
    started = time.time()
    done = _launch(tmp_path, "--zero", "3", "--fault", "stop:rank=1:at=backward:step=3")
    assert done.returncode != 0
    assert re.search(r"\(rank 1 \(its process \d+ is stopped\) did not arrive\)", done.output), done.output[-4000:]
    assert re.search(r"fzero launch: rank 1 \(pid \d+\) is stopped \(SIGSTOP\) and cannot act on the SIGTERM it "
                     r"was sent: killed it \(SIGKILL\)", done.output), done.output[-4000:]
    # Before: the timeout + torchrun's 30 s. The survivor's own exit and torchrun's count too.
    assert _seconds_since_fault(tmp_path, started, done) < TIMEOUT_S + 5 + LOAD_MARGIN_S


# --------------------------------------------------------------------------- one collective


def _stopped_peer(what: str) -> str:
    """Rank 1 stops itself (SIGSTOP); rank 0 waits for it in ``what``, and returns the error."""
    fzero.Mesh(dp=-1)  # starts the check-ins, as every program's mesh does
    store = dist.distributed_c10d._get_default_store()
    time.sleep(1.5)  # rank 1 has checked in once more: it is known alive before it stops
    if dist.get_rank() == 1:
        store.set("test/stopped", str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
    stopped = int(store.get("test/stopped"))
    try:
        if what == "collective":
            t = torch.ones(3)
            comm.run("all_reduce(the test's value)", lambda: comm.all_reduce(t, async_op=True), timeout_s=TIMEOUT_S,
                     where="test")
        else:
            fzero.checkpoint.save(os.path.join(what, "step_1"), {"w": torch.ones(2)}, timeout_s=TIMEOUT_S)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    finally:
        os.kill(stopped, signal.SIGKILL)  # the pool reports it dead at once, instead of hung
    return "no error"


@pytest.mark.parametrize("where", ["collective", "first save"])
def test_a_stopped_rank_is_named_by_the_rank_that_waited_for_it(tmp_path, where):
    arg = "collective" if where == "collective" else str(tmp_path)
    with pytest.raises(RankError) as info:
        run_ranks(2, _stopped_peer, arg, timeout_s=TIMEOUT_S + 20)
    said = info.value.results[0]
    assert said is not None, str(info.value)
    assert re.search(r"\(rank 1 \(its process \d+ is stopped\) did not arrive\)", said), said
    assert "on rank 0" in said, said
    if where == "collective":
        assert said.startswith("CollectiveError: test: collective all_reduce(the test's value)"), said
    else:  # the checkpoint's group is made on the first save: named, not a raw DistStoreError
        assert said.startswith(f"CollectiveError: fzero.checkpoint.save('{tmp_path}/step_1'): creating the "
                               "checkpoint's process group (dist.new_group"), said
    assert info.value.exit_codes == {1: -signal.SIGKILL}


def _all_reduce_error() -> str:
    """What this rank's all-reduce of three ones says when it fails ("no error" when not)."""
    t = torch.ones(3)
    try:
        comm.run("all_reduce(a)", lambda: comm.all_reduce(t, async_op=True), timeout_s=TIMEOUT_S, where="test")
    except Exception as e:  # noqa: BLE001
        return str(e)
    return "no error"


def _killed_peer() -> str:
    fzero.Mesh(dp=-1)
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)
    return _all_reduce_error()


def test_a_killed_rank_is_named_as_gone_by_the_rank_whose_collective_failed():
    with pytest.raises(RankError) as info:
        run_ranks(2, _killed_peer, timeout_s=TIMEOUT_S + 30)
    said = info.value.results[0]
    assert said is not None and said.startswith("test: collective all_reduce(a) "), str(info.value)
    assert re.search(r"\(rank 1 \(its process \d+ is gone\) did not arrive\)", said), said


def test_a_rank_on_another_host_is_named_by_the_age_of_its_last_check_in(monkeypatch):
    store = dist.HashStore()
    monkeypatch.setitem(checkin._STATE, "store", store)
    monkeypatch.setitem(checkin._STATE, "world", 3)
    monkeypatch.setitem(checkin._STATE, "rank", 0)
    now = time.time()
    store.set("fzero/checkin/1", json.dumps({"t": now - 10, "in": ["x"], "host": "elsewhere", "pid": 1}))
    store.set("fzero/checkin/2", json.dumps({"t": now, "in": ["all_gather(y)"], "host": "elsewhere", "pid": 1}))
    said = checkin.absent("x")
    assert re.fullmatch(r"rank 1 \(not heard from for 10\.\d s\) did not arrive; rank 2 \(waiting in all_gather\(y\)\) "
                        r"did not arrive: alive, elsewhere in the program", said), said
    store.set("fzero/checkin/1", json.dumps({"t": now, "in": ["x"], "host": "elsewhere", "pid": 1}))
    store.set("fzero/checkin/2", json.dumps({"t": now, "in": ["x"], "host": "elsewhere", "pid": 1}))
    assert checkin.absent("x") == ""  # everyone is there: nothing to name


def _alive_elsewhere() -> str:
    fzero.Mesh(dp=-1)
    if dist.get_rank() == 1:
        time.sleep(TIMEOUT_S + 2)  # alive, checking in, in its own code
        return "slept"
    return _all_reduce_error()


def test_a_rank_alive_in_its_own_code_is_named_as_elsewhere():
    said = run_ranks(2, _alive_elsewhere, timeout_s=TIMEOUT_S + 30)
    assert "(rank 1 (not in a collective) did not arrive: alive, elsewhere in the program)" in said[0], said[0]


def _watched_wait_on_stopped_peer(log: str) -> None:
    fzero.Mesh(dp=-1)
    store = dist.distributed_c10d._get_default_store()
    if dist.get_rank() == 1:
        store.set("test/stopped", "1")
        os.kill(os.getpid(), signal.SIGSTOP)
    store.get("test/stopped")
    os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT), 2)  # the watchdog's report goes to stderr
    t = torch.ones(3)
    with comm._watchdog_for_cpu():  # the GPU path: an untimed wait, ended by the watchdog
        comm.run("all_reduce(a)", lambda: comm.all_reduce(t, async_op=True), timeout_s=TIMEOUT_S, where="test")


def test_the_watchdog_report_names_a_stopped_rank_from_the_check_ins(tmp_path):
    log = tmp_path / "rank0.err"
    with pytest.raises(RankError) as info:
        run_ranks(2, _watched_wait_on_stopped_peer, str(log), timeout_s=TIMEOUT_S + 30)
    assert info.value.exit_codes.get(0) == watchdog.EXIT_CODE, str(info.value)
    report = log.read_text()
    assert "test: collective all_reduce(a) did not complete on rank 0 within 4 s" in report, report
    assert re.search(r"From the ranks' check-ins: rank 1 \(its process \d+ is stopped\) did not arrive\.", report), report
