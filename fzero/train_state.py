"""``TrainState``: everything a training step carries from one update to the next."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fzero import tree
from fzero._params import trainable
from fzero.core import NotApplied, bind

__all__ = ["TrainState"]


@tree.dataclass
class TrainState:
    """A pytree of the training state, as flax's ``TrainState``.

    Attributes:
        step: 0-dim int64 CPU tensor, the number of updates applied (a skipped fp16
            update does not count).
        params: the parameter pytree (``functionalize``'s dict of tensors).
        opt_state: the optimizer state, ``tx.init(params)``.
        apply_fn: static; the model's pure apply function.
        tx: static; the ``fzero.optim`` gradient transformation.
        extra: what the user keeps with the state (``TrainState.create(..., **extra)``),
            saved with the rest; fzero's transforms keep theirs in the typed fields below.
        buffers: the model's buffers by ``named_buffers()`` name (``{}`` when it has
            none). ``state.apply_fn`` runs the forward with them, so a forward that
            updates a buffer in place (BatchNorm's running statistics) updates the
            state's; ``shard_state`` makes them identical on every ``dp`` rank after each
            step; checkpoints save them.
        seed: 0-dim int64 CPU tensor, the run's random seed (``create(..., seed=0)``):
            dropout inside a step draws its masks from it, the update and each element's
            place in the global batch (:mod:`fzero.rng`), so they do not depend on the
            layout; checkpointed with the rest.
        master: ``mixed_precision``'s fp32 master weights of the trainable parameters (or
            ``offload_optimizer``'s in fp32 training), a pytree like
            ``params.trainable()``: the optimizer state is built over them, the update runs
            on them, and ``shard_state`` partitions them like optimizer state. ``None``
            without.
        loss_scaler: fp16's dynamic loss scaler (a ``LossScaler``: scale, update counter,
            last overflow, hysteresis); ``None`` without.
        tensor_parallel: the split of the parameters over ``tp``
            (:class:`~fzero.transforms.tensor_parallel.TensorParallelLayout`, no leaves),
            for checkpoints and :func:`fzero.gather`; ``None`` without.
        pipeline: which stage holds which parameters and buffers
            (:class:`~fzero.transforms.pipeline.PipelineLayout`, no leaves), for
            :func:`fzero.gather`; ``None`` without.

    Frozen parameters (``params.frozen``, from ``requires_grad=False``) get no optimizer
    state and are never updated.

    Example:
        >>> import torch, fzero
        >>> from fzero import optim
        >>> apply, params = fzero.functionalize(torch.nn.Linear(2, 1))
        >>> state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
        >>> int(state.step)
        0
        >>> grads = fzero.tree.map(torch.ones_like, state.params)
        >>> int(state.apply_gradients(grads).step)
        1
    """

    step: torch.Tensor
    params: Any
    opt_state: Any
    apply_fn: Callable = tree.field(static=True)
    tx: Any = tree.field(static=True)
    extra: dict = tree.field(default_factory=dict)
    buffers: dict = tree.field(default_factory=dict)
    seed: torch.Tensor = tree.field(default_factory=lambda: torch.zeros((), dtype=torch.int64))
    master: Any = None
    loss_scaler: Any = None
    tensor_parallel: Any = None
    pipeline: Any = None

    @classmethod
    def create(cls, *, apply_fn: Callable, params: Any, tx: Any = None, buffers: dict | None = None,
               seed: int = 0, **extra) -> "TrainState":
        """A fresh state at step 0 with ``opt_state = tx.init(params.trainable())``.

        ``tx`` may be left out when ``fzero.compile(config=...)`` installs the config's
        optimizer at ``step.init`` (``opt_state`` is then ``None`` until it does); a step
        that updates a state with no optimizer is an error saying so.

        ``seed`` (an int) keys the dropout masks of every step (see :mod:`fzero.rng`): the
        same seed gives the same run at any layout.

        ``buffers`` defaults to copies of the module's buffers when ``apply_fn`` comes
        from :func:`fzero.functionalize`, else ``{}``: the state owns them (a step updates
        them, the module keeps its own until :func:`fzero.load_into` writes the trained
        ones back), so two states made from one module share nothing.

        Raises:
            TypeError: ``tx`` is not an ``fzero.optim`` transformation; a ``params`` leaf that
                is not a tensor, or an integer tensor that would be trained (each named by
                its key path, all at once).
        """
        if tx is not None and not (hasattr(tx, "init") and hasattr(tx, "update")):
            raise TypeError(
                "fzero.TrainState.create: tx must be an fzero.optim gradient transformation "
                f"(with init and update), got {type(tx).__name__}"
            )
        if isinstance(seed, bool) or not isinstance(seed, int) and not (
                isinstance(seed, torch.Tensor) and seed.dim() == 0 and not seed.is_floating_point()):
            raise TypeError(f"fzero.TrainState.create: seed must be an int, got {type(seed).__name__}")
        _check_params(params)
        if buffers is None:
            module = getattr(apply_fn, "module", None)
            buffers = {k: b.detach().clone() for k, b in module.named_buffers()} \
                if isinstance(module, torch.nn.Module) else {}
        return cls(
            step=torch.zeros((), dtype=torch.int64),
            params=params,
            opt_state=None if tx is None else tx.init(trainable(params)),
            apply_fn=apply_fn,
            tx=tx,
            extra=dict(extra),
            buffers=dict(buffers),
            seed=torch.tensor(int(seed), dtype=torch.int64),
        )

    def apply_gradients(self, grads: Any) -> "TrainState":
        """The state after one update with ``grads`` (a pytree like ``params``).

        Under a transform the update may be deferred (``accumulate``), partitioned
        (``shard_state``) or skipped (fp16 overflow); the returned state is always the one
        to carry on with.

        Raises:
            fzero.tree.StructureError: ``grads`` does not have the structure of ``params``.
            ValueError: a gradient whose shape is not its parameter's (each named by its key
                path, with both shapes).
            RuntimeError: the state has no optimizer (``tx`` was not given and no config
                installed one).
        """
        if self.tx is None:
            raise missing_optimizer("fzero.TrainState.apply_gradients")
        out = bind("apply_gradients", self, grads)
        return out.state if isinstance(out, NotApplied) else out


class _BoundApply:
    """``TrainState.apply_fn``: the stored apply, bound to the state's buffers on access."""

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        apply = obj.__dict__["_apply_fn"]
        buffers = obj.__dict__.get("buffers")
        if buffers and hasattr(apply, "with_buffers"):
            return apply.with_buffers(buffers)
        return apply

    def __set__(self, obj, value):
        obj.__dict__["_apply_fn"] = value


