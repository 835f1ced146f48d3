"""``fzero.Config``: DeepSpeed's JSON config format, read into keyword-only dataclasses.

A DeepSpeed config (a dict, a JSON file, or JSON text) becomes a frozen :class:`Config`
with one dataclass per section. :meth:`Config.compile_options` gives the keyword options of
``fzero.compile``; :meth:`Config.make_optimizer` builds the ``optimizer`` section, with the
``scheduler`` section as its learning rate, as ``deepspeed.initialize`` builds them.

Every key is accounted for. A key DeepSpeed does not know (a typo) is a
:class:`ConfigKeyError` naming it with its dotted path and the nearest valid key, at every
nesting level. A DeepSpeed feature fzero does not implement is a ``NotImplementedError``
naming the key. A DeepSpeed key that only tunes speed, memory or logging, which fzero does
differently or not at all, is accepted; when its value asks for something (not DeepSpeed's
default) it is listed in ``Config.ignored`` and in one ``UserWarning``. docs/config.md has
the whole table.

DeepSpeed's semantics were read from ``deepspeed/runtime/config.py``,
``runtime/zero/config.py``, ``runtime/precision_config.py``, ``runtime/engine.py``
(``_configure_basic_optimizer``) and ``ops/{adam,lamb,lion}`` of DeepSpeed 0.19.8.

Example:
    >>> from fzero.config import Config      # fzero.Config once fzero/__init__.py exports it
    >>> cfg = Config.load({
    ...     "train_batch_size": 8, "gradient_accumulation_steps": 1,
    ...     "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
    ...     "fp16": {"enabled": True}, "zero_optimization": True})
    >>> cfg.train_micro_batch_size_per_gpu, cfg.zero_optimization.stage
    (8, 1)
    >>> opts = cfg.compile_options()
    >>> opts["precision"], opts["loss_scale"], opts["accumulate"]
    ('fp16', 'dynamic', 1)
    >>> cfg.make_optimizer().fused.kind      # DeepSpeed's "Adam" is AdamW unless adam_w_mode=false
    'adamw'
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import numbers
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

import torch

from fzero import optim
from fzero.optim import GradientTransformation, schedules
from fzero.optim.base import ScalarOrSchedule

__all__ = [
    "BF16Config",
    "Config",
    "ConfigKeyError",
    "FP16Config",
    "OptimizerConfig",
    "SchedulerConfig",
    "ZeroConfig",
]

WHERE = "fzero.Config"


class ConfigKeyError(KeyError, ValueError):
    """A key that is not part of DeepSpeed's config format (a typo, most often).

    The message names the key by its dotted path and the nearest valid key. It is both a
    ``KeyError`` and a ``ValueError``, so either ``except`` catches it.
    """

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0]) if self.args else ""


# --------------------------------------------------------------------------- value checks


def _auto(path: str, value: Any) -> None:
    if value == "auto":
        raise ValueError(f"{WHERE}: {path}='auto' is a placeholder Hugging Face's Trainer fills in; "
                         "DeepSpeed and fzero need a value")


def _int(path: str, value: Any, *, minimum: int | None = None) -> int:
    """An int, or a whole float (JSON writes ``5e8`` as a float); never a bool."""
    _auto(path, value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value).is_integer():
        raise TypeError(f"{WHERE}: {path} must be an integer, got {value!r} ({type(value).__name__})")
    v = int(value)
    if minimum is not None and v < minimum:
        raise ValueError(f"{WHERE}: {path} must be >= {minimum}, got {value!r}")
    return v


def _num(path: str, value: Any, *, minimum: float | None = None, positive: bool = False) -> float:
    _auto(path, value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{WHERE}: {path} must be a number, got {value!r} ({type(value).__name__})")
    v = float(value)
    if not math.isfinite(v) or (minimum is not None and v < minimum) or (positive and v <= 0):
        want = "> 0" if positive else f">= {minimum:g}" if minimum is not None else "finite"
        raise ValueError(f"{WHERE}: {path} must be a finite number {want}, got {value!r}")
    return v


def _bool(path: str, value: Any) -> bool:
    _auto(path, value)
    if not isinstance(value, bool):
        raise TypeError(f"{WHERE}: {path} must be true or false, got {value!r} ({type(value).__name__})")
    return value


def _section(path: str, value: Any) -> Mapping[str, Any]:
    _auto(path, value)
    if not isinstance(value, Mapping):
        raise TypeError(f"{WHERE}: {path} must be a JSON object, got {value!r} ({type(value).__name__})")
    return value


class _FrozenDict(dict):
    """A read-only dict: a section's ``params`` as written (picklable, unlike a mappingproxy)."""

    def _readonly(self, *args, **kwargs):
        raise TypeError(f"{WHERE}: a config section's params are read-only; use dataclasses.replace")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _readonly
    __ior__ = _readonly

    def __reduce__(self):
        return (_FrozenDict, (dict(self),))


def _frozen(d: Mapping[str, Any]) -> Mapping[str, Any]:
    return _FrozenDict(d)


# --------------------------------------------------------------------------- key rules


def _always(value: Any) -> bool:
    return True


def _never(value: Any) -> bool:
    return False


def _truthy(value: Any) -> bool:
    return bool(value)


def _enabled(value: Any) -> bool:
    """A DeepSpeed feature block is on when it is ``true`` or has ``"enabled": true``."""
    if isinstance(value, Mapping):
        return bool(value.get("enabled", False))
    return bool(value)


def _present(value: Any) -> bool:
    return value is not None and value != {} and value is not False


def _differs(default: Any) -> Callable[[Any], bool]:
    return lambda value: value != default


class _Rule(NamedTuple):
    """How fzero treats one DeepSpeed key.

    ``use``: read into a field. ``noop``: accepted, no effect in fzero; listed in
    ``Config.ignored`` when ``active(value)``. ``reject``: ``NotImplementedError`` when
    ``active(value)`` (the inactive form, e.g. ``"enabled": false``, is accepted).
    ``invalid``: a ``ValueError`` (DeepSpeed refuses it too).
    """

    kind: Literal["use", "noop", "reject", "invalid"]
    why: str = ""
    active: Callable[[Any], bool] = _always


