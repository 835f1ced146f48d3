"""``fzero.compile``: one call that composes the transforms a training run asks for."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from typing import Any

import torch

from fzero.distributed.mesh import Mesh
from fzero.train_state import TrainState
from fzero.transforms._core import Step, as_step, collecting_metrics

__all__ = ["compile"]

# Every option compile() knows, with its default. The order of application is fixed and
# documented in docs/design.md: shard_state(mixed_precision(accumulate(train_step))).
OPTIONS: dict[str, Any] = {
    "zero": 0,
    "precision": "fp32",
    "accumulate": 1,
    "clip_norm": None,
    "loss_scale": "dynamic",
    "loss_scale_options": None,
    "check_grad_overflow": True,
    "reduce_dtype": None,
    "bucket_size": None,
    "overlap_comm": True,
    "buffer_sync": "broadcast",
}

# Options that exist in fzero's design but whose transform has not landed yet: giving
# them a non-default value is an error that says so, never a silent no-op.
_NOT_YET = {
    "overlap_comm": "turning off overlapped communication is not supported yet",
}


def _check_options(options: dict[str, Any]) -> dict[str, Any]:
    for key in options:
        if key not in OPTIONS:
            close = difflib.get_close_matches(key, OPTIONS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TypeError(
                f"fzero.compile: unknown option {key!r}{hint} (valid options: {', '.join(OPTIONS)})"
            )
    opts = {**OPTIONS, **options}
    if opts["zero"] not in (0, 1, 2, 3):
        raise ValueError(f"fzero.compile: zero={opts['zero']!r} must be one of 0, 1, 2, 3")
    if opts["precision"] not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"fzero.compile: precision={opts['precision']!r} must be 'fp32', 'bf16' or 'fp16'")
    if not isinstance(opts["accumulate"], int) or opts["accumulate"] < 1:
        raise ValueError(f"fzero.compile: accumulate={opts['accumulate']!r} must be a positive int")
    clip = opts["clip_norm"]
    if clip is not None and (not isinstance(clip, (int, float)) or clip <= 0):
        raise ValueError(f"fzero.compile: clip_norm={clip!r} must be a positive number or None")
    for key, why in _NOT_YET.items():
        if key in options and options[key] != OPTIONS[key]:
            raise NotImplementedError(f"fzero.compile: option {key}={options[key]!r}: {why}")
    return opts


def _with_clipping(step: Step, max_norm: float) -> Step:
    """Clip by global norm in front of the state's optimizer (installed at ``init``)."""
    from fzero import optim

    def init(state):
        state = step.init(state)
        clip = optim.clip_by_global_norm(max_norm)
        return state.replace(
            tx=optim.chain(clip, state.tx), opt_state=(clip.init(state.params), state.opt_state)
        )

    return Step(step, init=init, name=f"clip({step.__name__})", inner=step)


