"""The watchdog of collectives waited on without a timeout (``fzero.distributed.watchdog``),
and the wait paths of ``comm`` and ``p2p``: a collective of device tensors is waited on
without a timeout and watched; one of CPU tensors keeps its timed wait (that path's hang is
tests/test_zero.py's ``test_a_collective_that_never_completes_times_out_with_its_name``).

The device path is exercised on gloo under ``comm._watchdog_for_cpu()``. A hang there ends
the process, so the hanging job runs under torchrun in a subprocess with a hard timeout.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fzero.distributed import comm, p2p, watchdog
from harness.commands import run_command

ROOT = Path(__file__).resolve().parent.parent


def multirank(test):
    """Spawns real ranks: left out of ``make test-fast``."""
    return pytest.mark.slow(pytest.mark.multirank(test))


class _Work:
    """A stand-in for a ``torch.distributed`` work: completes when told to; counts polls."""

    def __init__(self):
        self.done, self.polls = False, 0

    def is_completed(self):
        self.polls += 1
        return self.done


def _until(cond, *, limit_s=30.0):
    """Wait for ``cond()`` (a hang guard, not a timing assertion)."""
    end = time.monotonic() + limit_s
    while not cond():
        if time.monotonic() > end:
            pytest.fail(f"the watchdog did not get there within {limit_s} s")
        time.sleep(0.02)


# --------------------------------------------------------------------------- one process


def test_the_watchdog_drops_completed_works_and_sleeps_while_none_is_outstanding():
    wd = watchdog.Watchdog()
    try:
        work = _Work()
        wd.watch("collective all_reduce(loss)", work, where="test", timeout_s=600)
        assert wd.outstanding()[0].startswith("test: collective all_reduce(loss) (outstanding for ")
        work.done = True
        _until(lambda: not wd.outstanding())
        polls = work.polls
        time.sleep(4 * watchdog.POLL_S)
        assert work.polls == polls  # nothing outstanding: nothing polled
        again = _Work()
        wd.watch("collective all_reduce(loss)", again, where="test", timeout_s=600)  # wakes the sleeping thread
        _until(lambda: again.polls > 0)
    finally:
        wd.stop()


def test_a_work_past_its_deadline_is_reported_with_its_name_rank_timeout_and_the_others_outstanding(monkeypatch):
    reports = []
    monkeypatch.setattr(watchdog, "_end_process", reports.append)  # instead of ending this process
    wd = watchdog.Watchdog()
    try:
        wd.watch("collective all_gather(parameter group 2, 64 elements)", _Work(), where="fzero.shard_state",
                 timeout_s=600)
        wd.watch("collective reduce_scatter(gradient group 0, 64 elements)", _Work(), where="fzero.shard_state",
                 timeout_s=7, since=time.monotonic() - 8)  # launched 8 s ago
        _until(lambda: reports)
    finally:
        wd.stop()
    report = reports[0]
    first, rest = report.split("\n", 1)
    assert first.startswith("fzero.shard_state: collective reduce_scatter(gradient group 0, 64 elements) did not "
                            "complete on rank 0 within 7 s"), report
    assert f"exit code {watchdog.EXIT_CODE}" in first, report
    assert "Still outstanding on rank 0" in rest and "all_gather(parameter group 2, 64 elements)" in rest, report
    assert "The main thread is at" in rest, report
    assert len(reports) == 1  # it reports once: the process ends there


def test_a_stopped_watchdog_ends_its_thread_and_watches_nothing_more():
    wd = watchdog.Watchdog()
    wd.watch("collective x", _Work(), where="test", timeout_s=600)
    thread = wd._thread
    wd.stop()
    assert not thread.is_alive()
    wd.watch("collective y", _Work(), where="test", timeout_s=0)
    assert not any("collective y" in d for d in wd.outstanding()) and wd._thread is thread


# --------------------------------------------------------------------------- real ranks


def _paths():
    """On 2 gloo ranks: which path each wait takes, and that the untimed one completes."""
    t = torch.full((3,), float(dist.get_rank() + 1))
    timed = comm.start("all_reduce(a test's value)", lambda: comm.all_reduce(t, async_op=True))
    by_hand = comm.start("all_reduce(by hand)", lambda: dist.all_reduce(torch.zeros(1), async_op=True))
    out = [timed.device, by_hand.device, comm._watched(timed.device), comm._watched(by_hand.device)]
    timed.wait(60)
    by_hand.wait(60)
    with comm._watchdog_for_cpu():
        out.append(comm._watched(timed.device))
        comm.run("all_reduce(a test's value, watched)", lambda: comm.all_reduce(t, async_op=True), timeout_s=60)
        buf = torch.zeros(2)
        channel = p2p.Channel(dist.group.WORLD, timeout_s=60, where="test")
        if dist.get_rank() == 0:
            channel.isend(torch.arange(2.0), 1, "a test's tensor")
            channel.flush()
        else:
            channel.recv(buf, 0, "a test's tensor")
    _until(lambda: not watchdog.outstanding())
    return out, t.tolist(), buf.tolist()


@multirank
def test_cpu_collectives_keep_the_timed_wait_and_watched_ones_complete_and_leave_the_watchdog(ranks):
    for rank, (paths, summed, received) in enumerate(ranks(2).run(_paths)):
        # the device is read from the tensor the helper handed to torch; a collective started
        # without the helpers keeps the timed wait
        assert paths == ["cpu", None, False, False, True], paths
        assert summed == [6.0] * 3  # (1 + 2), then doubled by the watched all-reduce
        assert received == ([0.0, 0.0] if rank == 0 else [0.0, 1.0])


HANG = """
import datetime, sys, time
import torch, torch.distributed as dist
from fzero.distributed import comm, p2p

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))  # far beyond the job's timeout
if dist.get_rank() == 1:
    time.sleep(600)  # never joins: only rank 0's watchdog can end the job
with comm._watchdog_for_cpu():
    if sys.argv[1] == "collective":
        t = torch.ones(3)
        comm.run("all_reduce(a test's value)", lambda: comm.all_reduce(t, async_op=True), timeout_s=3,
                 where="test")
    else:
        channel = p2p.Channel(dist.group.WORLD, timeout_s=3, where="test")
        channel.recv(torch.empty(3), 1, "the activation of micro-batch 0")
print("not reached", flush=True)
"""


@multirank
@pytest.mark.parametrize("kind", ["collective", "receive"])
def test_a_watched_wait_that_never_completes_ends_the_process_naming_it(tmp_path, kind):
    script = tmp_path / "hang.py"
    script.write_text(HANG)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), kind]
    done = run_command(cmd, env=env, timeout_s=3 + 170)  # the timeout, plus starting two ranks on a busy machine
    out = done.output
    if done.timed_out:
        pytest.fail(f"the job did not end: the watchdog did not end rank 0\n{out}")
    assert done.returncode != 0 and "not reached" not in out, out
    what = ("collective all_reduce(a test's value)" if kind == "collective"
            else "receive of the activation of micro-batch 0 from rank 1")
    assert f"test: {what} did not complete on rank 0 within 3 s" in out, out
    assert f"exitcode  : {watchdog.EXIT_CODE}" in out, out  # torchrun's summary of rank 0