_USE = _Rule("use")


def _noop(why: str, active: Callable[[Any], bool] = _truthy) -> _Rule:
    return _Rule("noop", why, active)


def _reject(why: str, active: Callable[[Any], bool] = _always) -> _Rule:
    return _Rule("reject", why, active)


def _check_keys(prefix: str, given: Mapping[str, Any], rules: Mapping[str, _Rule], noted: list[str]) -> None:
    """Classify every key of ``given``: unknown, unimplemented, ignored or used."""
    for key, value in given.items():
        path = f"{prefix}{key}"
        rule = rules.get(key) if isinstance(key, str) else None
        if rule is None:
            close = difflib.get_close_matches(str(key), list(rules), n=1, cutoff=0.6)
            hint = f"; did you mean {prefix + close[0]!r}?" if close else ""
            where = prefix.rstrip(".") or "the top level"
            valid = ", ".join(rules) if len(rules) <= 16 else "see docs/config.md"
            raise ConfigKeyError(
                f"{WHERE}: unknown key {path!r}{hint} (not a DeepSpeed config key; valid keys at "
                f"{where}: {valid})")
        if rule.kind == "invalid":
            raise ValueError(f"{WHERE}: {path}: {rule.why}")
        if rule.kind == "reject" and rule.active(value):
            raise NotImplementedError(
                f"{WHERE}: {path}={value!r}: a DeepSpeed option fzero does not implement: {rule.why}")
        if rule.kind == "noop" and rule.active(value):
            noted.append(f"{path} ({rule.why})")


# Keys DeepSpeed knows at the top level. Speed, memory and logging knobs are ``noop``;
# features that change what is trained, or that a user would count on, are ``reject``.
_PERF = "only changes DeepSpeed's speed or memory use, not the result"
_TOP: dict[str, _Rule] = {
    "train_batch_size": _USE,
    "train_micro_batch_size_per_gpu": _USE,
    "gradient_accumulation_steps": _USE,
    "optimizer": _USE,
    "scheduler": _USE,
    "fp16": _USE,
    "bf16": _USE,
    "bfloat16": _USE,  # DeepSpeed's older name of "bf16"
    "zero_optimization": _USE,
    "gradient_clipping": _USE,
    "communication_data_type": _USE,
    "steps_per_print": _noop("fzero prints nothing; log the metrics each step returns",
                             lambda v: v is not None),
    "wall_clock_breakdown": _noop("fzero has no step timers; time the step yourself"),
    "memory_breakdown": _noop("fzero has no memory logging; see `fzero estimate`"),
    "dump_state": _noop("fzero does not print its state"),
    "log_level": _noop("DeepSpeed's logger level", _never),
    "disable_python_gc": _noop(_PERF),
    "tensorboard": _noop("fzero writes no monitor logs; log the returned metrics", _enabled),
    "wandb": _noop("fzero writes no monitor logs; log the returned metrics", _enabled),
    "csv_monitor": _noop("fzero writes no monitor logs; log the returned metrics", _enabled),
    "comet": _noop("fzero writes no monitor logs; log the returned metrics", _enabled),
    "flops_profiler": _noop("fzero has no FLOPs profiler", _enabled),
    "comms_logger": _noop("fzero does not log collectives", _enabled),
    "timers": _noop("DeepSpeed's throughput timers", _never),
    "autotuning": _noop("autotuning is a DeepSpeed launcher feature", _enabled),
    "vocabulary_size": _noop("DeepSpeed only checks it for tensor-core alignment", _never),
    "zero_allow_untested_optimizer": _noop("fzero's ZeRO runs any fzero.optim optimizer", _never),
    "zero_force_ds_cpu_optimizer": _noop("applies to offload, which fzero does not do", _never),
    "allgather_size": _noop("the all-gather bucket of the legacy `\"zero_optimization\": true`; "
                            + _PERF, _differs(5e8)),
    "fp32_allreduce": _noop("fzero always reduces fp32 gradients", _never),
    "prescale_gradients": _noop("dividing by the world size before or after the all-reduce "
                                "gives the same mean up to rounding"),
    "gradient_predivide_factor": _noop("splitting the division by the world size around the "
                                       "all-reduce gives the same mean up to rounding", _differs(1.0)),
    "disable_allgather": _noop(_PERF),
    "sparse_gradients": _noop("fzero's gradients are dense; the result is the same"),
    "dataloader_drop_last": _noop("fzero builds no data loader"),
    "checkpoint": _noop("fzero.checkpoint always verifies checksums and loads onto any world size",
                        _present),
    "datastates_ckpt": _noop("fzero.checkpoint has its own asynchronous save", _present),
    "activation_checkpointing": _noop("configures deepspeed.checkpointing, which a model calls "
                                      "itself; use fzero.remat", lambda v: isinstance(v, Mapping)
                                      and any(x is True for x in v.values())),
    "aio": _noop("asynchronous I/O for NVMe offload, which fzero does not do", _never),
    "graph_harvesting": _noop(_PERF),
    "compile": _noop("DeepSpeed's torch.compile of the module; fzero does not compile the model",
                     _enabled),
    "seq_parallel_communication_data_type": _noop("fzero has no sequence parallelism", _never),
    "gradient_allreduce_op": _reject("only 'mean' (DeepSpeed's default) is supported",
                                     lambda v: str(v).lower() != "mean"),
    "managed_gradient_accumulation": _reject("fzero always applies one update per step call",
                                             lambda v: v is not True),
    "amp": _reject("NVIDIA Apex AMP; use \"fp16\" or \"bf16\"", _enabled),
    "torch_autocast": _reject("use \"bf16\" or \"fp16\" (fzero computes under torch.autocast)",
                              _enabled),
    "elasticity": _reject("elastic batch sizes", _enabled),
    "data_efficiency": _reject("curriculum learning and data sampling", _enabled),
    "curriculum_learning": _reject("curriculum learning", _enabled),
    "progressive_layer_drop": _reject("progressive layer drop", _enabled),
    "eigenvalue": _reject("eigenvalue computation", _enabled),
    "quantize_training": _reject("quantized training (MoQ)", _enabled),
    "compression_training": _reject("the compression library", _present),
    "sparse_attention": _reject("sparse attention kernels", _present),
    "weight_quantization": _reject("weight quantization", _present),
    "pipeline": _reject("DeepSpeed's pipeline engine; use fzero.pipeline", _present),
    "hybrid_engine": _reject("the RLHF hybrid engine", _enabled),
    "nebula": _reject("Nebula checkpointing; use fzero.checkpoint", _enabled),
    "tensor_parallel": _reject("automatic tensor parallelism",
                               lambda v: isinstance(v, Mapping) and (v.get("autotp_size") or 0) > 1),
    "expert_parallel": _reject("expert parallelism", _present),
    "use_data_before_expert_parallelism": _reject("expert parallelism"),
    "data_types": _reject("only fp32 gradient accumulation (fzero's) is supported",
                          lambda v: not isinstance(v, Mapping) or any(
                              k != "grad_accum_dtype" or val not in (None, "fp32", "float32")
                              for k, val in v.items())),
}

