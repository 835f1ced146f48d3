"""This process's asynchronous save in flight, which a load or a second save waits for.

Its own module so that ``_load`` (which must wait for it) and ``_save`` (which starts it, and
whose ``latest(verify=True)`` reads checkpoints through ``_load``) need not import each other.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["current", "set_current", "wait_pending"]

_PENDING: Any = None  # this process's last asynchronous save (a SaveHandle)
_LOCK = threading.Lock()


def current() -> Any:
    """The last asynchronous save this process started (done or not), or ``None``."""
    with _LOCK:
        return _PENDING


def set_current(handle: Any) -> None:
    global _PENDING
    with _LOCK:
        _PENDING = handle


def wait_pending() -> None:
    """Wait for this process's asynchronous save, if one is running (its error, if any, is
    left for its handle or the next save to raise)."""
    previous = current()
    if previous is not None:
        previous._done.wait()
        if previous._thread is not None:
            previous._thread.join()
