"""How ``fzero launch`` runs torchrun on this machine: signals go to the ranks, with a grace period,
and a stopped rank is killed rather than waited for.

Preemption. A SIGTERM (or SIGHUP) to ``fzero launch`` is passed to every rank as SIGTERM,
not to torchrun: torchrun would stop the ranks itself and report the job failed even when
they all saved and exited 0. The ranks (whose loop asks :func:`fzero.preempted`) finish the
step, save and exit 0; torchrun sees a group that succeeded and exits 0. The launcher gives
them ``--grace`` seconds from the first signal; past it, it kills them (SIGKILL), says so,
and exits 128 + 15. A second signal is passed on too (the ranks then exit at once), unless
it comes within ``REPEAT_S`` of the first: a scheduler that signals every process reaches
the launcher through each process above it too (``timeout``, a shell), and the ranks take
such repeats for the same request.

Stopped ranks. When a rank fails, torchrun stops the others with SIGTERM and waits a fixed
30 s before SIGKILL (its ``_stop_workers`` ignores ``--shutdown-timeout``). A rank stopped
by SIGSTOP (or a debugger's stop) cannot act on the SIGTERM, so every such job took 30 s
more than the collective timeout to end. The launcher polls the ranks every
:data:`POLL_S`; one that is stopped with a SIGTERM pending is killed at once, and named.

The ranks are found as torchrun's child processes in ``/proc`` (their ``RANK`` read from
their environment). Where there is no ``/proc``, signals go to torchrun as before.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import time

from fzero._signals import REPEAT_S

__all__ = ["DEFAULT_GRACE_S", "POLL_S", "Supervisor", "agent_env", "supervise"]

#: Seconds the ranks get to save and stop after a SIGTERM: Kubernetes' default
#: ``terminationGracePeriodSeconds`` and a GCP spot VM's notice.
DEFAULT_GRACE_S = 30.0
#: How often the ranks are looked at (stopped ranks, the grace period).
POLL_S = 0.2
_KILL_WAIT_S = 5.0  # after killing the ranks, how long torchrun gets to notice and exit
_SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def _exit_code(rc: int) -> int:
    return 128 - rc if rc < 0 else rc  # killed by signal s -> 128+s, as a shell reports it


class _Rank:
    __slots__ = ("pid", "rank")

    def __init__(self, pid: int, rank: str):
        self.pid, self.rank = pid, rank

    def __str__(self) -> str:
        return f"rank {self.rank} (pid {self.pid})"


def _child_pids(pid: int) -> set[int]:
    """The processes whose parent is ``pid``: from its threads' ``children`` files, else by
    reading every process's parent in ``/proc``."""
    pids: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:  # torchrun is gone
        return pids
    try:
        for t in tasks:
            with contextlib.suppress(ProcessLookupError), open(f"/proc/{pid}/task/{t}/children") as f:
                pids.update(int(x) for x in f.read().split())
        return pids
    except FileNotFoundError:  # a kernel without CONFIG_PROC_CHILDREN
        pass
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
            if int(stat[stat.rindex(b")") + 2:].split()[1]) == pid:
                pids.add(int(entry))
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return pids


def _rank_of(pid: int) -> str:
    """The ``RANK`` in the environment of process ``pid`` ("?" when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for var in f.read().split(b"\0"):
                if var.startswith(b"RANK="):
                    return var[5:].decode(errors="replace")
    except OSError:
        pass
    return "?"


def _stopped_with_sigterm(pid: int) -> bool:
    """Whether ``pid`` is stopped (state T) with a SIGTERM pending: it cannot act on it."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return False
    if not fields.get("State", "").strip().startswith("T"):
        return False
    pending = 0
    for key in ("SigPnd", "ShdPnd"):
        with contextlib.suppress(ValueError):
            pending |= int(fields.get(key, "0").strip(), 16)
    return bool(pending & _SIGTERM_BIT)


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, sig)


def _say(text: str) -> None:
    print(f"fzero launch: {text}", file=sys.stderr, flush=True)