_FP16: dict[str, _Rule] = {
    "enabled": _USE,
    "loss_scale": _USE,
    "initial_scale_power": _USE,
    "loss_scale_window": _USE,
    "hysteresis": _USE,
    "consecutive_hysteresis": _USE,
    "min_loss_scale": _USE,
    "auto_cast": _noop("fzero computes under torch.autocast, which casts each op's inputs; "
                       "the batch itself is not cast"),
    "fp16_master_weights_and_grads": _reject("fzero keeps fp32 master weights and gradients",
                                             _truthy),
}

_BF16: dict[str, _Rule] = {
    "enabled": _USE,
    "immediate_grad_update": _noop(_PERF, _never),
    "check_grad_overflow": _USE,
    "bf16_master_weights_and_grads": _reject("fzero keeps fp32 master weights and gradients",
                                             _truthy),
    "bf16_optimizer_states": _reject("fzero keeps fp32 optimizer state", _truthy),
}


def _offloaded(value: Any) -> bool:
    if value is None:
        return False
    if isinstance(value, Mapping):
        return str(value.get("device", "none")).lower() != "none"
    return True


def _zero_perf(default: Any) -> _Rule:
    return _noop(_PERF, _differs(default))


_ZERO: dict[str, _Rule] = {
    "stage": _USE,
    "reduce_bucket_size": _USE,
    "overlap_comm": _USE,
    "contiguous_gradients": _zero_perf(True),
    "reduce_scatter": _zero_perf(True),
    "use_multi_rank_bucket_allreduce": _zero_perf(True),
    "allgather_partitions": _zero_perf(True),
    "allgather_bucket_size": _noop("fzero gathers parameters in buckets of `bucket_size` bytes, "
                                   "set by reduce_bucket_size", _differs(5e8)),
    "compute_grad_norm": _zero_perf(True),
    "load_from_fp32_weights": _noop("fzero.checkpoint always stores fp32 master weights", _never),
    "elastic_checkpoint": _noop("fzero.checkpoint always loads onto any world size", _never),
    "sub_group_size": _zero_perf(1e9),
    "ignore_unused_parameters": _noop("fzero's gradients are a full pytree; unused parameters "
                                      "get zero gradients", _never),
    "legacy_stage1": _zero_perf(False),
    "round_robin_gradients": _zero_perf(False),
    "parameter_alignment": _zero_perf(False),
    "memory_efficient_linear": _zero_perf(True),
    "pipeline_loading_checkpoint": _zero_perf(False),
    "override_module_apply": _zero_perf(True),
    "log_trace_cache_warnings": _zero_perf(False),
    "enable_sanity_checks": _zero_perf(False),
    "save_muon_momentum_buffer_in_memory": _zero_perf(False),
    "leaf_module": _zero_perf({}),
    "cpu_offload_use_pin_memory": _noop(_PERF, _never),
    "offload_optimizer": _reject("fzero keeps optimizer state on the device", _offloaded),
    "offload_param": _reject("fzero keeps parameters on the device", _offloaded),
    "cpu_offload": _reject("fzero keeps optimizer state on the device", _truthy),
    "cpu_offload_param": _reject("fzero keeps parameters on the device", _truthy),
    "zenflow": _reject("ZenFlow offload", _present),
    "zero_hpz_partition_size": _reject("ZeRO++ hierarchical partitioning",
                                       lambda v: v not in (0, 1)),
    "zero_quantized_weights": _reject("ZeRO++ quantized weights", _truthy),
    "zero_quantized_nontrainable_weights": _reject("ZeRO++ quantized weights", _truthy),
    "zero_quantized_gradients": _reject("ZeRO++ quantized gradients", _truthy),
    "zeropp_loco_param": _reject("LoCo-ZeRO++", _present),
    "mics_shard_size": _reject("MiCS sharding", lambda v: v not in (-1, 0, None)),
    "mics_hierarchical_params_gather": _reject("MiCS sharding", _truthy),
}
# Stage-3 knobs, under both their field names and their "stage3_" aliases.
for _name, _default in [("prefetch_bucket_size", 5e7), ("param_persistence_threshold", 1e5),
                        ("model_persistence_threshold", 2**63 - 1), ("max_live_parameters", 1e9),
                        ("max_reuse_distance", 1e9),
                        ("module_granularity_threshold", 0), ("use_all_reduce_for_fetch_params", False),
                        ("allgather_sequential", False)]:
    _ZERO[_name] = _ZERO["stage3_" + _name] = _zero_perf(_default)
for _name in ("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
              "stage3_gather_fp16_weights_on_model_save"):
    _ZERO[_name] = _noop("configures DeepSpeed's save_16bit_model; use fzero.checkpoint.export")

_MAX_GRAD_NORM = _Rule("invalid", "max_grad_norm is not an optimizer parameter (DeepSpeed refuses "
                       "it too); use the top-level \"gradient_clipping\"")
