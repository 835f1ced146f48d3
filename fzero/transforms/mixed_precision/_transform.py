"""``mixed_precision``: low-precision compute, fp32 master weights, DeepSpeed's loss scaler
and overflow check: the handler and the transform (the scaler is ``_scaler.py``, the norm
weights ``_norm.py``)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Literal

import torch

from fzero import tree
from fzero._params import merge_trainable, trainable, with_values
from fzero.transforms.shard_state import is_shard
from fzero.transforms._checks import check_option
from fzero.core import (Handler, NotApplied, Step, as_step, collecting_metrics, context, emit_metric, installed, lower,
                        psum)
from fzero.transforms._deferred import is_deferred
from fzero.transforms._skip import BufferGuard, SkipStreak, update_under_verdict
from fzero.transforms.finite import count_nonfinite, nonfinite_by_norm
from fzero.transforms.mixed_precision._lowp import (CompensatedState, compensated, narrow_like, states_in,
                                                    stochastic_round, toward_zero, widen)
from fzero.transforms.mixed_precision._norm import NormsInFp32, norm_weight_leaf, with_norm_weights
from fzero.transforms.mixed_precision._scaler import LossScaler, update_scaler

__all__ = ["mixed_precision"]

WHERE = "fzero.mixed_precision"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# What masters and optimizer state may be kept in (DeepSpeed's bf16.bf16_master_weights_and_grads,
# bf16.bf16_optimizer_states).
KEPT_IN = {"fp32": torch.float32, "bf16": torch.bfloat16}


class _PrecisionHandler(Handler):
    def __init__(self, dtype: torch.dtype, loss_scale, opts: dict, check_grad_overflow: bool, *,
                 master_dtype: torch.dtype = torch.float32, rounding: str = "nearest", by_norm: bool = False):
        self.dtype, self.loss_scale, self.opts, self.by_norm = dtype, loss_scale, opts, by_norm
        self.master_dtype, self.rounding = master_dtype, rounding
        # A loss scaler needs the verdict on every update; without one it is the user's choice.
        self.check = loss_scale is not None or check_grad_overflow
        self.scale = 1.0  # the scale of the step running now
        self.pending_overflow = False  # overflow seen in micro-batches whose update was deferred
        # The buffers' values before the update's first forward, for a skipped update to restore.
        self.guard = BufferGuard(WHERE)
        self.streak = SkipStreak(WHERE)

    def value_and_grad(self, fn, params, args, kwargs, *, next, **options):
        has_aux, scale = options.get("has_aux", False), self.scale
        run = self._low_precision(fn)

        @functools.wraps(fn)
        def low_precision(p, *a, **kw):
            out = run(p, *a, **kw)
            if scale == 1.0:
                return out
            if has_aux:
                return out[0].float() * scale, out[1]
            return out.float() * scale

        # The scale travels with the call: a function that seeds its own backward (the
        # pipeline schedule) seeds it with the same scale.
        options["loss_scale"] = options.get("loss_scale", 1.0) * scale
        if context().jit is None:
            # The leaves are NormWeights from the start (norm_weight_leaf): no alias whose
            # backward the engine would run last, holding every gradient until backward is
            # done (and ZeRO's reduction with them).
            options.setdefault("leaf", norm_weight_leaf)
        value, grads = next(low_precision, params, args, kwargs, **options)
        if scale != 1.0:
            value = (value[0] / scale, value[1]) if has_aux else value / scale
        return value, grads

    def forward(self, fn, params, args, kwargs, *, next):
        # An evaluation inside the step computes as the training forward does.
        return next(self._low_precision(fn), params, args, kwargs)

    def _low_precision(self, fn):
        dtype = self.dtype

        @functools.wraps(fn)
        def low_precision(p, *a, **kw):
            # What torch.autocast runs for an fp32 module: its low-precision ops (matmuls,
            # convolutions) take the parameters' low-precision copies, which are the casts
            # autocast would make of the masters, bit for bit; norm layers take fp32 weights
            # (NormWeights); every other op runs as autocast runs it.
            device = next_device(p)
            if context().jit is not None:
                # A compiled forward refuses a tensor subclass bound as a parameter (AOTAutograd
                # cannot run torch 2.13's aten ops on it): the same rule as a mode, which dynamo
                # traces into the graph.
                with torch.autocast(device_type=device, dtype=dtype), NormsInFp32():
                    out = fn(p, *a, **kw)
            else:
                with torch.autocast(device_type=device, dtype=dtype):
                    out = fn(with_norm_weights(p), *a, **kw)
            return out

        return low_precision

    def apply_gradients(self, state, grads, *, next):
        if not self.check:
            return next(state, grads)
        scale = self.scale
        # The flag stays on the gradients' device: under ZeRO it is all-reduced on the
        # mesh's group (NCCL moves CUDA tensors only), and one read of the verdict below
        # is the only synchronisation. One collective under ZeRO: a rank whose own gradient
        # pieces are finite still skips when another rank's are not (DeepSpeed all-reduces
        # its overflow flag with MAX), the same count check_finite takes.
        leaves = [g for g in tree.leaves(grads) if isinstance(g, torch.Tensor)]
        if self.by_norm and scale == 1.0 and not any(is_deferred(g) for g in leaves):
            # A clip follows: its global norm decides, taken once here for the clip to use,
            # as check_finite's by_norm takes it: one pass and one psum for both.
            flag, known = nonfinite_by_norm(grads)
        else:
            flag, known = psum(count_nonfinite(leaves, state)), contextlib.nullcontext()
        # Unscale in fp32: an fp16 gradient divided by 2^16 in fp16 would underflow.
        # A deferred gradient has no value yet: the last micro-batch's gradient carries it.
        unscaled = tree.map(lambda g: g if is_deferred(g) else g.float() / scale, grads) if scale != 1.0 else grads
        # The update goes on even on overflow and is discarded below: an accumulation
        # outside this transform must still count this micro-batch, and the verdict is
        # for the whole update (every micro-batch of it), as DeepSpeed checks the
        # accumulated gradient. It runs with the verdict still on the device.
        with known:
            new, overflow = update_under_verdict(flag, self.pending_overflow, lambda: next(state, unscaled))
        if isinstance(new, NotApplied) and new.reason == "deferred":  # an accumulation outside:
            self.pending_overflow = overflow  # remember, decide at the update's last micro-batch
            return new
        self.pending_overflow = False
        self.guard.finish(skipped=overflow)  # before the scaler, which may raise at its minimum
        self.streak.record(overflow, lambda: self._why(state), step=int(state.step))
        if self.loss_scale is not None:
            emit_metric("loss_scale", torch.tensor(scale))
        emit_metric("skipped", torch.tensor(overflow))
        scaler = {}
        if self.loss_scale == "dynamic":
            scaler["loss_scaler"] = update_scaler(state.loss_scaler, overflow, **self.opts)
        if overflow:
            # DeepSpeed skips the update: parameters, optimizer state (so the schedule's
            # count), the step counter and (restored above) the buffers stay as they were.
            return NotApplied(state.replace(**scaler), "skipped")
        if isinstance(new, NotApplied):  # skipped further in
            return NotApplied(new.state.replace(**scaler), new.reason)
        return new.replace(**scaler)

    def _why(self, state) -> str:
        """Why this transform skips updates, for the warning of a long streak."""
        low = "bf16" if self.dtype == torch.bfloat16 else "fp16"
        if self.loss_scale == "dynamic":
            return (f"the fp16 gradients overflow at loss scale {self.scale:g}, which halves on each overflow down to "
                    f"min_loss_scale={self.opts['min_scale']:g} (where it raises)")
        if self.loss_scale is not None:
            return f"the fp16 gradients overflow at the fixed loss scale {self.scale:g}"
        return f"the {low} gradients hold inf or NaN"

    def update(self, state, grads, *, next):
        if self.master_dtype != torch.float32:
            return self._update_low_masters(state, grads, next=next)
        # The optimizer steps the fp32 masters, whatever partitioned them (under ZeRO these
        # are this rank's pieces, as are the parameters); the model computes with their
        # low-precision copies.
        master = state.master
        if not lower(state.tx, master).reads_low_precision:
            # The update wants fp32 gradients (the fused kernels read 16-bit ones as they are):
            # cast here, so that the handlers outside (global_mean's rescale, offload's copy
            # to the host) act on fp32, as the optimizer will.
            grads = tree.map(lambda g, m: g.to(m.dtype), grads, master)
        new = next(state.replace(params=merge_trainable(state.params, master)), grads)
        master = trainable(new.params)
        here = context()
        if here.offload_optimizer or here.offload_params:  # masters or pieces on the host: cast where the masters are
            from fzero.transforms.offload import write_params

            low = write_params(trainable(state.params), master)
        elif here.donate:  # the low-precision copies are this step's: round the masters into them
            low = _round_into(trainable(state.params), master)
        else:
            low = tree.map(lambda m, p: m.to(p.dtype), master, trainable(state.params))
        return new.replace(params=merge_trainable(state.params, low), master=master)

    def _update_low_masters(self, state, grads, *, next):
        # bf16 masters (and, with bf16 optimizer state, bf16 moments): the update computes in
        # fp32 on fp32 working copies of this rank's masters, gradients and optimizer state, as
        # DeepSpeed's fused Adam and torch's fused AdamW compute on bf16 tensors, and its
        # results are rounded once into the kept dtypes. The copies live for the update only:
        # between steps the state holds the bf16 masters and the state's own dtypes.
        master, kept = state.master, state.opt_state
        wide_master = widen(master)
        if self.rounding == "kahan":  # the masters' true values: each bf16 weight plus its compensation
            wide_master = tree.map(lambda m, c: m.add_(c), wide_master, widen(kept.compensation))
        wide = next(state.replace(params=merge_trainable(state.params, wide_master), opt_state=widen(kept)),
                    widen(grads))
        result = trainable(wide.params)
        new_master = self._round(result, master, state)
        new_opt = narrow_like(wide.opt_state, kept)
        if self.rounding == "kahan":  # what the rounding dropped, kept for the next update
            # Toward zero: weight plus compensation then rounds back to the weight, so an update
            # that changes nothing (skipped, a zero gradient) leaves the weight's bits as they were.
            lost = tree.map(lambda r, m: toward_zero(r - m.float()), result, new_master)
            new_opt = CompensatedState(new_opt.inner, lost)
        new = wide.replace(opt_state=new_opt)
        here = context()
        if here.offload_optimizer or here.offload_params:
            from fzero.transforms.offload import write_params

            low = write_params(trainable(state.params), new_master)
        elif here.donate:
            low = _round_into(trainable(state.params), new_master)
        else:  # a copy of its own: the parameters never alias the masters
            low = tree.map(lambda m, p: m.to(p.dtype, copy=True), new_master, trainable(state.params))
        return new.replace(params=merge_trainable(state.params, low), master=new_master)

    def _round(self, wide: dict, master: dict, state) -> dict:
        """The fp32 results ``wide`` rounded into ``master``'s dtype: to nearest, or
        stochastically keyed by (seed, update, name, position in the whole tensor)."""
        if self.rounding != "stochastic":
            return narrow_like(wide, master)
        seed, update = int(state.seed), int(state.step)
        out = {}
        for name, x in wide.items():
            if x is None or not _floating(_local(x)) or _local(master[name]).dtype != torch.bfloat16:
                out[name] = x if x is None else tree.map(lambda a, m: a.to(m.dtype), x, master[name])
                continue
            start = x.info.piece()[0] if is_shard(x) else 0
            rounded = stochastic_round(_local(x), seed=seed, update=update, name=name, start=start)
            out[name] = type(x)(rounded, x.info) if is_shard(x) else rounded
        return with_values(master, out)


def _local(x):
    return x.local if is_shard(x) else x


def _floating(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def _round_into(params, masters):
    """``masters`` (fp32, or this rank's pieces of them) rounded into the 16-bit ``params`` in
    place: one multi-tensor copy, not a copy per parameter."""
    low, high = [], []

    def pair(p, m):
        low.append(p.local if is_shard(p) else p)
        high.append(m.local if is_shard(m) else m)
        return p

    out = tree.map(pair, params, masters)
    if low:
        with torch.no_grad():
            torch._foreach_copy_(low, high)
    return out


def next_device(params) -> str:
    """The device type (``"cpu"``, ``"cuda"``) of the first tensor leaf of ``params``, the one
    ``torch.autocast`` is entered for; ``"cpu"`` without one."""
    for x in tree.leaves(params):
        if isinstance(x, torch.Tensor):
            return x.device.type
    return "cpu"


def mixed_precision(
    step: Callable,
    dtype: Literal["bf16", "fp16"] = "bf16",
    loss_scale: Literal["dynamic"] | float | None = "dynamic",
    *,
    initial_scale_power: int = 16,
    loss_scale_window: int = 1000,
    hysteresis: int = 2,
    consecutive_hysteresis: bool = False,
    min_loss_scale: float = 1.0,
    check_grad_overflow: bool = True,
    master_weights: Literal["fp32", "bf16"] = "fp32",
    optimizer_states: Literal["fp32", "bf16"] = "fp32",
    rounding: Literal["nearest", "stochastic", "kahan"] = "nearest",
    check_by_norm: bool = False,
) -> Step:
    """Compute in bf16 or fp16 with fp32 master weights; skip updates whose gradients are
    not finite.

    ``init`` keeps fp32 master weights in ``state.master`` (the optimizer state is
    built over them) and makes ``state.params`` their ``dtype`` copies, which the model
    computes with (under ``torch.autocast``, so ops torch keeps in fp32 still run in fp32)
    and which ZeRO-3 gathers (half the bytes). Gradients come out in ``dtype``; the update
    runs on the fp32 masters and writes the new low-precision copies.

    With ``fp16`` the loss is multiplied by a scale first; the update unscales, checks
    every gradient for inf/nan and, on overflow, is skipped, with DeepSpeed 0.19.8's
    ``DynamicLossScaler`` as its ZeRO optimizers drive it at every stage: initial scale
    ``2**initial_scale_power``; on overflow the scale halves (never below
    ``min_loss_scale``) once ``hysteresis`` overflows have been spent; it doubles on a clean
    update when ``iter - last_overflow_iter - 1`` is positive and a multiple of
    ``loss_scale_window`` (``iter`` counts updates, skipped ones included); an overflow at
    the minimum scale is an error. ``bf16`` has fp32's range and needs no scaler; its
    update is skipped when a gradient is not finite (DeepSpeed's
    ``bf16.check_grad_overflow``, on by default), unless ``check_grad_overflow=False``.

    A skipped update leaves the parameters, the optimizer state (so the schedule's count),
    ``state.step`` and the buffers the forward changed (BatchNorm's running statistics) as
    they were before the step. The verdict is agreed by every rank under ZeRO, and is for
    the whole update under ``accumulate`` (any micro-batch's non-finite gradient skips it;
    the buffers go back to before its first micro-batch). After 10 skips in a row a
    ``RuntimeWarning`` says why (``fzero.transforms._skip.WARN_AFTER``).

    Args:
        step: ``train_step(state, batch) -> (state, metrics)``.
        dtype: ``"bf16"`` or ``"fp16"``.
        loss_scale: ``"dynamic"`` (fp16 default), a fixed float, or ``None`` (bf16 default
            is no scaling, whatever is passed: bf16 has fp32's range).
        initial_scale_power, loss_scale_window, hysteresis, consecutive_hysteresis,
            min_loss_scale: DeepSpeed's ``fp16`` section, same names and defaults.
        check_grad_overflow: without a loss scaler (bf16, or fp16 with ``loss_scale=None``),
            whether to skip an update whose gradients are not finite (DeepSpeed's
            ``bf16.check_grad_overflow``, default true). ``False`` applies such an update
            (the parameters become inf/nan) and saves the check. A loss scaler always
            checks, as DeepSpeed always does under fp16.
        master_weights: the dtype of the weights the optimizer steps. ``"fp32"``: fp32
            masters beside the 16-bit parameters. ``"bf16"`` (``dtype="bf16"`` only;
            DeepSpeed's ``bf16.bf16_master_weights_and_grads``): the masters are bf16, the
            gradients stay bf16, and the update computes in fp32 on fp32 copies of this
            rank's masters, gradients and optimizer state, rounding its results once into the
            kept dtypes. Saves 2 bytes per parameter (partitioned with the optimizer state).
        optimizer_states: the dtype of the optimizer's floating state (Adam's moments).
            ``"bf16"`` (DeepSpeed's ``bf16.bf16_optimizer_states``) needs
            ``master_weights="bf16"``, as in DeepSpeed; the moments are rounded to nearest.
        rounding: how the update's fp32 result becomes a bf16 master: ``"nearest"`` (as
            DeepSpeed), or ``"stochastic"`` (``master_weights="bf16"`` only): up with
            probability equal to the fraction of the gap, so an update below half a bf16
            ulp survives on average; the bits hash (``state.seed``, ``state.step``, the
            parameter's name, the element's position in the whole tensor), so the result is
            the same at every dp size and ZeRO stage (see
            :func:`fzero.transforms.mixed_precision._lowp.stochastic_round`); or ``"kahan"``
            (``master_weights="bf16"`` only): a bf16 compensation per parameter (2 bytes,
            kept in the optimizer state as
            :class:`~fzero.transforms.mixed_precision._lowp.CompensatedState`) holds what
            the rounding dropped; the update computes with weight plus compensation, so
            small updates add up deterministically.

        check_by_norm: a clip by global norm follows inside (``compile(clip_norm=)`` sets
            it): without a loss scale, the verdict is that norm, taken here once for the
            clip to use -- finite exactly when every gradient element is, unless its sum of
            squares overflows (elements past about 1e19, skipped too, as
            :func:`fzero.check_finite`'s ``by_norm`` does) -- one pass and one ``psum`` less.

    Returns:
        A :class:`Step`. Its metrics carry ``skipped`` (whether this update was skipped)
        whenever gradients are checked, and under fp16 with a scale ``loss_scale`` (the
        scale this update's loss was multiplied by).

    Raises:
        ValueError: an unknown ``dtype`` or ``loss_scale``, a scaler setting out of range,
            or ``check_grad_overflow=False`` with a loss scaler, or a ``master_weights``,
            ``optimizer_states`` or ``rounding`` another setting rules out.
        FloatingPointError: at call time, an overflow at the minimum scale.

    Example:
        >>> import torch, fzero
        >>> from fzero import optim
        >>> apply, params = fzero.functionalize(torch.nn.Linear(2, 1))
        >>> state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
        >>> def train_step(state, batch):
        ...     loss_fn = lambda p: state.apply_fn(p, batch).float().pow(2).mean()
        ...     loss, g = fzero.value_and_grad(loss_fn)(state.params)
        ...     return state.apply_gradients(g), {"loss": loss}
        >>> step = fzero.mixed_precision(train_step, "bf16")
        >>> state = step.init(state)
        >>> state, metrics = step(state, torch.ones(4, 2))
        >>> bool(metrics["skipped"]), int(state.step), state.params["weight"].dtype
        (False, 1, torch.bfloat16)
        >>> state, metrics = step(state, torch.full((4, 2), float("inf")))
        >>> bool(metrics["skipped"]), int(state.step)  # not applied: params stay finite
        (True, 1)
    """
    if dtype not in DTYPES:
        raise ValueError(f"{WHERE}: dtype={dtype!r} must be 'bf16' or 'fp16'")
    for name, value in [("loss_scale", loss_scale), ("initial_scale_power", initial_scale_power),
                        ("loss_scale_window", loss_scale_window), ("hysteresis", hysteresis),
                        ("consecutive_hysteresis", consecutive_hysteresis), ("min_loss_scale", min_loss_scale),
                        ("check_grad_overflow", check_grad_overflow)]:
        check_option(WHERE, name, value)
    for name, value in [("master_weights", master_weights), ("optimizer_states", optimizer_states)]:
        if value not in KEPT_IN:
            raise ValueError(f"{WHERE}: {name}={value!r} must be 'fp32' or 'bf16'")
    if rounding not in ("nearest", "stochastic", "kahan"):
        raise ValueError(f"{WHERE}: rounding={rounding!r} must be 'nearest', 'stochastic' or 'kahan'")
    if master_weights == "bf16" and dtype != "bf16":
        raise ValueError(f"{WHERE}: master_weights='bf16' needs dtype='bf16', got dtype={dtype!r}")
    if optimizer_states == "bf16" and master_weights != "bf16":
        raise ValueError(f"{WHERE}: optimizer_states='bf16' needs master_weights='bf16' (as DeepSpeed's "
                         "bf16_optimizer_states needs bf16_master_weights_and_grads)")
    if rounding != "nearest" and master_weights != "bf16":
        raise ValueError(f"{WHERE}: rounding={rounding!r} rounds bf16 masters: it needs master_weights='bf16'")
    if dtype == "bf16":
        loss_scale = None
    if loss_scale is not None and not check_grad_overflow:
        raise ValueError(f"{WHERE}: check_grad_overflow=False with loss_scale={loss_scale!r}: a loss scaler "
                         "must see every overflow (DeepSpeed always checks under fp16); pass loss_scale=None "
                         "to compute in fp16 unscaled and unchecked")
    inner = as_step(step)
    opts = dict(window=loss_scale_window, hysteresis=hysteresis, consecutive=consecutive_hysteresis,
                min_scale=float(min_loss_scale))
    master_dtype, states_dtype = KEPT_IN[master_weights], KEPT_IN[optimizer_states]
    check_option(WHERE, "check_by_norm", check_by_norm, "check_grad_overflow")  # a bool, the same check
    handler = _PrecisionHandler(DTYPES[dtype], loss_scale, opts, check_grad_overflow, master_dtype=master_dtype,
                                rounding=rounding, by_norm=check_by_norm)

    def before(state):
        # Before the inner transforms' init, so that a shard_state inside or outside this
        # transform finds the masters and partitions them (the order: core.py).
        if state.master is None:
            if state.tx is None:
                from fzero.train_state import missing_optimizer

                raise missing_optimizer(f"{WHERE}: step.init")
            low = DTYPES[dtype]
            # Masters for the trainable parameters only; frozen ones keep their own dtype
            # (bit-identical, as they must stay) and autocast casts them per op.
            master = tree.map(lambda p: p.detach().to(master_dtype) if p.is_floating_point() else p,
                              trainable(state.params))
            params = merge_trainable(state.params,
                                     tree.map(lambda m: m.to(low, copy=True) if m.is_floating_point() else m, master))
            tx = state.tx
            if states_dtype != master_dtype:  # the optimizer state is built over the masters: in theirs, else
                tx = states_in(tx, states_dtype)
            if rounding == "kahan":  # a bf16 compensation per parameter, partitioned with the optimizer state
                tx = compensated(tx)
            # ZeRO 1-3 outside builds the optimizer state over its pieces of the masters: one
            # built here over the whole masters would only add to init's peak.
            opt_state = None if context().opt_state_outside else tx.init(master)
            state = state.replace(params=params, tx=tx, opt_state=opt_state, master=master)
        if loss_scale == "dynamic" and state.loss_scaler is None:
            state = state.replace(loss_scaler=LossScaler.create(initial_scale_power, hysteresis))
        return state

    def call(state, batch):
        if loss_scale == "dynamic":
            if state.loss_scaler is None:
                raise RuntimeError(f"{WHERE}: call step.init(state) once before the first step")
            handler.scale = float(state.loss_scaler.scale)
        else:
            handler.scale = 1.0 if loss_scale is None else float(loss_scale)
        if handler.check and context().micro_batch.index == 0:  # an update starts: its forwards will change the buffers
            handler.guard.keep(getattr(state, "buffers", None))
        # Collect what this step emits (loss_scale, skipped) into its own metrics, so the
        # transform reports them used alone as well as under compile.
        with collecting_metrics() as emitted, installed(handler):
            state, metrics = inner(state, batch)
        for k, v in emitted.items():
            emit_metric(k, v)  # and pass them outwards for enclosing collectors
        return state, {**metrics, **emitted}

    return Step(call, before=before, name=f"mixed_precision({inner.__name__}, {dtype})", inner=inner)
