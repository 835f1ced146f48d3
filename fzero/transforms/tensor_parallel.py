"""``tensor_parallel``: Megatron-style tensor parallelism over the mesh's ``tp`` axis.

A *plan* maps module names (globs, as ``fnmatch`` reads them) to a style, named as
``torch.distributed.tensor.parallel`` names them:

* :class:`ColwiseParallel` -- an ``nn.Linear`` whose output features are split over the
  ``tp`` ranks (rows of ``weight``, and ``bias``). Its input is whole on every rank; its
  output is this rank's slice of the features. Megatron's *f* stands in front: identity
  forward, all-reduce of the input's gradient backward (each rank's slice contributes to it).
* :class:`RowwiseParallel` -- an ``nn.Linear`` whose input features are split (columns of
  ``weight``; ``bias`` whole). Its input is the slice a column-parallel layer produced; the
  partial products are summed by Megatron's *g* -- all-reduce forward, identity backward --
  and the bias is added once, after the sum.

A column-parallel layer followed by a row-parallel one (an MLP, attention's QKV and output
projection with the heads split) costs one all-reduce of the activation forward and one
backward. Every other tensor stays whole and identical on every ``tp`` rank, and so do its
gradients (the all-reduces make every activation outside the pairs identical), so the
update needs no further communication.

This is the narrow thing rather than DTensor: the state holds each rank's slice as a plain
tensor, so ``shard_state`` partitions it over ``dp`` and the optimizer runs on it unchanged,
and the model's code runs unchanged (the planned modules' forwards are replaced at ``init``,
a few lines each) with no per-op dispatch on the step's path.

Reductions across parameters (``psum``: global-norm clipping, LAMB's trust ratios, the
overflow check of ``mixed_precision``) are exact: they name each leaf's parameter
(:class:`fzero.transforms.LeafSums`), and the handler counts a whole leaf on ``tp`` rank 0
only and sums over ``tp`` -- a split leaf's slices add up, a whole one is counted once.
What it does not do yet: checkpoints of a split state are refused.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import types
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from fzero import tree
from fzero._params import trainable, with_values
from fzero.distributed import comm
from fzero.distributed.mesh import Mesh
from fzero.transforms._core import Handler, Step, as_step, installed

__all__ = ["ColwiseParallel", "RowwiseParallel", "tensor_parallel"]

WHERE = "fzero.tensor_parallel"


# --------------------------------------------------------------------------- Megatron's f and g


class _CopyToTP(torch.autograd.Function):
    """Megatron's *f*: identity forward; backward, the sum of every ``tp`` rank's gradient."""

    @staticmethod
    def forward(ctx, x, group, timeout_s):
        ctx.group, ctx.timeout_s = group, timeout_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group, ctx.timeout_s, "all_reduce(tp: input gradient)"), None, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's *g*: forward, the sum of every ``tp`` rank's partial product; identity backward."""

    @staticmethod
    def forward(ctx, x, group, timeout_s):
        return _all_reduce(x, group, timeout_s, "all_reduce(tp: partial products)")

    @staticmethod
    def backward(ctx, g):
        return g, None, None


def _all_reduce(x: torch.Tensor, group, timeout_s: float, name: str, what: str = "tp") -> torch.Tensor:
    out = x.contiguous().clone()
    comm.run(f"{name}, {out.numel()} elements",
             lambda: comm.all_reduce(out, group=group, async_op=True, what=what),
             timeout_s=timeout_s, where=WHERE)
    return out


# --------------------------------------------------------------------------- styles


@dataclasses.dataclass(frozen=True)
class ColwiseParallel:
    """Split an ``nn.Linear``'s output features over ``tp`` (``weight`` dim 0, ``bias`` dim 0)."""

    dims = {"weight": 0, "bias": 0}

    @staticmethod
    def forward(module: torch.nn.Linear, x: torch.Tensor, group, timeout_s: float) -> torch.Tensor:
        return F.linear(_CopyToTP.apply(x, group, timeout_s), module.weight, module.bias)


@dataclasses.dataclass(frozen=True)
class RowwiseParallel:
    """Split an ``nn.Linear``'s input features over ``tp`` (``weight`` dim 1; ``bias`` whole,
    added once after the sum)."""

    dims = {"weight": 1}

    @staticmethod
    def forward(module: torch.nn.Linear, x: torch.Tensor, group, timeout_s: float) -> torch.Tensor:
        out = _ReduceFromTP.apply(F.linear(x, module.weight), group, timeout_s)
        return out if module.bias is None else out + module.bias


