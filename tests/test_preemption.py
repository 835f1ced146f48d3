"""``fzero.preempted()`` in one process: what a SIGTERM does once the loop has asked.

On real ranks under ``fzero launch`` (every rank stopping at the same step, the checkpoint,
the resume, the grace period): tests/test_faults.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import fzero

PROGRAM = r"""
import os, signal, sys, time
import fzero

def say(*a):
    print(*a, flush=True)

say("before", fzero.preempted())
os.kill(os.getpid(), signal.SIGTERM)
say("after one", fzero.preempted())
os.kill(os.getpid(), signal.SIGTERM)  # at once: the same request (a scheduler signalling twice)
say("after a repeat", fzero.preempted())
time.sleep(1.5)  # past REPEAT_S: a second request
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(5)
say("not reached")
"""


def test_a_sigterm_is_noted_for_the_loop_and_a_second_one_a_second_later_exits_at_once():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(fzero.__file__).parents[1]),
                                                         os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines() == ["before False", "after one True", "after a repeat True"], done
    assert done.returncode == 128 + signal.SIGTERM, done
    assert "fzero.preempted: rank 0 received SIGTERM: the ranks save and stop at the end of this step" in done.stderr
    assert done.stderr.count("received SIGTERM") == 1  # the repeat within REPEAT_S said nothing
    assert "fzero.preempted: rank 0 received a second SIGTERM: exiting at once" in done.stderr, done.stderr


def test_the_first_call_installs_the_handler_and_uninstall_puts_the_previous_one_back():
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert fzero.preempted() is False
        assert signal.getsignal(signal.SIGTERM) is not before  # the first call installed the handler
    finally:
        fzero.distributed.preemption.uninstall()
    assert signal.getsignal(signal.SIGTERM) is before
