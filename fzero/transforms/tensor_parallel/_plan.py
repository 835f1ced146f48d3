"""A tensor-parallel plan: which layers are split, how, and the record a state keeps of it."""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping
from typing import Any

import torch

from fzero import tree
from fzero._params import Params, frozen_names
from fzero.distributed import comm
from fzero.transforms.tensor_parallel._sequence import PrepareModuleInput, SequenceParallel
from fzero.transforms.tensor_parallel._styles import (STYLES, WHERE, ColwiseParallel, DivideAttributes, RowwiseParallel,
                                                      _io, _is_conv1d, _whole)


# --------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class _Split:
    """One split parameter: the dim it is split on, its whole shape, and the blocks split
    one by one (a fused projection's)."""

    dim: int
    shape: tuple[int, ...]
    parts: int = 1


# Where an attention module keeps its head counts (on itself, or on its Hugging Face config),
# and the sizes its forward may read that become per-rank once its heads are split: the
# attributes DeepSpeed's AutoTP divides (module_inject/auto_tp.py, update_mp_params), and
# GPT-2's split_size, which its forward cuts the fused q/k/v output with. A head's width
# (head_dim) and the query heads per key/value head (num_key_value_groups) do not change.
_HEADS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "num_attn_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_n_heads", "num_kv")
_PER_RANK = ("split_size", "n_heads", "inner_dim", "num_heads", "num_kv", "num_attention_heads", "num_attn_heads",
             "all_head_size", "embed_dim", "hidden_size", "num_key_value_heads", "num_kv_heads", "kv_n_heads",
             "d_model", "n_head", "n_kv_heads")


def _count(m: torch.nn.Module, names: tuple[str, ...]) -> int | None:
    """The first of ``names`` that ``m`` (or its ``config``) holds as an int."""
    for owner in (m, getattr(m, "config", None)):
        for n in names:
            v = getattr(owner, n, None) if owner is not None else None
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None


def _mlp(layers: list[tuple[str, tuple[int, int]]]) -> dict[str, Any] | None:
    """Expansions ``d -> h`` then their contraction ``h -> d`` (``h > d``): columns, then rows."""
    (last, (h, d)), up = layers[-1], layers[:-1]
    if not h > d or any(io != (d, h) for _, io in up):
        return None
    return {**{n: ColwiseParallel() for n, _ in up}, last: RowwiseParallel()}


def _attention(m: torch.nn.Module, layers: list[tuple[str, tuple[int, int]]]) -> dict[str, Any] | None:
    """Projections ``d -> heads x head_dim`` (q; k and v with their own head count; or one
    fused q/k/v of three equal blocks) then the output projection ``heads x head_dim -> d``,
    in a module that says its head count: columns by whole heads, then rows by whole heads."""
    heads = _count(m, _HEADS)
    (last, (width, d)), ins = layers[-1], layers[:-1]
    if heads is None or width % heads:
        return None
    head = getattr(m, "head_dim", None)
    head = head if isinstance(head, int) and not isinstance(head, bool) and head * heads == width else width // heads
    kv = _count(m, _KV_HEADS) or heads
    plan: dict[str, Any] = {}
    for n, (i, o) in ins:
        if i != d:
            return None
        if o in (heads * head, kv * head):
            plan[n] = ColwiseParallel(unit=head)
        elif o == 3 * heads * head and kv == heads:
            plan[n] = ColwiseParallel(parts=3, unit=head)
        else:
            return None
    plan[last] = RowwiseParallel(unit=head)
    return plan


