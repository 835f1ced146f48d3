"""Hugging Face's ``"auto"`` values, resolved from what fzero knows.

Hugging Face's Trainer and Accelerate fill a DeepSpeed config's ``"auto"`` values from
their ``TrainingArguments`` and the model (``HfTrainerDeepSpeedConfig.trainer_config_process``
and ``trainer_config_finalize``). fzero fills them from, in this order:

1. an explicit ``auto=`` mapping: dotted config paths (``"optimizer.params.lr"``), or
   Hugging Face's argument names (``learning_rate``, ``per_device_train_batch_size``,
   ``max_steps``, ``hidden_size``, ...), or an object with those attributes (a
   ``TrainingArguments``);
2. ``fzero.compile``'s keywords (``accumulate=``, ``precision=``, ``clip_norm=``, ``zero=``);
3. at ``step.init``, the model: its hidden size;
4. at the first step call, the batch: its leading size is micro-batch × accumulation steps;
5. Hugging Face's defaults where it has one (``TrainingArguments``: learning rate 5e-5,
   betas (0.9, 0.999), eps 1e-8, weight decay 0.0, no accumulation, fp32, clipping at
   1.0, no warmup, a minimum warmup rate of 0).

The optimizer's values come from ``auto=`` or Hugging Face's defaults, never from the
optimizer handed to ``TrainState.create``: the config's optimizer replaces that one at
``step.init`` (it may be omitted), so its values are a placeholder's (``adamw``'s default
weight decay is torch's 0.01, Hugging Face's Trainer uses 0.0).

A value that none of these gives is an error naming its path and how to give it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from fzero.config._options import fills

AUTO = "auto"

# Hugging Face's argument names -> the config paths they fill (trainer_config_process).
_HF_NAMES: dict[str, tuple[str, ...]] = {
    "per_device_train_batch_size": ("train_micro_batch_size_per_gpu",),
    "gradient_accumulation_steps": ("gradient_accumulation_steps",),
    "max_grad_norm": ("gradient_clipping",),
    "learning_rate": ("optimizer.params.lr", "scheduler.params.warmup_max_lr"),
    "adam_epsilon": ("optimizer.params.eps",),
    "weight_decay": ("optimizer.params.weight_decay",),
    "warmup_steps": ("scheduler.params.warmup_num_steps",),
    "max_steps": ("scheduler.params.total_num_steps",),
    "fp16": ("fp16.enabled",),
    "bf16": ("bf16.enabled",),
}
_HF_EXTRA = ("adam_beta1", "adam_beta2", "hidden_size")

# The auto paths compile's keywords fill: {path: (field, its value from the field's keyword)}.
_FROM_OPTIONS = fills()

# Hugging Face's defaults (TrainingArguments) where fzero knows nothing better.
_DEFAULTS: dict[str, tuple[Any, str]] = {
    "optimizer.params.lr": (5e-5, "Hugging Face's default learning_rate"),
    "optimizer.params.betas": ([0.9, 0.999], "Hugging Face's default adam_beta1, adam_beta2"),
    "optimizer.params.eps": (1e-8, "Hugging Face's default adam_epsilon"),
    "optimizer.params.weight_decay": (0.0, "Hugging Face's default weight_decay"),
    "gradient_accumulation_steps": (1, "Hugging Face's default: no accumulation"),
    "gradient_clipping": (1.0, "Hugging Face's default max_grad_norm"),
    "fp16.enabled": (False, "Hugging Face's default: fp16 off"),
    "bf16.enabled": (False, "Hugging Face's default: bf16 off"),
    "scheduler.params.warmup_min_lr": (0.0, "Hugging Face's value"),
    # Hugging Face's default is 0 warmup steps, which DeepSpeed 0.19 refuses (it wants >= 1
    # and warms up over max(2, n)): the shortest warmup it accepts.
    "scheduler.params.warmup_num_steps": (1, "Hugging Face's default of no warmup, as the least DeepSpeed takes"),
}

_LR, _WARMUP_MAX_LR = "optimizer.params.lr", "scheduler.params.warmup_max_lr"
_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu")
_BUCKET = "zero_optimization.reduce_bucket_size"
# Stage-3 knobs Hugging Face derives from the hidden size; speed knobs fzero does not read.
_HIDDEN_KNOBS = {"zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
                 "zero_optimization.prefetch_bucket_size": lambda h: int(0.9 * h * h),
                 "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h,
                 "zero_optimization.param_persistence_threshold": lambda h: 10 * h}


class _Drop:
    """A key to remove: the value is not known yet (or has no effect), so the section is
    built as if it were not written."""

    def __repr__(self) -> str:
        return "<not written>"


DROP = _Drop()


# Where "auto" is DeepSpeed's own value, not Hugging Face's placeholder.
_NATIVE = frozenset({"pipeline.stages"})


def find(d: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The dotted paths whose value is Hugging Face's ``"auto"``, in the order written."""
    out = []
    for key, value in d.items():
        path = f"{prefix}{key}"
        if path in _NATIVE:
            continue
        if isinstance(value, str) and value == AUTO:
            out.append(path)
        elif isinstance(value, Mapping):
            out.extend(find(value, path + "."))
        elif isinstance(value, (list, tuple)) and any(isinstance(v, str) and v == AUTO for v in value):
            out.append(path)
    return out


