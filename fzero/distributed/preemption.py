"""Preemption: a SIGTERM asks the job to finish its step, save and stop, every rank at the same step.

A scheduler that takes the machines back (a spot reclaim, Slurm's ``--signal``, a Kubernetes
eviction) sends SIGTERM and waits a grace period before SIGKILL. The training loop asks
:func:`preempted` once per step, at the step boundary::

    while int(state.step) < steps:
        state, metrics = step(state, next(batches))
        if fzero.preempted():                       # the same answer on every rank
            fzero.checkpoint.save(f"{root}/step_{int(state.step)}", state)
            sys.exit(0)

Why a collective: the signal reaches the ranks at different moments (or only one of them),
but a checkpoint needs every rank at the same step. Each call gathers one integer per rank
(whether it was signalled) on a gloo group of its own, and every rank gets the same answer:
the job stops after the first step at whose end any rank had been signalled. The group is
not the checkpoint's, whose asynchronous saves talk from a thread of their own while the
loop runs; the gather is a few bytes, on the host.

The first call installs a SIGTERM handler in this process (so a SIGTERM before the loop's
first call ends the rank as usual: there is nothing newer to save). The handler only notes
the signal. A second SIGTERM more than :data:`REPEAT_S` after the first ends the process at
once (``os._exit``, status 128 + 15), even in the middle of the save: the checkpoint being
written is then never committed (its commit is one rename, after every rank wrote), and the
newest committed one stays as it was. Signals closer together count as one: a scheduler that
signals every process of the job reaches a rank both directly and through ``fzero launch``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch.distributed as dist

from fzero.distributed import comm, device_check
from fzero._signals import REPEAT_S
from fzero.distributed.mesh import DEFAULT_TIMEOUT_S

__all__ = ["REPEAT_S", "preempted", "uninstall"]

WHERE = "fzero.preempted"

_STATE: dict = {"installed": False, "previous": None, "first": None, "agreed": None, "group": None, "default": None}
_LOCK = threading.Lock()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _on_sigterm(signum: int, frame) -> None:
    now = time.monotonic()
    first = _STATE["first"]
    if first is None:
        _STATE["first"] = now
        print(f"{WHERE}: rank {_rank()} received SIGTERM: the ranks save and stop at the end of this step "
              "(a second SIGTERM ends this rank at once)", file=sys.stderr, flush=True)
    elif now - first > REPEAT_S:
        print(f"{WHERE}: rank {_rank()} received a second SIGTERM: exiting at once; the checkpoint being "
              "written, if any, is not committed, and the newest committed one is unchanged",
              file=sys.stderr, flush=True)
        os._exit(128 + signum)


def _install() -> None:
    if _STATE["installed"]:
        return
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(f"{WHERE}: call it from the main thread (its first call installs the SIGTERM handler, "
                           "which only the main thread may do)")
    _STATE["previous"] = signal.signal(signal.SIGTERM, _on_sigterm)
    _STATE["installed"] = True


def uninstall() -> None:
    """Put back the SIGTERM handler that :func:`preempted`'s first call replaced, and forget
    any SIGTERM received (a program that stops asking, or a test that asked once)."""
    if _STATE["installed"]:
        signal.signal(signal.SIGTERM, _STATE["previous"])
    _STATE.update(installed=False, previous=None, first=None, agreed=None)


def _group(timeout_s: float):
    default = dist.group.WORLD
    with _LOCK:
        if _STATE["default"] is not default:
            # Every rank makes its first call at the same point of its loop, so every rank
            # creates this group in the same order relative to other groups.
            group = comm.new_gloo_group("its process group (dist.new_group, on every rank's first call)",
                                        timeout_s=timeout_s, where=WHERE)
            _STATE["default"], _STATE["group"] = default, group
        return _STATE["group"]


def preempted(*, timeout_s: float | None = None) -> bool:
    """Whether the job was asked to stop (a SIGTERM to any rank, or to ``fzero launch``).

    Collective: every rank calls it at the same point of its loop, once per step, after
    the step. It returns the same answer on every rank: ``True`` from the first call at
    which any rank had received SIGTERM, and from then on. The loop then saves a
    checkpoint and exits 0; ``fzero launch`` gives it ``--grace`` seconds.

    Its first call installs the SIGTERM handler (see the module docstring); outside a
    process group it answers for this process alone.

    Args:
        timeout_s: how long a rank waits for the others (default ``$FZERO_TIMEOUT``, 300 s).

    Returns:
        ``True`` when the job should save and stop at this step.

    Raises:
        RuntimeError: called from a thread other than the main thread.
        CollectiveError: a rank did not arrive in time (named).

    Example:
        >>> import fzero
        >>> fzero.preempted()  # nobody sent SIGTERM
        False
        >>> fzero.distributed.preemption.uninstall()  # this process's SIGTERM handler as it was
    """
    _install()
    if _STATE["agreed"] is not None:
        return True
    signalled = _STATE["first"] is not None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if signalled:
            _STATE["agreed"] = [0]
        return signalled
    timeout = DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s)
    group = _group(timeout)
    with device_check.on_host():  # host tensors on a host group, under a device check too
        flags = comm.all_gather_ints("all_gather(SIGTERM flags)", [int(signalled)], group, timeout_s=timeout,
                                     where=WHERE)
    ranks = [r for r, v in enumerate(flags[:, 0].tolist()) if v]
    if not ranks:
        return False
    _STATE["agreed"] = ranks
    if dist.get_rank() == 0:
        print(f"{WHERE}: SIGTERM on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: every rank "
              "stops after this step", file=sys.stderr, flush=True)
    return True
