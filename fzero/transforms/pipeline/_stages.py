"""Stages: what a pipeline stage is, how an ``nn.Sequential`` is cut into stages, and which
parameters each stage owns (a name owned by several stages is a tied weight)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import torch
from torch.func import functional_call

from fzero._params import like_params

WHERE = "fzero.pipeline"


class StageError(ValueError):
    """A stage cannot run on what it is given (raised on every rank of the pipeline)."""


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pipeline stage: a pure function and the parameter names it owns.

    Attributes:
        fn: ``fn(params, x) -> y``; ``params`` holds exactly ``keys``.
        keys: names in the params dict this stage uses. A name owned by several stages is a
            *tied* weight (an embedding used again as the head): each of those stages holds
            a copy, and their gradients are summed before the update, so the copies stay
            equal.
        in_shape: optional trailing dims the stage expects of its input (e.g. ``(64,)``);
            checked before the first step, so a mismatch names both shapes.
        buffers: the model's buffers (by ``named_buffers()`` name) the stage runs on:
            :func:`split` fills it, and a pipelined state keeps these in ``state.buffers``
            (updated by the stage's forward, restored on a skipped update, checkpointed). A
            stage written by hand (``Stage(fn, keys)``) runs on whatever buffers its ``fn``
            holds; the state keeps none for it.
    """

    fn: Callable
    keys: tuple[str, ...]
    in_shape: tuple[int, ...] | None = None
    buffers: tuple[str, ...] = ()

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"{WHERE}.Stage: fn must be callable as fn(params, x), got {type(self.fn).__name__}")
        if isinstance(self.keys, str) or not isinstance(self.keys, Iterable):
            raise TypeError(f"{WHERE}.Stage: keys must be a sequence of parameter names, got {self.keys!r}")
        object.__setattr__(self, "keys", tuple(dict.fromkeys(self.keys)))
        if self.in_shape is not None:
            object.__setattr__(self, "in_shape", tuple(int(d) for d in self.in_shape))
        object.__setattr__(self, "buffers", tuple(dict.fromkeys(self.buffers)))


class _ModuleStage:
    """``params, x -> sub(x)`` for a slice of an ``nn.Sequential``, parameters (and buffers)
    by the full model's names."""

    def __init__(self, sub: torch.nn.Module, names: dict[str, str], buffer_names: dict[str, str] | None = None):
        self.sub, self.names = sub, names  # names: the slice's own name -> the full model's
        self.buffer_names = buffer_names or {}

    def __call__(self, params: dict, x, buffers: dict | None = None):
        """With ``buffers`` (the state's, by the full model's names) the slice runs on them, so
        a forward that updates a buffer (BatchNorm) updates the state's; else on its own."""
        given = {local: params[full] for local, full in self.names.items()}
        if buffers is None:
            given.update(dict(self.sub.named_buffers()))
        else:
            given.update({local: buffers[full] for local, full in self.buffer_names.items()})
        return functional_call(self.sub, given, (x,), strict=True, tie_weights=True)

    def __repr__(self) -> str:
        return f"<stage {type(self.sub).__name__} of {len(self.sub)} modules>"


_ELEMENTWISE = (torch.nn.Tanh, torch.nn.ReLU, torch.nn.GELU, torch.nn.SiLU, torch.nn.Sigmoid,
                torch.nn.Dropout, torch.nn.Identity)


def _expected_shape(sub: torch.nn.Module) -> tuple[int, ...] | None:
    """Trailing input dims of a slice, read from its first layer where that layer says."""
    for m in sub.modules():
        if next(m.children(), None) is not None:
            continue
        if isinstance(m, torch.nn.Linear):
            return (m.in_features,)
        if isinstance(m, torch.nn.LayerNorm):
            return tuple(m.normalized_shape)
        if not isinstance(m, _ELEMENTWISE):
            return None
    return None


