"""DeepSpeed's ``autotuning`` config section, as ``fzero autotune`` reads it.

Keys and defaults are DeepSpeed's (``deepspeed/autotuning/constants.py``). The training
step ignores the section (``fzero.Config`` accepts it with no effect); the tuner honours
what carries over to fzero and names, in one warning, the keys it accepts but does not use.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from fzero.config import ConfigKeyError

__all__ = ["AutotuningConfig", "METRICS"]

WHERE = "fzero autotune"
# The metric, and whether larger is better. DeepSpeed's "flops" is FLOPs per GPU per second:
# with one model and one world size, FLOPs per sample and the GPU count are fixed, so it ranks
# candidates exactly as samples per second does.
METRICS = {"throughput": True, "latency": False, "flops": True}
TUNERS = ("gridsearch", "random", "model_based")

# Keys accepted and not used, with the reason (reported once, when the value is not DeepSpeed's default).
_UNUSED = {
    "fast": (True, "fzero always tunes in DeepSpeed's fast mode: stage × micro-batch (× tp), "
                   "not bucket sizes or overlap"),
    "metric_path": (None, "the tuner sets each trial's metric file"),
}
_MODEL_INFO_KEYS = {"profile", "num_params", "hidden_size", "hideen_size", "num_layers"}


def _int(key: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{WHERE}: autotuning.{key} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutotuningConfig:
    """DeepSpeed's ``autotuning`` section, checked. Defaults are DeepSpeed's.

    Example:
        >>> cfg = AutotuningConfig.from_dict({"enabled": True, "metric": "latency",
        ...                                   "max_train_micro_batch_size_per_gpu": 8})
        >>> cfg.metric, cfg.start_profile_step, cfg.end_profile_step, cfg.max_train_micro_batch_size_per_gpu
        ('latency', 3, 5, 8)
    """

    enabled: bool = False
    """Read by DeepSpeed's engine; ``fzero autotune`` tunes whether or not it is set."""
    results_dir: str = "autotuning_results"
    """Where the table, every trial's result and the best config are written."""
    exps_dir: str = "autotuning_exps"
    """One folder per trial: its config, its metric file, its stdout and stderr."""
    overwrite: bool = True
    """``False``: a trial whose metric file is already in ``exps_dir`` is not run again."""
    metric: Literal["throughput", "latency", "flops"] = "throughput"
    """Samples/s (higher is better), seconds per step (lower), or FLOPs/s per GPU (ranks as throughput)."""
    start_profile_step: int = 3
    """The first step call timed (1-based); the calls before it are warm-up."""
    end_profile_step: int = 5
    """The last step call timed; the trial ends when it returns."""
    tuner_type: Literal["gridsearch", "random", "model_based"] = "gridsearch"
    """``gridsearch``: stages in order, micro-batches in order; ``random``: the same grid in a
    seeded random order; ``model_based`` runs as ``gridsearch`` (reported)."""
    tuner_early_stopping: int = 5
    """Stop after this many trials in a row that do not beat the best."""
    tuner_num_trials: int = 50
    """Run at most this many trials (pruned candidates are not run and do not count)."""
    arg_mappings: Mapping[str, str] | None = None
    """Config key → the script's command-line flag that carries it, e.g.
    ``{"train_micro_batch_size_per_gpu": "--per_device_train_batch_size"}``: each trial sets
    the flag to the candidate's value."""
    num_params: int | None = None
    """``model_info.num_params``, else read from ``model_info_path``; ``None``: measured by a first trial."""
    block_params: int | None = None
    """The largest block's parameters (``0``: the model has none), read from ``model_info_path``
    where the trial that measured Ψ wrote it; ``None``: unknown (``fzero estimate`` then takes
    blocks of 1/32 of the model)."""
    mp_size: int = 1
    """The model-parallel degree: the tensor-parallel size tried when ``--tp`` is not given."""
    max_train_batch_size: int | None = None
    min_train_batch_size: int = 1
    max_train_micro_batch_size_per_gpu: int = 1024
    min_train_micro_batch_size_per_gpu: int = 1
    num_tuning_micro_batch_sizes: int = 3
    """At most this many micro-batch sizes per stage, the largest that fit the bounds."""
    ignored: tuple[str, ...] = ()
    """Keys accepted without effect, each with the reason."""

    @classmethod
    def from_dict(cls, section: Mapping[str, Any] | None, *, base_dir: str | Path = ".") -> "AutotuningConfig":
        """Read the ``autotuning`` section of a DeepSpeed config (``None``: the defaults).

        Args:
            section: the section's dict.
            base_dir: where a relative ``model_info_path`` is read from.

        Raises:
            ConfigKeyError: a key DeepSpeed's autotuning section does not have (with the nearest one).
            ValueError: a value out of range, or an unreadable ``model_info_path``; the key is named.
        """
        section = dict(section or {})
        known = {f.name for f in dataclasses.fields(cls)} - {"num_params", "block_params", "ignored"}
        known |= set(_UNUSED) | {"model_info", "model_info_path"}
        unknown = sorted(k for k in section if k not in known)
        if unknown:
            hints = []
            for k in unknown:
                close = difflib.get_close_matches(str(k), sorted(known), n=1, cutoff=0.6)
                hints.append(f"autotuning.{k}" + (f" (did you mean autotuning.{close[0]}?)" if close else ""))
            raise ConfigKeyError(f"{WHERE}: unknown keys in the autotuning section: {', '.join(hints)}; "
                                 f"valid keys: {', '.join(sorted(known))}")
        ignored = [f"autotuning.{k} ({why})" for k, (default, why) in _UNUSED.items()
                   if k in section and section.pop(k) != default]
        info = section.pop("model_info", None) or {}
        info_path = section.pop("model_info_path", None)
        if not isinstance(info, Mapping) or set(info) - _MODEL_INFO_KEYS:
            bad = sorted(set(info) - _MODEL_INFO_KEYS) if isinstance(info, Mapping) else info
            raise ValueError(f"{WHERE}: autotuning.model_info must be an object with keys among "
                             f"{', '.join(sorted(_MODEL_INFO_KEYS))}; got {bad!r}")
        ignored += [f"autotuning.model_info.{k} (fzero estimate takes num_params; a trial measures the blocks)"
                    for k in sorted(set(info) - {"num_params"}) if info[k] not in (None, False)]
        num_params, block_params = info.get("num_params"), None
        if num_params is None and info_path is not None:
            p = Path(base_dir) / info_path
            try:
                measured = json.loads(p.read_text())
                num_params, block_params = measured["num_params"], measured.get("block_params")
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(f"{WHERE}: autotuning.model_info_path {str(p)!r} holds no num_params: {e!r}") from None
            if block_params is not None:  # 0: the model has no blocks
                block_params = _int(f"model_info_path {str(p)!r}: block_params", block_params, minimum=0)
        if num_params is not None:
            num_params = _int("model_info.num_params", num_params)
        kw: dict[str, Any] = dict(section)
        cfg = cls(num_params=num_params, block_params=block_params, **kw)
        if cfg.tuner_type == "model_based":
            ignored.append("autotuning.tuner_type='model_based' (fzero has no cost model; the grid is searched in order)")
        return dataclasses.replace(cfg, ignored=tuple(ignored))

    def __post_init__(self) -> None:
        for key in ("enabled", "overwrite"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{WHERE}: autotuning.{key} must be true or false, got {getattr(self, key)!r}")
        for key in ("results_dir", "exps_dir"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise ValueError(f"{WHERE}: autotuning.{key} must be a non-empty path, got {getattr(self, key)!r}")
        if self.metric not in METRICS:
            raise ValueError(f"{WHERE}: autotuning.metric must be one of {', '.join(METRICS)}, got {self.metric!r}")
        if self.tuner_type not in TUNERS:
            raise ValueError(f"{WHERE}: autotuning.tuner_type must be one of {', '.join(TUNERS)}, "
                             f"got {self.tuner_type!r}")
        for key in ("start_profile_step", "end_profile_step", "tuner_early_stopping", "tuner_num_trials", "mp_size",
                    "min_train_batch_size", "max_train_micro_batch_size_per_gpu",
                    "min_train_micro_batch_size_per_gpu", "num_tuning_micro_batch_sizes"):
            _int(key, getattr(self, key))
        if self.max_train_batch_size is not None:
            _int("max_train_batch_size", self.max_train_batch_size)
        if self.start_profile_step > self.end_profile_step:
            raise ValueError(f"{WHERE}: autotuning.start_profile_step={self.start_profile_step} is after "
                             f"end_profile_step={self.end_profile_step}")
        if self.min_train_micro_batch_size_per_gpu > self.max_train_micro_batch_size_per_gpu:
            raise ValueError(f"{WHERE}: autotuning.min_train_micro_batch_size_per_gpu="
                             f"{self.min_train_micro_batch_size_per_gpu} exceeds max_train_micro_batch_size_per_gpu="
                             f"{self.max_train_micro_batch_size_per_gpu}")
        if self.arg_mappings is not None and not (
                isinstance(self.arg_mappings, Mapping)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in self.arg_mappings.items())):
            raise ValueError(f"{WHERE}: autotuning.arg_mappings must map config keys to command-line flags "
                             f"(strings), got {self.arg_mappings!r}")