TrainState.apply_fn = _BoundApply()


def missing_optimizer(where: str) -> RuntimeError:
    """The error of a state without an optimizer, where one is needed."""
    return RuntimeError(f"{where}: the state has no optimizer: TrainState.create was given no tx= and no config "
                        "installed one; pass tx= (an fzero.optim transformation) to TrainState.create, or compile "
                        "with a config whose optimizer section step.init installs")


def _check_params(params: Any) -> None:
    """Every leaf of ``params`` a tensor, and no integer tensor among the trained ones."""
    where = "fzero.TrainState.create"
    paths, leaves, _ = tree.flatten_with_path(params)
    bad = [f"params{tree.keystr(k)} is {type(v).__name__}" for k, v in zip(paths, leaves)
           if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"{where}: every params leaf must be a torch.Tensor: " + "; ".join(bad[:8])
                        + (f"; and {len(bad) - 8} more" if len(bad) > 8 else "")
                        + " (keep other values in TrainState.create(..., **extra) or in the module)")
    tpaths, tleaves, _ = tree.flatten_with_path(trainable(params))
    ints = [f"params{tree.keystr(k)} ({v.dtype})" for k, v in zip(tpaths, tleaves)
            if isinstance(v, torch.Tensor) and not (v.is_floating_point() or v.is_complex())]
    if ints:
        raise TypeError(f"{where}: integer parameters cannot be trained by gradients: " + ", ".join(ints[:8])
                        + (f" and {len(ints) - 8} more" if len(ints) > 8 else "")
                        + "; freeze them (nn.Parameter(..., requires_grad=False), or fzero.Params(..., "
                        "frozen={...})) or keep them as module buffers")


