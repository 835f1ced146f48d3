"""Reading a DeepSpeed config: JSON (duplicate keys refused, errors with line and column),
then every key classified by :mod:`fzero.config._keys` and each section built.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from fzero.config._keys import (
    _BF16,
    _CANONICAL,
    _COMMS_LOGGER,
    _COMPILE,
    _FZERO,
    _TORCH_AUTOCAST,
    _FLOPS_PROFILER,
    _FP16,
    _MONITORS,
    _OFFLOAD_OPTIMIZER,
    _OFFLOAD_PARAM,
    _OPTIMIZERS,
    _SCHEDULERS,
    _TOP,
    _USE,
    _ZERO,
    ConfigKeyError,
    _classify,
    _message,
    _noop,
    _Notes,
    _Rule,
    _PIPELINE,
)
from fzero.config import _auto, _options
from fzero.config._options import COMM_DTYPES
from fzero.config._sections import (BF16Config, FP16Config, OptimizerConfig, SchedulerConfig, ZeroConfig,
                                    offload_device)
from fzero.config._values import WHERE, _bool, _frozen, _int, _num, _section, _short
from fzero.options import TrialSpec


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
    except RecursionError:  # json's parser recurses once per level of nesting
        raise ValueError(f"{WHERE}.load: {source}: invalid JSON: nested too deeply to parse") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"{WHERE}.load: {source}: the config must be a JSON object, got "
                         f"{type(data).__name__}")
    return data


def _given_or(value: Any, default: Any) -> Any:
    """``value`` as written, or ``default`` when it is JSON null (not ``value or default``:
    a ``0``, ``""`` or ``[]`` written where a section belongs is an error, not the default)."""
    return default if value is None else value


def _fields(prefix: str, d: Mapping[str, Any], rules: Mapping[str, _Rule], notes: _Notes) -> dict:
    """The ``use`` keys of a section, after classifying all of its keys."""
    return _classify(prefix, d, rules, notes)


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


# The rule tables by section, to tell an "auto" at a key fzero does not read (accepted, no
# effect) from one at a key it uses (resolved, or an error).
_TABLES: dict[str, Mapping[str, _Rule]] = {
    "": _TOP, "fp16.": _FP16, "bf16.": _BF16, "bfloat16.": _BF16, "zero_optimization.": _ZERO,
    "zero_optimization.offload_optimizer.": _OFFLOAD_OPTIMIZER,
    "zero_optimization.offload_param.": _OFFLOAD_PARAM, "comms_logger.": _COMMS_LOGGER,
    "compile.": _COMPILE,
    "fzero.": _FZERO,
    "torch_autocast.": _TORCH_AUTOCAST,
    "pipeline.": _PIPELINE,
}


def _no_effect(path: str) -> bool:
    prefix, _, key = path.rpartition(".")
    rules = _TABLES.get(prefix + "." if prefix else "")
    return rules is not None and key in rules and rules[key].kind == "noop"


class Known:
    """What fzero knows to fill ``"auto"`` values with (see :mod:`fzero.config._auto`)."""

    __slots__ = ("auto", "options", "at_init", "hidden", "batch")

    def __init__(self, auto: Any = None, options: Mapping[str, Any] | None = None,
                 at_init: bool = False, hidden: int | None = None, batch: int | None = None):
        self.auto, self.options, self.at_init = auto, dict(options or {}), at_init
        self.hidden, self.batch = hidden, batch

    def but(self, **changes: Any) -> "Known":
        values = {name: getattr(self, name) for name in self.__slots__}
        return Known(**{**values, **changes})


def from_dict(cls: type, d: Mapping[str, Any], world_size: int, source: str | None,
              known: Known | None = None) -> Any:
    """A ``cls`` (``Config``, which calls this: the loading stands under the data and never
    imports it) from a config dict: ``"auto"`` values filled from ``known``,
    every key classified, every section built; all problems in one error, which names the
    file after ``fzero.Config:``."""
    cfg, notes = _read(cls, d, world_size, source, known or Known())
    notes.raise_if_any(source)
    return cfg


def _read(cls: type, d: Mapping[str, Any], world_size: int, source: str | None,
          known: Known) -> tuple[Any, _Notes]:
    notes = _Notes()
    paths = _auto.find(d)
    given, hidden = _auto.given_values(known.auto)
    quiet = [p for p in paths if _no_effect(p) and p not in _auto._HIDDEN_KNOBS]
    subs, resolved, pending, unresolved = _auto.resolve(
        [p for p in paths if p not in quiet], d, given=given,
        hidden=known.hidden if known.hidden is not None else hidden, options=known.options,
        at_init=known.at_init, batch=known.batch)
    for path in quiet:
        subs[path] = _auto.DROP
        resolved[path] = (None, "no effect in fzero")
    for path, how in unresolved:
        subs[path] = _auto.DROP
        notes.problem(path, ValueError(f"{WHERE}: {path} is \"auto\": {how}"))
    for path in paths:
        if path in resolved:
            value, where = resolved[path]
            notes.verdicts.append((path, "auto", where if value is None else f"{_short(value)} ({where})"))
        elif path in pending:
            notes.verdicts.append((path, "auto", "filled at step.init (from the model's hidden size) or the "
                                                 "first call (from the batch)"))
    cfg = _build(cls, _auto.substitute(d, subs), world_size, source, notes, tuple(pending))
    # A section that failed only because an "auto" in it could not be filled says so once.
    blocked = [path for path, _ in unresolved]
    notes.problems = [(p, e) for p, e in notes.problems
                      if p in blocked or not any(b.startswith(p + ".") for b in blocked)]
    notes.verdicts = _in_file_order(d, notes.verdicts, set(paths))
    if cfg is not None:
        object.__setattr__(cfg, "auto", dict(resolved))
        object.__setattr__(cfg, "_raw", d)
        object.__setattr__(cfg, "_known", known)
        object.__setattr__(cfg, "_verdicts", tuple(notes.verdicts))
        object.__setattr__(cfg, "_foreign", tuple(notes.foreign))
    return cfg, notes


def _trial(section: Any) -> TrialSpec | None:
    """The trial an ``autotuning`` section asks of this run, as DeepSpeed's engine reads the
    section: ``enabled`` with ``model_info.profile`` and ``model_info_path`` (Ψ at init, then
    the end), or ``enabled`` with ``metric_path`` (profile, then the end); ``None`` for a
    section that asks none (``fzero autotune`` reads the rest)."""
    if not isinstance(section, Mapping) or section.get("enabled") is not True:
        return None
    info = section.get("model_info")
    try:
        if isinstance(info, Mapping) and info.get("profile") is True and section.get("model_info_path"):
            return TrialSpec(mode="model_info", metric_path=section["model_info_path"])
        if section.get("metric_path"):
            return TrialSpec(mode="profile", metric_path=section["metric_path"],
                             start_profile_step=section.get("start_profile_step", 3),
                             end_profile_step=section.get("end_profile_step", 5))
    except ValueError as e:
        raise ValueError(f"{WHERE}: autotuning: {e}") from None
    return None


def _flat_paths(d: Mapping[str, Any], prefix: str = "") -> list[str]:
    out = []
    for key, value in d.items():
        out.append(f"{prefix}{key}")
        if isinstance(value, Mapping):
            out.extend(_flat_paths(value, f"{prefix}{key}."))
    return out


def _in_file_order(d: Mapping[str, Any], verdicts: list, autos: set[str]) -> list:
    """One verdict per key, in the order the file writes them (an ``"auto"`` key keeps its
    ``auto`` verdict, not the ``used`` one of the value it was given)."""
    order = {p: i for i, p in enumerate(_flat_paths(d))}
    seen: dict[str, tuple] = {}
    for v in verdicts:
        path, verdict = v[0], v[1]
        if path in seen and (path in autos and seen[path][1] == "auto" or verdict != "error"):
            continue
        seen[path] = v
    return sorted(seen.values(), key=lambda v: order.get(v[0], len(order)))


def check(cls: type, d: Mapping[str, Any], world_size: int, source: str | None, known: Known | None = None
          ) -> tuple[list[tuple[str, str, str]], list[tuple[str, str]]]:
    """``(verdicts, problems)``: what fzero does with each key of ``d`` read as a ``cls``
    (``Config``): ``(path, verdict, detail)``, and every problem loading it would raise
    (``(path, message)``)."""
    _, notes = _read(cls, d, world_size, source, known or Known())
    return notes.verdicts, [(p, _message(e)) for p, e in notes.problems]


_SAYS = _options.says()


def _used(notes: _Notes, prefix: str, d: Mapping[str, Any], what: Mapping[str, str] | None = None) -> None:
    """Note the verdict of each used key of a section: ``what`` it does, or by default the
    :class:`fzero.CompileOptions` field it decides (:data:`fzero.config._options.OPTIONS`)."""
    for key, value in d.items():
        said = _SAYS.get(prefix + key) if what is None else what.get(key)
        if said is not None:
            notes.verdicts.append((prefix + key, "used", f"{_short(value)} -> {said}"))


def _build(cls: type, d: Mapping[str, Any], world_size: int, source: str | None, notes: _Notes,
           pending: tuple[str, ...]) -> Any:
    """Every section built, each failure noted by its path; the ``Config``, or ``None`` when
    it could not be built."""
    top = _fields("", d, _TOP, notes)

    def build(path: str, make):
        try:
            return make()
        except (ConfigKeyError, NotImplementedError, ValueError, TypeError) as e:
            notes.problem(path, e)
            return None

    if "bf16" in top and "bfloat16" in top:
        notes.problem("bfloat16", ValueError(f"{WHERE}: both 'bf16' and its older name 'bfloat16' are "
                                             "given; keep 'bf16'"))
    kw: dict[str, Any] = {k: top[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                               "gradient_accumulation_steps") if top.get(k) is not None}
    _used(notes, "", kw, dict.fromkeys(kw, "the batch sizes"))

    if top.get("optimizer") is not None:
        sec = build("optimizer", lambda: _section("optimizer", top["optimizer"]))
        sec = sec if sec is None else _fields("optimizer.", sec, {
            "type": _USE, "params": _USE, "legacy_fusion": _noop("an fp16 fused-Adam detail of DeepSpeed")}, notes)
        if sec is not None and "type" not in sec:
            notes.problem("optimizer.type", ValueError(f"{WHERE}: optimizer.type is required (one of "
                                                       f"{', '.join(_CANONICAL.values())})"))
        elif sec is not None:
            params = build("optimizer.params", lambda: _section("optimizer.params", _given_or(sec.get("params"), {})))
            before = len(notes.problems)
            kind = str(sec["type"]).lower()
            if params is not None and kind in _OPTIMIZERS:
                _used(notes, "optimizer.params.", _fields("optimizer.params.", params, _OPTIMIZERS[kind][0], notes),
                      dict.fromkeys(params, f"fzero.optim ({sec['type']})"))
            if params is not None and len(notes.problems) == before:
                kw["optimizer"] = build("optimizer", lambda: OptimizerConfig(type=sec["type"], params=params))
                _used(notes, "optimizer.", {"type": sec["type"]}, {"type": "the optimizer step.init installs"})
    if top.get("scheduler") is not None:
        sec = build("scheduler", lambda: _section("scheduler", top["scheduler"]))
        sec = sec if sec is None else _fields("scheduler.", sec, {"type": _USE, "params": _USE}, notes)
        if sec is not None and "type" not in sec:
            notes.problem("scheduler.type", ValueError(
                f"{WHERE}: scheduler.type is required (one of {', '.join(_SCHEDULERS)})"))
        elif sec is not None:
            params = build("scheduler.params", lambda: _section("scheduler.params", _given_or(sec.get("params"), {})))
            if params is not None:
                kw["scheduler"] = build("scheduler", lambda: SchedulerConfig(type=sec["type"], params=params))
                _used(notes, "scheduler.params.", params, dict.fromkeys(params, f"the {sec['type']} schedule"))

    if "fp16" in top:
        fields = build("fp16", lambda: _fields("fp16.", _section("fp16", top["fp16"]), _FP16, notes))
        if fields is not None:
            _used(notes, "fp16.", fields)
            kw["fp16"] = build("fp16", lambda: FP16Config(**fields))
    bf16_key = "bf16" if "bf16" in top else "bfloat16" if "bfloat16" in top else None
    if bf16_key is not None:
        fields = build(bf16_key, lambda: _fields(f"{bf16_key}.", _section(bf16_key, top[bf16_key]), _BF16, notes))
        if fields is not None:
            # DeepSpeed's older name "bfloat16" says what "bf16" says.
            _used(notes, f"{bf16_key}.", fields, {k: _SAYS[f"bf16.{k}"] for k in fields if f"bf16.{k}" in _SAYS})
            kw["bf16"] = build(bf16_key, lambda: BF16Config(**fields))

    zero = top.get("zero_optimization")
    if isinstance(zero, bool):  # DeepSpeed's legacy form: true is stage 1
        kw["zero_optimization"] = ZeroConfig(stage=1 if zero else 0)
        _used(notes, "", {"zero_optimization": zero}, {"zero_optimization": f"ZeRO stage {int(zero)}"})
    elif zero is not None:
        fields = build("zero_optimization", lambda: _fields("zero_optimization.", _section("zero_optimization", zero),
                                                           _ZERO, notes))
        if fields is not None:
            offload = fields.pop("offload_optimizer", None)
            param = fields.pop("offload_param", None)
            _used(notes, "zero_optimization.", fields)
            if "stage3_max_reuse_distance" in fields:  # DeepSpeed's two names of one knob
                other = fields.pop("stage3_max_reuse_distance")
                if fields.get("max_reuse_distance", other) != other:
                    notes.problem("zero_optimization.stage3_max_reuse_distance", ValueError(
                        f"{WHERE}: zero_optimization.stage3_max_reuse_distance={other!r} and max_reuse_distance="
                        f"{fields['max_reuse_distance']!r} are one setting: write one"))
                fields["max_reuse_distance"] = other
            if offload is not None:  # DeepSpeed's default is None: no offload
                p = "zero_optimization.offload_optimizer"
                offload = build(p, lambda: _fields(p + ".", _section(p, offload), _OFFLOAD_OPTIMIZER, notes))
                if offload is not None:
                    _used(notes, p + ".", offload)
                    fields["offload_optimizer"] = offload.get("device", "none")
                    fields["pin_memory"] = build(p + ".pin_memory",
                                                 lambda: _bool(p + ".pin_memory", offload.get("pin_memory", False)))
            if param is not None:  # stage 3's parameter offload; DeepSpeed's default is None
                q = "zero_optimization.offload_param"
                param = build(q, lambda: _fields(q + ".", _section(q, param), _OFFLOAD_PARAM, notes))
                device = None if param is None else build(q, lambda: offload_device(
                    q + ".device", param.get("device", "none"), stage=fields.get("stage", 0)))
                pin = None if param is None else build(q + ".pin_memory",
                                                       lambda: _bool(q + ".pin_memory", param.get("pin_memory", False)))
                if device is not None and pin is not None:
                    _used(notes, q + ".", param)
                    fields["offload_param"] = device
                    fields["pin_memory"] = bool(fields.get("pin_memory")) or pin  # either section pins
            kw["zero_optimization"] = build("zero_optimization", lambda: ZeroConfig(**fields))
    if top.get("gradient_clipping") is not None:
        kw["gradient_clipping"] = build("gradient_clipping",
                                        lambda: _num("gradient_clipping", top["gradient_clipping"], minimum=0.0))
        _used(notes, "", {"gradient_clipping": top["gradient_clipping"]})
    if top.get("sequence_parallel_size") is not None:
        kw["sequence_parallel_size"] = build("sequence_parallel_size", lambda: _int(
            "sequence_parallel_size", top["sequence_parallel_size"], minimum=1))
        _used(notes, "", {"sequence_parallel_size": top["sequence_parallel_size"]},
              {"sequence_parallel_size": "checked against the mesh's sp axis"})
    pipe = top.get("pipeline")
    if pipe is not None:
        section = build("pipeline", lambda: _fields("pipeline.", _section("pipeline", pipe), _PIPELINE, notes))
        if section is not None:
            stages = section.get("stages", "auto")
            kw["pipeline_stages"] = 0 if stages == "auto" else build(
                "pipeline.stages", lambda: _int("pipeline.stages", stages, minimum=1))
            _used(notes, "pipeline.", {"stages": stages}, {"stages": "checked against the mesh's pp axis"})
    tp = top.get("tensor_parallel")
    if tp is not None:
        section = build("tensor_parallel", lambda: _section("tensor_parallel", tp))
        for key in sorted(set(section or ()) - {"autotp_size"}):
            notes.problem(f"tensor_parallel.{key}", ConfigKeyError(
                f"{WHERE}: tensor_parallel.{key}: fzero reads only tensor_parallel.autotp_size (DeepSpeed's "
                "AutoTP degree)"))
        if section is not None and section.get("autotp_size") is not None:
            kw["autotp_size"] = build("tensor_parallel.autotp_size",
                                      lambda: _int("tensor_parallel.autotp_size", section["autotp_size"], minimum=1))
            _used(notes, "tensor_parallel.", section)
    tuning = top.get("autotuning")
    if tuning is not None:
        trial = build("autotuning", lambda: _trial(tuning))
        if trial is not None:
            kw["trial"] = trial
            _used(notes, "autotuning.", tuning)
            _used(notes, "autotuning.model_info.", tuning.get("model_info") or {})
        elif not any(p == "autotuning" for p, _ in notes.problems):
            notes.verdicts.append(("autotuning", "no effect", "read by `fzero autotune`"))
    logger = top.get("comms_logger")
    if logger is not None:
        section = build("comms_logger", lambda: _fields("comms_logger.", _section("comms_logger", logger),
                                                       _COMMS_LOGGER, notes))
        if section is not None:
            kw["comms_logger"] = build("comms_logger.enabled",
                                       lambda: _bool("comms_logger.enabled", section.get("enabled", False)))
            _used(notes, "comms_logger.", section)
    if top.get("compile") is not None:  # compile(jit=): torch.compile of the model's forward
        section = build("compile", lambda: _fields("compile.", _section("compile", top["compile"]), _COMPILE, notes))
        if section is not None:
            kw["compile"] = build("compile", lambda: _jit(section))
            _used(notes, "compile.", section)
    if top.get("torch_autocast") is not None:  # compile(torch_autocast=): autocast with fp32 weights
        section = build("torch_autocast", lambda: _fields("torch_autocast.", _section("torch_autocast",
                                                                                       top["torch_autocast"]),
                                                          _TORCH_AUTOCAST, notes))
        if section is not None:
            kw["torch_autocast"] = build("torch_autocast", lambda: _autocast(section))
            _used(notes, "torch_autocast.", section)
    # Measuring and logging (fzero.monitor): the timers, memory, FLOPs and the writers.
    for key in ("wall_clock_breakdown", "memory_breakdown"):
        if top.get(key) is not None:
            kw[key] = build(key, lambda key=key: _bool(key, top[key]))
            _used(notes, "", {key: top[key]})
    if top.get("flops_profiler") is not None:
        section = build("flops_profiler", lambda: _fields("flops_profiler.", _section(
            "flops_profiler", top["flops_profiler"]), _FLOPS_PROFILER, notes))
        if section is not None:
            kw["flops_profiler"] = build("flops_profiler.enabled",
                                         lambda: _bool("flops_profiler.enabled", section.get("enabled", False)))
            _used(notes, "flops_profiler.", section)
    for key, rules in _MONITORS.items():
        if top.get(key) is not None:
            section = build(key, lambda key=key, rules=rules: _fields(f"{key}.", _section(key, top[key]), rules, notes))
            if section is not None:
                kw[key] = _frozen(section)
                _used(notes, f"{key}.", section, dict.fromkeys(section, f"the {key} writer (fzero.monitor)"))
    comm = top.get("communication_data_type")
    if comm is not None:
        if not isinstance(comm, str) or comm.lower() not in COMM_DTYPES:
            notes.problem("communication_data_type", ValueError(
                f"{WHERE}: communication_data_type must be one of {', '.join(map(repr, COMM_DTYPES))}, "
                f"got {_short(comm)}"))
        else:
            kw["communication_data_type"] = comm.lower()
            _used(notes, "", {"communication_data_type": comm})
    if top.get("zero_allow_untested_optimizer") is not None:
        kw["zero_allow_untested_optimizer"] = build(
            "zero_allow_untested_optimizer",
            lambda: _bool("zero_allow_untested_optimizer", top["zero_allow_untested_optimizer"]))
        _used(notes, "", {"zero_allow_untested_optimizer": top["zero_allow_untested_optimizer"]},
              {"zero_allow_untested_optimizer": "nothing: fzero's ZeRO runs any client optimizer"})
    if top.get("dataloader_drop_last") is not None:
        kw["dataloader_drop_last"] = build("dataloader_drop_last",
                                           lambda: _bool("dataloader_drop_last", top["dataloader_drop_last"]))
        _used(notes, "", {"dataloader_drop_last": top["dataloader_drop_last"]},
              {"dataloader_drop_last": "fzero.data.DataLoader(config=...)"})
    if top.get("fzero") is not None:  # fzero's own options
        section = build("fzero", lambda: _fields("fzero.", _section("fzero", top["fzero"]), _FZERO, notes))
        if section is not None and section.get("check_replicas") is not None:
            kw["check_replicas"] = build("fzero.check_replicas",
                                         lambda: _int("fzero.check_replicas", section["check_replicas"], minimum=1))
        if section is not None:
            _used(notes, "fzero.", section)
    kw = {k: v for k, v in kw.items() if v is not None}
    return build("", lambda: cls(world_size=world_size, ignored=tuple(notes.ignored),
                                 source=source, pending=pending, **kw))


# DeepSpeed's DtypeEnum spellings of the autocast dtypes.
_AUTOCAST_DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
                    "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16"}


def _autocast(section: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """DeepSpeed's ``torch_autocast`` section as ``compile(torch_autocast=,
    lower_precision_safe_modules=)`` takes it: ``None`` when not enabled, else ``{"dtype":
    "bf16", "lower_precision_safe_modules": (names,) or None}``."""
    # Every value is checked, enabled or not, as DeepSpeed's pydantic model checks them.
    enabled = _bool("torch_autocast.enabled", section.get("enabled", False))
    given = section.get("dtype", "bfloat16")  # DeepSpeed passes None to torch.autocast: bf16 on the CPU
    dtype = _AUTOCAST_DTYPES.get(given.lower()) if isinstance(given, str) else "bf16" if given is None else None
    if dtype is None:
        raise ValueError(f"{WHERE}: torch_autocast.dtype must be one of {', '.join(map(repr, _AUTOCAST_DTYPES))}, "
                         f"got {given!r}")
    modules = section.get("lower_precision_safe_modules")
    if modules is not None and (not isinstance(modules, list) or not all(isinstance(m, str) for m in modules)):
        raise ValueError(f"{WHERE}: torch_autocast.lower_precision_safe_modules must be a list of class paths "
                         f"such as \"torch.nn.Linear\", got {modules!r}")
    if not enabled:
        return None
    if dtype == "fp16":
        raise NotImplementedError(f"{WHERE}: torch_autocast.dtype={given!r}: fp16 autocast (DeepSpeed adds a "
                                  "GradScaler) is not supported; use \"bfloat16\", or the \"fp16\" section")
    if modules is not None:
        from fzero.transforms.mixed_precision._autocast import safe_module_classes

        safe_module_classes(modules, f"{WHERE}: torch_autocast")
        modules = tuple(modules)
    return {"dtype": dtype, "lower_precision_safe_modules": modules}


def _jit(section: Mapping[str, Any]) -> Any:
    """DeepSpeed's ``compile`` section as ``compile(jit=)`` takes it: ``False`` when not
    enabled, ``True`` for torch's default backend, the backend's name, or with ``kwargs``
    a dict of torch.compile's keywords."""
    enabled = _bool("compile.enabled", section.get("enabled", False))
    backend, kwargs = section.get("backend"), section.get("kwargs")
    kwargs = {} if kwargs is None else kwargs
    # Checked enabled or not, as DeepSpeed's pydantic model checks them.
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"{WHERE}: compile.backend must be a string, got {backend!r}")
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"{WHERE}: compile.kwargs must be a dict of torch.compile's keywords, got {kwargs!r}")
    if not enabled:
        return False
    if not kwargs:
        return True if backend is None else backend
    return {**({"backend": backend} if backend is not None else {}), **kwargs}
