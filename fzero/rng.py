"""fzero's randomness: dropout masks that do not depend on how the batch is laid out.

Inside a step fzero runs (any :class:`fzero.Step`: ``fzero.compile``'s, or a transform's), a
dropout's mask is not drawn from torch's generator. Each element's keep/drop bit is a hash of

* the state's ``seed`` (``TrainState.create(..., seed=0)``, checkpointed with the state),
* the update (``state.step``),
* which dropout call of the step's forward it is (the first, the second, ...),
* the element's sample: its row's index in the *global* batch, and
* the element's position within its sample, counted in the whole tensor,

so a row's mask is the same whichever data-parallel rank, micro-batch or tensor-parallel
rank holds it: a run is the same run at any layout, and a per-rank ``torch.manual_seed``
changes nothing. This is the counter-based generator JAX's explicit keys make natural
(``jax.random.fold_in``), applied to the dropout torch code calls.

What is covered (torch's functions of these names are fzero's while a step runs):
``torch.nn.functional.dropout`` (so ``nn.Dropout`` and the Hugging Face models that call
either), ``torch.dropout``, ``dropout1d``/``dropout2d``/``dropout3d`` (one bit per sample and
channel) and ``scaled_dot_product_attention(dropout_p=)`` (computed as its reference math,
softmax(QKᵀ·scale + mask), then the dropout, then ·V). Anything else random a model draws
(``torch.rand``, ``bernoulli``, ``alpha_dropout``) draws from torch's generator, which the
step seeds from (seed, update, data-parallel rank): reproducible and identical on
tensor-parallel peers, but not layout-invariant.

The rules a model must follow for the invariance to hold: its tensors are batch-major (the
leading dim is the batch's rows, possibly flattened with the next ones: ``(B, T, C)`` or
``(B*T, C)``), and dropout is called the same number of times, in the same order, on every
layout. Activation checkpointing (``fzero.remat``, ``torch.utils.checkpoint``, Hugging
Face's gradient checkpointing) recomputes the same masks: the call's number is read from
torch's generator, whose state every checkpoint restores for its recomputation.

The hash is Chris Wellons' two-multiply integer hash (the ``lowbias32`` family, constants
``0x21f0aaad``, ``0x735a2d97``: both below 2³¹, so the products of 32-bit values fit in
int64 and torch computes it exactly on every device), applied twice per element.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from fzero import tree
from fzero.core import context, register_step_scope, rehearsing

__all__ = ["Slice", "Unknown", "calls_before", "compiled_region", "dropout_keep", "fold_in", "hash32", "mix32", "rehearsed_calls",
           "slice_of", "tracking_slices", "with_slice"]

_M32 = 0xFFFFFFFF
_C1, _C2 = 0x21F0AAAD, 0x735A2D97
_GOLDEN = 0x9E3779B9


class Slice(NamedTuple):
    """Where a tensor sits in a whole one that tensor-parallel ranks split: on ``dim`` it
    holds ``[offset, offset + n)`` of ``whole`` (``n`` its own size there); with ``parts``,
    that dim is ``parts`` equal blocks (a fused q/k/v projection's) and it holds
    ``[offset, offset + n / parts)`` of each block of ``whole / parts``.

    Tensor-parallel code tags the tensors it splits (:func:`with_slice`); a dropout reads the
    tag (:func:`slice_of`) to draw the slice of the whole tensor's mask."""

    dim: int
    offset: int
    whole: int
    parts: int = 1


class Unknown(NamedTuple):
    """A tensor computed from a split one by ``op``, whose place in the whole tensor is not
    known: a dropout on it is an error naming ``op``."""

    op: str


#: The key of a tagged tensor's ``__dict__`` that holds its :class:`Slice` or :class:`Unknown`
#: (read and written by :func:`slice_of` and :func:`with_slice`, and directly by the
#: tensor-parallel tracker, which looks at every operation's tensors).
SLICE_ATTR = "_fzero_slice"


_COMPILED_REGION: contextvars.ContextVar[bool] = contextvars.ContextVar("fzero_compiled_region", default=False)
_TRACKED: contextvars.ContextVar[bool] = contextvars.ContextVar("fzero_tracked_outside", default=False)


@contextlib.contextmanager
def compiled_region() -> Iterator[None]:
    """While a ``compile(jit=)`` compiled forward runs (its graph breaks, where drawn dropouts
    run, included): the slice trackers are off the mode stack (a compiled graph's tensors
    carry no tags out of it; a drawn dropout there is refused, see ``keep``), the other
    modes stay in their order."""
    token = _COMPILED_REGION.set(True)
    popped = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())][::-1]
    kept = [m for m in popped if not getattr(m, "tracks_slices", False)]
    tracked = _TRACKED.set(len(kept) < len(popped))
    for m in kept:
        torch._C._push_on_torch_function_stack(m)
    try:
        yield
    finally:
        for _ in kept:
            torch._C._pop_torch_function_stack()
        for m in popped:
            torch._C._push_on_torch_function_stack(m)
        _TRACKED.reset(tracked)
        _COMPILED_REGION.reset(token)


