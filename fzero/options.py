"""``CompileOptions``: every option of ``fzero.compile``, typed, one name per concept.

A field's name is the keyword ``compile`` takes (the public contract's ``zero=``,
``precision=``, ``accumulate=``, ``clip_norm=``, ``tp=``, ``pipeline=``; the transforms'
own names elsewhere), its docstring says which transform acts on it, and
:meth:`fzero.Config.compile_options` answers in the same names (``fzero/config/_options.py``
holds the one table from DeepSpeed's keys to these fields). A field that feeds a
transform's keyword is checked by that keyword's check (:mod:`fzero.transforms._checks`),
so a bad value gets the same message wherever it is given.

The module stands above the transforms: it checks ``tp=`` with the tensor-parallel plan's
own check and ``pipeline=`` against :class:`~fzero.transforms.pipeline.Pipeline`; nothing
below it imports it.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal

from fzero._jit import check_jit
from fzero.transforms._checks import CHECKS, DEFAULT_BUCKET_BYTES, boolean, choice, optional, positive_int, \
    positive_number
from fzero.transforms.pipeline import Pipeline
from fzero.transforms.tensor_parallel import check_plan

__all__ = ["CompileOptions", "DEFAULT_BUCKET_BYTES", "RENAMED", "TrialSpec", "field_name"]

# Other names of an option -> (its name now, still accepted). The accepted ones are the
# transforms' own keywords (shard_state(stage=), mixed_precision(dtype=)), which compile took
# as its fields before the contract's names did; giving one says the name now. The others
# are names of earlier versions: an error naming what replaced them, never a silent no-op.
RENAMED: dict[str, tuple[str, bool]] = {
    "stage": ("zero", True),
    "dtype": ("precision", True),
    "bucket_size": ("bucket_bytes", False),
    "reduce_dtype": ("reduce_in", False),
    "loss_scale_options": ("initial_scale_power=, loss_scale_window=, hysteresis=, consecutive_hysteresis= and "
                           "min_loss_scale=", False),
}


def field_name(keyword: str) -> str:
    """The :class:`CompileOptions` field a keyword of ``compile`` sets: itself, or the
    field a transform's name of it (:data:`RENAMED`) now is."""
    return RENAMED.get(keyword, (keyword,))[0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrialSpec:
    """An autotuning trial the compiled step runs (``compile(trial=)``): what ``fzero
    autotune`` asks of each run of the script, through its trial config's ``autotuning``
    section (docs/autotune.md), and what a test or notebook passes to profile a step.

    Example:
        >>> TrialSpec(mode="profile", metric_path="m.json", start_profile_step=5, end_profile_step=2)
        Traceback (most recent call last):
            ...
        ValueError: fzero autotune trial: need 1 <= start_profile_step <= end_profile_step, got start_profile_step=5, end_profile_step=2
    """

    mode: Literal["profile", "model_info"]
    """``"profile"``: time calls ``start_profile_step``..``end_profile_step``, write the
    result, end the run; ``"model_info"``: write Ψ (the trainable parameters) at
    ``step.init`` and end the run there."""

    metric_path: str
    """Where rank 0 writes the result (JSON)."""

    start_profile_step: int = 3
    """The first timed call, 1-based (the calls before it are warm-up)."""

    end_profile_step: int = 5
    """The last timed call, inclusive."""

    shutdown: bool = True
    """Destroy the process group before ending the trial (a trial that is a whole run);
    ``False`` leaves it to a caller that goes on."""

    def __post_init__(self):
        if self.mode not in ("profile", "model_info"):
            raise ValueError(f"fzero autotune trial: mode must be 'profile' or 'model_info', got {self.mode!r}")
        start, end = self.start_profile_step, self.end_profile_step
        if not (isinstance(start, int) and isinstance(end, int) and 1 <= start <= end):
            raise ValueError(f"fzero autotune trial: need 1 <= start_profile_step <= end_profile_step, got "
                             f"start_profile_step={start!r}, end_profile_step={end!r}")
        object.__setattr__(self, "metric_path", str(self.metric_path))


def _plan(v) -> str | None:
    try:
        check_plan(v)  # the transform's own check, once
    except TypeError:
        return "must be None, 'auto' or a dict of module-name globs to ColwiseParallel() / RowwiseParallel()"
    return None


def _pipeline(v) -> str | None:
    return None if isinstance(v, Pipeline) else "must be None or an fzero.pipeline(...) (a Pipeline)"


def _trial(v) -> str | None:
    return None if isinstance(v, TrialSpec) else "must be None or an fzero.autotune.TrialSpec"


def _class_paths(v) -> str | None:
    ok = isinstance(v, (tuple, list)) and all(isinstance(x, str) for x in v)
    return None if ok else "must be None or a list of module class paths such as 'torch.nn.Linear'"


def _monitors(v) -> str | None:
    ok = isinstance(v, (tuple, list)) and all(callable(getattr(m, "write", None)) and callable(getattr(m, "close", None))
                                             for m in v)
    return None if ok else "must be a list of monitors (objects with write(scalars, *, step, samples) and close())"


# Each field's check: the check of the transform keyword it feeds, or compile's own.
_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "zero": CHECKS["stage"],  # shard_state(stage=)
    "precision": choice("fp32", "bf16", "fp16"),  # mixed_precision(dtype=) beyond fp32
    "accumulate": CHECKS["micro_batches"],  # accumulate(micro_batches=)
    "clip_norm": optional(CHECKS["clip_norm"]),  # clip(clip_norm=)
    **{name: CHECKS[name] for name in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                                       "consecutive_hysteresis", "min_loss_scale", "check_grad_overflow",
                                       "reduce_in", "bucket_bytes", "overlap_comm", "buffer_sync", "offload_param",
                                       "pin_memory", "max_reuse_distance")},
    "nonfinite": optional(choice("skip", "raise", "apply")),
    "torch_autocast": optional(choice("bf16")),  # torch_autocast(dtype=)
    "lower_precision_safe_modules": optional(_class_paths),  # torch_autocast(lower_precision_safe_modules=)
    "master_weights": choice("fp32", "bf16"),  # mixed_precision(master_weights=)
    "optimizer_states": choice("fp32", "bf16"),  # mixed_precision(optimizer_states=)
    "rounding": choice("nearest", "stochastic", "kahan"),  # mixed_precision(rounding=)
    "donate": boolean,
    "jit": check_jit,
    "comm_bytes": boolean,
    "offload_optimizer": choice("none", "cpu"),
    "tp": optional(_plan),
    "sequence_parallel": boolean,
    "pipeline": optional(_pipeline),
    "trial": optional(_trial),
    "timers": boolean,
    "flops": boolean,
    "memory": boolean,
    "peak_flops": optional(positive_number),
    "tokens_per_batch": optional(positive_int),
    "check_replicas": optional(positive_int),
    "monitors": _monitors,
}


