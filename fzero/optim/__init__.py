"""Optax-style gradient transformations on torch tensors.

An optimizer is a :class:`GradientTransformation`, a pair of pure functions
``init(params) -> opt_state`` and ``update(grads, opt_state, params) -> (updates, opt_state)``;
:func:`apply_updates` adds the updates to the parameters. Optimizers are chains of small
transformations (``adamw`` is ``chain(scale_by_adam, add_decayed_weights,
scale_by_learning_rate)``) and compose with :func:`chain`.

Example:
    >>> import torch
    >>> from fzero import optim
    >>> tx = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3, weight_decay=0.1))
    >>> params = {"w": torch.ones(3)}
    >>> opt_state = tx.init(params)
    >>> updates, opt_state = tx.update({"w": torch.ones(3)}, opt_state, params)
    >>> params = optim.apply_updates(params, updates)
    >>> params["w"]
    tensor([0.9989, 0.9989, 0.9989])
"""

from fzero.optim import adagrad as _adagrad_module
from fzero.optim import alias, clipping, deepspeed, lowering, matrix, onebit, schedules, torch_optim, transform
from fzero.optim.alias import adam, adamw, lamb, lion, sgd
from fzero.optim._known import FusedSpec, fused_spec_of
from fzero.optim.adagrad import ScaleByRssState, adagrad, scale_by_rss
from fzero.optim.base import EmptyState, GradientTransformation, apply_updates, chain, identity
from fzero.optim.clipping import clip_by_global_norm, global_norm, global_sumsq, known_sumsq, leaf_norms
from fzero.optim.deepspeed import ScaleByDeepSpeedLambState, deepspeed_lamb
from fzero.optim.fused import use_fused
from fzero.optim.matrix import WholeTensorState, adafactor, muon, scale_by_muon
from fzero.optim.onebit import (DataParallelExchange, OnebitLambState, ZeroOneAdamState, exchange_of, onebit_adam,
                                onebit_lamb, scale_by_onebit_adam, zero_one_adam)
from fzero.optim.torch_optim import FromTorchState, TorchState, from_torch
from fzero.optim.transform import (
    MaskedState,
    ScaleByAdamState,
    ScaleByLionState,
    ScaleByScheduleState,
    TraceState,
    add_decayed_weights,
    masked,
    scale,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_lion,
    scale_by_schedule,
    scale_by_trust_ratio,
    trace,
)

# Each submodule's __all__ is its public list; test_public_names checks every name is here.
__all__ = [
    "EmptyState",
    "FusedSpec",
    "GradientTransformation",
    "apply_updates",
    "chain",
    "fused_spec_of",
    "identity",
    "schedules",
    "use_fused",
    *_adagrad_module.__all__,
    *alias.__all__,
    *clipping.__all__,
    *deepspeed.__all__,
    *matrix.__all__,
    *onebit.__all__,
    *torch_optim.__all__,
    *transform.__all__,
]
