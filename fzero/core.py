"""fzero's core: the primitives a step is made of, the handlers that rewrite them, the step
context, and the plain implementations underneath. Everything else stands on this module;
it stands on ``fzero.tree`` and ``fzero._params`` alone.

A user's ``train_step`` touches fzero at a few *primitives* only:

* ``value_and_grad`` -- where parameters are used and gradients are born
  (:func:`fzero.value_and_grad`); its plain implementation, here, differentiates on torch's
  autograd engine;
* ``apply_gradients`` -- where the update happens (:meth:`fzero.TrainState.apply_gradients`);
  its plain implementation checks the gradients against the parameters and binds ``update``;
* ``update`` -- the optimizer's step itself, bound once every handler of ``apply_gradients``
  has had its say, so a handler of ``update`` sees exactly the tensors the optimizer will
  update (this rank's pieces under ZeRO, whatever the nesting): ``mixed_precision`` swaps its
  fp32 masters in there; its plain implementation is the state's optimizer, lowered
  (:func:`register_lowering`, :class:`Lowered`);
* ``psum`` -- where an optimizer sums a reduction over the leaves across the ranks holding
  them (a global norm, LAMB's per-leaf norms, the overflow flag); the contract is at
  :func:`psum`, and ``counted`` is its companion: which leaves this rank counts;
* ``pmean_data`` -- the mean of a value over the ranks holding different rows: what
  :func:`fzero.global_mean` counts with;
* ``compressed_pmean`` -- the mean over the data-parallel ranks of each rank's own tensors,
  exchanged 1-bit compressed with error feedback: how an optimizer that does its own
  data-parallel exchange (the 1-bit family, :mod:`fzero.optim.onebit`) averages its momentum;
* ``emit`` -- where fzero reports a metric from deep inside (``grad_norm`` from a clip).

What a transform tells the code inside it -- which micro-batch runs, whether the step owns
its input, where the optimizer's state lives -- is not a primitive but one typed value, the
:class:`StepContext` (:func:`context`), which each transform's call narrows for the code it
runs (:func:`running`).

A transform installs a :class:`Handler` for the duration of the inner step. When a primitive
runs, the innermost installed handler sees it first and decides what to do; it passes the
(possibly rewritten) call on with ``next(...)``, which reaches the next handler outwards and,
at the bottom, the plain single-device implementation. Nesting transforms is nesting
handlers: ``shard_state(mixed_precision(step))`` installs the sharding handler, then the
precision handler inside it, so precision casts before sharding gathers and reduces.

A handler must call ``next``, never the public primitive, to pass a call on (the public
primitive would start again at the innermost handler).

Options travel with a call: ``value_and_grad`` carries ``has_aux``, ``grad_sink`` (a
transform that reduces gradients while backward runs), ``loss_scale`` (the factor a
handler has multiplied the loss by, so that a function seeding its own backward -- the
pipeline schedule -- seeds it with the same scale) and ``leaf`` (how the differentiated
leaves are made: mixed precision's are its ``NormWeight`` tensors, ``torch_autocast``'s
carry the hook that rounds a gradient). A handler adds to them
and passes the rest on untouched.

``init`` runs once, before the first step, as one traversal of the nesting -- an onion.
:class:`Step` runs a transform's ``before`` on the way in (outermost first), its inner
step's ``init``, then its ``after`` on the way out (innermost first). A transform that
chooses or casts what the inner steps compute with acts *before* (``pipeline`` keeps its
stage's parameters, ``mixed_precision`` makes fp32 masters and low-precision copies); one
that lays out or extends what the inner transforms built acts *after* (``shard_state``
partitions parameters, masters and optimizer state; ``compile``'s clip puts itself in front
of the optimizer). So ``shard_state(mixed_precision(step))`` and
``mixed_precision(shard_state(step))`` reach the same state: the masters exist before
anything is partitioned, whichever is outside.

The outermost step also opens what lives exactly one step, around every handler
(:func:`register_step_scope`): the step's randomness and its global means.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from fzero import tree
from fzero._params import Params, like_params, merge_trainable, trainable
from fzero.tree import _USER_VIEW, user_view

__all__ = ["DataShard", "Handler", "LeafSums", "Lowered", "MicroBatch", "NotApplied", "Step", "StepContext", "as_step",
           "bind", "compressed_pmean", "context", "emit_metric", "installed", "loss_scale", "lower", "pmean_data", "psum",
           "register_lowering", "register_primitive", "register_step_scope", "rehearsal", "rehearsing", "running", "trainable_grads"]

_STACK: contextvars.ContextVar[tuple["Handler", ...]] = contextvars.ContextVar("fzero_handlers", default=())
_METRICS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fzero_metrics", default=None)
_BASE: dict[str, Callable[..., Any]] = {}
# Context managers ``opener(state, batch)`` the outermost step runs inside (see Step.__call__).
_STEP_SCOPES: list[Callable[[Any, Any], contextlib.AbstractContextManager]] = []
_IN_STEP: contextvars.ContextVar[bool] = contextvars.ContextVar("fzero_in_step", default=False)


class Handler:
    """Base class of a transform's handler; every method passes the call on unchanged.

    Override a primitive's method to rewrite it. Each receives the primitive's arguments and
    ``next``, the continuation to the handlers outside this one.
    """

    def value_and_grad(self, fn, params, args, kwargs, *, next: Callable, **options):
        # options: has_aux, grad_sink, loss_scale (see _value_and_grad_base)
        return next(fn, params, args, kwargs, **options)

    def forward(self, fn, params, args, kwargs, *, next: Callable):
        # a model's apply outside value_and_grad (an evaluation inside the step):
        # fn(params, *args, **kwargs), nothing differentiated
        return next(fn, params, args, kwargs)

    def apply_gradients(self, state, grads, *, next: Callable):
        # returns the new state, or a NotApplied carrying the state to go on with
        return next(state, grads)

    def update(self, state, grads, *, next: Callable):
        # the optimizer's step on the state apply_gradients' handlers prepared; returns the new state
        return next(state, grads)

    def emit(self, name: str, value: Any, *, next: Callable):
        return next(name, value)

    def psum(self, value, *, next: Callable):
        # value: a tensor this rank sums with the other ranks' (see psum's contract)
        return next(value)

    def counted(self, names, *, next: Callable):
        # names: the parameter of each leaf a LeafSums sums; returns whether this rank counts each
        return next(names)

    def pmean_data(self, value, *, next: Callable):
        # value: a tensor every rank holding different data averages with the others'
        return next(value)

    def compressed_pmean(self, tensors, key, *, next: Callable):
        # tensors: this rank's own values (a list), averaged over the data-parallel ranks
        # 1-bit compressed; key: whose error feedback they carry (see compressed_pmean)
        return next(tensors, key)


class NotApplied(NamedTuple):
    """What ``apply_gradients`` returns through the handlers when it applied no update.

    ``reason`` is ``"deferred"`` (an ``accumulate`` before its last micro-batch: the
    gradients were summed, the update comes later) or ``"skipped"`` (a non-finite gradient
    under ``mixed_precision``: the update was dropped). ``state`` is the state to carry on
    with. A handler that acts on applied updates only tests ``isinstance(new, NotApplied)``
    and passes it on (with its own changes to ``state``); the public
    :meth:`fzero.TrainState.apply_gradients` unwraps it, so the user's step always gets a
    state.
    """

    state: Any
    reason: str


def register_primitive(name: str):
    """Register the plain implementation of a primitive (the bottom of every handler chain)."""

    def deco(fn):
        _BASE[name] = fn
        return fn

    return deco


def bind(primitive: str, *args, **kwargs):
    """Run ``primitive`` through the installed handlers, innermost first.

    The handlers and the base run in fzero's own view of the pytrees, where a ZeRO ``Shard``
    flattens to this rank's piece (see :func:`fzero.tree.user_view`)."""
    if _USER_VIEW.get():
        with user_view(False):
            return bind(primitive, *args, **kwargs)
    stack = _STACK.get()
    return _call(stack, primitive, _BASE[primitive], len(stack) - 1, args, kwargs)


