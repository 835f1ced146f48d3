"""Learning-rate schedules: plain functions ``fn(count) -> lr``.

``count`` is the 0-based index of the update about to be applied (the number of updates
already applied, as optax counts), given as an ``int`` or a 0-dim integer tensor; the
result is a Python ``float``. A tensor count is read with ``int()``, which synchronises
with its device once per call.

Two families live here.

* optax's: :func:`constant`, :func:`linear`, :func:`cosine_decay`, :func:`join_schedules`,
  :func:`linear_warmup` and :func:`warmup_cosine`, with optax's formulas and counting.
* DeepSpeed's (``deepspeed/runtime/lr_schedules.py``, checked against release 0.19.8):
  :func:`WarmupLR`, :func:`WarmupDecayLR`, :func:`WarmupCosineLR`, :func:`OneCycle` and
  :func:`LRRangeTest`. They take DeepSpeed's parameter names, i.e. the ``scheduler.params``
  of a DeepSpeed JSON config, and return the learning rate DeepSpeed *applies* at update
  ``count``.

DeepSpeed's counting: the scheduler's constructor writes ``get_lr()`` evaluated at
``last_batch_iteration = -1`` into the optimizer, and the engine calls
``lr_scheduler.step()`` (``last_batch_iteration += 1``) right after every
``optimizer.step()`` that was not skipped for fp16 overflow (``engine._take_model_step``).
So update ``k`` runs with ``get_lr()`` at ``last_batch_iteration = k - 1``. The DeepSpeed
functions below take ``k`` and write their formulas in ``j = k - 1``. Their arithmetic
follows DeepSpeed's operation by operation, so the values agree to the last bit.

Example:
    >>> from fzero.optim import schedules
    >>> lr = schedules.warmup_cosine(1.0, warmup=2, total=6)
    >>> [round(lr(k), 3) for k in range(8)]
    [0.0, 0.5, 1.0, 0.854, 0.5, 0.146, 0.0, 0.0]
"""

from __future__ import annotations

import difflib
import math
import numbers
import operator
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "Schedule",
    "constant",
    "linear",
    "cosine_decay",
    "join_schedules",
    "linear_warmup",
    "warmup_cosine",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "OneCycle",
    "LRRangeTest",
]

Schedule = Callable[[Any], float]
"""``fn(count) -> lr``: ``count`` an ``int`` or 0-dim integer tensor, ``lr`` a float."""

_REQUIRED = object()  # marks a DeepSpeed parameter without a default
_WARMUP_TYPES = ("log", "linear")


# --------------------------------------------------------------------------- checks


def _err(name: str, msg: str, exc: type[Exception] = ValueError) -> Exception:
    return exc(f"fzero.optim.schedules.{name}: {msg}")


def _count(name: str, count: Any) -> int:
    """The update index as an int: ints, integer tensors, and whole floats are accepted."""
    try:
        k = operator.index(count)
    except TypeError:
        try:
            if not hasattr(type(count), "__float__"):  # not a number (a str, say)
                raise TypeError
            x = float(count)
        except (TypeError, ValueError, RuntimeError):
            raise _err(name, "count must be an int or a 0-dim integer tensor, got "
                       f"{type(count).__name__}", TypeError) from None
        if not x.is_integer():
            raise _err(name, f"count must be a whole number of updates, got {x!r}") from None
        k = int(x)
    if k < 0:
        raise _err(name, f"count must be >= 0 (the 0-based index of the update), got {k}")
    return k


def _wrap(title: str, name: str, raw: Callable[[int], float]) -> Schedule:
    """A public schedule: checks ``count`` then calls ``raw(int)``; named for its repr."""

    def schedule(count: Any) -> float:
        return raw(_count(name, count))

    schedule.__name__ = schedule.__qualname__ = title
    return schedule


def _number(name: str, param: str, value: Any, *, nonneg: bool = False) -> float:
    if isinstance(value, (list, tuple)):
        raise _err(name, f"{param} must be one number; per-parameter-group lists are not "
                   f"supported, got {value!r}", TypeError)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _err(name, f"{param} must be a number, got {value!r} "
                   f"({type(value).__name__})", TypeError)
    v = float(value)
    if not math.isfinite(v) or (nonneg and v < 0):
        want = "a finite number >= 0" if nonneg else "a finite number"
        raise _err(name, f"{param} must be {want}, got {value!r}")
    return v


