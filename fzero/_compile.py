"""``fzero.compile``: one call that composes the transforms a training run asks for.

First the options become plain data (:class:`Plan`: the keywords, the config's decided
options, check_finite's mode, the bucket); then :data:`ORDER` wraps the step in the
transforms they ask for, one row per transform with the reason it stands where it does;
then the step boundary (:func:`compile`'s ``before``/``call``) fills the config's pending
``"auto"`` values, installs its optimizer, collects metrics and marks donated states.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from fzero import replicas, tree
from fzero._jit import Jit
from fzero.autotune._profile import TrialProfiler
from fzero.config import AutoFill, Config
from fzero.config._options import keys_of
from fzero.core import Step, as_step, collecting_metrics, running
from fzero.distributed import comm
from fzero.distributed.mesh import AXES, DATA_AXES, Mesh
from fzero.options import CompileOptions, field_name
from fzero.train_state import TrainState, missing_optimizer
from fzero.transforms.accumulate import accumulate
from fzero.transforms.clip import clip
from fzero.transforms.finite import check_finite
from fzero.transforms.mixed_precision import mixed_precision, torch_autocast
from fzero.transforms.offload import offload_optimizer
from fzero.transforms.shard_state import release_parameters, shard_state
from fzero.transforms.tensor_parallel import tensor_parallel
from fzero.transforms.ulysses import ulysses

__all__ = ["compile", "ORDER", "Plan", "Layer"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the transforms are built from, all of it known before the first is built."""

    opts: CompileOptions
    """The options: the keywords over the config's decided ones."""

    mesh: Mesh
    """The mesh the step runs on."""

    nonfinite: str | None
    """``check_finite``'s mode, or ``None`` when it is not applied (:func:`_nonfinite`)."""

    bucket_bytes: int | Callable[[], int]
    """``shard_state``'s bucket: ``opts.bucket_bytes``, or, for a config whose
    ``reduce_bucket_size`` is ``"auto"``, :meth:`fzero.config.AutoFill.bucket_bytes`, which
    ``shard_state``'s ``init`` asks once ``step.init`` has filled it from the model."""


class Layer(NamedTuple):
    """One row of compile's order: the transform, when it applies, and why it stands there."""

    name: str
    applies: Callable[[Plan], bool]
    wrap: Callable[[Step, Plan], Step]
    why: str


