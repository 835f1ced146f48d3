"""How a drawn case ended: :func:`outcome` sorts what a call did, and the helpers that
say what an error names.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any, Literal


Outcome = Literal["ran", "named", "user", "bug"]


def outcome(fn: Callable[[], Any], *, named: tuple[type[BaseException], ...], prefix: str | tuple[str, ...] = "fzero",
            user_files: tuple[str, ...] = ()) -> tuple[Outcome, Any]:
    """Call ``fn`` and sort what happened: ``("ran", result)``; ``("named", error)`` for an
    error of a ``named`` type whose message starts with ``prefix``; ``("user", error)`` for
    an error raised under a frame of ``user_files`` (the user's own step, passed through as
    it was); else ``("bug", error)`` (an AttributeError, KeyError, ZeroDivisionError, ...
    from fzero's inside)."""
    try:
        return "ran", fn()
    except Exception as e:  # noqa: BLE001  (sorting every exception is the point)
        if isinstance(e, named) and str(e).startswith(prefix):
            return "named", e
        frames = [f.filename for f in traceback.extract_tb(e.__traceback__)]
        if user_files and any(f.endswith(u) for f in frames for u in user_files):
            return "user", e
        return "bug", e


def describe(error: BaseException) -> str:
    """An error and where it was raised, for a failing case's message."""
    tb = traceback.extract_tb(error.__traceback__)
    where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
    return f"{type(error).__name__}: {error}{where}"


def section_paths(changes: list[tuple[str, Any]]) -> list[str]:
    """The dotted paths of ``changes`` and every section above them."""
    out = []
    for path, _ in changes:
        parts = path.split(".")
        out += [".".join(parts[: i + 1]) for i in range(len(parts))]
    return out


def mentions_any(message: str, paths: list[str] | tuple[str, ...]) -> bool:
    """Whether ``message`` names one of ``paths`` (by its dotted path or its last key)."""
    return any(p in message or p.rsplit(".", 1)[-1] in message for p in paths)