def compile(train_step: Callable, mesh: Mesh | None = None, config: Any = None, **options) -> Step:  # noqa: A001
    """Compose fzero's transforms around ``train_step`` from keyword options.

    Args:
        train_step: a pure single-device ``train_step(state, batch) -> (state, metrics)``.
        mesh: the :class:`fzero.Mesh` to run on (default: ``Mesh(dp=-1)``).
        config: a DeepSpeed-format config: a dict, a path to a JSON file, or an
            :class:`fzero.Config` (see docs/config.md). Its options join the keywords (a
            keyword that contradicts it is an error); its optimizer and scheduler sections
            replace the state's optimizer at ``step.init``.
        zero: ZeRO stage 0-3 over the mesh's ``dp`` axis (``fzero.shard_state``); on a
            mesh of more than one rank, stage 0 is plain data parallelism (DDP).
        bucket_size: bytes per gradient bucket (default 25 MiB).
        reduce_dtype: the dtype gradients are summed in across ranks (``"fp32"``,
            ``"bf16"``, ``"fp16"``; default fp32 for low-precision gradients).
        precision: ``"fp32"``, ``"bf16"`` or ``"fp16"``.
        accumulate: micro-batches per update.
        clip_norm: clip gradients to this global L2 norm; ``metrics["grad_norm"]`` then
            holds the norm before clipping.
        loss_scale: fp16 only: ``"dynamic"`` (DeepSpeed's scaler), a fixed float, or None.
        loss_scale_options: fp16 scaler settings, DeepSpeed's names
            (``initial_scale_power``, ``loss_scale_window``, ``hysteresis``,
            ``consecutive_hysteresis``, ``min_loss_scale``).
        buffer_sync: how the model's buffers agree across ``dp`` ranks after each step:
            ``"broadcast"`` (DDP's: dp-rank 0's), ``"mean"`` or ``"local"`` (see
            :func:`fzero.shard_state`).
        check_grad_overflow: bf16 (and fp16 with ``loss_scale=None``): skip an update whose
            gradients are not finite (default ``True``, DeepSpeed's
            ``bf16.check_grad_overflow``); ``metrics["skipped"]`` says whether it was.

    After ``step.init`` the module passed to ``fzero.functionalize`` holds no weights
    (its parameters are ``meta`` tensors, so no dead copy of the model stays in memory);
    ``fzero.load_into(module, state)`` writes the trained ones back.

    Returns:
        A :class:`Step`: call ``step.init(state)`` once, then ``step(state, batch)``.
        Its ``metrics`` are the user's plus those fzero emits (``grad_norm``, ...).

    Raises:
        TypeError: an unknown option (the message names it and the nearest valid one).
        NotImplementedError: an option whose transform has not landed yet.

    Example:
        >>> import torch, fzero
        >>> from fzero import optim
        >>> apply, params = fzero.functionalize(torch.nn.Linear(2, 1))
        >>> state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
        >>> def train_step(state, batch):
        ...     loss, g = fzero.value_and_grad(lambda p: state.apply_fn(p, batch).pow(2).mean())(state.params)
        ...     return state.apply_gradients(g), {"loss": loss}
        >>> step = fzero.compile(train_step, clip_norm=1.0)
        >>> state = step.init(state)
        >>> state, metrics = step(state, torch.ones(4, 2))
        >>> sorted(metrics)
        ['grad_norm', 'loss']
    """
    mesh = mesh if mesh is not None else Mesh(dp=-1)
    cfg = None
    if config is not None:
        from fzero.config import Config

        cfg = Config.load(config, world_size=mesh.size("dp"))
        from_config = cfg.compile_options()
        for key, value in options.items():
            if key in from_config and from_config[key] != value:
                raise ValueError(f"fzero.compile: option {key}={value!r} contradicts the config's "
                                 f"{key}={from_config[key]!r}; set it in one place")
        options = {**from_config, **options}
    opts = _check_options(options)
    if mesh.size("pp") > 1 or mesh.size("tp") > 1:
        raise NotImplementedError(f"fzero.compile: {mesh} has pp or tp axes; pipeline and tensor "
                                  "parallelism are not supported yet")
    inner = as_step(train_step)
    if opts["clip_norm"] is not None:
        inner = _with_clipping(inner, float(opts["clip_norm"]))
    if opts["accumulate"] > 1:
        from fzero.transforms.accumulate import accumulate

        inner = accumulate(inner, opts["accumulate"])
    if opts["precision"] != "fp32":
        from fzero.transforms.mixed_precision import mixed_precision

        inner = mixed_precision(inner, opts["precision"], opts["loss_scale"],
                                check_grad_overflow=opts["check_grad_overflow"],
                                **(opts["loss_scale_options"] or {}))
    if opts["zero"] > 0 or mesh.size("dp") > 1:
        from fzero.transforms.shard_state import DEFAULT_BUCKET_BYTES, shard_state

        inner = shard_state(inner, mesh, opts["zero"],
                            bucket_bytes=opts["bucket_size"] or DEFAULT_BUCKET_BYTES,
                            reduce_dtype=opts["reduce_dtype"], buffer_sync=opts["buffer_sync"])

    def init(state):
        if not isinstance(state, TrainState):
            raise TypeError(f"fzero.compile: step.init expects an fzero.TrainState, got {type(state).__name__}")
        # First, so that every transform's init (masters, layouts, optimizer state) builds
        # on the mesh's device.
        state = mesh.place(state)
        if cfg is not None:
            # The config's optimizer and scheduler sections, as deepspeed.initialize builds them.
            state = cfg.install(state)
        state = inner.init(state)
        module = getattr(state.apply_fn, "module", None)
        if isinstance(module, torch.nn.Module):
            # The module is only code from here on (its parameters live in the state);
            # fzero.load_into writes trained weights back.
            from fzero.transforms.shard_state import release_parameters

            release_parameters(module)
        return state

    def call(state, batch):
        with collecting_metrics() as emitted:
            out = inner(state, batch)
        if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
            raise TypeError(
                f"fzero.compile: {getattr(train_step, '__name__', 'train_step')} must return "
                f"(state, metrics) with metrics a dict, got {type(out).__name__}"
            )
        state, metrics = out
        return state, {**metrics, **emitted}

    step = Step(call, init=init, name=f"compiled({getattr(train_step, '__name__', 'step')})", inner=inner)
    step.mesh = mesh
    step.options = opts
    step.config = cfg
    return step