# The fixed order, innermost first: each row wraps the rows above it. A transform's handler
# sees the primitives of the ones inside it first, and its init runs after theirs
# (fzero/core.py). docs/transforms.md shows this table; tests/test_compile.py holds it to it.
ORDER: tuple[Layer, ...] = (
    Layer("clip", lambda p: p.opts.clip_norm is not None, lambda s, p: clip(s, p.opts.clip_norm),
          "innermost: the clip joins the optimizer, so it sees the update's gradients after every reduction "
          "and unscaling (the global norm, as torch's clip_grad_norm_)"),
    Layer("accumulate", lambda p: p.opts.accumulate > 1, lambda s, p: accumulate(s, p.opts.accumulate),
          "inside mixed precision and ZeRO: micro-batches add up before the overflow verdict and before "
          "stage 0-1's single reduction of the sum"),
    Layer("mixed_precision", lambda p: p.opts.precision != "fp32",
          lambda s, p: mixed_precision(s, p.opts.precision, p.opts.loss_scale,
                                       check_grad_overflow=p.opts.check_grad_overflow,
                                       master_weights=p.opts.master_weights, optimizer_states=p.opts.optimizer_states,
                                       rounding=p.opts.rounding, check_by_norm=p.opts.clip_norm is not None,
                                       **p.opts.scaler()),
          "inside ZeRO: its init makes the masters and the low-precision copies, which shard_state's init then "
          "partitions and gathers (half the bytes)"),
    Layer("torch_autocast", lambda p: p.opts.torch_autocast is not None,
          lambda s, p: torch_autocast(s, p.opts.torch_autocast,
                                      lower_precision_safe_modules=p.opts.lower_precision_safe_modules,
                                      round_grads=p.opts.zero >= 1),
          "where mixed precision would be (the two exclude each other): the forward under torch.autocast with "
          "fp32 weights; at ZeRO 1-3 the listed modules' gradients take a low-precision reduction's values"),
    Layer("check_finite", lambda p: p.nonfinite is not None,
          lambda s, p: check_finite(s, p.nonfinite, by_norm=p.opts.clip_norm is not None),
          "outside mixed precision (it sees the unscaled gradients' verdict first) and inside ZeRO (its flags "
          "are summed over the ranks, so every rank decides alike)"),
    Layer("ulysses", lambda p: p.mesh.size("sp") > 1, lambda s, p: ulysses(s, p.mesh),
          "inside ZeRO, whose group spans dp x sp (the loss and gradients are averaged over both); outside "
          "accumulate: the sequence is cut once, then the rows into micro-batches"),
    Layer("shard_state", lambda p: p.opts.zero > 0 or p.mesh.size(DATA_AXES) > 1,
          lambda s, p: shard_state(s, p.mesh, p.opts.zero, bucket_bytes=p.bucket_bytes, reduce_in=p.opts.reduce_in,
                                   buffer_sync=p.opts.buffer_sync, overlap_comm=p.opts.overlap_comm,
                                   offload_param=p.opts.offload_param, pin_memory=p.opts.pin_memory,
                                   max_reuse_distance=p.opts.max_reuse_distance),
          "ranks exchange gradients and parameters of what the inner steps built"),
    Layer("offload_optimizer", lambda p: p.opts.offload_optimizer != "none",
          lambda s, p: offload_optimizer(s, pin_memory=p.opts.pin_memory, make_masters=p.opts.precision == "fp32"),
          "outside ZeRO: its init moves to the host what shard_state partitioned and placed on the device (this "
          "rank's masters and optimizer state), and its update handler, the last before the optimizer's, steps "
          "exactly those pieces there"),
    Layer("tensor_parallel", lambda p: p.opts.tp is not None,
          lambda s, p: tensor_parallel(s, p.mesh, p.opts.tp, sequence_parallel=p.opts.sequence_parallel),
          "outside ZeRO and mixed precision: its init keeps this rank's slice of each split layer before they "
          "cast, partition and build optimizer state on it (Ψ/tp per rank)"),
    Layer("pipeline", lambda p: p.opts.pipeline is not None, lambda s, p: p.opts.pipeline.transform(s),
          "outermost: its init keeps this stage's parameters before anything else is built on them, and its "
          "handler turns a norm's psum into an all-reduce over pp too"),
)


class Donated:
    """What a donated state's ``params``, ``opt_state`` and ``extra`` become once the step
    has written the next state into their tensors: any use is an error that says why."""

    __slots__ = ("field", "step", "init")

    def __init__(self, field: str, step: int, init: bool = False):
        self.field, self.step, self.init = field, step, init

    def error(self) -> RuntimeError:
        if self.init:
            return RuntimeError(
                f"fzero.compile: this state's {self.field} was given up to step.init (donate=True), which "
                "builds the optimizer state afresh (over masters, pieces or slices) and freed the one "
                "TrainState.create made: use the state step.init returned (state = step.init(state)), "
                "create the state again to init it again, or compile with donate=False")
        return RuntimeError(
            f"fzero.compile: this state's {self.field} was donated to the step (donate=True) that "
            f"returned the state at step {self.step}, and its tensors now hold that state's values: "
            "use the state the step returned (state, metrics = step(state, batch)), or compile "
            "with donate=False to keep every input state intact")

    def __getattr__(self, name):
        raise self.error()

    def __getitem__(self, key):
        raise self.error()

    def __iter__(self):
        raise self.error()

    def __len__(self):
        raise self.error()

    def __repr__(self) -> str:
        return f"<donated to the step that returned step {self.step}>"