def auto_plan(module: torch.nn.Module) -> dict[str, Any]:
    """A plan for the common Linear layouts, as DeepSpeed's AutoTP finds them.

    It looks at every module whose only children with parameters are Linear layers
    (``nn.Linear``, Hugging Face's ``Conv1D``) and norm layers, and reads the Linear ones in
    the order the module registers them:

    * an **MLP**: some expansions ``d -> h`` (``c_fc``; Llama's ``gate_proj`` and
      ``up_proj``) and last their contraction ``h -> d`` (``c_proj``, ``down_proj``),
      ``h > d``: the expansions split by columns, the contraction by rows;
    * an **attention**: a module that says its head count (``num_heads``,
      ``num_attention_heads``, ``n_head``, ... on itself or on its ``config``), with
      projections ``d -> heads x head_dim`` (separate q, k and v, k and v with
      ``num_key_value_heads`` heads; or one fused q/k/v of three equal blocks, GPT-2's
      ``c_attn``) and last the output projection ``heads x head_dim -> d``: the projections
      split by columns and the output by rows, by whole heads; and the attention's integer
      sizes that become per-rank (head counts, ``split_size``, ``embed_dim``,
      ``hidden_size``, ... as DeepSpeed's AutoTP divides them) divided while the step runs.
      Its forward must read the head count from those attributes or from the tensors'
      shapes (as Hugging Face's Llama and GPT-2 do), not from somewhere else.

    A model's input and output layers around its blocks are not a pair, and a fused q/k/v of
    unequal blocks (grouped key/value heads in one projection) is left whole. Check the plan
    once (``auto_plan(model)``): the rules read the module tree, as AutoTP's do.

    Example:
        >>> import torch
        >>> from fzero.transforms.tensor_parallel import auto_plan
        >>> mlp = torch.nn.ModuleDict({"fc": torch.nn.Linear(4, 16), "proj": torch.nn.Linear(16, 4)})
        >>> sorted((k, type(v).__name__) for k, v in auto_plan(torch.nn.ModuleDict({"mlp": mlp})).items())
        [('mlp.fc', 'ColwiseParallel'), ('mlp.proj', 'RowwiseParallel')]
        >>> attn = torch.nn.ModuleDict({n: torch.nn.Linear(8, 8) for n in ("q", "k", "v", "o")})
        >>> attn.num_heads = 4
        >>> sorted((k, type(v).__name__, getattr(v, "unit", None))
        ...        for k, v in auto_plan(torch.nn.ModuleDict({"attn": attn})).items())  # doctest: +NORMALIZE_WHITESPACE
        [('attn', 'DivideAttributes', None), ('attn.k', 'ColwiseParallel', 2), ('attn.o', 'RowwiseParallel', 2),
         ('attn.q', 'ColwiseParallel', 2), ('attn.v', 'ColwiseParallel', 2)]
    """
    plan: dict[str, Any] = {}
    for name, m in module.named_modules():
        layers = [(n, _io(c)) for n, c in m.named_children() if isinstance(c, torch.nn.Linear) or _is_conv1d(c)]
        others = [c for c in m.children() if not (isinstance(c, torch.nn.Linear) or _is_conv1d(c))]
        if len(layers) < 2 or any("Norm" not in type(c).__name__ and any(True for _ in c.parameters())
                                  for c in others):
            continue  # an MLP or an attention holds its Linear layers, and perhaps a norm: nothing else
        found = _mlp(layers)
        attention = found is None and name != ""
        found = found or (_attention(m, layers) if attention else None)
        if found is None:
            continue
        prefix = f"{name}." if name else ""
        plan.update({prefix + n: style for n, style in found.items()})
        sizes = [a for a in _PER_RANK if attention and isinstance(getattr(m, a, None), int)
                 and not isinstance(getattr(m, a), bool)]
        if sizes:
            plan[name] = DivideAttributes(*sizes)
    return plan