def _call(stack: tuple, primitive: str, base: Callable, i: int, args: tuple, kwargs: dict):
    """Handler ``i`` of ``stack`` (the base below the innermost) running ``primitive``; its
    ``next`` calls handler ``i - 1``. (A module-level function: a closure that called itself
    would be a reference cycle, left to the garbage collector, at every bind.)"""
    if i < 0:
        return base(*args, **kwargs)
    method = getattr(stack[i], primitive)
    return method(*args, next=lambda *a2, **kw2: _call(stack, primitive, base, i - 1, a2, kw2), **kwargs)


@contextlib.contextmanager
def installed(handler: Handler) -> Iterator[Handler]:
    """Install ``handler`` innermost for the duration of the block."""
    token = _STACK.set(_STACK.get() + (handler,))
    try:
        yield handler
    finally:
        _STACK.reset(token)


def handlers() -> tuple[Handler, ...]:
    """The installed handlers, outermost first."""
    return _STACK.get()


@register_primitive("forward")
def _forward_base(fn, params, args, kwargs):
    return fn(params, *args, **kwargs)


# --------------------------------------------------------------------------- psum


class LeafSums(NamedTuple):
    """This rank's partial sums of a reduction over the leaves of the parameters, one per
    leaf, named by parameter: what :func:`psum` sums exactly however the leaves are held.

    Attributes:
        sums: a vector, this rank's partial sum of each leaf (a sum of squares, say) over
            what it holds of the leaf.
        names: the parameter each entry belongs to, as ``state.params`` names it; ``None``
            for a leaf of a tree that is not keyed by parameter name.
        total: whether :func:`psum` returns the sum over the leaves (a 0-dim tensor) instead
            of each leaf's sum (a vector).

    Example:
        >>> import torch
        >>> g = {"w": torch.tensor([3.0, 4.0]), "b": torch.tensor([12.0])}
        >>> sq = LeafSums.of([g], torch.stack([x.square().sum() for x in tree.leaves(g)]), total=True)
        >>> sq.names, psum(sq)
        (('b', 'w'), tensor(169.))
    """

    sums: torch.Tensor
    names: tuple[str | None, ...]
    total: bool = False

    @classmethod
    def of(cls, trees, sums: torch.Tensor, *, total: bool = False) -> "LeafSums":
        """``sums`` of the leaves of ``trees`` (in order), named by the first key of each
        leaf's path: a parameter's name in a tree keyed as ``state.params``."""
        names = ()
        for t in trees:
            names += _first_keys(tree.structure(t))
        return cls(sums, names, total)


