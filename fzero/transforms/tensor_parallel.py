"""``tensor_parallel``: Megatron-style tensor parallelism over the mesh's ``tp`` axis.

A *plan* maps module names (globs, as ``fnmatch`` reads them) to a style, named as
``torch.distributed.tensor.parallel`` names them:

* :class:`ColwiseParallel` -- an ``nn.Linear`` whose output features are split over the
  ``tp`` ranks (rows of ``weight``, and ``bias``). Its input is whole on every rank; its
  output is this rank's slice of the features. Megatron's *f* stands in front: identity
  forward, all-reduce of the input's gradient backward (each rank's slice contributes to it).
  ``ColwiseParallel(output="vocab")`` on a language-model head: the output is a
  :class:`VocabShardedLogits`, this rank's slice of the vocabulary standing for the whole
  logits, on which the user's ``F.cross_entropy`` is computed across the ranks (Megatron's
  vocab-parallel cross-entropy: three all-reduces of ``tokens`` elements) -- the logits are
  never gathered, and what would need them whole is refused by name.
* :class:`RowwiseParallel` -- an ``nn.Linear`` whose input features are split (columns of
  ``weight``; ``bias`` whole). Its input is the slice a column-parallel layer produced; the
  partial products are summed by Megatron's *g* -- all-reduce forward, identity backward --
  and the bias is added once, after the sum. On an ``nn.Embedding`` (as torch's
  ``RowwiseParallel``): the vocabulary (``weight`` rows) is split, each rank looks up the ids
  it holds (zeros for the others) and *g* sums them.

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
``init`` records the split in the state (:class:`TensorParallelLayout`), so
``fzero.checkpoint`` saves, reshards and exports it (a layer split block by block excepted).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import types
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fzero import tree
from fzero._params import trainable, with_values
from fzero.distributed import comm
from fzero.distributed.mesh import Mesh
from fzero.transforms._core import Handler, Step, as_step, installed
from fzero.transforms._vocab_parallel import VocabShardedLogits

__all__ = ["ColwiseParallel", "DivideAttributes", "RowwiseParallel", "TensorParallelLayout", "VocabShardedLogits",
           "auto_plan", "tensor_parallel"]

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


def _is_conv1d(m: torch.nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (GPT-2): a Linear whose ``weight`` is stored ``(in, out)``."""
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf") and getattr(m, "weight", None) is not None


def _io(m: torch.nn.Module) -> tuple[int, int]:
    """(input features, output features) of an ``nn.Linear`` or a ``Conv1D``."""
    return (m.weight.shape[0], m.nf) if _is_conv1d(m) else (m.in_features, m.out_features)


