"""The ``tensor_parallel`` transform: slices the state at ``init``, makes ``psum`` exact over ``tp``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from fzero import tree
from fzero._params import Params, frozen_names, trainable, with_values
from fzero.distributed.mesh import Mesh
from fzero.core import Handler, Step, as_step, installed
from fzero.transforms.tensor_parallel._batch import check_same_batch
from fzero.transforms.tensor_parallel._plan import TensorParallelLayout, _Split, auto_plan, check_plan, resolve_plan
from fzero.transforms.tensor_parallel._rewrite import Rewrite
from fzero.transforms.tensor_parallel._slices import SliceTracker
from fzero.transforms.tensor_parallel._sequence import PrepareModuleInput, SequenceParallel
from fzero.transforms.tensor_parallel._styles import WHERE, RowwiseParallel, _all_reduce, _local


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

    def value_and_grad(self, fn, params, args, kwargs, *, next, **options):
        # The forward runs with split layers' outputs tagged, the tags followed to any dropout
        # (_slices.py): its mask is the whole model's slice. Only the forward: the optimizer's
        # operations never pay the tracker's call per operation.
        return next(_tracked(fn), params, args, kwargs, **options)

    def forward(self, fn, params, args, kwargs, *, next):
        # An evaluation inside the step draws its dropout masks as the training forward does.
        return next(_tracked(fn), params, args, kwargs)


def _tracked(fn: Callable) -> Callable:
    """``fn`` run with split layers' outputs tagged (:class:`SliceTracker`)."""

    def tracked(p, *a, **kw):
        with SliceTracker():
            return fn(p, *a, **kw)

    return tracked