_NO_EFFECT = _noop("an implementation detail of the optimizer", _never)

# DeepSpeed's parameter names of each optimizer it builds, with the optimizer's defaults
# (FusedAdam / torch.optim.Adam(W), FusedLamb, FusedLion, torch.optim.SGD).
_OPTIMIZERS: dict[str, tuple[dict[str, _Rule], dict[str, Any]]] = {
    "adam": ({"lr": _USE, "betas": _USE, "eps": _USE, "weight_decay": _USE, "adam_w_mode": _USE,
              "torch_adam": _USE,
              "bias_correction": _reject("Adam without bias correction", lambda v: v is not True),
              "amsgrad": _reject("AMSGrad", _truthy), "set_grad_none": _NO_EFFECT,
              "max_grad_norm": _MAX_GRAD_NORM},
             {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
              "adam_w_mode": True, "torch_adam": False}),
    "lamb": ({"lr": _USE, "betas": _USE, "eps": _USE, "weight_decay": _USE, "bias_correction": _USE,
              "eps_inside_sqrt": _USE, "max_coeff": _USE, "min_coeff": _USE,
              "amsgrad": _reject("AMSGrad", _truthy), "max_grad_norm": _MAX_GRAD_NORM},
             {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
              "bias_correction": True, "eps_inside_sqrt": False, "max_coeff": 10.0, "min_coeff": 0.01}),
    "lion": ({"lr": _USE, "betas": _USE, "weight_decay": _USE, "set_grad_none": _NO_EFFECT,
              "max_grad_norm": _MAX_GRAD_NORM},
             {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0}),
    "sgd": ({"lr": _USE, "momentum": _USE, "weight_decay": _USE, "nesterov": _USE,
             "dampening": _reject("SGD dampening", lambda v: v != 0),
             "maximize": _reject("maximize", _truthy), "foreach": _NO_EFFECT,
             "differentiable": _NO_EFFECT, "fused": _NO_EFFECT, "max_grad_norm": _MAX_GRAD_NORM},
            {"lr": 1e-3, "momentum": 0.0, "weight_decay": 0.0, "nesterov": False}),
}
_OPTIMIZERS["adamw"] = _OPTIMIZERS["adam"]
_CANONICAL = {"adam": "Adam", "adamw": "AdamW", "lamb": "Lamb", "lion": "Lion", "sgd": "SGD"}
# Optimizers DeepSpeed builds by name that fzero does not have (any torch.optim name too).
_DS_ONLY_OPTIMIZERS = ("adagrad", "onebitadam", "zerooneadam", "onebitlamb", "muadam", "muadamw",
                       "musgd", "muon")

# DeepSpeed's scheduler parameter names (deepspeed/runtime/lr_schedules.py); values are
# checked by fzero.optim.schedules, which takes the same names.
_SCHEDULERS: dict[str, tuple[str, ...]] = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                 "last_batch_iteration"),
    "WarmupDecayLR": ("total_num_steps", "warmup_min_lr", "warmup_max_lr", "warmup_num_steps",
                      "warmup_type", "last_batch_iteration"),
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio",
                       "warmup_type", "last_batch_iteration"),
    "OneCycle": ("cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_first_step_size",
                 "cycle_second_step_size", "cycle_first_stair_count", "cycle_second_stair_count",
                 "decay_step_size", "cycle_momentum", "cycle_min_mom", "cycle_max_mom",
                 "decay_mom_rate", "last_batch_iteration"),
    "LRRangeTest": ("lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
                    "lr_range_test_staircase", "last_batch_iteration"),
}
_NEEDS_BASE_LR = ("WarmupLR", "WarmupCosineLR")  # they read the optimizer's learning rate

# DeepSpeed clips at 1.0 when "gradient_clipping" is not written (GRADIENT_CLIPPING_DEFAULT,
# 1.0 since deepspeedai/DeepSpeed#8068 in the 0.19 series; 0, no clipping, before). fzero
# follows the release its DeepSpeed semantics are checked against (0.19.8).
GRADIENT_CLIPPING_DEFAULT = 1.0

# communication_data_type -> (compile's reduce_dtype, bytes per reduced element)
_COMM_DTYPES = {"fp32": (None, 4), "fp16": ("fp16", 2), "bfp16": ("bf16", 2), "bf16": ("bf16", 2)}


