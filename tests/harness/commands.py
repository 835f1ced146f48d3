"""Run a launcher command to its end or a timeout, and leave nothing it started behind.

``run_command(argv, timeout_s=)`` runs ``fzero launch`` / torchrun / any command with its
output captured to a file, and afterwards kills every process the command started (torchrun
starts ranks in sessions of their own, out of reach of a process-group kill): each process
inherits a tag in its environment, and :func:`reap` finds them by it in ``/proc``.

Test support, not installed with fzero: the tests that launch ranks through ``fzero launch``
or torchrun use it, and so does ``benchmarks/faults.py``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
import uuid
from typing import NamedTuple

__all__ = ["Command", "REAP_VAR", "reap", "run_command"]

#: The variable :func:`run_command` sets to a fresh tag in the environment of the command it
#: starts; every process the command starts inherits it, so :func:`reap` finds them all.
REAP_VAR = "FZERO_REAP_TAG"


class Command(NamedTuple):
    """What :func:`run_command` saw: the exit ``returncode`` (negative: killed by that
    signal; ``None`` when it timed out), stdout and stderr together as ``output``, the
    ``seconds`` it ran, and the ``reaped`` process ids it left behind and :func:`reap` killed."""

    returncode: int | None
    output: str
    seconds: float
    reaped: list[int]

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def _tagged(tag: str, var: str = REAP_VAR) -> list[int]:
    needle = f"{var}={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:  # gone, or not ours
            continue
    return found


def reap(tag: str, var: str = REAP_VAR) -> list[int]:
    """SIGKILL every process whose environment holds ``FZERO_REAP_TAG=tag`` (or ``var=tag``:
    a driver above run_command tags with a variable of its own, which run_command's inner
    tag does not overwrite); return their ids.

    torchrun starts each rank in a session of its own (``setsid``), out of reach of a kill
    of the launcher's process group, and a rank whose launcher died is re-parented away
    from it: the tag in the environment, inherited by every descendant, finds them all.
    Stopped (SIGSTOP) processes die too: SIGKILL needs no cooperation. Linux only (reads
    ``/proc``); elsewhere nothing is found.
    """
    if not os.path.isdir("/proc"):
        return []
    killed, empty = [], 0
    for _ in range(6):  # a process may fork while we look
        pids = _tagged(tag, var)
        if not pids:
            # A process caught between fork and exec shows no environment yet: only two
            # empty looks in a row mean none is left (one missed half the time under load).
            empty += 1
            if empty == 2:
                break
            time.sleep(0.02)
            continue
        empty = 0
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        time.sleep(0.05)
    return sorted(set(killed))


def run_command(argv: list[str], *, timeout_s: float, cwd: str | None = None,
                env: dict[str, str] | None = None) -> Command:
    """Run ``argv`` (a launcher: ``fzero launch``, torchrun) to its end or ``timeout_s``, then
    kill whatever it left running, ranks in sessions of their own included (:func:`reap`).

    Args:
        argv: the command.
        timeout_s: the longest it may run; past it the command and every process it started
            are killed and ``returncode`` is ``None``.
        cwd, env: as ``subprocess.Popen``'s (``env`` defaults to this process's).

    Returns:
        A :class:`Command`.

    Example:
        >>> done = run_command(["sh", "-c", "setsid sleep 60 & echo started"], timeout_s=10)
        >>> done.returncode, done.output, len(done.reaped), done.seconds < 10
        (0, 'started\\n', 1, True)
    """
    tag = uuid.uuid4().hex
    env = {**(os.environ if env is None else env), REAP_VAR: tag}
    t0 = time.monotonic()
    # Output to a file, not a pipe: a process left behind holding the pipe would keep a
    # reader waiting after the launcher itself ended.
    with tempfile.TemporaryFile("w+", errors="replace") as log:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            code = None
        except BaseException:  # pytest-timeout, Ctrl-C: leave nothing behind
            reap(tag)
            proc.kill()
            proc.wait()
            raise
        seconds = time.monotonic() - t0
        if code is None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
        reaped = reap(tag)
        proc.wait()
        log.seek(0)
        return Command(code, log.read(), seconds, reaped)
