"""Reading a DeepSpeed config: JSON (duplicate keys refused, errors with line and column),
then every key classified by :mod:`fzero.config._keys` and each section built.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fzero.config._keys import (
    _BF16,
    _CANONICAL,
    _COMM_DTYPES,
    _COMMS_LOGGER,
    _FP16,
    _OFFLOAD_OPTIMIZER,
    _SCHEDULERS,
    _TOP,
    _USE,
    _ZERO,
    ConfigKeyError,
    _check_keys,
    _noop,
    _Rule,
    _PIPELINE,
)
from fzero.config._sections import BF16Config, FP16Config, OptimizerConfig, SchedulerConfig, ZeroConfig
from fzero.config._values import WHERE, _bool, _int, _section

if TYPE_CHECKING:
    from fzero.config._config import Config


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


def read(src: Any) -> tuple[Mapping[str, Any], str | None]:
    """``(the config as a dict, its source for messages)`` from a dict, a JSON file's path or
    JSON text."""
    if isinstance(src, str) and src.lstrip().startswith("{"):
        return _parse_json(src, "<JSON text>"), "<JSON text>"
    if isinstance(src, (str, os.PathLike)):
        source = os.fspath(src)
        try:
            with open(source, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise FileNotFoundError(f"{WHERE}.load: no such config file: {source}") from None
        return _parse_json(text, source), source
    if not isinstance(src, Mapping):
        raise TypeError(f"{WHERE}.load: expected a dict, a path to a JSON file or a Config, "
                        f"got {type(src).__name__}")
    return src, None


def from_dict(cls: type[Config], d: Mapping[str, Any], world_size: int, source: str | None) -> Config:
    """A ``cls`` (``Config``) from a config dict: every key classified, every section built;
    an error from a file names it after ``fzero.Config:``."""
    try:
        return _build(cls, d, world_size, source)
    except (ConfigKeyError, NotImplementedError, ValueError, TypeError) as e:
        if source is None:
            raise
        msg = str(e)
        if msg.startswith(WHERE + ": "):
            msg = f"{WHERE}: {source}: " + msg[len(WHERE) + 2:]
        raise type(e)(msg) from e


def _build(cls: type[Config], d: Mapping[str, Any], world_size: int, source: str | None) -> Config:
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
        fields = _fields("zero_optimization.", _section("zero_optimization", zero), _ZERO, noted)
        offload = fields.pop("offload_optimizer", None)
        if offload is not None:  # DeepSpeed's default is None: no offload
            p = "zero_optimization.offload_optimizer"
            offload = _fields(p + ".", _section(p, offload), _OFFLOAD_OPTIMIZER, noted)
            fields["offload_optimizer"] = offload.get("device", "none")
            fields["pin_memory"] = _bool(p + ".pin_memory", offload.get("pin_memory", False))
        kw["zero_optimization"] = ZeroConfig(**fields)
    if top.get("gradient_clipping") is not None:
        kw["gradient_clipping"] = top["gradient_clipping"]
    pipe = top.get("pipeline")
    if pipe is not None:
        section = _fields("pipeline.", _section("pipeline", pipe), _PIPELINE, noted)
        stages = section.get("stages", "auto")
        kw["pipeline_stages"] = 0 if stages == "auto" else _int("pipeline.stages", stages, minimum=1)
    tp = top.get("tensor_parallel")
    if tp is not None:
        section = _section("tensor_parallel", tp)
        unknown = sorted(set(section) - {"autotp_size"})
        if unknown:
            raise ConfigKeyError(f"{WHERE}: tensor_parallel.{unknown[0]}: fzero reads only "
                                 "tensor_parallel.autotp_size (DeepSpeed's AutoTP degree)"
                                 + (f"; also unknown: {', '.join(unknown[1:])}" if unknown[1:] else ""))
        if section.get("autotp_size") is not None:
            kw["autotp_size"] = _int("tensor_parallel.autotp_size", section["autotp_size"], minimum=1)
    logger = top.get("comms_logger")
    if logger is not None:
        section = _fields("comms_logger.", _section("comms_logger", logger), _COMMS_LOGGER, noted)
        kw["comms_logger"] = _bool("comms_logger.enabled", section.get("enabled", False))
    comm = top.get("communication_data_type")
    if comm is not None:
        if not isinstance(comm, str) or comm.lower() not in _COMM_DTYPES:
            raise ValueError(f"{WHERE}: communication_data_type must be one of "
                             f"{', '.join(map(repr, _COMM_DTYPES))}, got {comm!r}")
        kw["communication_data_type"] = comm.lower()
    if top.get("dataloader_drop_last") is not None:
        kw["dataloader_drop_last"] = _bool("dataloader_drop_last", top["dataloader_drop_last"])
    return cls(world_size=world_size, ignored=tuple(noted), source=source, **kw)
