"""Schedules: the order in which a stage runs its micro-batches' forwards and backwards, as
pure functions of the pipeline's shape (no tensors, no communication), and the timeline
they give in unit slots (:func:`slots`), from which the bubble is counted."""

from __future__ import annotations

from typing import Literal

from fzero.transforms.pipeline._stages import WHERE

SCHEDULES = ("gpipe", "1f1b", "interleaved")

#: Slots a forward and a backward of one model chunk take in :func:`slots` (a backward
#: computes two products per forward product: the input's gradient and the weights').
FORWARD_SLOTS, BACKWARD_SLOTS = 1, 2


def check(kind: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> None:
    """Raise ``ValueError`` naming the option when ``kind``, ``virtual_stages`` and
    ``micro_batches`` do not make a schedule of ``stages`` ranks."""
    if kind not in SCHEDULES:
        raise ValueError(f"{WHERE}: schedule={kind!r} must be one of {', '.join(map(repr, SCHEDULES))}")
    v = virtual_stages
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{WHERE}: virtual_stages={v!r} must be a positive int")
    if kind != "interleaved" and v != 1:
        raise ValueError(f"{WHERE}: virtual_stages={v} needs schedule='interleaved' (schedule={kind!r} runs "
                         "one model chunk per rank)")
    if kind == "interleaved" and micro_batches % stages:
        raise ValueError(f"{WHERE}: schedule='interleaved' runs micro-batches in groups of the pp size: "
                         f"micro_batches={micro_batches} is not a multiple of pp={stages}")


def schedule(kind: Literal["gpipe", "1f1b", "interleaved"], stages: int, micro_batches: int, stage: int,
             virtual_stages: int = 1) -> list[tuple]:
    """The order in which rank ``stage`` runs forwards ``("F", j)`` and backwards ``("B", j)``.

    GPipe (Huang et al. 2019) runs every forward, then every backward: a stage holds ``m``
    micro-batches' activations. 1F1B (PipeDream-Flush, Narayanan et al. 2021) runs
    ``p - s - 1`` warm-up forwards, then alternates one forward and one backward: stage
    ``s`` never holds more than ``p - s`` micro-batches, whatever ``m``. Both leave the
    bubble ``(p - 1) / (m + p - 1)`` of the step with balanced stages and free
    communication (whatever a backward costs relative to a forward).

    ``"interleaved"`` (Megatron-LM's interleaved 1F1B, Narayanan et al. 2021): the model is
    cut into ``p * v`` chunks and rank ``r`` holds chunks ``r, r + p, ..., r + (v-1) p``
    (``v = virtual_stages``); the ops are triples ``("F", j, c)`` / ``("B", j, c)`` naming
    the micro-batch ``j`` and the model chunk ``c``. Forwards go through the rank's chunks
    in groups of ``p`` micro-batches (chunk ``r`` on micro-batches ``0..p-1``, then chunk
    ``r + p`` on them, ...), backwards through the chunks in reverse; rank ``r`` warms up
    with ``2 (p - r - 1) + (v - 1) p`` forwards (all of them when ``m == p``), then
    alternates. ``m`` must be a multiple of ``p``. The bubble is ``(p - 1) / (v m)`` of the
    compute (:func:`slots`): ``v`` times smaller than 1F1B's, for ``v`` times the sends.

    Example:
        >>> schedule("1f1b", 2, 3, 0)
        [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
        >>> schedule("interleaved", 2, 4, 1, virtual_stages=2)[:5]
        [('F', 0, 1), ('F', 1, 1), ('F', 0, 3), ('B', 0, 3), ('F', 1, 3)]
    """
    m, p, v = micro_batches, stages, virtual_stages
    check(kind, p, m, v)
    if kind == "gpipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
    if kind == "1f1b":
        warm = min(p - stage - 1, m)
        ops = [("F", j) for j in range(warm)]
        for k in range(m - warm):
            ops += [("F", warm + k), ("B", k)]
        return ops + [("B", j) for j in range(m - warm, m)]
    total = m * v
    warm = total if m == p else min(2 * (p - stage - 1) + (v - 1) * p, total)

    def at(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k % (p * v)) // p
        if not forward:
            chunk = v - 1 - chunk
        return (k // (p * v)) * p + k % p, chunk * p + stage

    ops = [("F", *at(k, True)) for k in range(warm)]
    for k in range(total - warm):
        ops += [("F", *at(warm + k, True)), ("B", *at(k, False))]
    return ops + [("B", *at(k, False)) for k in range(total - warm, total)]


def ops(kind: str, stages: int, micro_batches: int, stage: int, virtual_stages: int = 1) -> list[tuple[str, int, int]]:
    """:func:`schedule` with every op a triple ``(op, micro-batch, model chunk)`` (the chunk
    is ``stage`` itself for one chunk per rank)."""
    return [o if len(o) == 3 else (*o, stage) for o in schedule(kind, stages, micro_batches, stage, virtual_stages)]


def slots(kind: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> list[dict]:
    """Each rank's timeline when every rank runs its :func:`schedule` in order, a forward of
    one chunk taking ``FORWARD_SLOTS`` and a backward ``BACKWARD_SLOTS``, communication
    free: an op starts when its rank is free and its input has arrived (the previous
    chunk's forward of that micro-batch, or the next chunk's backward).

    Returns one dict per rank: ``busy`` and ``idle`` slots (idle counted up to the end of
    the last rank's last op: the step's length) and ``length``. ``idle / busy`` is the
    bubble fraction, ``(p - 1) / (v m)``.

    Raises:
        RuntimeError: the schedules deadlock (no rank can run its next op).
    """
    p, v = stages, virtual_stages
    n = p * v
    orders = [ops(kind, p, micro_batches, r, v) for r in range(p)]
    done: dict[tuple, int] = {}
    clock, pos, busy = [0] * p, [0] * p, [0] * p
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                op, j, c = orders[r][pos[r]]
                if op == "F":
                    dep = None if c == 0 else ("F", j, c - 1)
                else:
                    dep = ("F", j, c) if c == n - 1 else ("B", j, c + 1)
                if dep is not None and dep not in done:
                    break
                cost = FORWARD_SLOTS if op == "F" else BACKWARD_SLOTS
                clock[r] = max(clock[r], done.get(dep, 0)) + cost
                busy[r] += cost
                done[(op, j, c)] = clock[r]
                pos[r] += 1
                moved = True
    stuck = [r for r in range(p) if pos[r] < len(orders[r])]
    if stuck:
        raise RuntimeError(f"{WHERE}: schedule={kind!r} deadlocks: rank {stuck[0]} waits at "
                           f"{orders[stuck[0]][pos[stuck[0]]]}")
    length = max(clock)
    return [{"busy": busy[r], "idle": length - busy[r], "length": length} for r in range(p)]
