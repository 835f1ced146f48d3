"""Pure models and their gradients: ``functionalize``, ``value_and_grad``, ``grad``, ``remat``.

``value_and_grad`` keeps JAX's pure interface -- a function of a params pytree in, the
value and a gradient pytree of the same structure out -- but runs on torch's autograd
engine (``torch.autograd.grad`` over fresh ``requires_grad`` leaves), not on
``torch.func.grad``. The engine is what activation checkpointing, saved-tensor hooks and
per-leaf gradient hooks need, and those are what ``remat``, ZeRO-3's re-gathering and
overlapped gradient reduction stand on (``torch.func.grad`` refuses saved-tensor hooks).

``value_and_grad`` is also a *primitive*: under a transform, the transform's handler sees
each call and may cast, gather or reduce (see :mod:`fzero.core`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.utils.parametrize
import torch.utils.checkpoint
from torch.nn.utils.stateless import _reparametrize_module

from fzero import means, tree
from fzero._params import Params
from fzero.core import _BINDINGS, bind, context, handlers, loss_scale

__all__ = ["functionalize", "value_and_grad", "grad", "remat", "load_into", "loss_scale"]


# --------------------------------------------------------------------------- functionalize


class Apply:
    """The pure apply function of a module: ``apply(params, *args, **kwargs)``.

    It holds the module (for its code) and runs its forward with the given parameters and
    the buffers: the module's own, or those of the :class:`fzero.TrainState` it belongs to
    (``state.apply_fn`` is bound to ``state.buffers``; a forward that updates a buffer in
    place, as BatchNorm does, updates the state's). Parameters are checked strictly: a
    missing or an unexpected key is an error naming it.

    Inside :func:`fzero.value_and_grad` the module keeps the parameters it was called with
    until the gradient has been computed, not only for the forward: a recomputation in
    backward (``fzero.remat`` or ``torch.utils.checkpoint`` inside the model, as Hugging
    Face's gradient checkpointing does) then runs with the same parameters as the forward.
    ``torch.func.functional_call`` restores the module's own tensors on exit, which made
    such a recomputation use stale (or, at ZeRO-3, absent) weights.
    """

    def __init__(self, module: torch.nn.Module, buffers: dict[str, torch.Tensor] | None = None):
        self.module = module
        self.param_names = tuple(name for name, _ in module.named_parameters())
        self._names = frozenset(self.param_names)
        self._buffers = buffers

    @property
    def buffers(self) -> dict[str, torch.Tensor]:
        """The buffers the forward runs with."""
        if self._buffers is not None:
            return self._buffers
        slots = _slots(self.module)
        if slots is not None and slots.keys() == self._names:  # no buffer: no walk of the modules
            return {}
        return dict(self.module.named_buffers())

    def with_buffers(self, buffers: dict[str, torch.Tensor] | None) -> "Apply":
        """This apply running with ``buffers`` instead of the module's own."""
        out = object.__new__(Apply)
        out.module, out.param_names, out._names, out._buffers = self.module, self.param_names, self._names, buffers
        return out

    def __call__(self, params: dict[str, torch.Tensor], *args, **kwargs):
        if not isinstance(params, dict):
            raise TypeError(
                f"fzero apply ({type(self.module).__name__}): params must be a dict of "
                f"named_parameters() keys, got {type(params).__name__}"
            )
        if params.keys() != self._names:
            self._key_error(params)
        bindings = _BINDINGS.get()
        if bindings is None:
            if handlers():
                # Inside a transformed step, outside value_and_grad (an evaluation): the
                # transforms see the call as the primitive "forward" (ZeRO-3 gathers its
                # units a block at a time, mixed precision runs it under autocast).
                return bind("forward", self._forward, params, args, kwargs)
            return self._forward(params, *args, **kwargs)
        # Under value_and_grad: released when its backward is done (LIFO, so a nested or
        # repeated call restores correctly).
        bindings.enter_context(self._bound({**params, **self.buffers}))
        return self._module_call()(*args, **kwargs)

    def _forward(self, params: dict[str, torch.Tensor], *args, **kwargs):
        with self._bound({**params, **self.buffers}):
            return self._module_call()(*args, **kwargs)

    def _module_call(self) -> Callable:
        """The module's call: under compile(jit=), compiled, with the tensors bound as here
        (fzero/_jit.py); the binding itself stays eager."""
        jit = context().jit
        return self.module if jit is None else jit.forward(self.module)

    def _bound(self, tensors: dict[str, torch.Tensor]):
        """The module running with ``tensors`` (parameters and buffers by name; a tied
        alias follows its name), restored on exit."""
        slots = _slots(self.module)
        if slots is None or tensors.keys() != slots.keys():  # parametrized modules, new buffers: torch's way
            return _reparametrize_module(self.module, tensors, tie_weights=True, strict=True)
        return _Bound(slots, tensors)

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

    # Two Apply objects of one module are the same static pytree metadata (whichever
    # buffers they are bound to: buffers are state, not structure).
    def __eq__(self, other):
        return isinstance(other, Apply) and other.module is self.module

    def __hash__(self):
        return id(self.module)


# Where each parameter and buffer of a module is held: ``name -> [(owner's dict, key), ...]``,
# one entry per alias of a tied tensor. Computed once per module: torch's own
# ``functional_call`` walks every submodule and re-derives the ties on each call (in a
# profile of a small GPT's step, as much Python as its optimizer update).
_SLOTS: "weakref.WeakKeyDictionary[torch.nn.Module, dict | None]" = weakref.WeakKeyDictionary()


def _slots(module: torch.nn.Module) -> dict[str, list[tuple[dict, str]]] | None:
    if module in _SLOTS:
        return _SLOTS[module]
    slots: dict[str, list[tuple[dict, str]]] | None = {}
    first: dict[int, str] = {}
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        if torch.nn.utils.parametrize.is_parametrized(mod):
            slots = None
            break
        prefix = mod_name + "." if mod_name else ""
        for store in (mod._parameters, mod._buffers):
            for key, t in store.items():
                if t is None:
                    continue
                name = first.setdefault(id(t), prefix + key)  # a tied alias binds to its first name
                slots.setdefault(name, []).append((store, key))
    _SLOTS[module] = slots
    return slots


class _Bound:
    """Binds tensors into their slots on enter; puts the module's own back on exit."""

    __slots__ = ("slots", "tensors", "saved")

    def __init__(self, slots: dict[str, list[tuple[dict, str]]], tensors: dict[str, torch.Tensor]):
        self.slots, self.tensors, self.saved = slots, tensors, []

    def __enter__(self):
        saved = self.saved
        for name, places in self.slots.items():
            t = self.tensors[name]
            for store, key in places:
                saved.append((store, key, store[key]))
                store[key] = t
        return self

    def __exit__(self, *exc):
        for store, key, t in reversed(self.saved):
            store[key] = t
        self.saved = []
        return False


def functionalize(module: torch.nn.Module) -> tuple[Apply, dict[str, torch.Tensor]]:
    """Split a module into a pure function and its parameters.

    Args:
        module: any ``torch.nn.Module``.

    Returns:
        ``(apply, params)``: ``params`` is a dict keyed by ``named_parameters()`` names
        (tied weights appear once, under their first name, and stay tied), holding detached
        tensors that share storage with the module's parameters (no copy is made); when
        some parameters have ``requires_grad=False`` it is a :class:`fzero.Params`, a dict
        that lists them in ``params.frozen`` so that they are not trained;
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
    named = list(module.named_parameters())
    params = {name: p.detach() for name, p in named}
    frozen = {n for n, p in named if not p.requires_grad}
    return Apply(module), (Params(params, frozen=frozen) if frozen else params)


# --------------------------------------------------------------------------- value_and_grad


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
        get zeros, and the frozen entries of a :class:`fzero.Params` get ``None`` (no
        gradient is computed for them).

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

        used = []  # whether fn's loss used a deferred global mean (see fzero.means)

        def call(d, *rest_args, **kw):
            full, r = [], iter(rest_args)
            ds = (d,) if single else d
            for i in range(len(args)):
                full.append(ds[nums.index(i)] if i in nums else next(r))
            since = means.mark()
            out = fn(*full, **kw)
            if since >= 0:
                loss = out[0] if has_aux and isinstance(out, (tuple, list)) and len(out) == 2 else out
                if means.check_loss(loss, since, getattr(fn, "__name__", "fn")):
                    used.append(True)
            return out

        out = bind("value_and_grad", call, diff, tuple(rest), kwargs, has_aux=has_aux)
        if used:  # corrected in place once the update's count is known
            means.returned(out[0][0] if has_aux else out[0])
        return out

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


# --------------------------------------------------------------------------- load_into


def load_into(module: torch.nn.Module, state_or_params: Any) -> torch.nn.Module:
    """Write trained weights back into ``module``, in place, on every rank.

    After ``step.init`` the module is only code (its parameters were released to ``meta``
    so that no dead copy of the model stays in memory); this puts full weights back so
    ``module.state_dict()``, ``torch.save`` or Hugging Face's ``save_pretrained`` save the
    trained model. Parameters are gathered whole (:func:`fzero.gather`: over ``dp``, over
    ``tp``, and over ``pp`` for a pipelined state; a collective: call it on every rank),
    taken from the fp32 masters under mixed precision, and written in the module's own
    dtype; tied parameters stay tied; buffers are copies of ``state.buffers`` (later steps
    do not change the module). No transform's rewrite is left in the module
    (``tensor_parallel``'s split forwards and divided attributes are in place only while its
    step runs), so ``module(x)`` then computes what the plain module with these weights
    computes.

    Args:
        module: the module that was functionalized (or one with the same names).
        state_or_params: a :class:`fzero.TrainState`, or a params dict (then buffers are
            left as they are; a pipelined model needs the state, which records every
            stage's parameters).

    Returns:
        ``module``.

    Raises:
        KeyError: names of the module's parameters or buffers that the state lacks, and
            names of the state's that the module lacks (all of them).
        ValueError: parameters or buffers whose shapes differ (each named, both shapes).

    Example:
        >>> import torch, fzero
        >>> from fzero import optim
        >>> model = torch.nn.Linear(2, 1)
        >>> apply, params = fzero.functionalize(model)
        >>> state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
        >>> step = fzero.compile(lambda s, b: (s.apply_gradients(fzero.tree.map(torch.ones_like, s.params)), {}))
        >>> state, _ = step(step.init(state), None)
        >>> model.weight.is_meta
        True
        >>> fzero.load_into(model, state).weight.tolist() == fzero.gather(state.params)["weight"].tolist()
        True
    """
    from fzero.distributed.gather import gather

    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"fzero.load_into: expected a torch.nn.Module, got {type(module).__name__}")
    params = getattr(state_or_params, "params", state_or_params)
    if not isinstance(params, dict):
        raise TypeError(f"fzero.load_into: expected a TrainState or a params dict, got {type(params).__name__}")
    # Whole over every mesh axis: a TrainState carries the records of its tp split and its
    # pipeline stages; a params dict its tp layout (docs/parallelism.md, "Getting the model back").
    slim = state_or_params  # the optimizer state is not gathered: only what the module holds
    if hasattr(slim, "opt_state") and hasattr(slim, "replace"):
        slim = slim.replace(opt_state=None)
    whole = gather(slim)
    full = dict(getattr(whole, "params", whole))
    if getattr(whole, "master", None) is not None:
        full.update({k: v for k, v in whole.master.items() if v is not None})
    buffers = getattr(whole, "buffers", None)
    buffers = None if not buffers else dict(buffers)
    # The state's own buffer tensors (gathering may hand back other objects for them): a
    # module holding one of them gets a copy instead, never the state's tensor.
    owned = {id(t) for t in (getattr(state_or_params, "buffers", None) or {}).values()}

    def canonical(named):
        by_id, pairs = {}, []
        for name, t in named:
            by_id.setdefault(id(t), name)
            pairs.append((name, by_id[id(t)]))
        return pairs

    p_pairs = canonical(module.named_parameters(remove_duplicate=False))
    b_pairs = canonical(module.named_buffers(remove_duplicate=False)) if buffers is not None else []
    wanted_p = {c for _, c in p_pairs}
    wanted_b = {c for _, c in b_pairs}
    problems = []
    missing = sorted((wanted_p - full.keys()) | (wanted_b - (buffers or {}).keys()))
    extra_names = sorted((full.keys() - wanted_p) | ((buffers or {}).keys() - wanted_b))
    if missing or extra_names:
        msg = ["fzero.load_into: the state's names do not match the module's."]
        if missing:
            msg.append(f"  missing from the state: {missing}")
        if extra_names:
            msg.append(f"  not in the module: {extra_names}")
        raise KeyError("\n".join(msg))
    current = dict(module.named_parameters(remove_duplicate=False))
    current_b = dict(module.named_buffers(remove_duplicate=False))
    for name, c in p_pairs:
        if tuple(current[name].shape) != tuple(full[c].shape):
            problems.append(f"  parameter {name!r}: module {tuple(current[name].shape)}, state {tuple(full[c].shape)}")
    for name, c in b_pairs:
        if tuple(current_b[name].shape) != tuple(buffers[c].shape):
            problems.append(f"  buffer {name!r}: module {tuple(current_b[name].shape)}, state {tuple(buffers[c].shape)}")
    if problems:
        raise ValueError("fzero.load_into: shapes differ:\n" + "\n".join(problems))

    p_canonical, b_canonical = dict(p_pairs), dict(b_pairs)
    made: dict[int, torch.nn.Parameter] = {}
    made_b: dict[int, torch.Tensor] = {}
    for mod_name, m in module.named_modules(remove_duplicate=False):
        prefix = mod_name + "." if mod_name else ""
        for pname, p in list(m._parameters.items()):
            if p is None:
                continue
            value = full[p_canonical[prefix + pname]]
            if p.is_meta:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(value.detach().to(p.dtype, copy=True), requires_grad=p.requires_grad)
                m._parameters[pname] = made[id(p)]
            elif id(p) not in made:
                with torch.no_grad():
                    p.copy_(value)
                made[id(p)] = p
        if buffers is not None:
            for bname, b in list(m._buffers.items()):
                if b is None:
                    continue
                if id(b) not in made_b:  # a buffer under two names stays one tensor
                    value = buffers[b_canonical[prefix + bname]]
                    if b is value or id(b) in owned or b.is_meta:  # copies, never the state's tensors
                        made_b[id(b)] = value.detach().to(b.dtype, copy=True)
                    else:
                        with torch.no_grad():
                            made_b[id(b)] = b.copy_(value)
                m._buffers[bname] = made_b[id(b)]
    return module
