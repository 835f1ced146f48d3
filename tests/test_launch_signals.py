"""How ``fzero launch`` runs its torchrun agent (``fzero/cli/_signals.py``), with a stand-in agent:
a Python process that starts "ranks" (child processes) and reports what they did.

The whole jobs (torchrun and real ranks) are in tests/test_faults.py; here each case takes
about a second.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from fzero.cli import _signals, launch
from fzero.cli.main import build_parser

# The agent stand-in: starts the ranks given as Python snippets (each with RANK=i and OUT in
# its environment), writes their pids to OUT/pids once each has said it is ready (OUT/readyI,
# written by READY) or ended, waits for them, writes their exit codes to OUT/codes and notes
# any signal it got itself in OUT/agent (as torchrun's handler would act on it).
AGENT = r"""
import os, signal, subprocess, sys, time
out, ranks = sys.argv[1], sys.argv[2:]
signal.signal(signal.SIGTERM, lambda s, f: open(os.path.join(out, "agent"), "a").write("SIGTERM\n"))
procs = [subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "RANK": str(i), "OUT": out})
         for i, code in enumerate(ranks)]
for i, p in enumerate(procs):
    while p.poll() is None and not os.path.exists(os.path.join(out, f"ready{i}")):
        time.sleep(0.02)
with open(os.path.join(out, "pids.tmp"), "w") as f:
    f.write(" ".join(str(p.pid) for p in procs))
os.rename(os.path.join(out, "pids.tmp"), os.path.join(out, "pids"))
codes = []
for p in procs:
    while True:
        try:
            codes.append(p.wait())
            break
        except InterruptedError:
            continue
