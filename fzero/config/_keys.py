"""Every DeepSpeed key and what fzero does with it: the rules and their tables.

A key is used (read into a section's field), a no-op (accepted; listed in
``Config.ignored`` when its value asks for something), rejected (a DeepSpeed feature fzero
does not implement) or invalid. A key in no table is a typo: :class:`ConfigKeyError`.
The tables were read from DeepSpeed 0.19.8 (``runtime/config.py``, ``runtime/zero/config.py``,
``runtime/precision_config.py``, ``runtime/lr_schedules.py``, ``ops/{adam,lamb,lion}``).
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple

from fzero.config._values import WHERE, _short


class ConfigKeyError(KeyError, ValueError):
    """A key that is not part of DeepSpeed's config format (a typo, most often).

    The message names the key by its dotted path and the nearest valid key. It is both a
    ``KeyError`` and a ``ValueError``, so either ``except`` catches it.
    """

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0]) if self.args else ""


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
    takes: Literal["bool", "int", "number", "str", "list", "object"] | None = None
    """What a ``noop`` key's value must be, as DeepSpeed's config model types it (JSON null
    is "not written"): a key with no effect in fzero still refuses a value of the wrong type."""


_USE = _Rule("use")

_TAKES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "int": ("an integer", lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool)
            and math.isfinite(v) and float(v).is_integer()),
    "number": ("a number", lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "list": ("a list", lambda v: isinstance(v, list)),
    "object": ("a JSON object", lambda v: isinstance(v, Mapping)),
}


def _noop(why: str, active: Callable[[Any], bool] = _truthy, takes: str | None = None) -> _Rule:
    return _Rule("noop", why, active, takes)  # type: ignore[arg-type]


def _reject(why: str, active: Callable[[Any], bool] = _always) -> _Rule:
    return _Rule("reject", why, active)


class ConfigError(ConfigKeyError, NotImplementedError, TypeError):
    """Several problems in one config, all reported at once: each by its dotted path.

    ``problems`` is the list of ``(path, message)``. It is every kind of error a single
    problem would raise (a :class:`ConfigKeyError`, so a ``KeyError`` and a ``ValueError``;
    a ``NotImplementedError``; a ``TypeError``), so any ``except`` that caught one problem
    catches several.
    """

    def __init__(self, message: str, problems: list[tuple[str, str]]):
        super().__init__(message)
        self.problems = list(problems)


class _Notes:
    """What reading a config found, key by key: the ignored keys (for ``Config.ignored``),
    the problems (one error at the end) and every key's verdict (``fzero config check``)."""

    def __init__(self) -> None:
        self.ignored: list[str] = []  # "path (why)": accepted, no effect, value not the default
        self.foreign: list[str] = []  # keys DeepSpeed itself does not read
        self.problems: list[tuple[str, BaseException]] = []
        self.verdicts: list[tuple[str, str, str]] = []  # (path, verdict, detail)

    def problem(self, path: str, error: BaseException) -> None:
        self.problems.append((path, error))
        self.verdicts.append((path, "error", _message(error)))

    def raise_if_any(self, source: str | None = None) -> None:
        """One error for everything found: the single problem's own exception, or a
        :class:`ConfigError` listing each by its path."""
        if not self.problems:
            return
        where = f"{WHERE}: {source}: " if source else f"{WHERE}: "
        if len(self.problems) == 1:
            error = self.problems[0][1]
            raise type(error)(where + _message(error)) from error
        lines = [f"  {_message(e)}" for _, e in self.problems]
        raise ConfigError(f"{where}{len(self.problems)} problems, each by its config path:\n"
                          + "\n".join(lines), [(p, _message(e)) for p, e in self.problems])


def _message(error: BaseException) -> str:
    """An error's message without the ``fzero.Config: `` prefix each check writes."""
    text = str(error)
    return text[len(WHERE) + 2:] if text.startswith(WHERE + ": ") else text


