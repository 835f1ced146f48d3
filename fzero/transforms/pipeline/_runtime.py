"""The pipeline at run time: :class:`Pipeline` runs this stage's side of the schedule
inside one ``value_and_grad`` call -- receives, forwards, sends, backwards seeded with the
loss scale, gradients accumulated -- and hands the gradients over through ``_Deliver``
(``_deliver.py``); :func:`pipeline` checks the options and builds it; ``_PipelineHandler``
carries 0-dim ``psum`` reductions over ``pp``."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from fzero import means, rng, tree
from fzero._params import frozen_names, like_params, trainable
from fzero.distributed import comm
from fzero.distributed.mesh import Mesh
from fzero.core import Handler, MicroBatch, Step, as_step, bind, context, installed, loss_scale, run_backward, running
from fzero.transforms._batches import split_batch
from fzero.transforms.pipeline._deliver import _Deliver, _targets
from fzero.transforms.pipeline._handshake import _MAX_DIMS, Handshake, _decode, _describe, _encode, _fmt, broadcast
from fzero.transforms.pipeline._layout import PipelineLayout
from fzero.transforms.pipeline._memory import _SavedBytes
from fzero.transforms.pipeline._schedule import SCHEDULES
from fzero.transforms.pipeline._schedule import check as check_schedule
from fzero.transforms.pipeline._schedule import ops as schedule_ops
from fzero.transforms.pipeline._schedule import slots
from fzero.transforms.pipeline._stages import (WHERE, Stage, StageError, _as_stage, _ModuleStage, held_by_rank,
                                               stage_params)
from fzero.transforms.pipeline._tied import sum_tied_grads, tied_weights


# --------------------------------------------------------------------------- the pipeline


class Pipeline:
    """A pipelined ``value_and_grad``: ``loss, grads = pipe(params, x, y)``.

    Made by :func:`pipeline`. Attributes: ``stages`` (the model's, ``p * v`` of them),
    ``loss_fn``, ``mesh``, ``micro_batches``, ``schedule``, ``virtual_stages`` (``v``),
    ``stage`` (this rank's index on ``pp``), ``chunks`` (the model stages it runs: ``stage,
    stage + p, ...``), ``tied`` (name -> ranks holding it), and ``stats`` (of the last call:
    ``max_in_flight``, ``compute_s``, ``step_s``, ``bubble``, ``busy_slots``,
    ``idle_slots``, ``bubble_slots``, and ``peak_saved_bytes`` with ``measure_memory=True``).
    """

    def __init__(self, stages, loss_fn, mesh: Mesh, micro_batches: int, kind: str, timeout_s: float,
                 measure_memory: bool, virtual_stages: int = 1):
        self.stages = stages
        self.virtual_stages = virtual_stages
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
        self.chunks = tuple(range(self.stage, len(stages), self.p))
        # What each rank holds: the parameters and buffers of its model stages, together.
        self.held = held_by_rank(stages, self.p)
        self.tied = tied_weights(self.held)
        self._channel = None
        self._shapes = Handshake(stages, loss_fn, self.stage, self.p, self.device, self.group, timeout_s)
        self.stats: dict[str, Any] = {}
        self._deferred = False  # the last call's loss used a deferred fzero.global_mean
        self._buffers: dict | None = None  # the running step's state.buffers (this stage's)
        self._timeline: dict | None = None  # this rank's busy and idle slots (``slots``)

    def __repr__(self) -> str:
        if self.virtual_stages > 1:
            return (f"<fzero pipeline: {len(self.stages)} stages on {self.p} ranks, {self.micro_batches} "
                    f"micro-batches, {self.schedule}; this rank runs stages {list(self.chunks)}>")
        return (f"<fzero pipeline: {self.p} stages, {self.micro_batches} micro-batches, {self.schedule}; "
                f"this rank runs stage {self.stage}>")

    # ---------------------------------------------------------------- public helpers

    @property
    def keys(self) -> tuple[str, ...]:
        """The parameter names this rank's stages own."""
        return self.held[self.stage].keys

    def stage_params(self, params: dict) -> dict:
        """This rank's stage's entries of ``params`` (a dict by parameter name).

        Raises:
            KeyError: some of the stage's names are missing (names them).
        """
        return stage_params(self.held, self.stage, params)

    def init(self, state):
        """The state keeping only this stage's parameters, with its optimizer state rebuilt
        over them. Call it on a fresh state, before any other transform's ``init``
        (``pipe.transform(step)`` does).

        Raises:
            ValueError: the state was already prepared by another transform.
        """
        if state.master is not None or any(hasattr(v, "__fzero_gather__") for v in tree.leaves(state.params)):
            raise ValueError(f"{WHERE}: init the pipeline before the other transforms (make pipe.transform "
                             "the outermost transform): this state is already partitioned or cast")
        local = self.stage_params(state.params)
        # This stage's buffers only (what its forward updates), as its parameters.
        buffers = {k: state.buffers[k] for k in self.held[self.stage].buffers if k in state.buffers}
        # On the mesh's device first: the optimizer state is built there, and the sends of
        # activations and gradients move tensors of that device.
        placed = self.mesh.place(state.replace(params=local, buffers=buffers))
        local = placed.params
        # The record of which stage holds what: fzero.gather(state) and fzero.load_into put every
        # stage's parameters and buffers on every rank from it.
        layout = PipelineLayout(self.p, self.stage, tuple(st.keys for st in self.held), group=self.group,
                                timeout_s=self.timeout_s, buffer_keys=tuple(st.buffers for st in self.held))
        return state.replace(params=local, buffers=placed.buffers, opt_state=state.tx.init(trainable(local)),
                             pipeline=layout)

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
            self._buffers = getattr(state, "buffers", None)  # the stages of split() run on them
            try:
                with installed(handler):
                    return inner(state, batch)
            finally:
                self._buffers = None

        v = f", v={self.virtual_stages}" if self.virtual_stages > 1 else ""
        name = f"pipeline({inner.__name__}, {self.schedule}, m={self.micro_batches}{v})"
        return Step(call, before=self.init, name=name, inner=inner)

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
        for k, st in enumerate(self.held):
            names = [n for n in st.keys if n not in out]
            hdr = torch.zeros(max(len(names), 1), 2 + _MAX_DIMS, dtype=torch.int64, device=self.device)
            if k == self.stage:
                for i, n in enumerate(names):
                    hdr[i] = torch.tensor(_encode(full[n].shape, full[n].dtype))
            self._broadcast(hdr, k, f"broadcast(parameter shapes of stage {k})", "metadata")
            for i, n in enumerate(names):
                shape, dtype = _decode(hdr[i])
                t = full[n] if k == self.stage else torch.empty(shape, dtype=dtype, device=self.device)
                self._broadcast(t, k, f"broadcast(parameter {n!r} of stage {k})", "gather")
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
        if self._deferred:  # a deferred global mean's loss: corrected in place once the count is whole
            means.returned(value)
        if len(local) == len(params):
            return value, grads
        frozen = frozen_names(params)
        out = {k: grads[k] if k in grads else None if k in frozen else torch.zeros_like(v) for k, v in params.items()}
        return value, like_params(params, out, frozen)

    # ---------------------------------------------------------------- communication

    @property
    def channel(self):
        if self._channel is None:
            from fzero.distributed.p2p import Channel

            self._channel = Channel(self.group, timeout_s=self.timeout_s, where=WHERE)
        return self._channel

    def _broadcast(self, t: torch.Tensor, src_stage: int, name: str, what: str) -> torch.Tensor:
        return broadcast(t, src_stage, name, group=self.group, timeout_s=self.timeout_s, what=what)

    # ---------------------------------------------------------------- the schedule

    def _run(self, params: dict, xs: list, ys: list):
        """The function ``value_and_grad`` differentiates: runs the whole schedule, returns
        the loss through :class:`_Deliver` carrying the accumulated gradients."""
        t_start = time.perf_counter()
        metas = self._shapes.agree(params, xs[0], ys[0])
        s, p, m, v = self.stage, self.p, self.micro_batches, self.virtual_stages
        n = len(self.stages)
        names = [k for k in self.keys if isinstance(params[k], torch.Tensor) and params[k].requires_grad]
        ptensors = [params[k] for k in names]
        targets = _targets(ptensors)
        # Seed each micro-batch's backward with the scale mixed_precision multiplies the
        # loss by, so fp16 gradients are born scaled as in the plain step.
        scale = float(loss_scale())

        def floating(meta):
            return meta is not None and (meta[1].is_floating_point or meta[1].is_complex)

        def tag(c: int, what: str) -> int:
            # One stream per model stage and direction (several share a pair of ranks when
            # interleaved); in order within a stream, as each stage runs its micro-batches.
            return 0 if v == 1 else 2 + 2 * c + (what == "activation_gradients")

        # Parameters and the caller's batch (micro-batches of stage 0 are views of it) are
        # held whatever the schedule: what is counted is what the schedule keeps.
        meter = _SavedBytes(ptensors + [t for mb in xs for t in tree.leaves(mb) if isinstance(t, torch.Tensor)]) \
            if self.measure_memory else None
        acc: list[torch.Tensor | None] = [None] * len(targets)
        saved: dict[tuple[int, int], tuple] = {}
        before = means.deferred_state() if s == p - 1 else None
        losses: list[torch.Tensor | None] = [None] * m
        in_flight = max_in_flight = 0
        compute = 0.0
        for op, j, c in schedule_ops(self.schedule, p, m, s, v):
            first, last = c == 0, c == n - 1
            in_meta, out_meta, dropouts_before = metas[c]
            if op == "F":
                if first:
                    inp = xs[j]
                else:
                    inp = torch.empty(in_meta[0], dtype=in_meta[1], device=self.device)
                    self.channel.recv(inp, (c - 1) % p, f"the activation of micro-batch {j} (stage {c - 1} -> {c})",
                                      what="activations", tag=tag(c - 1, "activations"))
                    if floating(in_meta):
                        inp.requires_grad_(True)
                t0 = time.perf_counter()
                # Which micro-batch runs, for what keys itself by its rows (dropout, global means).
                with running(pipeline_micro_batch=MicroBatch(j, m)), rng.calls_before(dropouts_before):
                    if meter is not None:
                        with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                            out = self._forward(self.stages[c], params, inp, ys[j], last)
                    else:
                        out = self._forward(self.stages[c], params, inp, ys[j], last)
                compute += time.perf_counter() - t0
                if last:
                    losses[j] = out.detach().float()
                else:
                    if tuple(out.shape) != out_meta[0] or out.dtype != out_meta[1]:
                        raise StageError(f"{WHERE}: stage {c} gave {_fmt(out.shape, out.dtype)} on micro-batch "
                                         f"{j}, but {_fmt(*out_meta)} on micro-batch 0 of the first step: "
                                         "shapes must not change between micro-batches")
                    self.channel.isend(out.detach(), (c + 1) % p, f"the activation of micro-batch {j}",
                                       what="activations", tag=tag(c, "activations"))
                saved[(j, c)] = (inp, out)
                in_flight += 1
                max_in_flight = max(max_in_flight, in_flight)
                continue
            inp, out = saved.pop((j, c))
            if last:
                out, seed = out.float(), torch.tensor(scale, dtype=torch.float32, device=out.device)
            elif floating(out_meta):
                seed = torch.empty(out_meta[0], dtype=out_meta[1], device=self.device)
                self.channel.recv(seed, (c + 1) % p, f"the gradient of micro-batch {j} (stage {c + 1} -> {c})",
                                  what="activation_gradients", tag=tag(c + 1, "activation_gradients"))
            else:
                seed = None
            send_grad = not first and floating(in_meta)
            wrt = targets + ([inp] if send_grad else [])
            t0 = time.perf_counter()
            if seed is not None and out.requires_grad and wrt:
                # Backward outside autocast, as the plain step's backward runs.
                # A recomputation (remat) in it keys by the same rows.
                with torch.autocast(self.device.type, enabled=False), \
                        running(pipeline_micro_batch=MicroBatch(j, m)), rng.calls_before(dropouts_before):
                    gs = run_backward(out, wrt, seed, accumulate=False)
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
                self.channel.isend(g_in.detach(), (c - 1) % p, f"the gradient of micro-batch {j}",
                                   what="activation_gradients", tag=tag(c, "activation_gradients"))
            del inp, out, gs
            in_flight -= 1
        if p > 1:
            self.channel.flush()
        for a in acc:
            if a is not None:
                a.div_(m)  # the mean over micro-batches: a mean loss gives the full batch's gradient
        if self.tied and p > 1:  # (``self.channel`` is made on first use; a lone stage never makes it)
            sum_tied_grads(dict(zip(names, ptensors)), targets, acc, tied=self.tied, stage=s, channel=self.channel,
                           device=self.device)
        loss = self._loss(losses, before)
        step_s = time.perf_counter() - t_start
        # The schedule's timeline in unit slots (a chunk's forward 1, its backward 2,
        # communication free): this rank's busy and idle slots over the step.
        if self._timeline is None:  # the same every step: the schedule's shape is fixed
            self._timeline = slots(self.schedule, p, m, v)[s]
        timeline = self._timeline
        self.stats = {"schedule": self.schedule, "micro_batches": m, "virtual_stages": v,
                      "max_in_flight": max_in_flight, "compute_s": compute, "step_s": step_s,
                      "bubble": max(0.0, 1.0 - compute / step_s), "busy_slots": timeline["busy"],
                      "idle_slots": timeline["idle"], "bubble_slots": timeline["idle"] / timeline["busy"]}
        if meter is not None:
            self.stats["peak_saved_bytes"] = meter.peak
        return _Deliver.apply(loss, scale, acc, *targets)

    def _forward(self, st: Stage, params, inp, y, last: bool):
        if self._buffers is not None and isinstance(st.fn, _ModuleStage):
            out = st.fn(params, inp, buffers=self._buffers)
        else:
            out = st.fn(params, inp)
        if last:
            since = means.mark()
            out = self.loss_fn(out, y)
            if isinstance(out, torch.Tensor):
                means.check_loss(out, since, getattr(self.loss_fn, "__name__", "loss_fn"))
            if not (isinstance(out, torch.Tensor) and out.numel() == 1):
                raise StageError(f"{WHERE}: loss_fn must return a scalar tensor, got {_describe(out)}")
            out = out.reshape(())
        return out

    def _loss(self, losses, before) -> torch.Tensor:
        """The mean loss over the micro-batches, on every stage. With it the last stage
        sends what a deferred ``fzero.global_mean`` in ``loss_fn`` counted (the count of this
        call's micro-batches and the provisional divisor): the stages before it take the
        same count on, so that every stage scales its gradients by the same factor once
        the update's count is whole (``fzero/means.py``)."""
        # [loss, whether a deferred global mean was used, its count in this call, its divisor]
        out = torch.zeros(4, dtype=torch.float64, device=self.device)
        deferred = False
        if self.stage == self.p - 1:
            total = losses[0].clone()
            for v in losses[1:]:
                total += v
            total /= self.micro_batches
            out[0] = total
            after = means.deferred_state()
            if after is not None:
                deferred = True
                out[1] = 1.0
                out[2] = after[0] - (before[0] if before is not None else 0.0)
                out[3] = after[1]
        if self.p > 1:
            self._broadcast(out, self.p - 1, "broadcast(loss from the last stage)", "loss")
            if self.stage != self.p - 1:
                deferred = bool(out[1] > 0)  # (one read of the broadcast on the host)
                if deferred:
                    means.mirror(out[2], out[3], context().micro_batch.count * self.micro_batches)
        self._deferred = deferred
        return out[0].to(torch.float32)

class _PipelineHandler(Handler):
    def __init__(self, pipe: Pipeline):
        self.pipe = pipe

    def counted(self, names, *, next):
        # A tied weight lives on every stage that uses it, with the same summed gradient:
        # the first of those stages counts it in a norm, the others not (else a clip over
        # pp counts it once per stage).
        tied, stage = self.pipe.tied, self.pipe.stage
        return tuple(c and (n not in tied or stage == min(tied[n])) for n, c in zip(names, next(names)))

    def psum(self, value, *, next):
        pipe = self.pipe
        if pipe.p > 1 and isinstance(value, torch.Tensor) and value.dim() == 0:
            value = value.reshape(1).clone()
            comm.run("all_reduce(psum over pp)",
                     lambda: comm.all_reduce(value, group=pipe.group, async_op=True, what="psum"),
                     timeout_s=pipe.timeout_s, where=WHERE)
            value = value.reshape(())
        return next(value)


# --------------------------------------------------------------------------- the transform


def pipeline(
    stages: Sequence[Stage | tuple],
    loss_fn: Callable,
    mesh: Mesh | None = None,
    *,
    micro_batches: int = 1,
    schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b",  # noqa: F811
    virtual_stages: int = 1,
    timeout_s: float | None = None,
    measure_memory: bool = False,
) -> Pipeline:
    """Pipeline parallelism over the mesh's ``pp`` axis: a pipelined ``value_and_grad``.

    Args:
        stages: the model's stages, in order: :class:`Stage` ``(fn, keys)`` (or pairs), or
            ``fzero.pipeline.split(module, boundaries)``; one per rank of the ``pp`` axis,
            or ``pp * virtual_stages`` with ``schedule="interleaved"`` (rank ``r`` runs
            stages ``r, r + pp, r + 2 pp, ...``).
        loss_fn: ``loss_fn(out, y) -> scalar`` on the last stage's output and targets; a
            mean over the micro-batch, so that the mean over micro-batches is the batch's.
        mesh: the :class:`fzero.Mesh` (default ``Mesh(pp=len(stages), dp=-1)``).
        micro_batches: ``m``, how many pieces the batch is cut into on its leading dim.
        schedule: ``"1f1b"`` (at most ``p - s`` micro-batches' activations on stage ``s``),
            ``"gpipe"`` (all ``m``), or ``"interleaved"`` (Megatron's interleaved 1F1B over
            ``virtual_stages`` model stages per rank: the bubble ``(p - 1) / (v m)`` of the
            compute instead of ``(p - 1) / m``; ``m`` a multiple of ``p``).
        virtual_stages: ``v``, the model stages each rank runs (``schedule="interleaved"``
            only; 1 otherwise).
        timeout_s: how long a receive or a collective may wait (default: the mesh's).
        measure_memory: count the bytes autograd saves for backward on this stage (in
            ``pipe.stats["peak_saved_bytes"]``); it installs saved-tensor hooks, so not
            together with ``shard_state(stage=3)``.

    Returns:
        A :class:`Pipeline`: ``loss, grads = pipe(params, x, y)``; ``pipe.transform(step)``
        to keep one stage's parameters per rank; ``pipe.gather(params)`` for all of them.

    Raises:
        ValueError: the number of stages is not the ``pp`` size (times ``virtual_stages``;
            on every rank); an unknown schedule; ``micro_batches`` not a positive int, or
            not a multiple of ``pp`` under ``"interleaved"``; ``virtual_stages`` other than 1
            without ``"interleaved"``.
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
    v = virtual_stages
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{WHERE}: virtual_stages={v!r} must be a positive int")
    mesh = mesh if mesh is not None else Mesh(pp=len(stages) // v, dp=-1)
    pp = mesh.size("pp")
    if len(stages) != pp * v:
        per = f"{v} stages per pp rank (virtual_stages={v})" if v > 1 else "one stage per pp rank"
        raise ValueError(f"{WHERE}: {len(stages)} stages, but the mesh's pp axis has {pp} ranks "
                         f"({mesh}); give {per}")
    check_schedule(schedule, pp, micro_batches, v)
    if schedule == "interleaved" and pp < 2:
        raise ValueError(f"{WHERE}: schedule='interleaved' needs a pp axis of 2 ranks or more ({mesh}); "
                         "with one rank, run the stages as one (schedule='1f1b')")
    timeout_s = mesh.timeout_s if timeout_s is None else float(timeout_s)
    return Pipeline(stages, loss_fn, mesh, micro_batches, schedule, timeout_s, measure_memory, v)
