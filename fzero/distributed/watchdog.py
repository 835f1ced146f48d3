"""A watchdog for collectives waited on without a timeout: a hang on a GPU still ends with
the collective's name, the rank and the timeout.

Why: on NCCL, ``Work.wait(timeout)`` blocks the host thread until the collective completes
(torch documents it; measured on our GPU machines), while ``Work.wait()`` only makes the
current CUDA stream wait for it, and the host goes on launching the kernels the collective
is meant to overlap. So fzero waits on collectives of device tensors without a timeout
(:class:`fzero.distributed.comm.Pending`, :class:`fzero.distributed.p2p.Channel`) and hands
each to this watchdog, which keeps what the timeout gave: a hang that says what hung.

One daemon thread per process holds the outstanding works (what, where, the rank, the
deadline), polls ``work.is_completed()`` every :data:`POLL_S` (on NCCL a query of a CUDA
event: microseconds), drops the completed ones, and sleeps while none is outstanding. When
one is still outstanding past its deadline it writes on stderr what did not complete, on
which rank, within which timeout, every other collective still outstanding and where the
main thread is, and ends the process with :data:`EXIT_CODE`. It cannot raise instead: the
main thread may be blocked inside CUDA (a synchronisation behind the hung collective),
where no exception reaches it. An abrupt exit is what NCCL's own watchdog does too; torchrun
then stops the other ranks.

The thread is stopped by an ``atexit`` hook, so it runs no Python code while the interpreter
tears down, and a forked child starts with no watchdog (and a fresh one on its first watch).

On the CPU (gloo) a wait blocks the host anyway, and a timed wait raises a
:class:`~fzero.distributed.comm.CollectiveError` the program can catch: collectives there do
not come here (but in tests, under ``comm._watchdog_for_cpu()``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import traceback

import torch.distributed as dist

__all__ = ["EXIT_CODE", "POLL_S", "Watchdog", "outstanding", "watch"]

#: How often outstanding works are polled: a hang is reported at most this late.
POLL_S = 0.25
#: The exit status of a process the watchdog ends: ``timeout(1)``'s, "timed out".
EXIT_CODE = 124


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class _Entry:
    __slots__ = ("what", "where", "rank", "timeout_s", "since", "work")

    def __init__(self, what, where, rank, timeout_s, since, work):
        self.what, self.where, self.rank, self.timeout_s, self.since, self.work = (
            what, where, rank, timeout_s, since, work)

    @property
    def deadline(self) -> float:
        return self.since + self.timeout_s

    def describe(self, now: float) -> str:
        return f"{self.where}: {self.what} (outstanding for {now - self.since:.1f} s, timeout {self.timeout_s:g} s)"


def _completed(work) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001  (a failed work: its waiter sees the error; nothing to watch)
        return True


def _end_process(report: str) -> None:
    """Write ``report`` on stderr and end the process at once (no cleanup: the main thread
    may hold locks inside CUDA or NCCL that a cleanup would wait on)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    try:
        sys.stderr.write(report + "\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001  (a closed or replaced stderr: the file descriptor still works)
        with contextlib.suppress(OSError):
            os.write(2, (report + "\n").encode(errors="replace"))
    os._exit(EXIT_CODE)


class Watchdog:
    """Watches works until they complete; ends the process when one is past its deadline.

    The process has one (:func:`watch`); tests make their own.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._entries: list[_Entry] = []
        self._thread: threading.Thread | None = None
        self._stopped = False

    def watch(self, what: str, work, *, where: str, timeout_s: float, since: float | None = None) -> None:
        """Watch ``work`` (a ``torch.distributed`` work) until ``work.is_completed()``.

        Args:
            what: what it is, for the report (``"collective all_reduce(loss)"``).
            where: the public function to name (``"fzero.shard_state"``).
            timeout_s: how long it may stay outstanding.
            since: when it started (``time.monotonic()``; default now): the timeout counts
                from there, as NCCL's own watchdog counts from a collective's launch.
        """
        since = time.monotonic() if since is None else since
        entry = _Entry(what, where, _rank(), float(timeout_s), since, work)
        with self._cond:
            if self._stopped:  # the interpreter is exiting
                return
            self._entries.append(entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="fzero-watchdog", daemon=True)
                self._thread.start()
            elif len(self._entries) == 1:
                self._cond.notify()  # it sleeps without a timeout while nothing is outstanding

    def outstanding(self) -> list[str]:
        """What is watched now and not yet seen completed, oldest first."""
        now = time.monotonic()
        with self._cond:
            return [e.describe(now) for e in self._entries]

    def stop(self) -> None:
        """Stop the thread (and watch nothing more); waits for it to return."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10 * POLL_S)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._entries and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                entries = list(self._entries)
            # Polled outside the lock: waits on other threads keep registering meanwhile.
            done = {id(e) for e in entries if _completed(e.work)}
            now = time.monotonic()
            with self._cond:
                if self._stopped:
                    return
                self._entries = [e for e in self._entries if id(e) not in done]
                late = [e for e in entries if id(e) not in done and e.deadline <= now]
                if late:
                    first = min(late, key=lambda e: e.deadline)
                    _end_process(self._report(first, [e for e in self._entries if e is not first], now))
                    return
                self._cond.wait(POLL_S)

    @staticmethod
    def _report(late: _Entry, others: list[_Entry], now: float) -> str:
        lines = [f"{late.where}: {late.what} did not complete on rank {late.rank} within {late.timeout_s:g} s "
                 f"(a rank may have died or taken another path). fzero's watchdog ends this process with exit "
                 f"code {EXIT_CODE}: its wait had no timeout, so that the host could go on launching work, and the "
                 f"main thread may be blocked inside CUDA, where no exception reaches it."]
        if others:
            lines.append(f"Still outstanding on rank {late.rank}, oldest first:")
            lines += [f"  {e.describe(now)}" for e in others]
        else:
            lines.append(f"Nothing else is outstanding on rank {late.rank}.")
        from fzero.distributed import checkin  # the ranks' check-ins in the store

        with contextlib.suppress(Exception):
            if found := checkin.absent(late.what, silent_only=True):
                lines.append(f"From the ranks' check-ins: {found}.")
        frame = sys._current_frames().get(threading.main_thread().ident)
        if frame is not None:
            lines.append("The main thread is at (most recent call last):")
            lines += [ln.rstrip("\n") for ln in traceback.format_stack(frame)]
        return "\n".join(lines)


_WATCHDOG = Watchdog()


def watch(what: str, work, *, where: str, timeout_s: float, since: float | None = None) -> None:
    """Watch ``work`` with this process's watchdog (see :meth:`Watchdog.watch`)."""
    _WATCHDOG.watch(what, work, where=where, timeout_s=timeout_s, since=since)


def outstanding() -> list[str]:
    """What this process's watchdog watches now (see :meth:`Watchdog.outstanding`)."""
    return _WATCHDOG.outstanding()


def _stop() -> None:
    _WATCHDOG.stop()


def _after_fork_in_child() -> None:
    # The parent's thread does not exist here, and its lock may have been held at the fork.
    global _WATCHDOG
    _WATCHDOG = Watchdog()


atexit.register(_stop)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