# Top-level keys DeepSpeed does not read (it ignores any top-level key it does not know),
# seen in public configs: accepted with one warning. A key in neither table is a typo.
_FOREIGN = {
    "cuda_visible_devices": "a launcher setting some projects keep in the config; DeepSpeed does not read it",
    "comms_config": "not a DeepSpeed key (DeepSpeed's is comms_logger); DeepSpeed does not read it",
    "monitor_config": "not a DeepSpeed key (DeepSpeed's monitors are tensorboard, wandb, csv_monitor); "
                      "DeepSpeed does not read it",
}


def _classify(prefix: str, given: Mapping[str, Any], rules: Mapping[str, _Rule], notes: _Notes) -> dict:
    """Classify every key of ``given`` (unknown, unimplemented, invalid, ignored or used),
    noting each; returns the used keys. Problems are noted, not raised."""
    used = {}
    for key, value in given.items():
        path = f"{prefix}{key}"
        rule = rules.get(key) if isinstance(key, str) else None
        if rule is None and not prefix and isinstance(key, str) and (key.startswith("_") or key in _FOREIGN):
            why = _FOREIGN.get(key, "a comment")
            notes.verdicts.append((path, "not read", why))
            if key in _FOREIGN:
                notes.foreign.append(f"{path} ({why})")
            continue
        if rule is None:
            close = difflib.get_close_matches(str(key), list(rules), n=1, cutoff=0.6)
            hint = f"; did you mean {prefix + close[0]!r}?" if close else ""
            where = prefix.rstrip(".") or "the top level"
            valid = ", ".join(rules) if len(rules) <= 16 else "see docs/config.md"
            notes.problem(path, ConfigKeyError(
                f"{WHERE}: unknown key {path!r}{hint} (not a DeepSpeed config key; valid keys at "
                f"{where}: {valid})"))
        elif rule.kind == "invalid":
            notes.problem(path, ValueError(f"{WHERE}: {path}: {rule.why}"))
        elif rule.kind == "reject" and rule.active(value):
            notes.problem(path, NotImplementedError(
                f"{WHERE}: {path}={_short(value)}: a DeepSpeed option fzero does not implement: {rule.why}"))
        elif rule.kind == "noop" and rule.takes is not None and value is not None and not _TAKES[rule.takes][1](value):
            notes.problem(path, TypeError(f"{WHERE}: {path} must be {_TAKES[rule.takes][0]}, got {_short(value)} "
                                          f"({type(value).__name__})"))
        elif rule.kind == "noop":
            if rule.active(value):
                notes.ignored.append(f"{path} ({rule.why})")
                notes.verdicts.append((path, "no effect", rule.why))
            else:
                notes.verdicts.append((path, "no effect", "DeepSpeed's default or off"))
        elif rule.kind == "reject":
            notes.verdicts.append((path, "off", "accepted: the feature is not turned on"))
        else:
            used[key] = value
    return used


