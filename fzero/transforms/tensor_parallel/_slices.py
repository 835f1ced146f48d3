"""Which slice of the whole tensor a tensor-parallel rank holds, followed through the forward.

A column-parallel layer's output is this rank's slice of the whole output's last dim. The
model's own code then cuts it into heads, transposes, multiplies and takes a softmax, and
somewhere a dropout draws a mask on it. For that mask to be the whole model's (fzero's
promise: the same run at any ``tp``), the dropout must know where its tensor sits in the
whole one. A :class:`SliceTracker` (a ``TorchFunctionMode``, active while a tensor-parallel
step runs) carries that answer from the layer to the dropout: each result of an operation on a
tagged tensor is tagged with where *it* sits -- a :class:`fzero.rng.Slice` -- by the rule of
its operation (views, transposes, element-wise maps, batched matmuls, splits and softmaxes
that keep the split dim whole; the table below). An operation without a rule, or one that mixes
the split dim (a sum over it, a matmul contracting it), tags its result
:class:`fzero.rng.Unknown`, naming itself: a dropout on such a tensor is an error saying so,
never a silently different mask. A row-parallel layer's output, summed over the ranks, is
whole again (no tag).

This is the part of DTensor's sharding propagation dropout needs, for the operations
attention and MLP code uses; nothing else reads it, and it costs one Python call per
operation of a tensor-parallel step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from fzero.rng import SLICE_ATTR, Slice, Unknown, slice_of

__all__ = ["SliceTracker"]

# Element-wise maps (and in-place forms): the result sits where its tagged operand sits,
# broadcast from the right.
_ELEMENTWISE = frozenset({
    "add", "add_", "sub", "sub_", "rsub", "mul", "mul_", "div", "div_", "true_divide", "neg", "pow", "__pow__",
    "__rpow__", "__radd__", "__rsub__", "__rmul__", "__rtruediv__", "__add__", "__sub__", "__mul__", "__truediv__",
    "where", "masked_fill", "masked_fill_", "clamp", "clamp_", "clamp_min", "clamp_max", "abs", "exp", "log",
    "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "relu_", "gelu", "silu", "mish", "softplus", "leaky_relu", "elu",
    "erf", "sin", "cos", "square", "to", "float", "half", "bfloat16", "double", "type", "type_as", "detach",
    "clone", "contiguous", "requires_grad_", "nan_to_num", "maximum", "minimum", "sign", "reciprocal",
    "logical_not", "eq", "ne", "lt", "le", "gt", "ge", "__and__", "__or__", "__invert__", "bitwise_not",
    "baddbmm_scale", "lerp", "addcmul", "masked_fill", "fill_", "zero_",
})
# (name, its dim keyword's position after the tensor): the dim is kept whole, the rest element-wise.
_ALONG_DIM = {"softmax": 1, "log_softmax": 1, "cumsum": 1, "argmax": 1, "argmin": 1}
_RESHAPES = frozenset({"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as"})


def _tensors(x: Any):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)


def _tagged(values, found: list) -> list:
    """``(tensor, tag)`` of every tagged tensor among ``values`` (lists and tuples looked
    into), appended to ``found``: the tracker's look at every operation's arguments, so
    kept to one dict lookup per tensor (``slice_of`` without its compiling check, which
    the tracker makes once per operation)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            tag = v.__dict__.get(SLICE_ATTR)
            if tag is not None:
                found.append((v, tag))
        elif isinstance(v, (list, tuple)):
            _tagged(v, found)
    return found


class SliceTracker(TorchFunctionMode):
    """Tags the results of operations on sliced tensors with where they sit in the whole.

    ``compile(jit=)``'s compiled forwards run with it off the mode stack (a graph's
    intermediate tensors carry no attributes out of it; :func:`fzero.rng.compiled_region`):
    a drawn dropout there is refused."""

    tracks_slices = True  # what fzero.rng looks for on the mode stack

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **kwargs) if kwargs else func(*args)
        if torch.compiler.is_compiling():  # a graph's tensors carry no tags (fzero.rng.slice_of)
            return out
        tagged = _tagged(args, [])
        if kwargs:
            _tagged(kwargs.values(), tagged)
        if not tagged:
            return out
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        try:
            tags = _rule(name, args, kwargs, out, tagged)
        except Exception:  # noqa: BLE001  (a rule that cannot read its call: the result is unknown)
            tags = None
        outs = list(_tensors(out)) if isinstance(out, (tuple, list)) else [out]
        if tags is None:
            tags = [None] * len(outs)
        for t, tag in zip(outs, tags):
            if isinstance(t, torch.Tensor):
                t.__dict__[SLICE_ATTR] = Unknown(name) if tag is None else tag  # with_slice, tag never None
        return out