def _check(where: str, name: str, value: Any, field: str) -> None:
    why = _CHECKS[field](value)
    if why is not None:
        raise ValueError(f"{where}: {name}={value!r} {why}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileOptions:
    """The options of ``fzero.compile``; every field keyword-only, checked on creation.

    Example:
        >>> from fzero import CompileOptions
        >>> opts = CompileOptions(zero=2, precision="bf16", accumulate=4)
        >>> opts.zero, opts.bucket_bytes
        (2, None)
        >>> CompileOptions(zero=5)
        Traceback (most recent call last):
            ...
        ValueError: fzero.CompileOptions: zero=5 must be 0, 1, 2 or 3
    """

    zero: Literal[0, 1, 2, 3] = 0
    """ZeRO stage over the mesh's ``dp`` axis (:func:`fzero.shard_state`'s ``stage``): 0
    replicates (DDP on more than one rank), 1 partitions optimizer state, 2 also gradients,
    3 also parameters. ``compile`` still takes the transform's name, ``stage=``, with a
    ``DeprecationWarning``."""

    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute dtype; ``"bf16"`` / ``"fp16"`` keep fp32 master weights
    (:func:`fzero.mixed_precision`'s ``dtype``). ``compile`` still takes the transform's
    name, ``dtype=``, with a ``DeprecationWarning``."""

    accumulate: int = 1
    """Micro-batches per update (:func:`fzero.accumulate`'s ``micro_batches``; not
    :func:`fzero.pipeline`'s ``micro_batches``, which pipeline one update's batch)."""

    clip_norm: float | None = None
    """Clip gradients to this global L2 norm (:func:`fzero.clip`); ``metrics["grad_norm"]``
    is the norm before. torch's and optax's ``max_norm``, DeepSpeed's ``gradient_clipping``."""

    loss_scale: Literal["dynamic"] | float | None = "dynamic"
    """fp16 only: ``"dynamic"`` (DeepSpeed's scaler), a fixed float, or ``None``."""

    initial_scale_power: int = 16
    """fp16 dynamic scaler: the first scale is ``2**initial_scale_power`` (DeepSpeed's name)."""

    loss_scale_window: int = 1000
    """fp16 dynamic scaler: clean updates between two doublings of the scale."""

    hysteresis: int = 2
    """fp16 dynamic scaler: overflows tolerated before the scale halves."""

    consecutive_hysteresis: bool = False
    """fp16 dynamic scaler: refill the hysteresis on every clean update."""

    min_loss_scale: float = 1.0
    """fp16 dynamic scaler: the scale never drops below this; an overflow there is an error."""

    check_grad_overflow: bool = True
    """Without a loss scaler (bf16; fp16 with ``loss_scale=None``): skip an update whose
    gradients are not finite (DeepSpeed's ``bf16.check_grad_overflow``)."""

    master_weights: Literal["fp32", "bf16"] = "fp32"
    """Under ``precision="bf16"``: the dtype of the weights the optimizer steps
    (:func:`fzero.mixed_precision`'s ``master_weights``; DeepSpeed's
    ``bf16.bf16_master_weights_and_grads``)."""

    optimizer_states: Literal["fp32", "bf16"] = "fp32"
    """Under ``master_weights="bf16"``: the dtype of the optimizer's moments
    (:func:`fzero.mixed_precision`'s ``optimizer_states``; DeepSpeed's
    ``bf16.bf16_optimizer_states``)."""

    rounding: Literal["nearest", "stochastic", "kahan"] = "nearest"
    """Under ``master_weights="bf16"``: how the update's fp32 result is rounded into the bf16
    masters: to nearest, stochastically, or to nearest with a Kahan compensation
    (:func:`fzero.mixed_precision`'s ``rounding``)."""

    torch_autocast: Literal["bf16"] | None = None
    """Run the forward under ``torch.autocast`` with fp32 weights, no low-precision copies
    (:func:`fzero.torch_autocast`; DeepSpeed's ``torch_autocast`` section). Needs
    ``precision="fp32"``."""

    lower_precision_safe_modules: tuple[str, ...] | None = None
    """Under ``torch_autocast``: module classes whose parameters' gradients are reduced in
    the autocast dtype at ZeRO 1-3, as DeepSpeed reads this key (``None``: Linear and
    Conv1d/2d/3d)."""

    nonfinite: Literal["skip", "raise", "apply"] | None = None
    """An update whose gradients hold inf or NaN: ``"skip"`` it on every rank and say so in
    ``metrics["skipped"]`` (DeepSpeed's behaviour under its overflow checks), ``"raise"``
    :class:`fzero.NonFiniteGradientError` naming each non-finite gradient's key path before
    anything changes, or ``"apply"`` it (NaN parameters follow). ``None``, the default: fp32
    skips; fp16 and bf16 do what ``fzero.mixed_precision`` does (fp16's loss scaler skips,
    bf16 skips unless ``check_grad_overflow=False``). Under fp16 with a loss scaler only
    ``"skip"`` is possible (overflows are how the scaler learns); under bf16 ``"skip"`` and
    ``"apply"`` must agree with ``check_grad_overflow``."""

    reduce_in: Literal["fp32", "bf16", "fp16"] | None = None
    """The dtype gradients are summed in across ranks (``None``: fp32 for 16-bit gradients,
    else their own); ``"bf16"`` halves the bytes moved."""

    bucket_bytes: int | None = None
    """Bytes of gradients reduced together (one bucket, one collective). ``None``: chosen at
    ``step.init`` from the model: ``DEFAULT_BUCKET_BYTES`` (25 MiB, DDP's), the whole model
    when smaller, with the reduce buffers kept between steps bounded to 1/16 of the
    gradient; at stage 3 1/32 of the trainable parameters' bytes, at most 25 MiB, at least
    64 KiB (:func:`fzero.shard_state`'s ``bucket_bytes``)."""

    max_reuse_distance: int | float | None = None
    """ZeRO-3: a unit (a block) stays gathered from its forward to its backward, instead of
    being freed and gathered again, when the elements gathered from its gather until its
    backward (itself and the units after it) are at most this many -- DeepSpeed's
    ``zero_optimization.stage3_max_reuse_distance``; the last blocks of forward, whose
    backward comes first. The blocks fzero finds are gathered in runs of consecutive blocks
    within it, a unit each. ``0`` makes every block a unit and frees it after its forward
    (FSDP2's ``reshard_after_forward=True``). ``None``: 25 MiB of parameters' worth of
    elements (:func:`fzero.shard_state`'s ``max_reuse_distance``)."""

    overlap_comm: bool = True
    """Reduce each gradient bucket while backward goes on; ``False`` reduces them all after
    backward (DeepSpeed's ``zero_optimization.overlap_comm: false``): the same result,
    later, with every bucket held at once."""

    buffer_sync: Literal["broadcast", "mean", "local"] = "broadcast"
    """How ``state.buffers`` agree across ``dp`` ranks after a step: dp-rank 0's (DDP's),
    the mean of floating-point ones, or each rank's own."""

    donate: bool = True
    """The step owns the state it is given (JAX's ``donate_argnums``): the update writes the
    new parameters, moments and (under ZeRO-1/2) gathered parameters into the input state's
    tensors instead of allocating new ones each step, and the input state can no longer be
    used (the step marks it, so passing it again is an error). Write
    ``state, metrics = step(state, batch)``; ``False`` keeps every input state intact (a
    pure step, a new state each call; its forward runs on copies of the buffers, one copy of
    them per call)."""

    jit: bool | str | Mapping[str, Any] = False
    """Compile the model's computation with ``torch.compile`` (``fzero/_jit.py``): each
    module call the step makes through its ``apply_fn`` (the forward ``value_and_grad``
    differentiates, and AOTAutograd's backward of it) runs compiled, while every transform
    (ZeRO's collectives and hooks, mixed precision, accumulation, clipping, the optimizer)
    stays eager around it. ``True``: torch's default backend (inductor); a backend name
    (``"aot_eager"``, ``"eager"``, ...); or a dict of ``torch.compile`` keywords
    (``backend``, ``mode``, ``options``, ``dynamic``, ``fullgraph``). The first step
    compiles (the second may again, once ZeRO's or the donated buffers have replaced the
    initial tensors), none after. A dropout that draws a mask and ZeRO-3's gather hooks run
    eagerly between compiled graphs (graph breaks), so the masks are the eager step's.
    DeepSpeed's config spells it ``"compile": {"enabled": true, "backend": ...}``."""

    comm_bytes: bool = False
    """Report this rank's communication in the step's ``metrics["comm_bytes"]``: a dict of
    the bytes it sent on the wire in that step, by kind (``"all_reduce"``,
    ``"reduce_scatter"``, ``"all_gather"``, ``"all_to_all"`` (the 1-bit optimizers' exchange),
    ``"broadcast"``, ``"send"``, each present, 0
    when none) and their ``"total"``, as exact :class:`fractions.Fraction` values (``float()``
    them to log). Bytes sent are the ring algorithms' (:func:`fzero.distributed.comm.sent_bytes`:
    an all-reduce of ``S`` bytes over ``N`` ranks sends ``2 S (N - 1) / N``), counted from
    the step's first collective to its last, every micro-batch of an update included.
    Beside it, ``metrics["comm_bytes_by_axis"]``: the same bytes by the mesh axis they
    crossed (``"pp"``, ``"dp"``, ``"sp"``, ``"tp"``, each present; ``"dp_sp"``, ZeRO's group,
    on a mesh with both ``dp`` and ``sp`` above 1; and ``"other"`` for a group that is none of
    them), so tensor parallelism's all-reduces read apart from ZeRO's gradient and
    parameter traffic. Counting only reads sizes, so the step computes the same; off,
    ``metrics`` has neither key. DeepSpeed's config spells it
    ``"comms_logger": {"enabled": true}``."""

    offload_optimizer: Literal["none", "cpu"] = "none"
    """ZeRO-Offload (:func:`fzero.transforms.offload.offload_optimizer`): ``"cpu"`` keeps the
    fp32 master weights and the optimizer state of this rank's pieces in host memory and runs
    the update there; each update copies the gradient pieces to the host and the new
    parameter pieces back. Needs ``stage`` 1, 2 or 3 (as DeepSpeed's). With ``comm_bytes``,
    ``metrics["offload_bytes"]`` holds the step's bytes copied, ``{"d2h": n, "h2d": n}``.
    DeepSpeed's config spells it ``zero_optimization.offload_optimizer: {"device": "cpu"}``."""

    offload_param: Literal["none", "cpu"] = "none"
    """ZeRO-3's parameter offload (:func:`fzero.shard_state`'s ``offload_param``): ``"cpu"``
    keeps this rank's pieces of the parameters (the low-precision copies under mixed
    precision) in host memory; each gather of a unit copies the rank's slice to the device
    before all-gathering it, and each update writes the new pieces on the host. Needs
    ``stage`` 3 (as DeepSpeed's). With ``comm_bytes``, ``metrics["offload_bytes"]`` holds the
    step's bytes copied. DeepSpeed's config spells it
    ``zero_optimization.offload_param: {"device": "cpu"}``."""

    pin_memory: bool = False
    """With ``offload_optimizer="cpu"`` or ``offload_param="cpu"``: page-lock the host
    buffers (faster copies to and from a GPU; ignored without CUDA). DeepSpeed's
    ``offload_optimizer.pin_memory`` and ``offload_param.pin_memory``."""

    tp: Mapping[str, Any] | Literal["auto"] | None = None
    """The tensor-parallel plan over the mesh's ``tp`` axis (:func:`fzero.tensor_parallel`):
    module-name globs to ``fzero.ColwiseParallel()`` / ``fzero.RowwiseParallel()``, or
    ``"auto"`` (DeepSpeed's AutoTP: the common Linear layouts). Required when the mesh has a
    ``tp`` axis."""

    sequence_parallel: bool = False
    """With ``tp``: Megatron's sequence parallelism (Megatron-LM's ``--sequence-parallel``).
    Between the split pairs the activations are this rank's shard of the sequence: the
    pairs' all-reduces become an all-gather and a reduce-scatter, and the norms and dropouts
    run on ``1/tp`` of the tokens. The plan says where the shards begin and end
    (``fzero.PrepareModuleInput``, ``fzero.SequenceParallel``; ``tp_plans.gpt(model,
    sequence_parallel=True)``). No config key: DeepSpeed's ``sequence_parallel_size`` is
    Ulysses (the mesh's ``sp`` axis), and DeepSpeed's ``tensor_parallel`` section has none."""

    pipeline: Pipeline | None = None
    """The :class:`fzero.transforms.pipeline.Pipeline` over the mesh's ``pp`` axis
    (``fzero.pipeline(stages, loss_fn, mesh, micro_batches=, schedule=)``; ``schedule=
    "interleaved", virtual_stages=v`` for Megatron's interleaved 1F1B), applied outermost
    as ``pipe.transform``. The train step computes its loss and gradients with
    ``pipe(params, x, y)``. Required when the mesh has a ``pp`` axis."""

    trial: TrialSpec | None = None
    """An autotuning trial (:class:`TrialSpec`, exported as ``fzero.autotune.TrialSpec``):
    the step measures itself and ends the run with ``fzero.autotune.TrialDone``, a
    ``SystemExit(0)``. ``fzero autotune`` gives it through each trial's config, DeepSpeed's
    ``autotuning`` keys (``enabled`` with ``metric_path``, ``start_profile_step``,
    ``end_profile_step``; or ``enabled`` with ``model_info.profile`` and
    ``model_info_path``); ``None``, the default, measures nothing."""

    timers: bool = False
    """Time each step's phases into ``metrics["time"]``: seconds of ``forward``, ``backward``,
    ``reduce`` (the host waiting for gradient reduction: the communication backward did not
    hide), ``update`` (the optimizer), ``gather`` (waiting for parameter all-gathers) and the
    whole ``step`` (:mod:`fzero.monitor`; on a GPU each boundary synchronizes). DeepSpeed's
    ``wall_clock_breakdown``."""

    flops: bool = False
    """Count the step's FLOPs (``torch.utils.flop_counter``, once per batch shape) into
    ``metrics["flops"]`` (this rank's), with ``flops_per_s``, ``tokens_per_s`` (when the
    batch has tokens) and ``mfu`` (on a GPU whose peak is known, or with ``peak_flops``).
    DeepSpeed's ``flops_profiler.enabled``."""

    memory: bool = False
    """Report this rank's memory in ``metrics["memory"]``: ``state_bytes`` (the tensors its
    state holds), ``peak_rss_bytes`` and, on CUDA, ``cuda_peak_bytes``. DeepSpeed's
    ``memory_breakdown``."""

    peak_flops: float | None = None
    """The peak FLOP/s that ``mfu`` divides by (default: the GPU's dense peak for the step's
    precision, from :data:`fzero.monitor.PEAK_FLOPS`; none on a CPU)."""

    tokens_per_batch: int | None = None
    """Tokens in one local batch, for ``tokens_per_s`` (default: the element count of the
    batch's first integer tensor of two or more dimensions, :func:`fzero.monitor.batch_tokens`)."""

    check_replicas: int | None = None
    """Every this many updates, compare a fingerprint of every leaf that should be identical
    on the ranks holding it (dp replicas' parameters at stages 0-2 and replicated optimizer
    state, tp peers' whole weights, a tied weight's copies on pipeline stages) and raise
    :class:`fzero.ReplicaDivergenceError` on every rank, naming the leaves, the ranks and
    the step, when they differ (:mod:`fzero.replicas`). ``None``: never."""

    monitors: tuple = ()
    """Writers of each step's scalar metrics, on rank 0 (:class:`fzero.monitor.TensorBoard`,
    ``CSV``, ``Wandb``, ``JSONL``, or any object with ``write`` and ``close``); a config's
    ``tensorboard``, ``csv_monitor`` and ``wandb`` sections add theirs."""

    def __post_init__(self):
        object.__setattr__(self, "monitors", tuple(self.monitors) if isinstance(self.monitors, list)
                           else self.monitors)
        if isinstance(self.lower_precision_safe_modules, list):
            object.__setattr__(self, "lower_precision_safe_modules", tuple(self.lower_precision_safe_modules))
        for f in dataclasses.fields(self):
            _check("fzero.CompileOptions", f.name, getattr(self, f.name), f.name)

    @classmethod
    def from_keywords(cls, where: str, keywords: Mapping[str, Any], base: "CompileOptions | None" = None,
                      *, stacklevel: int = 2) -> "CompileOptions":
        """``base`` (default: the defaults) with ``keywords`` applied, the way ``compile``
        takes them: a transform's name of a field (:data:`RENAMED`: ``stage=``, ``dtype=``)
        accepted with a ``DeprecationWarning`` naming the field, every unknown keyword or
        earlier name named at once, a bad value named as the caller spelled it.

        Raises:
            TypeError: unknown or renamed keywords, or one option given under both names.
            ValueError: a value out of range.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        bad, fields = [], {}
        for key, value in keywords.items():
            field, accepted = RENAMED.get(key, (key, True))
            if not accepted:
                bad.append(f"{key!r} is now {field}")
            elif field not in names:
                close = difflib.get_close_matches(key, names, n=1)
                bad.append(f"unknown option {key!r}" + (f"; did you mean {close[0]!r}?" if close else ""))
            elif field in fields:
                bad.append(f"{key!r} and {fields[field][0]!r} are one option; give it once")
            else:
                fields[field] = (key, value)
        if bad:
            raise TypeError(f"{where}: " + "; ".join(bad) + f" (valid options: {', '.join(names)})")
        for field, (key, value) in fields.items():
            _check(where, key, value, field)
            if key != field:
                warnings.warn(f"{where}: {key}= is now {field}= (the option's name in compile, CompileOptions and "
                              f"docs/transforms.md; {key}= is the transform's own keyword)", DeprecationWarning,
                              stacklevel=stacklevel + 1)
        return dataclasses.replace(base or cls(), **{f: v for f, (_, v) in fields.items()})

    def replace(self, **changes) -> "CompileOptions":
        """A copy with ``changes`` (field names), checked."""
        return dataclasses.replace(self, **changes)

    def scaler(self) -> dict[str, Any]:
        """The fp16 dynamic scaler's settings, as :func:`fzero.mixed_precision` takes them."""
        return {"initial_scale_power": self.initial_scale_power, "loss_scale_window": self.loss_scale_window,
                "hysteresis": self.hysteresis, "consecutive_hysteresis": self.consecutive_hysteresis,
                "min_loss_scale": self.min_loss_scale}
