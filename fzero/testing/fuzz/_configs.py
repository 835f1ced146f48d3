"""DeepSpeed configs: what each key takes, values it does not take, any change at any
key, contradictions, valid configs; and the checks each case is held to.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from hypothesis import strategies as st

from fzero.testing.fuzz._batches import linear
from fzero.testing.fuzz._outcome import Outcome, describe, mentions_any, outcome, section_paths


# What each key fzero reads takes, as DeepSpeed documents it (fzero's stricter reading of
# booleans: JSON true/false only). None (JSON null) means "not written" and is not drawn.
KEY_DOMAINS: dict[str, Any] = {
    **dict.fromkeys(("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                     "fp16.loss_scale_window", "fp16.hysteresis", "zero_optimization.reduce_bucket_size",
                     "tensor_parallel.autotp_size", "fzero.check_replicas", "pipeline.stages"), "int>=1"),
    "fp16.initial_scale_power": "int>=0",
    **dict.fromkeys(("fp16.loss_scale", "gradient_clipping", "optimizer.params.lr", "optimizer.params.eps",
                     "optimizer.params.weight_decay"), "num>=0"),
    "fp16.min_loss_scale": "num>0",
    **dict.fromkeys(("fp16.enabled", "fp16.consecutive_hysteresis", "bf16.enabled", "bf16.check_grad_overflow",
                     "zero_optimization.overlap_comm", "wall_clock_breakdown", "memory_breakdown",
                     "flops_profiler.enabled", "comms_logger.enabled", "dataloader_drop_last",
                     "zero_allow_untested_optimizer", "compile.enabled", "torch_autocast.enabled",
                     "tensorboard.enabled", "csv_monitor.enabled", "wandb.enabled",
                     "zero_optimization.offload_optimizer.pin_memory", "zero_optimization.offload_param.pin_memory",
                     "optimizer.params.adam_w_mode", "optimizer.params.bias_correction",
                     "optimizer.params.torch_adam"), "bool"),
    "zero_optimization.stage": ("enum", (0, 1, 2, 3)),
    "communication_data_type": ("enum", ("fp32", "fp16", "bf16", "bfp16")),
    "zero_optimization.offload_optimizer.device": ("enum", ("none", "cpu", "nvme")),
    "zero_optimization.offload_param.device": ("enum", ("none", "cpu", "nvme")),
    "torch_autocast.dtype": ("enum", ("bfloat16", "bf16", "torch.bfloat16", "float16", "fp16", "half")),
    "optimizer.params.betas": "pair",
    # Keys with no effect in fzero still take only their DeepSpeed type.
    **dict.fromkeys(("steps_per_print", "flops_profiler.profile_step", "pipeline.activation_checkpoint_interval",
                     "zero_optimization.offload_optimizer.buffer_count", "vocabulary_size"), "int"),
    **dict.fromkeys(("zero_optimization.sub_group_size", "zero_optimization.stage3_prefetch_bucket_size",
                     "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.allgather_bucket_size",
                     "gradient_predivide_factor", "zero_optimization.stage3_max_live_parameters"), "number"),
    **dict.fromkeys(("zero_optimization.contiguous_gradients", "zero_optimization.round_robin_gradients",
                     "prescale_gradients", "sparse_gradients", "bf16.immediate_grad_update", "fp16.auto_cast",
                     "zero_optimization.stage3_gather_16bit_weights_on_model_save", "comms_logger.verbose",
                     "compile.deepcompile", "pipeline.pipe_partitioned", "zero_optimization.elastic_checkpoint",
                     "zero_optimization.ignore_unused_parameters", "zero_force_ds_cpu_optimizer"), "bool"),
    **dict.fromkeys(("compile.backend", "tensorboard.output_path", "tensorboard.job_name", "csv_monitor.output_path",
                     "csv_monitor.job_name", "wandb.project", "wandb.group", "wandb.team"), "str"),
    **dict.fromkeys(("fp16", "bf16", "optimizer", "scheduler", "optimizer.params", "scheduler.params",
                     "zero_optimization.offload_optimizer", "zero_optimization.offload_param", "comms_logger",
                     "compile", "torch_autocast", "pipeline", "tensor_parallel", "flops_profiler", "tensorboard",
                     "csv_monitor", "wandb", "fzero", "compile.kwargs"), "object"),
}

# Values no key of a domain takes (DeepSpeed's Hugging Face placeholder "auto" is never drawn).
_WRONG = {
    "int": [1.5, "2", True, [], {}, math.nan, math.inf],
    "number": ["1", True, [], {}, math.nan, math.inf],
    "int>=1": [0, -1, -2**63, 1.5, "2", True, False, [], {}, math.nan, math.inf],
    "int>=0": [-1, 0.5, "3", True, [], {}, math.nan, -math.inf],
    "num>=0": [-1, -1e-9, "0.1", True, [], {}, math.nan, math.inf, -math.inf],
    "num>0": [0, 0.0, -1, "1", True, [], math.nan, math.inf],
    "bool": [0, 1, 1.0, "true", "false", "yes", [], {}, [True]],
    "pair": [0.9, [0.9], [0.9, 0.99, 0.999], ["0.9", 0.99], [0.9, None], {}, "0.9,0.99", [math.nan, 0.9]],
    "str": [0, 1.5, True, [], {}, ["a"]],
    "object": [0, 1.5, "x", [], ["enabled"]],
}
_ENUM_WRONG = [-1, 4, 1.5, "", "x", "CPU2", "float8", True, [], {}]


def _wrong_values(domain: Any) -> list:
    if isinstance(domain, tuple):  # ("enum", allowed): anything not allowed, cased or not
        allowed = {str(a).lower() for a in domain[1]}
        return [v for v in _ENUM_WRONG if not (isinstance(v, (str, int)) and not isinstance(v, bool)
                                              and str(v).lower() in allowed)]
    return _WRONG[domain]


# A config every case starts from: valid, small, one process.
BASE_CONFIG: dict[str, Any] = {"train_micro_batch_size_per_gpu": 2,
                               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def set_path(d: dict, path: str, value: Any) -> dict:
    """``d`` with ``value`` at the dotted ``path`` (sections made on the way, or replaced
    when they are not objects)."""
    parts = path.split(".")
    cur = d
    for p in parts[:-1]:
        if not isinstance(cur.get(p), dict):
            cur[p] = {}
        cur = cur[p]
    cur[parts[-1]] = copy.deepcopy(value)
    return d


@st.composite
def bad_values(draw) -> tuple[str, Any]:
    """``(dotted path, a value that key does not take)``."""
    path = draw(st.sampled_from(sorted(KEY_DOMAINS)))
    return path, draw(st.sampled_from(_wrong_values(KEY_DOMAINS[path])))


def _known_paths() -> list[str]:
    """Every dotted key path fzero's tables know, sections and their keys (read only to
    choose where to put a value; the verdict on the value comes from :data:`KEY_DOMAINS`)."""
    from fzero.config import _keys as k

    sections = {"": k._TOP, "fp16.": k._FP16, "bf16.": k._BF16, "zero_optimization.": k._ZERO,
                "zero_optimization.offload_optimizer.": k._OFFLOAD_OPTIMIZER,
                "zero_optimization.offload_param.": k._OFFLOAD_PARAM, "comms_logger.": k._COMMS_LOGGER,
                "compile.": k._COMPILE, "fzero.": k._FZERO, "torch_autocast.": k._TORCH_AUTOCAST,
                "pipeline.": k._PIPELINE, "flops_profiler.": k._FLOPS_PROFILER,
                **{f"{name}.": rules for name, rules in k._MONITORS.items()}}
    paths = {prefix + key for prefix, rules in sections.items() for key in rules}
    paths |= {"optimizer.params." + key for rules, _ in k._OPTIMIZERS.values() for key in rules}
    paths |= {"scheduler.params." + key for names in k._SCHEDULERS.values() for key in names}
    paths |= {"optimizer.type", "scheduler.type", "tensor_parallel.autotp_size", "autotuning.enabled",
              "autotuning.metric_path", "bfloat16.enabled"}
    return sorted(paths | set(KEY_DOMAINS))


_ANY_VALUE = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([2**63, -2**63, 10**30, 0.5, -0.5, 1e308]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "auto", "cpu", "nvme", "none", "AdamW", "Adam", "SGD", "Lamb", "WarmupLR", "OneCycle",
                     "fp16", "bf16", "x" * 100, "mean", "linear", "torch.nn.Linear", "inductor"]),
    st.lists(st.integers(-2, 2), max_size=3), st.just({}),
    st.dictionaries(st.sampled_from(["enabled", "stage", "lr", "type", "params", "zz"]), st.integers(-1, 3),
                    max_size=2),
    st.text(max_size=5))
_UNKNOWN_KEYS = ["train_batch", "fp16.enable", "zero_optimization.stagee", "optimizer.params.learning_rate",
                 "optimiser", "bf16.enabledd", "zero_optimization.offload_optimizer.devices", "zz.yy", "fp16.zz"]


@st.composite
def config_mutations(draw, *, max_changes: int = 4) -> tuple[dict, list[tuple[str, Any]]]:
    """``(config, changes)``: :data:`BASE_CONFIG` with 1 to ``max_changes`` keys (known or
    unknown, at any depth) set to any value."""
    d = copy.deepcopy(BASE_CONFIG)
    changes = []
    paths = _known_paths() + _UNKNOWN_KEYS
    for _ in range(draw(st.integers(1, max_changes))):
        path = draw(st.sampled_from(paths))
        value = draw(_ANY_VALUE)
        set_path(d, path, value)
        changes.append((path, value))
    return d, changes


@st.composite
def config_texts(draw) -> str:
    """A config's JSON text (a valid config's, :func:`valid_configs`) cut short, with
    characters put in or taken out, a key written twice, or nested thousands deep."""
    import json

    text = json.dumps(draw(valid_configs()))
    how = draw(st.sampled_from(["cut", "insert", "delete", "duplicate", "nest", "nan"]))
    at = draw(st.integers(1, len(text) - 1))
    if how == "cut":
        return text[:at]
    if how == "insert":
        bad = draw(st.sampled_from(["{", "}", "[", "]", ",", ":", '"', "\\", "\x00", "NaN", "1e999"]))
        return text[:at] + bad + text[at:]
    if how == "delete":
        return text[:at] + text[at + 1:]
    if how == "duplicate":
        return text[:-1] + ', "gradient_clipping": 1.0, "gradient_clipping": 0.5}'
    if how == "nest":
        depth = draw(st.sampled_from([100, 10_000, 200_000]))
        return text[:-1] + ', "fzero": ' + '{"a": ' * depth + "1" + "}" * depth + "}"
    return text[:-1] + ', "gradient_clipping": NaN}'


# Configs that contradict themselves, each with the keys its error must name.
CONTRADICTIONS: list[tuple[str, dict, tuple[str, ...]]] = [
    ("train_batch_size is not micro x accumulation x world",
     {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2},
     ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")),
    ("a batch that the world size does not divide", {"train_batch_size": 3}, ("train_batch_size",)),
    ("fp16 and bf16 both enabled", {"fp16": {"enabled": True}, "bf16": {"enabled": True}}, ("fp16", "bf16")),
    ("bf16 and its older name bfloat16", {"bf16": {"enabled": True}, "bfloat16": {"enabled": True}},
     ("bf16", "bfloat16")),
    ("optimizer offload without a ZeRO stage", {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
     ("offload_optimizer.device", "stage")),
    ("parameter offload below stage 3",
     {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, ("offload_param.device", "stage 3")),
    ("bf16 master weights at stage 0", {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
     ("bf16_master_weights_and_grads", "stage")),
    ("bf16 optimizer states without bf16 master weights",
     {"bf16": {"enabled": True, "bf16_optimizer_states": True}},
     ("bf16_optimizer_states", "bf16_master_weights_and_grads")),
    ("torch_autocast with fp16 weights", {"torch_autocast": {"enabled": True}, "fp16": {"enabled": True}},
     ("torch_autocast", "fp16")),
    ("Lamb's min_coeff above its max_coeff",
     {"optimizer": {"type": "Lamb", "params": {"min_coeff": 2.0, "max_coeff": 1.0}}}, ("min_coeff", "max_coeff")),
    ("torch_adam without bias correction",
     {"optimizer": {"type": "Adam", "params": {"torch_adam": True, "bias_correction": False}}},
     ("bias_correction", "torch_adam")),
    ("a torch optimizer outside DeepSpeed's tested list under ZeRO",
     {"optimizer": {"type": "RMSprop", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}},
     ("optimizer.type", "zero_allow_untested_optimizer")),
    ("an optimizer section without a type", {"optimizer": {"params": {"lr": 1e-3}}}, ("optimizer.type",)),
    ("a scheduler section without a type", {"scheduler": {"params": {}}}, ("scheduler.type",)),
    ("NVMe offload", {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     ("offload_param.device",)),
    ("ZeRO stage 3 with ZeRO++ quantized weights",
     {"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}, ("zero_quantized_weights",)),
    ("max_grad_norm as an optimizer parameter",
     {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "max_grad_norm": 1.0}}},
     ("optimizer.params.max_grad_norm", "gradient_clipping")),
]


@st.composite
def valid_configs(draw) -> dict:
    """A config every key of which is valid and consistent, for one process: batch sizes,
    an optimizer (and maybe a schedule), a precision, a ZeRO stage with or without offload,
    clipping, and a few keys that only measure."""
    micro, gas = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    d: dict[str, Any] = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas}
    if draw(st.booleans()):
        d["train_batch_size"] = micro * gas
    opt = draw(st.sampled_from(["Adam", "AdamW", "SGD", "Lion", "Lamb", "Adagrad"]))
    params: dict[str, Any] = {"lr": draw(st.sampled_from([1e-3, 1e-2, 0.1]))}
    if opt in ("Adam", "AdamW", "Lamb") and draw(st.booleans()):
        params["betas"] = [draw(st.sampled_from([0.8, 0.9])), draw(st.sampled_from([0.95, 0.999]))]
    if draw(st.booleans()):
        params["weight_decay"] = draw(st.sampled_from([0.0, 0.01, 0.1]))
    d["optimizer"] = {"type": opt, "params": params}
    if draw(st.booleans()):
        d["scheduler"] = draw(st.sampled_from([
            {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
            {"type": "WarmupDecayLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2}},
            {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2}}]))
    precision = draw(st.sampled_from(["fp32", "bf16", "fp16"]))
    stage = draw(st.sampled_from([0, 1, 2, 3]))
    if precision == "fp16":
        d["fp16"] = {"enabled": True, "initial_scale_power": draw(st.integers(0, 16))}
    elif precision == "bf16":
        d["bf16"] = {"enabled": True}
    zero: dict[str, Any] = {"stage": stage}
    if stage >= 1 and draw(st.booleans()):
        zero["offload_optimizer"] = {"device": "cpu"}
    if stage == 3 and draw(st.booleans()):
        zero["offload_param"] = {"device": "cpu"}
    d["zero_optimization"] = zero
    d["gradient_clipping"] = draw(st.sampled_from([0.0, 0.5, 1.0]))
    for key in ("wall_clock_breakdown", "memory_breakdown"):
        if draw(st.booleans()):
            d[key] = draw(st.booleans())
    if draw(st.booleans()):
        d["steps_per_print"] = 10
    return d


CONFIG_ERRORS = (ValueError, TypeError, NotImplementedError)
# Where a bad value of BAD_BASE's keys goes: a scheduler is there so that scheduler.params
# has a section to sit in.
BAD_BASE: dict[str, Any] = {**BASE_CONFIG, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}}}


def _load_config(d: Any, world_size: int = 1) -> Any:
    import warnings

    from fzero.config import Config

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # keys accepted with no effect warn; not what is checked here
        return Config.load(d, world_size=world_size)


def config_value_case(path: str, value: Any) -> Outcome:
    """A value ``path`` does not take is refused, by an error naming ``path``."""
    d = set_path(copy.deepcopy(BAD_BASE), path, value)
    kind, result = outcome(lambda: _load_config(d), named=CONFIG_ERRORS, prefix="fzero.Config")
    assert kind != "ran", f"{path}={value!r} was accepted"
    assert kind == "named", f"{path}={value!r}: {describe(result)}"
    assert path in str(result) or path.rsplit(".", 1)[-1] in str(result), f"{path}={value!r}: {result}"
    return kind


def config_change_case(d: dict, changes: list[tuple[str, Any]], world_size: int) -> Outcome:
    """A config with any changes loads, or fails naming a changed key (or the batch sizes)."""
    kind, result = outcome(lambda: _load_config(d, world_size), named=CONFIG_ERRORS, prefix="fzero.Config")
    assert kind in ("ran", "named"), f"{changes}: {describe(result)}"
    if kind == "named":
        named = section_paths(changes) + ["train_batch_size", "train_micro_batch_size_per_gpu", "optimizer"]
        assert mentions_any(str(result), named), f"{changes}: the error names none of them: {result}"
    return kind


def config_text_case(text: str) -> Outcome:
    """A config's JSON text, however damaged, gives a config or a ``ValueError``/``TypeError``
    that says where (``fzero.Config``, the line and column, the key)."""
    kind, result = outcome(lambda: _load_config(text), named=CONFIG_ERRORS, prefix="fzero.Config")
    assert kind in ("ran", "named"), f"{text[:80]!r}...: {describe(result)}"
    return kind


def contradiction_case(config: dict, keys: tuple[str, ...]) -> Outcome:
    """A config that contradicts itself is refused at world size 2, naming every key of ``keys``."""
    d = {"train_micro_batch_size_per_gpu": 2, **config}
    kind, result = outcome(lambda: _load_config(d, 2), named=CONFIG_ERRORS, prefix="fzero.Config")
    assert kind == "named", f"{config}: {'accepted' if kind == 'ran' else describe(result)}"
    missing = [k for k in keys if k not in str(result)]
    assert not missing, f"{config}: the error does not name {missing}: {result}"
    return kind


def valid_config_case(d: dict, seed: int) -> Outcome:
    """A valid config loads, ``fzero.compile`` builds its step, and one step on one process
    gives plain PyTorch's loss (the micro-batches' mean ``mse_loss`` of the same module)
    and counts the update (unless fp16's scaler skipped it)."""
    import torch.nn.functional as F

    import fzero
    from fzero import optim
    from fzero.testing.steps import mse_step

    cfg = _load_config(d)
    module = linear()
    apply, params = fzero.functionalize(copy.deepcopy(module))
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.0))  # the config's replaces it
    step = fzero.compile(mse_step, fzero.Mesh(dp=-1), config=cfg)
    state = step.init(state)
    g = torch.Generator().manual_seed(seed)
    micro, rows = cfg.train_micro_batch_size_per_gpu, cfg.local_batch_size
    batch = {"x": torch.randn(rows, 4, generator=g), "y": torch.randn(rows, 2, generator=g)}
    state, metrics = step(state, batch)
    with torch.no_grad():
        expected = torch.stack([F.mse_loss(module(batch["x"][i:i + micro]), batch["y"][i:i + micro])
                                for i in range(0, rows, micro)]).mean()
    tol = {"fp32": 1e-6, "bf16": 3e-2, "fp16": 3e-3}[cfg.precision]
    assert math.isclose(float(metrics["loss"]), float(expected), rel_tol=tol, abs_tol=tol), (d, metrics)
    assert int(state.step) == (0 if bool(metrics.get("skipped", False)) else 1), (d, metrics)
    return "ran"