# Each leaf's first path key where it is a str (a parameter's name), by spec: a step asks for
# the same structures' names every time (the norms' LeafSums).
_FIRST_KEYS = tree.SpecCache()


def _first_keys(spec) -> tuple[str | None, ...]:
    def make():
        keys = (getattr(a[0], "entry", None) if len(a) else None for a in spec.accessors())
        return tuple(k if isinstance(k, str) else None for k in keys)

    return _FIRST_KEYS.get(spec, make)


def psum(value):
    """Sum a reduction over the leaves across every rank that holds part of the state.

    The contract, for the two kinds of ``value``:

    * a :class:`LeafSums` (a norm, a trust ratio: anything that must count each leaf once).
      Each leaf's result is the sum of the partial sums of the ranks holding different parts
      of it, and a leaf held whole by several ranks with the same values (``tensor_parallel``'s
      unsplit leaves, on every ``tp`` rank) is counted once: the ``counted`` primitive asks the
      handlers which leaves this rank counts (the transform that makes the copies answers;
      by default every leaf), the others enter as zero. Returns the vector of per-leaf sums,
      or with ``total`` their sum, a 0-dim tensor. With every leaf counted this is the psum
      of ``sums`` (or of ``sums.sum()``), bit for bit.
    * a bare tensor (mixed precision's overflow flag): summed as it is over every such rank,
      so a value that depends on how many copies of a leaf were counted is wrong here. Right
      for an *any*: a count of non-finite leaves, where a copy counted ``tp`` times is still
      > 0 exactly when one is; and for sums over leaves no two ranks share.

    What the ``psum`` handlers see is always a tensor, every rank's counted once: a 0-dim one
    is a sum over leaves (or a flag), a vector one entry per leaf of :class:`LeafSums` order.
    With an unpartitioned state it is the identity; under ``shard_state`` at stages 1-3 an
    all-reduce over ``dp`` (each element owned by one rank); under ``tensor_parallel`` an
    all-reduce over ``tp``; under ``pipeline`` 0-dim values are all-reduced over ``pp`` too
    (a stage's per-leaf vector names its own leaves only).

    Raises:
        ValueError: a :class:`LeafSums` whose ``sums`` and ``names`` differ in length; under
            ``tensor_parallel``, names that are not parameters (a handler that cannot tell
            a split leaf from a whole one refuses to guess).
    """
    if not isinstance(value, LeafSums):
        return bind("psum", value)
    sums, names = value.sums, tuple(value.names)
    if sums.dim() != 1 or sums.numel() != len(names):
        raise ValueError(f"fzero.psum: LeafSums.sums must be a vector with one entry per name; got shape "
                         f"{tuple(sums.shape)} for {len(names)} names")
    counted = bind("counted", names)
    if not all(counted):  # another rank counts these leaves: they enter as zero here
        keep = torch.tensor(counted, dtype=torch.bool, device=sums.device)
        sums = torch.where(keep, sums, torch.zeros_like(sums))
    return bind("psum", sums.sum() if value.total else sums)


@register_primitive("psum")
def _psum_base(value):
    return value


@register_primitive("counted")
def _counted_base(names: tuple) -> tuple[bool, ...]:
    return (True,) * len(names)


# --------------------------------------------------------------------------- the step context


class MicroBatch(NamedTuple):
    """Where the running step sits in its update: micro-batch ``index`` (0-based) of ``count``."""

    index: int
    count: int

    @property
    def last(self) -> bool:
        """Whether the update is applied after this micro-batch."""
        return self.index == self.count - 1