def _give_up_opt_state(given: TrainState, state: TrainState) -> TrainState:
    """``state`` without its optimizer state, whose tensors are freed now, and ``given`` (the
    caller's state) marked as having given it up: ``init`` builds the optimizer state again
    inside, so the moments ``TrainState.create`` made (8 bytes per parameter for Adam) would
    otherwise stay allocated beside the new ones until ``init`` returned -- on a GPU, at
    init's peak. A tensor that shares storage with the parameters, masters, buffers or
    ``extra`` is left alone."""
    kept = {t.untyped_storage().data_ptr() for t in tree.leaves((given.params, given.master, given.buffers, given.extra,
                                                                 state.params, state.master, state.buffers))
            if isinstance(t, torch.Tensor)}
    for t in tree.leaves((given.opt_state, state.opt_state)):
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.untyped_storage().data_ptr() not in kept:
            t.untyped_storage().resize_(0)
    object.__setattr__(given, "opt_state", Donated("opt_state", 0, init=True))
    return state.replace(opt_state=None)


def donated(state: TrainState, step: int) -> None:
    """Mark ``state`` as given up: its tensors were written into by the step (its buffers
    too, where it has any: the forward updates them in place)."""
    for field in ("params", "opt_state", "extra", *(("buffers",) if state.buffers else ()),
                  *(("master",) if state.master is not None else ())):
        object.__setattr__(state, field, Donated(field, step))


