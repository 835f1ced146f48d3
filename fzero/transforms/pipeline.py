"""``pipeline``: GPipe and 1F1B pipeline parallelism over the mesh's ``pp`` axis.

The user gives *stages* -- pure functions ``stage(params, x) -> y``, each owning some keys of
the params dict (or :func:`split` of an ``nn.Sequential``) -- and a loss on the last stage.
``fzero.pipeline`` returns a :class:`Pipeline`, a ``value_and_grad``-shaped function::

    loss, grads = pipe(params, x, y)

Rank ``s`` on the ``pp`` axis runs stage ``s`` on each of ``m`` micro-batches in the order
the schedule gives (GPipe: all forwards, then all backwards; 1F1B: at most ``p - s``
micro-batches in flight), sends activations forward and their gradients backward with real
point-to-point sends (shapes agreed once, then cached), and accumulates this stage's
parameter gradients. The loss is computed on the last stage and broadcast to every stage.

How it composes (see docs/pipeline.md): the whole schedule runs inside *one* call of the
``value_and_grad`` primitive, whose differentiated function returns the loss through a
small autograd function that hands the accumulated gradients to whatever asked for them.
So every handler of the primitive sees one ordinary call per step: ``mixed_precision``
casts and scales (the schedule seeds its backward with the loss scale), ``shard_state``
gathers (stage 3) and reduces each stage's gradients over ``dp`` once per step -- not once
per micro-batch -- and ``accumulate`` runs whole pipelined steps. ``pipe.transform(step)``
keeps only this stage's parameters in the state (so each ``dp`` group shards one stage's
parameters) and turns 0-dim ``psum`` reductions (a global norm, fp16's overflow flag) into
all-reduces over ``pp`` as well.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.func import functional_call

from fzero import tree
from fzero._params import Params, frozen_names, trainable
from fzero.distributed import comm
from fzero.distributed.mesh import Mesh
from fzero.transforms._core import Handler, Step, as_step, bind, installed
from fzero.transforms.accumulate import split_batch

__all__ = ["Pipeline", "Stage", "StageError", "pipeline", "schedule", "split"]

WHERE = "fzero.pipeline"
SCHEDULES = ("gpipe", "1f1b")
_MAX_DIMS = 8
# Dtypes an activation may have, by code (sent in the shape handshake).
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)


class StageError(ValueError):
    """A stage cannot run on what it is given (raised on every rank of the pipeline)."""


# --------------------------------------------------------------------------- stages


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pipeline stage: a pure function and the parameter names it owns.

    Attributes:
        fn: ``fn(params, x) -> y``; ``params`` holds exactly ``keys``.
        keys: names in the params dict this stage uses. A name owned by several stages is a
            *tied* weight (an embedding used again as the head): each of those stages holds
            a copy, and their gradients are summed before the update, so the copies stay
            equal.
        in_shape: optional trailing dims the stage expects of its input (e.g. ``(64,)``);
            checked before the first step, so a mismatch names both shapes.
    """

    fn: Callable
    keys: tuple[str, ...]
    in_shape: tuple[int, ...] | None = None

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"{WHERE}.Stage: fn must be callable as fn(params, x), got {type(self.fn).__name__}")
        if isinstance(self.keys, str) or not isinstance(self.keys, Iterable):
            raise TypeError(f"{WHERE}.Stage: keys must be a sequence of parameter names, got {self.keys!r}")
        object.__setattr__(self, "keys", tuple(dict.fromkeys(self.keys)))
        if self.in_shape is not None:
            object.__setattr__(self, "in_shape", tuple(int(d) for d in self.in_shape))


class _ModuleStage:
    """``params, x -> sub(x)`` for a slice of an ``nn.Sequential``, parameters by full name."""

    def __init__(self, sub: torch.nn.Module, names: dict[str, str]):
        self.sub, self.names = sub, names  # names: the slice's own name -> the full model's

    def __call__(self, params: dict, x):
        given = {local: params[full] for local, full in self.names.items()}
        given.update(dict(self.sub.named_buffers()))
        return functional_call(self.sub, given, (x,), strict=True, tie_weights=True)

    def __repr__(self) -> str:
        return f"<stage {type(self.sub).__name__} of {len(self.sub)} modules>"


_ELEMENTWISE = (torch.nn.Tanh, torch.nn.ReLU, torch.nn.GELU, torch.nn.SiLU, torch.nn.Sigmoid,
                torch.nn.Dropout, torch.nn.Identity)


