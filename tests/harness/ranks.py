"""Run a function on N real ``torch.distributed`` ranks: the multi-rank test harness.

A :class:`RankPool` spawns ``world_size`` processes once, joins them into a gloo process
group, and then runs many jobs in them: ``pool.run(fn, *args)`` calls ``fn(*args)`` on
every rank and returns the results in rank order. Starting the ranks costs seconds
(each imports torch); a job costs milliseconds, so a test suite starts its pools once per
session (the ``ranks`` fixture in ``tests/conftest.py``) and runs every case in
them.

Failures never hang the caller and always name the rank:

* a rank that raises gives :class:`RankError`, holding every failing rank's traceback, each
  line prefixed with ``rank r:``, and the Python stack of any rank still stuck (say in a
  collective waiting for the rank that raised);
* a rank that does not answer in time gives :class:`RankTimeout`, naming the ranks that
  answered and the ranks that hung, with each hung rank's current stack (dumped by
  ``faulthandler`` on ``SIGUSR1``, so it works even inside a blocking gloo call);
* a rank process that dies (``os._exit``, a signal, a segfault) is reported with its exit
  code.

After any failure the ranks are killed and started afresh on the next ``run``: a
collective that half happened leaves the process group in a state no later job should
inherit.

``fn`` travels by reference (pickled by its qualified name), so it must be a module-level
function or a ``functools.partial`` of one; test modules under ``tests/`` are importable in
the ranks because the parent's ``sys.path`` (and so ``tests/``) is handed down. Arguments
and results are pickled; CPU tensors are fine. Inside ``fn``, :func:`current` gives the
rank and world size (``torch.distributed.get_rank()`` works too).

Example (skipped as a doctest: the suite's fast run starts no ranks, and
``tests/test_multirank.py`` runs it):
    >>> import torch.distributed as dist
    >>> from harness.ranks import run_ranks
    >>> run_ranks(2, dist.get_world_size)  # doctest: +SKIP
    [2, 2]

Test support, not installed with fzero: it lives in ``tests/harness/`` and is imported as
``harness.ranks`` (pytest puts ``tests/`` on ``sys.path``). It imports only the standard
library at import time; torch.distributed is imported when a pool starts.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import multiprocessing
import multiprocessing.connection as mpc
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections import OrderedDict
from typing import Any, Callable, Literal, NamedTuple

__all__ = ["RankError", "RankInfo", "RankPool", "RankPools", "RankTimeout", "current", "run_ranks"]

# How long a hung rank gets to write its stack after SIGUSR1, and how long a graceful stop
# waits for a rank to exit before it is killed.
_DUMP_WAIT_S = 2.0
_STOP_WAIT_S = 5.0


class RankInfo(NamedTuple):
    """Where the calling job runs: its ``rank`` in a world of ``world_size`` ranks."""

    rank: int
    world_size: int


_CURRENT: RankInfo | None = None


def current() -> RankInfo:
    """The rank and world size of the pool rank this job runs on.

    Raises:
        RuntimeError: called outside a job started by :meth:`RankPool.run`.
    """
    if _CURRENT is None:
        raise RuntimeError(
            "harness.ranks.current: not running on a RankPool rank; call it from a "
            "function passed to RankPool.run or run_ranks"
        )
    return _CURRENT


class RankError(RuntimeError):
    """One or more ranks of a :class:`RankPool` job failed.

    Attributes:
        failures: rank -> formatted traceback of the exception that rank raised.
        exit_codes: rank -> exit code of a rank process that died (negative: killed by
            that signal).
        hung: ranks that had not answered when the pool gave up on them.
        answered: ranks that returned a result or raised.
        stacks: rank -> Python stack of a hung rank, as ``faulthandler`` dumped it.
        results: per rank, its result, or ``None`` where it failed or hung.
    """

    def __init__(self, message: str, *, failures=None, exit_codes=None, hung=(), answered=(),
                 stacks=None, results=None):
        super().__init__(message)
        self.failures: dict[int, str] = dict(failures or {})
        self.exit_codes: dict[int, int] = dict(exit_codes or {})
        self.hung: list[int] = sorted(hung)
        self.answered: list[int] = sorted(answered)
        self.stacks: dict[int, str] = dict(stacks or {})
        self.results: list[Any] = list(results or [])


class RankTimeout(RankError, TimeoutError):
    """Some rank did not answer in time (and none raised or died first); see ``hung``."""


# --------------------------------------------------------------------------- the ranks


def _child_main(rank: int, world_size: int, conn, spec: dict) -> None:
    """Body of one rank process: join the group, then run jobs until told to stop."""
    global _CURRENT
    # Ctrl-C reaches the whole process group; the parent decides when ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    dump = open(spec["dump_path"], "a", buffering=1)  # kept open: faulthandler holds its fd
    faulthandler.enable(file=dump, all_threads=True)  # segfaults etc. leave a stack here
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    _watch_parent()
    for path in reversed(spec["sys_path"]):
        if path not in sys.path:
            sys.path.insert(0, path)
    os.environ.update(spec["rank_env"][rank])
    try:
        import torch

        torch.set_num_threads(1)
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(1)
        if spec["init_process_group"]:
            import torch.distributed as dist

            store = dist.TCPStore(spec["host"], spec["port"], is_master=False,
                                  timeout=datetime.timedelta(seconds=spec["start_timeout_s"]))
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=spec["collective_timeout_s"]))
    except BaseException:
        conn.send_bytes(pickle.dumps(("start_err", traceback.format_exc())))
        return
    _CURRENT = RankInfo(rank, world_size)
    conn.send_bytes(pickle.dumps(("ready", os.getpid())))
    try:
        while True:
            try:
                msg = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):  # the parent went away
                break
            if msg[0] == "stop":
                break
            _, job, payload = msg
            conn.send_bytes(_run_job(job, payload, spec["init_process_group"]))
    finally:
        if spec["init_process_group"]:
            import torch.distributed as dist

            if dist.is_initialized():
                with contextlib.suppress(Exception):
                    dist.destroy_process_group()


def _run_job(job: int, payload: bytes, needs_group: bool) -> bytes:
    try:
        fn, args, kwargs = pickle.loads(payload)
    except BaseException:
        return pickle.dumps(("err", job, "could not unpickle the job (is fn importable here?)\n"
                             + traceback.format_exc(), _group_ok(needs_group)))
    try:
        result = fn(*args, **kwargs)
    except BaseException as e:  # SystemExit and KeyboardInterrupt are failures too
        # Drop this frame: the traceback starts in the user's function.
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))
        return pickle.dumps(("err", job, text, _group_ok(needs_group)))
    try:
        return pickle.dumps(("ok", job, result, _group_ok(needs_group)), protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException:
        return pickle.dumps(("err", job, f"the result of {_name(fn)} could not be pickled\n"
                             + traceback.format_exc(), _group_ok(needs_group)))


def _group_ok(needs_group: bool) -> bool:
    if not needs_group:
        return True
    import torch.distributed as dist

    return dist.is_initialized()


def _watch_parent() -> None:
    """Exit if the parent dies, so a killed test run leaves no ranks behind."""

    parent = os.getppid()  # the test process under spawn, the forkserver under forkserver

    def _parent_watch_loop():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=_parent_watch_loop, name="fzero-parent-watch", daemon=True).start()


# --------------------------------------------------------------------------- the pool

_LIVE: "weakref.WeakSet[RankPool]" = weakref.WeakSet()
# ``path`` (the repository root and tests/) goes in front first: the harness is imported from
# tests/, which a forkserver started before pytest put tests/ on sys.path would not find.
_BOOTSTRAP = ("import os, sys; os.environ.update(env); sys.path[:0] = [p for p in path if p not in sys.path]\n"
              "from harness.ranks import _child_main; _child_main(*args)")


class RankPool:
    """``world_size`` rank processes in a gloo process group, reused across jobs.

    Args:
        world_size: number of ranks.
        timeout_s: default time a :meth:`run` waits for every rank to answer.
        start_timeout_s: time the ranks get to start and join the process group.
        collective_timeout_s: gloo's timeout for a collective, and ``$FZERO_TIMEOUT`` in the
            ranks (default: ``timeout_s``), so a stuck collective raises in the rank.
        grace_s: after one rank fails, how long the others get to finish or fail before
            they are reported as stuck.
        env: extra environment variables for the ranks (set before they import torch).
        init_process_group: ``False`` starts the ranks without a process group, with
            torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
            ``MASTER_PORT``, ...) set, for code that initialises the group itself.
        start_method: ``"forkserver"`` (the default where available) forks each rank from
            a server that imported torch once, so a (re)start costs a fraction of a second
            instead of an import of torch per rank; ``env`` is then applied after torch
            but before fzero is imported. ``"spawn"`` starts each rank from scratch.

    The ranks start in the constructor; after a failure they are restarted on the next
    :meth:`run`. Use it as a context manager or call :meth:`close`.

    Raises:
        ValueError: ``world_size`` is not a positive int.
        RankError, RankTimeout: the ranks failed to start.

    Example:
        >>> import torch.distributed as dist
        >>> with RankPool(2) as pool:  # doctest: +SKIP
        ...     pool.run(dist.get_rank)
        [0, 1]
    """

    def __init__(self, world_size: int, *, timeout_s: float = 120.0, start_timeout_s: float = 120.0,
                 collective_timeout_s: float | None = None, grace_s: float = 2.0,
                 env: dict[str, str] | None = None, init_process_group: bool = True,
                 start_method: Literal["forkserver", "spawn"] | None = None):
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"RankPool: world_size must be a positive int, got {world_size!r}")
        for name, value in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s), ("grace_s", grace_s)):
            if not value > 0:
                raise ValueError(f"RankPool: {name} must be > 0, got {value!r}")
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.start_timeout_s = float(start_timeout_s)
        self.collective_timeout_s = float(collective_timeout_s or timeout_s)
        self.grace_s = float(grace_s)
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self.init_process_group = bool(init_process_group)
        if start_method is None:
            start_method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"RankPool: start_method must be 'forkserver' or 'spawn', got {start_method!r}")
        self.start_method = start_method
        self.starts = 0  # how many times the ranks were started (1 + restarts)
        self.start_s = 0.0  # seconds the last start took
        self.jobs = 0
        self._procs: list = []  # mutated in place: the finalizer holds this list
        self._conns: list = []
        self._store = None
        self._dump_dir: str | None = None
        self._dump_offsets: list[int] = []
        self._closed = False
        self._lock = threading.RLock()
        self._on_start: Callable[[RankPool], None] | None = None  # set by RankPools
        _LIVE.add(self)
        weakref.finalize(self, _kill_all, self._procs)
        self.start()

    # ----------------------------------------------------------------- lifecycle

    @property
    def running(self) -> bool:
        """Whether the rank processes are up (they are restarted lazily after a failure)."""
        return bool(self._procs)

    def start(self) -> None:
        """Start the ranks if they are not running; wait until all joined the group."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"RankPool.start: {self!r} is closed")
            if self.running:
                return
            if self._on_start is not None:
                self._on_start(self)
            t0 = time.monotonic()
            try:
                self._spawn()
                self._wait_ready(t0 + self.start_timeout_s)
            except BaseException:
                self._stop(graceful=False)
                raise
            self.starts += 1
            self.start_s = time.monotonic() - t0

    def restart(self) -> None:
        """Stop the ranks now; the next :meth:`run` starts a fresh world (e.g. after a job
        left a collective half done on some rank)."""
        with self._lock:
            self._stop(graceful=False)

    def close(self) -> None:
        """Stop the ranks for good (gracefully, then by force)."""
        with self._lock:
            self._closed = True
            self._stop(graceful=True)

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running" if self.running else "stopped"
        return f"RankPool(world_size={self.world_size}, {state}, starts={self.starts}, jobs={self.jobs})"

    def _spawn(self) -> None:
        import torch.distributed as dist

        n = self.world_size
        host = "127.0.0.1"
        if self.init_process_group:
            # The parent hosts the rendezvous store on a port the OS picked: no free-port race.
            self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                        timeout=datetime.timedelta(seconds=self.start_timeout_s))
            port = self._store.port
        else:
            port = _free_port(host)
        self._dump_dir = tempfile.mkdtemp(prefix="fzero-ranks-")
        self._dump_offsets[:] = [0] * n
        # The repository root and its tests/ (where the harness and the test modules' jobs live).
        tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        extra = [os.path.dirname(tests), tests]
        sys_path = _unique([*extra, *sys.path])
        rank_env = []
        for r in range(n):
            e = {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_WORLD_SIZE": str(n),
                 "GROUP_RANK": "0"}
            if not self.init_process_group:
                e.update(MASTER_ADDR=host, MASTER_PORT=str(port))
            rank_env.append(e)
        env = {
            # 2-core CI machines: one thread per rank, or ranks fight over cores.
            "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "FZERO_TIMEOUT": str(self.collective_timeout_s),
            "PYTHONPATH": os.pathsep.join(_unique([*extra, *os.environ.get("PYTHONPATH", "").split(os.pathsep)])),
        }
        if sys.platform.startswith("linux") and os.path.exists("/sys/class/net/lo"):
            env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")  # one host: loopback
        env.update(self.env)
        spec = dict(host=host, port=port, init_process_group=self.init_process_group,
                    start_timeout_s=self.start_timeout_s, collective_timeout_s=self.collective_timeout_s,
                    sys_path=sys_path, rank_env=rank_env, dump_path=None)
        ctx = multiprocessing.get_context(self.start_method)
        if self.start_method == "forkserver":
            # Import torch once in the server; every rank (and every restart) forks from it.
            # No effect if this process's forkserver already runs.
            ctx.set_forkserver_preload(["torch", "torch.distributed"])
        for r in range(n):
            parent_end, child_end = ctx.Pipe(duplex=True)
            rspec = dict(spec, dump_path=os.path.join(self._dump_dir, f"rank{r}.stack"))
            # The target is ``exec`` of a two-line bootstrap, so the environment is set in
            # the rank before anything of fzero is imported (fzero reads $FZERO_TIMEOUT at
            # import). Not daemonic: a daemonic process may not start its own (DataLoader).
            p = ctx.Process(target=exec, args=(_BOOTSTRAP, {"env": env, "path": extra,
                                                            "args": (r, n, child_end, rspec)}),
                            name=f"fzero-rank{r}-of-{n}", daemon=False)
            p.start()
            child_end.close()
            self._procs.append(p)
            self._conns.append(parent_end)

    def _wait_ready(self, deadline: float) -> None:
        n = self.world_size
        pending, errors, died = set(range(n)), {}, {}
        while pending:
            ready = self._wait(pending, deadline)
            if not ready:
                break
            for r in ready:
                msg = self._recv(r)
                pending.discard(r)
                if msg is None:
                    died[r] = self._exitcode(r)
                elif msg[0] == "start_err":
                    errors[r] = msg[1]
            if errors or died:
                break
        if not (pending or errors or died):
            return
        stacks = self._dump_stacks(pending) if pending else {}
        what = f"RankPool({n}): the ranks failed to start"
        cls = RankError if errors or died else RankTimeout
        if cls is RankTimeout:
            what += f" within {self.start_timeout_s:g} s"
        raise cls(self._report(what, errors, died, pending, stacks, extra=self._fatal_dumps(died)),
                  failures=errors, exit_codes=died, hung=pending,
                  answered=set(range(n)) - pending, stacks=stacks)

    def _stop(self, *, graceful: bool) -> None:
        procs, conns = list(self._procs), list(self._conns)
        if graceful:
            for c in conns:
                with contextlib.suppress(Exception):
                    c.send_bytes(pickle.dumps(("stop",)))
            deadline = time.monotonic() + _STOP_WAIT_S
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
        _kill_all(procs)
        for c in conns:
            with contextlib.suppress(Exception):
                c.close()
        self._procs.clear()
        self._conns.clear()
        self._store = None
        if self._dump_dir:
            shutil.rmtree(self._dump_dir, ignore_errors=True)
            self._dump_dir = None

    # ----------------------------------------------------------------- jobs

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        Args:
            fn: a module-level function (or a ``functools.partial`` of one): it is sent by
                reference and imported in each rank. To pass ``fn`` a keyword named
                ``timeout_s``, bind it with ``functools.partial``.
            *args, **kwargs: pickled and passed to ``fn`` on every rank.
            timeout_s: how long to wait for every rank (default: the pool's).

        Returns:
            ``[result of rank 0, result of rank 1, ...]``.

        Raises:
            TypeError: ``fn`` or the arguments cannot be pickled.
            RankError: a rank raised or its process died; the message holds every failing
                rank's traceback (or exit code) and the stack of every rank still stuck.
            RankTimeout: some rank did not answer within ``timeout_s``; names the ranks
                that answered and those that hung, with the hung ranks' stacks.
        """
        try:
            payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise TypeError(
                f"RankPool.run: fn and its arguments must be picklable, and fn importable by its "
                f"qualified name (a module-level function, not a lambda or a nested function); "
                f"got fn={_name(fn)}: {e}"
            ) from e
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        with self._lock:
            self.start()
            try:
                return self._run(_name(fn), payload, timeout)
            except BaseException:
                # A failed job, a KeyboardInterrupt or pytest-timeout: never reuse these ranks.
                self._stop(graceful=False)
                raise

    def _run(self, fn_name: str, payload: bytes, timeout: float) -> list[Any]:
        n = self.world_size
        self.jobs += 1
        job = self.jobs
        msg = pickle.dumps(("run", job, payload))
        for c in self._conns:
            c.send_bytes(msg)
        t0 = time.monotonic()
        deadline = t0 + timeout
        results: list[Any] = [None] * n
        pending, errors, died, group_lost = set(range(n)), {}, {}, False
        first_failure = None
        while pending:
            limit = deadline if first_failure is None else min(deadline, first_failure + self.grace_s)
            ready = self._wait(pending, limit)
            if not ready:
                break
            for r in ready:
                reply = self._recv(r)
                pending.discard(r)
                if reply is None:
                    died[r] = self._exitcode(r)
                elif reply[0] == "ok" and reply[1] == job:
                    results[r], group_lost = reply[2], group_lost or not reply[3]
                elif reply[0] == "err" and reply[1] == job:
                    errors[r] = reply[2]
                else:  # cannot happen: ranks are restarted after every failure
                    errors[r] = f"unexpected reply {reply[:2]!r} to job {job}"
                if (r in errors or r in died) and first_failure is None:
                    first_failure = time.monotonic()
        if not (pending or errors or died):
            if group_lost:  # the job destroyed the process group: start afresh next time
                self._stop(graceful=True)
            return results
        stacks = self._dump_stacks(pending) if pending else {}
        answered = set(range(n)) - pending
        if errors or died:
            # A death comes first: the others' errors (a closed gloo connection) follow from it.
            parts = [f"rank {r} died" for r in sorted(died)]
            parts += [f"rank{'s' if len(errors) > 1 else ''} {_ranks(errors)} raised"] if errors else []
            what = f"RankPool.run({fn_name}) on {n} ranks: " + ", ".join(parts)
            if pending:
                what += f"; rank{'s' if len(pending) > 1 else ''} {_ranks(pending)} still running after that"
            cls = RankError
        else:
            what = (f"RankPool.run({fn_name}) on {n} ranks: timed out after {timeout:g} s; "
                    f"answered: {_ranks(answered) or 'none'}; hung: {_ranks(pending)}")
            cls = RankTimeout
        what += " (the ranks are restarted on the next run)"
        raise cls(self._report(what, errors, died, pending, stacks, extra=self._fatal_dumps(died)),
                  failures=errors, exit_codes=died, hung=pending, answered=answered, stacks=stacks,
                  results=results)

    # ----------------------------------------------------------------- plumbing

    def _wait(self, ranks: set[int], deadline: float) -> list[int]:
        """Ranks among ``ranks`` with a reply or a dead process, waiting until ``deadline``."""
        objs = {}
        for r in ranks:
            objs[self._conns[r]] = r
            objs[self._procs[r].sentinel] = r
        timeout = deadline - time.monotonic()
        if timeout <= 0:
            return []
        return sorted({objs[o] for o in mpc.wait(list(objs), timeout)})

    def _recv(self, r: int):
        """Rank ``r``'s reply, or ``None`` if its process died without one."""
        conn = self._conns[r]
        try:
            if conn.poll(0):  # a reply sent just before exiting still counts
                return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return None
        except Exception:
            return ("err", self.jobs, "its reply could not be unpickled in the parent\n" + traceback.format_exc(), True)
        if self._procs[r].is_alive():  # spurious wake-up; treat as dead only if it is
            self._procs[r].join(1.0)
            if self._procs[r].is_alive():
                return ("err", self.jobs, "woke without a reply while alive", True)
        return None

    def _exitcode(self, r: int) -> int | None:
        self._procs[r].join(5.0)
        return self._procs[r].exitcode

    def _read_dump(self, r: int) -> str:
        if not self._dump_dir:
            return ""
        path = os.path.join(self._dump_dir, f"rank{r}.stack")
        try:
            with open(path, errors="replace") as f:
                f.seek(self._dump_offsets[r])
                text = f.read()
                self._dump_offsets[r] = f.tell()
        except OSError:
            return ""
        return text

    def _dump_stacks(self, ranks) -> dict[int, str]:
        """Ask each rank in ``ranks`` for its Python stack (faulthandler on SIGUSR1)."""
        if not hasattr(signal, "SIGUSR1"):
            return {}
        for r in ranks:
            self._read_dump(r)  # skip what is already there
            with contextlib.suppress(OSError):
                os.kill(self._procs[r].pid, signal.SIGUSR1)
        stacks = {r: "" for r in ranks}
        deadline = time.monotonic() + _DUMP_WAIT_S
        while time.monotonic() < deadline:
            time.sleep(0.05)
            for r in ranks:
                stacks[r] += self._read_dump(r)
            if all(stacks.values()):
                time.sleep(0.05)  # let a dump that is being written finish
                for r in ranks:
                    stacks[r] += self._read_dump(r)
                break
        return {r: _clean_stack(s) for r, s in stacks.items() if s}

    def _fatal_dumps(self, died: dict) -> dict[int, str]:
        """What faulthandler wrote when a rank crashed on a fatal signal (segfault, abort)."""
        return {r: text for r in died if (text := self._read_dump(r).strip())}

    def _report(self, what, errors, died, hung, stacks, extra) -> str:
        lines = [what]
        for r in sorted(died):
            lines.append(f"rank {r}: process died, {_exit_text(died[r])}")
            if extra.get(r):
                lines += _prefixed(r, extra[r])
        for r in sorted(errors):
            lines += _prefixed(r, errors[r])
        for r in sorted(hung):
            if stacks.get(r):
                lines.append(f"rank {r}: did not answer; its stack:")
                lines += _prefixed(r, stacks[r])
            else:
                lines.append(f"rank {r}: did not answer (no stack could be taken)")
        return "\n".join(lines)


class RankPools:
    """A cache of :class:`RankPool` by world size (and options): ``pools(2).run(fn)``.

    At most ``max_pools`` pools have their ranks running at once: starting another stops
    the least recently used (it restarts if used again), so a 2-core machine is not
    shared by a dozen idle ranks.

    Args:
        max_pools: pools whose ranks may run at once.
        **defaults: options for every :class:`RankPool` (``timeout_s=``, ``env=``, ...).
    """

    def __init__(self, *, max_pools: int = 2, **defaults: Any):
        if not isinstance(max_pools, int) or max_pools < 1:
            raise ValueError(f"RankPools: max_pools must be a positive int, got {max_pools!r}")
        self.max_pools = max_pools
        self.defaults = defaults
        self._pools: OrderedDict[tuple, RankPool] = OrderedDict()
        self._lock = threading.RLock()

    def __call__(self, world_size: int, **options: Any) -> RankPool:
        """The pool of ``world_size`` ranks with these options, started if need be."""
        opts = {**self.defaults, **options}
        key = (world_size, _freeze(opts))
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                self._make_room(None)
                pool = RankPool(world_size, **opts)
                pool._on_start = self._make_room
                self._pools[key] = pool
            else:
                pool.start()  # restarts it (making room) if it was stopped
            self._pools.move_to_end(key)
            return pool

    def _make_room(self, starting: RankPool | None) -> None:
        with self._lock:
            for key, pool in list(self._pools.items()):
                if pool is starting:
                    self._pools.move_to_end(key)
            running = [p for p in self._pools.values() if p.running and p is not starting]
            for pool in running[: max(0, len(running) - (self.max_pools - 1))]:
                with pool._lock:
                    pool._stop(graceful=True)

    def close(self) -> None:
        """Close every pool."""
        with self._lock:
            for pool in self._pools.values():
                pool.close()
            self._pools.clear()


def run_ranks(world_size: int, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0,
              **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` once on ``world_size`` fresh ranks; results in rank order.

    A one-shot :class:`RankPool`: use it for a job that must have a world of its own (one
    that kills a rank, or destroys the process group). Raises as :meth:`RankPool.run`.

    Example:
        >>> import torch.distributed as dist
        >>> run_ranks(2, dist.get_rank)  # doctest: +SKIP
        [0, 1]
    """
    with RankPool(world_size, timeout_s=timeout_s) as pool:
        return pool.run(fn, *args, **kwargs)


# --------------------------------------------------------------------------- helpers


def _kill_all(procs) -> None:
    for p in procs:
        with contextlib.suppress(Exception):
            if p.is_alive():
                p.kill()
    for p in procs:
        with contextlib.suppress(Exception):
            p.join(_STOP_WAIT_S)


@atexit.register
def _close_live_pools() -> None:
    # Runs before multiprocessing's own exit hook (registered earlier), which would wait
    # forever on our non-daemonic ranks.
    for pool in list(_LIVE):
        with contextlib.suppress(Exception):
            pool.close()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _unique(items) -> list:
    return list(dict.fromkeys(i for i in items if i))


def _freeze(obj):
    if isinstance(obj, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return tuple(_freeze(v) for v in obj)
    return obj


def _name(fn) -> str:
    inner = getattr(fn, "func", fn)  # functools.partial
    return f"{getattr(inner, '__module__', '?')}.{getattr(inner, '__qualname__', repr(inner))}"


def _ranks(ranks) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def _clean_stack(text: str) -> str:
    """A faulthandler dump without the harness: no watchdog thread, no frames below the job."""
    blocks = []
    for block in text.strip().split("\n\n"):
        if " in _parent_watch_loop" in block:
            continue
        lines = block.splitlines()
        for i, line in enumerate(lines):
            if line.strip().startswith('File "') and f"{os.sep}harness{os.sep}ranks.py" in line and line.endswith(" in _run_job"):
                lines = lines[:i]
                break
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _prefixed(rank: int, text: str) -> list[str]:
    return [f"rank {rank}: {line}" for line in text.rstrip().splitlines()]


def _exit_text(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"exit code {code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            return f"exit code {code} (killed by signal {-code})"
    return f"exit code {code}"