def _rule(name: str, args, kwargs, out, tagged) -> list | None:
    x, tag = tagged[0]
    if isinstance(tag, Unknown):
        return [tag] * (len(out) if isinstance(out, (tuple, list)) else 1)
    if name in _ELEMENTWISE:
        return [_broadcast(out, tagged)]
    if name in _ALONG_DIM:
        dim = kwargs.get("dim", args[_ALONG_DIM[name]] if len(args) > _ALONG_DIM[name] else None)
        if dim is None or dim % x.dim() == tag.dim:
            return None
        return [tag]
    if name in _RESHAPES:
        return [_reshaped(tag, tuple(x.shape), tuple(out.shape))]
    if name in ("transpose", "swapaxes", "swapdims"):
        a, b = (int(d) % x.dim() for d in args[1:3])
        d = {a: b, b: a}.get(tag.dim, tag.dim)
        return [tag._replace(dim=d)]
    if name == "permute":
        dims = args[1:] if not isinstance(args[1], (tuple, list)) else args[1]
        dims = [int(d) % x.dim() for d in dims]
        return [tag._replace(dim=dims.index(tag.dim))]
    if name in ("chunk", "split", "tensor_split"):
        dim = kwargs.get("dim", args[2] if len(args) > 2 else 0) % x.dim()
        pieces = list(out)
        if dim != tag.dim:
            return [tag] * len(pieces)
        sizes = {p.shape[dim] for p in pieces}
        if tag.parts > 1 and len(pieces) == tag.parts and len(sizes) == 1:
            return [Slice(tag.dim, tag.offset, tag.whole // tag.parts)] * len(pieces)
        return None
    if name == "unbind":
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0) % x.dim()
        if dim == tag.dim:
            return None
        return [tag._replace(dim=tag.dim - (dim < tag.dim))] * len(out)
    if name == "__getitem__":
        return [_indexed(tag, x, args[1])]
    if name in ("matmul", "bmm", "__matmul__"):
        return [_matmul(args[0], args[1], out)]
    if name == "scaled_dot_product_attention":
        q = args[0] if args else kwargs["query"]
        qt = slice_of(q)
        if qt is None or qt.dim >= q.dim() - 2:
            return None
        return [qt._replace(dim=qt.dim + out.dim() - q.dim())]
    if name == "layer_norm":
        shape = args[1] if len(args) > 1 else kwargs["normalized_shape"]
        if tag.dim >= x.dim() - len(tuple(shape)):
            return None
        return [tag]
    if name in ("linear",):
        if tag.dim == x.dim() - 1 or not (len(tagged) == 1 and tagged[0][0] is args[0]):
            return None  # contracting the split dim gives a partial sum
        return [tag]
    if name in ("expand", "expand_as"):
        return [tag._replace(dim=tag.dim + out.dim() - x.dim())] if out.shape[tag.dim + out.dim() - x.dim()] == \
            x.shape[tag.dim] else None
    if name in ("cat", "stack"):
        tensors = args[0]
        dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
        tags = {slice_of(t) for t in tensors}
        if len(tags) != 1:
            return None
        dim = dim % out.dim()
        if name == "cat":
            return None if dim == tag.dim else [tag]
        return [tag._replace(dim=tag.dim + (dim <= tag.dim))]
    return None


def _broadcast(out: torch.Tensor, tagged) -> Slice | Unknown | None:
    tags = set()
    for t, tag in tagged:
        if isinstance(tag, Unknown):
            return tag
        tags.add(tag._replace(dim=tag.dim + out.dim() - t.dim()))
    return tags.pop() if len(tags) == 1 else None


def _reshaped(tag: Slice, shape: tuple, new: tuple) -> Slice | None:
    """Where the split dim lands when ``shape`` is viewed as ``new``.

    A view keeps the row-major order: the split dim ``d`` (local size ``n``, ``I`` elements
    after each of its indices) is the run of "digits" ``[I, n*I)``. It lands on the first
    dim ``e`` of ``new`` whose elements-after-and-including is ``n*I``; if the dims after ``e``
    hold ``J >= I`` elements, ``d`` was split (the slice is on ``e``, in units of ``J/I``),
    else it was merged with the ``I/J`` after it. No such ``e``: ``d`` was merged with a dim
    before it, and the slice is not one range of any dim."""
    if tag.parts != 1:
        return None
    n = shape[tag.dim]
    inner = math.prod(shape[tag.dim + 1:])
    right = [math.prod(new[k:]) for k in range(len(new) + 1)]
    for e in range(len(new)):
        if right[e] != n * inner:
            continue
        after = right[e + 1]
        if after >= inner:
            if after % inner:
                return None
            unit = after // inner
            if tag.offset % unit or tag.whole % unit:
                return None
            return Slice(e, tag.offset // unit, tag.whole // unit)
        if inner % after:
            return None
        unit = inner // after
        return Slice(e, tag.offset * unit, tag.whole * unit)
    return None


def _indexed(tag: Slice, x: torch.Tensor, index) -> Slice | None:
    index = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis for i in index):
        k = index.index(Ellipsis)
        fill = x.dim() - (len(index) - 1 - sum(i is None for i in index))
        index = index[:k] + (slice(None),) * fill + index[k + 1:]
    d_in = d_out = 0
    new_dim = None
    for i in index + (slice(None),) * (x.dim() - sum(i is not None for i in index)):
        if i is None:
            d_out += 1
            continue
        if d_in == tag.dim:
            if not (isinstance(i, slice) and i == slice(None)):
                return None
            new_dim = d_out
        if isinstance(i, int):
            d_in += 1
            continue
        if isinstance(i, torch.Tensor):
            return None
        d_in += 1
        d_out += 1
    return None if new_dim is None else tag._replace(dim=new_dim)


def _matmul(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> Slice | None:
    found = set()
    for t, is_a in ((a, True), (b, False)):
        tag = slice_of(t)
        if tag is None:
            continue
        if isinstance(tag, Unknown) or t.dim() < 2:
            return None
        if tag.dim < t.dim() - 2:  # a batch dim
            found.add(tag._replace(dim=tag.dim + out.dim() - t.dim()))
        elif is_a and tag.dim == t.dim() - 2:  # a's rows
            found.add(tag._replace(dim=out.dim() - 2))
        elif not is_a and tag.dim == t.dim() - 1:  # b's columns
            found.add(tag._replace(dim=out.dim() - 1))
        else:
            return None  # the contracted dim: a partial sum
    return found.pop() if len(found) == 1 else None