def tracking_slices() -> bool:
    """Whether a tensor-parallel slice tracker was active when the running compiled forward
    began (or is active now)."""
    from torch.overrides import _get_current_function_mode_stack

    return _TRACKED.get() or any(getattr(m, "tracks_slices", False) for m in _get_current_function_mode_stack())


def slice_of(t: Any) -> Slice | Unknown | None:
    """The :class:`Slice` (or :class:`Unknown`) tag of a tensor; ``None`` for a whole one
    (and inside a graph being compiled, whose tensors carry no tags)."""
    if torch.compiler.is_compiling():
        return None
    return t.__dict__.get(SLICE_ATTR) if isinstance(t, torch.Tensor) else None


def with_slice(t: torch.Tensor, tag: Slice | Unknown | None) -> torch.Tensor:
    """Tag ``t`` (in place; returns it). ``None`` marks it whole. Nothing inside a graph being
    compiled (see :func:`compiled_region`)."""
    if torch.compiler.is_compiling():
        return t
    if tag is None:
        t.__dict__.pop(SLICE_ATTR, None)
    else:
        t.__dict__[SLICE_ATTR] = tag
    return t


def mix32(x: int) -> int:
    """The 32-bit hash of an int in ``[0, 2³²)`` (a bijection).

    Example:
        >>> mix32(0), mix32(1) != mix32(2)
        (0, True)
    """
    x ^= x >> 16
    x = (x * _C1) & _M32
    x ^= x >> 15
    x = (x * _C2) & _M32
    x ^= x >> 15
    return x


def _mix(x: torch.Tensor) -> torch.Tensor:
    """:func:`mix32` of every element of an int64 tensor holding values in ``[0, 2³²)``."""
    x = x ^ (x >> 16)
    x = (x * _C1) & _M32
    x = x ^ (x >> 15)
    x = (x * _C2) & _M32
    return x ^ (x >> 15)


def _mix_(x: torch.Tensor) -> torch.Tensor:
    """:func:`_mix` in place (a tensor of its own: no allocation per pass)."""
    x.bitwise_xor_(x >> 16).mul_(_C1).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15).mul_(_C2).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 15)


def hash32(*values: int) -> int:
    """One 32-bit key from integers of any size (each folded in 32 bits at a time).

    Example:
        >>> hash32(0, 1) != hash32(1, 0)
        True
    """
    h = 0
    for v in values:
        v = int(v)
        chunks = [v & _M32, (v >> 32) & _M32] if 0 <= v < 1 << 64 else [(v % (1 << 64)) & _M32, (v % (1 << 64)) >> 32]
        for c in chunks:
            h = mix32((h ^ (c + _GOLDEN + ((h << 6) & _M32) + (h >> 2))) & _M32)
    return h


