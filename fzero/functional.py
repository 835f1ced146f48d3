"""Pure models and their gradients: ``functionalize``, ``value_and_grad``, ``grad``, ``remat``.

``value_and_grad`` keeps JAX's pure interface -- a function of a params pytree in, the
value and a gradient pytree of the same structure out -- but runs on torch's autograd
engine (``torch.autograd.grad`` over fresh ``requires_grad`` leaves), not on
``torch.func.grad``. The engine is what activation checkpointing, saved-tensor hooks and
per-leaf gradient hooks need, and those are what ``remat``, ZeRO-3's re-gathering and
overlapped gradient reduction stand on (``torch.func.grad`` refuses saved-tensor hooks).

``value_and_grad`` is also a *primitive*: under a transform, the transform's handler sees
each call and may cast, gather or reduce (see :mod:`fzero.transforms._core`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils.checkpoint
from torch.func import functional_call

from fzero import tree
from fzero.transforms._core import bind, register_primitive

__all__ = ["functionalize", "value_and_grad", "grad", "remat"]


# --------------------------------------------------------------------------- functionalize


class Apply:
    """The pure apply function of a module: ``apply(params, *args, **kwargs)``.

    It holds the module (for its code and buffers) and calls
    ``torch.func.functional_call`` with the given parameters and the module's buffers.
    Parameters are checked strictly: a missing or an unexpected key is an error naming it.
    """

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.param_names = tuple(name for name, _ in module.named_parameters())
        self._names = frozenset(self.param_names)

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        return dict(self.module.named_buffers())

    def __call__(self, params: dict[str, torch.Tensor], *args, **kwargs):
        if not isinstance(params, dict):
            raise TypeError(
                f"fzero apply ({type(self.module).__name__}): params must be a dict of "
                f"named_parameters() keys, got {type(params).__name__}"
            )
        if params.keys() != self._names:
            self._key_error(params)
        return functional_call(
            self.module, {**params, **self.buffers}, args, kwargs, strict=True, tie_weights=True
        )

    def _key_error(self, params):
        got = set(params)
        missing = sorted(self._names - got)
        extra = sorted(got - self._names)
        msg = [f"fzero apply ({type(self.module).__name__}): params do not match the module's parameters."]
        if missing:
            msg.append(f"  missing: {missing}")
        if extra:
            msg.append(f"  unexpected: {extra}")
        raise KeyError("\n".join(msg))

    def __repr__(self) -> str:
        return f"<fzero apply of {type(self.module).__name__}>"

    # Two Apply objects of one module are the same static pytree metadata.
    def __eq__(self, other):
        return isinstance(other, Apply) and other.module is self.module

    def __hash__(self):
        return id(self.module)


def functionalize(module: torch.nn.Module) -> tuple[Apply, dict[str, torch.Tensor]]:
    """Split a module into a pure function and its parameters.

    Args:
        module: any ``torch.nn.Module``.

    Returns:
        ``(apply, params)``: ``params`` is a dict keyed by ``named_parameters()`` names
        (tied weights appear once, under their first name, and stay tied), holding detached
        tensors that share storage with the module's parameters (no copy is made);
        ``apply(params, *args, **kwargs)`` calls the module's forward with those
        parameters and the module's buffers, and returns whatever the module returns
        (tensors, tuples, dicts, dataclass outputs).

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.

    Example:
        >>> import torch, fzero
        >>> apply, params = fzero.functionalize(torch.nn.Linear(3, 2))
        >>> sorted(params)
        ['bias', 'weight']
        >>> apply(params, torch.ones(4, 3)).shape
        torch.Size([4, 2])
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"fzero.functionalize: expected a torch.nn.Module, got {type(module).__name__}")
    params = {name: p.detach() for name, p in module.named_parameters()}
    return Apply(module), params


# --------------------------------------------------------------------------- value_and_grad


def _differentiable(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


@register_primitive("value_and_grad")
def _value_and_grad_base(fn, params, args, kwargs, *, has_aux: bool, grad_sink=None):
    """The plain implementation: differentiate ``fn`` at ``params`` on the autograd engine.

    ``grad_sink`` (used by transforms that reduce gradients while backward runs) receives
    each leaf's gradient the moment it is complete -- ``grad_sink.on_grad(i, g)``, with
    ``i`` the leaf's index in flatten order -- and the gradient is then dropped, so only
    what the sink keeps stays resident; ``grad_sink.finish()`` returns the gradient leaves.
    """
    leaves, spec = tree.flatten(params)
    inputs = [x.detach().requires_grad_(True) if _differentiable(x) else x for x in leaves]
    with torch.enable_grad():
        out = fn(tree.unflatten(spec, inputs), *args, **kwargs)
        value, aux = _split_output(out, has_aux)
    wrt = [i for i, x in enumerate(inputs) if _differentiable(x)]
    if grad_sink is not None:
        out_leaves = _backward_into(grad_sink, value, inputs, wrt)
    else:
        grads = [None] * len(wrt)
        if value.requires_grad and wrt:
            grads = list(torch.autograd.grad(value, [inputs[i] for i in wrt], allow_unused=True))
        by_index = dict(zip(wrt, grads))
        out_leaves = [by_index.get(i) for i in range(len(inputs))]
        out_leaves = [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, out_leaves)]
    value = value.detach()
    if has_aux:
        aux = tree.map(lambda a: a.detach() if isinstance(a, torch.Tensor) else a, aux)
        return (value, aux), tree.unflatten(spec, out_leaves)
    return value, tree.unflatten(spec, out_leaves)


