"""Schedules: the order in which a stage runs its micro-batches' forwards and backwards, as
pure functions of the pipeline's shape (no tensors, no communication)."""

from __future__ import annotations

from typing import Literal

from fzero.transforms.pipeline._stages import WHERE

SCHEDULES = ("gpipe", "1f1b")


def schedule(kind: Literal["gpipe", "1f1b"], stages: int, micro_batches: int, stage: int) -> list[tuple[str, int]]:
    """The order in which ``stage`` runs forwards ``("F", j)`` and backwards ``("B", j)``.

    GPipe (Huang et al. 2019) runs every forward, then every backward: a stage holds ``m``
    micro-batches' activations. 1F1B (PipeDream-Flush, Narayanan et al. 2021) runs
    ``p - s - 1`` warm-up forwards, then alternates one forward and one backward: stage
    ``s`` never holds more than ``p - s`` micro-batches, whatever ``m``. Both leave the
    bubble ``(p - 1) / (m + p - 1)`` of the step with balanced stages and free
    communication (whatever a backward costs relative to a forward).

    Example:
        >>> schedule("1f1b", 2, 3, 0)
        [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
    """
    m, p = micro_batches, stages
    if kind == "gpipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
    if kind != "1f1b":
        raise ValueError(f"{WHERE}: schedule={kind!r} must be one of {', '.join(map(repr, SCHEDULES))}")
    warm = min(p - stage - 1, m)
    ops = [("F", j) for j in range(warm)]
    for k in range(m - warm):
        ops += [("F", warm + k), ("B", k)]
    return ops + [("B", j) for j in range(m - warm, m)]
