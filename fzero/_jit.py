"""``fzero.compile(jit=)``: the model's forward under ``torch.compile``, fzero around it.

The seam is the module call inside :class:`fzero.functional.Apply`: with the parameters
bound into the module's slots (fzero's own ``requires_grad`` leaves, made by
``value_and_grad``), ``module(*args)`` runs compiled. AOTAutograd gives the compiled
forward its compiled backward, and both sit on torch's autograd engine like any other
operation: everything fzero does around the model stays eager Python and composes
unchanged -- the handlers (ZeRO's sink and the gradient hooks on the leaves, mixed
precision's autocast and loss scale, accumulation, clipping), the optimizer and its kernels.

What stays outside the compiled graphs, by graph breaks:

* a dropout that draws a mask (``fzero.rng``'s drawing functions are
  ``torch.compiler.disable``\\ d, so the masks are the eager step's, bit for bit);
* ZeRO-3's module hooks, which gather and free each unit's parameters
  (``torch.compiler.disable``\\ d in ``shard_state/_units.py``): the compiled code is each
  unit's forward between them.

A call made while a ``TorchDispatchMode`` is active (the monitor's FLOP counter on a batch
shape's first step, a user's profiling mode) runs the module eagerly: dynamo, meeting a
dispatch mode, stops compiling that code for the rest of the process, so one counted step
would otherwise leave every later step uncompiled.

One compiled callable per module and :class:`Jit` (one per ``fzero.compile``): its code
is a fresh copy per module, so each module has its own dynamo cache and recompile budget,
kept as long as the step: a new closure in every step (``value_and_grad(lambda
p: ...)``) compiles nothing again. The parameters are graph inputs (dynamo's inlining of
``nn.Module``\\ s guards their shapes and dtypes, not their identity), so new tensors at every
update are the same graph.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fzero import rng

__all__ = ["Jit", "check_jit"]

# torch.compile's keywords a jit= dict may give (the compiled object is fzero's, not a model's).
_KEYWORDS = ("backend", "mode", "options", "dynamic", "fullgraph")


def check_jit(value: Any) -> str | None:
    """Why ``value`` is not a valid ``jit=`` (``None`` if it is)."""
    if isinstance(value, bool) or (isinstance(value, str) and value):
        return None
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        bad = sorted(set(value) - set(_KEYWORDS))
        if not bad:
            return None
        return f"has keys torch.compile does not take here: {bad} (valid: {', '.join(_KEYWORDS)})"
    return ("must be True/False, a torch.compile backend name ('inductor', 'aot_eager', ...) or a dict of "
            f"torch.compile keywords ({', '.join(_KEYWORDS)})")


class Jit:
    """How a step's model forwards are compiled: ``torch.compile``'s keywords, and the
    compiled forward of each module, made at its first call and kept with the module.

    Args:
        option: ``compile(jit=)``'s value: ``True`` (torch's default backend, inductor), a
            backend name, or a dict of ``torch.compile`` keywords.

    Example:
        >>> import torch
        >>> jit = Jit("aot_eager")
        >>> jit.kwargs
        {'backend': 'aot_eager'}
        >>> m = torch.nn.Linear(2, 1)
        >>> jit.forward(m) is jit.forward(m)
        True
        >>> jit.forward(m)(torch.ones(3, 2)).shape
        torch.Size([3, 1])
    """

    def __init__(self, option: bool | str | Mapping[str, Any] = True):
        why = check_jit(option)
        if why is not None or option is False:
            raise ValueError(f"fzero.compile: jit={option!r} " + (why or "asks for no compilation"))
        self.kwargs: dict[str, Any] = ({} if option is True else {"backend": option} if isinstance(option, str)
                                       else dict(option))
        rng.make_opaque()  # drawn dropouts run eagerly inside compiled forwards
        # Held as long as the fzero step that owns this Jit (which holds the model anyway).
        self._forwards: dict[Any, tuple[torch.nn.Module, Callable]] = {}

    def forward(self, module: torch.nn.Module) -> Callable:
        """``module``'s call (hooks and all), compiled; made once per module."""
        held = self._forwards.get(id(module))
        if held is None:
            held = self._forwards[id(module)] = (module, _eager_under_modes(
                torch.compile(_own_code(module), **self.kwargs), module))
        return held[1]

    def compiled_forward(self, module: torch.nn.Module) -> "_Restore":
        """Put ``module.forward`` compiled in place (its hooks stay eager, outside it);
        ``.remove()`` puts the class's back. ZeRO-3 compiles each unit so."""
        held = self._forwards.get(("forward", id(module)))
        if held is None:
            held = self._forwards[("forward", id(module))] = (module, _eager_under_modes(
                torch.compile(module.forward, **self.kwargs), module.forward))
        module.forward = held[1]
        return _Restore(module)

    def __repr__(self) -> str:
        return f"Jit({self.kwargs})"


class _Restore:
    """A handle like a hook's: ``remove()`` gives ``module`` its class's ``forward`` back."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def remove(self) -> None:
        self.module.__dict__.pop("forward", None)


def _eager_under_modes(compiled: Callable, eager: Callable) -> Callable:
    """``compiled``, except while a dispatch mode is active: then ``eager`` (see the module's
    docstring)."""
    def call(*args, **kwargs):
        if torch._C._len_torch_dispatch_stack():
            return eager(*args, **kwargs)
        with rng.compiled_region():
            return compiled(*args, **kwargs)

    return call


def _own_code(module: torch.nn.Module) -> Callable:
    """``module(*args, **kwargs)`` as a function whose code object is its own: dynamo keeps
    its cache, and counts recompilations against its limit, per code object, so two models
    (or one model after many others in a process) never share one budget."""
    def call(*args, **kwargs):
        return module(*args, **kwargs)

    name = f"fzero_jit_{type(module).__name__}"
    code = call.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, call.__globals__, name, None, call.__closure__)