class DataShard(NamedTuple):
    """Which of the data-parallel ranks' local batches this rank's is: ``index`` of ``count``;
    rank ``index``'s local batch holds rows ``[index * n, (index + 1) * n)`` of the global
    batch (``n`` rows each), as ``fzero.data.DataLoader`` hands them out."""

    index: int
    count: int


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What the transforms around the running code tell it, as one typed value.

    Each transform's call narrows it for the code inside (:func:`running`); outside any step
    every field has its default.

    Attributes:
        donate: the running step owns its input state (``fzero.compile(..., donate=True)``,
            JAX's ``donate_argnums``): the update, the low-precision copies and ZeRO's
            parameter all-gathers may write into the input's tensors. ``mixed_precision`` and
            ``check_finite`` turn it off while an update they will discard runs.
        micro_batch: which micro-batch of its update the step runs (``accumulate``; nested
            accumulations compose), so a transform can act once per update.
        data_shard: which of the data-parallel ranks' local batches this rank's is
            (``shard_state``).
        pipeline_micro_batch: which of a pipeline's micro-batches the running forward or
            backward is (the pipeline's schedule; unlike ``micro_batch`` it changes within one
            call of ``value_and_grad``).
        offload_optimizer: the optimizer's state and the fp32 masters live on the host
            (ZeRO-Offload, ``offload_optimizer="cpu"``): what the update writes is copied from
            there.
        offload_staging: under ``offload_optimizer``, the host buffers the new parameters are
            cast into before their copy to the device, kept between steps
            (``fzero.transforms.offload.HostStaging``), else ``None``.
        offload_params: this rank's pieces of the parameters live on the host between uses
            (ZeRO-3's ``offload_param="cpu"``): an update's new pieces are written there.
        skip_flag: a 0-dim device tensor, nonzero when the running update is to be discarded
            (``mixed_precision``'s and ``check_finite``'s verdict on the gradients, still on
            the device). The update reads it there where it can (the fused kernels write
            nothing when it is set: :attr:`Lowered.honours_skip_flag`), else ``update``'s plain
            implementation reads it first and leaves the state as it was; so a discarded
            update writes nothing of its input, and the host waits for the verdict once,
            after the update is on its way.
        sequence_shard: which slice of every sequence this rank holds under Ulysses sequence
            parallelism (the ``sp`` axis, ``fzero.transforms.ulysses``): ``index`` of ``count``
            equal slices of the batch's sequence dim. Dropout keys read it (a mask drawn on a
            slice of the sequence is refused: docs/parallelism.md).
        jit: how the model's forward runs: ``None`` eagerly, or a :class:`fzero._jit.Jit`
            (``fzero.compile(jit=)``), whose compiled forward of each module
            :class:`fzero.functional.Apply` calls instead of the module.
        finite_certificate: ``check_finite``'s (``"skip"``) holder for a verdict on the
            gradients that a reduction outside it can give for free
            (``fzero.transforms.finite.Certificate``: ZeRO 1-3 on gloo), else ``None``.
        opt_state_outside: at ``init``: a transform outside (ZeRO 1-3) builds the optimizer
            state over its own pieces of the masters, so one inside need not build it over
            the whole tensors (it would be thrown away: 8 bytes per parameter for Adam at the
            peak of ``init``). ``offload_optimizer`` is set at ``init`` too: the pieces and the
            optimizer state are built on the host, where they live.

    Example:
        >>> context().micro_batch
        MicroBatch(index=0, count=1)
        >>> with running(donate=True):
        ...     context().donate
        True
    """

    donate: bool = False
    micro_batch: MicroBatch = MicroBatch(0, 1)
    data_shard: DataShard = DataShard(0, 1)
    pipeline_micro_batch: MicroBatch = MicroBatch(0, 1)
    offload_optimizer: bool = False
    offload_staging: Any = None  # a fzero.transforms.offload.HostStaging
    offload_params: bool = False
    skip_flag: Any = None
    sequence_shard: DataShard = DataShard(0, 1)
    jit: Any = None  # a fzero._jit.Jit; core stands under it and does not import it
    finite_certificate: Any = None  # a fzero.transforms.finite.Certificate
    opt_state_outside: bool = False


_CONTEXT: contextvars.ContextVar[StepContext] = contextvars.ContextVar("fzero_step_context", default=StepContext())


def context() -> StepContext:
    """The running code's :class:`StepContext`."""
    return _CONTEXT.get()


@contextlib.contextmanager
def running(**fields) -> Iterator[StepContext]:
    """Within the block, the step context with ``fields`` replaced (a transform's call says
    what it tells the code inside it)."""
    token = _CONTEXT.set(dataclasses.replace(_CONTEXT.get(), **fields))
    try:
        yield _CONTEXT.get()
    finally:
        _CONTEXT.reset(token)


# --------------------------------------------------------------------------- pmean_data


def pmean_data(value: torch.Tensor) -> torch.Tensor:
    """The mean of ``value`` over the ranks that hold different data (the ``dp`` ranks under
    ``shard_state``; tensor-parallel peers hold the same batch and are not counted again).
    Identity in a world of one. What :func:`fzero.global_mean` counts with."""
    return bind("pmean_data", value)


@register_primitive("pmean_data")
def _pmean_data_base(value: torch.Tensor) -> torch.Tensor:
    return value


# --------------------------------------------------------------------------- compressed_pmean


def compressed_pmean(tensors: Sequence[torch.Tensor], key: str) -> list[torch.Tensor]:
    """The mean over the data-parallel ranks of each rank's own ``tensors``, exchanged with
    1-bit compression and error feedback, as DeepSpeed's ``compressed_allreduce`` (1-bit Adam,
    Tang et al., 2021, <https://arxiv.org/abs/2102.02888>).

    The transform that owns the ``dp`` axis answers (``shard_state`` at ZeRO stage 0: each
    rank adds its worker error, sends the signs of each chunk, packed 8 to a byte, with one
    fp32 scale per tensor, to the chunk's server rank, which averages, adds its server error,
    compresses again and all-gathers). ``key`` names the caller's error feedback (kept by that
    transform between steps, one buffer per tensor and rank): two callers with different keys
    never share errors. In a world of one it is the identity (DeepSpeed compresses nothing
    there either).

    Example:
        >>> compressed_pmean([torch.tensor([1.0, -2.0])], "doc")
        [tensor([ 1., -2.])]
    """
    return bind("compressed_pmean", list(tensors), key)


@register_primitive("compressed_pmean")
def _compressed_pmean_base(tensors: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    return tensors


# --------------------------------------------------------------------------- metrics


def emit_metric(name: str, value: Any) -> None:
    """Report a metric from inside a step (e.g. ``grad_norm`` from a clip).

    Outside a compiled step this does nothing; inside one, the value lands in the step's
    ``metrics`` under ``name``. Handlers may rewrite it (e.g. average over micro-batches).
    """
    bind("emit", name, value)


@register_primitive("emit")
def _emit_base(name: str, value: Any) -> None:
    sink = _METRICS.get()
    if sink is not None:
        sink[name] = value


@contextlib.contextmanager
def collecting_metrics() -> Iterator[dict]:
    """Collect metrics emitted inside the block into the yielded dict."""
    sink: dict = {}
    token = _METRICS.set(sink)
    try:
        yield sink
    finally:
        _METRICS.reset(token)


# --------------------------------------------------------------------------- value_and_grad


# While a ``value_and_grad`` runs, the modules its function calls keep the parameters they
# were called with until its backward has finished (see ``Apply.__call__``).
_BINDINGS: contextvars.ContextVar[contextlib.ExitStack | None] = contextvars.ContextVar(
    "fzero_bindings", default=None)
_LOSS_SCALE: contextvars.ContextVar[float] = contextvars.ContextVar("fzero_loss_scale", default=1.0)


def loss_scale() -> float:
    """Inside a function ``value_and_grad`` is differentiating: the factor its loss will be
    multiplied by once it returns (``mixed_precision``'s fp16 scale; 1.0 without one).

    Autograd carries the scale down to every gradient by itself; only a function that seeds
    a backward of its own (the pipeline schedule, which runs each micro-batch's backward
    inside the step) needs it, to seed with the same scale.
    """
    return _LOSS_SCALE.get()

def _trainable_flags(params: Any, n: int) -> list[bool]:
    """One flag per leaf of ``params`` (``n`` of them): False at the frozen entries of every
    ``Params`` inside."""
    if (type(params) is dict or type(params) is Params and not params.frozen) \
            and all(isinstance(v, torch.Tensor) for v in params.values()):
        return [True] * n  # the common case, every step: no tree walk
    is_params = lambda x: isinstance(x, Params)  # noqa: E731
    flags = tree.map(
        lambda x: Params({k: (None if v is None else k not in x.frozen) for k, v in x.items()}, frozen=x.frozen)
        if is_params(x) else True,
        params, is_leaf=is_params)
    return tree.leaves(flags)


@register_primitive("value_and_grad")
def _value_and_grad_base(fn, params, args, kwargs, *, has_aux: bool, grad_sink=None, loss_scale: float = 1.0,
                         leaf: Callable | None = None):
    """The plain implementation: differentiate ``fn`` at ``params`` on the autograd engine.

    Frozen entries of a :class:`fzero.Params` are passed through undifferentiated and get
    ``None`` as their gradient. ``grad_sink`` (used by transforms that reduce gradients
    while backward runs) receives each trainable leaf's gradient the moment it is complete
    -- ``grad_sink.on_grad(i, g)``, with ``i`` the leaf's index in flatten order -- and the
    gradient is then dropped, so only what the sink keeps stays resident (a sink whose
    ``takes_after_backward(leaves)`` is true, with nothing to overlap, takes them all once
    backward is done: ``grad_sink.on_grads(indices, grads)``, or accumulated into its
    ``grad_buffers``); ``grad_sink.finish()`` returns the
    gradient leaves. A sink with an ``on_value`` attribute (not ``None``) is handed the
    value (the loss, still attached) before backward starts, so that a reduction of it can
    run while backward does. ``loss_scale`` (the factor a
    handler multiplies ``fn``'s loss by) is what :func:`loss_scale` answers while ``fn``
    runs. ``leaf(x, name)``, where a handler gives one, makes the differentiated leaf of each
    trainable tensor (``name``: its key in ``params``, ``None`` for a ``leaf`` whose
    ``by_name`` attribute is false; default ``x.detach().requires_grad_()``):
    a leaf of a tensor subclass, or one with a gradient hook, made here rather than an alias
    made inside ``fn``, whose backward node -- created before the forward's -- the engine
    would run last, holding every gradient behind it until backward is done.
    """
    leaves, spec = tree.flatten(params)
    train = _trainable_flags(params, len(leaves))
    # Which leaves are differentiated, asked of the leaves as given: a leaf made below may be a
    # tensor subclass, whose every method call passes through Python.
    wrt = [i for i, (x, t) in enumerate(zip(leaves, train))
           if t and isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())]
    inputs = list(leaves)
    if leaf is None:
        for i in wrt:
            inputs[i] = leaves[i].detach().requires_grad_(True)
    else:  # the names only for a leaf that reads them (a walk of the tree less for one that does not)
        names = [_key(path) for path in tree.paths(params)] if getattr(leaf, "by_name", True) else None
        for i in wrt:
            inputs[i] = leaf(leaves[i], names[i] if names is not None else None)
    bindings = contextlib.ExitStack()
    token, scale_token = _BINDINGS.set(bindings), _LOSS_SCALE.set(loss_scale)
    try:
        with bindings:  # modules keep their parameters until backward is done
            with torch.enable_grad():
                out = fn(tree.unflatten(spec, inputs), *args, **kwargs)
                value, aux = _split_output(out, has_aux)
            if grad_sink is not None:
                out_leaves = _backward_into(grad_sink, value, inputs, wrt)
            else:
                grads = [None] * len(wrt)
                if value.requires_grad and wrt:
                    grads = list(run_backward(value, [inputs[i] for i in wrt], accumulate=False))
                if len(wrt) == len(inputs):  # every leaf differentiated (the usual case): in order
                    out_leaves = grads
                else:
                    out_leaves = [None] * len(inputs)
                    for i, g in zip(wrt, grads):
                        out_leaves[i] = g
                out_leaves = [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, out_leaves)]
    finally:
        _BINDINGS.reset(token)
        _LOSS_SCALE.reset(scale_token)
    if not all(train):
        out_leaves = [g if t else None for g, t in zip(out_leaves, train)]
    value = value.detach()
    if has_aux:
        aux = tree.map(lambda a: a.detach() if isinstance(a, torch.Tensor) else a, aux)
        return (value, aux), tree.unflatten(spec, out_leaves)
    return value, tree.unflatten(spec, out_leaves)


