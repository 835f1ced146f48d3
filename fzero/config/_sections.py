"""The sections of a DeepSpeed config, one keyword-only dataclass each: ``optimizer``,
``scheduler``, ``fp16``, ``bf16`` and ``zero_optimization``.

Each checks its values in ``__post_init__`` (naming the dotted key) and keeps DeepSpeed's
defaults; :class:`OptimizerConfig` and :class:`SchedulerConfig` build the fzero optimizer
and schedule they stand for.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any, Literal

import torch

from fzero import optim
from fzero.config._keys import (
    _CANONICAL,
    _DS_ONLY_OPTIMIZERS,
    _OPTIMIZERS,
    ONEBIT_OPTIMIZERS,
    _SCHEDULERS,
    _USE,
    _check_keys,
)
from fzero.config._values import WHERE, _bool, _frozen, _int, _num, _section
from fzero.optim import GradientTransformation, schedules
from fzero.optim.base import ScalarOrSchedule

__all__ = ["BF16Config", "FP16Config", "OptimizerConfig", "SchedulerConfig", "ZeroConfig"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The ``optimizer`` section: which optimizer, with DeepSpeed's parameter names.

    How DeepSpeed's names map onto :mod:`fzero.optim` (``_configure_basic_optimizer``):
    ``Adam``/``AdamW`` with ``adam_w_mode`` (default true) are :func:`fzero.optim.adamw`
    (decoupled decay, as FusedAdam's AdamW mode); ``Adam`` with ``adam_w_mode: false`` is
    :func:`fzero.optim.adam` (L2 decay); ``Lion`` is :func:`fzero.optim.lion`; ``SGD`` is
    :func:`fzero.optim.sgd`; ``Lamb`` is DeepSpeed's FusedLamb itself,
    :func:`fzero.optim.deepspeed_lamb` (see :meth:`build`). Defaults are DeepSpeed's optimizers' own (weight decay 0, Lion's
    ``betas`` (0.9, 0.999), Lamb's ``eps`` 1e-8), not fzero's. ``bias_correction: false`` on
    ``Adam``/``AdamW`` is :func:`fzero.optim.adam`/:func:`~fzero.optim.adamw` with
    ``bias_correction=False`` (FusedAdam's formula; not fused). ``Adagrad`` is
    :func:`fzero.optim.adagrad` with ``torch.optim.Adagrad``'s defaults (``lr`` 1e-2,
    ``initial_accumulator_value`` 0, ``eps`` 1e-10), what DeepSpeed builds. ``OneBitAdam``,
    ``ZeroOneAdam`` and ``OneBitLamb`` are :func:`fzero.optim.onebit_adam`,
    :func:`~fzero.optim.zero_one_adam` and :func:`~fzero.optim.onebit_lamb` (ZeRO stage 0
    only, as in DeepSpeed).
    """

    type: str
    """DeepSpeed's optimizer name: ``Adam``, ``AdamW``, ``Lamb``, ``Lion``, ``Adagrad``,
    ``OneBitAdam``, ``ZeroOneAdam``, ``OneBitLamb`` (any case, as DeepSpeed lower-cases its
    own names) or ``SGD`` (exact: DeepSpeed looks it up in ``torch.optim``). Stored in the
    canonical spelling."""

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
        if kind not in _OPTIMIZERS and torch_optimizer(self.type) is not None:
            # DeepSpeed's last resort: torch.optim.<type>(params, **params), looked up exactly.
            cls = torch_optimizer(self.type)
            params = _section("optimizer.params", self.params)
            unknown = sorted(set(params) - set(_torch_defaults(cls)))
            if unknown:
                raise ValueError(f"{WHERE}: optimizer.params of torch.optim.{self.type}: unknown "
                                 f"{', '.join('optimizer.params.' + k for k in unknown)} (it takes "
                                 f"{', '.join(_torch_defaults(cls))})")
            object.__setattr__(self, "params", _frozen(params))
            self.build(self.hyperparameters()["lr"])  # checks every value once, here
            return
        if kind not in _OPTIMIZERS:
            if kind in _DS_ONLY_OPTIMIZERS:
                raise NotImplementedError(
                    f"{WHERE}: optimizer.type={self.type!r}: a DeepSpeed optimizer fzero does not "
                    f"implement; fzero implements {', '.join(_CANONICAL.values())}")
            names = list(_CANONICAL.values()) + [n.capitalize() for n in _DS_ONLY_OPTIMIZERS]
            names += ["OnebitAdam", "OnebitLamb"]  # DeepSpeed's class names
            close = difflib.get_close_matches(self.type, names, n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{WHERE}: unknown optimizer.type {self.type!r}{hint} (fzero "
                             f"implements {', '.join(_CANONICAL.values())})")
        object.__setattr__(self, "type", _CANONICAL[kind])
        params = _section("optimizer.params", self.params)
        _check_keys("optimizer.params.", params, _OPTIMIZERS[kind][0], [])
        object.__setattr__(self, "params", _frozen(params))
        # checks every value once, here (the muP types' per-parameter scaling waits for the model)
        self.build(self.hyperparameters()["lr"], infshapes=_CHECK_ONLY if kind in _MUP else None)

    @property
    def kind(self) -> str:
        """The fzero optimizer built: ``"adamw"``, ``"adam"``, ``"lamb"``, ``"lion"``, ``"sgd"``,
        ``"adagrad"``, ``"onebitadam"``, ``"zerooneadam"`` or ``"onebitlamb"``."""
        if self.type in ("Adam", "AdamW"):
            h = self.hyperparameters()
            return "adamw" if self.type == "AdamW" or h["adam_w_mode"] else "adam"
        if self.type.lower() not in _OPTIMIZERS:
            return "torch"  # torch.optim.<type>, by optim.from_torch
        return self.type.lower()

    def hyperparameters(self) -> dict[str, Any]:
        """Every parameter of this optimizer by DeepSpeed's name, defaults filled in."""
        p = "optimizer.params."
        kind = self.type.lower()
        if kind not in _OPTIMIZERS:  # torch.optim.<type>: its own keywords and defaults, checked by torch
            return {**_torch_defaults(torch_optimizer(self.type)), **self.params}
        h = {**_OPTIMIZERS[kind][1], **self.params}
        out: dict[str, Any] = {"lr": _num(p + "lr", h["lr"], minimum=0.0)}
        if "betas" in h:
            b = h["betas"]
            if not (isinstance(b, (list, tuple)) and len(b) == 2):
                raise TypeError(f"{WHERE}: {p}betas must be a list of two numbers [beta1, beta2], got {b!r}")
            out["betas"] = (_num(p + "betas[0]", b[0]), _num(p + "betas[1]", b[1]))
        for name in ("eps", "weight_decay", "momentum", "max_coeff", "min_coeff", "lr_decay",
                     "initial_accumulator_value", "coeff_beta", "factor_max", "factor_min", "factor_threshold"):
            if name in h:
                out[name] = _num(p + name, h[name], minimum=0.0)
        for name in ("freeze_step", "var_freeze_step", "var_update_scaler", "local_step_scaler",
                     "local_step_clipper"):
            if name in h:
                out[name] = _int(p + name, h[name], minimum=0 if "freeze" in name else 1)
        for name in ("adam_w_mode", "torch_adam", "nesterov", "bias_correction", "eps_inside_sqrt", "decoupled_wd"):
            if name in h and (kind not in ONEBIT_OPTIMIZERS or name in self.params):
                out[name] = _bool(p + name, h[name])
        if kind == "muon":
            given = self.params.get("lr")
            for name, default in (("muon_lr", 0.02), ("adam_lr", 3e-4)):
                value = h.get(name, given if given is not None else default)
                out[name] = _num(p + name, value, minimum=0.0)
            if h["ns_method"] not in ("gram", "standard"):
                raise ValueError(f"{WHERE}: {p}ns_method must be 'gram' or 'standard', got {h['ns_method']!r}")
            out["ns_method"] = h["ns_method"]
        if kind in ("adam", "adamw") and out["torch_adam"] and not out["bias_correction"]:
            raise ValueError(f"{WHERE}: {p}bias_correction=false with torch_adam=true: torch.optim.Adam(W) has no "
                             "bias_correction (DeepSpeed fails to build it); drop torch_adam")
        if kind in ("adam", "adamw") and out["torch_adam"] and "weight_decay" not in self.params and (
                kind == "adamw" or out["adam_w_mode"]):
            out["weight_decay"] = 1e-2  # torch.optim.AdamW's default, which DeepSpeed then builds
        if kind in ("lamb", "onebitlamb") and out["min_coeff"] > out["max_coeff"]:
            raise ValueError(f"{WHERE}: {p}min_coeff={out['min_coeff']} is greater than "
                             f"max_coeff={out['max_coeff']}")
        return out

    def build(self, learning_rate: ScalarOrSchedule, *, infshapes: Mapping[str, Any] | None = None
              ) -> GradientTransformation:
        """The fzero optimizer, with ``learning_rate`` (a float or a schedule) as its rate.

        ``Muon`` is DeepSpeed's ``MuonWithAuxAdam``: every 2-D parameter by Muon (torch's and
        DeepSpeed's momentum, ``sqrt(max(1, rows / cols))`` scaling, the Newton-Schulz
        iteration in fp32 as DeepSpeed runs it on a CPU; ``ns_method`` ``"gram"`` and
        ``"standard"`` are the same iteration rearranged, and fzero computes the standard
        one for both), with ``muon_lr`` (else ``lr``, else 0.02), ``momentum`` and
        decoupled ``weight_decay``; every other parameter by AdamW with ``adam_lr`` (else
        ``lr``, else 3e-4), ``betas``, ``eps`` and ``weight_decay``. DeepSpeed asks the
        user to flag each parameter ``use_muon``; fzero takes the 2-D ones. With a
        ``scheduler`` section both groups follow the schedule, as DeepSpeed's schedulers
        set every group's ``lr``.

        ``MuAdam``, ``MuAdamW``, ``MuSGD`` are the ``mup`` package's: ``torch.optim.Adam``,
        ``AdamW``, ``SGD`` (run by :func:`fzero.optim.from_torch`) with per-parameter
        learning rates from each parameter's ``infshape`` (``mup.set_base_shapes``):
        ``infshapes`` maps parameter names to them (``step.init`` reads them from the
        model). Adam: a matrix-like parameter (two infinite dimensions) gets ``lr /
        width_mult`` (and, unless ``decoupled_wd``, ``weight_decay * width_mult``); SGD: a
        vector-like one ``lr * width_mult`` (``weight_decay / width_mult``), a matrix-like
        one ``lr / (fan-in mult / fan-out mult)`` (``weight_decay`` times it).

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
            if kind == "torch":
                given = {k: v for k, v in self.params.items() if k != "lr"}
                return optim.from_torch(torch_optimizer(self.type), lr=learning_rate, **given)
            if kind == "muon":
                muon_lr, adam_lr = (learning_rate, learning_rate) if callable(learning_rate) else \
                    (h["muon_lr"], h["adam_lr"])
                return optim.chain(
                    optim.masked(optim.chain(
                        optim.scale_by_muon(beta=h["momentum"], eps=1e-7, nesterov=True, bias_correction=False),
                        optim.add_decayed_weights(h["weight_decay"]),
                        optim.scale_by_learning_rate(muon_lr)), _matrices, where=f"{WHERE}: optimizer 'Muon'"),
                    optim.masked(optim.adamw(adam_lr, b1, b2, h["eps"], h["weight_decay"]), _not_matrices,
                                 where=f"{WHERE}: optimizer 'Muon'"))
            if kind in _MUP:
                return _mup_optimizer(self.type, kind, learning_rate, h, infshapes)
            if kind == "adamw":
                return optim.adamw(learning_rate, b1, b2, h["eps"], h["weight_decay"],
                                   bias_correction=h["bias_correction"])
            if kind == "adam":
                return optim.adam(learning_rate, b1, b2, h["eps"], h["weight_decay"],
                                  bias_correction=h["bias_correction"])
            if kind == "adagrad":
                return optim.adagrad(learning_rate, h["initial_accumulator_value"], h["eps"],
                                     weight_decay=h["weight_decay"], lr_decay=h["lr_decay"])
            if kind == "onebitadam":
                return optim.onebit_adam(learning_rate, b1, b2, h["eps"], h["weight_decay"],
                                         freeze_step=h["freeze_step"])
            if kind == "zerooneadam":
                return optim.zero_one_adam(learning_rate, b1, b2, h["eps"], h["weight_decay"],
                                           var_freeze_step=h["var_freeze_step"],
                                           var_update_scaler=h["var_update_scaler"],
                                           local_step_scaler=h["local_step_scaler"],
                                           local_step_clipper=h["local_step_clipper"])
            if kind == "onebitlamb":
                return optim.onebit_lamb(learning_rate, b1, b2, h["eps"], h["weight_decay"],
                                         freeze_step=h["freeze_step"], max_coeff=h["max_coeff"],
                                         min_coeff=h["min_coeff"], coeff_beta=h["coeff_beta"],
                                         factor_max=h["factor_max"], factor_min=h["factor_min"],
                                         factor_threshold=h["factor_threshold"])
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


_MUP = ("muadam", "muadamw", "musgd")
# The torch.optim classes DeepSpeed 0.19 runs under ZeRO without zero_allow_untested_optimizer
# (its ZERO_SUPPORTED_OPTIMIZERS, torch's among them).
ZERO_TESTED_TORCH = ("Adam", "AdamW", "Adagrad")


def torch_optimizer(name: Any) -> type | None:
    """``torch.optim.<name>`` if it is an optimizer class (DeepSpeed's lookup: exact), else None."""
    cls = getattr(torch.optim, name, None) if isinstance(name, str) else None
    return cls if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) else None


def _torch_defaults(cls: type) -> dict[str, Any]:
    """The keywords of ``cls(params, ...)`` with their defaults (``lr`` first)."""
    import inspect

    out = {}
    for name, p in inspect.signature(cls.__init__).parameters.items():
        if name in ("self", "params") or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        out[name] = None if p.default is inspect.Parameter.empty else p.default
    return out
_CHECK_ONLY: Mapping[str, Any] = {}  # build()'s infshapes while a section checks its values


def _matrices(params):
    return {k: v.ndim == 2 for k, v in params.items()}


def _not_matrices(params):
    return {k: v.ndim != 2 for k, v in params.items()}


def _mup_optimizer(name: str, kind: str, learning_rate: ScalarOrSchedule, h: dict,
                   infshapes: Mapping[str, Any] | None) -> GradientTransformation:
    """``mup``'s ``MuAdam`` / ``MuAdamW`` / ``MuSGD`` as :func:`fzero.optim.from_torch` over
    ``torch.optim.Adam`` / ``AdamW`` / ``SGD``, one parameter group per width multiplier."""
    if kind == "musgd":
        cls, base = torch.optim.SGD, dict(momentum=h["momentum"], nesterov=h["nesterov"])
    else:
        cls, base = (torch.optim.AdamW if kind == "muadamw" else torch.optim.Adam), dict(betas=h["betas"], eps=h["eps"])
    wd = h["weight_decay"]
    if infshapes is _CHECK_ONLY:
        return optim.from_torch(cls, lr=h["lr"], weight_decay=wd, **base)
    missing = sorted(k for k, v in (infshapes or {}).items() if v is None)
    if not infshapes or missing:
        which = "the model's parameters carry no infshape" if not infshapes or len(missing) == len(infshapes) \
            else f"these parameters have no infshape: {missing}"
        raise ValueError(
            f"optimizer.type={name!r} scales each parameter's learning rate by the width multipliers of its "
            f"infshape (set by mup.set_base_shapes(model, base_shapes)), and {which}: call mup.set_base_shapes on "
            f"the model before fzero.functionalize, or use 'Adam'/'AdamW'/'SGD'")
    # (lr factor, weight-decay factor) of each parameter, as mup's optimizers group them
    factors: dict[str, tuple[float, float]] = {}
    for key, shape in infshapes.items():
        ninf = shape.ninf()
        if ninf > 2:
            raise NotImplementedError(f"optimizer.type={name!r}: parameter {key!r} has {ninf} infinite "
                                      f"dimensions (mup supports at most 2)")
        if kind == "musgd":
            m = shape.width_mult() if ninf == 1 else (1.0 / shape.fanin_fanout_mult_ratio() if ninf == 2 else 1.0)
        else:
            m = 1.0 / shape.width_mult() if ninf == 2 else 1.0
        factors[key] = (m, 1.0 if h["decoupled_wd"] else 1.0 / m)
    groups = []
    for f in sorted(set(factors.values())):
        if f == (1.0, 1.0):
            continue
        names = frozenset(k for k, v in factors.items() if v == f)
        lr = (lambda c, fn=learning_rate, m=f[0]: fn(c) * m) if callable(learning_rate) else learning_rate * f[0]
        groups.append({"mask": lambda p, names=names: {k: k in names for k in p}, "lr": lr, "weight_decay": wd * f[1]})
    return optim.from_torch(cls, lr=learning_rate, weight_decay=wd, param_groups=groups, **base)


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
    """Compute in fp16 (``fzero.compile(dtype="fp16")``)."""

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
    """Compute in bf16 (``fzero.compile(dtype="bf16")``), fp32 master weights, no scaler."""

    check_grad_overflow: bool = True
    """Skip an update whose gradients are not finite (``fzero.compile(check_grad_overflow=)``);
    DeepSpeed 0.19's ``DeepSpeedBF16Config`` default, true."""

    bf16_master_weights_and_grads: bool = False
    """Keep the master weights (and gradients) in bf16, no fp32 copy
    (``fzero.compile(master_weights="bf16")``). DeepSpeed 0.19 takes it at ZeRO stages 1-3
    only, and so does a config here."""

    bf16_optimizer_states: bool = False
    """Keep the optimizer's moments in bf16 (``fzero.compile(optimizer_states="bf16")``);
    needs ``bf16_master_weights_and_grads``, as in DeepSpeed."""

    def __post_init__(self) -> None:
        p = "bf16."
        _bool(p + "enabled", self.enabled)
        for name in ("check_grad_overflow", "bf16_master_weights_and_grads", "bf16_optimizer_states"):
            object.__setattr__(self, name, _bool(p + name, getattr(self, name)))
        if self.bf16_optimizer_states and not self.bf16_master_weights_and_grads:
            raise ValueError(f"{WHERE}: bf16.bf16_optimizer_states needs bf16.bf16_master_weights_and_grads "
                             "(DeepSpeed refuses it alone too)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """The ``zero_optimization`` section. ``true`` means stage 1 and ``false`` stage 0, as
    DeepSpeed reads that legacy boolean form (``read_zero_config_deprecated``)."""

    stage: int = 0
    """ZeRO stage 0-3 over the mesh's ``dp`` axis (``fzero.compile(zero=...)``)."""

    reduce_bucket_size: int | None = None
    """Gradient elements reduced per bucket, DeepSpeed's unit (fzero's ``bucket_bytes`` is in
    bytes: elements times 4, or 2 with a 16-bit ``communication_data_type``). ``None``, when
    not written, keeps fzero's default bucket (25 MiB or the whole model when smaller; at
    stage 3 1/32 of the model's trainable bytes, at most 25 MiB, at least 64 KiB) rather
    than DeepSpeed's 5e8 elements; a written value is used as it is."""

    overlap_comm: bool | None = None
    """Overlap gradient reduction with backward; ``None`` when not written (fzero overlaps)."""

    max_reuse_distance: float | None = None
    """``stage3_max_reuse_distance`` (or ``max_reuse_distance``): ZeRO-3 units whose reuse
    distance, in elements, is at most this stay gathered from forward to backward
    (``fzero.compile(max_reuse_distance=)``); ``None`` when not written (fzero's default, 25
    MiB of parameters' worth, rather than DeepSpeed's 1e9 elements)."""

    offload_optimizer: Literal["none", "cpu"] | None = None
    """``offload_optimizer.device``: ``"cpu"`` keeps the masters and optimizer state on the
    host (``fzero.compile(offload_optimizer="cpu")``, stages 1-3); ``None`` when the config
    has no ``offload_optimizer``. ``"nvme"`` is refused: NVMe offload is not supported."""

    offload_param: Literal["none", "cpu"] | None = None
    """``offload_param.device``: ``"cpu"`` keeps this rank's pieces of the parameters on the
    host (``fzero.compile(offload_param="cpu")``, stage 3 only); ``None`` when the config has
    no ``offload_param``. ``"nvme"`` is refused: NVMe offload is not supported."""

    pin_memory: bool = False
    """``offload_optimizer.pin_memory`` or ``offload_param.pin_memory`` (either section asking
    pins fzero's host buffers): page-lock the host buffers (``fzero.compile(pin_memory=)``)."""

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
        if self.max_reuse_distance is not None:
            object.__setattr__(self, "max_reuse_distance",
                               _num(p + "stage3_max_reuse_distance", self.max_reuse_distance, minimum=0.0))
        if self.offload_optimizer is not None:
            key = p + "offload_optimizer.device"
            device = offload_device(key, self.offload_optimizer)
            if device == "cpu" and self.stage == 0:
                raise ValueError(f"{WHERE}: {key}=\"cpu\" needs {p}stage 1, 2 or 3 (DeepSpeed's ZeRO-Offload "
                                 "offloads the partitioned optimizer state); got stage 0")
            object.__setattr__(self, "offload_optimizer", device)
        if self.offload_param is not None:
            object.__setattr__(self, "offload_param", offload_device(p + "offload_param.device", self.offload_param,
                                                                     stage=self.stage))
        _bool(p + "offload_optimizer.pin_memory", self.pin_memory)


def offload_device(key: str, value: Any, *, stage: int | None = None) -> str:
    """``value`` of an offload section's ``device`` key, lower-cased: ``"none"`` or
    ``"cpu"``; with ``stage`` (``offload_param``), ``"cpu"`` only at stage 3, as DeepSpeed.

    Raises:
        NotImplementedError: ``"nvme"`` (NVMe offload is not supported).
        ValueError: another device, or ``offload_param`` at a stage other than 3.
    """
    device = str(value).lower()
    if device == "nvme":
        raise NotImplementedError(f"{WHERE}: {key}={value!r}: NVMe offload is not supported; use \"cpu\" (host "
                                  "memory) or \"none\"")
    if device not in ("none", "cpu"):
        raise ValueError(f"{WHERE}: {key} must be \"none\", \"cpu\" or \"nvme\", got {value!r}")
    if stage is not None and device == "cpu" and stage != 3:
        raise ValueError(f"{WHERE}: {key}=\"cpu\" needs zero_optimization.stage 3 (parameter offload moves the "
                         f"partitioned parameters, which only stage 3 has, as in DeepSpeed); got stage {stage}")
    return device