def _check_keys(prefix: str, given: Mapping[str, Any], rules: Mapping[str, _Rule],
                noted: list[str] | None = None) -> None:
    """Classify every key of ``given``; raise one error for all the problems found."""
    notes = _Notes()
    _classify(prefix, given, rules, notes)
    if noted is not None:
        noted.extend(notes.ignored)
    notes.raise_if_any()


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
                             lambda v: v is not None, "int"),
    "wall_clock_breakdown": _USE,  # compile(timers=)
    "memory_breakdown": _USE,  # compile(memory=)
    "dump_state": _noop("fzero does not print its state", takes="bool"),
    "log_level": _noop("DeepSpeed's logger level", _never),
    "disable_python_gc": _noop(_PERF),
    "tensorboard": _USE,  # _MONITORS: fzero.monitor's writers
    "wandb": _USE,
    "csv_monitor": _USE,
    "comet": _noop("fzero writes no monitor logs; log the returned metrics", _enabled),
    "flops_profiler": _USE,  # compile(flops=)
    "comms_logger": _USE,
    "timers": _noop("DeepSpeed's throughput timers", _never),
    # Read by `fzero autotune` (fzero.autotune.AutotuningConfig); the step reads only the
    # trial a tuner's trial config asks of it (Config.trial).
    "autotuning": _USE,
    "vocabulary_size": _noop("DeepSpeed only checks it for tensor-core alignment", _never, "int"),
    # DeepSpeed refuses a client optimizer under ZeRO without it. fzero's ZeRO runs any client
    # `tx=` exactly (each rank's pieces, cross-leaf reductions through psum), so there is no
    # gate to open: read and type-checked (Config.zero_allow_untested_optimizer), never needed.
    "zero_allow_untested_optimizer": _USE,
    "zero_force_ds_cpu_optimizer": _noop("applies to offload, which fzero does not do", _never, "bool"),
    "allgather_size": _noop("the all-gather bucket of the legacy `\"zero_optimization\": true`; "
                            + _PERF, _differs(5e8), "number"),
    "fp32_allreduce": _noop("fzero always reduces fp32 gradients", _never, "bool"),
    "prescale_gradients": _noop("dividing by the world size before or after the all-reduce "
                                "gives the same mean up to rounding", takes="bool"),
    "gradient_predivide_factor": _noop("splitting the division by the world size around the "
                                       "all-reduce gives the same mean up to rounding", _differs(1.0), "number"),
    "disable_allgather": _noop(_PERF, takes="bool"),
    "sparse_gradients": _noop("fzero's gradients are dense; the result is the same", takes="bool"),
    "dataloader_drop_last": _USE,
    "checkpoint": _noop("fzero.checkpoint always verifies checksums and loads onto any world size",
                        _present),
    "datastates_ckpt": _noop("fzero.checkpoint has its own asynchronous save", _present),
    "activation_checkpointing": _noop("configures deepspeed.checkpointing, which a model calls "
                                      "itself; use fzero.remat", lambda v: isinstance(v, Mapping)
                                      and any(x is True for x in v.values())),
    "aio": _noop("asynchronous I/O for NVMe offload, which fzero does not do", _never),
    "graph_harvesting": _noop(_PERF, takes="bool"),
    "compile": _USE,  # compile(jit=)
    "fzero": _USE,  # fzero's own options, not DeepSpeed's (_FZERO)
    "seq_parallel_communication_data_type": _noop("Ulysses' all-to-alls move the activations in their own dtype",
                                                  _never),
    "sequence_parallel_size": _USE,  # DeepSpeed-Ulysses: checked against the mesh's sp axis
    "gradient_allreduce_op": _reject("only 'mean' (DeepSpeed's default) is supported",
                                     lambda v: str(v).lower() != "mean"),
    "managed_gradient_accumulation": _reject("fzero always applies one update per step call",
                                             lambda v: v is not True),
    "amp": _reject("NVIDIA Apex AMP; use \"fp16\" or \"bf16\"", _enabled),
    "torch_autocast": _USE,  # compile(torch_autocast=, lower_precision_safe_modules=)
    "elasticity": _reject("elastic batch sizes", _enabled),
    "data_efficiency": _reject("curriculum learning and data sampling", _enabled),
    "curriculum_learning": _reject("curriculum learning", _enabled),
    "progressive_layer_drop": _reject("progressive layer drop", _enabled),
    "eigenvalue": _reject("eigenvalue computation", _enabled),
    "quantize_training": _reject("quantized training (MoQ)", _enabled),
    "compression_training": _reject("the compression library", _present),
    "sparse_attention": _reject("sparse attention kernels", _present),
    "weight_quantization": _reject("weight quantization", _present),
    "pipeline": _USE,
    "hybrid_engine": _reject("the RLHF hybrid engine", _enabled),
    "nebula": _reject("Nebula checkpointing; use fzero.checkpoint", _enabled),
    "tensor_parallel": _USE,
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
                       "the batch itself is not cast", takes="bool"),
    "fp16_master_weights_and_grads": _reject("fzero keeps fp32 master weights and gradients",
                                             _truthy),
}