def _expected_shape(sub: torch.nn.Module) -> tuple[int, ...] | None:
    """Trailing input dims of a slice, read from its first layer where that layer says."""
    for m in sub.modules():
        if next(m.children(), None) is not None:
            continue
        if isinstance(m, torch.nn.Linear):
            return (m.in_features,)
        if isinstance(m, torch.nn.LayerNorm):
            return tuple(m.normalized_shape)
        if not isinstance(m, _ELEMENTWISE):
            return None
    return None


def split(module: torch.nn.Sequential, boundaries: Sequence[int]) -> list[Stage]:
    """Cut an ``nn.Sequential`` into stages at the given child indices.

    Args:
        module: the model, an ``nn.Sequential`` (the ``apply`` of ``fzero.functionalize``
            of it gives the params dict these stages index).
        boundaries: indices of the children that start stages 1, 2, ...: ``[2, 5]`` gives
            ``module[0:2]``, ``module[2:5]``, ``module[5:]``.

    Returns:
        One :class:`Stage` per slice; its ``keys`` are the full model's parameter names
        (a weight shared by two slices is a tied weight of both), its ``in_shape`` read
        from the slice's first ``Linear`` or ``LayerNorm`` where there is one.

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``.
        ValueError: boundaries not strictly increasing inside ``(0, len(module))``.

    Example:
        >>> import torch, fzero
        >>> stages = fzero.transforms.pipeline.split(torch.nn.Sequential(
        ...     torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)), [2])
        >>> [s.keys for s in stages]
        [('0.weight', '0.bias'), ('2.weight', '2.bias')]
    """
    if not isinstance(module, torch.nn.Sequential):
        raise TypeError(f"{WHERE}.split: expected an nn.Sequential, got {type(module).__name__} "
                        "(write the stages as fzero.pipeline.Stage(fn, keys) instead)")
    n = len(module)
    cuts = [0, *[int(b) for b in boundaries], n]
    if any(b <= a for a, b in zip(cuts, cuts[1:])):
        raise ValueError(f"{WHERE}.split: boundaries {list(boundaries)} must increase strictly inside (0, {n})")
    full: dict[int, str] = {}
    for name, p in module.named_parameters():
        full.setdefault(id(p), name)
    stages = []
    for a, b in zip(cuts, cuts[1:]):
        sub = module[a:b]
        names = {local: full[id(p)] for local, p in sub.named_parameters(remove_duplicate=False)}
        stages.append(Stage(_ModuleStage(sub, names), tuple(names.values()), _expected_shape(sub)))
    return stages


# --------------------------------------------------------------------------- schedules


def schedule(kind: Literal["gpipe", "1f1b"], stages: int, micro_batches: int, stage: int) -> list[tuple[str, int]]:
    """The order in which ``stage`` runs forwards ``("F", j)`` and backwards ``("B", j)``.

    GPipe (Huang et al. 2019) runs every forward, then every backward: a stage holds ``m``
    micro-batches' activations. 1F1B (PipeDream-Flush, Narayanan et al. 2021) runs
    ``p - s - 1`` warm-up forwards, then alternates one forward and one backward: stage
    ``s`` never holds more than ``p - s`` micro-batches, whatever ``m``. Both leave the
    bubble ``(p - 1) / (m + p - 1)`` of the step with balanced stages and free
    communication (whatever a backward costs relative to a forward).

    Example:
        >>> schedule("1f1b", 2, 3, 0)
        [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
    """
    m, p = micro_batches, stages
    if kind == "gpipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
    if kind != "1f1b":
        raise ValueError(f"{WHERE}: schedule={kind!r} must be one of {', '.join(map(repr, SCHEDULES))}")
    warm = min(p - stage - 1, m)
    ops = [("F", j) for j in range(warm)]
    for k in range(m - warm):
        ops += [("F", warm + k), ("B", k)]
    return ops + [("B", j) for j in range(m - warm, m)]


# --------------------------------------------------------------------------- helpers


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {str(x.dtype).replace('torch.', '')} tensor of shape {tuple(x.shape)}"
    leaves = [v for v in tree.leaves(x) if isinstance(v, torch.Tensor)]
    return f"a {type(x).__name__} of {len(leaves)} tensors (first of shape " \
           f"{tuple(leaves[0].shape) if leaves else '-'})"


def _fmt(shape, dtype) -> str:
    return f"{tuple(shape)} ({str(dtype).replace('torch.', '')})"


def _signature(x) -> tuple:
    return tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v) for v in tree.leaves(x))


def _loss_scale() -> float:
    """The scale a ``mixed_precision`` handler will multiply the loss by (1.0 if none).

    The schedule seeds every micro-batch's backward with it, so fp16 gradients are born
    scaled, exactly as in the plain step (where autograd carries the scale down from the
    scaled loss)."""
    from fzero.functional import loss_scale

    return float(loss_scale())