@tree.dataclass
class TensorParallelLayout:
    """How a state is split over the ``tp`` axis; ``init`` keeps it in
    ``state.tensor_parallel``, where ``fzero.checkpoint`` finds it (by type) to
    save whole tensors' slices and to re-slice them onto another ``tp``, and as the
    ``layout`` of the state's :class:`fzero.Params`, where ``fzero.gather`` finds it.

    Every field is static, so the record has no leaves: a state's key paths and leaves are
    the same with and without it, and a checkpoint saved at ``tp=2`` loads into a plain
    state by key path.

    Attributes:
        size: the ``tp`` degree.
        rank: this rank's coordinate on ``tp``; it holds ``whole.chunk(size, dim)[rank]`` of
            every split parameter.
        splits: ``(name, _Split(dim, whole shape))`` per split parameter, sorted by name.
        group: the ``tp`` process group the slices are gathered over (not compared, not
            pickled: a layout sent to another process cannot gather).
        timeout_s: the timeout of those gathers.

    A tensor of the state stored under a split parameter's name -- the parameter, its
    optimizer moments, its fp32 master -- is split as the parameter is: optax-style
    optimizer states mirror the params dict, and every ``fzero.optim`` state per parameter
    has the parameter's shape.
    """

    size: int = tree.field(static=True)
    rank: int = tree.field(static=True)
    splits: tuple[tuple[str, _Split], ...] = tree.field(static=True)
    group: Any = tree.field(static=True, default=None, compare=False, repr=False)
    timeout_s: float = tree.field(static=True, default=300.0, compare=False, repr=False)

    #: The mesh axis ``fzero.gather`` puts this record's slices back together over.
    __fzero_axis__ = "tp"

    def __reduce__(self):
        return (TensorParallelLayout, (self.size, self.rank, self.splits))

    def whole(self, name: str, piece: torch.Tensor) -> torch.Tensor:
        """The whole tensor of which ``piece`` is this rank's slice as parameter ``name`` is
        split: every ``tp`` rank's slice all-gathered (a collective: every ``tp`` rank calls
        it for the same names in the same order).

        Raises:
            RuntimeError: the layout has no process group (it was sent from another process).
        """
        split = dict(self.splits)[name]
        if self.size == 1:
            return piece.detach().clone()
        if self.group is None:
            raise RuntimeError(f"fzero.gather: the tensor-parallel layout of {name!r} has no process group (it "
                               "was pickled in another process); gather on the ranks that trained it")
        piece = piece.detach().contiguous()
        full = torch.empty((self.size,) + tuple(piece.shape), dtype=piece.dtype, device=piece.device)
        comm.run(f"all_gather(tp: {name})",
                 lambda: comm.all_gather_flat(full.view(-1), piece.view(-1), group=self.group, async_op=True,
                                              what="gather"),
                 timeout_s=self.timeout_s, where="fzero.gather")
        return _whole(list(full.unbind(0)), split.dim, split.parts)

    def whole_params(self, params: Mapping[str, Any]) -> dict:
        """``params`` (a :class:`fzero.Params` with this layout) with every split entry whole;
        the result carries no layout."""
        names = dict(self.splits)
        out = {k: self.whole(k, v) if k in names and isinstance(v, torch.Tensor) else v for k, v in params.items()}
        return Params(out, frozen=frozen_names(params))

    def whole_leaf(self, path, x: Any) -> Any:
        """``x`` whole if it is stored under a split parameter's name (the last key of
        ``path``: the parameter, a moment, a master), else ``x``."""
        last = path[-1] if path else None
        name = getattr(last, "entry", None)
        if isinstance(x, torch.Tensor) and isinstance(name, str) and name in dict(self.splits):
            return self.whole(name, x)
        return x


def check_plan(plan: Any, where: str = WHERE) -> None:
    """``plan`` must map module-name globs (strings) to a style instance, or be ``"auto"``."""
    if plan == "auto":
        return
    if not isinstance(plan, Mapping) or not plan:
        raise TypeError(f"{where}: the plan must be a non-empty dict of module-name globs to "
                        f"ColwiseParallel() / RowwiseParallel(), or 'auto', got {plan!r}")
    styles = STYLES + (SequenceParallel, PrepareModuleInput)
    bad = [f"{k!r}: {v!r}" for k, v in plan.items() if not (isinstance(k, str) and isinstance(v, styles))]
    if bad:
        raise TypeError(f"{where}: plan entries must be 'glob': ColwiseParallel(), RowwiseParallel(), "
                        "DivideAttributes(...), SequenceParallel() or PrepareModuleInput(...); "
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
        if isinstance(style, (SequenceParallel, PrepareModuleInput)):
            # Nothing split: the module runs on (or moves its input to) sequence shards. A
            # module of another pipeline stage is not run here.
            own = [n for n, _ in m.named_parameters(remove_duplicate=False)]
            if not own or any(a in params for n in own for a in aliases.get(id(m.get_parameter(n)), [n])):
                local[name] = style
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