_BF16: dict[str, _Rule] = {
    "enabled": _USE,
    "immediate_grad_update": _noop(_PERF, _never, "bool"),
    "check_grad_overflow": _USE,
    "bf16_master_weights_and_grads": _USE,  # compile(master_weights="bf16")
    "bf16_optimizer_states": _USE,  # compile(optimizer_states="bf16")
}


# zero_optimization.offload_optimizer (DeepSpeed's DeepSpeedZeroOffloadOptimizerConfig).
_OFFLOAD_OPTIMIZER: dict[str, _Rule] = {
    "device": _USE,
    "pin_memory": _USE,
    "nvme_path": _noop("NVMe offload only", _never, "str"),
    "buffer_count": _noop("NVMe offload only", _never, "int"),
    "pipeline_read": _noop("NVMe offload only", _never, "bool"),
    "pipeline_write": _noop("NVMe offload only", _never, "bool"),
    "pipeline": _noop("NVMe offload only", _never, "bool"),
    "fast_init": _noop(_PERF, _never, "bool"),
    "ratio": _reject("partial optimizer offload (a ratio below 1)", lambda v: v != 1 and v is not None),
}


# zero_optimization.offload_param (DeepSpeed's DeepSpeedZeroOffloadParamConfig).
_OFFLOAD_PARAM: dict[str, _Rule] = {
    "device": _USE,
    "pin_memory": _USE,
    "nvme_path": _noop("NVMe offload only", _never, "str"),
    "buffer_count": _noop("NVMe offload only", _never, "int"),
    "buffer_size": _noop("NVMe offload only", _never, "number"),
    "max_in_cpu": _noop("NVMe offload only", _never, "number"),
}


def _zero_perf(default: Any) -> _Rule:
    takes = "bool" if isinstance(default, bool) else "object" if isinstance(default, Mapping) else "number"
    return _noop(_PERF, _differs(default), takes)


_ZERO: dict[str, _Rule] = {
    "stage": _USE,
    "reduce_bucket_size": _USE,
    "overlap_comm": _USE,
    "contiguous_gradients": _zero_perf(True),
    "reduce_scatter": _zero_perf(True),
    "use_multi_rank_bucket_allreduce": _zero_perf(True),
    "allgather_partitions": _zero_perf(True),
    "allgather_bucket_size": _noop("fzero gathers parameters in buckets of `bucket_bytes` bytes, "
                                   "set by reduce_bucket_size", _differs(5e8), "number"),
    "compute_grad_norm": _zero_perf(True),
    "load_from_fp32_weights": _noop("fzero.checkpoint always stores fp32 master weights", _never, "bool"),
    "elastic_checkpoint": _noop("fzero.checkpoint always loads onto any world size", _never, "bool"),
    "sub_group_size": _zero_perf(1e9),
    "ignore_unused_parameters": _noop("fzero's gradients are a full pytree; unused parameters "
                                      "get zero gradients", _never, "bool"),
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
    "cpu_offload_use_pin_memory": _noop(_PERF, _never, "bool"),
    "offload_optimizer": _USE,  # its own keys: _OFFLOAD_OPTIMIZER
    "offload_param": _USE,  # its own keys: _OFFLOAD_PARAM
    "cpu_offload": _reject("DeepSpeed's older spelling: write offload_optimizer: {\"device\": \"cpu\"}", _truthy),
    "cpu_offload_param": _reject("DeepSpeed's older spelling: write offload_param: {\"device\": \"cpu\"}",
                                 _truthy),
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
                        ("module_granularity_threshold", 0), ("use_all_reduce_for_fetch_params", False),
                        ("allgather_sequential", False)]:
    _ZERO[_name] = _ZERO["stage3_" + _name] = _zero_perf(_default)
