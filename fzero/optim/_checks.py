"""Argument checks shared by every factory in :mod:`fzero.optim`.

Each takes ``where``, the public function's name the error starts with, and returns the
value as a Python float, so a transformation and the optimizer built from it report the
same value in the same words.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

from fzero import tree

__all__ = ["check_adamw_args", "check_coeff_bounds", "check_int", "check_lr", "check_nonneg", "check_number",
           "check_unit", "check_update_args", "type_name"]


def type_name(x: Any) -> str:
    return type(x).__name__


def check_number(where: str, name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: {name} must be a number, got {type_name(value)} {value!r}")
    return float(value)


def check_nonneg(where: str, name: str, value: Any) -> float:
    v = check_number(where, name, value)
    if not v >= 0.0:
        raise ValueError(f"{where}: {name} must be >= 0, got {value!r}")
    return v


def check_unit(where: str, name: str, value: Any, *, closed: bool = False) -> float:
    """A decay rate: 0 <= value < 1 (or <= 1 with ``closed``)."""
    v = check_number(where, name, value)
    ok = 0.0 <= v <= 1.0 if closed else 0.0 <= v < 1.0
    if not ok:
        interval = "[0, 1]" if closed else "[0, 1)"
        raise ValueError(f"{where}: {name} must lie in {interval}, got {value!r}")
    return v


def check_lr(where: str, learning_rate: Any) -> float | Callable[[int], float]:
    """A learning rate is a non-negative number or a schedule ``fn(count) -> float``."""
    if callable(learning_rate):
        return learning_rate
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, numbers.Real):
        raise TypeError(
            f"{where}: learning_rate must be a float or a schedule fn(count: int) -> float, "
            f"got {type_name(learning_rate)} {learning_rate!r}"
        )
    if not float(learning_rate) >= 0.0:
        raise ValueError(f"{where}: learning_rate must be >= 0, got {learning_rate!r}")
    return float(learning_rate)


def check_adamw_args(where: str, learning_rate: Any, b1: Any, b2: Any, eps: Any,
                     weight_decay: Any) -> tuple[float | Callable[[int], float], float, float, float, float]:
    """The arguments of an Adam-like optimizer with decoupled weight decay, checked in this
    order: ``(learning_rate, b1, b2, eps, weight_decay)``."""
    lr = check_lr(where, learning_rate)
    b1, b2 = check_unit(where, "b1", b1), check_unit(where, "b2", b2)
    return lr, b1, b2, check_nonneg(where, "eps", eps), check_nonneg(where, "weight_decay", weight_decay)


def check_int(where: str, name: str, value: Any, low: int = 0) -> int:
    """An int (not a bool) >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise TypeError(f"{where}: {name} must be an int >= {low}, got {value!r}")
    return value


def check_coeff_bounds(where: str, max_coeff: Any, min_coeff: Any) -> tuple[float, float]:
    """A trust ratio's bounds: ``0 <= min_coeff <= max_coeff``; returns ``(max_coeff, min_coeff)``."""
    max_coeff, min_coeff = check_nonneg(where, "max_coeff", max_coeff), check_nonneg(where, "min_coeff", min_coeff)
    if min_coeff > max_coeff:
        raise ValueError(f"{where}: min_coeff={min_coeff} is greater than max_coeff={max_coeff}")
    return max_coeff, min_coeff


def check_update_args(where: str, mu: Any, updates: Any, params: Any) -> tuple[list, Any, list, list]:
    """The arguments of an ``update`` that needs ``params``, checked against the state's
    ``mu`` tree: ``(leaves of mu, its spec, update leaves in mu's dtypes, param leaves)``."""
    if params is None:
        raise ValueError(f"{where}: needs the parameters; call update(updates, state, params)")
    for x, name in ((updates, "updates"), (params, "params")):
        tree.assert_same_structure(mu, x, what=where, names=("the optimizer state's mu", name))
    mu_leaves, spec = tree.flatten(mu)
    g = [x.to(m.dtype) for x, m in zip(tree.leaves(updates), mu_leaves)]
    return mu_leaves, spec, g, tree.leaves(params)