def _key(path) -> str:
    """A leaf's name in the parameters: its key in a dict of them (``functionalize``'s), else
    its path written out."""
    if len(path) == 1 and isinstance(getattr(path[0], "entry", None), str):
        return path[0].entry
    return tree.keystr(path)


def keeping_function_modes(fn: Callable) -> Callable:
    """``fn`` run, when the autograd engine calls it (a gradient hook, a saved-tensor hook),
    under the torch-function modes that are active now: the engine drops them there, and a
    mode that watches the tensors a step makes (``device_check.pretend``'s) would not see
    the ones a hook makes. ``fn`` itself when none is active (the usual case)."""
    modes = torch.overrides._get_current_function_mode_stack()
    if not modes:
        return fn

    @functools.wraps(fn)
    def under_modes(*args, **kwargs):
        if torch.overrides._get_current_function_mode_stack():  # called outside the engine
            return fn(*args, **kwargs)
        with contextlib.ExitStack() as stack:
            for mode in modes:
                stack.enter_context(mode)
            return fn(*args, **kwargs)

    return under_modes


# torch.autograd.grad and backward check their tensors for a __torch_function__ override and,
# for a subclass that has one (mixed precision's NormWeight leaves), call it; it runs the
# function with subclasses no longer dispatching, and so runs the whole backward that way: a
# block that activation checkpointing recomputes there computes without the subclass's rule
# (a norm in bf16 that the forward ran in fp32; the non-reentrant checkpoint then refuses the
# recomputed tensors). The engine's entry below that check is what fzero calls then (torch's
# own grad() and backward() call it); without it (a torch that moved it), the leaves' gradient
# edges, on which torch does not dispatch.
try:
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # pragma: no cover - torch 2.11 and 2.13 have it (checked)
    _engine_run_backward = None