def compile(train_step: Callable, mesh: Mesh | None = None, config: Any = None, **options) -> Step:  # noqa: A001
    """Compose fzero's transforms around ``train_step`` from keyword options.

    Args:
        train_step: a pure single-device ``train_step(state, batch) -> (state, metrics)``.
        mesh: the :class:`fzero.Mesh` to run on (default: ``Mesh(dp=-1)``).
        config: a DeepSpeed-format config: a dict, a path to a JSON file, or an
            :class:`fzero.Config` (see docs/config.md). Its options join the keywords (a
            keyword that contradicts it is an error); its optimizer and scheduler sections
            replace the state's optimizer at ``step.init``. Hugging Face's ``"auto"``
            values are filled from ``auto=``, these keywords, the state at ``init`` and the
            first batch (docs/config.md); ``step.config`` is the filled config.
        auto: with ``config``: values for its ``"auto"`` keys, by dotted path or Hugging
            Face argument name (``{"max_steps": 1000}``), or a ``TrainingArguments``.
        **options: the fields of :class:`fzero.CompileOptions`, each documented there:
            ``zero``, ``precision``, ``accumulate``, ``clip_norm``, ``loss_scale`` and the
            fp16 scaler's settings, ``check_grad_overflow``, ``reduce_in``, ``bucket_bytes``,
            ``overlap_comm``, ``nonfinite`` (an update with an inf/NaN gradient: skipped by
            default), ``buffer_sync``, ``donate``, ``jit``, ``comm_bytes``, ``offload_optimizer``,
            ``offload_param``, ``pin_memory``, ``max_reuse_distance``, ``tp``, ``pipeline``, ``trial``,
            ``check_replicas`` (every N updates, compare what should be identical across
            the ranks; :class:`fzero.ReplicaDivergenceError` names what differs), and the
            measuring ones. ``stage=`` and ``dtype=`` (the transforms' names) are still taken
            for ``zero`` and ``precision``, with a ``DeprecationWarning``.

    After ``step.init`` the module passed to ``fzero.functionalize`` holds no weights
    (its parameters are ``meta`` tensors, so no dead copy of the model stays in memory);
    ``fzero.load_into(module, state)`` writes the trained ones back.

    Returns:
        A :class:`Step`: call ``step.init(state)`` once, then ``step(state, batch)``.
        Its ``metrics`` are the user's plus those fzero emits (``grad_norm``, ...; with
        ``comm_bytes=True``, ``comm_bytes``: this rank's bytes sent in the step, by kind, and
        ``comm_bytes_by_axis``: the same bytes by the mesh axis they crossed (``pp``, ``dp``,
        ``sp``, ``tp``; ``dp_sp`` with both ``dp`` and ``sp``; ``other`` for a group that is
        none of them); and
        with ``offload_optimizer="cpu"`` or ``offload_param="cpu"`` too, ``offload_bytes``: its
        bytes copied device→host and host→device).

    Raises:
        TypeError: unknown options (the message names each, with the nearest valid one).
        ValueError: a value out of range, or a keyword that contradicts the config.
        NotImplementedError: an option whose transform has not landed yet.

    Example:
        >>> import torch, fzero
        >>> from fzero import optim
        >>> apply, params = fzero.functionalize(torch.nn.Linear(2, 1))
        >>> state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
        >>> def train_step(state, batch):
        ...     loss, g = fzero.value_and_grad(lambda p: state.apply_fn(p, batch).pow(2).mean())(state.params)
        ...     return state.apply_gradients(g), {"loss": loss}
        >>> step = fzero.compile(train_step, clip_norm=1.0, comm_bytes=True)
        >>> state = step.init(state)
        >>> state, metrics = step(state, torch.ones(4, 2))
        >>> sorted(metrics)
        ['comm_bytes', 'comm_bytes_by_axis', 'grad_norm', 'loss', 'skipped']
        >>> metrics["comm_bytes"]["total"]      # one process: nothing sent
        Fraction(0, 1)
    """
    mesh = mesh if mesh is not None else Mesh(dp=-1)
    auto = options.pop("auto", None)
    if auto is not None and config is None:
        raise ValueError("fzero.compile: auto= fills a config's \"auto\" values; pass config= too")
    opts, cfg = _options(config, options, mesh, auto)
    _check_kept_dtypes(opts)
    if mesh.size("pp") > 1 and opts.pipeline is None:
        raise ValueError(f"fzero.compile: {mesh} has a pp axis of {mesh.size('pp')}: pass pipeline=fzero.pipeline("
                         "stages, loss_fn, mesh, ...) and compute the step's loss and gradients with it")
    if mesh.size("sp") > 1 and (opts.tp is not None or opts.pipeline is not None):
        raise ValueError(f"fzero.compile: {mesh} has an sp axis of {mesh.size('sp')} (Ulysses sequence parallelism), "
                         f"which does not run with {'tp=' if opts.tp is not None else 'pipeline='}: use one of them")
    if mesh.size("tp") > 1 and opts.tp is None:
        raise ValueError(f"fzero.compile: {mesh} has a tp axis of {mesh.size('tp')}: pass tp={{...}}, a plan "
                         "of module-name globs to fzero.ColwiseParallel() / fzero.RowwiseParallel()")
    if opts.sequence_parallel and opts.tp is None:
        raise ValueError("fzero.compile: sequence_parallel=True shards the activations between tensor-parallel "
                         "layers: pass tp=plan too (fzero.transforms.tp_plans.gpt(model, sequence_parallel=True))")
    if opts.sequence_parallel and opts.jit:
        raise ValueError(f"fzero.compile: sequence_parallel=True with jit={opts.jit!r}: a compiled graph's tensors "
                         "do not carry which shard of the sequence they are, which the split layers read; use "
                         "jit=False with sequence_parallel")
    fill = AutoFill(cfg, itemsize=2 if opts.reduce_in in ("fp16", "bf16") else 4,
                    default_bucket=opts.bucket_bytes) if cfg is not None else None
    # Everything the transforms are built from is known here, as plain data.
    plan = Plan(opts, mesh, _nonfinite(opts),
                fill.bucket_bytes if fill is not None and fill.bucket_pending else opts.bucket_bytes)
    inner = as_step(train_step)
    for layer in ORDER:
        if layer.applies(plan):
            inner = layer.wrap(inner, plan)

    # An autotuning trial (compile(trial=), or the trial config fzero autotune writes): the
    # step measures itself and ends the run, as DeepSpeed's engine does (docs/autotune.md).
    profiler = TrialProfiler(opts.trial) if opts.trial is not None else None

    # A transform inside builds the optimizer state afresh at init (over the masters, the
    # pieces, the tp slices or the stage's parameters): the one TrainState.create built is
    # not used, and init owns its input as a step does (donate=True).
    rebuilds = (opts.precision != "fp32" or opts.zero >= 1 or (opts.tp is not None and mesh.size("tp") > 1)
                or opts.pipeline is not None or opts.offload_optimizer != "none")

    def before(state):
        if not isinstance(state, TrainState):
            raise TypeError(f"fzero.compile: step.init expects an fzero.TrainState, got {type(state).__name__}")
        if isinstance(state.__dict__.get("opt_state"), Donated):
            raise state.opt_state.error()
        given = state
        if profiler is not None:  # Ψ of the whole model, before any transform splits it
            profiler.init(state, mesh)
        # First, so that every transform's init (masters, layouts, optimizer state) builds
        # on the mesh's device. An optimizer state built again inside is not placed: the
        # moments TrainState.create made on the host never reach the device (under
        # offload_optimizer they are built on the host again, and ZeRO builds pieces).
        state = mesh.place(state.replace(opt_state=None) if rebuilds else state)
        if fill is not None:
            # step.config is the config as far as it is known: the state fills the bucket
            # from the model's hidden size (shard_state's init, inside, reads it), the first
            # call the batch sizes.
            step.config = resolved = fill.at_init(state)
            _report(resolved)
            # The config's optimizer and scheduler sections, as deepspeed.initialize builds
            # them (its optimizer state only where nothing inside builds it again).
            state = resolved.install(state, opt_state=not rebuilds)
        if state.tx is None:  # before any transform builds optimizer state over its masters or pieces
            raise missing_optimizer("fzero.compile: step.init")
        if opts.donate and rebuilds:
            state = _give_up_opt_state(given, state)
        return state

    def after(state):
        module = getattr(state.apply_fn, "module", None)
        if isinstance(module, torch.nn.Module):
            # The module is only code from here on (its parameters live in the state);
            # fzero.load_into writes trained weights back.
            release_parameters(module)
        return state

    monitoring = _monitoring(opts, cfg, mesh)
    jit = Jit(opts.jit) if opts.jit is not False else None  # its compiled forwards live with the step

    def call(state, batch):
        if isinstance(state, TrainState) and isinstance(state.__dict__.get("params"), Donated):
            raise state.params.error()
        # The traffic counter only grows; the step's share is the difference, so a caller
        # counting over several steps (comm.traffic itself) is not disturbed.
        if fill is not None and fill.config.pending:  # "auto" batch sizes: this batch says
            step.config = fill.at_first_call(batch)
            _report(step.config, only=("train_batch_size", "train_micro_batch_size_per_gpu"))
        if not opts.donate and isinstance(state, TrainState) and state.buffers:
            # The forward updates buffers in place (BatchNorm's statistics): an undonated step
            # runs it on copies, which the returned state holds, so the input keeps its own.
            state = state.replace(buffers={k: v.clone() for k, v in state.buffers.items()})
        before = comm.traffic.copy() if opts.comm_bytes else None
        update = int(state.step) if monitoring is not None and monitoring.lr is not None else 0
        if profiler is not None:
            profiler.before_call(mesh, batch)
        # The timer's handler first: outermost, it sees each primitive right above its plain
        # implementation (fzero/monitor/_timers.py).
        # donate=True: the step owns the state it is given (the step context says so inside);
        # jit: the model's forwards run compiled (fzero/_jit.py), everything else as it is.
        with monitoring.running(batch) if monitoring else contextlib.nullcontext() as times, \
                collecting_metrics() as emitted, running(donate=opts.donate, jit=jit):
            out = inner(state, batch)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
            raise TypeError(
                f"fzero.compile: {getattr(train_step, '__name__', 'train_step')} must return "
                f"(state, metrics) with metrics a dict, got {type(out).__name__}"
            )
        new, metrics = out
        if opts.donate and isinstance(state, TrainState) and new is not state:
            donated(state, int(new.step))
        metrics = {**metrics, **emitted}
        if before is not None:
            spent = comm.traffic - before
            metrics["comm_bytes"] = spent.comm_bytes()
            metrics["comm_bytes_by_axis"] = spent.sent_by_axis(_axes_of(mesh))
            if opts.offload_optimizer != "none" or opts.offload_param != "none":
                metrics["offload_bytes"] = spent.copy_bytes()
        if monitoring is not None:
            metrics = monitoring.report(metrics, times, new, batch, update)
        if profiler is not None:
            profiler.after_call(mesh)  # ends the trial after its last profiled step
        if opts.check_replicas is not None and isinstance(new, TrainState):
            _check_replicas(new)
        return new, metrics

    checked: dict[str, Any] = {"step": None}

    def _check_replicas(state: TrainState) -> None:
        at = int(state.step)
        if at % opts.check_replicas or checked["step"] == at:  # every N updates; a skipped one is not one
            return
        checked["step"] = at
        replicas.check(state, at, device=mesh.device, timeout_s=mesh.timeout_s,
                       buffers=opts.buffer_sync != "local", _counts=checked)

    step = Step(call, before=before, after=after, name=f"compiled({getattr(train_step, '__name__', 'step')})", inner=inner)
    step.mesh = mesh
    step.options = opts
    step.config = cfg
    step.monitors = monitoring.monitors if monitoring is not None else ()
    return step