STYLES = (ColwiseParallel, RowwiseParallel)


# --------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class _Split:
    """One split parameter: the dim it is split on and its whole shape."""

    dim: int
    shape: tuple[int, ...]


def check_plan(plan: Any, where: str = WHERE) -> None:
    """``plan`` must map module-name globs (strings) to a style instance."""
    if not isinstance(plan, Mapping) or not plan:
        raise TypeError(f"{where}: the plan must be a non-empty dict of module-name globs to "
                        f"ColwiseParallel() / RowwiseParallel(), got {plan!r}")
    bad = [f"{k!r}: {v!r}" for k, v in plan.items() if not (isinstance(k, str) and isinstance(v, STYLES))]
    if bad:
        raise TypeError(f"{where}: plan entries must be 'glob': ColwiseParallel() or RowwiseParallel(); "
                        f"got {', '.join(bad)}")


def resolve_plan(module: torch.nn.Module, params: Mapping[str, torch.Tensor], plan: Mapping[str, Any],
                 tp: int) -> tuple[dict[str, Any], dict[str, _Split]]:
    """The planned modules by name, and the split of each of their parameters.

    Raises:
        ValueError: every problem at once -- a glob that matches no module, a matched module
            that is not an ``nn.Linear``, a parameter whose split dim does not divide by
            ``tp`` (named with its size), a split parameter tied to another name.
    """
    problems: list[str] = []
    modules = dict(module.named_modules())
    chosen: dict[str, Any] = {}
    for glob, style in plan.items():
        hits = [name for name in modules if name and fnmatch.fnmatchcase(name, glob)]
        if not hits:
            problems.append(f"glob {glob!r} matches no module (modules: {', '.join(list(modules)[1:9])}...)")
        for name in hits:
            chosen[name] = style
    aliases: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    splits: dict[str, _Split] = {}
    for name, style in chosen.items():
        m = modules[name]
        if not isinstance(m, torch.nn.Linear):
            problems.append(f"module {name!r} is a {type(m).__name__}; {type(style).__name__} splits nn.Linear")
            continue
        for pname, dim in style.dims.items():
            p = getattr(m, pname)
            if p is None:
                continue
            full = f"{name}.{pname}"
            tied = aliases.get(id(p), [full])
            if len(tied) > 1:
                problems.append(f"parameter {full!r} is tied to {[a for a in tied if a != full]}: a split "
                                "parameter cannot be shared")
            elif full not in params:
                problems.append(f"parameter {full!r} is not in state.params")
            elif params[full].shape[dim] % tp:
                problems.append(f"parameter {full!r} of shape {tuple(params[full].shape)}: dim {dim} "
                                f"({params[full].shape[dim]}) does not divide by tp={tp}")
            else:
                splits[full] = _Split(dim, tuple(params[full].shape))
    if problems:
        raise ValueError(f"{WHERE}: the plan does not fit the model:\n  " + "\n  ".join(problems))
    return chosen, splits


# --------------------------------------------------------------------------- the transform


class _TensorParallelHandler(Handler):
    """Makes ``psum`` exact across ``tp`` (its contract: :func:`fzero.transforms.psum`).

    A split leaf's partial sums differ on every ``tp`` rank and add up to the whole tensor's;
    a whole leaf's are the same on every ``tp`` rank (same values, same gradients), so only
    ``tp`` rank 0 counts it (``counted``), and every value is then summed over ``tp``. One
    all-reduce per ``psum``, of the size the optimizer asked for (a scalar for a global norm).
    """

    def __init__(self, group, rank: int, timeout_s: float, splits: Mapping[str, _Split]):
        self.group, self.rank, self.timeout_s = group, rank, timeout_s
        self.splits = splits  # filled by init: the split parameters by name
        self.names: frozenset[str] = frozenset()  # every parameter's name, from init

    def counted(self, names, *, next):
        unknown = sorted({repr(n) for n in names if n not in self.names})
        if unknown:
            raise ValueError(
                f"{WHERE}: a reduction across parameters (psum of LeafSums) named leaves that are not "
                f"parameters: {', '.join(unknown[:8])}; the leaves must be named as state.params names them "
                "(pass the trees keyed by parameter, not their flattened leaves), so that a split leaf "
                "is summed over tp and a whole one counted once")
        whole_counted_here = self.rank == 0
        return tuple(c and (n in self.splits or whole_counted_here) for n, c in zip(names, next(names)))

    def psum(self, value, *, next):
        return next(_all_reduce(value, self.group, self.timeout_s, "all_reduce(tp: psum)", what="psum"))


