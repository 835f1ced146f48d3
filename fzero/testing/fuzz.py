"""Hypothesis strategies for bad input, the checks each drawn case is held to, and
:func:`outcome`, which sorts what a call did.

Three kinds of input a user hands fzero are drawn here: DeepSpeed configs (every key fzero
knows, with values outside what the key takes, contradictions, unknown keys, sections of
the wrong shape), batches given to a compiled step (wrong dtypes, ranks, shapes, empty
tensors, NaN and inf, sizes that do not split, trees that change), and mutations of a
checkpoint's ``manifest.json`` (fields removed, wrong types, shapes that do not match the
pieces, offsets past the end, unknown dtypes, paths that leave the directory, huge sizes).

What a key takes (:data:`KEY_DOMAINS`) is written here from DeepSpeed's documentation and
docs/config.md, not read from fzero's own tables, so a value fzero wrongly accepts shows.
Each ``*_case`` function runs one drawn case and returns how it ended (``"ran"``,
``"named"``, ``"user"``), or fails an assertion saying what went wrong: ``tests/test_fuzz.py``
calls them under ``@given``, ``benchmarks/fuzz.py`` counts them (docs/reliability.md).

Example:
    >>> from hypothesis import find
    >>> path, value = find(bad_values(), lambda pv: pv[0] == "fp16.enabled")
    >>> path, value
    ('fp16.enabled', 0)
"""

from __future__ import annotations

import copy
import math
import re
import traceback
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import torch
from hypothesis import strategies as st

__all__ = ["BASE_CONFIG", "CONTRADICTIONS", "KEY_DOMAINS", "LEAF_KINDS", "READS", "Outcome", "SavedCheckpoint",
           "apply_mutations", "bad_values", "batch_case", "batches", "config_change_case", "config_mutations",
           "config_value_case", "contradiction_case", "describe", "make_leaf", "manifest_case", "manifest_mutations",
           "manifest_nodes", "mentions_any", "outcome", "save_checkpoint", "section_paths", "set_path",
           "valid_config_case", "valid_configs", "write_manifest"]

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
                     "zero_optimization.offload_optimizer.buffer_count"), "int"),
    **dict.fromkeys(("zero_optimization.sub_group_size", "zero_optimization.stage3_prefetch_bucket_size",
                     "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.allgather_bucket_size",
                     "gradient_predivide_factor", "zero_optimization.stage3_max_live_parameters"), "number"),
    **dict.fromkeys(("zero_optimization.contiguous_gradients", "zero_optimization.round_robin_gradients",
                     "prescale_gradients", "sparse_gradients", "bf16.immediate_grad_update", "fp16.auto_cast",
                     "zero_optimization.stage3_gather_16bit_weights_on_model_save", "comms_logger.verbose",
                     "compile.deepcompile", "pipeline.pipe_partitioned"), "bool"),
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


# ---------------------------------------------------------------------------------- batches

LeafKind = Literal["good", "float64", "float16", "bfloat16", "int64", "bool", "complex64", "flat", "extra_dim",
                   "wide", "empty", "nan", "inf", "list", "none", "str", "scalar", "int", "numpy", "noncontig",
                   "meta"]
LEAF_KINDS: tuple[str, ...] = LeafKind.__args__  # type: ignore[attr-defined]