def _affine(module: torch.nn.Module, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """``module``'s affine map with its (local) weight: ``nn.Linear`` or ``Conv1D``."""
    b = module.bias if bias else None
    if _is_conv1d(module):
        w = module.weight
        out = x.reshape(-1, x.shape[-1]) @ w if b is None else torch.addmm(b, x.reshape(-1, x.shape[-1]), w)
        return out.view(*x.shape[:-1], w.shape[1])
    return F.linear(x, module.weight, b)


@dataclasses.dataclass(frozen=True)
class ColwiseParallel:
    """Split a Linear layer's output features over ``tp`` (``nn.Linear``'s ``weight`` rows,
    Hugging Face ``Conv1D``'s columns; ``bias`` with them).

    Args:
        parts: the output is this many equal blocks split one by one (a fused q/k/v
            projection: ``parts=3``), so each rank gets its slice of each block.
        unit: features kept together (an attention head's width): a split never cuts one.
        output: ``"features"``, this rank's slice as a plain tensor, for the row-parallel
            layer after it; ``"vocab"``, for a language-model head: the slice wrapped in a
            :class:`VocabShardedLogits`, which stands for the whole logits in the user's loss
            code -- ``F.cross_entropy`` on it is computed across the ``tp`` ranks without
            gathering the logits (Megatron's vocab-parallel cross-entropy).
    """

    parts: int = 1
    unit: int = 1
    output: Literal["features", "vocab"] = "features"

    def __post_init__(self):
        if self.output not in ("features", "vocab"):
            raise ValueError(f"{WHERE}: ColwiseParallel(output=...) must be 'features' or 'vocab', got {self.output!r}")
        if self.output == "vocab" and (self.parts, self.unit) != (1, 1):
            raise ValueError(f"{WHERE}: ColwiseParallel(output='vocab') splits the vocabulary in one block; got "
                             f"parts={self.parts}, unit={self.unit}")

    def dims(self, module: torch.nn.Module) -> dict[str, int]:
        return {"weight": 1 if _is_conv1d(module) else 0, "bias": 0}

    def forward(self, module: torch.nn.Module, x: torch.Tensor, group, timeout_s: float) -> torch.Tensor:
        out = _affine(module, _CopyToTP.apply(x, group, timeout_s))
        if self.output == "features":
            return out
        tp = dist.get_world_size(group)
        return VocabShardedLogits(out, vocab=out.shape[-1] * tp, tp=tp, rank=dist.get_rank(group), group=group,
                                  timeout_s=timeout_s)


@dataclasses.dataclass(frozen=True)
class RowwiseParallel:
    """Split a Linear layer's input features over ``tp`` (``bias`` whole, added once after
    the sum); or an ``nn.Embedding``'s vocabulary (``weight`` rows), as torch's
    ``RowwiseParallel`` splits an embedding.

    An embedding rank looks up the ids in its ``[lo, hi)`` of the vocabulary, gives zeros for
    the others, and Megatron's *g* sums the ranks' rows (one rank holds each id), so the
    output is whole on every rank and each rank's gradient lands on its own rows only.

    Args:
        unit: input features kept together (an attention head's width).
    """

    parts: int = 1
    unit: int = 1

    def dims(self, module: torch.nn.Module) -> dict[str, int]:
        return {"weight": 0 if _is_conv1d(module) or isinstance(module, torch.nn.Embedding) else 1}

    def forward(self, module: torch.nn.Module, x: torch.Tensor, group, timeout_s: float) -> torch.Tensor:
        if isinstance(module, torch.nn.Embedding):
            return _ReduceFromTP.apply(_embed_local(module, x, dist.get_rank(group)), group, timeout_s)
        out = _ReduceFromTP.apply(_affine(module, x, bias=False), group, timeout_s)
        return out if module.bias is None else out + module.bias


def _embed_local(module: torch.nn.Embedding, ids: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's part of the lookup: its rows for its ids, zeros for the others'."""
    rows = module.weight.shape[0]
    lo = rank * rows
    here = (ids >= lo) & (ids < lo + rows)
    pad = module.padding_idx
    pad = pad - lo if pad is not None and lo <= pad < lo + rows else None
    out = F.embedding(torch.where(here, ids - lo, torch.zeros_like(ids)), module.weight, pad)
    return out * here.unsqueeze(-1).to(out.dtype)


@dataclasses.dataclass(frozen=True)
class DivideAttributes:
    """Divide integer attributes of a module by ``tp`` at ``init`` -- the sizes its own
    forward reads that become per-rank once its projections are split (Hugging Face GPT-2's
    attention reads ``split_size`` to cut the fused q/k/v output; a model that reads a head
    count does the same with it). The module's code is unchanged.
    """

    names: tuple[str, ...]

    def __init__(self, *names: str):
        object.__setattr__(self, "names", tuple(names))


STYLES = (ColwiseParallel, RowwiseParallel, DivideAttributes)


def _local(full: torch.Tensor, dim: int, tp: int, rank: int, parts: int) -> torch.Tensor:
    """Rank ``rank``'s slice of ``full`` on ``dim``: of each of ``parts`` equal blocks."""
    blocks = full.detach().chunk(parts, dim=dim)
    return torch.cat([b.chunk(tp, dim=dim)[rank] for b in blocks], dim=dim).clone()


def _whole(pieces: list[torch.Tensor], dim: int, parts: int) -> torch.Tensor:
    """The inverse of :func:`_local`: every rank's slice (in rank order) back into the whole."""
    per = [p.chunk(parts, dim=dim) for p in pieces]
    return torch.cat([torch.cat([q[i] for q in per], dim=dim) for i in range(parts)], dim=dim)


# --------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class _Split:
    """One split parameter: the dim it is split on, its whole shape, and the blocks split
    one by one (a fused projection's)."""

    dim: int
    shape: tuple[int, ...]
    parts: int = 1


def auto_plan(module: torch.nn.Module) -> dict[str, Any]:
    """A plan for the common Linear layouts, as DeepSpeed's AutoTP finds them.

    In every module whose Linear children (``nn.Linear``, Hugging Face's ``Conv1D``) are
    expansions and their contraction -- some
    ``d -> h`` layers (an MLP's ``c_fc``; Llama's ``gate_proj`` and ``up_proj``) and one
    ``h -> d`` layer (``c_proj``, ``down_proj``), ``h > d`` -- the former are split by
    columns and the latter by rows. Attention projections (``d -> d``, or a fused
    ``d -> 3d`` beside a ``d -> d``) are left whole: splitting them needs the heads split.

    Example:
        >>> import torch
        >>> from fzero.transforms.tensor_parallel import auto_plan
        >>> mlp = torch.nn.ModuleDict({"fc": torch.nn.Linear(4, 16), "proj": torch.nn.Linear(16, 4)})
        >>> sorted((k, type(v).__name__) for k, v in auto_plan(torch.nn.ModuleDict({"mlp": mlp})).items())
        [('mlp.fc', 'ColwiseParallel'), ('mlp.proj', 'RowwiseParallel')]
    """
    plan: dict[str, Any] = {}
    for name, m in module.named_modules():
        layers = [(n, _io(c)) for n, c in m.named_children() if isinstance(c, torch.nn.Linear) or _is_conv1d(c)]
        down = [(n, io) for n, io in layers if io[0] > io[1] and any(o == io[::-1] for _, o in layers)]
        up = [(n, io) for n, io in layers if (n, io) not in down]
        if len(down) != 1 or not up or any(io != down[0][1][::-1] for _, io in up):
            continue
        prefix = f"{name}." if name else ""
        plan.update({prefix + n: ColwiseParallel() for n, _ in up})
        plan[prefix + down[0][0]] = RowwiseParallel()
    return plan


@tree.dataclass
class TensorParallelLayout:
    """How a state is split over the ``tp`` axis; ``init`` keeps it in
    ``state.extra["tensor_parallel"]``, where ``fzero.checkpoint`` finds it (by type) to
    save whole tensors' slices and to re-slice them onto another ``tp``.

    Every field is static, so the record has no leaves: a state's key paths and leaves are
    the same with and without it, and a checkpoint saved at ``tp=2`` loads into a plain
    state by key path.

    Attributes:
        size: the ``tp`` degree.
        rank: this rank's coordinate on ``tp``; it holds ``whole.chunk(size, dim)[rank]`` of
            every split parameter.
        splits: ``(name, _Split(dim, whole shape))`` per split parameter, sorted by name.

    A tensor of the state stored under a split parameter's name -- the parameter, its
    optimizer moments, its fp32 master -- is split as the parameter is: optax-style
    optimizer states mirror the params dict, and every ``fzero.optim`` state per parameter
    has the parameter's shape.
    """

    size: int = tree.field(static=True)
    rank: int = tree.field(static=True)
    splits: tuple[tuple[str, _Split], ...] = tree.field(static=True)


def check_plan(plan: Any, where: str = WHERE) -> None:
    """``plan`` must map module-name globs (strings) to a style instance, or be ``"auto"``."""
    if plan == "auto":
        return
    if not isinstance(plan, Mapping) or not plan:
        raise TypeError(f"{where}: the plan must be a non-empty dict of module-name globs to "
                        f"ColwiseParallel() / RowwiseParallel(), or 'auto', got {plan!r}")
    bad = [f"{k!r}: {v!r}" for k, v in plan.items() if not (isinstance(k, str) and isinstance(v, STYLES))]
    if bad:
        raise TypeError(f"{where}: plan entries must be 'glob': ColwiseParallel(), RowwiseParallel() or "
                        "DivideAttributes(...); "
                        f"got {', '.join(bad)}")


def resolve_plan(module: torch.nn.Module, params: Mapping[str, torch.Tensor], plan: Mapping[str, Any],
                 tp: int) -> tuple[dict[str, Any], dict[str, _Split]]:
    """The planned modules this rank runs, by name, and the split of each of their
    parameters. A planned layer none of whose parameters are in ``params`` belongs to
    another pipeline stage and is left alone.

    Raises:
        ValueError: every problem at once -- a glob that matches no module, a matched module
            that is not an ``nn.Linear`` (or ``Conv1D``; or an ``nn.Embedding`` under
            :class:`RowwiseParallel`, without ``max_norm``, ``scale_grad_by_freq`` or
            ``sparse``), a parameter whose split dim does not
            divide by ``tp`` or would cut a head (named with its size), a split parameter
            tied to another name, an attribute to divide that is missing or indivisible.
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
    local: dict[str, Any] = {}  # the planned modules this rank runs
    for name, style in chosen.items():
        m = modules[name]
        if isinstance(style, DivideAttributes):
            local[name] = style
            for attr in style.names:
                v = getattr(m, attr, None)
                if not isinstance(v, int) or isinstance(v, bool):
                    problems.append(f"module {name!r} has no integer attribute {attr!r} to divide (got {v!r})")
                elif v % tp:
                    problems.append(f"module {name!r}: {attr}={v} does not divide by tp={tp}")
            continue
        embedding = isinstance(m, torch.nn.Embedding)
        if embedding and not isinstance(style, RowwiseParallel):
            problems.append(f"module {name!r} is an Embedding; split its vocabulary with RowwiseParallel() "
                            f"(got {type(style).__name__})")
            continue
        if not (isinstance(m, torch.nn.Linear) or _is_conv1d(m) or embedding):
            problems.append(f"module {name!r} is a {type(m).__name__}; {type(style).__name__} splits nn.Linear "
                            "(or Hugging Face's Conv1D)" + (" or nn.Embedding" if isinstance(style, RowwiseParallel)
                                                             else ""))
            continue
        if embedding and (m.max_norm is not None or m.scale_grad_by_freq or m.sparse):
            problems.append(f"module {name!r}: an Embedding with max_norm, scale_grad_by_freq or sparse cannot "
                            "be split by vocabulary (each renormalises or counts over the ids of the whole "
                            "vocabulary)")
            continue
        own = [f"{name}.{pname}" for pname in style.dims(m) if getattr(m, pname) is not None]
        # another pipeline stage's layer: not run here (a tied parameter may be in params by its other name)
        if not any(a in params for n in own for a in aliases.get(id(getattr(m, n.rsplit(".", 1)[1])), [n])):
            continue
        local[name] = style
        for pname, dim in style.dims(m).items():
            p = getattr(m, pname)
            if p is None:
                continue
            full = f"{name}.{pname}"
            tied = aliases.get(id(p), [full])
            if len(tied) > 1:
                problems.append(f"parameter {full!r} is tied to {[a for a in tied if a != full]}: a split "
                                "parameter cannot be shared (untie them -- Hugging Face: "
                                "tie_word_embeddings=False -- or leave them whole)")
                continue
            if full not in params:
                problems.append(f"parameter {full!r} is not in state.params")
                continue
            shape = tuple(params[full].shape)
            size, parts, unit = shape[dim], style.parts, style.unit
            if parts == 1 and unit == 1 and size % tp:
                problems.append(f"parameter {full!r} of shape {shape}: dim {dim} ({size}) does not divide by tp={tp}")
            elif size % parts or (size // parts) % unit or (size // parts // unit) % tp:
                problems.append(f"parameter {full!r} of shape {shape}: dim {dim} ({size}) as {parts} block(s) of "
                                f"units of {unit} (heads) does not split over tp={tp} without cutting one")
            else:
                splits[full] = _Split(dim, shape, parts)
    if problems:
        raise ValueError(f"{WHERE}: the plan does not fit the model:\n  " + "\n  ".join(problems))
    return local, splits


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
        plan: module-name globs to :class:`ColwiseParallel` / :class:`RowwiseParallel`, or
            ``"auto"`` (:func:`auto_plan`, at ``init``). An ``nn.Embedding`` under
            :class:`RowwiseParallel` is split by vocabulary; an LM head under
            ``ColwiseParallel(output="vocab")`` returns :class:`VocabShardedLogits`.

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
        if "master" in state.extra or "tensor_parallel" in state.extra \
                or any(hasattr(v, "__fzero_gather__") for v in tree.leaves(state.params)):
            raise ValueError(f"{WHERE}: this state is already partitioned or cast: make tensor_parallel "
                             "outside mixed_precision and shard_state (it chooses what they compute with)")
        planned = auto_plan(module) if plan == "auto" else plan
        if not planned:
            raise ValueError(f"{WHERE}: plan='auto' found no Linear layers to split in {type(module).__name__} "
                             "(an expansion d -> h beside a contraction h -> d in one module); give a plan")
        chosen, found = resolve_plan(module, state.params, planned, tp)
        splits.clear()
        splits.update(found)
        handler.names = frozenset(state.params)
        timeout_s = mesh.timeout_s
        for name, style in chosen.items():
            if tp == 1:
                continue
            m = module.get_submodule(name)
            if isinstance(style, DivideAttributes):
                for attr in style.names:
                    setattr(m, attr, getattr(m, attr) // tp)
            else:
                m.forward = types.MethodType(lambda self, x, style=style: style.forward(self, x, group, timeout_s), m)
        local = {name: _local(state.params[name], s.dim, tp, rank, s.parts) for name, s in splits.items()}
        params = with_values(state.params, local)
        layout = TensorParallelLayout(tp, rank, tuple(sorted(splits.items())))
        return state.replace(params=params, opt_state=state.tx.init(trainable(params)),
                             extra={**state.extra, "tensor_parallel": layout})

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
            out[name] = _whole(list(full.unbind(0)), s.dim, s.parts)
        return out

    out = Step(call, before=before, name=f"tensor_parallel({inner.__name__}, tp={tp})", inner=inner)
    out.gather = gather
    out.splits = splits
    return out