# --------------------------------------------------------------------------- sections


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The ``optimizer`` section: which optimizer, with DeepSpeed's parameter names.

    How DeepSpeed's names map onto :mod:`fzero.optim` (``_configure_basic_optimizer``):
    ``Adam``/``AdamW`` with ``adam_w_mode`` (default true) are :func:`fzero.optim.adamw`
    (decoupled decay, as FusedAdam's AdamW mode); ``Adam`` with ``adam_w_mode: false`` is
    :func:`fzero.optim.adam` (L2 decay); ``Lion`` is :func:`fzero.optim.lion`; ``SGD`` is
    :func:`fzero.optim.sgd`; ``Lamb`` is DeepSpeed's FusedLamb itself,
    :func:`fzero.optim.deepspeed_lamb` (see :meth:`build`). Defaults are DeepSpeed's optimizers' own (weight decay 0, Lion's
    ``betas`` (0.9, 0.999), Lamb's ``eps`` 1e-8), not fzero's.
    """

    type: str
    """DeepSpeed's optimizer name: ``Adam``, ``AdamW``, ``Lamb``, ``Lion`` (any case, as
    DeepSpeed lower-cases its own names) or ``SGD`` (exact: DeepSpeed looks it up in
    ``torch.optim``). Stored in the canonical spelling."""

    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The ``params`` object as written, DeepSpeed's names (``lr``, ``betas``, ``eps``,
    ``weight_decay``, ...); missing names take the DeepSpeed optimizer's defaults."""

    def __post_init__(self) -> None:
        if not isinstance(self.type, str):
            raise TypeError(f"{WHERE}: optimizer.type must be a string, got {self.type!r}")
        kind = self.type.lower()
        if kind == "sgd" and self.type != "SGD":
            raise ValueError(f"{WHERE}: unknown optimizer.type {self.type!r}; did you mean 'SGD'? "
                             "(DeepSpeed looks it up as torch.optim.SGD, case-sensitively)")
        if kind not in _OPTIMIZERS:
            if kind in _DS_ONLY_OPTIMIZERS or hasattr(torch.optim, self.type):
                raise NotImplementedError(
                    f"{WHERE}: optimizer.type={self.type!r}: a DeepSpeed optimizer fzero does not "
                    f"implement; fzero implements {', '.join(_CANONICAL.values())}")
            names = list(_CANONICAL.values()) + [n.capitalize() for n in _DS_ONLY_OPTIMIZERS]
            close = difflib.get_close_matches(self.type, names, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{WHERE}: unknown optimizer.type {self.type!r}{hint} (fzero "
                             f"implements {', '.join(_CANONICAL.values())})")
        object.__setattr__(self, "type", _CANONICAL[kind])
        params = _section("optimizer.params", self.params)
        _check_keys("optimizer.params.", params, _OPTIMIZERS[kind][0], [])
        object.__setattr__(self, "params", _frozen(params))
        self.build(self.hyperparameters()["lr"])  # checks every value once, here

    @property
    def kind(self) -> str:
        """The fzero optimizer built: ``"adamw"``, ``"adam"``, ``"lamb"``, ``"lion"`` or ``"sgd"``."""
        if self.type in ("Adam", "AdamW"):
            h = self.hyperparameters()
            return "adamw" if self.type == "AdamW" or h["adam_w_mode"] else "adam"
        return self.type.lower()

    def hyperparameters(self) -> dict[str, Any]:
        """Every parameter of this optimizer by DeepSpeed's name, defaults filled in."""
        p = "optimizer.params."
        kind = self.type.lower()
        h = {**_OPTIMIZERS[kind][1], **self.params}
        out: dict[str, Any] = {"lr": _num(p + "lr", h["lr"], minimum=0.0)}
        if "betas" in h:
            b = h["betas"]
            if not (isinstance(b, (list, tuple)) and len(b) == 2):
                raise TypeError(f"{WHERE}: {p}betas must be a list of two numbers [beta1, beta2], got {b!r}")
            out["betas"] = (_num(p + "betas[0]", b[0]), _num(p + "betas[1]", b[1]))
        for name in ("eps", "weight_decay", "momentum", "max_coeff", "min_coeff"):
            if name in h:
                out[name] = _num(p + name, h[name], minimum=0.0)
        for name in ("adam_w_mode", "torch_adam", "nesterov", "bias_correction", "eps_inside_sqrt"):
            if name in h:
                out[name] = _bool(p + name, h[name])
        if kind in ("adam", "adamw") and out["torch_adam"] and "weight_decay" not in self.params and (
                kind == "adamw" or out["adam_w_mode"]):
            out["weight_decay"] = 1e-2  # torch.optim.AdamW's default, which DeepSpeed then builds
        if kind == "lamb" and out["min_coeff"] > out["max_coeff"]:
            raise ValueError(f"{WHERE}: {p}min_coeff={out['min_coeff']} is greater than "
                             f"max_coeff={out['max_coeff']}")
        return out

    def build(self, learning_rate: ScalarOrSchedule) -> GradientTransformation:
        """The fzero optimizer, with ``learning_rate`` (a float or a schedule) as its rate.

        ``Lamb`` is DeepSpeed's FusedLamb, which is not optax's LAMB (``fzero.optim.lamb``):
        its direction ``u = m / (sqrt(v) + eps) + weight_decay * p`` uses the moments
        *without* bias correction, its trust ratio ``||p|| / ||u||`` is clamped to
        ``[min_coeff, max_coeff]`` (1 where a norm is 0), and the bias corrections multiply
        the step: ``p -= lr * sqrt(1 - b2^t) / (1 - b1^t) * ratio * u``. fzero builds
        exactly that, :func:`fzero.optim.deepspeed_lamb` (per-tensor norms, exact under
        ZeRO), without a fused-kernel record.

        Raises:
            TypeError, ValueError: a hyperparameter out of range (from :mod:`fzero.optim`),
                prefixed with the config path.
        """
        h = self.hyperparameters()
        kind = self.kind
        b1, b2 = h.get("betas", (0.9, 0.999))
        try:
            if kind == "adamw":
                return optim.adamw(learning_rate, b1, b2, h["eps"], h["weight_decay"])
            if kind == "adam":
                return optim.adam(learning_rate, b1, b2, h["eps"], h["weight_decay"])
            if kind == "lion":
                return optim.lion(learning_rate, b1, b2, h["weight_decay"])
            if kind == "sgd":
                return optim.sgd(learning_rate, h["momentum"] or None, h["nesterov"], h["weight_decay"])
            return optim.deepspeed_lamb(learning_rate, b1, b2, h["eps"], h["weight_decay"],
                                        bias_correction=h["bias_correction"],
                                        eps_inside_sqrt=h["eps_inside_sqrt"],
                                        max_coeff=h["max_coeff"], min_coeff=h["min_coeff"])
        except (TypeError, ValueError) as e:
            raise type(e)(f"{WHERE}: optimizer {self.type!r}: {e}") from e


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """The ``scheduler`` section: one of DeepSpeed's five learning-rate schedules.

    Built by :mod:`fzero.optim.schedules`, which takes DeepSpeed's parameter names and gives
    the learning rate DeepSpeed applies at each update (``WarmupLR``'s missing
    ``warmup_max_lr`` and ``WarmupCosineLR``'s base are the optimizer's ``lr``).
    """

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest"]
    """DeepSpeed's schedule name, exactly (DeepSpeed looks it up by attribute name)."""

    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The ``params`` object as written, DeepSpeed's parameter names."""

    def __post_init__(self) -> None:
        if self.type not in _SCHEDULERS:
            import torch.optim.lr_scheduler as torch_schedulers

            if isinstance(self.type, str) and self.type[:1].isupper() and hasattr(torch_schedulers, self.type):
                raise NotImplementedError(
                    f"{WHERE}: scheduler.type={self.type!r}: DeepSpeed builds "
                    f"torch.optim.lr_scheduler.{self.type}, which fzero does not implement; fzero "
                    f"implements {', '.join(_SCHEDULERS)}")
            close = difflib.get_close_matches(str(self.type), list(_SCHEDULERS), n=1, cutoff=0.6)
            close = close or [n for n in _SCHEDULERS if n.lower() == str(self.type).lower()]
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{WHERE}: unknown scheduler.type {self.type!r}{hint} (DeepSpeed's "
                             f"schedules: {', '.join(_SCHEDULERS)})")
        params = _section("scheduler.params", self.params)
        _check_keys("scheduler.params.", params, dict.fromkeys(_SCHEDULERS[self.type], _USE), [])
        object.__setattr__(self, "params", _frozen(params))
        self.build(1.0)  # checks every value once, here (and warns, e.g. OneCycle's momentum)

    def build(self, base_lr: float | None) -> schedules.Schedule:
        """The schedule ``fn(count) -> lr``; ``base_lr`` is the optimizer's learning rate.

        Raises:
            ValueError: ``WarmupCosineLR`` without a ``base_lr``.
            TypeError, ValueError: a parameter value out of range (from
                :mod:`fzero.optim.schedules`), prefixed with the config path.
        """
        fn = getattr(schedules, self.type)
        try:
            if self.type == "WarmupCosineLR":
                if base_lr is None:
                    raise ValueError("WarmupCosineLR scales the optimizer's lr; the config has no "
                                     "optimizer section, so pass base_lr=")
                return fn(base_lr, **self.params)
            if self.type == "WarmupLR":
                return fn(base_lr, **self.params)
            return fn(**self.params)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{WHERE}: scheduler {self.type!r}: {e}") from e


@dataclasses.dataclass(frozen=True, kw_only=True)
class FP16Config:
    """The ``fp16`` section: fp16 compute with fp32 master weights and a loss scaler."""

    enabled: bool = False
    """Compute in fp16 (``fzero.compile(precision="fp16")``)."""

    loss_scale: float = 0.0
    """A fixed loss scale, or 0 for DeepSpeed's dynamic loss scaler."""

    initial_scale_power: int = 16
    """The dynamic scaler starts at ``2**initial_scale_power``."""

    loss_scale_window: int = 1000
    """Updates without overflow before the dynamic scale doubles."""

    hysteresis: int = 2
    """Overflows tolerated before the dynamic scale halves (DeepSpeed's delayed shift)."""

    consecutive_hysteresis: bool = False
    """Refill the hysteresis after every update without overflow."""

    min_loss_scale: float = 1.0
    """The dynamic scale never drops below this."""

    def __post_init__(self) -> None:
        p = "fp16."
        for name, value in (
            ("enabled", _bool(p + "enabled", self.enabled)),
            ("loss_scale", _num(p + "loss_scale", self.loss_scale, minimum=0.0)),
            ("initial_scale_power", _int(p + "initial_scale_power", self.initial_scale_power, minimum=0)),
            ("loss_scale_window", _int(p + "loss_scale_window", self.loss_scale_window, minimum=1)),
            ("hysteresis", _int(p + "hysteresis", self.hysteresis, minimum=1)),
            ("consecutive_hysteresis", _bool(p + "consecutive_hysteresis", self.consecutive_hysteresis)),
            ("min_loss_scale", _num(p + "min_loss_scale", self.min_loss_scale, positive=True)),
        ):
            object.__setattr__(self, name, value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BF16Config:
    """The ``bf16`` section (DeepSpeed's older name ``bfloat16`` is read too)."""

    enabled: bool = False
    """Compute in bf16 (``fzero.compile(precision="bf16")``), fp32 master weights, no scaler."""

    check_grad_overflow: bool = True
    """Skip an update whose gradients are not finite (``fzero.compile(check_grad_overflow=)``);
    DeepSpeed 0.19's ``DeepSpeedBF16Config`` default, true."""

    def __post_init__(self) -> None:
        _bool("bf16.enabled", self.enabled)
        object.__setattr__(self, "check_grad_overflow",
                           _bool("bf16.check_grad_overflow", self.check_grad_overflow))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """The ``zero_optimization`` section. ``true`` means stage 1 and ``false`` stage 0, as
    DeepSpeed reads that legacy boolean form (``read_zero_config_deprecated``)."""

    stage: int = 0
    """ZeRO stage 0-3 over the mesh's ``dp`` axis (``fzero.compile(zero=...)``)."""

    reduce_bucket_size: int | None = None
    """Gradient elements reduced per bucket, DeepSpeed's unit (fzero's ``bucket_size`` is in
    bytes: elements times 4, or 2 with a 16-bit ``communication_data_type``). ``None``, when
    not written, keeps fzero's default bucket of 25 MiB rather than DeepSpeed's 5e8 elements."""

    overlap_comm: bool | None = None
    """Overlap gradient reduction with backward; ``None`` when not written (fzero overlaps)."""

    def __post_init__(self) -> None:
        p = "zero_optimization."
        if _int(p + "stage", self.stage) not in (0, 1, 2, 3):
            raise ValueError(f"{WHERE}: {p}stage must be 0, 1, 2 or 3, got {self.stage!r}")
        object.__setattr__(self, "stage", int(self.stage))
        if self.reduce_bucket_size is not None:
            object.__setattr__(self, "reduce_bucket_size",
                               _int(p + "reduce_bucket_size", self.reduce_bucket_size, minimum=1))
        if self.overlap_comm is not None:
            _bool(p + "overlap_comm", self.overlap_comm)


# --------------------------------------------------------------------------- Config


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
        >>> opts["zero"], opts["precision"], opts["accumulate"], opts["clip_norm"], opts["bucket_size"]
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

    ignored: tuple[str, ...] = ()
    """DeepSpeed keys that were accepted but have no effect in fzero, each with the reason
    (only those whose value differs from DeepSpeed's default)."""

    source: str | None = dataclasses.field(default=None, compare=False)
    """The file the config was read from, for error messages; ``None`` for a dict."""

    _given: tuple = dataclasses.field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        w = _int("world_size", self.world_size, minimum=1)
        triple = [None if v is None else _int(name, v, minimum=1) for name, v in (
            ("train_batch_size", self.train_batch_size),
            ("train_micro_batch_size_per_gpu", self.train_micro_batch_size_per_gpu),
            ("gradient_accumulation_steps", self.gradient_accumulation_steps))]
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
        object.__setattr__(self, "gradient_clipping",
                           _num("gradient_clipping", self.gradient_clipping, minimum=0.0))
        if self.communication_data_type is not None and self.communication_data_type not in _COMM_DTYPES:
            raise ValueError(f"{WHERE}: communication_data_type must be one of "
                             f"{', '.join(map(repr, _COMM_DTYPES))}, got {self.communication_data_type!r}")
        object.__setattr__(self, "ignored", tuple(self.ignored))

    # ------------------------------------------------------------------ reading

    @classmethod
    def load(cls, src: Any, *, world_size: int | None = None) -> "Config":
        """Read a DeepSpeed config.

        Args:
            src: a dict, a path (``str`` or ``os.PathLike``) to a JSON file, JSON text (a
                ``str`` starting with ``{``), or a :class:`Config` (returned as is, or
                re-resolved for another ``world_size``).
            world_size: the data-parallel world size to resolve the batch sizes for
                (``fzero.compile`` passes its mesh's ``dp`` size). Default: the
                ``torch.distributed`` world size when it is initialised, else 1.

        Returns:
            A :class:`Config`. Keys accepted without effect are in ``.ignored`` and are
            reported in one ``UserWarning``.

        Raises:
            ConfigKeyError: a key DeepSpeed does not know, named with its dotted path and
                the nearest valid key.
            NotImplementedError: a DeepSpeed feature fzero does not implement, named.
            ValueError: inconsistent batch sizes (all three and the world size are shown),
                invalid JSON (the file, line and column are shown), a value out of range.
            TypeError: a value of the wrong type.
            FileNotFoundError: ``src`` names no file.
        """
        if isinstance(src, Config):
            if world_size is None or world_size == src.world_size:
                return src
            train, micro, gas = src._given
            return dataclasses.replace(src, world_size=world_size, train_batch_size=train,
                                       train_micro_batch_size_per_gpu=micro,
                                       gradient_accumulation_steps=gas)
        source = None
        if isinstance(src, str) and src.lstrip().startswith("{"):
            src, source = _parse_json(src, "<JSON text>"), "<JSON text>"
        elif isinstance(src, (str, os.PathLike)):
            source = os.fspath(src)
            try:
                with open(source, encoding="utf-8") as f:
                    text = f.read()
            except FileNotFoundError:
                raise FileNotFoundError(f"{WHERE}.load: no such config file: {source}") from None
            src = _parse_json(text, source)
        elif not isinstance(src, Mapping):
            raise TypeError(f"{WHERE}.load: expected a dict, a path to a JSON file or a Config, "
                            f"got {type(src).__name__}")
        cfg = _from_dict(src, world_size if world_size is not None else _default_world_size(), source)
        if cfg.ignored:
            warnings.warn(f"{WHERE}: these DeepSpeed keys have no effect in fzero: "
                          + "; ".join(cfg.ignored), UserWarning, stacklevel=2)
        return cfg

    # ------------------------------------------------------------------ derived values

    @property
    def precision(self) -> Literal["fp32", "bf16", "fp16"]:
        """``"fp16"``, ``"bf16"`` or ``"fp32"``, from the ``fp16`` and ``bf16`` sections."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    @property
    def local_batch_size(self) -> int:
        """Samples each data-parallel rank passes to one step call: micro-batch * steps."""
        return self.train_micro_batch_size_per_gpu * self.gradient_accumulation_steps

    def compile_options(self) -> dict[str, Any]:
        """The keyword options of ``fzero.compile`` this config asks for.

        Returns:
            A dict with ``zero`` (stage), ``precision``, ``loss_scale`` (``"dynamic"`` or a
            float; it matters under fp16 only), ``loss_scale_options`` (the fp16 dynamic
            scaler's ``initial_scale_power``, ``loss_scale_window``, ``hysteresis``,
            ``consecutive_hysteresis``, ``min_loss_scale``, as ``fzero.mixed_precision``
            takes them), ``check_grad_overflow`` (``bf16.check_grad_overflow`` under bf16;
            true otherwise, as DeepSpeed always checks under fp16), ``accumulate``
            (gradient_accumulation_steps), ``clip_norm`` (gradient_clipping, ``None`` for 0)
            and ``bucket_size`` (reduce_bucket_size in bytes, ``None`` when not written);
            plus ``overlap_comm`` when the config writes it and ``reduce_dtype`` when
            ``communication_data_type`` is a 16-bit type.
        """
        comm_dtype, itemsize = _COMM_DTYPES[self.communication_data_type or "fp32"]
        zero = self.zero_optimization
        fp16 = self.fp16
        opts: dict[str, Any] = {
            "zero": zero.stage,
            "precision": self.precision,
            "loss_scale": float(fp16.loss_scale) if fp16.enabled and fp16.loss_scale > 0 else "dynamic",
            "loss_scale_options": {
                "initial_scale_power": int(fp16.initial_scale_power),
                "loss_scale_window": int(fp16.loss_scale_window),
                "hysteresis": int(fp16.hysteresis),
                "consecutive_hysteresis": bool(fp16.consecutive_hysteresis),
                "min_loss_scale": float(fp16.min_loss_scale),
            },
            # DeepSpeed reads bf16.check_grad_overflow only under bf16 and always checks
            # under fp16 (DeepSpeedEngine._configure_zero_optimizer).
            "check_grad_overflow": self.bf16.check_grad_overflow if self.bf16.enabled else True,
            "accumulate": self.gradient_accumulation_steps,
            "clip_norm": self.gradient_clipping or None,
            "bucket_size": None if zero.reduce_bucket_size is None else zero.reduce_bucket_size * itemsize,
        }
        if zero.overlap_comm is not None:
            opts["overlap_comm"] = zero.overlap_comm
        if comm_dtype is not None:
            opts["reduce_dtype"] = comm_dtype
        return opts

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
        if base_lr is None and self.optimizer is not None:
            base_lr = self.optimizer.hyperparameters()["lr"]
        with warnings.catch_warnings():  # warned once already, when the section was read
            warnings.simplefilter("ignore", UserWarning)
            return self.scheduler.build(base_lr)

    def make_optimizer(self) -> GradientTransformation:
        """The ``optimizer`` section as an :mod:`fzero.optim` transformation, with the
        ``scheduler`` section (if any) as its learning rate: use it as ``tx=`` of
        ``fzero.TrainState.create``.

        Gradient clipping is not part of it: ``fzero.compile`` adds ``clip_norm`` in front.

        Raises:
            ValueError: the config has no ``optimizer`` section.

        Example:
            >>> cfg = Config.load({"train_batch_size": 4,
            ...                    "optimizer": {"type": "Lion", "params": {"lr": 1e-4}}})
            >>> spec = cfg.make_optimizer().fused
            >>> spec.kind, spec.learning_rate, spec.b2, spec.weight_decay
            ('lion', 0.0001, 0.999, 0.0)
        """
        if self.optimizer is None:
            raise ValueError(f"{WHERE}.make_optimizer: the config has no optimizer section")
        lr = self.make_schedule() if self.scheduler is not None else self.optimizer.hyperparameters()["lr"]
        return self.optimizer.build(lr)

    def install(self, state: Any) -> Any:
        """``state`` with this config's optimizer as ``tx`` and a fresh ``opt_state``, as
        ``deepspeed.initialize`` builds them; ``state`` unchanged without an optimizer
        section. ``fzero.compile(config=...)`` calls this in ``step.init``.

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
        tx = self.make_optimizer()
        return state.replace(tx=tx, opt_state=tx.init(state.params))


# --------------------------------------------------------------------------- parsing


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _parse_json(text: str, source: str) -> Mapping[str, Any]:
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as e:
        raise ValueError(f"{WHERE}.load: {source}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    except ValueError as e:  # a duplicate key, which DeepSpeed refuses too
        raise ValueError(f"{WHERE}.load: {source}: {e}") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"{WHERE}.load: {source}: the config must be a JSON object, got "
                         f"{type(data).__name__}")
    return data


def _fields(prefix: str, d: Mapping[str, Any], rules: Mapping[str, _Rule], noted: list[str]) -> dict:
    """The ``use`` keys of a section, after classifying all of its keys."""
    _check_keys(prefix, d, rules, noted)
    return {k: v for k, v in d.items() if rules[k].kind == "use"}


def _from_dict(d: Mapping[str, Any], world_size: int, source: str | None) -> Config:
    try:
        return _build(d, world_size, source)
    except (ConfigKeyError, NotImplementedError, ValueError, TypeError) as e:
        if source is None:
            raise
        msg = str(e)
        if msg.startswith(WHERE + ": "):
            msg = f"{WHERE}: {source}: " + msg[len(WHERE) + 2:]
        raise type(e)(msg) from e


def _build(d: Mapping[str, Any], world_size: int, source: str | None) -> Config:
    noted: list[str] = []
    top = _fields("", d, _TOP, noted)
    if "bf16" in top and "bfloat16" in top:
        raise ValueError(f"{WHERE}: both 'bf16' and its older name 'bfloat16' are given; keep 'bf16'")
    kw: dict[str, Any] = {k: top[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                               "gradient_accumulation_steps") if top.get(k) is not None}

    if top.get("optimizer") is not None:
        sec = _fields("optimizer.", _section("optimizer", top["optimizer"]),
                      {"type": _USE, "params": _USE,
                       "legacy_fusion": _noop("an fp16 fused-Adam detail of DeepSpeed")}, noted)
        if "type" not in sec:
            raise ValueError(f"{WHERE}: optimizer.type is required (one of "
                             f"{', '.join(_CANONICAL.values())})")
        kw["optimizer"] = OptimizerConfig(type=sec["type"], params=sec.get("params") or {})
    if top.get("scheduler") is not None:
        sec = _fields("scheduler.", _section("scheduler", top["scheduler"]),
                      {"type": _USE, "params": _USE}, noted)
        if "type" not in sec:
            raise ValueError(f"{WHERE}: scheduler.type is required (one of {', '.join(_SCHEDULERS)})")
        kw["scheduler"] = SchedulerConfig(type=sec["type"], params=sec.get("params") or {})

    if "fp16" in top:
        kw["fp16"] = FP16Config(**_fields("fp16.", _section("fp16", top["fp16"]), _FP16, noted))
    bf16_key = "bf16" if "bf16" in top else "bfloat16" if "bfloat16" in top else None
    if bf16_key is not None:
        kw["bf16"] = BF16Config(**_fields(f"{bf16_key}.", _section(bf16_key, top[bf16_key]), _BF16, noted))

    zero = top.get("zero_optimization")
    if isinstance(zero, bool):  # DeepSpeed's legacy form: true is stage 1
        kw["zero_optimization"] = ZeroConfig(stage=1 if zero else 0)
    elif zero is not None:
        kw["zero_optimization"] = ZeroConfig(**_fields("zero_optimization.",
                                                       _section("zero_optimization", zero), _ZERO, noted))
    if top.get("gradient_clipping") is not None:
        kw["gradient_clipping"] = top["gradient_clipping"]
    comm = top.get("communication_data_type")
    if comm is not None:
        if not isinstance(comm, str) or comm.lower() not in _COMM_DTYPES:
            raise ValueError(f"{WHERE}: communication_data_type must be one of "
                             f"{', '.join(map(repr, _COMM_DTYPES))}, got {comm!r}")
        kw["communication_data_type"] = comm.lower()
    return Config(world_size=world_size, ignored=tuple(noted), source=source, **kw)