class Supervisor:
    """Watches one torchrun agent and its ranks (see the module docstring): :func:`supervise`'s
    one, and each of an elastic job's agents on this host (``_elastic.run``)."""

    def __init__(self, proc: subprocess.Popen, grace_s: float):
        self.proc, self.grace_s = proc, grace_s
        self.first: float | None = None  # when the first signal came
        self.deadline: float | None = None  # set by the first signal
        self.killed = False  # the grace period ran out and the ranks were killed
        self.reported: set[int] = set()
        self.names: dict[int, _Rank] = {}

    def ranks(self) -> list[_Rank] | None:
        """torchrun's ranks now, or ``None`` without ``/proc``."""
        if not os.path.isdir("/proc"):
            return None
        out = []
        for pid in _child_pids(self.proc.pid):
            if pid not in self.names or self.names[pid].rank == "?":
                # (Between fork and exec a rank still shows torchrun's environment: no RANK yet.)
                self.names[pid] = _Rank(pid, _rank_of(pid))
            out.append(self.names[pid])
        return sorted(out, key=lambda r: (r.rank, r.pid))

    def on_signal(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self.first is not None and now - self.first <= REPEAT_S:
            return  # the same request again
        ranks = self.ranks()
        if ranks is None:  # no /proc: torchrun stops the ranks, as it does on its own
            self.proc.send_signal(signum)
            return
        for r in ranks:
            _kill(r.pid, signal.SIGTERM)
        listed = ", ".join(map(str, ranks)) or "none running"
        if self.deadline is None:
            self.first, self.deadline = now, now + self.grace_s
            _say(f"{name}: passed on to the ranks as SIGTERM ({listed}); they save and stop within the grace period "
                 f"of {self.grace_s:g} s (--grace), or are killed")
        else:
            left = max(self.deadline - time.monotonic(), 0.0)
            _say(f"a second {name}: passed on to the ranks ({listed}), which exit at once; {left:.1f} s of the "
                 "grace period were left")

    def poll(self) -> None:
        ranks = self.ranks() or []
        for r in ranks:
            if r.pid not in self.reported and _stopped_with_sigterm(r.pid):
                self.reported.add(r.pid)
                _kill(r.pid, signal.SIGKILL)
                _say(f"{r} is stopped (SIGSTOP) and cannot act on the SIGTERM it was sent: killed it (SIGKILL) "
                     "instead of waiting for torchrun's 30 s")
        if self.deadline is not None and not self.killed and time.monotonic() > self.deadline:
            self.killed = True
            for r in ranks:
                _kill(r.pid, signal.SIGKILL)
            _say(f"the ranks did not stop within the grace period of {self.grace_s:g} s (--grace) after SIGTERM: "
                 f"killed {', '.join(map(str, ranks)) or 'nothing (none was left)'} (SIGKILL)")
            try:
                self.proc.wait(_KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def agent_env(env: dict[str, str], grace_s: float) -> dict[str, str]:
    """A torchrun agent's environment: if torchrun itself is signalled too (a scheduler
    signalling every process), its own wait for the ranks is the grace period rather than
    its 30 s."""
    return {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(max(math.ceil(grace_s), 1)), **env}


def supervise(argv: list[str], env: dict[str, str], *, grace_s: float = DEFAULT_GRACE_S) -> int:
    """Run one torchrun agent (``argv``) to its end; return its exit code (128 + s when it was
    killed by signal s, 128 + 15 when the ranks were killed past the grace period).

    A SIGTERM or SIGHUP reaches every rank as SIGTERM, and the ranks get ``grace_s`` seconds
    to stop; a rank that is stopped (SIGSTOP) when it is sent SIGTERM is killed at once.
    Ctrl-C (SIGINT) goes to torchrun.
    """
    proc = subprocess.Popen(argv, env=agent_env(env, grace_s))
    sup = Supervisor(proc, grace_s)
    old = {}
    for s in (signal.SIGTERM, signal.SIGHUP):
        try:
            old[s] = signal.signal(s, sup.on_signal)
        except ValueError:  # not the main thread: signals stay as they are
            pass
    try:
        while True:
            try:
                rc = proc.wait(POLL_S)
            except subprocess.TimeoutExpired:
                sup.poll()
                continue
            except KeyboardInterrupt:
                proc.send_signal(signal.SIGINT)
                continue
            return 128 + signal.SIGTERM if sup.killed else _exit_code(rc)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