def tensor_parallel(step: Callable, mesh: Mesh | None = None, plan: Mapping[str, Any] | None = None, *,
                    sequence_parallel: bool = False) -> Step:
    """Tensor parallelism over the mesh's ``tp`` axis, as Megatron-LM splits layers.

    Every ``tp`` rank of a ``dp`` coordinate passes the same batch (checked every step, by
    one all-gather of a few numbers over ``tp``); each holds its slice of the planned layers'
    parameters (and, under ``shard_state``, ZeRO partitions that slice over ``dp``). The
    step computes the same update as the plain step.

    Args:
        step: ``train_step(state, batch) -> (state, metrics)``.
        mesh: the :class:`fzero.Mesh`, with a ``tp`` axis.
        plan: module-name globs to :class:`ColwiseParallel` / :class:`RowwiseParallel`, or
            ``"auto"`` (:func:`auto_plan`, at ``init``). An ``nn.Embedding`` under
            :class:`RowwiseParallel` is split by vocabulary; an LM head under
            ``ColwiseParallel(output="vocab")`` returns :class:`VocabShardedLogits`.
        sequence_parallel: Megatron's sequence parallelism (``_sequence.py``): between the
            split pairs activations are this rank's shard of the sequence; column-parallel
            layers all-gather their input, row-parallel ones reduce-scatter their output. The
            plan says where the shards begin and end and which modules run on them
            (:class:`PrepareModuleInput`, :class:`SequenceParallel`; ``tp_plans.gpt(model,
            sequence_parallel=True)``).

    Returns:
        A :class:`Step`. ``init`` keeps this rank's slices (before the transforms inside it
        build anything on the parameters: make it the outermost transform but ``pipeline``)
        in ``state.params``, a :class:`fzero.Params` whose ``layout`` records the split, so
        ``fzero.gather(state.params)`` (or of the state) gives the whole parameters on every
        rank. The planned layers' forwards and divided attributes are in place only while the
        step runs: outside it the module is the user's own (``fzero.load_into`` puts the whole
        trained weights into it).

    Raises:
        TypeError: a plan that is not globs to styles.
        ValueError: at ``init``, a plan that does not fit the model (every problem named); a
            plan whose sequence-parallel styles disagree with ``sequence_parallel``.
        BatchMismatchError: a step whose ``tp`` peers were handed different batches (each
            differing leaf named by key path, with both ranks and both shapes), on every peer.

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
    running: dict[str, Rewrite] = {}  # filled by init

    def before(state):
        if tp > 1 and dist.get_rank(group) != rank:
            # Slices are cut by the mesh coordinate, forwards find their vocabulary range by
            # the group's rank: they must be one number.
            raise RuntimeError(f"{WHERE}: this rank is tp rank {dist.get_rank(group)} of its process group but "
                               f"tp coordinate {rank} of {mesh}; the tp group must list its ranks in mesh order")
        module = getattr(state.apply_fn, "module", None)
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"{WHERE}: state.apply_fn must come from fzero.functionalize(module): the plan "
                            "names the module's layers")
        if state.master is not None or state.tensor_parallel is not None \
                or any(hasattr(v, "__fzero_gather__") for v in tree.leaves(state.params)):
            raise ValueError(f"{WHERE}: this state is already partitioned or cast: make tensor_parallel "
                             "outside mixed_precision and shard_state (it chooses what they compute with)")
        planned = auto_plan(module) if plan == "auto" else plan
        if not planned:
            raise ValueError(f"{WHERE}: plan='auto' found no Linear layers to split in {type(module).__name__} "
                             "(an expansion d -> h beside a contraction h -> d in one module); give a plan")
        chosen, found = resolve_plan(module, state.params, planned, tp)
        _check_sequence_styles(module, chosen, sequence_parallel)
        splits.clear()
        splits.update(found)
        handler.names = frozenset(state.params)
        if tp == 1:
            return state.replace(tensor_parallel=TensorParallelLayout(1, 0, tuple(sorted(splits.items()))))
        # The planned forwards and divided attributes are the step's, not the module's: they are
        # in place only while a step runs (_rewrite.py), so the module stays the user's own.
        running["rewrite"] = Rewrite(module, chosen, tp, group, mesh.timeout_s, sequence_parallel=sequence_parallel)
        layout = TensorParallelLayout(tp, rank, tuple(sorted(splits.items())), group=group, timeout_s=mesh.timeout_s)
        local = {name: _local(state.params[name], s.dim, tp, rank, s.parts) for name, s in splits.items()}
        # The layout rides on the params container, as its frozen names do: gradients, masters,
        # moments and a checkpoint loaded like the state are made from it, and fzero.gather
        # reads it from any of them.
        params = Params(with_values(state.params, local), frozen=frozen_names(state.params), layout=layout)
        return state.replace(params=params, opt_state=state.tx.init(trainable(params)), tensor_parallel=layout)

    def call(state, batch):
        if tp == 1:
            return inner(state, batch)
        # Before any tp collective: peers handed different batches would hand all-reduces of
        # different sizes to one collective (gloo aborts), or silently sum different samples.
        check_same_batch(batch, group, device=mesh.device, timeout_s=mesh.timeout_s)
        rewrite = running.get("rewrite")
        with installed(handler), rewrite.applied() if rewrite is not None else contextlib.nullcontext():
            return inner(state, batch)

    sp = ", sequence_parallel=True" if sequence_parallel else ""
    return Step(call, before=before, name=f"tensor_parallel({inner.__name__}, tp={tp}{sp})", inner=inner)


def _check_sequence_styles(module: torch.nn.Module, chosen: Mapping[str, Any], sequence_parallel: bool) -> None:
    """Sequence-parallel styles only with ``sequence_parallel=True``, which needs a place where
    the shards begin."""
    on_shards = sorted(n for n, s in chosen.items() if isinstance(s, (SequenceParallel, PrepareModuleInput)))
    if on_shards and not sequence_parallel:
        raise ValueError(f"{WHERE}: the plan runs {', '.join(map(repr, on_shards))} on sequence shards "
                         "(SequenceParallel / PrepareModuleInput) but sequence_parallel is off: pass "
                         "sequence_parallel=True (compile(..., tp=plan, sequence_parallel=True)), or drop them")
    begins = [n for n, s in chosen.items() if (isinstance(s, PrepareModuleInput) and s.shards())
              or (isinstance(s, RowwiseParallel) and isinstance(module.get_submodule(n), torch.nn.Embedding))]
    if sequence_parallel and not begins:
        raise ValueError(f"{WHERE}: sequence_parallel=True, but the plan shards no activation on the sequence: "
                         "add PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1)) on "
                         "the first block (or split the embedding by vocabulary) and SequenceParallel() on the "
                         "norms between the split pairs; fzero.transforms.tp_plans.gpt(model, "
                         "sequence_parallel=True) is one")