def _backward_into(sink, value, inputs, wrt):
    handles = []
    for i in wrt:
        def hook(leaf, i=i):
            g = leaf.grad
            leaf.grad = None  # the sink decides what stays resident
            sink.on_grad(i, g)

        handles.append(inputs[i].register_post_accumulate_grad_hook(hook))
    try:
        if value.requires_grad and wrt:
            torch.autograd.backward(value, inputs=[inputs[i] for i in wrt])
    finally:
        for h in handles:
            h.remove()
    return sink.finish()


def _split_output(out, has_aux: bool):
    if has_aux:
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError(
                "fzero.value_and_grad: with has_aux=True, fn must return a pair (value, aux), "
                f"got {type(out).__name__}" + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else "")
            )
        value, aux = out
    else:
        value, aux = out, None
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
        what = (
            f"a {value.dtype} tensor of shape {tuple(value.shape)}"
            if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        hint = " (use has_aux=True to return (loss, aux))" if isinstance(value, (tuple, list)) else ""
        raise TypeError(f"fzero.value_and_grad: fn must return a floating-point scalar tensor, got {what}{hint}")
    return value.reshape(()), aux


def value_and_grad(fn: Callable, argnums: int | Sequence[int] = 0, *, has_aux: bool = False) -> Callable:
    """Value and gradient of a pure scalar function of a pytree of tensors.

    Args:
        fn: ``fn(params, *args, **kwargs) -> loss`` (or ``(loss, aux)`` with ``has_aux``);
            ``loss`` a floating-point scalar tensor.
        argnums: which positional argument(s) to differentiate; an int, or a tuple (the
            gradient is then a tuple of pytrees).
        has_aux: ``fn`` returns ``(loss, aux)``; aux is returned detached.

    Returns:
        A function with ``fn``'s signature returning ``(loss, grads)``, or
        ``((loss, aux), grads)`` with ``has_aux``, as ``jax.value_and_grad``. ``grads`` has
        the structure of the differentiated argument; leaves that do not influence the loss
        get zeros.

    Raises:
        TypeError: ``fn`` did not return a scalar (or a pair with ``has_aux``).

    Example:
        >>> import torch, fzero
        >>> f = lambda p: (p["w"] ** 2).sum()
        >>> loss, g = fzero.value_and_grad(f)({"w": torch.tensor([1.0, 2.0])})
        >>> loss.item(), g["w"].tolist()
        (5.0, [2.0, 4.0])
    """
    single = isinstance(argnums, int)
    nums = (argnums,) if single else tuple(argnums)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if max(nums) >= len(args):
            raise TypeError(
                f"fzero.value_and_grad: argnums={argnums} but {getattr(fn, '__name__', 'fn')} "
                f"was called with {len(args)} positional argument(s)"
            )
        diff = args[nums[0]] if single else tuple(args[i] for i in nums)
        rest = [a for i, a in enumerate(args) if i not in nums]

        def call(d, *rest_args, **kw):
            full, r = [], iter(rest_args)
            ds = (d,) if single else d
            for i in range(len(args)):
                full.append(ds[nums.index(i)] if i in nums else next(r))
            return fn(*full, **kw)

        return bind("value_and_grad", call, diff, tuple(rest), kwargs, has_aux=has_aux)

    return wrapped


def grad(fn: Callable, argnums: int | Sequence[int] = 0, *, has_aux: bool = False) -> Callable:
    """Gradient of a pure scalar function; returns ``grads`` or ``(grads, aux)``, as ``jax.grad``.

    Example:
        >>> import torch, fzero
        >>> fzero.grad(lambda w: (3 * w).sum())(torch.ones(2)).tolist()
        [3.0, 3.0]
    """
    vg = value_and_grad(fn, argnums, has_aux=has_aux)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        out, g = vg(*args, **kwargs)
        return (g, out[1]) if has_aux else g

    return wrapped


def remat(fn: Callable) -> Callable:
    """Activation checkpointing of a pure function, as ``jax.checkpoint``.

    The forward keeps only ``fn``'s inputs; the backward runs ``fn`` again to rebuild its
    activations (torch's non-reentrant checkpoint, with the RNG state restored so dropout
    draws the same mask). Use it on a block of a model, inside the loss function.

    Example:
        >>> import torch, fzero
        >>> block = fzero.remat(lambda x, w: torch.tanh(x @ w))
        >>> g = fzero.grad(lambda w: block(torch.ones(2, 2), w).sum())(torch.eye(2))
        >>> tuple(g.shape)
        (2, 2)
    """

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, **kwargs)

    return wrapped