open(os.path.join(out, "codes"), "w").write(" ".join(map(str, codes)))
"""
READY = "import os; open(os.path.join(os.environ['OUT'], 'ready' + os.environ['RANK']), 'w').close()\n"
SAVES_ON_SIGTERM = ("import signal, sys, time\n"
                    "signal.signal(signal.SIGTERM, lambda s, f: sys.exit(0))\n"
                    + READY + "time.sleep(60)\n")
IGNORES_SIGTERM = ("import signal, time\n"
                   "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                   + READY + "time.sleep(60)\n")


def _pids(out: Path, timeout_s: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while not (out / "pids").exists():
        assert time.monotonic() < deadline, "the stand-in agent did not start its ranks"
        time.sleep(0.05)
    return [int(x) for x in (out / "pids").read_text().split()]


def _after_start(out: Path, act) -> threading.Thread:
    t = threading.Thread(target=lambda: act(_pids(out)), daemon=True)
    t.start()
    return t


def _twice(pids):
    # Two signals within REPEAT_S, as when a scheduler signals every process of the job and
    # one reaches the launcher through a process above it as well: one request.
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)


def test_a_sigterm_reaches_the_ranks_not_the_agent_and_ranks_past_the_grace_period_are_killed(tmp_path, capsys):
    # The signal is sent to this process once supervise() has put its handler in place
    # (the ranks exist only after it started the agent).
    _after_start(tmp_path, _twice)
    t0 = time.monotonic()
    code = _signals.supervise([sys.executable, "-c", AGENT, str(tmp_path), SAVES_ON_SIGTERM, IGNORES_SIGTERM],
                              dict(os.environ), grace_s=1.0)
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGTERM, err
    assert not (tmp_path / "agent").exists()  # the agent (torchrun) was not signalled
    # Rank 0 stopped on the SIGTERM (exit 0); rank 1 ignored it and was killed past the grace period.
    assert (tmp_path / "codes").read_text() == f"0 {-signal.SIGKILL}"
    pids = _pids(tmp_path)
    assert (f"fzero launch: SIGTERM: passed on to the ranks as SIGTERM (rank 0 (pid {pids[0]}), "
            f"rank 1 (pid {pids[1]})); "
            "they save and stop within the grace period of 1 s (--grace), or are killed") in err, err
    assert (f"fzero launch: the ranks did not stop within the grace period of 1 s (--grace) after SIGTERM: killed "
            f"rank 1 (pid {pids[1]}) (SIGKILL)") in err, err
    assert "a second SIGTERM" not in err and err.count("passed on to the ranks") == 1, err
    assert took < 30, took  # the agent's 60 s sleepers were not waited for
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # this process's handler is put back


def test_ranks_that_stop_on_sigterm_within_the_grace_period_give_the_agents_exit_code(tmp_path, capsys):
    _after_start(tmp_path, lambda pids: os.kill(os.getpid(), signal.SIGTERM))
    code = _signals.supervise([sys.executable, "-c", AGENT, str(tmp_path), SAVES_ON_SIGTERM, SAVES_ON_SIGTERM],
                              dict(os.environ), grace_s=60.0)
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "codes").read_text() == "0 0"
    assert "did not stop within" not in capsys.readouterr().err


def test_a_rank_stopped_when_it_is_sent_sigterm_is_killed_at_once_and_named(tmp_path, capsys):
    def stop_then_term(pids):
        os.kill(pids[1], signal.SIGSTOP)
        time.sleep(0.3)
        os.kill(pids[1], signal.SIGTERM)  # what torchrun does to the others when a rank fails
    _after_start(tmp_path, stop_then_term)
    t0 = time.monotonic()
    code = _signals.supervise([sys.executable, "-c", AGENT, str(tmp_path), "import sys; sys.exit(0)",
                               SAVES_ON_SIGTERM], dict(os.environ))
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == 0, err  # the stand-in agent reports what its ranks did; it exits 0
    assert (tmp_path / "codes").read_text() == f"0 {-signal.SIGKILL}"
    pid = _pids(tmp_path)[1]
    assert (f"fzero launch: rank 1 (pid {pid}) is stopped (SIGSTOP) and cannot act on the SIGTERM it was sent: "
            "killed it (SIGKILL) instead of waiting for torchrun's 30 s") in err, err
    assert took < 30, took


def test_a_rank_stopped_without_a_sigterm_is_left_alone(tmp_path, capsys):
    # A stop alone (a debugger, a job-control stop) is not a failure: nothing is killed.
    def stop_then_continue(pids):
        os.kill(pids[0], signal.SIGSTOP)
        time.sleep(3 * _signals.POLL_S)
        os.kill(pids[0], signal.SIGCONT)
    _after_start(tmp_path, stop_then_continue)
    code = _signals.supervise([sys.executable, "-c", AGENT, str(tmp_path),
                               READY + "import time; time.sleep(2)"], dict(os.environ))
    assert code == 0
    assert (tmp_path / "codes").read_text() == "0"
    assert "killed" not in capsys.readouterr().err


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_negative_grace_is_refused_naming_the_option(value):
    args = build_parser().parse_args(["launch", "--nproc", "1", "--grace", value, "t.py"])
    with pytest.raises(launch.LaunchError, match=rf"--grace must be >= 0 seconds, got {value}"):
        launch.plan(args, env={})


def test_an_elastic_jobs_agents_are_supervised_as_one_agent_is(tmp_path, capsys):
    """``fzero launch --nproc-min``'s agents (here two stand-ins of one rank each): a SIGTERM
    reaches the ranks, not the agents; a rank that saves exits 0, one that ignores it is
    killed past ``--grace`` and the launcher exits 128 + SIGTERM, without waiting for it."""
    import argparse
    from types import SimpleNamespace

    from fzero.cli import _elastic

    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        out.mkdir()
    script = tmp_path / "train.py"
    script.write_text("")
    ranks = [SAVES_ON_SIGTERM, IGNORES_SIGTERM]
    nodes = [SimpleNamespace(argv=[sys.executable, "-c", AGENT, str(out), code], env={}, nproc=1)
             for out, code in zip(outs, ranks)]
    plan = SimpleNamespace(nodes=nodes, host_store=False, master_addr="127.0.0.1", master_port=0, min_nodes=1,
                           max_nodes=2, join=["fzero", "launch", "..."])
    args = argparse.Namespace(dry_run=False, script=str(script), grace=1.0)

    def signal_once_both_started():
        for out in outs:
            _pids(out)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=signal_once_both_started, daemon=True).start()
    t0 = time.monotonic()
    code = _elastic.run(plan, args, parser=None)
    took = time.monotonic() - t0
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGTERM, err
    assert not any((out / "agent").exists() for out in outs), err  # no agent was signalled
    assert (outs[0] / "codes").read_text() == "0" and (outs[1] / "codes").read_text() == str(-signal.SIGKILL), err
    pid = _pids(outs[1])[0]
    # (Each stand-in numbers its own ranks from 0.)
    assert (f"the ranks did not stop within the grace period of 1 s (--grace) after SIGTERM: killed rank 0 "
            f"(pid {pid}) (SIGKILL)") in err, err
    assert took < 30, took
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