_ZERO["max_reuse_distance"] = _ZERO["stage3_max_reuse_distance"] = _USE  # compile(max_reuse_distance=)
for _name in ("gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
              "stage3_gather_fp16_weights_on_model_save"):
    _ZERO[_name] = _noop("configures DeepSpeed's save_16bit_model; use fzero.checkpoint.export", takes="bool")

_MAX_GRAD_NORM = _Rule("invalid", "max_grad_norm is not an optimizer parameter (DeepSpeed refuses "
                       "it too); use the top-level \"gradient_clipping\"")
_NO_EFFECT = _noop("an implementation detail of the optimizer", _never)

# DeepSpeed's parameter names of each optimizer it builds, with the optimizer's defaults
# (FusedAdam / torch.optim.Adam(W), FusedLamb, FusedLion, torch.optim.SGD, torch.optim.Adagrad,
# runtime/fp16/onebit/{adam,zoadam,lamb}.py).
_ONEBIT_COMMON: dict[str, _Rule] = {
    "lr": _USE, "betas": _USE, "eps": _USE, "weight_decay": _USE,
    "bias_correction": _noop("DeepSpeed's 1-bit optimizers accept it and apply no bias correction either way",
                             _never),
    "eps_inside_sqrt": _noop("DeepSpeed's 1-bit optimizers accept it and do not use it", _never),
    "amsgrad": _reject("AMSGrad", _truthy),
    "cuda_aware": _noop("CUDA-aware MPI only: fzero exchanges over the mesh's dp process group "
                        "(gloo on the CPU, NCCL on GPUs)"),
    "comm_backend_name": _noop("fzero exchanges over the mesh's dp process group (gloo on the CPU, NCCL on "
                               "GPUs), whatever backend is named", lambda v: v != "nccl"),
    "max_grad_norm": _MAX_GRAD_NORM,
}
_ONEBIT_DEFAULTS: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
_OPTIMIZERS: dict[str, tuple[dict[str, _Rule], dict[str, Any]]] = {
    "adam": ({"lr": _USE, "betas": _USE, "eps": _USE, "weight_decay": _USE, "adam_w_mode": _USE,
              "torch_adam": _USE, "bias_correction": _USE,
              "amsgrad": _reject("AMSGrad", _truthy), "set_grad_none": _NO_EFFECT,
              "max_grad_norm": _MAX_GRAD_NORM},
             {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
              "adam_w_mode": True, "torch_adam": False, "bias_correction": True}),
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
    # torch.optim.Adagrad, which DeepSpeed builds (DeepSpeedCPUAdagrad, the same formula, under
    # optimizer offload): torch's defaults, not optax's.
    "adagrad": ({"lr": _USE, "lr_decay": _USE, "weight_decay": _USE, "initial_accumulator_value": _USE,
                 "eps": _USE, "maximize": _reject("maximize", _truthy), "foreach": _NO_EFFECT,
                 "differentiable": _NO_EFFECT, "fused": _NO_EFFECT, "max_grad_norm": _MAX_GRAD_NORM},
                {"lr": 1e-2, "lr_decay": 0.0, "weight_decay": 0.0, "initial_accumulator_value": 0.0,
                 "eps": 1e-10}),
    "onebitadam": ({**_ONEBIT_COMMON, "freeze_step": _USE}, {**_ONEBIT_DEFAULTS, "freeze_step": 100000}),
    "zerooneadam": ({**_ONEBIT_COMMON, "var_freeze_step": _USE, "var_update_scaler": _USE,
                     "local_step_scaler": _USE, "local_step_clipper": _USE},
                    {**_ONEBIT_DEFAULTS, "var_freeze_step": 100000, "var_update_scaler": 16,
                     "local_step_scaler": 32678, "local_step_clipper": 16}),
    "onebitlamb": ({**_ONEBIT_COMMON, "freeze_step": _USE, "max_coeff": _USE, "min_coeff": _USE,
                    "coeff_beta": _USE, "factor_max": _USE, "factor_min": _USE, "factor_threshold": _USE},
                   {**_ONEBIT_DEFAULTS, "freeze_step": 100000, "max_coeff": 10.0, "min_coeff": 0.01,
                    "coeff_beta": 0.9, "factor_max": 4.0, "factor_min": 0.5, "factor_threshold": 0.1}),
}
_OPTIMIZERS["adamw"] = _OPTIMIZERS["adam"]
# DeepSpeed's Muon (runtime/zero/muon, MuonWithAuxAdam): a Muon group and an Adam group, each
# taking the config's parameters it knows; muon_lr / adam_lr override lr for their group. The
# defaults are its groups' own (lr 0.02 and 3e-4 when no lr is given at all).
_OPTIMIZERS["muon"] = ({"lr": _USE, "muon_lr": _USE, "adam_lr": _USE, "momentum": _USE, "weight_decay": _USE,
                        "betas": _USE, "eps": _USE, "ns_method": _USE},
                       {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "betas": (0.9, 0.95), "eps": 1e-10,
                        "ns_method": "gram"})