def substitute(d: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``d`` with each dotted path set to its value (``DROP`` removes the key)."""
    out = copy.deepcopy(dict(d))
    for path, value in values.items():
        *parents, last = path.split(".")
        node = out
        for name in parents:
            child = node.get(name)
            if not isinstance(child, Mapping):
                break
            node[name] = child = dict(child)
            node = child
        else:
            if value is DROP:
                node.pop(last, None)
            else:
                node[last] = value
    return out


def given_values(auto: Any) -> tuple[dict[str, Any], int | None]:
    """``(values by dotted path, hidden size)`` from an ``auto=`` mapping or object."""
    if auto is None:
        return {}, None
    if isinstance(auto, Mapping):
        get = auto.get
        names = list(auto)
    else:  # an object with Hugging Face's argument names as attributes (TrainingArguments)
        def get(name, default=None):
            return getattr(auto, name, default)
        names = [n for n in (*_HF_NAMES, *_HF_EXTRA) if hasattr(auto, n)]
    out: dict[str, Any] = {}
    for name in names:
        value = get(name)
        if name in _HF_NAMES:
            for path in _HF_NAMES[name]:
                out.setdefault(path, value)
        elif name not in _HF_EXTRA and isinstance(name, str):
            out[name] = value  # a dotted config path, as written
    if out.get("scheduler.params.warmup_num_steps") is not None and "warmup_steps" in names:
        # As Hugging Face fills it: DeepSpeed 0.19 refuses 0 warmup steps.
        out["scheduler.params.warmup_num_steps"] = max(1, int(out["scheduler.params.warmup_num_steps"]))
    b1, b2 = get("adam_beta1"), get("adam_beta2")
    if b1 is not None or b2 is not None:
        out.setdefault("optimizer.params.betas", [0.9 if b1 is None else b1, 0.999 if b2 is None else b2])
    hidden = get("hidden_size")
    return out, None if hidden is None else int(hidden)


def hidden_size_of(module: Any) -> int | None:
    """The model's hidden size, as Hugging Face reads it (``config.hidden_size``, or
    ``hidden_sizes``' largest), or ``None``."""
    cfg = getattr(module, "config", None)
    if cfg is None:
        return None
    for name in ("hidden_size", "d_model", "n_embd"):
        h = getattr(cfg, name, None)
        if isinstance(h, int):
            return h
    sizes = getattr(cfg, "hidden_sizes", None)
    if isinstance(sizes, (list, tuple)) and sizes and all(isinstance(s, int) for s in sizes):
        return max(sizes)
    return None


def resolve(paths: list[str], d: Mapping[str, Any], *, given: Mapping[str, Any], hidden: int | None,
            options: Mapping[str, Any], at_init: bool,
            batch: int | None) -> tuple[dict[str, Any], dict[str, tuple[Any, str]], list[str], list[tuple[str, str]]]:
    """Resolve the ``"auto"`` values at ``paths`` of config ``d`` from what is known.

    Args:
        given: values by dotted path from ``auto=``.
        hidden: the model's hidden size, if known.
        options: ``fzero.compile``'s keyword fields (``accumulate``, ``dtype``, ...).
        at_init: ``step.init`` has seen the state (a model without a hidden size then
            keeps fzero's default bucket).
        batch: the first batch's leading size, once the first step call knows it.

    Returns:
        ``(substitutions, resolved, pending, unresolved)``: the values to write into the
        config (``DROP`` for a key to leave out for now), ``{path: (value, where from)}``,
        the paths resolved later (at ``step.init`` or the first call), and
        ``[(path, how to give it)]`` for those nothing can give.
    """
    subs: dict[str, Any] = {}
    resolved: dict[str, tuple[Any, str]] = {}
    pending: list[str] = []
    unresolved: list[tuple[str, str]] = []
    autos = set(paths)

    def take(path, value, source):
        subs[path] = value
        resolved[path] = (value, source)

    for path in paths:
        if path in given and given[path] is not None and not (isinstance(given[path], str) and given[path] == AUTO):
            take(path, given[path], "auto=")
            continue
        field, fill = _FROM_OPTIONS.get(path, (None, None))
        if field in options and fill(options[field]) is not None:
            take(path, fill(options[field]), "fzero.compile's keyword")
            continue
        if path in _BATCH:
            other = _BATCH[1 - _BATCH.index(path)]
            subs[path] = DROP
            if other in given or (other not in autos and _get(d, other) is not None):
                resolved[path] = (None, "derived by DeepSpeed's rule train = micro × accumulation × world")
            elif batch is None:
                pending.append(path)
            continue
        if path in _DEFAULTS:
            take(path, *_DEFAULTS[path])
            continue
        if path == _WARMUP_MAX_LR:  # the optimizer's lr, as Hugging Face fills both from learning_rate
            lr = given.get(_LR)
            if lr is None or (isinstance(lr, str) and lr == AUTO):
                lr = _DEFAULTS[_LR][0] if _is_auto(d, _LR) or _get(d, _LR) is None else _get(d, _LR)
            take(path, lr, "the optimizer's lr")
            continue
        if path == _BUCKET or path in _HIDDEN_KNOBS:
            if hidden is not None:
                value = hidden * hidden if path == _BUCKET else _HIDDEN_KNOBS[path](hidden)
                take(path, value, f"the model's hidden size {hidden}"
                     + ("" if path == _BUCKET else ", as Hugging Face sets it; no effect in fzero"))
                if path != _BUCKET:
                    subs[path] = DROP  # a speed knob fzero does not read
            elif path != _BUCKET:  # a speed knob fzero does not read: nothing to wait for
                subs[path] = DROP
                resolved[path] = (None, "no effect in fzero")
            elif at_init:  # the model says no hidden size
                subs[path] = DROP
                resolved[path] = (None, "the model has no config.hidden_size: fzero's default bucket")
            else:
                subs[path] = DROP
                pending.append(path)
            continue
        if path == "scheduler.params.total_num_steps":
            unresolved.append((path, "fzero cannot know how many updates the run makes: pass "
                               "auto={\"max_steps\": N} (Hugging Face's name) or "
                               "{\"scheduler.params.total_num_steps\": N}"))
            continue
        unresolved.append((path, f"fzero does not fill this one: give a value, or pass auto={{{path!r}: value}}"))

    micro = "train_micro_batch_size_per_gpu"
    if batch is not None and micro in autos and micro not in given and micro not in resolved:
        gas = resolved.get("gradient_accumulation_steps", (None,))[0]
        if gas is None:
            gas = _get(d, "gradient_accumulation_steps") or 1
        if isinstance(gas, int) and gas > 0 and batch % gas == 0:
            take(micro, batch // gas, f"the first batch: {batch} samples / {gas} accumulation steps")
            if "train_batch_size" in autos and "train_batch_size" not in given:
                resolved["train_batch_size"] = (None, "derived by DeepSpeed's rule train = micro × accumulation × world")
        else:
            unresolved.append((micro, f"the first batch's {batch} samples do not split into {gas} "
                               "accumulation steps"))
    return subs, resolved, pending, unresolved


def _get(d: Mapping[str, Any], path: str) -> Any:
    node: Any = d
    for name in path.split("."):
        if not isinstance(node, Mapping) or name not in node:
            return None
        node = node[name]
    return node


def _is_auto(d: Mapping[str, Any], path: str) -> bool:
    v = _get(d, path)
    return isinstance(v, str) and v == AUTO


class AutoFill:
    """One compiled run's config while its ``"auto"`` values are filled: ``fzero.compile``
    holds one, and the run fills what ``Config.load`` could not, in this order.

    1. :meth:`at_init`, from ``step.init``'s state: the model's hidden size fills the
       bucket (``zero_optimization.reduce_bucket_size`` = hidden², Hugging Face's rule).
    2. :meth:`bucket_bytes`, ``shard_state``'s bucket when the config's is ``"auto"``: a
       hook of no arguments that ``shard_state``'s ``init`` calls, after (1) (compile's
       ``before`` runs first), in bytes of the reduced dtype.
    3. :meth:`at_first_call`, from the first batch: its leading size is micro-batch ×
       accumulation steps.

    :attr:`config` is the config as far as it is known (``step.config``).

    Args:
        config: the :class:`fzero.Config` as loaded (its ``pending`` paths are what waits).
        itemsize: bytes of one reduced gradient element (2 with a 16-bit ``reduce_in``).
        default_bucket: the bucket in bytes when the model has no hidden size (``None``:
            ``shard_state``'s default, from the model's size).
    """

    def __init__(self, config: Any, *, itemsize: int, default_bucket: int | None):
        self.config = config
        self.itemsize, self.default_bucket = itemsize, default_bucket

    @property
    def bucket_pending(self) -> bool:
        """Whether the bucket waits for the model (``reduce_bucket_size: "auto"``)."""
        return _BUCKET in self.config.pending

    def at_init(self, state: Any) -> Any:
        """The config with what ``state`` says filled (its model's hidden size)."""
        self.config = self.config.resolve(state=state)
        return self.config

    def at_first_call(self, batch: Any) -> Any:
        """The config with what ``batch`` says filled (the batch sizes)."""
        self.config = self.config.resolve(batch=batch)
        return self.config

    def bucket_bytes(self) -> int | None:
        """``shard_state``'s bucket in bytes, once :meth:`at_init` has run: the filled
        ``reduce_bucket_size`` × ``itemsize``, or ``default_bucket`` for a model without a
        hidden size."""
        elements = self.config.zero_optimization.reduce_bucket_size
        return self.default_bucket if elements is None else int(elements) * self.itemsize