def _overrides(leaves: Sequence[torch.Tensor]) -> bool:
    return any(type(x) is not torch.Tensor and getattr(type(x), "__torch_function__", None)
               is not torch._C._disabled_torch_function_impl for x in leaves)


def run_backward(outputs: torch.Tensor, leaves: Sequence[torch.Tensor], seed: torch.Tensor | None = None, *,
                 accumulate: bool):
    """``torch.autograd.backward(outputs, seed, inputs=leaves)`` (``accumulate``: into the
    leaves' ``.grad``; returns ``None``) or ``torch.autograd.grad(outputs, leaves, seed,
    allow_unused=True)``, the same, except that leaves of a tensor subclass with a
    ``__torch_function__`` (mixed precision's norm weights) still dispatch to it during the
    backward: a block recomputed there (activation checkpointing) computes as its forward did.
    ``seed`` defaults to ones, for a scalar ``outputs``."""
    try:
        return _run_backward(outputs, leaves, seed, accumulate)
    except RuntimeError as e:
        if "use_reentrant=True" not in str(e):
            raise
        raise RuntimeError(
            "fzero.value_and_grad: the model runs torch.utils.checkpoint with use_reentrant=True, which "
            "cannot run under the torch.autograd.grad fzero differentiates with; checkpoint with "
            "use_reentrant=False (fzero.remat does; a Hugging Face model: gradient_checkpointing_enable("
            "gradient_checkpointing_kwargs={'use_reentrant': False}))") from e


def _run_backward(outputs, leaves, seed, accumulate: bool):
    if not _overrides(leaves):
        if accumulate:
            torch.autograd.backward(outputs, seed, inputs=list(leaves))
            return None
        return torch.autograd.grad(outputs, list(leaves), seed, allow_unused=True)
    if seed is None:
        seed = torch.ones_like(outputs, memory_format=torch.preserve_format)
    if _engine_run_backward is not None:
        out = _engine_run_backward((outputs,), (seed,), False, False, tuple(leaves), True, accumulate_grad=accumulate)
        return None if accumulate else out
    with torch._C.DisableTorchFunctionSubclass():
        edges = [torch.autograd.graph.get_gradient_edge(x) for x in leaves]
    if accumulate:
        torch.autograd.backward(outputs, seed, inputs=edges)
        return None
    return torch.autograd.grad(outputs, edges, seed, allow_unused=True)