# The mup package's MuAdam / MuAdamW / MuSGD: torch.optim.Adam / AdamW / SGD with each
# parameter's learning rate (and coupled weight decay) scaled by its width multipliers.
_MU_ADAM_KEYS = {"lr": _USE, "betas": _USE, "eps": _USE, "weight_decay": _USE, "decoupled_wd": _USE,
                 "amsgrad": _reject("AMSGrad", _truthy), "max_grad_norm": _MAX_GRAD_NORM}
_OPTIMIZERS["muadam"] = (_MU_ADAM_KEYS, {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                                         "decoupled_wd": False})
_OPTIMIZERS["muadamw"] = (_MU_ADAM_KEYS, {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2,
                                          "decoupled_wd": False})
_OPTIMIZERS["musgd"] = ({"lr": _USE, "momentum": _USE, "weight_decay": _USE, "nesterov": _USE, "decoupled_wd": _USE,
                         "dampening": _reject("SGD dampening", lambda v: v != 0),
                         "max_grad_norm": _MAX_GRAD_NORM},
                        {"lr": 1e-3, "momentum": 0.0, "weight_decay": 0.0, "nesterov": False, "decoupled_wd": False})
_CANONICAL = {"adam": "Adam", "adamw": "AdamW", "lamb": "Lamb", "lion": "Lion", "sgd": "SGD", "adagrad": "Adagrad",
              "onebitadam": "OneBitAdam", "zerooneadam": "ZeroOneAdam", "onebitlamb": "OneBitLamb", "muon": "Muon",
              "muadam": "MuAdam", "muadamw": "MuAdamW", "musgd": "MuSGD"}
# The 1-bit family: each exchanges its momentum across the dp ranks itself, at ZeRO stage 0 only.
ONEBIT_OPTIMIZERS = ("onebitadam", "zerooneadam", "onebitlamb")
# Optimizers DeepSpeed builds by name that fzero does not have (any torch.optim name too).
_DS_ONLY_OPTIMIZERS = ()

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

# DeepSpeed clips at 1.0 when "gradient_clipping" is not written (GRADIENT_CLIPPING_DEFAULT,
# 1.0 since deepspeedai/DeepSpeed#8068 in the 0.19 series; 0, no clipping, before). fzero
# follows the release its DeepSpeed semantics are checked against (0.19.8).
GRADIENT_CLIPPING_DEFAULT = 1.0

# DeepSpeed's ``comms_logger`` section (deepspeed/comm/config.py, DeepSpeedCommsConfig). Its
# ``enabled`` is ``compile(comm_bytes=)``: each step's metrics carry the bytes this rank sent,
# by collective kind. The rest choose what DeepSpeed prints and times, which fzero does not.
_COMMS_LOGGER: dict[str, _Rule] = {
    "enabled": _USE,
    "verbose": _noop("fzero prints no collective; read metrics[\"comm_bytes\"]", takes="bool"),
    "prof_all": _noop("fzero counts every collective; read metrics[\"comm_bytes\"]", _differs(True), "bool"),
    "prof_ops": _noop("fzero counts every collective; read metrics[\"comm_bytes\"]", _differs([]), "list"),
    "debug": _noop("fzero prints no collective; read metrics[\"comm_bytes\"]", takes="bool"),
}