class _Deliver(torch.autograd.Function):
    """Returns the loss; its backward hands out the gradients the schedule accumulated.

    This is how one pipelined step looks like one differentiable function to the
    ``value_and_grad`` primitive: whatever asked for gradients of the parameters (the plain
    engine, ZeRO's reduce-as-you-go sink, a cast to fp32 masters) receives them through
    the autograd engine as if the step's backward had produced them. ``seed`` is the
    gradient the schedule seeded the loss with; the incoming gradient divided by it is
    exactly 1.0 in the usual case, so the hand-over adds no rounding.
    """

    @staticmethod
    def forward(ctx, loss, seed, grads, *params):
        ctx.seed, ctx.grads = seed, grads
        ctx.dtypes = [p.dtype for p in params]
        return loss.clone()

    @staticmethod
    def backward(ctx, g):
        grads, ctx.grads = ctx.grads, None
        factor = g.float() / ctx.seed
        out = [None if a is None else (a * factor).to(dt) for a, dt in zip(grads, ctx.dtypes)]
        return (None, None, None, *out)


def _targets(ptensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """What the schedule differentiates: each parameter, or the tensor it is a view of.

    A transform may hand the stage views into flat buffers (ZeRO); re-gathering a ZeRO-3
    unit writes its buffer in place, which gives the views new autograd nodes, so a
    micro-batch's graph is only found again from the buffer itself. Gradients of the
    buffers are what ``value_and_grad`` wants anyway."""
    out, seen = [], set()
    for p in ptensors:
        t = p._base if p._base is not None and p._base.requires_grad else p
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


class _Box:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


class _SavedBytes:
    """Counts bytes of distinct storages autograd saved for backward, live now and at the
    peak: what a schedule keeps of its micro-batches' activations (``exclude``: storages
    held anyway, the parameters and the batch)."""

    def __init__(self, exclude: Sequence[torch.Tensor]):
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.live: dict[int, list[int]] = {}
        self.now = self.peak = 0

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr == 0 or ptr in self.exclude:
            return t
        entry = self.live.get(ptr)
        if entry is None:
            nbytes = t.untyped_storage().nbytes()
            self.live[ptr] = [1, nbytes]
            self.now += nbytes
            self.peak = max(self.peak, self.now)
        else:
            entry[0] += 1
        box = _Box(t)
        weakref.finalize(box, self._release, ptr)
        return box

    def _release(self, ptr):
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.live[ptr]

    @staticmethod
    def unpack(x):
        return x.t if isinstance(x, _Box) else x


# --------------------------------------------------------------------------- the pipeline


class Pipeline:
    """A pipelined ``value_and_grad``: ``loss, grads = pipe(params, x, y)``.

    Made by :func:`pipeline`. Attributes: ``stages``, ``loss_fn``, ``mesh``,
    ``micro_batches``, ``schedule``, ``stage`` (this rank's stage index), ``tied`` (name ->
    stages holding it), and ``stats`` (of the last call: ``max_in_flight``, ``compute_s``,
    ``step_s``, ``bubble``, and ``peak_saved_bytes`` with ``measure_memory=True``).
    """

    def __init__(self, stages, loss_fn, mesh: Mesh, micro_batches: int, kind: str, timeout_s: float,
                 measure_memory: bool):
        self.stages = stages
        self.loss_fn = loss_fn
        self.mesh = mesh
        self.micro_batches = micro_batches
        self.schedule = kind
        self.timeout_s = timeout_s
        self.measure_memory = measure_memory
        self.p = mesh.size("pp")
        self.stage = mesh.coords["pp"]
        self.group = mesh.group("pp")
        self.device = mesh.device
        holders: dict[str, list[int]] = {}
        for i, s in enumerate(stages):
            for k in s.keys:
                holders.setdefault(k, []).append(i)
        self.tied = {k: tuple(h) for k, h in holders.items() if len(h) > 1}
        self._channel = None
        self._agreed: dict[tuple, tuple] = {}
        self.stats: dict[str, Any] = {}

    def __repr__(self) -> str:
        return (f"<fzero pipeline: {self.p} stages, {self.micro_batches} micro-batches, {self.schedule}; "
                f"this rank runs stage {self.stage}>")

    # ---------------------------------------------------------------- public helpers

    @property
    def keys(self) -> tuple[str, ...]:
        """The parameter names this rank's stage owns."""
        return self.stages[self.stage].keys

    def stage_params(self, params: dict) -> dict:
        """This rank's stage's entries of ``params`` (a dict by parameter name).

        Raises:
            KeyError: some of the stage's names are missing (names them).
        """
        if not isinstance(params, dict):
            raise TypeError(f"{WHERE}: params must be a dict of parameters by name, got {type(params).__name__}")
        missing = [k for k in self.keys if k not in params]
        if missing:
            raise KeyError(f"{WHERE}: stage {self.stage}'s parameters are missing from params: {missing[:8]}"
                           + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
        out = {k: params[k] for k in self.keys}
        if isinstance(params, Params):  # keep which of them are frozen
            return Params(out, frozen=params.frozen & out.keys())
        return out

    def init(self, state):
        """The state keeping only this stage's parameters, with its optimizer state rebuilt
        over them. Call it on a fresh state, before any other transform's ``init``
        (``pipe.transform(step)`` does).

        Raises:
            ValueError: the state was already prepared by another transform.
        """
        if "master" in state.extra or any(hasattr(v, "__fzero_gather__") for v in tree.leaves(state.params)):
            raise ValueError(f"{WHERE}: init the pipeline before the other transforms (make pipe.transform "
                             "the outermost transform): this state is already partitioned or cast")
        local = self.stage_params(state.params)
        # On the mesh's device first: the optimizer state is built there, and the sends of
        # activations and gradients move tensors of that device.
        local = self.mesh.place(state.replace(params=local)).params
        return state.replace(params=local, opt_state=state.tx.init(trainable(local)))

    def transform(self, step: Callable) -> Step:
        """``step`` as a pipeline step: outermost of the transforms.

        ``init`` keeps this stage's parameters (then runs the inner transforms' ``init``, so
        ``shard_state`` partitions one stage's parameters over its ``dp`` group); the step
        turns every 0-dim ``psum`` (a global gradient norm, fp16's overflow flag) into an
        all-reduce over ``pp`` too, so every stage clips by, and skips on, the same verdict.
        Per-leaf ``psum`` vectors (LAMB's trust ratios) are left to the stage.
        """
        inner = as_step(step)
        handler = _PipelineHandler(self)

        def call(state, batch):
            with installed(handler):
                return inner(state, batch)

        return Step(call, before=self.init, name=f"pipeline({inner.__name__}, {self.schedule}, m={self.micro_batches})",
                    inner=inner)

    def gather(self, params: dict) -> dict:
        """Full parameters of every stage, on every rank (for tests, logging and export).

        ``params`` is this rank's stage dict, possibly sharded by ``shard_state``; a tied
        weight is taken from the first stage holding it.
        """
        from fzero.distributed.gather import gather

        full = gather(self.stage_params(params))
        if self.p == 1:
            return full
        out: dict[str, torch.Tensor] = {}
        for k, st in enumerate(self.stages):
            names = [n for n in st.keys if n not in out]
            hdr = torch.zeros(max(len(names), 1), 2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
            if k == self.stage:
                for i, n in enumerate(names):
                    hdr[i] = torch.tensor(_encode(full[n].shape, full[n].dtype))
            self._broadcast(hdr, k, f"broadcast(parameter shapes of stage {k})")
            for i, n in enumerate(names):
                shape, dtype = _decode(hdr[i])
                t = full[n] if k == self.stage else torch.empty(shape, dtype=dtype, device=self.device)
                self._broadcast(t, k, f"broadcast(parameter {n!r} of stage {k})")
                out[n] = t
        return out

    # ---------------------------------------------------------------- the call

    def __call__(self, params: dict, x, y=None):
        """``(loss, grads)`` of the mean over micro-batches of ``loss_fn(stages(x), y)``.

        Args:
            params: the params dict (this stage's names at least; other names get zero
                gradients).
            x: the input of stage 0 (a tensor or pytree), split on its leading dim into
                ``micro_batches``; every rank of the pipeline passes the same batch (only
                the first stage reads ``x``, only the last reads ``y``).
            y: the targets passed to ``loss_fn``, split likewise (or ``None``).

        Returns:
            ``(loss, grads)``: the loss of the whole batch on every rank; ``grads`` a dict
            with the keys of ``params``.

        Raises:
            ValueError: the batch does not split into ``micro_batches`` (names both sizes).
            StageError: on every rank, a stage that cannot run on its input (its output
                and the next stage's input disagree: names the stage and both shapes).
        """
        local = self.stage_params(params)
        m = self.micro_batches
        xs = split_batch(x, m, where=WHERE)
        ys = [None] * m if y is None else split_batch(y, m, where=WHERE)
        value, grads = bind("value_and_grad", self._run, local, (xs, ys), {}, has_aux=False)
        if len(local) == len(params):
            return value, grads
        frozen = frozen_names(params)
        out = {k: grads[k] if k in grads else None if k in frozen else torch.zeros_like(v) for k, v in params.items()}
        return value, (Params(out, frozen=frozen) if isinstance(params, Params) else out)

    # ---------------------------------------------------------------- communication

    @property
    def channel(self):
        if self._channel is None:
            from fzero.distributed.p2p import Channel

            self._channel = Channel(self.group, timeout_s=self.timeout_s, where=WHERE)
        return self._channel

    def _broadcast(self, t: torch.Tensor, src_stage: int, name: str) -> torch.Tensor:
        src = dist.get_global_rank(self.group, src_stage)
        comm.run(name, lambda: dist.broadcast(t, src=src, group=self.group, async_op=True),
                 timeout_s=self.timeout_s, where=WHERE)
        return t

    # ---------------------------------------------------------------- shapes, agreed once

    def _agree(self, params, x0, y0) -> tuple:
        """Run each stage once on micro-batch 0's shapes, in stage order, and tell every rank
        what each stage gives (or why it failed): every rank then knows the shapes it
        receives, or raises the same error. Cached by the input's signature."""
        key = (_signature(x0), _signature(y0), torch.is_autocast_enabled(self.device.type),
               torch.get_autocast_dtype(self.device.type))
        if key in self._agreed:
            return self._agreed[key]
        s, p = self.stage, self.p
        in_meta = out_meta = None
        for k in range(p):
            msg = torch.zeros(3 + _MAX_DIMS, dtype=torch.int64, device=self.device)
            text = ""
            if k == s:
                text, out = self._try_stage(params, x0, y0, in_meta)
                if text:
                    msg[0] = 1
                elif out is not None:
                    msg[1:] = torch.tensor(_encode(*out))
            if p > 1:
                self._broadcast(msg, k, f"broadcast(output shape of stage {k})")
            if int(msg[0]):
                if p > 1:
                    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=self.device)
                    n = self._broadcast(torch.tensor([data.numel()], device=self.device), k, "broadcast(error length)")
                    buf = data if k == s else torch.empty(int(n), dtype=torch.uint8, device=self.device)
                    text = bytes(self._broadcast(buf, k, "broadcast(error)").tolist()).decode()
                raise StageError(text)
            if k == s - 1:
                in_meta = _decode(msg[1:])
            if k == s and k < p - 1:
                out_meta = _decode(msg[1:])
        self._agreed[key] = (in_meta, out_meta)
        return in_meta, out_meta

    def _try_stage(self, params, x0, y0, in_meta) -> tuple[str, tuple | None]:
        """Run this stage (and, on the last, the loss) on zeros of the input's shape; return
        ``(error text, (shape, dtype) of the output)``. No gradients; the RNG is restored."""
        s, st = self.stage, self.stages[self.stage]
        last = s == self.p - 1
        if s == 0:
            inp, given = x0, f"on {_describe(x0)} (a micro-batch of x)"
        else:
            shape, dtype = in_meta
            given = f"on stage {s - 1}'s output {_fmt(shape, dtype)} per micro-batch"
            if st.in_shape is not None and tuple(shape[len(shape) - len(st.in_shape):]) != st.in_shape:
                return (f"{WHERE}: stage {s - 1}'s output and stage {s}'s input disagree: stage {s - 1} gives "
                        f"shape {tuple(shape)}, stage {s} expects (..., {', '.join(map(str, st.in_shape))})"), None
            inp = torch.zeros(shape, dtype=dtype, device=self.device)
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                out = st.fn(params, inp)
        except Exception as e:  # noqa: BLE001  (reported on every rank, with the original text)
            expects = f" (it expects (..., {', '.join(map(str, st.in_shape))}))" if st.in_shape else ""
            return f"{WHERE}: stage {s}{expects} failed {given}: {type(e).__name__}: {e}", None
        if not isinstance(out, torch.Tensor):
            return f"{WHERE}: stage {s} must return one tensor, got {type(out).__name__}", None
        if not last:
            if out.dim() > _MAX_DIMS or out.dtype not in _DTYPES:
                return f"{WHERE}: stage {s}'s output {_fmt(out.shape, out.dtype)} cannot be sent", None
            return "", (tuple(out.shape), out.dtype)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                loss = self.loss_fn(out, y0)
        except Exception as e:  # noqa: BLE001
            return (f"{WHERE}: loss_fn failed on the last stage's output {_fmt(out.shape, out.dtype)}: "
                    f"{type(e).__name__}: {e}"), None
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
            got = _fmt(loss.shape, loss.dtype) if isinstance(loss, torch.Tensor) else type(loss).__name__
            return f"{WHERE}: loss_fn must return a floating-point scalar tensor, got {got}", None
        return "", None

    # ---------------------------------------------------------------- the schedule

    def _run(self, params: dict, xs: list, ys: list):
        """The function ``value_and_grad`` differentiates: runs the whole schedule, returns
        the loss through :class:`_Deliver` carrying the accumulated gradients."""
        t_start = time.perf_counter()
        in_meta, out_meta = self._agree(params, xs[0], ys[0])
        s, p, m = self.stage, self.p, self.micro_batches
        first, last = s == 0, s == p - 1
        st = self.stages[s]
        names = [k for k in self.keys if isinstance(params[k], torch.Tensor) and params[k].requires_grad]
        ptensors = [params[k] for k in names]
        targets = _targets(ptensors)
        scale = _loss_scale()
        grads_in = in_meta is not None and (in_meta[1].is_floating_point or in_meta[1].is_complex)
        grads_out = out_meta is not None and (out_meta[1].is_floating_point or out_meta[1].is_complex)
        # Parameters and the caller's batch (micro-batches of stage 0 are views of it) are
        # held whatever the schedule: what is counted is what the schedule keeps.
        meter = _SavedBytes(ptensors + [v for mb in xs for v in tree.leaves(mb) if isinstance(v, torch.Tensor)]) \
            if self.measure_memory else None
        acc: list[torch.Tensor | None] = [None] * len(targets)
        saved: dict[int, tuple] = {}
        losses: list[torch.Tensor | None] = [None] * m
        in_flight = max_in_flight = 0
        compute = 0.0
        for op, j in schedule(self.schedule, p, m, s):
            if op == "F":
                if first:
                    inp = xs[j]
                else:
                    inp = torch.empty(in_meta[0], dtype=in_meta[1], device=self.device)
                    self.channel.recv(inp, s - 1, f"the activation of micro-batch {j} (stage {s - 1} -> {s})")
                    if grads_in:
                        inp.requires_grad_(True)
                t0 = time.perf_counter()
                if meter is not None:
                    with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                        out = self._forward(st, params, inp, ys[j], last)
                else:
                    out = self._forward(st, params, inp, ys[j], last)
                compute += time.perf_counter() - t0
                if last:
                    losses[j] = out.detach().float()
                else:
                    if tuple(out.shape) != out_meta[0] or out.dtype != out_meta[1]:
                        raise StageError(f"{WHERE}: stage {s} gave {_fmt(out.shape, out.dtype)} on micro-batch "
                                         f"{j}, but {_fmt(*out_meta)} on micro-batch 0 of the first step: "
                                         "shapes must not change between micro-batches")
                    self.channel.isend(out.detach(), s + 1, f"the activation of micro-batch {j}")
                saved[j] = (inp, out)
                in_flight += 1
                max_in_flight = max(max_in_flight, in_flight)
                continue
            inp, out = saved.pop(j)
            if last:
                out, seed = out.float(), torch.tensor(scale, dtype=torch.float32, device=out.device)
            elif grads_out:
                seed = torch.empty(out_meta[0], dtype=out_meta[1], device=self.device)
                self.channel.recv(seed, s + 1, f"the gradient of micro-batch {j} (stage {s + 1} -> {s})")
            else:
                seed = None
            send_grad = not first and grads_in
            wrt = targets + ([inp] if send_grad else [])
            t0 = time.perf_counter()
            if seed is not None and out.requires_grad and wrt:
                # Backward outside autocast, as the plain step's backward runs.
                with torch.autocast(self.device.type, enabled=False):
                    gs = torch.autograd.grad(out, wrt, seed, allow_unused=True)
            else:
                gs = [None] * len(wrt)
            for i, g in enumerate(gs[: len(targets)]):
                if g is None:
                    continue
                low = g.dtype in (torch.bfloat16, torch.float16)
                if acc[i] is None:  # a copy: autograd may hand out one tensor twice (x + b)
                    acc[i] = g.float() if low else g.clone()
                else:
                    acc[i].add_(g)
            compute += time.perf_counter() - t0
            if send_grad:
                g_in = gs[-1] if gs[-1] is not None else torch.zeros_like(inp)
                self.channel.isend(g_in.detach(), s - 1, f"the gradient of micro-batch {j}")
            del inp, out, gs
            in_flight -= 1
        if p > 1:
            self.channel.flush()
        for a in acc:
            if a is not None:
                a.div_(m)  # the mean over micro-batches: a mean loss gives the full batch's gradient
        self._sync_tied(dict(zip(names, ptensors)), targets, acc)
        loss = self._loss(losses)
        step_s = time.perf_counter() - t_start
        self.stats = {"schedule": self.schedule, "micro_batches": m, "max_in_flight": max_in_flight,
                      "compute_s": compute, "step_s": step_s, "bubble": max(0.0, 1.0 - compute / step_s)}
        if meter is not None:
            self.stats["peak_saved_bytes"] = meter.peak
        return _Deliver.apply(loss, scale, acc, *targets)

    def _forward(self, st: Stage, params, inp, y, last: bool):
        out = st.fn(params, inp)
        if last:
            out = self.loss_fn(out, y)
            if not (isinstance(out, torch.Tensor) and out.numel() == 1):
                raise StageError(f"{WHERE}: loss_fn must return a scalar tensor, got {_describe(out)}")
            out = out.reshape(())
        return out

    def _loss(self, losses) -> torch.Tensor:
        if self.stage == self.p - 1:
            total = losses[0].clone()
            for v in losses[1:]:
                total += v
            total /= self.micro_batches
        else:
            total = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.p > 1:
            total = total.reshape(1)
            self._broadcast(total, self.p - 1, "broadcast(loss from the last stage)")
            total = total.reshape(())
        return total

    def _sync_tied(self, params: dict, targets: list, acc: list) -> None:
        """Sum the gradients of each tied weight over the stages holding it.

        Every holder sends its gradients of the weights it shares with another holder and
        receives theirs (point to point, tag 1), then adds them in stage order, so every
        holder gets the same bits and its copy stays equal to the others after the update.
        """
        if not self.tied or self.p == 1:
            return
        s = self.stage
        shared = {h: [n for n, hs in sorted(self.tied.items()) if s in hs and h in hs and n in params]
                  for h in range(self.p) if h != s}
        shared = {h: ns for h, ns in shared.items() if ns}
        if not shared:
            return
        mine = {}
        for ns in shared.values():
            for n in ns:
                mine[n] = self._grad_of(params[n], targets, acc)
        for h, ns in shared.items():
            self.channel.isend(torch.cat([mine[n].float().reshape(-1) for n in ns]), h,
                               f"the gradients of tied weights {ns}", tag=1)
        received: dict[int, dict[str, torch.Tensor]] = {}
        for h, ns in shared.items():
            buf = torch.empty(sum(mine[n].numel() for n in ns), dtype=torch.float32, device=self.device)
            self.channel.recv(buf, h, f"the gradients of tied weights {ns} (stage {h} -> {s})", tag=1)
            parts = buf.split([mine[n].numel() for n in ns])
            received[h] = {n: t.view(mine[n].shape) for n, t in zip(ns, parts)}
        self.channel.flush()
        for n, g in mine.items():
            parts = [g.float() if h == s else received[h][n] for h in self.tied[n]]
            total = parts[0].clone()
            for t in parts[1:]:
                total += t
            g.copy_(total)

    def _grad_of(self, p: torch.Tensor, targets: list, acc: list) -> torch.Tensor:
        """The accumulated gradient of parameter ``p``, as a view into ``acc`` (made zeros
        where nothing reached it), whether ``p`` is a target itself or a view of one."""
        for i, t in enumerate(targets):
            if t is p or p._base is t:
                if acc[i] is None:
                    acc[i] = torch.zeros(t.shape, dtype=torch.float32, device=t.device)
                if t is p:
                    return acc[i]
                return acc[i].as_strided(p.shape, p.stride(), p.storage_offset() - t.storage_offset())
        raise AssertionError("unreachable: every parameter is a target or a view of one")


def _encode(shape, dtype) -> list[int]:
    shape = tuple(shape)
    return [_DTYPES.index(dtype), len(shape), *shape, *([0] * (_MAX_DIMS - len(shape)))]


def _decode(v: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    vals = [int(x) for x in v.tolist()]
    return tuple(vals[2: 2 + vals[1]]), _DTYPES[vals[0]]


class _PipelineHandler(Handler):
    def __init__(self, pipe: Pipeline):
        self.pipe = pipe

    def psum(self, value, *, next):
        pipe = self.pipe
        if pipe.p > 1 and isinstance(value, torch.Tensor) and value.dim() == 0:
            value = value.reshape(1).clone()
            comm.run("all_reduce(psum over pp)",
                     lambda: dist.all_reduce(value, group=pipe.group, async_op=True),
                     timeout_s=pipe.timeout_s, where=WHERE)
            value = value.reshape(())
        return next(value)


# --------------------------------------------------------------------------- the transform


def _as_stage(s, i: int) -> Stage:
    if isinstance(s, Stage):
        return s
    if isinstance(s, tuple) and len(s) in (2, 3):
        return Stage(*s)
    raise TypeError(f"{WHERE}: stage {i} must be a fzero.pipeline.Stage(fn, keys) or a pair (fn, keys), "
                    f"got {type(s).__name__}" + (" (a bare function does not say which parameters it owns)"
                                                 if callable(s) else ""))


def pipeline(
    stages: Sequence[Stage | tuple],
    loss_fn: Callable,
    mesh: Mesh | None = None,
    *,
    micro_batches: int = 1,
    schedule: Literal["gpipe", "1f1b"] = "1f1b",  # noqa: F811
    timeout_s: float | None = None,
    measure_memory: bool = False,
) -> Pipeline:
    """Pipeline parallelism over the mesh's ``pp`` axis: a pipelined ``value_and_grad``.

    Args:
        stages: one per rank of the ``pp`` axis, in order: :class:`Stage` ``(fn, keys)``
            (or pairs), or ``fzero.pipeline.split(module, boundaries)``.
        loss_fn: ``loss_fn(out, y) -> scalar`` on the last stage's output and targets; a
            mean over the micro-batch, so that the mean over micro-batches is the batch's.
        mesh: the :class:`fzero.Mesh` (default ``Mesh(pp=len(stages), dp=-1)``).
        micro_batches: ``m``, how many pieces the batch is cut into on its leading dim.
        schedule: ``"1f1b"`` (at most ``p - s`` micro-batches' activations on stage ``s``)
            or ``"gpipe"`` (all ``m``).
        timeout_s: how long a receive or a collective may wait (default: the mesh's).
        measure_memory: count the bytes autograd saves for backward on this stage (in
            ``pipe.stats["peak_saved_bytes"]``); it installs saved-tensor hooks, so not
            together with ``shard_state(stage=3)``.

    Returns:
        A :class:`Pipeline`: ``loss, grads = pipe(params, x, y)``; ``pipe.transform(step)``
        to keep one stage's parameters per rank; ``pipe.gather(params)`` for all of them.

    Raises:
        ValueError: the number of stages is not the ``pp`` size (on every rank); an
            unknown schedule; ``micro_batches`` not a positive int.
        NotImplementedError: a mesh with a ``tp`` axis.

    Example:
        >>> import torch, fzero
        >>> from fzero.transforms.pipeline import pipeline, split
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
        >>> apply, params = fzero.functionalize(model)
        >>> pipe = pipeline(split(model, []), torch.nn.functional.mse_loss, micro_batches=2)
        >>> loss, grads = pipe(params, torch.ones(4, 3), torch.zeros(4, 1))
        >>> sorted(grads) == sorted(params)
        True
    """
    if isinstance(stages, (Stage, tuple)) or not isinstance(stages, Sequence) or not stages:
        raise TypeError(f"{WHERE}: stages must be a non-empty list of stages, got {type(stages).__name__}")
    stages = [_as_stage(s, i) for i, s in enumerate(stages)]
    if not callable(loss_fn):
        raise TypeError(f"{WHERE}: loss_fn must be callable as loss_fn(out, y), got {type(loss_fn).__name__}")
    if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
        raise ValueError(f"{WHERE}: micro_batches={micro_batches!r} must be a positive int")
    if schedule not in SCHEDULES:
        raise ValueError(f"{WHERE}: schedule={schedule!r} must be one of {', '.join(map(repr, SCHEDULES))}")
    mesh = mesh if mesh is not None else Mesh(pp=len(stages), dp=-1)
    if mesh.size("tp") > 1:
        raise NotImplementedError(f"{WHERE}: {mesh} has a tp axis; tensor parallelism is not supported yet")
    if len(stages) != mesh.size("pp"):
        raise ValueError(f"{WHERE}: {len(stages)} stages, but the mesh's pp axis has {mesh.size('pp')} ranks "
                         f"({mesh}); give one stage per pp rank")
    timeout_s = mesh.timeout_s if timeout_s is None else float(timeout_s)
    return Pipeline(stages, loss_fn, mesh, micro_batches, schedule, timeout_s, measure_memory)


# ``fzero.pipeline.split(...)``, ``fzero.pipeline.Stage(...)``: the helpers ride on the function.
pipeline.Stage = Stage
pipeline.StageError = StageError
pipeline.Pipeline = Pipeline
pipeline.split = split
pipeline.schedule = globals()["schedule"]