def tensor_parallel(step: Callable, mesh: Mesh | None = None, plan: Mapping[str, Any] | None = None) -> Step:
    """Tensor parallelism over the mesh's ``tp`` axis, as Megatron-LM splits layers.

    Every ``tp`` rank of a ``dp`` coordinate passes the same batch; each holds its slice of
    the planned layers' parameters (and, under ``shard_state``, ZeRO partitions that slice
    over ``dp``). The step computes the same update as the plain step.

    Args:
        step: ``train_step(state, batch) -> (state, metrics)``.
        mesh: the :class:`fzero.Mesh`, with a ``tp`` axis.
        plan: module-name globs to :class:`ColwiseParallel` / :class:`RowwiseParallel`.

    Returns:
        A :class:`Step`. ``init`` keeps this rank's slices (before the transforms inside it
        build anything on the parameters: make it the outermost transform but ``pipeline``).
        ``step.gather(params)`` gives the whole parameters on every rank.

    Raises:
        TypeError: a plan that is not globs to styles.
        ValueError: at ``init``, a plan that does not fit the model (every problem named).

    Example (a world of one, ``tp=1``: the plan is checked and the step runs unchanged):
        >>> import torch, fzero
        >>> from fzero import optim
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
        >>> apply, params = fzero.functionalize(model)
        >>> state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
        >>> plan = {"0": fzero.ColwiseParallel(), "2": fzero.RowwiseParallel()}
        >>> step = fzero.tensor_parallel(fzero.testing.mse_step, fzero.Mesh(dp=-1), plan)
        >>> state, m = step(step.init(state), {"x": torch.randn(3, 4), "y": torch.randn(3, 2)})
        >>> int(state.step)
        1
    """
    check_plan(plan)
    mesh = mesh if mesh is not None else Mesh(dp=-1)
    tp, rank, group = mesh.size("tp"), mesh.coords["tp"], mesh.group("tp")
    inner = as_step(step)
    splits: dict[str, _Split] = {}
    handler = _TensorParallelHandler(group, rank, mesh.timeout_s, splits)

    def before(state):
        module = getattr(state.apply_fn, "module", None)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"{WHERE}: state.apply_fn must come from fzero.functionalize(module): the plan "
                            "names the module's layers")
        if "master" in state.extra or any(hasattr(v, "__fzero_gather__") for v in tree.leaves(state.params)):
            raise ValueError(f"{WHERE}: this state is already partitioned or cast: make tensor_parallel "
                             "outside mixed_precision and shard_state (it chooses what they compute with)")
        chosen, found = resolve_plan(module, state.params, plan, tp)
        splits.clear()
        splits.update(found)
        handler.names = frozenset(state.params)
        timeout_s = mesh.timeout_s
        for name, style in chosen.items():
            if tp > 1:
                m = module.get_submodule(name)
                m.forward = types.MethodType(lambda self, x, style=style: style.forward(self, x, group, timeout_s), m)
        local = {name: state.params[name].detach().chunk(tp, dim=s.dim)[rank].clone() for name, s in splits.items()}
        params = with_values(state.params, local)
        return state.replace(params=params, opt_state=state.tx.init(trainable(params)))

    def call(state, batch):
        if tp == 1:
            return inner(state, batch)
        with installed(handler):
            return inner(state, batch)

    def gather(params: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The whole parameters, on every rank (ZeRO pieces gathered over ``dp`` first)."""
        from fzero.distributed.gather import gather as gather_dp

        params = gather_dp(params)
        out = dict(params)
        for name, s in splits.items():
            if tp == 1:
                continue
            piece = params[name].contiguous()
            full = torch.empty((tp,) + tuple(piece.shape), dtype=piece.dtype, device=piece.device)
            comm.run(f"all_gather(tp: {name})",
                     lambda: comm.all_gather_flat(full.view(-1), piece.view(-1), group=group, async_op=True,
                                                  what="tp"),
                     timeout_s=mesh.timeout_s, where=WHERE)
            out[name] = torch.cat(list(full.unbind(0)), dim=s.dim)
        return out

    out = Step(call, before=before, name=f"tensor_parallel({inner.__name__}, tp={tp})", inner=inner)
    out.gather = gather
    out.splits = splits
    return out