# DeepSpeed's ``compile`` section (deepspeed/runtime/compiler.py, CompileConfig): ``enabled``,
# ``backend`` and ``kwargs`` are ``compile(jit=)``, torch.compile of the model's forward.
# fzero's own options (not DeepSpeed's): the "fzero" section.
_FZERO: dict[str, _Rule] = {
    "check_replicas": _USE,  # compile(check_replicas=)
}

_COMPILE: dict[str, _Rule] = {
    "enabled": _USE,
    "backend": _USE,
    "kwargs": _USE,
    "deepcompile": _noop("DeepSpeed's own graph passes over ZeRO; fzero compiles the forward and keeps ZeRO eager",
                         _truthy, "bool"),
}


# DeepSpeed's ``torch_autocast`` section (deepspeed/runtime/torch_autocast.py): the forward
# under torch.autocast with fp32 weights; the listed modules' gradients reduced in its dtype.
_TORCH_AUTOCAST: dict[str, _Rule] = {
    "enabled": _USE,
    "dtype": _USE,
    "lower_precision_safe_modules": _USE,
}


# DeepSpeed's ``pipeline`` section (deepspeed.runtime.config's pipeline defaults). The stages
# themselves are the ``fzero.pipeline`` given to ``compile(pipeline=...)``; ``stages`` is
# checked against it, the rest tune how DeepSpeed cuts and moves, not what is computed.
_PIPELINE: dict[str, _Rule] = {
    "stages": _USE,
    "partition": _noop("fzero's stages are the ones fzero.pipeline(...) was given", _differs("best"), "str"),
    "seed_layers": _noop("the layers are built by your code, seeded as you seed it", takes="bool"),
    "activation_checkpoint_interval": _noop("use fzero.remat inside the stage functions", _differs(0), "int"),
    "pipe_partitioned": _noop(_PERF, _differs(True), "bool"),
    "grad_partitioned": _noop(_PERF, _differs(True), "bool"),
}


# DeepSpeed's monitor sections (deepspeed/monitor/config.py: TensorBoardConfig, CSVConfig,
# WandbConfig), each an fzero.monitor writer when enabled (Config.make_monitors).
_MONITORS: dict[str, dict[str, _Rule]] = {
    "tensorboard": {"enabled": _USE, "output_path": _USE, "job_name": _USE},
    "csv_monitor": {"enabled": _USE, "output_path": _USE, "job_name": _USE},
    "wandb": {"enabled": _USE, "group": _USE, "team": _USE, "project": _USE},
}

# DeepSpeed's ``flops_profiler`` section (deepspeed/profiling/config.py). Its ``enabled`` is
# ``compile(flops=)``: each step's metrics carry its FLOPs, FLOP/s, tokens/s and MFU. The rest
# choose when and how DeepSpeed prints its per-module profile, which fzero does not print.
_FLOPS_PROFILER: dict[str, _Rule] = {
    "enabled": _USE,
    "recompute_fwd_factor": _noop("fzero counts the FLOPs a remat recomputes as they run", _differs(0.0),
                                  "number"),
    "profile_step": _noop("fzero counts every distinct batch shape's first step; read metrics[\"flops\"]",
                          _differs(1), "int"),
    "module_depth": _noop("fzero prints no per-module profile", _differs(-1), "int"),
    "top_modules": _noop("fzero prints no per-module profile", _differs(1), "int"),
    "detailed": _noop("fzero prints no per-module profile", _differs(True), "bool"),
    "output_file": _noop("fzero prints no profile; log metrics[\"flops\"]", lambda v: v is not None, "str"),
}
