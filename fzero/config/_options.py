"""DeepSpeed's keys -> the fields of :class:`fzero.CompileOptions`: the one table.

One row per field a config can decide: the DeepSpeed keys it is read from, its value
for a :class:`~fzero.config.Config` (:data:`ABSENT` when the config does not decide it,
and a keyword of ``fzero.compile`` may then set it), what ``fzero config check`` says the
keys do, and, for a key Hugging Face may write as ``"auto"``, that key's value from the
field's keyword (so a keyword that fills an ``"auto"`` agrees with the config by
construction). ``Config.decided_options``, the ``"auto"`` filling (:mod:`._auto`), the
verdicts of ``fzero config check`` (:mod:`._load`) and the table of docs/config.md all
read this one; ``tests/test_config.py`` holds the docs to it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

__all__ = ["ABSENT", "COMM_DTYPES", "OPTIONS", "Row", "decided", "fills", "says"]

ABSENT: Any = type("Absent", (), {"__repr__": lambda self: "<not decided by the config>"})()

# communication_data_type -> (CompileOptions.reduce_in, bytes per reduced element)
COMM_DTYPES = {"fp32": (None, 4), "fp16": ("fp16", 2), "bfp16": ("bf16", 2), "bf16": ("bf16", 2)}


class Row(NamedTuple):
    """A :class:`fzero.CompileOptions` field and the DeepSpeed keys that decide it."""

    field: str
    keys: tuple[str, ...]
    value: Callable[[Any], Any]  # Config -> the field's value, or ABSENT
    says: str | None = None  # what the keys do, for `fzero config check` (else: the field's name)
    fills: Mapping[str, Callable[[Any], Any]] = {}  # an "auto" key -> its value from the field's keyword


def _written(value: Any) -> Any:
    return ABSENT if value is None else value


def _bucket_bytes(cfg: Any) -> Any:
    # DeepSpeed counts elements of the reduced dtype; fzero's bucket is in bytes.
    elements = cfg.zero_optimization.reduce_bucket_size
    return ABSENT if elements is None else elements * COMM_DTYPES[cfg.communication_data_type or "fp32"][1]


def _pin_memory(cfg: Any) -> Any:
    zero = cfg.zero_optimization
    return ABSENT if zero.offload_optimizer is None and zero.offload_param is None else zero.pin_memory


def _same(value: Any) -> Any:
    return value


_FP16 = "fp16 compute and loss scaling"

OPTIONS: tuple[Row, ...] = (
    Row("zero", ("zero_optimization.stage",), lambda c: c.zero_optimization.stage, "the ZeRO stage",
        {"zero_optimization.stage": _same}),
    Row("precision", ("fp16.enabled", "bf16.enabled"), lambda c: c.precision, "the compute dtype",
        {"fp16.enabled": lambda v: v == "fp16", "bf16.enabled": lambda v: v == "bf16"}),
    Row("loss_scale", ("fp16.loss_scale",),
        lambda c: float(c.fp16.loss_scale) if c.fp16.enabled and c.fp16.loss_scale > 0 else "dynamic", _FP16),
    Row("initial_scale_power", ("fp16.initial_scale_power",), lambda c: int(c.fp16.initial_scale_power), _FP16),
    Row("loss_scale_window", ("fp16.loss_scale_window",), lambda c: int(c.fp16.loss_scale_window), _FP16),
    Row("hysteresis", ("fp16.hysteresis",), lambda c: int(c.fp16.hysteresis), _FP16),
    Row("consecutive_hysteresis", ("fp16.consecutive_hysteresis",), lambda c: bool(c.fp16.consecutive_hysteresis),
        _FP16),
    Row("min_loss_scale", ("fp16.min_loss_scale",), lambda c: float(c.fp16.min_loss_scale), _FP16),
    # DeepSpeed reads bf16.check_grad_overflow only under bf16 and always checks under fp16
    # (DeepSpeedEngine._configure_zero_optimizer).
    Row("check_grad_overflow", ("bf16.check_grad_overflow",),
        lambda c: c.bf16.check_grad_overflow if c.bf16.enabled else True, "skip non-finite updates"),
    Row("master_weights", ("bf16.bf16_master_weights_and_grads",),
        lambda c: _written("bf16" if c.bf16.enabled and c.bf16.bf16_master_weights_and_grads else None),
        "bf16 master weights and gradients"),
    Row("optimizer_states", ("bf16.bf16_optimizer_states",),
        lambda c: _written("bf16" if c.bf16.enabled and c.bf16.bf16_optimizer_states else None),
        "bf16 optimizer state"),
    Row("torch_autocast", ("torch_autocast.enabled", "torch_autocast.dtype"),
        lambda c: _written(c.torch_autocast and c.torch_autocast["dtype"]), "the forward under torch.autocast"),
    Row("lower_precision_safe_modules", ("torch_autocast.lower_precision_safe_modules",),
        lambda c: _written(c.torch_autocast and c.torch_autocast["lower_precision_safe_modules"]),
        "gradients reduced in the autocast dtype"),
    Row("accumulate", ("gradient_accumulation_steps",), lambda c: c.gradient_accumulation_steps, None,
        {"gradient_accumulation_steps": _same}),
    Row("clip_norm", ("gradient_clipping",), lambda c: c.gradient_clipping or None, None,
        {"gradient_clipping": lambda v: v or 0.0}),
    Row("bucket_bytes", ("zero_optimization.reduce_bucket_size",), _bucket_bytes),
    Row("overlap_comm", ("zero_optimization.overlap_comm",), lambda c: _written(c.zero_optimization.overlap_comm),
        "reduce during backward, or after it"),
    Row("max_reuse_distance", ("zero_optimization.stage3_max_reuse_distance",
                               "zero_optimization.max_reuse_distance"),
        lambda c: _written(c.zero_optimization.max_reuse_distance), "ZeRO-3 units kept gathered from forward to backward"),
    Row("reduce_in", ("communication_data_type",),
        lambda c: _written(COMM_DTYPES[c.communication_data_type or "fp32"][0])),
    Row("offload_optimizer", ("zero_optimization.offload_optimizer.device",),
        lambda c: _written(c.zero_optimization.offload_optimizer)),
    Row("offload_param", ("zero_optimization.offload_param.device",),
        lambda c: _written(c.zero_optimization.offload_param)),
    Row("pin_memory", ("zero_optimization.offload_optimizer.pin_memory", "zero_optimization.offload_param.pin_memory"),
        _pin_memory),
    Row("tp", ("tensor_parallel.autotp_size",), lambda c: "auto" if c.autotp_size > 1 else ABSENT,
        "tp=\"auto\" over the mesh's tp axis"),
    Row("comm_bytes", ("comms_logger.enabled",), lambda c: _written(c.comms_logger), "metrics[\"comm_bytes\"]"),
    Row("check_replicas", ("fzero.check_replicas",), lambda c: _written(c.check_replicas),
        "compare the replicas' fingerprints every N updates"),
    Row("jit", ("compile.enabled", "compile.backend", "compile.kwargs"), lambda c: _written(c.compile),
        "torch.compile of the model's forward"),
    Row("timers", ("wall_clock_breakdown",), lambda c: _written(c.wall_clock_breakdown), "metrics[\"time\"]"),
    Row("memory", ("memory_breakdown",), lambda c: _written(c.memory_breakdown), "metrics[\"memory\"]"),
    Row("flops", ("flops_profiler.enabled",), lambda c: _written(c.flops_profiler),
        "metrics[\"flops\"], \"mfu\""),
    Row("trial", ("autotuning.enabled", "autotuning.metric_path", "autotuning.start_profile_step",
                  "autotuning.end_profile_step", "autotuning.model_info.profile", "autotuning.model_info_path"),
        lambda c: _written(c.trial), "an autotuning trial: the step measures itself and ends the run"),
)


def decided(cfg: Any) -> dict[str, Any]:
    """The fields ``cfg`` decides, by field name (:meth:`fzero.Config.decided_options`)."""
    out = {}
    for row in OPTIONS:
        value = row.value(cfg)
        if value is not ABSENT:
            out[row.field] = value
    return out


def keys_of(field: str) -> tuple[str, ...]:
    """The DeepSpeed keys that decide ``field`` (empty for a field no key decides)."""
    return next((row.keys for row in OPTIONS if row.field == field), ())


def fills() -> dict[str, tuple[str, Callable[[Any], Any]]]:
    """``{"auto" key: (field, its value from the field's keyword)}``."""
    return {key: (row.field, fn) for row in OPTIONS for key, fn in row.fills.items()}


def says() -> dict[str, str]:
    """``{key: what it does}`` for ``fzero config check``: the field it decides, by name."""
    return {key: row.field if row.says is None else f"{row.says} ({row.field})" for row in OPTIONS for key in row.keys}
