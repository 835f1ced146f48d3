"""What a value of a DeepSpeed key may be: the checks every section and ``Config`` use.

Each names the key by its dotted path, as DeepSpeed's JSON spells it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

WHERE = "fzero.Config"


def _short(value: Any) -> str:
    """A value for a message: a section is ``{...}`` and a long value is cut, so an error
    never pastes a whole dict."""
    if isinstance(value, Mapping):
        return "{...}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _auto(path: str, value: Any) -> None:
    if value == "auto":
        raise ValueError(f"{WHERE}: {path}='auto' is Hugging Face's placeholder, which fzero fills only while "
                         "reading a config (Config.load, fzero.compile); a Config built directly needs a value")


def _int(path: str, value: Any, *, minimum: int | None = None) -> int:
    """An int, or a whole float (JSON writes ``5e8`` as a float); never a bool."""
    _auto(path, value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value).is_integer():
        raise TypeError(f"{WHERE}: {path} must be an integer, got {_short(value)} ({type(value).__name__})")
    v = int(value)
    if minimum is not None and v < minimum:
        raise ValueError(f"{WHERE}: {path} must be >= {minimum}, got {_short(value)}")
    return v


def _num(path: str, value: Any, *, minimum: float | None = None, positive: bool = False) -> float:
    _auto(path, value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{WHERE}: {path} must be a number, got {_short(value)} ({type(value).__name__})")
    v = float(value)
    if not math.isfinite(v) or (minimum is not None and v < minimum) or (positive and v <= 0):
        want = "> 0" if positive else f">= {minimum:g}" if minimum is not None else "finite"
        raise ValueError(f"{WHERE}: {path} must be a finite number {want}, got {_short(value)}")
    return v


def _bool(path: str, value: Any) -> bool:
    _auto(path, value)
    if not isinstance(value, bool):
        raise TypeError(f"{WHERE}: {path} must be true or false, got {_short(value)} ({type(value).__name__})")
    return value


def _section(path: str, value: Any) -> Mapping[str, Any]:
    _auto(path, value)
    if not isinstance(value, Mapping):
        raise TypeError(f"{WHERE}: {path} must be a JSON object, got {_short(value)} ({type(value).__name__})")
    return value


class _FrozenDict(dict):
    """A read-only dict: a section's ``params`` as written (picklable, unlike a mappingproxy)."""

    def _readonly(self, *args, **kwargs):
        raise TypeError(f"{WHERE}: a config section's params are read-only; use dataclasses.replace")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _readonly
    __ior__ = _readonly

    def __reduce__(self):
        return (_FrozenDict, (dict(self),))


def _frozen(d: Mapping[str, Any]) -> Mapping[str, Any]:
    return _FrozenDict(d)