def make_leaf(kind: str, rows: int, cols: int, seed: int) -> Any:
    """One batch leaf of ``rows x cols`` normal values, made bad as ``kind`` says."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, cols, generator=g)
    if kind in ("float64", "float16", "bfloat16", "int64", "bool", "complex64"):
        return t.to(getattr(torch, kind))
    if kind == "flat":
        return t.reshape(-1)
    if kind == "extra_dim":
        return t[None]
    if kind == "wide":
        return torch.randn(rows, cols + 1 + seed % 3, generator=g)
    if kind == "empty":
        return torch.randn(0, cols)
    if kind in ("nan", "inf"):
        t[seed % rows, seed % cols] = math.nan if kind == "nan" else -math.inf
        return t
    if kind == "list":
        return t.tolist()
    if kind == "numpy":
        return t.numpy()
    if kind == "noncontig":
        return torch.randn(cols, rows, generator=g).t()
    if kind == "meta":
        return torch.empty(rows, cols, device="meta")
    return {"none": None, "str": "x", "scalar": torch.tensor(1.0), "int": 3}.get(kind, t)


@st.composite
def batches(draw, *, d_in: int = 4, d_out: int = 2, max_rows: int = 7, good_weight: int = 3) -> dict:
    """``{"rows", "x", "y", "tree", "batch"}``: a batch for ``Linear(d_in, d_out)`` under an
    MSE step; each leaf good or bad (:data:`LEAF_KINDS`), its tree a dict ``{x, y}`` or one
    missing, extra, tupled, nested or listed."""
    rows = draw(st.integers(1, max_rows))
    kinds = ("good",) * good_weight + LEAF_KINDS[1:]
    kx, ky = draw(st.sampled_from(kinds)), draw(st.sampled_from(kinds))
    seed = draw(st.integers(0, 2**16))
    b: Any = {"x": make_leaf(kx, rows, d_in, seed), "y": make_leaf(ky, rows, d_out, seed + 1)}
    tree = draw(st.sampled_from(["dict"] * 4 + ["missing", "extra", "tuple", "nested", "list"]))
    if tree == "missing":
        b.pop(draw(st.sampled_from(["x", "y"])))
    elif tree == "extra":
        b["z"] = make_leaf(draw(st.sampled_from(kinds)), rows, 3, seed + 2)
    elif tree == "tuple":
        b = (b["x"], b["y"])
    elif tree == "nested":
        b = {**b, "meta": {"ids": torch.arange(rows)}}
    elif tree == "list":
        b = [b]
    return {"rows": rows, "x": kx, "y": ky, "tree": tree, "batch": b}


# ------------------------------------------------------------------------- checkpoint manifests

_HOSTILE = ["", "../../../etc/passwd", "/etc/passwd", "rank00000.safetensors", "rank00001.safetensors",
            "../rank00000.safetensors", "float128", "object", "F32", "tensor", "value", "int", "float", "str",
            "bool", "nan", "__import__('os').system('touch /tmp/fzero-fuzz-pwned')"]
_MANIFEST_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3),
    st.sampled_from([2**62, 2**64, -2**63, 10**30, 1.5, math.nan, math.inf]), st.sampled_from(_HOSTILE),
    st.lists(st.integers(-1, 2**40), max_size=4), st.just({}), st.just([]),
    st.lists(st.sampled_from([0, 5, 2**62]), max_size=3))
_RENAMES = ["../rank00000.safetensors", "rank00000.safetensors/../../x", "/tmp/rank00000.safetensors", "zz",
            "rank99999.safetensors", "rank00000.safetensors\x00"]


def manifest_nodes(manifest: Any) -> list[tuple]:
    """Every place in a manifest (as key/index paths), but only the first few numbers of the
    long RNG state arrays, so a draw lands on a structural field as often as on a number."""
    out: list[tuple] = []

    def walk(x: Any, path: tuple) -> None:
        if path and not (path[0] == "rng" and len(path) > 4 and isinstance(path[-1], int) and path[-1] > 2):
            out.append(path)
        items = x.items() if isinstance(x, dict) else enumerate(x) if isinstance(x, list) else ()
        for k, v in items:
            walk(v, path + (k,))

    walk(manifest, ())
    return out


@st.composite
def manifest_mutations(draw, nodes: list[tuple], *, max_changes: int = 3) -> list[tuple[tuple, str, Any]]:
    """1 to ``max_changes`` changes ``(where, "del" | "set" | "rename", value)`` to a
    manifest whose places are ``nodes`` (:func:`manifest_nodes`)."""
    out = []
    for _ in range(draw(st.integers(1, max_changes))):
        where = draw(st.sampled_from(nodes))
        op = draw(st.sampled_from(["del", "set", "set", "set", "rename"]))
        value = draw(_MANIFEST_VALUES) if op == "set" else draw(st.sampled_from(_RENAMES)) if op == "rename" else None
        out.append((where, op, value))
    return out


def apply_mutations(manifest: dict, changes: list[tuple[tuple, str, Any]]) -> dict:
    """A copy of ``manifest`` with ``changes`` made (a change whose place a previous one
    removed is skipped)."""
    m = copy.deepcopy(manifest)
    for where, op, value in changes:
        cur: Any = m
        try:
            for k in where[:-1]:
                cur = cur[k]
            k = where[-1]
            if op == "del":
                del cur[k]
            elif op == "set":
                cur[k] = copy.deepcopy(value)
            elif isinstance(cur, dict) and k in cur:
                cur[value] = cur.pop(k)
        except (KeyError, IndexError, TypeError):
            pass
    return m


# ---------------------------------------------------------------------------------- outcomes

Outcome = Literal["ran", "named", "user", "bug"]


def outcome(fn: Callable[[], Any], *, named: tuple[type[BaseException], ...], prefix: str | tuple[str, ...] = "fzero",
            user_files: tuple[str, ...] = ()) -> tuple[Outcome, Any]:
    """Call ``fn`` and sort what happened: ``("ran", result)``; ``("named", error)`` for an
    error of a ``named`` type whose message starts with ``prefix``; ``("user", error)`` for
    an error raised under a frame of ``user_files`` (the user's own step, passed through as
    it was); else ``("bug", error)`` (an AttributeError, KeyError, ZeroDivisionError, ...
    from fzero's inside)."""
    try:
        return "ran", fn()
    except Exception as e:  # noqa: BLE001  (sorting every exception is the point)
        if isinstance(e, named) and str(e).startswith(prefix):
            return "named", e
        frames = [f.filename for f in traceback.extract_tb(e.__traceback__)]
        if user_files and any(f.endswith(u) for f in frames for u in user_files):
            return "user", e
        return "bug", e


def describe(error: BaseException) -> str:
    """An error and where it was raised, for a failing case's message."""
    tb = traceback.extract_tb(error.__traceback__)
    where = f" at {tb[-1].filename}:{tb[-1].lineno}" if tb else ""
    return f"{type(error).__name__}: {error}{where}"


def section_paths(changes: list[tuple[str, Any]]) -> list[str]:
    """The dotted paths of ``changes`` and every section above them."""
    out = []
    for path, _ in changes:
        parts = path.split(".")
        out += [".".join(parts[: i + 1]) for i in range(len(parts))]
    return out


def mentions_any(message: str, paths: list[str] | tuple[str, ...]) -> bool:
    """Whether ``message`` names one of ``paths`` (by its dotted path or its last key)."""
    return any(p in message or p.rsplit(".", 1)[-1] in message for p in paths)




# ------------------------------------------------------------------------------------ cases
#
# Each case runs one drawn input and returns its outcome ("ran", "named" or "user"), or
# fails an assertion that says what went wrong: the tests call them under @given, and
# benchmarks/fuzz.py counts them.

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


def contradiction_case(config: dict, keys: tuple[str, ...]) -> Outcome:
    """A config that contradicts itself is refused at world size 2, naming every key of ``keys``."""
    d = {"train_micro_batch_size_per_gpu": 2, **config}
    kind, result = outcome(lambda: _load_config(d, 2), named=CONFIG_ERRORS, prefix="fzero.Config")
    assert kind == "named", f"{config}: {'accepted' if kind == 'ran' else describe(result)}"
    missing = [k for k in keys if k not in str(result)]
    assert not missing, f"{config}: the error does not name {missing}: {result}"
    return kind


def _linear(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(4, 2)


def valid_config_case(d: dict, seed: int) -> Outcome:
    """A valid config loads, ``fzero.compile`` builds its step, and one step on one process
    gives plain PyTorch's loss (the micro-batches' mean ``mse_loss`` of the same module)
    and counts the update (unless fp16's scaler skipped it)."""
    import torch.nn.functional as F

    import fzero
    from fzero import optim
    from fzero.testing.steps import mse_step

    cfg = _load_config(d)
    module = _linear()
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


_STEPS: dict = {}


def _compiled(accumulate: int, precision: str) -> tuple[Any, Any]:
    """One compiled step (SGD 0.1, momentum 0.9, one process) per (accumulate, precision), shared by the
    cases: a batch tree that changes between calls is part of what is drawn."""
    import fzero
    from fzero import optim
    from fzero.testing.steps import mse_step

    key = (accumulate, precision)
    if key not in _STEPS:
        apply, params = fzero.functionalize(_linear())
        state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1, 0.9))
        step = fzero.compile(mse_step, accumulate=accumulate, precision=precision, donate=False)
        _STEPS[key] = (step, step.init(state))
    return _STEPS[key]