def split(module: torch.nn.Sequential, boundaries: Sequence[int]) -> list[Stage]:
    """Cut an ``nn.Sequential`` into stages at the given child indices.

    Args:
        module: the model, an ``nn.Sequential`` (the ``apply`` of ``fzero.functionalize``
            of it gives the params dict these stages index).
        boundaries: indices of the children that start stages 1, 2, ...: ``[2, 5]`` gives
            ``module[0:2]``, ``module[2:5]``, ``module[5:]``.

    Returns:
        One :class:`Stage` per slice; its ``keys`` are the full model's parameter names
        (a weight shared by two slices is a tied weight of both), its ``in_shape`` read
        from the slice's first ``Linear`` or ``LayerNorm`` where there is one.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``.
        ValueError: boundaries not strictly increasing inside ``(0, len(module))``.

    Example:
        >>> import torch, fzero
        >>> stages = fzero.transforms.pipeline.split(torch.nn.Sequential(
        ...     torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)), [2])
        >>> [s.keys for s in stages]
        [('0.weight', '0.bias'), ('2.weight', '2.bias')]
    """
    if not isinstance(module, torch.nn.Sequential):
        raise TypeError(f"{WHERE}.split: expected an nn.Sequential, got {type(module).__name__} "
                        "(write the stages as fzero.pipeline.Stage(fn, keys) instead)")
    n = len(module)
    cuts = [0, *[int(b) for b in boundaries], n]
    if any(b <= a for a, b in zip(cuts, cuts[1:])):
        raise ValueError(f"{WHERE}.split: boundaries {list(boundaries)} must increase strictly inside (0, {n})")
    full: dict[int, str] = {}
    for name, p in module.named_parameters():
        full.setdefault(id(p), name)
    stages = []
    full_buffers: dict[int, str] = {}
    for name, b in module.named_buffers():
        full_buffers.setdefault(id(b), name)
    for a, b in zip(cuts, cuts[1:]):
        sub = module[a:b]
        names = {local: full[id(p)] for local, p in sub.named_parameters(remove_duplicate=False)}
        bnames = {local: full_buffers[id(t)] for local, t in sub.named_buffers(remove_duplicate=False)}
        stages.append(Stage(_ModuleStage(sub, names, bnames), tuple(names.values()), _expected_shape(sub),
                            tuple(bnames.values())))
    return stages


def _as_stage(s, i: int) -> Stage:
    if isinstance(s, Stage):
        return s
    if isinstance(s, tuple) and len(s) in (2, 3):
        return Stage(*s)
    raise TypeError(f"{WHERE}: stage {i} must be a fzero.pipeline.Stage(fn, keys) or a pair (fn, keys), "
                    f"got {type(s).__name__}" + (" (a bare function does not say which parameters it owns)"
                                                 if callable(s) else ""))


def held_by_rank(stages: Sequence[Stage], ranks: int) -> list[Stage]:
    """What each of ``ranks`` ranks holds when rank ``r`` runs stages ``r, r + ranks, ...``:
    one :class:`Stage` per rank whose keys and buffers are those of its stages together, in
    stage order (its ``fn`` is its first stage's; a name used by several stages of one rank
    is held once). With one stage per rank, the stages themselves."""
    if len(stages) == ranks:
        return list(stages)
    held = []
    for r in range(ranks):
        mine = stages[r::ranks]
        held.append(Stage(mine[0].fn, tuple(k for st in mine for k in st.keys),
                          buffers=tuple(b for st in mine for b in st.buffers)))
    return held


def stage_params(stages: Sequence[Stage], stage: int, params: dict) -> dict:
    """Stage ``stage``'s entries of ``params``, keeping which are frozen (for ``Pipeline.stage_params``)."""
    if not isinstance(params, dict):
        raise TypeError(f"{WHERE}: params must be a dict of parameters by name, got {type(params).__name__}")
    keys = stages[stage].keys
    missing = [k for k in keys if k not in params]
    if missing:
        raise KeyError(f"{WHERE}: stage {stage}'s parameters are missing from params: {missing[:8]}"
                       + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    return like_params(params, {k: params[k] for k in keys})  # keep which are frozen, and the layout