def _axes_of(mesh: Mesh) -> dict[str, tuple[int, ...]]:
    """The groups ``comm_bytes_by_axis`` files traffic under: each axis, and under sequence
    parallelism with data parallelism beside it ``"dp_sp"``, ZeRO's group over both."""
    axes = {axis: mesh.ranks(axis) for axis in AXES}
    if mesh.size("dp") > 1 and mesh.size("sp") > 1:
        axes["dp_sp"] = mesh.ranks(DATA_AXES)
    return axes


def _check_kept_dtypes(opts: CompileOptions) -> None:
    """bf16 masters, bf16 optimizer state and stochastic rounding are bf16 mixed precision's:
    asked for under another precision they would do nothing, so they are an error."""
    asked = [f"{name}={value!r}" for name, value, default in (
        ("master_weights", opts.master_weights, "fp32"), ("optimizer_states", opts.optimizer_states, "fp32"),
        ("rounding", opts.rounding, "nearest")) if value != default]
    if asked and opts.precision != "bf16":
        raise ValueError(f"fzero.compile: {', '.join(asked)} need precision='bf16' (bf16.enabled in a config), "
                         f"got precision={opts.precision!r}")
    if opts.torch_autocast is not None and opts.precision != "fp32":
        raise ValueError(f"fzero.compile: torch_autocast={opts.torch_autocast!r} computes with fp32 weights under "
                         f"torch.autocast; it excludes precision={opts.precision!r} (low-precision weights): set one")
    if opts.lower_precision_safe_modules is not None and opts.torch_autocast is None:
        raise ValueError("fzero.compile: lower_precision_safe_modules= needs torch_autocast='bf16' "
                         "(torch_autocast.enabled in a config)")