def _torch_sgd_step(batch: dict) -> dict[str, torch.Tensor]:
    """Plain PyTorch's SGD(0.1, momentum 0.9) step of ``mse_step`` on ``batch``: the new weights."""
    import torch.nn.functional as F

    module = _linear()
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    F.mse_loss(module(batch["x"]), batch["y"]).backward()
    opt.step()
    return {k: v.detach() for k, v in module.state_dict().items()}


def _finite(t: Any) -> bool:
    return not isinstance(t, torch.Tensor) or t.device.type == "meta" or not t.is_floating_point() or bool(
        torch.isfinite(t).all())


_LEAF_PATH = re.compile(r"\[('[^']*'|\d+)\]")


def batch_case(case: dict, accumulate: int, precision: str) -> Outcome:
    """A drawn batch (:func:`batches`) given to a compiled step ends in fzero's error naming
    the leaf, in the error the step's own code raised, or in a correct step: plain
    PyTorch's weights for an fp32 batch; the state before it for a batch with NaN or inf
    (the update skipped). An empty batch runs as plain PyTorch runs it (a NaN loss, zero
    gradients, an update)."""
    import warnings

    import fzero
    from fzero.testing.asserts import assert_trees_close

    step, state = _compiled(accumulate, precision)
    batch = case["batch"]
    before = {k: v.clone() for k, v in fzero.gather(state.params).items()}
    momentum_before = [t.clone() for t in fzero.tree.leaves(state.opt_state) if isinstance(t, torch.Tensor)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kind, result = outcome(lambda: step(state, batch), named=(ValueError, TypeError, RuntimeError),
                               prefix="fzero", user_files=("fzero/testing/steps.py",))
    what = f"x {case['x']}, y {case['y']}, tree {case['tree']}, accumulate {accumulate}, {precision}"
    assert kind != "bug", f"{what}: {describe(result)}"
    if kind == "named":  # a batch's problem names the leaf by its key path
        assert _LEAF_PATH.search(str(result)) or "batch" in str(result), f"{what}: {result}"
    if kind != "ran":
        return kind
    new, _ = result
    after = fzero.gather(new.params)
    leaves = [batch[k] for k in ("x", "y") if k in batch] if isinstance(batch, dict) else []  # what the step reads
    if not all(_finite(t) for t in leaves):
        assert all(torch.equal(after[k], before[k]) for k in before), f"{what}: a non-finite batch changed the params"
        assert int(new.step) == int(state.step), f"{what}: a non-finite batch's update was counted"
        momentum = [t for t in fzero.tree.leaves(new.opt_state) if isinstance(t, torch.Tensor)]
        same = len(momentum) == len(momentum_before) and all(map(torch.equal, momentum, momentum_before))
        assert same, f"{what}: a non-finite batch moved the optimizer's momentum"
    elif precision == "fp32" and case["tree"] in ("dict", "extra", "nested"):
        assert_trees_close(after, _torch_sgd_step(batch), rtol=1e-5, atol=1e-6)
    return kind


class SavedCheckpoint(NamedTuple):
    """A small committed checkpoint to mutate: its root, its directory, its manifest and
    the manifest's places (:func:`manifest_nodes`)."""

    root: str
    path: str
    manifest: dict
    nodes: list


SAVED_STATE = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.arange(5, dtype=torch.int64), "n": 7, "lr": 0.5,
               "flag": True}
