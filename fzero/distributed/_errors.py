"""The error every failed collective raises, below both the collectives (:mod:`comm`) and the
check of their tensors (:mod:`device_check`), whose :class:`DeviceMismatchError` is one."""

from __future__ import annotations

__all__ = ["CollectiveError"]


class CollectiveError(RuntimeError):
    """A collective failed or did not complete in time; the message names it and the rank."""
