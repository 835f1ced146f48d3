"""``Config``: a whole DeepSpeed config, resolved for one data-parallel world size.

The data (the sections, the batch sizes), what ``fzero.compile`` takes from it
(:meth:`Config.compile_options`) and what ``step.init`` installs (:meth:`Config.install`);
reading JSON and classifying its keys is :mod:`fzero.config._load`'s.
"""

from __future__ import annotations

import dataclasses
import warnings
import sys
from collections.abc import Mapping
from typing import Any, Literal

import torch

from fzero.config import _load, _options
from fzero.config._keys import GRADIENT_CLIPPING_DEFAULT
from fzero.config._options import COMM_DTYPES
from fzero.config._sections import ZERO_TESTED_TORCH, BF16Config, FP16Config, OptimizerConfig, SchedulerConfig, ZeroConfig
from fzero.config._values import WHERE, _bool, _int, _num
from fzero.optim import GradientTransformation, schedules
from fzero.options import CompileOptions, TrialSpec, field_name

_BATCH_PATHS = ("train_batch_size", "train_micro_batch_size_per_gpu")

__all__ = ["Config"]


def _default_world_size() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def _resolve_batch(train: int | None, micro: int | None, gas: int | None, world: int) -> tuple[int, int, int]:
    """DeepSpeed's ``_set_batch_related_parameters`` then ``_batch_assertion``.

    Any two imply the third (floor division, as DeepSpeed); ``train_batch_size`` alone means
    one accumulation step; ``train_micro_batch_size_per_gpu`` alone means one step and
    ``train = micro * world``. The result must satisfy ``train = micro * gas * world`` with
    every value >= 1.
    """
    given = {"train_batch_size": train, "train_micro_batch_size_per_gpu": micro,
             "gradient_accumulation_steps": gas}
    if train is None and micro is None:
        raise ValueError(f"{WHERE}: train_batch_size or train_micro_batch_size_per_gpu is required "
                         f"(as in DeepSpeed); got gradient_accumulation_steps={gas!r}, world size {world}")
    if train is not None and micro is not None and gas is None:
        gas = train // micro // world
    elif train is not None and gas is not None and micro is None:
        micro = train // world // gas
    elif micro is not None and gas is not None and train is None:
        train = micro * gas * world
    elif train is not None and micro is None and gas is None:
        gas, micro = 1, train // world
    elif micro is not None and train is None and gas is None:
        gas, train = 1, micro * world
    if min(train, micro, gas) < 1 or train != micro * gas * world:
        shown = {k: f"{v}" + ("" if given[k] is not None else " (derived)")
                 for k, v in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro),
                              ("gradient_accumulation_steps", gas))}
        raise ValueError(
            f"{WHERE}: inconsistent batch sizes: train_batch_size must equal "
            f"train_micro_batch_size_per_gpu * gradient_accumulation_steps * world size, every one "
            f">= 1; got train_batch_size={shown['train_batch_size']}, "
            f"train_micro_batch_size_per_gpu={shown['train_micro_batch_size_per_gpu']}, "
            f"gradient_accumulation_steps={shown['gradient_accumulation_steps']}, world size={world} "
            f"({micro} * {gas} * {world} = {micro * gas * world})")
    return train, micro, gas


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """A DeepSpeed config, checked and resolved for one data-parallel world size.

    Build it with :meth:`load` (a dict, a JSON file path, or JSON text); constructing it
    directly from the section dataclasses runs the same checks. Frozen: change it with
    ``dataclasses.replace``.

    Example:
        >>> cfg = Config.load({"train_micro_batch_size_per_gpu": 4,
        ...                    "gradient_accumulation_steps": 2,
        ...                    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
        ...                    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10,
        ...                                                                "warmup_type": "linear"}},
        ...                    "bf16": {"enabled": True},
        ...                    "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7},
        ...                    "gradient_clipping": 1.0}, world_size=2)
        >>> cfg.train_batch_size, cfg.local_batch_size
        (16, 8)
        >>> opts = cfg.compile_options()
        >>> opts.zero, opts.precision, opts.accumulate, opts.clip_norm, opts.bucket_bytes
        (2, 'bf16', 2, 1.0, 200000000)
        >>> lr = cfg.make_schedule()
        >>> [round(lr(k), 5) for k in (0, 1, 6, 11, 100)]
        [0.0, 0.0, 0.00015, 0.0003, 0.0003]
    """

    train_batch_size: int | None = None
    """Samples per update over all data-parallel ranks (resolved if not given)."""

    train_micro_batch_size_per_gpu: int | None = None
    """Samples per rank per micro-batch (resolved if not given)."""

    gradient_accumulation_steps: int | None = None
    """Micro-batches per update (``fzero.compile(accumulate=...)``); each rank's step gets a
    local batch of ``micro * steps`` samples and splits it (resolved if not given)."""

    world_size: int = 1
    """The data-parallel world size the batch sizes are resolved for (the mesh's ``dp``)."""

    optimizer: OptimizerConfig | None = None
    """The ``optimizer`` section, or ``None`` (the state's own optimizer is kept)."""

    scheduler: SchedulerConfig | None = None
    """The ``scheduler`` section, or ``None`` (a constant learning rate)."""

    fp16: FP16Config = dataclasses.field(default_factory=FP16Config)
    """The ``fp16`` section."""

    bf16: BF16Config = dataclasses.field(default_factory=BF16Config)
    """The ``bf16`` section."""

    zero_optimization: ZeroConfig = dataclasses.field(default_factory=ZeroConfig)
    """The ``zero_optimization`` section."""

    gradient_clipping: float = GRADIENT_CLIPPING_DEFAULT
    """Clip gradients to this global L2 norm; 0 means no clipping. Not written: 1.0, as
    DeepSpeed 0.19 (older DeepSpeed did not clip by default; write 0 for that)."""

    communication_data_type: Literal["fp32", "fp16", "bfp16", "bf16"] | None = None
    """dtype gradients are reduced in (``None``/``"fp32"``: fp32, fzero's default)."""

    pipeline_stages: int | None = None
    """The ``pipeline`` section: ``None`` when the config has none; else ``pipeline.stages``
    (0 for DeepSpeed's ``"auto"``). A config with the section needs
    ``compile(pipeline=fzero.pipeline(...))``, on a mesh whose ``pp`` axis has that many ranks."""

    autotp_size: int = 1
    """``tensor_parallel.autotp_size``: DeepSpeed's AutoTP degree. Above 1 the compiled step
    splits the common Linear layouts over the mesh's ``tp`` axis, which must have this size
    (``compile(tp="auto")``, :func:`fzero.transforms.tensor_parallel.auto_plan`)."""

    sequence_parallel_size: int = 1
    """``sequence_parallel_size``: DeepSpeed-Ulysses' degree. The mesh's ``sp`` axis
    (``fzero.Mesh(sp=)``) must have this size; data parallelism is the rest of the world
    over it, as in DeepSpeed (``train_batch_size`` counts the ``dp`` ranks only)."""

    comms_logger: bool | None = None
    """``comms_logger.enabled``: each step's ``metrics["comm_bytes"]`` says the bytes this
    rank sent, by collective kind (``fzero.compile(comm_bytes=)``); ``None`` when the config
    has no ``comms_logger`` section. Its other keys (``verbose``, ``prof_all``,
    ``prof_ops``, ``debug``) choose what DeepSpeed prints and are accepted with no effect."""

    wall_clock_breakdown: bool | None = None
    """``wall_clock_breakdown``: each step's ``metrics["time"]`` holds its phases' seconds
    (``fzero.compile(timers=)``); ``None`` when the config does not write it."""

    memory_breakdown: bool | None = None
    """``memory_breakdown``: each step's ``metrics["memory"]`` holds this rank's memory
    (``fzero.compile(memory=)``); ``None`` when the config does not write it."""

    flops_profiler: bool | None = None
    """``flops_profiler.enabled``: each step's metrics hold its FLOPs, FLOP/s, tokens/s and
    MFU (``fzero.compile(flops=)``); ``None`` when the config has no such section."""

    torch_autocast: Mapping[str, Any] | None = None
    """The ``torch_autocast`` section when enabled, as ``fzero.compile(torch_autocast=,
    lower_precision_safe_modules=)`` takes it: ``{"dtype": "bf16",
    "lower_precision_safe_modules": (class paths,) or None}``; ``None`` when the config has
    no enabled section."""

    compile: bool | str | Mapping[str, Any] | None = None
    """The ``compile`` section (``enabled``, ``backend``, ``kwargs``) as ``fzero.compile(jit=)``
    takes it: ``False`` when not enabled, ``True`` (torch's default backend), a backend's
    name, or a dict of torch.compile's keywords; ``None`` when the config has no such
    section."""

    tensorboard: Mapping[str, Any] | None = None
    """The ``tensorboard`` section's keys as written (``enabled``, ``output_path``,
    ``job_name``), or ``None``; enabled, :meth:`make_monitors` builds its writer."""

    csv_monitor: Mapping[str, Any] | None = None
    """The ``csv_monitor`` section's keys as written (``enabled``, ``output_path``,
    ``job_name``), or ``None``."""

    wandb: Mapping[str, Any] | None = None
    """The ``wandb`` section's keys as written (``enabled``, ``project``, ``group``,
    ``team``), or ``None``."""

    check_replicas: int | None = None
    """``fzero.check_replicas`` (fzero's own section, not DeepSpeed's): compare the
    replicas' fingerprints every this many updates (``fzero.compile(check_replicas=)``);
    ``None`` when not written."""

    trial: TrialSpec | None = None
    """The ``autotuning`` section as the trial it asks of this run (``fzero.compile(trial=)``),
    as DeepSpeed's engine reads it: ``enabled`` with ``model_info.profile`` and
    ``model_info_path`` (write Ψ at ``step.init`` and end the run), or ``enabled`` with
    ``metric_path`` (time ``start_profile_step``..``end_profile_step``, write the result, end
    the run). ``None`` otherwise: the section's other keys are ``fzero autotune``'s."""

    dataloader_drop_last: bool | None = None
    """``dataloader_drop_last``: whether :class:`fzero.data.DataLoader` built from this config
    drops a short last global batch; ``None`` when not written (the loader then drops it)."""

    zero_allow_untested_optimizer: bool = False
    """``zero_allow_untested_optimizer``: as DeepSpeed, a ``torch.optim`` class the optimizer
    section names outside DeepSpeed's tested list (``Adam``, ``AdamW``, ``Adagrad``) runs under
    ZeRO (stage ≥ 1) only with this true. A client ``tx=`` (fzero's own, or
    ``fzero.optim.from_torch``) needs no permission: it runs exactly at every stage."""

    ignored: tuple[str, ...] = dataclasses.field(default=(), compare=False)
    """DeepSpeed keys that were accepted but have no effect in fzero, each with the reason
    (only those whose value differs from DeepSpeed's default). Not compared: two configs
    that differ only in keys with no effect do the same."""

    source: str | None = dataclasses.field(default=None, compare=False)
    """The file the config was read from, for error messages; ``None`` for a dict."""

    pending: tuple[str, ...] = ()
    """The ``"auto"`` values not known yet, by dotted path: the bucket size (filled at
    ``step.init`` from the model's hidden size) and the micro-batch (from the first batch).
    :meth:`resolve` fills them."""

    auto: Mapping[str, tuple[Any, str]] = dataclasses.field(default_factory=dict, compare=False)
    """The ``"auto"`` values filled so far: ``{path: (value, where it came from)}``
    (``value`` is ``None`` for a key left out: derived, or with no effect in fzero)."""

    _given: tuple = dataclasses.field(init=False, repr=False, compare=False, default=())
    _raw: Any = dataclasses.field(init=False, repr=False, compare=False, default=None)
    _known: Any = dataclasses.field(init=False, repr=False, compare=False, default=None)
    _verdicts: tuple = dataclasses.field(init=False, repr=False, compare=False, default=())
    _foreign: tuple = dataclasses.field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        w = _int("world_size", self.world_size, minimum=1)
        triple = [None if v is None else _int(name, v, minimum=1) for name, v in (
            ("train_batch_size", self.train_batch_size),
            ("train_micro_batch_size_per_gpu", self.train_micro_batch_size_per_gpu),
            ("gradient_accumulation_steps", self.gradient_accumulation_steps))]
        if any(p in self.pending for p in _BATCH_PATHS):  # "auto": the first batch says
            train, micro, gas = None, None, triple[2] or 1
        else:
            train, micro, gas = _resolve_batch(*triple, w)
        for name, v in (("world_size", w), ("train_batch_size", train),
                        ("train_micro_batch_size_per_gpu", micro), ("gradient_accumulation_steps", gas)):
            object.__setattr__(self, name, v)
        object.__setattr__(self, "_given", tuple(triple))
        for name, cls in (("optimizer", OptimizerConfig), ("scheduler", SchedulerConfig),
                          ("fp16", FP16Config), ("bf16", BF16Config), ("zero_optimization", ZeroConfig)):
            v = getattr(self, name)
            if not (isinstance(v, cls) or (v is None and name in ("optimizer", "scheduler"))):
                raise TypeError(f"{WHERE}: {name} must be a {cls.__name__}, got {type(v).__name__}")
        if self.fp16.enabled and self.bf16.enabled:
            raise ValueError(f"{WHERE}: fp16 and bf16 are both enabled; enable one (DeepSpeed "
                             "refuses both too)")
        if self.torch_autocast is not None and (self.fp16.enabled or self.bf16.enabled):
            raise ValueError(f"{WHERE}: torch_autocast computes with fp32 weights under torch.autocast; it cannot be "
                             f"enabled with {'fp16' if self.fp16.enabled else 'bf16'} (low-precision weights); "
                             "enable one")
        if self.bf16.enabled and self.bf16.bf16_master_weights_and_grads and self.zero_optimization.stage == 0:
            raise ValueError(f"{WHERE}: bf16.bf16_master_weights_and_grads needs zero_optimization.stage 1, 2 or 3 "
                             "(DeepSpeed 0.19 takes it only there); got stage 0")
        object.__setattr__(self, "gradient_clipping",
                           _num("gradient_clipping", self.gradient_clipping, minimum=0.0))
        if self.communication_data_type is not None and self.communication_data_type not in COMM_DTYPES:
            raise ValueError(f"{WHERE}: communication_data_type must be one of "
                             f"{', '.join(map(repr, COMM_DTYPES))}, got {self.communication_data_type!r}")
        if self.trial is not None and not isinstance(self.trial, TrialSpec):
            raise TypeError(f"{WHERE}: trial must be an fzero.autotune.TrialSpec or None, got "
                            f"{type(self.trial).__name__}")
        if self.comms_logger is not None:
            _bool("comms_logger.enabled", self.comms_logger)
        for name in ("wall_clock_breakdown", "memory_breakdown", "flops_profiler"):
            if getattr(self, name) is not None:
                _bool(name, getattr(self, name))
        bad = []
        for name, texts in (("tensorboard", ("output_path", "job_name")), ("csv_monitor", ("output_path", "job_name")),
                            ("wandb", ("project", "group", "team"))):
            section = getattr(self, name)
            if section is None:
                continue
            if not isinstance(section.get("enabled", False), bool):
                bad.append(f"{name}.enabled must be true or false, got {section['enabled']!r}")
            bad += [f"{name}.{key} must be a string, got {section[key]!r}" for key in texts
                    if section.get(key) is not None and not isinstance(section[key], str)]
        if bad:
            raise TypeError(f"{WHERE}: " + "; ".join(bad))
        if self.dataloader_drop_last is not None:
            _bool("dataloader_drop_last", self.dataloader_drop_last)
        _bool("zero_allow_untested_optimizer", self.zero_allow_untested_optimizer)
        opt = self.optimizer
        if (opt is not None and opt.kind == "torch" and opt.type not in ZERO_TESTED_TORCH
                and self.zero_optimization.stage > 0 and not self.zero_allow_untested_optimizer):
            raise ValueError(
                f"{WHERE}: optimizer.type={opt.type!r} (torch.optim.{opt.type}) under zero_optimization.stage "
                f"{self.zero_optimization.stage}: DeepSpeed runs an optimizer outside its tested list under ZeRO "
                "only with \"zero_allow_untested_optimizer\": true, and so does fzero (which runs it exactly: "
                "element-wise on this rank's pieces, whole-tensor ones by an owner rank); add that key")
        object.__setattr__(self, "ignored", tuple(self.ignored))
        object.__setattr__(self, "pending", tuple(self.pending))

    # ------------------------------------------------------------------ reading

    @classmethod
    def load(cls, src: Any, *, world_size: int | None = None, auto: Any = None,
             options: Mapping[str, Any] | None = None) -> "Config":
        """Read a DeepSpeed config.

        Args:
            src: a dict, a path (``str`` or ``os.PathLike``) to a JSON file, JSON text (a
                ``str`` starting with ``{``), or a :class:`Config` (returned as is, or
                re-resolved for another ``world_size``, ``auto`` or ``options``).
            world_size: the data-parallel world size to resolve the batch sizes for
                (``fzero.compile`` passes its mesh's ``dp`` size). Default: the
                ``torch.distributed`` world size when it is initialised, else 1.
            auto: what to fill Hugging Face's ``"auto"`` values with: a mapping of dotted
                config paths (``{"optimizer.params.lr": 3e-4}``) and/or Hugging Face's
                argument names (``learning_rate``, ``per_device_train_batch_size``,
                ``gradient_accumulation_steps``, ``max_grad_norm``, ``adam_beta1``,
                ``adam_beta2``, ``adam_epsilon``, ``weight_decay``, ``warmup_steps``,
                ``max_steps``, ``fp16``, ``bf16``, ``hidden_size``), or an object with
                those attributes (a ``transformers.TrainingArguments``). See docs/config.md.
            options: ``fzero.compile``'s keyword options by field name, which fill
                ``"auto"`` values too (``accumulate``, ``dtype``, ``clip_norm``, ``stage``).

        Returns:
            A :class:`Config`. Keys accepted without effect are in ``.ignored`` and are
            reported, with the keys DeepSpeed itself does not read, in one ``UserWarning``.
            ``"auto"`` values filled are in ``.auto``; those only the state or the first
            batch can fill are in ``.pending``.

        Raises:
            ConfigKeyError, NotImplementedError, ValueError, TypeError: one problem: a key
                DeepSpeed does not know (with the nearest valid key), a DeepSpeed feature
                fzero does not implement, inconsistent batch sizes, invalid JSON (file,
                line and column), a value out of range or of the wrong type, an ``"auto"``
                nothing can fill -- each named by its dotted path.
            ConfigError: several of those, all listed, each by its path (it is each of
                the exception types above).
            FileNotFoundError: ``src`` names no file.
        """
        # compile's keywords by the field they set (a transform's name of one, stage=, too)
        options = {field_name(key): value for key, value in (options or {}).items()}
        if isinstance(src, Config):
            world = src.world_size if world_size is None else world_size
            if src._raw is not None and (auto is not None or options or world != src.world_size):
                known = src._known.but(auto=auto if auto is not None else src._known.auto,
                                       options={**src._known.options, **(options or {})})
                return _load.from_dict(cls, src._raw, world, src.source, known)
            if world == src.world_size:
                return src
            train, micro, gas = src._given
            return dataclasses.replace(src, world_size=world, train_batch_size=train,
                                       train_micro_batch_size_per_gpu=micro,
                                       gradient_accumulation_steps=gas)
        d, source = _load.read(src)
        cfg = _load.from_dict(cls, d, world_size if world_size is not None else _default_world_size(), source,
                              _load.Known(auto=auto, options=options))
        noted = list(cfg.ignored) + list(cfg._foreign)
        if noted:
            warnings.warn(f"{WHERE}: these keys have no effect in fzero: " + "; ".join(noted),
                          UserWarning, stacklevel=2)
        return cfg

    def resolve(self, *, state: Any = None, batch: Any = None) -> "Config":
        """This config with its pending ``"auto"`` values filled: from ``state`` (its
        model's hidden size), or from ``batch`` (the leading size of its first tensor is
        micro-batch × accumulation steps). Itself when nothing is pending.

        Raises:
            ValueError: a pending value ``state`` or ``batch`` cannot fill, named.
        """
        if not self.pending or self._raw is None:
            return self
        known = self._known
        if state is not None:
            from fzero.config._auto import hidden_size_of

            hidden = hidden_size_of(getattr(state.apply_fn, "module", None))
            known = known.but(at_init=True, hidden=hidden if known.hidden is None else known.hidden)
        if batch is not None:
            import fzero.tree as tree

            rows = tree.leading_size(batch)
            if rows is None:
                raise ValueError(f"{WHERE}: train_micro_batch_size_per_gpu is \"auto\" and the first batch has no "
                                 "tensor with a leading axis to take it from; give a value in the config or auto=")
            known = known.but(batch=rows)
        return _load.from_dict(type(self), self._raw, self.world_size, self.source, known)

    def report(self, only: tuple[str, ...] | None = None) -> str:
        """The ``"auto"`` values filled (those at ``only``'s paths, if given), one per line;
        empty when there are none."""
        def shown(path, value):
            if value is None and path in _BATCH_PATHS and getattr(self, path) is not None:
                value = getattr(self, path)
            return f"{path}: " if value is None else f"{path} = {value!r}: "

        lines = [f"  {shown(path, value)}{where}"
                 for path, (value, where) in self.auto.items() if only is None or path in only]
        lines += [f"  {path}: not known yet (the state or the first batch fills it)"
                  for path in self.pending if only is None or path in only]
        return (f"{WHERE}: \"auto\" values" + (f" of {self.source}" if self.source else "") + ":\n"
                + "\n".join(lines)) if lines else ""

    def verdicts(self) -> list[tuple[str, str, str]]:
        """What fzero does with each key of the config it was read from: ``(path, verdict,
        detail)``, verdict one of ``used``, ``no effect``, ``off``, ``not read``, ``auto``
        (``fzero config check`` prints these)."""
        return list(self._verdicts)

    # ------------------------------------------------------------------ derived values

    @property
    def precision(self) -> Literal["fp32", "bf16", "fp16"]:
        """``"fp16"``, ``"bf16"`` or ``"fp32"``, from the ``fp16`` and ``bf16`` sections."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    @property
    def local_batch_size(self) -> int:
        """Samples each data-parallel rank passes to one step call: micro-batch * steps."""
        if self.train_micro_batch_size_per_gpu is None:
            raise ValueError(f"{WHERE}: the micro-batch size is \"auto\" and no batch has filled it yet "
                             "(fzero.compile fills it at the first step call; or cfg.resolve(batch=...))")
        return self.train_micro_batch_size_per_gpu * self.gradient_accumulation_steps

    def decided_options(self) -> dict[str, Any]:
        """The :class:`fzero.CompileOptions` fields this config decides, by field name: a
        keyword of ``fzero.compile`` may set the others, never contradict these.

        One table says which DeepSpeed keys decide which field, and how
        (``fzero/config/_options.py``, shown in docs/config.md). Always decided: ``zero``,
        ``precision``, ``loss_scale`` and the fp16 scaler's settings, ``check_grad_overflow``,
        ``accumulate``, ``clip_norm``; the others only when the config writes their keys.
        """
        return _options.decided(self)

    def compile_options(self) -> CompileOptions:
        """The options of ``fzero.compile`` this config asks for: :meth:`decided_options`
        over the defaults of :class:`fzero.CompileOptions`."""
        return CompileOptions(**self.decided_options())

    def make_schedule(self, *, base_lr: float | None = None) -> schedules.Schedule:
        """The ``scheduler`` section as a schedule ``fn(count) -> lr`` (count 0-based).

        Args:
            base_lr: the optimizer learning rate ``WarmupCosineLR`` scales and ``WarmupLR``
                uses when ``warmup_max_lr`` is missing. Default: the ``optimizer``
                section's ``lr`` (with its DeepSpeed default 1e-3).

        Raises:
            ValueError: the config has no ``scheduler`` section, or ``WarmupCosineLR``
                without an optimizer section or ``base_lr``.
        """
        if self.scheduler is None:
            raise ValueError(f"{WHERE}.make_schedule: the config has no scheduler section")
        self._ready("make_schedule", "scheduler.")
        if base_lr is None and self.optimizer is not None:
            base_lr = self.optimizer.hyperparameters()["lr"]
        with warnings.catch_warnings():  # warned once already, when the section was read
            warnings.simplefilter("ignore", UserWarning)
            return self.scheduler.build(base_lr)

    def make_optimizer(self, module: torch.nn.Module | None = None) -> GradientTransformation:
        """The ``optimizer`` section as an :mod:`fzero.optim` transformation, with the
        ``scheduler`` section (if any) as its learning rate: use it as ``tx=`` of
        ``fzero.TrainState.create``.

        Gradient clipping is not part of it: ``fzero.compile`` adds ``clip_norm`` in front.

        Args:
            module: the model, for the muP types (``MuAdam``, ``MuAdamW``, ``MuSGD``), whose
                learning rates come from each parameter's ``infshape``.

        Raises:
            ValueError: the config has no ``optimizer`` section.

        Example:
            >>> cfg = Config.load({"train_batch_size": 4,
            ...                    "optimizer": {"type": "Lion", "params": {"lr": 1e-4}}})
            >>> from fzero import optim
            >>> spec = optim.fused_spec_of(cfg.make_optimizer())
            >>> spec.kind, spec.learning_rate, spec.b2, spec.weight_decay
            ('lion', 0.0001, 0.999, 0.0)
        """
        if self.optimizer is None:
            raise ValueError(f"{WHERE}.make_optimizer: the config has no optimizer section")
        self._ready("make_optimizer", "optimizer.", "scheduler.")
        lr = self.make_schedule() if self.scheduler is not None else self.optimizer.hyperparameters()["lr"]
        infshapes = None if module is None else \
            {k: getattr(p, "infshape", None) for k, p in module.named_parameters() if p.requires_grad}
        return self.optimizer.build(lr, infshapes=infshapes)

    def make_monitors(self) -> list:
        """The writers of the enabled ``tensorboard``, ``csv_monitor`` and ``wandb`` sections
        (:mod:`fzero.monitor`), with DeepSpeed's defaults for the keys not written; the
        compiled step writes each step's metrics to them on rank 0.

        Raises:
            ImportError: an enabled ``tensorboard`` or ``wandb`` section whose package is
                not installed (the message names the section).

        Example:
            >>> cfg = Config.load({"train_batch_size": 4,
            ...                    "csv_monitor": {"enabled": True, "output_path": "logs", "job_name": "run1"},
            ...                    "tensorboard": {"enabled": False}})
            >>> [(type(m).__name__, m.log_dir) for m in cfg.make_monitors()]
            [('CSV', 'logs/run1')]
        """
        from fzero import monitor

        out = []
        for name, make in (("tensorboard", monitor.TensorBoard), ("csv_monitor", monitor.CSV)):
            section = getattr(self, name)
            if section and section.get("enabled", False):
                out.append(make(section.get("output_path") or "", section.get("job_name") or "DeepSpeedJobName"))
        if self.wandb and self.wandb.get("enabled", False):
            out.append(monitor.Wandb(project=self.wandb.get("project") or "deepspeed", group=self.wandb.get("group"),
                                     team=self.wandb.get("team")))
        return out

    def _ready(self, what: str, *prefixes: str) -> None:
        waiting = [p for p in self.pending if p.startswith(prefixes)]
        if waiting:
            raise ValueError(f"{WHERE}.{what}: {', '.join(waiting)} "
                             f"{'is' if len(waiting) == 1 else 'are'} \"auto\" and not filled yet: "
                             "step.init and the first call fill them (or call cfg.resolve(state=..., batch=...), "
                             "or pass auto={path: value} to Config.load)")

    def install(self, state: Any, opt_state: bool = True) -> Any:
        """``state`` with this config's optimizer as ``tx`` and a fresh ``opt_state``, as
        ``deepspeed.initialize`` builds them; ``state`` unchanged without an optimizer
        section. ``fzero.compile(config=...)`` calls this in ``step.init``, with
        ``opt_state=False`` where a transform inside builds the optimizer state (over masters
        or pieces): ``opt_state`` is then left as it is.

        Raises:
            NotImplementedError: a ``scheduler`` section without an ``optimizer`` section
                (DeepSpeed wraps the client's optimizer; fzero cannot reach into ``tx``:
                build it with ``learning_rate=cfg.make_schedule()`` instead).
        """
        if self.optimizer is None:
            if self.scheduler is not None:
                raise NotImplementedError(
                    f"{WHERE}: a scheduler section without an optimizer section: fzero cannot "
                    "put a schedule into the state's own optimizer; build it with "
                    "learning_rate=config.make_schedule(), or add an optimizer section")
            return state
        module = getattr(state.apply_fn, "module", None)
        tx = self.make_optimizer(module if isinstance(module, torch.nn.Module) else None)
        return state.replace(tx=tx, opt_state=tx.init(state.params)) if opt_state else state.replace(tx=tx)