def _nonfinite(opts: CompileOptions) -> str | None:
    """The mode of the ``check_finite`` transform ``opts`` ask for, or ``None`` (none, or
    mixed precision's own check does it)."""
    mode = opts.nonfinite
    if opts.precision == "fp32":
        return None if mode == "apply" else mode or "skip"
    scaled = opts.precision == "fp16" and opts.loss_scale is not None
    if scaled and mode not in (None, "skip"):
        raise ValueError(f"fzero.compile: nonfinite={mode!r} with fp16's loss scaler: the scaler skips an "
                         "overflowed update and lowers the scale, which is how it finds its scale; only "
                         "'skip' is possible (or loss_scale=None)")
    if not scaled and mode in ("skip", "apply") and (mode == "skip") != opts.check_grad_overflow:
        raise ValueError(f"fzero.compile: nonfinite={mode!r} contradicts check_grad_overflow="
                         f"{opts.check_grad_overflow} (bf16.check_grad_overflow in a config); set one")
    return "raise" if mode == "raise" else None


def _report(cfg: Any, only: tuple[str, ...] | None = None) -> None:
    """Say on the first rank which "auto" values were filled and from what: all of them at
    init, the batch sizes again at the first call when the batch filled them."""
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        text = cfg.report(only)
        if text:
            print(text, file=sys.stderr, flush=True)