def dropout_keep(shape: tuple[int, ...], p: float, *, key: int, start: int, rows: int,
                 device: torch.device | str = "cpu", slice: Slice | None = None) -> torch.Tensor:  # noqa: A002
    """Which elements of a tensor of ``shape`` a dropout of rate ``p`` keeps (a bool tensor).

    The tensor's elements are read as ``rows`` samples of equal size (batch-major), the
    first being the global batch's row ``start``; each element's bit is a hash of ``key``,
    its sample's global index and its position within the sample. With ``slice``, the tensor
    is one tensor-parallel rank's slice of a larger one (:class:`Slice`), and positions are
    counted in the whole tensor: every rank's mask is its slice of the same whole mask.

    An element is kept when its 32-bit hash is at least ``round(p * 2³²)``: the rate is ``p``
    to 2⁻³².

    Example:
        >>> keep = dropout_keep((4, 1000), 0.25, key=7, start=0, rows=4)
        >>> abs(keep.float().mean().item() - 0.75) < 0.03
        True
        >>> bool((dropout_keep((2, 1000), 0.25, key=7, start=2, rows=2) == keep[2:]).all())  # rows 2-3 alone
        True
    """
    shape = tuple(shape)
    # Per dim: (this rank's index -> the whole tensor's index, the whole size).
    dims = [(None, n) for n in shape]
    if slice is not None:
        n = shape[slice.dim]
        per = n // slice.parts
        local = torch.arange(n, dtype=torch.int64, device=device)
        whole_index = (local // per) * (slice.whole // slice.parts) + slice.offset + local % per
        dims[slice.dim] = (whole_index, slice.whole)
    if rows >= 1 and shape and shape[0] % rows == 0 and (slice is None or slice.dim != 0):
        # Batch-major: the leading dim holds the rows (or rows x a flattened time dim), and
        # a sample is the leading index // (leading size / rows).
        lead = shape[0] // rows
        inner = [(None, lead)] + dims[1:]
        local_inner = (lead,) + shape[1:]
    else:
        # Not batch-major (a weight's DropConnect, say): keyed as one sample of its own.
        rows, start = 1, _M32
        inner, local_inner = dims, shape
    # Each element's position within its sample, counted in the whole sample.
    pos = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for (index, whole_n), n in reversed(list(zip(inner, local_inner))):
        idx = (torch.arange(n, dtype=torch.int64, device=device) if index is None else index) * stride
        pos = idx.view(-1, *([1] * pos.dim())) + pos
        stride *= whole_n
    pos = pos.reshape(1, -1)
    samples = torch.arange(start, start + rows, dtype=torch.int64, device=device).view(-1, 1)
    k1, k2 = hash32(key, 1), hash32(key, 2)
    row_key = _mix(_mix((samples + _GOLDEN) & _M32) ^ k1)
    bits = _mix_(pos ^ row_key)  # (rows, per-sample): the one full-size allocation
    bits = _mix_(bits.bitwise_xor_(k2))
    threshold = min(int(round(p * 2 ** 32)), 2 ** 32)
    return (bits >= threshold).reshape(shape)


# --------------------------------------------------------------------------- the step's randomness


class _Scaled(torch.autograd.Function):
    """``x * keep / (1 - p)``, keeping only the bool mask for backward (as torch's fused
    dropout keeps its mask)."""

    @staticmethod
    def forward(ctx, x, keep, scale):
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return torch.where(keep, x * scale, torch.zeros((), dtype=x.dtype, device=x.device))

    @staticmethod
    def backward(ctx, g):
        (keep,) = ctx.saved_tensors
        return torch.where(keep, g * ctx.scale, torch.zeros((), dtype=g.dtype, device=g.device)), None, None


class Randomness:
    """The randomness of one step: its seed, its update and the local batch's rows.

    Dropout calls number themselves by a value drawn from torch's generator (seeded for the
    step), so a recomputation under activation checkpointing, which restores that generator,
    finds the number -- and the rows -- its first run had, even from the autograd engine's
    device threads, where the step's handlers are not installed.
    """

    def __init__(self, seed: int, update: int, rows: int):
        self.seed, self.update, self.rows = seed, update, rows
        self.calls: dict[int, tuple] = {}  # tag -> (call number in its unit, start, rows, slice)
        self.numbered: dict[tuple, int] = {}  # unit -> calls so far
        self.offset = 0  # calls made before this code in the whole model (a pipeline stage's)
        self.rehearsed = 0  # calls made in a rehearsal (a pipeline's handshake)

    def position(self) -> tuple[int, int, tuple]:
        """``(start, rows, unit)``: the running (micro-)batch's rows in the global batch."""
        here = context()
        d, m, pm = here.data_shard, here.micro_batch, here.pipeline_micro_batch
        per = self.rows // m.count if m.count > 0 else self.rows
        start = d.index * self.rows + m.index * per
        if pm.count > 1:
            per_p = per // pm.count
            start, per = start + pm.index * per_p, per_p
        return start, per, (m.index, pm.index)

    def keep(self, x: torch.Tensor, p: float, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        shape = tuple(x.shape) if shape is None else shape
        if rehearsing():  # only shapes matter: number nothing
            self.rehearsed += 1
            return torch.ones(shape, dtype=torch.bool, device=x.device)
        tag = int(torch.randint(0, 2 ** 62, (), dtype=torch.int64))
        known = self.calls.get(tag)
        if known is None:  # a first run (a recomputation finds its tag)
            sequence = context().sequence_shard
            if sequence.count > 1:
                raise ValueError(
                    f"fzero: a dropout of p={p} under Ulysses sequence parallelism (sp={sequence.count}): this "
                    "rank holds a slice of each sequence, and fzero's masks are keyed by position in the whole "
                    "tensor, which a slice of the sequence does not carry; its mask would not be the one the "
                    "whole model draws. Train with dropout 0 under sp (docs/parallelism.md)")
            where = slice_of(x)
            if where is None and _COMPILED_REGION.get() and tracking_slices():
                raise ValueError(
                    "fzero: a dropout inside a model compiled by compile(jit=) under tensor parallelism: the "
                    "compiled graph does not carry which slice of the whole tensor this rank holds, so its mask "
                    "would not be the one the whole model draws (not the same run at another tp). Use jit=False "
                    "with tp, or a dropout of p=0 (docs/guide.md, jit)")
            if isinstance(where, Unknown):
                raise ValueError(
                    f"fzero: a dropout of a tensor computed from a tensor-parallel layer's slice by {where.op!r}, "
                    "an operation after which fzero cannot tell which slice of the whole tensor this rank holds; "
                    "its mask would not be the one the whole model draws (so not the same run at another tp). "
                    "Move the dropout after the row-parallel layer, or compute the tensor with views, "
                    "transposes, element-wise maps and batched matmuls (docs/parallelism.md)")
            if where is not None and where.dim >= len(shape):
                where = None  # a channel dropout's mask does not reach the split dim
            start, rows, unit = self.position()
            # Counted per part of the model too: a rank running several pipeline stages
            # (interleaved 1F1B) numbers each stage's calls after its own offset.
            unit = (*unit, self.offset)
            number = self.numbered.get(unit, 0)
            self.numbered[unit] = number + 1
            known = self.calls[tag] = (self.offset + number, start, rows, where)
        number, start, rows, where = known
        return dropout_keep(shape, p, key=hash32(self.seed, self.update, number), start=start, rows=rows,
                            device=x.device, slice=where)

    # ---------------------------------------------------------------- the functions replaced

    def dropout(self, x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False):
        if not training or p == 0.0:
            return x
        _check_p(p)
        out = self._apply(x, self.keep(x, p), p, inplace)
        return with_slice(out, slice_of(x))  # where x sits, so does its dropout

    def channel_dropout(self, x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False,
                        *, dims: int = 2):
        """dropout1d/2d/3d: one bit per (sample, channel), broadcast over the feature dims."""
        if not training or p == 0.0:
            return x
        _check_p(p)
        batched = x.dim() == dims + 2
        shape = tuple(x.shape[:2]) if batched else (1, x.shape[0])
        keep = self.keep(x, p, shape)
        keep = keep.view(*shape, *([1] * dims)) if batched else keep.view(x.shape[0], *([1] * dims))
        return self._apply(x, keep.expand_as(x), p, inplace)

    @staticmethod
    def _apply(x, keep, p, inplace):
        if p >= 1.0:
            return x.mul_(0) if inplace else x * 0
        scale = 1.0 / (1.0 - p)
        if inplace:
            return x.mul_(torch.where(keep, scale, 0.0).to(x.dtype))
        return _Scaled.apply(x, keep, scale)

    def attention(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False):
        """``scaled_dot_product_attention`` as its documented math, with this step's dropout
        (torch's own kernel when ``dropout_p`` is 0)."""
        if not dropout_p:
            return _ORIGINAL["scaled_dot_product_attention"](query, key, value, attn_mask=attn_mask, dropout_p=0.0,
                                                             is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        L, S = query.size(-2), key.size(-2)
        scale = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
        if enable_gqa and key.size(-3) != query.size(-3):
            rep = query.size(-3) // key.size(-3)
            key, value = key.repeat_interleave(rep, -3), value.repeat_interleave(rep, -3)
        scores = (query @ key.transpose(-2, -1)) * scale
        if is_causal:
            causal = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
            scores = scores.masked_fill(~causal, float("-inf"))
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
                else scores + attn_mask
        probs = torch.softmax(scores, dim=-1)
        probs = self.dropout(probs, dropout_p, True)
        return probs @ value


def rehearsed_calls() -> int:
    """How many dropout calls the step's rehearsals have made so far (0 outside a step)."""
    return 0 if _ACTIVE is None else _ACTIVE.rehearsed


@contextlib.contextmanager
def calls_before(n: int) -> Iterator[None]:
    """Within the block, dropout calls are numbered from ``n``: the code running is the part
    of a model after ``n`` dropout calls of the whole (a pipeline stage after the stages
    before it), so its masks are those the whole model draws at those calls."""
    rng = _ACTIVE
    if rng is None:
        yield
        return
    old, rng.offset = rng.offset, n
    try:
        yield
    finally:
        rng.offset = old


def _check_p(p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")


# --------------------------------------------------------------------------- torch's functions, replaced for the step

# The step's dropouts reach fzero through torch's own names, replaced for the duration of the
# step and put back after: ``F.dropout`` (what ``nn.Dropout`` and Hugging Face's models call),
# ``torch.dropout``, the channel dropouts and ``F.scaled_dot_product_attention``. Names, not a
# ``TorchFunctionMode``: a mode is not active inside the autograd engine, where activation
# checkpointing recomputes the forward, and a recomputation must draw the same masks. The
# active randomness is a plain global, not a context variable, for the same reason (CUDA's
# backward runs on the engine's own threads).
_ORIGINAL = {"dropout": F.dropout, "torch.dropout": torch.dropout, "dropout1d": F.dropout1d,
             "dropout2d": F.dropout2d, "dropout3d": F.dropout3d,
             "scaled_dot_product_attention": F.scaled_dot_product_attention}
_ACTIVE: Randomness | None = None

# Under ``fzero.compile(jit=)`` a dropout that draws is a graph break: the drawing functions
# below are made opaque to the compiler (``torch.compiler.disable``, by :func:`make_opaque`,
# which compile's jit calls: not at import, since ``torch.compiler.disable`` imports dynamo
# and with it triton) and run as they run eagerly, so a compiled forward draws exactly the
# eager step's masks. Traced, the call's number and key would be Python ints
# baked into the graph (a recompilation every update), and the tag drawn from torch's
# generator (``Randomness.keep``) is read as a Python int, which a graph cannot do. A dropout
# that draws nothing (``p == 0``, not training) is torch's own and stays in the graph, so a
# model with its dropout off compiles whole.


def _dropout(input, p=0.5, training=True, inplace=False):
    if not training or p == 0.0:  # nothing drawn: torch's own returns its input (traceable)
        return _ORIGINAL["dropout"](input, p, training, inplace)
    return _drawn_dropout(input, p, training, inplace)


def _drawn_dropout(input, p, training, inplace):
    rng = _ACTIVE
    if rng is None:
        return _ORIGINAL["dropout"](input, p, training, inplace)
    return rng.dropout(input, p, training, inplace)


def _torch_dropout(input, p, train):
    if not train or p == 0.0:
        return _ORIGINAL["torch.dropout"](input, p, train)
    return _drawn_torch_dropout(input, p, train)


def _drawn_torch_dropout(input, p, train):
    rng = _ACTIVE
    if rng is None:
        return _ORIGINAL["torch.dropout"](input, p, train)
    return rng.dropout(input, p, train)


def _drawn_channel(input, p, training, inplace, dims, name):
    rng = _ACTIVE
    if rng is None:
        return _ORIGINAL[name](input, p, training, inplace)
    return rng.channel_dropout(input, p, training, inplace, dims=dims)


def _channel(dims: int, name: str):
    def dropout_nd(input, p=0.5, training=True, inplace=False):
        if not training or p == 0.0:
            return _ORIGINAL[name](input, p, training, inplace)
        return _drawn_channel(input, p, training, inplace, dims, name)
    dropout_nd.__name__ = name
    return dropout_nd


def _attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if not dropout_p:  # torch's own kernel (traceable)
        return _ORIGINAL["scaled_dot_product_attention"](query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                                         is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return _drawn_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _drawn_attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    rng = _ACTIVE
    if rng is None:
        return _ORIGINAL["scaled_dot_product_attention"](query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                                         is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return rng.attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


_OPAQUE = False


def make_opaque() -> None:
    """Make the functions that draw a mask opaque to ``torch.compile`` (graph breaks that run
    eagerly): ``fzero.compile(jit=)`` calls it when it builds its step. Idempotent."""
    global _OPAQUE, _drawn_dropout, _drawn_torch_dropout, _drawn_channel, _drawn_attention
    if not _OPAQUE:
        _drawn_dropout, _drawn_torch_dropout, _drawn_channel, _drawn_attention = (
            torch.compiler.disable(f) for f in (_drawn_dropout, _drawn_torch_dropout, _drawn_channel, _drawn_attention))
        _OPAQUE = True


# (owner, attribute, fzero's function, the key of torch's own in _ORIGINAL)
_REPLACED = [(F, "dropout", _dropout, "dropout"), (torch, "dropout", _torch_dropout, "torch.dropout"),
             (F, "dropout1d", _channel(1, "dropout1d"), "dropout1d"),
             (F, "dropout2d", _channel(2, "dropout2d"), "dropout2d"),
             (F, "dropout3d", _channel(3, "dropout3d"), "dropout3d"),
             (F, "scaled_dot_product_attention", _attention, "scaled_dot_product_attention")]


def _seed_generators(seed: int) -> None:
    torch.random.default_generator.manual_seed(seed)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed(seed)


def fold_in(value: int) -> None:
    """Inside a step: reseed torch's generator from its own next draw and ``value``, as
    ``jax.random.fold_in`` derives a key. ``shard_state`` folds in the data-parallel rank, so
    ranks that hold different rows draw different numbers for whatever else a model draws
    (``torch.rand``, ...), while tensor-parallel peers, which hold the same rows, draw the
    same. Outside a step it does nothing."""
    if _ACTIVE is None:
        return
    _seed_generators(hash32(int(torch.randint(0, 2 ** 62, (), dtype=torch.int64)), value))


@contextlib.contextmanager
def _step_randomness(state: Any, batch: Any) -> Iterator[None]:
    """The step's randomness, opened by the outermost step (see ``register_step_scope``):
    torch's generator forked and seeded from (seed, update) for whatever else draws from it
    (``shard_state`` folds the data-parallel rank in), and the dropouts keyed as this module
    says. A state without a ``seed`` (not a ``TrainState``) keeps torch's own randomness."""
    global _ACTIVE
    seed = getattr(state, "seed", None)
    if not isinstance(seed, torch.Tensor) or _ACTIVE is not None:
        yield
        return
    seed, update = int(seed), int(getattr(state, "step", 0))
    rows = tree.leading_size(batch) or 1
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    _ACTIVE = Randomness(seed, update, rows)
    for owner, name, fn, _ in _REPLACED:
        setattr(owner, name, fn)
    try:
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            _seed_generators(hash32(seed, update, 0x5EED))
            yield
    finally:
        _ACTIVE = None
        for owner, name, _, key in _REPLACED:
            setattr(owner, name, _ORIGINAL[key])


register_step_scope(_step_randomness)