def _backward_into(sink, value, inputs, wrt):
    on_value = getattr(sink, "on_value", None)
    if on_value is not None:  # the value is known before backward: a reduction of it can start now
        on_value(value)
    leaves = [inputs[i] for i in wrt]
    at_once = getattr(sink, "takes_after_backward", None)
    # The sink's look at the leaves (dtypes, shapes) and their .grad, set and read here, go
    # past a leaf's __torch_function__ (mixed precision's NormWeight): a Python call for each
    # attribute of each parameter a step, to the same slots. Backward itself runs outside
    # (run_backward: the norms recomputed in it must dispatch).
    no_subclass = torch._C.DisableTorchFunctionSubclass
    with no_subclass():
        together = at_once is not None and at_once(leaves)
    if together:  # the sink takes every gradient at once
        if not (value.requires_grad and wrt):
            sink.on_grads(wrt, [None] * len(wrt))
            return sink.finish()
        grad_buffers = getattr(sink, "grad_buffers", None)
        if grad_buffers is None:
            sink.on_grads(wrt, run_backward(value, leaves, accumulate=False))
            return sink.finish()
        # Backward accumulates each gradient into the sink's buffer, as the leaf's .grad:
        # no hook per leaf, no gradient held twice.
        with no_subclass():
            views = grad_buffers(wrt, leaves)
            for leaf, view in zip(leaves, views):
                leaf.grad = view
        try:
            run_backward(value, leaves, accumulate=True)
            with no_subclass():
                grads = [leaf.grad for leaf in leaves]
        finally:
            with no_subclass():
                for leaf in leaves:
                    leaf.grad = None
        sink.on_accumulated(wrt, grads, views)
        return sink.finish()
    handles = []
    on_grad = keeping_function_modes(sink.on_grad)
    for i in wrt:
        def hook(leaf, i=i):
            with no_subclass():
                g = leaf.grad
                leaf.grad = None  # the sink decides what stays resident
            on_grad(i, g)

        with no_subclass():
            handles.append(inputs[i].register_post_accumulate_grad_hook(hook))
    try:
        if value.requires_grad and wrt:
            run_backward(value, leaves, accumulate=True)
    finally:
        for h in handles:
            h.remove()
    return sink.finish()