def _monitoring(opts: CompileOptions, cfg: Config | None, mesh: Mesh):
    """The step's measurements and monitors (:mod:`fzero.monitor`), or ``None`` when it has
    none: then the step runs exactly as without them."""
    monitors = list(opts.monitors)
    lr = None
    if cfg is not None:
        monitors += cfg.make_monitors()  # on every rank: a missing package fails them all alike
        if cfg.optimizer is not None:
            # The config's learning rate: its optimizer and scheduler values never wait for the
            # state or a batch ("auto" ones are filled at Config.load), so this is what
            # step.init installs. Built at the first use.
            @functools.cache
            def schedule():
                lr0 = cfg.optimizer.hyperparameters()["lr"]
                return cfg.make_schedule() if cfg.scheduler is not None else (lambda _: float(lr0))

            def lr(count: int) -> float:
                return schedule()(count)
    if not (opts.timers or opts.flops or opts.memory or monitors):
        return None
    from fzero.monitor._run import Monitoring

    return Monitoring(device=torch.device(mesh.device), rank=mesh.rank, dp=mesh.size("dp"), dtype=opts.precision,
                      timers=opts.timers, flops=opts.flops, memory=opts.memory, peak_flops=opts.peak_flops,
                      tokens_per_batch=opts.tokens_per_batch, monitors=monitors, lr=lr)


def _options(config: Any, keywords: dict[str, Any], mesh: Mesh, auto: Any = None) -> tuple[CompileOptions, Any]:
    """The options from ``config`` (if any) and the keywords; a keyword may add to the
    config, never contradict it (it fills the config's ``"auto"`` values)."""
    cfg = None
    if config is not None:
        cfg = Config.load(config, world_size=mesh.size("dp"), auto=auto, options=keywords)
    opts = CompileOptions.from_keywords("fzero.compile", keywords, cfg.compile_options() if cfg else None,
                                        stacklevel=3)
    if cfg is not None:
        decided = cfg.decided_options()
        fields = {key: field_name(key) for key in keywords}
        clash = [f"{key}={keywords[key]!r} contradicts the config's {f}={decided[f]!r} ({', '.join(keys_of(f))})"
                 for key, f in fields.items() if f in decided and decided[f] != getattr(opts, f)]
        if clash:
            raise ValueError("fzero.compile: option " + "; ".join(clash) + "; set each in one place")
        if cfg.pipeline_stages is not None and opts.pipeline is None:
            raise ValueError("fzero.compile: the config has a pipeline section: pass pipeline=fzero.pipeline(stages, "
                             "loss_fn, mesh, ...), the stages the step computes its loss and gradients with")
        if cfg.pipeline_stages and cfg.pipeline_stages != mesh.size("pp"):
            raise ValueError(f"fzero.compile: the config's pipeline.stages={cfg.pipeline_stages} but {mesh} has "
                             f"pp={mesh.size('pp')}: make the mesh's pp axis that size")
        if cfg.sequence_parallel_size != mesh.size("sp"):
            raise ValueError(f"fzero.compile: the config's sequence_parallel_size={cfg.sequence_parallel_size} but "
                             f"{mesh} has sp={mesh.size('sp')}: make the mesh's sp axis that size "
                             f"(fzero.Mesh(sp={cfg.sequence_parallel_size}))")
        if cfg.autotp_size > 1 and cfg.autotp_size != mesh.size("tp"):
            raise ValueError(f"fzero.compile: the config's tensor_parallel.autotp_size={cfg.autotp_size} but "
                             f"{mesh} has tp={mesh.size('tp')}: make the mesh's tp axis that size")
    if opts.offload_optimizer != "none" and opts.zero == 0:
        raise ValueError(f"fzero.compile: offload_optimizer={opts.offload_optimizer!r} needs ZeRO stage 1, 2 or 3 "
                         "(it moves this rank's partition of the optimizer state to the host, as DeepSpeed's "
                         "ZeRO-Offload does); got stage=0")
    if opts.offload_param != "none" and opts.zero != 3:
        raise ValueError(f"fzero.compile: offload_param={opts.offload_param!r} needs ZeRO stage 3 (it moves this "
                         f"rank's partition of the parameters to the host, as DeepSpeed's offload_param does); "
                         f"got stage={opts.zero}")
    return opts, cfg
