"""Norm weights under ``mixed_precision``: a 16-bit parameter that a norm function computes
with in fp32, as an fp32 module's norm does under ``torch.autocast``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fzero import tree

__all__ = ["NormWeight", "NormsInFp32", "norm_weight_leaf", "norm_weights", "with_norm_weights"]


# The norm functions and where their weight and bias are, positionally (by keyword they are
# ``weight`` and ``bias``). torch.autocast leaves an fp32 module's norm weights in fp32: on
# CUDA it runs layer_norm and group_norm in fp32; on the CPU it runs them as they are, and
# their kernels take a bf16/fp16 input with fp32 weights but refuse an fp32 input (the raw
# input, an fp32 residual) with 16-bit weights ("mixed dtype (CPU): expect parameter to have
# scalar type of Float"); batch_norm refuses 16-bit weights beside fp32 running statistics
# on either device.
_NORM_WEIGHTS = {
    F.layer_norm: (2, 3), torch.layer_norm: (2, 3),
    F.group_norm: (2, 3), torch.group_norm: (2, 3),
    F.batch_norm: (3, 4), torch.batch_norm: (1, 2),
    F.instance_norm: (3, 4), torch.instance_norm: (1, 2),
    F.rms_norm: (2,), torch.rms_norm: (2,),
}
_LOW = (torch.bfloat16, torch.float16)


class NormWeight(torch.Tensor):
    """A 16-bit parameter as the model sees it under ``mixed_precision``: a norm function
    (``layer_norm``, ``group_norm``, ``batch_norm``, ``instance_norm``, ``rms_norm``) given
    it as its weight or bias computes with it in fp32, as an fp32 module's norm computes
    under ``torch.autocast``; every other operation sees the plain tensor and returns plain
    tensors. It is an alias of the parameter (``Tensor.as_subclass``: same storage, on the
    autograd graph), so its gradient is the parameter's, in the parameter's dtype.

    Only operations that take a parameter pass through Python here (a norm, a matmul's
    weight), not every operation of the forward as a ``TorchFunctionMode`` would; and a
    recomputation in backward (``fzero.remat``, Hugging Face's gradient checkpointing) sees
    the same tensors, where a mode entered for the forward would be gone.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> w = torch.ones(4, dtype=torch.bfloat16, requires_grad=True)
        >>> y = F.layer_norm(torch.randn(2, 4), (4,), w.as_subclass(NormWeight))  # an fp32 input
        >>> type(y).__name__, y.dtype
        ('Tensor', torch.float32)
        >>> y.sum().backward(); w.grad.dtype
        torch.bfloat16
    """

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        at = _NORM_WEIGHTS.get(func)
        with torch._C.DisableTorchFunctionSubclass():
            if at is not None:
                args = [_fp32(x) if i in at else x for i, x in enumerate(args)]
                kwargs = {k: _fp32(v) if k in ("weight", "bias") else v for k, v in kwargs.items()}
            return func(*args, **kwargs)


class NormsInFp32(torch.overrides.TorchFunctionMode):
    """:class:`NormWeight`'s rule as a mode, for a compiled forward (``compile(jit=)``):
    every 16-bit weight or bias a norm function is given computes in fp32. AOTAutograd
    (torch 2.13) fails on a ``__torch_function__`` subclass bound as a module's parameter;
    dynamo traces a mode that is active when the compiled code is called into the graph.
    Under ``mixed_precision`` every trainable floating parameter is 16-bit, so this differs
    from :class:`NormWeight` only for a 16-bit norm weight that is not a parameter.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> w = torch.ones(4, dtype=torch.bfloat16)
        >>> with NormsInFp32():
        ...     F.layer_norm(torch.randn(2, 4), (4,), w).dtype
        torch.float32
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        at = _NORM_WEIGHTS.get(func)
        if at is not None:
            args = [_fp32(x) if i in at else x for i, x in enumerate(args)]
            kwargs = {k: _fp32(v) if k in ("weight", "bias") else v for k, v in kwargs.items()}
        return func(*args, **kwargs)


def _fp32(x):
    return x.float() if isinstance(x, torch.Tensor) and x.dtype in _LOW else x


def norm_weight_leaf(x: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """``x`` as a differentiated leaf (``value_and_grad``'s ``leaf``): a 16-bit tensor as a
    :class:`NormWeight` leaf sharing its storage (as ``nn.Parameter`` is made), anything else
    as ``x.detach().requires_grad_()``. The leaf is the parameter the model sees, so no alias
    stands between it and the forward: an alias made at the forward's start would be the
    first node of the graph, which the autograd engine runs last, and every gradient would
    reach its leaf -- and ZeRO's reduction -- only once backward is done.

    Example:
        >>> import torch
        >>> w = norm_weight_leaf(torch.ones(2, dtype=torch.bfloat16))
        >>> type(w).__name__, w.is_leaf, w.requires_grad
        ('NormWeight', True, True)
    """
    if type(x) is torch.Tensor and x.dtype in _LOW:
        return torch.Tensor._make_subclass(NormWeight, x, True)  # (which detaches it, as nn.Parameter's)
    return x.detach().requires_grad_(True)


norm_weight_leaf.by_name = False  # the leaf does not depend on the parameter's name


def norm_weights(x):
    """A 16-bit tensor as a :class:`NormWeight` (an alias); anything else as it is."""
    if type(x) is torch.Tensor and x.dtype in _LOW:
        return x.as_subclass(NormWeight)
    return x


def with_norm_weights(params):
    """``params`` with every 16-bit plain tensor leaf as a :class:`NormWeight` alias
    (:func:`norm_weights`). A dict holding none -- every trainable leaf already made one by
    :func:`norm_weight_leaf`, the rest fp32 or integer -- is returned as it is: one look
    at each value, where a walk would build a new dict of the same tensors every step.

    Example:
        >>> import torch
        >>> p = {"w": norm_weight_leaf(torch.ones(2, dtype=torch.bfloat16)), "n": torch.ones(1)}
        >>> with_norm_weights(p) is p
        True
        >>> type(with_norm_weights({"frozen": torch.ones(2, dtype=torch.bfloat16)})["frozen"]).__name__
        'NormWeight'
    """
    if type(params) is dict and not any(type(v) is torch.Tensor and v.dtype in _LOW for v in params.values()):
        return params
    return tree.map(norm_weights, params)