def _split_output(out, has_aux: bool):
    if has_aux:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(
                "fzero.value_and_grad: with has_aux=True, fn must return a pair (value, aux), "
                f"got {type(out).__name__}" + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else "")
            )
        value, aux = out
    else:
        value, aux = out, None
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
        what = (
            f"a {value.dtype} tensor of shape {tuple(value.shape)}"
            if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        hint = " (use has_aux=True to return (loss, aux))" if isinstance(value, (tuple, list)) else ""
        raise TypeError(f"fzero.value_and_grad: fn must return a floating-point scalar tensor, got {what}{hint}")
    return value.reshape(()), aux


# --------------------------------------------------------------------------- apply_gradients and update


def trainable_grads(params: Any, grads: Any, where: str) -> Any:
    """``grads`` in the structure of ``params.trainable()``. A plain dict of gradients (a
    user's own) is accepted with or without the frozen names; a gradient given for a frozen
    name is dropped (the parameter stays as it is)."""
    if isinstance(params, Params) and isinstance(grads, dict) \
            and params.keys() - params.frozen <= grads.keys() <= params.keys():
        grads = like_params(params, {k: None if k in params.frozen else grads[k] for k in params})
    mine = trainable(params)
    g_leaves, g_spec = tree.flatten(grads)
    p_leaves, p_spec = tree.flatten(mine)
    if g_spec != p_spec:  # one flatten of each on every step; the paths only when they differ
        tree.assert_same_structure(mine, grads, what=where, names=("state.params", "grads"))
    pairs = list(zip(g_leaves, p_leaves))
    if any(type(g) is torch.Tensor and type(p) is torch.Tensor and g.shape != p.shape for g, p in pairs):
        # Named only when wrong: the paths are not worked out on every step.
        wrong = [f"grads{tree.keystr(k)} has shape {tuple(g.shape)}, the parameter {tuple(p.shape)}"
                 for k, (g, p) in zip(tree.paths(grads), pairs)
                 if type(g) is torch.Tensor and type(p) is torch.Tensor and g.shape != p.shape]
        raise ValueError(f"{where}: gradients must have their parameters' shapes: " + "; ".join(wrong[:8])
                         + (f"; and {len(wrong) - 8} more" if len(wrong) > 8 else ""))
    return grads


@register_primitive("apply_gradients")
def _apply_gradients_base(state: Any, grads: Any) -> Any:
    grads = trainable_grads(state.params, grads, "fzero.TrainState.apply_gradients")
    # Every handler of apply_gradients has prepared the state (ZeRO's pieces, ...): the
    # optimizer's step is a primitive of its own, so a handler can rewrite exactly it.
    return bind("update", state, grads)


class Lowered(NamedTuple):
    """One update by an optimizer, as the registered lowering runs it (:func:`lower`).

    Attributes:
        update: ``(grads, opt_state, params, *, donate) -> (params, opt_state)``; with
            ``donate`` the step owns ``params`` and ``opt_state`` and they may be written.
        reads_low_precision: the update reads bf16/fp16 gradients as they are (the fused
            kernels do); else it wants them in the parameters' dtypes, and a transform
            holding 16-bit gradients beside fp32 masters casts them before handing them on
            (so that what the handlers outside it do to them, a rescale, a copy to the host,
            happens in fp32).
        honours_skip_flag: ``update`` takes ``found_inf=``, a device flag that discards the
            update on the device (no host read): the step context's ``skip_flag``.
    """

    update: Callable[..., tuple[Any, Any]]
    reads_low_precision: bool
    honours_skip_flag: bool = False


# How a state's optimizer (``state.tx``) makes one update: registered by ``fzero.optim``, the
# package that knows the optimizers (the fused kernels where they apply, in place when the step
# owns the state).
_LOWER: list[Callable[[Any, Any], Lowered]] = []


def register_lowering(lower: Callable[[Any, Any], Lowered]) -> None:
    """Install ``lower(tx, params) -> Lowered``, how ``update``'s plain implementation turns
    ``state.tx`` into one update of ``params`` (``fzero.optim`` does, at import)."""
    _LOWER[:] = [lower]


def lower(tx: Any, params: Any) -> Lowered:
    """The update ``tx`` makes of ``params``, the tensors it steps, as the registered lowering
    runs it."""
    if not _LOWER:
        raise RuntimeError("fzero.core: no optimizer lowering is registered (import fzero.optim)")
    return _LOWER[0](tx, params)


@register_primitive("update")
def _update_base(state: Any, grads: Any) -> Any:
    params, here = trainable(state.params), context()
    lowered = lower(state.tx, params)
    flag = here.skip_flag
    if flag is not None and not lowered.honours_skip_flag:
        if bool(flag > 0):  # discarded, and this update cannot read the verdict on the device:
            # it runs on copies (what it reports, a clip's norm, is still reported) and the
            # state stays as it was
            lowered.update(grads, state.opt_state, params, donate=False)
            return state.replace(step=state.step + 1)
        flag = None
    extra = {} if flag is None else {"found_inf": flag}
    new, opt_state = lowered.update(grads, state.opt_state, params, donate=here.donate, **extra)
    return state.replace(step=state.step + 1, params=merge_trainable(state.params, new), opt_state=opt_state)


# --------------------------------------------------------------------------- steps


class Step:
    """A train step that knows how to prepare its state.

    A step with no ``inner`` step is the user's own code (``as_step(fn)``): it runs in the
    user's view of the pytrees, where a partitioned leaf is one ``Shard`` with the whole
    tensor's semantics, not this rank's piece; every primitive it calls goes back to fzero's
    view. A transform wraps its inner step with ``inner=`` set.

    ``step.init(state)`` prepares a freshly created state for this step, in the one order
    written at the top of this module: ``after(inner.init(before(state)))``, each of the
    three skipped when absent; ``init_scope()``, a context manager, is entered around
    ``inner.init`` (what a transform tells the inits inside it, as its call tells their
    steps: a :func:`running` block). ``step(state, batch) -> (state, metrics)`` runs it. Every
    transform returns a ``Step``; a plain function is a ``Step`` whose ``init`` returns the
    state unchanged.
    """

    def __init__(self, fn: Callable, *, before: Callable | None = None, after: Callable | None = None,
                 name: str | None = None, inner=None,
                 init_scope: Callable[[], contextlib.AbstractContextManager] | None = None):
        self._fn = fn
        self._before, self._after = before, after
        self._init_scope = init_scope
        self.inner = inner
        self.__name__ = name or getattr(fn, "__name__", "step")
        self.__doc__ = getattr(fn, "__doc__", None)
        self.__wrapped__ = fn

    def __call__(self, state, batch):
        if not _IN_STEP.get():
            # The outermost step: what lives for one whole step (its randomness, its
            # global means) opens here, around every transform's handlers.
            token = _IN_STEP.set(True)
            try:
                with contextlib.ExitStack() as scopes:
                    for opener in _STEP_SCOPES:
                        scopes.enter_context(opener(state, batch))
                    return self._run(state, batch)
            finally:
                _IN_STEP.reset(token)
        return self._run(state, batch)

    def _run(self, state, batch):
        if self.inner is None:  # the user's own step: Shards are whole tensors to it
            with user_view(True):
                return self._fn(state, batch)
        return self._fn(state, batch)

    def init(self, state):
        if self._before is not None:
            state = self._before(state)
        if self.inner is not None:
            with self._init_scope() if self._init_scope is not None else contextlib.nullcontext():
                state = self.inner.init(state)
        if self._after is not None:
            state = self._after(state)
        return state

    def __repr__(self) -> str:
        return f"<fzero step {self.__name__}>"


_REHEARSAL: contextvars.ContextVar[bool] = contextvars.ContextVar("fzero_rehearsal", default=False)


@contextlib.contextmanager
def rehearsal() -> Iterator[None]:
    """Within the block the model runs only to learn shapes (a pipeline's handshake): what
    lives for the step does not count it -- dropout numbers no call, a global mean counts
    nothing and communicates nothing."""
    token = _REHEARSAL.set(True)
    try:
        yield
    finally:
        _REHEARSAL.reset(token)


def rehearsing() -> bool:
    """Whether the running code is a :func:`rehearsal`."""
    return _REHEARSAL.get()


def register_step_scope(opener: Callable[[Any, Any], contextlib.AbstractContextManager]) -> None:
    """Run every outermost step inside ``opener(state, batch)`` (a context manager): for what
    lives exactly one step, around every transform (``fzero.rng``'s randomness,
    ``fzero.means``' global means)."""
    _STEP_SCOPES.append(opener)


def as_step(fn: Callable) -> Step:
    """``fn`` as a :class:`Step` (unchanged if it already is one)."""
    if isinstance(fn, Step):
        return fn
    if not callable(fn):
        raise TypeError(f"fzero: a train step must be callable as step(state, batch), got {type(fn).__name__}")
    return Step(fn)