def _steps(name: str, param: str, value: Any, *, minimum: int = 0) -> int:
    """A step count: an int (or a whole float, as JSON may write ``1e3``) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _err(name, f"{param} must be an integer number of steps, got {value!r} "
                   f"({type(value).__name__})", TypeError)
    if not float(value).is_integer():
        raise _err(name, f"{param} must be a whole number of steps, got {value!r}")
    v = int(value)
    if v < minimum:
        raise _err(name, f"{param} must be >= {minimum}, got {value!r}")
    return v


def _flag(name: str, param: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _err(name, f"{param} must be true or false, got {value!r} "
                   f"({type(value).__name__})", TypeError)
    return value


def _params(name: str, given: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict:
    """DeepSpeed's parameters merged over ``defaults``; unknown and missing names fail."""
    for key in given:
        if key not in defaults:
            close = difflib.get_close_matches(key, list(defaults), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise _err(name, f"unknown parameter {key!r}{hint}; valid parameters: "
                       f"{', '.join(defaults)}", TypeError)
    for key, default in defaults.items():
        if default is _REQUIRED and key not in given:
            raise _err(name, f"missing required parameter {key!r}", TypeError)
    p = {**defaults, **given}
    # DeepSpeed resumes a scheduler from ``last_batch_iteration``; fzero resumes from the
    # update count in the checkpointed state, so only a fresh start (-1) has a meaning.
    if p["last_batch_iteration"] != -1 or isinstance(p["last_batch_iteration"], bool):
        raise _err(name, "last_batch_iteration must be -1: fzero derives the schedule "
                   "position from the update count (resume by loading a checkpoint), got "
                   f"{p['last_batch_iteration']!r}")
    return p


def _warmup(name: str, p: Mapping[str, Any]) -> tuple[int, float, str]:
    """DeepSpeed's warmup length ``max(2, warmup_num_steps)``, ``1/ln`` of it, and type."""
    steps = _steps(name, "warmup_num_steps", p["warmup_num_steps"], minimum=1)
    kind = p["warmup_type"]
    if kind not in _WARMUP_TYPES:
        # DeepSpeed logs a warning and falls back to "log"; a typo in a config should fail.
        raise _err(name, f"warmup_type must be one of {list(_WARMUP_TYPES)}, got {kind!r}")
    w = max(2, steps)  # DeepSpeed's floor: a log warmup over 1 step would divide by ln(1)
    return w, 1.0 / math.log(w), kind


def _warmup_gamma(j: int, w: int, inv_log_w: float, kind: str) -> float:
    """DeepSpeed's warmup fraction at ``last_batch_iteration = j < w``."""
    if kind == "log":
        return inv_log_w * math.log(j + 1)
    return j / w


def _warmup_raw(warmup: tuple[int, float, str], first: float, warm: Callable[[float], float],
                after: Callable[[int], float]) -> Callable[[int], float]:
    """DeepSpeed's warmup schedules by the count ``k``: ``first`` at ``k = 0`` (what the
    constructor writes), then with ``j = k - 1``: ``warm(fraction)`` while ``j < W``, with the
    warmup fraction of :func:`_warmup_gamma`, and ``after(j)`` from there on."""
    w, inv_log_w, kind = warmup

    def raw(k: int) -> float:
        if k == 0:
            return first
        j = k - 1
        return warm(_warmup_gamma(j, w, inv_log_w, kind)) if j < w else after(j)

    return raw


def _total(name: str, p: Mapping[str, Any], w: int) -> int:
    total = _steps(name, "total_num_steps", p["total_num_steps"], minimum=0)
    if total < w:
        # DeepSpeed only logs a warning here; a decay that ends before the warmup does is
        # a config mistake, so fzero refuses it.
        raise _err(name, f"total_num_steps={total} is less than the warmup length {w} "
                   "(DeepSpeed warms up over max(2, warmup_num_steps) steps)")
    return total


# ---------------------------------------------------------------- optax's schedules


def _linear_raw(init: float, end: float, steps: int) -> Callable[[int], float]:
    if steps == 0:
        return lambda k: end

    def raw(k: int) -> float:
        # optax's polynomial_schedule with power 1, in its operation order.
        return (init - end) * (1 - min(k, steps) / steps) + end

    return raw


def _cosine_raw(init: float, steps: int, alpha: float) -> Callable[[int], float]:
    def raw(k: int) -> float:
        cosine = 0.5 * (1 + math.cos(math.pi * min(k, steps) / steps))
        return init * ((1 - alpha) * cosine + alpha)

    return raw


def _join_raw(raws: Sequence[Callable[[int], float]], bounds: Sequence[int]):
    def raw(k: int) -> float:
        i = 0
        while i < len(bounds) and k >= bounds[i]:
            i += 1
        return raws[i](k - (bounds[i - 1] if i else 0))

    return raw


def constant(value: float) -> Schedule:
    """The same learning rate at every update (optax's ``constant_schedule``).

    Args:
        value: the learning rate, a finite number.

    Returns:
        A schedule ``fn(count) -> value``.

    Raises:
        TypeError, ValueError: ``value`` is not a finite number.

    Example:
        >>> constant(0.1)(0), constant(0.1)(10_000)
        (0.1, 0.1)
    """
    v = _number("constant", "value", value)
    return _wrap(f"constant(value={v!r})", "constant", lambda k: v)


def linear(init_value: float, end_value: float, transition_steps: int) -> Schedule:
    """Linear interpolation from ``init_value`` to ``end_value`` (optax's ``linear_schedule``).

    ``lr(k) = init_value + (end_value - init_value) * min(k, T) / T`` with
    ``T = transition_steps``: ``init_value`` at ``k = 0``, ``end_value`` from ``k = T`` on.
    ``T = 0`` gives ``end_value`` at every count (the transition is complete at once; optax
    instead holds ``init_value`` in that degenerate case).

    Args:
        init_value: learning rate at count 0.
        end_value: learning rate from count ``transition_steps`` on.
        transition_steps: length of the ramp, an integer >= 0.

    Returns:
        A schedule.

    Raises:
        TypeError, ValueError: a value is not finite or ``transition_steps`` is negative.

    Example:
        >>> f = linear(1.0, 0.0, 4)
        >>> [f(k) for k in range(6)]
        [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    """
    name = "linear"
    a = _number(name, "init_value", init_value)
    b = _number(name, "end_value", end_value)
    t = _steps(name, "transition_steps", transition_steps)
    return _wrap(f"linear(init_value={a!r}, end_value={b!r}, transition_steps={t})", name,
                 _linear_raw(a, b, t))


def cosine_decay(init_value: float, decay_steps: int, alpha: float = 0.0) -> Schedule:
    """Cosine decay from ``init_value`` to ``alpha * init_value``.

    optax's ``cosine_decay_schedule`` with ``exponent=1``.

    ``lr(k) = init_value * ((1 - alpha) * 0.5 * (1 + cos(pi * min(k, D) / D)) + alpha)``
    with ``D = decay_steps``.

    Args:
        init_value: learning rate at count 0.
        decay_steps: length of the decay, an integer >= 1.
        alpha: final learning rate as a fraction of ``init_value``.

    Returns:
        A schedule.

    Raises:
        TypeError, ValueError: ``decay_steps < 1`` or a value is not finite.

    Example:
        >>> f = cosine_decay(1.0, 4, alpha=0.1)
        >>> [round(f(k), 4) for k in (0, 2, 4, 9)]
        [1.0, 0.55, 0.1, 0.1]
    """
    name = "cosine_decay"
    a = _number(name, "init_value", init_value)
    d = _steps(name, "decay_steps", decay_steps, minimum=1)
    al = _number(name, "alpha", alpha)
    return _wrap(f"cosine_decay(init_value={a!r}, decay_steps={d}, alpha={al!r})", name,
                 _cosine_raw(a, d, al))


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """Run ``schedules`` one after another (optax's ``join_schedules``).

    For ``boundaries[i-1] <= count < boundaries[i]`` the value is
    ``schedules[i](count - boundaries[i-1])``: each schedule counts from its own start.

    Args:
        schedules: ``n`` schedules.
        boundaries: ``n - 1`` non-decreasing integer counts >= 0.

    Returns:
        A schedule.

    Raises:
        TypeError, ValueError: the lengths do not match, a schedule is not callable, or the
            boundaries are negative or decreasing.

    Example:
        >>> f = join_schedules([constant(1.0), linear(1.0, 0.0, 2)], [3])
        >>> [f(k) for k in range(6)]
        [1.0, 1.0, 1.0, 1.0, 0.5, 0.0]
    """
    name = "join_schedules"
    fns = list(schedules)
    if not fns or not all(callable(f) for f in fns):
        raise _err(name, f"schedules must be a non-empty sequence of callables, got {schedules!r}",
                   TypeError)
    bounds = [_steps(name, f"boundaries[{i}]", b) for i, b in enumerate(boundaries)]
    if len(bounds) != len(fns) - 1:
        raise _err(name, f"expected {len(fns) - 1} boundaries for {len(fns)} schedules, "
                   f"got {len(bounds)}")
    if any(b1 < b0 for b0, b1 in zip(bounds, bounds[1:])):
        raise _err(name, f"boundaries must be non-decreasing, got {bounds}")
    return _wrap(f"join_schedules(boundaries={bounds})", name, _join_raw(fns, bounds))


def linear_warmup(peak: float, warmup: int) -> Schedule:
    """Linear warmup from 0 to ``peak`` over ``warmup`` updates, then constant ``peak``.

    ``lr(k) = peak * min(k, warmup) / warmup`` (optax's ``linear_schedule(0, peak, warmup)``):
    0 at count 0, ``peak`` from count ``warmup`` on. ``warmup = 0`` is a constant ``peak``.

    Args:
        peak: the learning rate after warmup.
        warmup: number of warmup updates, an integer >= 0.

    Returns:
        A schedule.

    Raises:
        TypeError, ValueError: ``peak`` is not finite or ``warmup`` is negative.

    Example:
        >>> f = linear_warmup(1.0, warmup=4)
        >>> [f(k) for k in range(6)]
        [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """
    name = "linear_warmup"
    p = _number(name, "peak", peak)
    w = _steps(name, "warmup", warmup)
    return _wrap(f"linear_warmup(peak={p!r}, warmup={w})", name, _linear_raw(0.0, p, w))


def warmup_cosine(peak: float, warmup: int, total: int, end: float = 0.0) -> Schedule:
    """Linear warmup to ``peak``, then cosine decay to ``end`` at count ``total``.

    Equal to optax's ``warmup_cosine_decay_schedule(init_value=0, peak_value=peak,
    warmup_steps=warmup, decay_steps=total, end_value=end)``; note ``total`` includes the
    warmup, as optax's ``decay_steps`` does. With ``D = total - warmup``:

    * ``k < warmup``: ``lr(k) = peak * k / warmup``;
    * ``k >= warmup``: ``lr(k) = peak * ((1 - a) * c + a)`` with
      ``c = 0.5 * (1 + cos(pi * min(k - warmup, D) / D))`` and ``a = end / peak``
      (``a = 0`` when ``peak == 0``), i.e. ``end`` from ``total`` on.

    Args:
        peak: learning rate at count ``warmup``.
        warmup: number of warmup updates, an integer >= 0.
        total: count at which the decay reaches ``end``; ``total > warmup``.
        end: final learning rate.

    Returns:
        A schedule.

    Raises:
        TypeError, ValueError: a value is not finite, ``warmup < 0`` or ``total <= warmup``.

    Example:
        >>> f = warmup_cosine(1.0, warmup=2, total=6, end=0.1)
        >>> [round(f(k), 3) for k in (0, 1, 2, 4, 6, 100)]
        [0.0, 0.5, 1.0, 0.55, 0.1, 0.1]
    """
    name = "warmup_cosine"
    p = _number(name, "peak", peak)
    w = _steps(name, "warmup", warmup)
    t = _steps(name, "total", total)
    e = _number(name, "end", end)
    if t <= w:
        raise _err(name, f"total must be greater than warmup (total counts the warmup too, "
                   f"as optax's decay_steps does), got total={t}, warmup={w}")
    alpha = 0.0 if p == 0.0 else e / p
    raw = _join_raw([_linear_raw(0.0, p, w), _cosine_raw(p, t - w, alpha)], [w])
    return _wrap(f"warmup_cosine(peak={p!r}, warmup={w}, total={t}, end={e!r})", name, raw)


# ------------------------------------------------------------- DeepSpeed's schedules


def WarmupLR(base_lr: float | None = None, /, **params: Any) -> Schedule:  # noqa: N802
    """DeepSpeed's ``WarmupLR``: warm up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold.

    With ``lo = warmup_min_lr``, ``hi = warmup_max_lr``, ``W = max(2, warmup_num_steps)`` and
    ``j = count - 1`` (see the module docstring):

    * ``count == 0``: ``lo`` (what the constructor writes);
    * ``j < W``: ``lo + (hi - lo) * g`` with ``g = ln(j + 1) / ln(W)`` for ``"log"``,
      ``g = j / W`` for ``"linear"``;
    * ``j >= W``: ``hi``.

    So a log warmup reaches ``hi`` at count ``W``, a linear one at count ``W + 1``.

    Args:
        base_lr: positional only, not a DeepSpeed parameter: the optimizer's learning rate,
            which DeepSpeed uses as ``warmup_max_lr`` when that is not given. Without both,
            ``warmup_max_lr`` is 0.001 (DeepSpeed's documented default).
        **params: DeepSpeed's ``warmup_min_lr=0.0``, ``warmup_max_lr``,
            ``warmup_num_steps=1000``, ``warmup_type="log"`` (or ``"linear"``),
            ``last_batch_iteration=-1`` (only -1 is accepted).

    Returns:
        A schedule.

    Raises:
        TypeError: an unknown parameter name (the message lists the valid ones) or a value
            of the wrong type.
        ValueError: ``warmup_num_steps < 1``, an unknown ``warmup_type``, a negative rate.

    Example:
        >>> f = WarmupLR(warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=4,
        ...              warmup_type="linear")
        >>> [f(k) for k in range(7)]
        [0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """
    name = "WarmupLR"
    p = _params(name, params, {"warmup_min_lr": 0.0, "warmup_max_lr": None,
                               "warmup_num_steps": 1000, "warmup_type": "log",
                               "last_batch_iteration": -1})
    lo = _number(name, "warmup_min_lr", p["warmup_min_lr"], nonneg=True)
    if p["warmup_max_lr"] is not None:
        hi = _number(name, "warmup_max_lr", p["warmup_max_lr"], nonneg=True)
    elif base_lr is not None:
        hi = _number(name, "base_lr", base_lr, nonneg=True)
    else:
        hi = 0.001
    warmup = _warmup(name, p)
    w, _, kind = warmup
    delta = hi - lo
    raw = _warmup_raw(warmup, lo, lambda gamma: lo + delta * gamma, lambda j: lo + delta * 1.0)
    return _wrap(f"WarmupLR(warmup_min_lr={lo!r}, warmup_max_lr={hi!r}, warmup_num_steps={w}, "
                 f"warmup_type={kind!r})", name, raw)


def WarmupDecayLR(**params: Any) -> Schedule:  # noqa: N802
    """DeepSpeed's ``WarmupDecayLR``: :func:`WarmupLR`'s warmup, then a linear decay to ``lo``.

    With ``lo``, ``hi``, ``W``, ``j = count - 1`` as in :func:`WarmupLR` and
    ``T = total_num_steps``:

    * ``count == 0``: ``lo``;
    * ``j < W``: the warmup of :func:`WarmupLR`;
    * ``j >= W``: ``lo + (hi - lo) * max(0, (T - j) / max(1, T - W))``: ``hi`` at count
      ``W + 1``, ``lo`` from count ``T + 1`` on.

    Args:
        **params: DeepSpeed's ``total_num_steps`` (required), ``warmup_min_lr=0.0``,
            ``warmup_max_lr=0.001``, ``warmup_num_steps=1000``, ``warmup_type="log"``,
            ``last_batch_iteration=-1`` (only -1 is accepted).

    Returns:
        A schedule.

    Raises:
        TypeError: an unknown or missing parameter, or a value of the wrong type.
        ValueError: as :func:`WarmupLR`, and ``total_num_steps < W`` (DeepSpeed only warns).

    Example:
        >>> f = WarmupDecayLR(total_num_steps=10, warmup_max_lr=1.0, warmup_num_steps=4,
        ...                   warmup_type="linear")
        >>> [round(f(k), 4) for k in (0, 1, 2, 5, 8, 11, 50)]
        [0.0, 0.0, 0.25, 1.0, 0.5, 0.0, 0.0]
    """
    name = "WarmupDecayLR"
    p = _params(name, params, {"total_num_steps": _REQUIRED, "warmup_min_lr": 0.0,
                               "warmup_max_lr": 0.001, "warmup_num_steps": 1000,
                               "warmup_type": "log", "last_batch_iteration": -1})
    lo = _number(name, "warmup_min_lr", p["warmup_min_lr"], nonneg=True)
    hi = _number(name, "warmup_max_lr", p["warmup_max_lr"], nonneg=True)
    warmup = _warmup(name, p)
    w, _, kind = warmup
    total = _total(name, p, w)
    delta = hi - lo

    def decay(j: int) -> float:
        return lo + delta * max(0.0, float(total - j) / float(max(1.0, total - w)))

    raw = _warmup_raw(warmup, lo, lambda gamma: lo + delta * gamma, decay)
    return _wrap(f"WarmupDecayLR(total_num_steps={total}, warmup_min_lr={lo!r}, "
                 f"warmup_max_lr={hi!r}, warmup_num_steps={w}, warmup_type={kind!r})", name, raw)


def WarmupCosineLR(base_lr: float, **params: Any) -> Schedule:  # noqa: N802
    """DeepSpeed's ``WarmupCosineLR``: ``base_lr`` times a warmup-then-cosine ratio.

    DeepSpeed scales the optimizer's learning rate; ``base_lr`` is that learning rate. With
    ``W = max(2, warmup_num_steps)``, ``T = total_num_steps``, ``j = count - 1``,
    ``wmin = warmup_min_ratio``, ``cmin = cos_min_ratio``, ``lr = base_lr * r``:

    * ``count == 0``: ``r = 0`` (DeepSpeed's ``get_lr()`` before the first ``step()``
      returns 0.0, not ``wmin``);
    * ``j < W``: ``r = wmin + (1 - wmin) * g``, ``g`` as in :func:`WarmupLR`;
    * ``j >= W``: ``r = max(0, cmin + (1 - cmin) * (1 + cos(pi * p)) / 2)`` with
      ``p = min(1, (j - W + 1) / max(1, T - W))``: ``cmin`` from count ``T`` on.

    Args:
        base_lr: the optimizer's learning rate (the ratio's 1.0).
        **params: DeepSpeed's ``total_num_steps`` (required), ``warmup_min_ratio=0.0``,
            ``warmup_num_steps=1000``, ``cos_min_ratio=0.0001``, ``warmup_type="log"``,
            ``last_batch_iteration=-1`` (only -1 is accepted).

    Returns and raises as :func:`WarmupDecayLR`.

    Example:
        >>> f = WarmupCosineLR(2.0, total_num_steps=10, warmup_num_steps=4,
        ...                    cos_min_ratio=0.0, warmup_type="linear")
        >>> [round(f(k), 4) for k in (0, 1, 2, 4, 7, 10, 11)]
        [0.0, 0.0, 0.5, 1.5, 1.0, 0.0, 0.0]
    """
    name = "WarmupCosineLR"
    lr0 = _number(name, "base_lr", base_lr, nonneg=True)
    p = _params(name, params, {"total_num_steps": _REQUIRED, "warmup_min_ratio": 0.0,
                               "warmup_num_steps": 1000, "cos_min_ratio": 0.0001,
                               "warmup_type": "log", "last_batch_iteration": -1})
    wmin = _number(name, "warmup_min_ratio", p["warmup_min_ratio"], nonneg=True)
    cmin = _number(name, "cos_min_ratio", p["cos_min_ratio"], nonneg=True)
    warmup = _warmup(name, p)
    w, _, kind = warmup
    total = _total(name, p, w)

    def cosine(j: int) -> float:
        progress = min(1.0, (j - w + 1) / max(1, total - w))
        ratio = (1 + math.cos(math.pi * progress)) / 2
        return lr0 * max(0.0, cmin + (1.0 - cmin) * ratio)

    raw = _warmup_raw(warmup, 0.0, lambda gamma: lr0 * (wmin + gamma * (1.0 - wmin)), cosine)
    return _wrap(f"WarmupCosineLR(base_lr={lr0!r}, total_num_steps={total}, "
                 f"warmup_min_ratio={wmin!r}, warmup_num_steps={w}, cos_min_ratio={cmin!r}, "
                 f"warmup_type={kind!r})", name, raw)


def OneCycle(**params: Any) -> Schedule:  # noqa: N802
    """DeepSpeed's ``OneCycle`` (1Cycle, Smith 2018, arXiv:1803.09820): up, down, then decay.

    With ``lo = cycle_min_lr``, ``hi = cycle_max_lr``, ``S1 = cycle_first_step_size``,
    ``S2 = cycle_second_step_size`` (default ``S1``), ``C = S1 + S2`` and ``k = count``
    (DeepSpeed's ``last_batch_iteration + 1`` is exactly ``k``):

    * ``k <= S1``: ``lo + (hi - lo) * k / S1``;
    * ``S1 < k <= C``: ``lo + (hi - lo) * (C - k) / S2``;
    * with ``n`` stairs in that half (``cycle_first_stair_count``,
      ``cycle_second_stair_count`` default the first; 0 = none) the fraction is floored to a
      multiple of ``1/n``: ``floor(n * k / S1) / n``, resp. ``floor(n * (C - k) / S2) / n``;
    * ``k > C``: ``lo / (1 + decay_lr_rate * (k - C) / decay_step_size)``, or ``lo`` when
      ``decay_step_size`` or ``decay_lr_rate`` is 0.

    Momentum: DeepSpeed also cycles the optimizer's ``betas[0]`` between ``cycle_max_mom``
    and ``cycle_min_mom`` when ``cycle_momentum`` is true (its default). A schedule only
    gives a learning rate, and fzero's optimizers keep their betas fixed, so fzero does
    *not* cycle momentum: ``cycle_momentum``, ``cycle_min_mom``, ``cycle_max_mom`` and
    ``decay_mom_rate`` are accepted and checked (so DeepSpeed configs load) and otherwise
    ignored, and ``cycle_momentum=True`` (the default) emits a ``UserWarning`` saying so.
    Pass ``cycle_momentum=False`` to state that no momentum cycling is wanted.

    Args:
        **params: DeepSpeed's ``cycle_min_lr`` and ``cycle_max_lr`` (required),
            ``decay_lr_rate=0.0``, ``cycle_first_step_size=2000``,
            ``cycle_second_step_size=None``, ``cycle_first_stair_count=0``,
            ``cycle_second_stair_count=None``, ``decay_step_size=0``,
            ``cycle_momentum=True``, ``cycle_min_mom=0.8``, ``cycle_max_mom=0.9``,
            ``decay_mom_rate=0.0``, ``last_batch_iteration=-1`` (only -1 is accepted).

    Returns:
        A schedule.

    Raises:
        TypeError: an unknown or missing parameter, or a value of the wrong type.
        ValueError: ``cycle_first_step_size < 1``, a negative size, count or rate.

    Example:
        >>> f = OneCycle(cycle_min_lr=0.1, cycle_max_lr=0.5, cycle_first_step_size=4,
        ...              decay_lr_rate=0.5, decay_step_size=2, cycle_momentum=False)
        >>> [round(f(k), 4) for k in (0, 2, 4, 6, 8, 10, 12)]
        [0.1, 0.3, 0.5, 0.3, 0.1, 0.0667, 0.05]
    """
    name = "OneCycle"
    p = _params(name, params, {
        "cycle_min_lr": _REQUIRED, "cycle_max_lr": _REQUIRED, "decay_lr_rate": 0.0,
        "cycle_first_step_size": 2000, "cycle_second_step_size": None,
        "cycle_first_stair_count": 0, "cycle_second_stair_count": None, "decay_step_size": 0,
        "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
        "decay_mom_rate": 0.0, "last_batch_iteration": -1})
    lo = _number(name, "cycle_min_lr", p["cycle_min_lr"], nonneg=True)
    hi = _number(name, "cycle_max_lr", p["cycle_max_lr"], nonneg=True)
    rate = _number(name, "decay_lr_rate", p["decay_lr_rate"], nonneg=True)
    s1 = float(_steps(name, "cycle_first_step_size", p["cycle_first_step_size"], minimum=1))
    s2 = s1 if p["cycle_second_step_size"] is None else float(
        _steps(name, "cycle_second_step_size", p["cycle_second_step_size"]))
    n1 = _steps(name, "cycle_first_stair_count", p["cycle_first_stair_count"])
    n2 = n1 if p["cycle_second_stair_count"] is None else _steps(
        name, "cycle_second_stair_count", p["cycle_second_stair_count"])
    decay_size = _steps(name, "decay_step_size", p["decay_step_size"])
    if _flag(name, "cycle_momentum", p["cycle_momentum"]):
        warnings.warn("fzero.optim.schedules.OneCycle: cycle_momentum is true, but fzero does "
                      "not cycle momentum (its optimizers' betas are fixed); only the learning "
                      "rate follows the cycle. Pass cycle_momentum=False to silence this.",
                      UserWarning, stacklevel=2)
    for mom in ("cycle_min_mom", "cycle_max_mom", "decay_mom_rate"):
        _number(name, mom, p[mom])
    total = s1 + s2
    step_ratio = s1 / total
    skip_decay = decay_size == 0 or math.isclose(rate, 0)

    def raw(k: int) -> float:
        if k - 1 < total:  # DeepSpeed: last_batch_iteration < total_size
            # DeepSpeed's _get_scale_factor with batch_iteration = last_batch_iteration + 1 = k.
            cycle = math.floor(1 + k / total)
            x = 1.0 + k / total - cycle
            if x <= step_ratio:
                scale, stairs = x / step_ratio, n1
            else:
                scale, stairs = (x - 1) / (step_ratio - 1), n2
            if stairs > 0:
                pos = k % total
                if pos <= s1:
                    pos = pos * stairs / s1
                else:
                    pos = (total - pos) * stairs / s2
                scale = math.floor(pos) / stairs
            return lo + (hi - lo) * scale
        if skip_decay:
            return lo
        decay_interval = ((k - 1) - total + 1) / decay_size
        return lo / (1 + rate * decay_interval)

    return _wrap(f"OneCycle(cycle_min_lr={lo!r}, cycle_max_lr={hi!r}, "
                 f"cycle_first_step_size={int(s1)}, cycle_second_step_size={int(s2)}, "
                 f"cycle_first_stair_count={n1}, cycle_second_stair_count={n2}, "
                 f"decay_lr_rate={rate!r}, decay_step_size={decay_size})", name, raw)


def LRRangeTest(**params: Any) -> Schedule:  # noqa: N802
    """DeepSpeed's ``LRRangeTest``: a learning rate that grows with the update count.

    With ``lo = lr_range_test_min_lr``, ``s = lr_range_test_step_size``,
    ``r = lr_range_test_step_rate`` and ``k = count`` (DeepSpeed's
    ``last_batch_iteration + 1``): ``lr(k) = lo * (1 + r * k / s)``, or with
    ``lr_range_test_staircase`` ``lo * (1 + r * floor(k / s))``.

    Args:
        **params: DeepSpeed's ``lr_range_test_min_lr=0.001``,
            ``lr_range_test_step_size=2000``, ``lr_range_test_step_rate=1.0``,
            ``lr_range_test_staircase=False``, ``last_batch_iteration=-1`` (only -1).

    Returns:
        A schedule.

    Raises:
        TypeError: an unknown parameter, or a value of the wrong type.
        ValueError: ``lr_range_test_step_size < 1``, a negative rate.

    Example:
        >>> f = LRRangeTest(lr_range_test_min_lr=0.01, lr_range_test_step_size=10,
        ...                 lr_range_test_step_rate=2.0, lr_range_test_staircase=True)
        >>> [round(f(k), 4) for k in (0, 9, 10, 25)]
        [0.01, 0.01, 0.03, 0.05]
    """
    name = "LRRangeTest"
    p = _params(name, params, {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2000,
                               "lr_range_test_step_rate": 1.0,
                               "lr_range_test_staircase": False, "last_batch_iteration": -1})
    lo = _number(name, "lr_range_test_min_lr", p["lr_range_test_min_lr"], nonneg=True)
    size = _steps(name, "lr_range_test_step_size", p["lr_range_test_step_size"], minimum=1)
    rate = _number(name, "lr_range_test_step_rate", p["lr_range_test_step_rate"], nonneg=True)
    staircase = _flag(name, "lr_range_test_staircase", p["lr_range_test_staircase"])

    def raw(k: int) -> float:
        interval = float(k) / size
        if staircase:
            interval = math.floor(interval)
        return lo * (1 + rate * interval)

    return _wrap(f"LRRangeTest(lr_range_test_min_lr={lo!r}, lr_range_test_step_size={size}, "
                 f"lr_range_test_step_rate={rate!r}, lr_range_test_staircase={staircase})",
                 name, raw)
