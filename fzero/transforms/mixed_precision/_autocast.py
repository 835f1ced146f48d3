"""``torch_autocast``: the forward under ``torch.autocast`` with fp32 weights, as DeepSpeed
0.19's ``torch_autocast`` config section runs it (``deepspeed/runtime/torch_autocast.py``).

No low-precision copy of any weight is kept: the parameters, their gradients, the optimizer
and its state stay fp32, and autocast casts each op's inputs as it runs (matmuls in bf16,
norms and reductions in fp32, per torch's autocast op lists). What DeepSpeed's
``lower_precision_safe_modules`` decides is not which modules compute in low precision (the
whole forward runs under autocast) but the dtype their parameters' gradients are reduced in
across data-parallel ranks: a parameter of a module whose class is listed (default:
``torch.nn.Linear``, ``Conv1d``, ``Conv2d``, ``Conv3d``; the class itself, not its subclasses)
gets ``comm_dtype`` = the autocast dtype, and DeepSpeed's ZeRO optimizers (stages 1-3) copy
its gradient into a bucket of that dtype, reduce it there and copy the mean back into the
fp32 gradient; every other gradient is reduced in fp32. Without ZeRO (stage 0) DeepSpeed's
engine all-reduces every gradient in its communication dtype (fp32 here).

``round_grads=True`` (``fzero.compile`` sets it at ZeRO stages 1-3) gives those gradients the
values DeepSpeed's low-precision reduction gives: each rank's gradient rounded to the dtype,
the mean (fzero reduces in fp32: a sum of two bf16 values is exact in fp32, and halving is
exact) rounded to the dtype again. On two ranks that is DeepSpeed's bf16 sum bit for bit;
on more ranks it differs by the order of the bf16 additions. The bytes on the wire stay
fp32 (``communication_data_type`` halves them for every gradient).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from fzero._params import with_values
from fzero.core import Handler, Step, as_step, installed
from fzero.transforms._deferred import is_deferred
from fzero.transforms.mixed_precision._transform import next_device
from fzero.transforms.shard_state import is_shard

__all__ = ["DEFAULT_SAFE_MODULES", "safe_module_classes", "torch_autocast"]

WHERE = "fzero.torch_autocast"
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "torch.bfloat16": torch.bfloat16}
# DeepSpeed 0.19's LOWER_PRECISION_SAFE_MODULES.
DEFAULT_SAFE_MODULES = ("torch.nn.Linear", "torch.nn.Conv1d", "torch.nn.Conv2d", "torch.nn.Conv3d")


def safe_module_classes(names: Sequence[str], where: str = WHERE) -> tuple[type, ...]:
    """The classes ``names`` (``"package.module.Class"``) import to, as DeepSpeed imports them.

    Raises:
        ValueError: every name that is not a string, does not import or is not an
            ``nn.Module`` subclass, all at once.

    Example:
        >>> safe_module_classes(["torch.nn.Linear", "torch.nn.modules.conv.Conv2d"])
        (<class 'torch.nn.modules.linear.Linear'>, <class 'torch.nn.modules.conv.Conv2d'>)
    """
    if isinstance(names, str) or not isinstance(names, Sequence):
        raise ValueError(f"{where}: lower_precision_safe_modules must be a list of class paths such as "
                         f"'torch.nn.Linear', got {names!r}")
    out, bad = [], []
    for name in names:
        if not isinstance(name, str) or "." not in name:
            bad.append(f"{name!r} is not a 'package.Class' path")
            continue
        package, cls_name = name.rsplit(".", 1)
        try:
            cls = getattr(importlib.import_module(package), cls_name)
        except (ImportError, AttributeError) as e:
            bad.append(f"{name!r} does not import ({type(e).__name__}: {e})")
            continue
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
            bad.append(f"{name!r} is not an nn.Module class")
            continue
        out.append(cls)
    if bad:
        raise ValueError(f"{where}: lower_precision_safe_modules: " + "; ".join(bad))
    return tuple(out)


def _rounding_leaf(low: frozenset, dtype: torch.dtype):
    """``value_and_grad``'s ``leaf``: each differentiated leaf, those named in ``low`` with a
    hook that rounds their gradient to ``dtype`` and back before it is accumulated: a rank's
    gradient as it enters a low-precision reduction bucket. A hook on the leaf itself, not an
    alias made in the forward (whose backward the engine would run last, holding those
    gradients, and ZeRO's reduction, until backward was done); made per call, so no hook
    outlives the call."""

    def leaf(x: torch.Tensor, name: str | None) -> torch.Tensor:
        out = x.detach().requires_grad_(True)
        if name in low:
            out.register_hook(lambda g: g.to(dtype).to(g.dtype))
        return out

    return leaf


def _round(x, dtype):
    """A reduced gradient (a tensor, or a ZeRO piece) rounded to ``dtype`` and back; a
    placeholder of a micro-batch whose sum is reduced later (``accumulate``) as it is: the
    last micro-batch's gradient carries the sum."""
    if is_shard(x):
        return type(x)(_round(x.local, dtype), x.info)
    return x.to(dtype).to(x.dtype) if isinstance(x, torch.Tensor) and not is_deferred(x) else x


class _AutocastHandler(Handler):
    def __init__(self, dtype: torch.dtype, classes: tuple[type, ...], round_grads: bool):
        self.dtype, self.classes, self.round_grads = dtype, classes, round_grads
        self.low: frozenset[str] = frozenset()  # parameters of the listed modules, by name

    def value_and_grad(self, fn, params, args, kwargs, *, next, **options):
        dtype, low = self.dtype, self.low if self.round_grads else frozenset()
        by_name = isinstance(params, dict)
        if low and by_name:
            options.setdefault("leaf", _rounding_leaf(low, dtype))
        value, grads = next(self._autocast(fn), params, args, kwargs, **options)
        if low and by_name and isinstance(grads, dict):
            grads = with_values(grads, {name: _round(grads[name], dtype) for name in low & grads.keys()
                                        if grads[name] is not None})
        return value, grads

    def forward(self, fn, params, args, kwargs, *, next):
        # An evaluation inside the step runs under the training forward's autocast (no
        # gradient to round).
        return next(self._autocast(fn), params, args, kwargs)

    def _autocast(self, fn):
        """``fn`` under autocast."""
        dtype = self.dtype

        @functools.wraps(fn)
        def autocast(p, *a, **kw):
            with torch.autocast(device_type=next_device(p), dtype=dtype):
                return fn(p, *a, **kw)

        return autocast

    def find(self, state) -> None:
        """The names of the parameters whose modules' classes are listed (direct parameters
        of such a module, as DeepSpeed sets ``comm_dtype`` on ``parameters(recurse=False)``)."""
        module = getattr(state.apply_fn, "module", None)
        if not isinstance(module, torch.nn.Module):
            if self.round_grads and self.classes:
                raise TypeError(f"{WHERE}: lower_precision_safe_modules needs the state's apply_fn from "
                                "fzero.functionalize(module) (its module's classes say which gradients are "
                                "reduced in low precision)")
            return
        names = set()
        for prefix, m in module.named_modules(remove_duplicate=False):
            if type(m) in self.classes:
                names.update(f"{prefix}.{n}" if prefix else n for n, _ in m.named_parameters(recurse=False))
        self.low = frozenset(names & set(state.params))


def torch_autocast(
    step: Callable,
    dtype: Literal["bf16"] = "bf16",
    *,
    lower_precision_safe_modules: Sequence[str] | None = None,
    round_grads: bool = False,
) -> Step:
    """Run the model's forward under ``torch.autocast(dtype)`` with fp32 weights (DeepSpeed's
    ``torch_autocast`` section): no low-precision copy of the weights; gradients, optimizer and
    its state stay fp32.

    Args:
        step: ``train_step(state, batch) -> (state, metrics)``.
        dtype: the autocast dtype; ``"bf16"`` (DeepSpeed's ``"bfloat16"``). fp16 autocast
            needs a gradient scaler and is not supported here (use ``mixed_precision``'s
            fp16).
        lower_precision_safe_modules: class paths (``"torch.nn.Linear"``) whose modules'
            parameters have their gradients reduced in ``dtype`` under ZeRO 1-3, as DeepSpeed
            reads this key; ``None``: DeepSpeed's default, Linear and Conv1d/2d/3d.
        round_grads: give those gradients the values a reduction in ``dtype`` gives (each
            rank's rounded to ``dtype``, the mean rounded again); ``fzero.compile`` sets it
            at ZeRO stages 1-3, where DeepSpeed reduces them so.

    Returns:
        A :class:`Step`.

    Raises:
        ValueError: another ``dtype``, or ``lower_precision_safe_modules`` naming a class
            that does not import (every such name at once).

    Example:
        >>> import torch, fzero
        >>> from fzero import optim
        >>> apply, params = fzero.functionalize(torch.nn.Linear(2, 1))
        >>> state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
        >>> def train_step(state, batch):
        ...     def loss_fn(p):
        ...         y = state.apply_fn(p, batch)  # the Linear computes in bf16
        ...         return y.float().pow(2).mean(), y.dtype
        ...     (loss, dtype), g = fzero.value_and_grad(loss_fn, has_aux=True)(state.params)
        ...     return state.apply_gradients(g), {"loss": loss, "dtype": dtype}
        >>> step = fzero.torch_autocast(train_step)
        >>> state = step.init(state)
        >>> state, metrics = step(state, torch.ones(4, 2))
        >>> metrics["dtype"], state.params["weight"].dtype  # fp32 weights, no copies
        (torch.bfloat16, torch.float32)
    """
    if dtype not in DTYPES:
        raise ValueError(f"{WHERE}: dtype={dtype!r} must be 'bf16' (fp16 autocast needs a gradient scaler: "
                         "use fzero.mixed_precision(step, 'fp16'))")
    if not isinstance(round_grads, bool):
        raise ValueError(f"{WHERE}: round_grads={round_grads!r} must be True or False")
    classes = safe_module_classes(DEFAULT_SAFE_MODULES if lower_precision_safe_modules is None
                                  else lower_precision_safe_modules)
    inner = as_step(step)
    handler = _AutocastHandler(DTYPES[dtype], classes, round_grads)

    def before(state):
        handler.find(state)
        return state

    def call(state, batch):
        with installed(handler):
            return inner(state, batch)

    return Step(call, before=before, name=f"torch_autocast({inner.__name__}, {dtype})", inner=inner)