_LIKE = {"w": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.int64), "n": 0, "lr": 0.0, "flag": False}
READS = ("load", "load, verify=False", "load, restore_rng=True", "verify", "export", "inspect")


def save_checkpoint(root: str) -> SavedCheckpoint:
    """Save :data:`SAVED_STATE` (two tensors, three values) under ``root``/src."""
    import json
    import os

    import fzero.checkpoint as ckpt

    path = os.path.join(root, "src")
    ckpt.save(path, SAVED_STATE)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    _read(path, "inspect")  # every module a read imports, imported before any watch starts
    return SavedCheckpoint(root, path, manifest, manifest_nodes(manifest))


class _Watch:
    """An audit hook (installed once) that, while on, records files opened outside
    ``allowed`` and any code run, unpickled or spawned."""

    def __init__(self) -> None:
        import sys

        self.on, self.allowed, self.seen = False, (), []
        sys.addaudithook(self)

    def __call__(self, event: str, args: tuple) -> None:
        import os

        if not self.on:
            return
        if event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], (str, bytes, os.PathLike)):
            p = os.path.abspath(os.fsdecode(args[0]))
            if p not in self.allowed and not p.startswith(tuple(a for a in self.allowed if a.endswith(os.sep))):
                self.seen.append((event, p))
        elif event in ("exec", "pickle.find_class", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn"):
            self.seen.append((event, str(args)[:80]))


_WATCH: list = []


def write_manifest(path: str, manifest: dict) -> None:
    """Write ``manifest`` into the checkpoint at ``path``, with the ``COMMITTED`` marker's
    checksum of it updated: a consistent edit, which the manifest's checks (not its
    checksum) must catch."""
    import json
    import os
    import zlib

    data = json.dumps(manifest, indent=1).encode()
    with open(os.path.join(path, "manifest.json"), "wb") as f:
        f.write(data)
    with open(os.path.join(path, "COMMITTED")) as f:
        marker = json.load(f)
    marker["manifest_crc32"] = zlib.crc32(data)
    with open(os.path.join(path, "COMMITTED"), "w") as f:
        json.dump(marker, f)


def _export_file(path: str) -> str:
    import os

    return os.path.join(os.path.dirname(path), "export.safetensors")


def _read(path: str, how: str) -> Any:
    import contextlib
    import io
    import os

    import fzero.checkpoint as ckpt
    from fzero.checkpoint import cli

    if how == "load":
        return ckpt.load(path, like=_LIKE)
    if how == "load, verify=False":
        return ckpt.load(path, like=_LIKE, verify=False)
    if how == "load, restore_rng=True":
        return ckpt.load(path, like=_LIKE, restore_rng=True)
    if how == "verify":
        return ckpt.verify(path)
    if how == "export":
        return ckpt.export(path, _export_file(path))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = cli.main(["inspect", path])
    if rc != 0:
        raise ckpt.CheckpointError(f"fzero checkpoint inspect exited {rc}")
    return rc


def manifest_case(saved: SavedCheckpoint, changes: list, how: str, *, expect: Outcome | None = None) -> Outcome:
    """The checkpoint ``saved`` with its manifest changed by ``changes``, read as ``how``
    (:data:`READS`): a ``CheckpointError``, or a read that passed its checks (whose tensors
    are then the saved ones); never another exception, a file opened outside the
    checkpoint's root, code run or unpickled."""
    import os
    import shutil
    import sys

    from fzero.checkpoint import CheckpointError

    path = os.path.join(saved.root, "case")
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(saved.path, path)
    write_manifest(path, apply_mutations(saved.manifest, changes))
    if not _WATCH:
        _WATCH.append(_Watch())
    watch = _WATCH[0]
    # the checkpoint's own directory (not its sibling, the saved original), export's output
    # file, and Python's own files (a module imported lazily on the way)
    watch.allowed = (os.path.join(path, ""), path, _export_file(path), os.path.join(sys.prefix, ""),
                     os.path.join(sys.base_prefix, ""))
    watch.seen, watch.on = [], True
    try:
        kind, result = outcome(lambda: _read(path, how), named=(CheckpointError,), prefix="")
    finally:
        watch.on = False
    assert kind in ("ran", "named"), f"{changes}, {how}: {describe(result)}"
    assert not watch.seen, f"{changes}, {how}: {watch.seen}"
    assert expect is None or kind == expect, f"{changes}, {how}: {kind}, not {expect}: {result}"
    if kind == "ran" and how in ("load", "load, restore_rng=True"):  # what was read passed its checksums
        for k in ("w", "b"):
            assert torch.equal(result[k], SAVED_STATE[k]), f"{changes}, {how}: {k} read wrong"
    return kind
