"""``shard_state``: ZeRO stages 0-3 over the mesh's ``dp`` axis (``dp`` x ``sp`` under
Ulysses sequence parallelism).

What each stage keeps on a rank between steps (Ψ parameters, N ranks, fp32 Adam):

=====  ==========================  =====================  ===============================================
stage  parameters                  optimizer state        gradients (inside the step)
=====  ==========================  =====================  ===============================================
0      full (4Ψ)                   full (8Ψ)              full, all-reduced (4Ψ)
1      full (4Ψ)                   own slice (8Ψ/N)       own slice, reduce-scattered (as stage 2; whole
                                                          sums under accumulation, 4Ψ)
2      full (4Ψ)                   own slice (8Ψ/N)       own slice, reduce-scattered (4Ψ/N + 2 buckets)
3      own slice (4Ψ/N)            own slice (8Ψ/N)       own slice (4Ψ/N + 2 units)
=====  ==========================  =====================  ===============================================

How the step is rewritten (see docs/zero.md): the handler of ``value_and_grad`` asks the
autograd engine for each gradient the moment it is complete and starts its bucket's
collective then (buckets in backward's order), so communication overlaps the rest of
backward; the handler of ``apply_gradients`` runs the unchanged optimizer on this rank's
slices (optimizers reduce across slices through ``psum``, which becomes an all-reduce),
then all-gathers the new parameters (stages 1-2). At stage 3 parameters are gathered per
unit (a run of consecutive blocks of the model within ``max_reuse_distance``) just before
the unit's forward, freed after it, and gathered again when backward first needs them,
unless the unit is within ``max_reuse_distance``; a model whose blocks all are has none,
and is gathered whole for the step, in stage 2's buckets. At stage 0 an optimizer that
exchanges across the ranks itself (the 1-bit family, ``fzero.optim.exchange_of``) is handed
this rank's own gradients when it asks for them, and its ``compressed_pmean`` runs here
(``fzero/distributed/compressed.py``).

This module is the handler, the partitioning at ``init`` and the transform; the parts are
its neighbours in this package (see its ``__init__``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch

from fzero import tree
from fzero._params import frozen_names, merge_trainable, with_values
from fzero._params import trainable as trainable_view
from fzero.distributed import comm, device_check
from fzero.distributed.compressed import ErrorFeedback, compressed_mean
from fzero.distributed.mesh import DATA_AXES, Mesh
from fzero.optim import _known, exchange_of
from fzero.transforms._checks import (check_option, default_bucket_bytes, default_reuse_distance, kept_reduce_bytes,
                                      unit_runs, units_within_reuse)
from fzero.transforms._arguments import Arguments
from fzero import rng
from fzero.core import (DataShard, Handler, MicroBatch, NotApplied, Step, as_step, context, installed,
                        keeping_function_modes, running)
from fzero.transforms.offload import host_copy, write_params
from fzero.transforms._deferred import Deferred
from fzero.transforms.shard_state._checks import check_same_model
from fzero.transforms.shard_state._collectives import all_gather_params, sync_buffers
from fzero.transforms.shard_state._layout import Layout, build_layout
from fzero.transforms.shard_state._reduce import MAX_IN_FLIGHT, BufferPool, HostGradients, ReduceSink
from fzero.transforms.shard_state._shard import Shard
from fzero.transforms.shard_state._units import Units, find_units

__all__ = ["release_parameters", "shard_state"]

WHERE = "fzero.shard_state"


class _ShardHandler(Handler):
    """The handler ``shard_state`` installs: ``init`` partitions the state; the primitives
    (``value_and_grad``, ``apply_gradients``, ``psum``) run on the partitioned state.

    ``layout`` is the flat groups of the trainable parameters (``_layout.py``); ``units``
    (stage 3) the gathered units (``_units.py``); ``pool`` the stage 2-3 reduce buffers
    kept between steps (``_reduce.py``).
    """

    def __init__(self, mesh: Mesh, stage: int, bucket_bytes, units, timeout_s: float | None,
                 reduce_in: torch.dtype | None = None, prefetch: bool = True,
                 buffer_sync: str = "broadcast", overlap_comm: bool = True, offload_param: bool = False,
                 pin_memory: bool = False, max_reuse_distance: int | None = None):
        self.mesh, self.stage, self.bucket_bytes, self.units_spec = mesh, stage, bucket_bytes, units
        self.max_reuse_distance = max_reuse_distance  # stage 3 (None: 25 MiB of parameters, at init)
        # Stage 3's parameter offload: this rank's pieces live on the host between uses.
        self.offload_param, self.pin = offload_param, pin_memory and torch.cuda.is_available()
        self.overlap_comm = overlap_comm
        self.buffer_sync = buffer_sync
        self.frozen: frozenset[str] = frozenset()
        self.reduce_in = reduce_in
        self.prefetch = prefetch
        # ZeRO's group: the ranks holding different data, dp x sp (DeepSpeed's "sequence data
        # parallel" group: sequence-parallel peers hold different tokens of the same rows, so
        # their gradients are summed too, and the optimizer state is partitioned over both).
        self.world = mesh.size(DATA_AXES)
        self.rank = mesh.coord(DATA_AXES)
        self.group = mesh.group(DATA_AXES)
        self.timeout_s = mesh.timeout_s if timeout_s is None else timeout_s
        self.layout: Layout | None = None
        self.bucket: int | None = None  # the bucket in bytes the layout was cut with (set at init)
        self.names: list[str] = []
        self.all_names: frozenset[str] = frozenset()
        self.units: Units | None = None  # stage 3
        # Stages 1-3 build the optimizer state at init, over this rank's pieces: a transform
        # inside need not, one outside finds it built (offload_optimizer: on the host, where
        # the masters' pieces were cut to, when opt_state_on_host).
        self.builds_optimizer_state = stage >= 1
        self.opt_state_on_host = False
        self.pool = BufferPool()
        self.host_gradients: HostGradients | None = None  # offload_optimizer: where reduced pieces go
        self.held: dict[int, torch.Tensor] = {}  # stages 0-1: gradient sums of this update's micro-batches
        self.loss_sums = None  # (loss, sums, pending): the all-reduce _mean_value waits for
        self.rows = -1  # the leading size of this step's local batch (-1: no batched tensor)
        # Whether the ranks' batch sizes differ (a device flag, from the loss's all-reduce),
        # until the host reads it: after the update is enqueued, or at the step's end.
        self.sizes_differ: torch.Tensor | None = None
        self.rows_leaf: Any = None  # which leaf it is, for the error when ranks' sizes differ
        # An optimizer that exchanges across dp itself (the 1-bit family): whether this update
        # hands it local gradients, and its error feedback by caller (per rank, working memory:
        # like DeepSpeed, which resets it on a checkpoint load, it is not part of the state).
        self.local = False
        self.errors: dict[str, ErrorFeedback] = {}

    @property
    def peak_gathered_bytes(self) -> int:
        """Stage 3: the most parameter bytes gathered at once so far (0 at stages 0-2)."""
        return self.units.peak_gathered_bytes if self.units is not None else 0

    @property
    def peak_reduce_bytes(self) -> int:
        """Stages 2-3: the most gradient reduce-buffer bytes in use at once so far (being
        filled or in flight; not the reduced slices), ``BufferPool.peak_bytes``."""
        return self.pool.peak_bytes

    # ---------------------------------------------------------------- init

    def init(self, state):
        params = state.params
        if state.tx is None:
            from fzero.train_state import missing_optimizer

            raise missing_optimizer(f"{WHERE}: step.init")
        if not (isinstance(params, dict) and all(isinstance(v, torch.Tensor) for v in params.values())):
            raise TypeError(
                f"{WHERE}: state.params must be a dict of tensors (as fzero.functionalize returns), "
                f"got {type(params).__name__}"
            )
        # An optimizer that may read whole tensors must say so before it sees this rank's pieces.
        _known.check_partitionable(state.tx, stage=self.stage, where=f"{WHERE}: step.init")
        exchange = exchange_of(state.tx, state.opt_state)
        if exchange is not None and self.stage not in exchange.stages:
            raise ValueError(f"{WHERE}: {exchange.optimizer} exchanges its momentum across the data-parallel ranks "
                             f"itself and runs at ZeRO stage {' or '.join(map(str, exchange.stages))} only (as "
                             f"DeepSpeed's 1-bit optimizers, which refuse ZeRO); got stage={self.stage}")
        self.errors = {}
        check_same_model(params, stage=self.stage, group=self.group, world=self.world,
                         timeout_s=self.timeout_s, device=self.mesh.device)
        # Frozen parameters stay out of the flat groups: no gradient buffer, no reduction,
        # no optimizer state. They are kept whole on every rank (their bytes are the model's,
        # not the training state's).
        self.frozen = frozen_names(params)
        train = {k: v for k, v in params.items() if k not in self.frozen}
        self.names = list(train)
        self.all_names = frozenset(params)
        module = getattr(state.apply_fn, "module", None)
        found = []  # stage 3: (module, parameter names) of each unit
        if self.stage == 3 and isinstance(module, torch.nn.Module):
            found = [([m], names) for m, names in find_units(module, train, self.units_spec)]
            if self.units_spec is None:  # the blocks found, in runs within the reuse window
                found = self._runs(found, train)
        self.bucket, keep = self._bucket(train, units=bool(found))
        self.layout = build_layout(train, world=self.world, rank=self.rank, units=[names for _, names in found],
                                   bucket_bytes=self.bucket)
        kept = self._kept([self.layout.where[names[0]][0] for _, names in found])  # units kept gathered
        if found and self.units_spec is None and len(kept) == len(found):
            # Every unit would stay gathered from its forward to its backward: the model is
            # gathered whole for the step instead, in stage 2's buckets -- the same parameters
            # held at the peak, one collective each way instead of one per block.
            found, kept = [], set()
            self.bucket, keep = self._bucket(train)
            self.layout = build_layout(train, world=self.world, rank=self.rank, bucket_bytes=self.bucket)
        if self.stage == 0:  # every group's buffer is kept between steps, as DDP keeps its buckets
            self.pool = BufferPool(limit=len(self.layout.groups) + MAX_IN_FLIGHT)
        else:
            self.pool = BufferPool(keep_bytes=keep)
        if isinstance(module, torch.nn.Module):
            # The module is only code from here on: its parameters come from the state
            # (fzero.load_into writes trained weights back), so its own storage can go.
            release_parameters(module)
        if self.stage == 0:
            return state
        # fp32 master weights (mixed precision) count as optimizer state: partitioned from
        # stage 1 on, and the optimizer state is built over them.
        master = state.master
        # Under offload_optimizer (which says so at init) this rank's pieces of the masters are
        # cut straight into host memory and the optimizer state is built over them there: the
        # device never holds them, not even while init runs.
        self.opt_state_on_host = context().offload_optimizer and master is not None
        if master is not None:
            whole = {k: v for k, v in master.items() if v is not None}
            if self.opt_state_on_host:  # each piece its own host tensor (the group's padding stays behind)
                pieces = self.layout.shard_params(whole, self.group, copy=lambda flat: flat)
                pieces = {k: Shard(host_copy(v.local, pin=False), v.info) for k, v in pieces.items()}
            else:
                pieces = self.layout.shard_params(whole, self.group)
            master = with_values(master, pieces)
        if self.stage in (1, 2):
            full = self.layout.regroup(train)
            target = master or with_values(trainable_view(params), self.layout.piece_views(full, self.group))
            return state.replace(params=with_values(params, full), opt_state=state.tx.init(target), master=master)
        # Stage 3: the state keeps only this rank's pieces.
        shards = self.layout.shard_params(train, self.group)
        modules = [(m, self.layout.where[names[0]][0]) for ms, names in found for m in ms]
        self.units = Units(self.layout, modules, group=self.group, world=self.world, timeout_s=self.timeout_s,
                           prefetch=self.prefetch, host=self.offload_param, pin_memory=self.pin,
                           keep=kept)
        target = master or with_values(trainable_view(params), shards)
        opt_state = state.tx.init(target)  # beside the pieces it was built over (the masters' on the host)
        if self.offload_param:
            shards = self._on_host(shards)
        return state.replace(params=with_values(params, shards), opt_state=opt_state, master=master)

    def _runs(self, found: list[tuple[list[torch.nn.Module], list[str]]],
              train: dict[str, torch.Tensor]) -> list[tuple[list[torch.nn.Module], list[str]]]:
        """Stage 3, units found by ``shard_state`` itself: consecutive blocks merged into one
        unit each, in runs within ``max_reuse_distance`` (``_checks.unit_runs``): one
        all-gather and one reduce-scatter per run, not per block; the last run is the window
        kept gathered. Blocks the user chose (``units=``) stay as chosen."""
        if not found:
            return found
        sizes = [sum(train[n].numel() for n in names) for _, names in found]
        itemsize = train[found[0][1][0]].element_size()
        out, at = [], 0
        for k in unit_runs(sizes, default_reuse_distance(itemsize, self.max_reuse_distance)):
            part = found[at:at + k]
            at += k
            out.append(([m for ms, _ in part for m in ms], [n for _, names in part for n in names]))
        return out

    def _kept(self, order: list[int]) -> set[int]:
        """Stage 3: the units (group indices, ``order`` their forward order) that stay gathered
        from their forward to their backward instead of being freed and gathered again: each
        unit whose *reuse distance* -- the elements gathered from its own gather until its
        backward needs it again, itself and the units after it (each gathered once) -- is at
        most ``max_reuse_distance`` (DeepSpeed's ``stage3_max_reuse_distance``; default
        ``_checks.default_reuse_distance``: 25 MiB of parameters). The last units of
        forward, whose backward comes first."""
        if not order:
            return set()
        budget = default_reuse_distance(self.layout.groups[order[0]].dtype.itemsize, self.max_reuse_distance)
        n = units_within_reuse([self.layout.groups[gi].numel for gi in order], budget)
        return set(order[len(order) - n:])

    def _bucket(self, train: dict[str, torch.Tensor], units: bool = False) -> tuple[int, int | None]:
        """The bucket in bytes, and the most bytes of free reduce buffers to keep between
        steps (``None``: the two buffers of a given bucket). The one given (a config's
        ``"auto"`` one is asked now); else ``default_bucket_bytes`` of the trainable
        parameters' bytes (DDP's 25 MiB, the whole model when smaller; 1/32 of it at stage
        3 with ``units``), with the kept buffers bounded to a share of the model
        (``_checks.kept_reduce_bytes``), so a large default bucket costs memory between
        steps little."""
        given = self.bucket_bytes() if callable(self.bucket_bytes) else self.bucket_bytes
        if given is not None:
            return given, None
        model = sum(p.numel() * p.element_size() for p in train.values())
        if self.stage == 3 and units:  # its buffers are its units' (blocks), whatever the bucket: two are kept
            return default_bucket_bytes(model, 3), None
        return default_bucket_bytes(model), kept_reduce_bytes(model)

    def _on_host(self, shards: dict[str, Shard]) -> dict[str, Shard]:
        """Parameter offload: each group's owned slice copied to a host buffer of its own (page-
        locked with ``pin_memory``), the pieces views of it, so a gather copies one slice."""
        out = {}
        for g in self.layout.groups:
            own = host_copy(g.pack_own(shards), self.pin)
            out.update(zip(g.names, g.pieces(own, self.group)))
        return {k: out[k] for k in shards}

    # ---------------------------------------------------------------- primitives

    def psum(self, value, *, next):
        # With local gradients (an optimizer exchanging itself) every rank's norms and flags
        # differ, so they are summed at stage 0 too: the ranks must agree on a skip.
        if (self.stage >= 1 or self.local) and self.world > 1:
            # A sum an offloaded optimizer made on the host goes through the group's
            # collective on the mesh's device and comes back to the host. Anywhere else a
            # host tensor here is a mistake (a hidden synchronisation on a GPU) that the
            # device check names, so it is not moved.
            home = value.device
            value = value.to(self.mesh.device, copy=True) if context().offload_optimizer else value.clone()
            comm.run("all_reduce(psum)", lambda: comm.all_reduce(value, group=self.group, async_op=True, what="psum"),
                     timeout_s=self.timeout_s, where=WHERE)
            value = value.to(home)
        return next(value)

    def pmean_data(self, value, *, next):
        if self.world > 1:
            value = value.to(self.mesh.device, copy=True)
            comm.run("all_reduce(pmean_data)",
                     lambda: comm.all_reduce(value, group=self.group, async_op=True, what="mean"),
                     timeout_s=self.timeout_s, where=WHERE)
            value = value / self.world
        return next(value)

    def compressed_pmean(self, tensors, key, *, next):
        if self.stage != 0:  # the tensors would be this rank's pieces, not its own whole values
            raise ValueError(f"{WHERE}: compressed_pmean ({key}) averages each rank's whole tensors and runs at "
                             f"ZeRO stage 0 only; got stage={self.stage}")
        if self.world == 1:
            return next(tensors, key)
        numels = [t.numel() for t in tensors]
        errors = self.errors.get(key)
        if errors is None or errors.numels != numels:
            errors = self.errors[key] = ErrorFeedback(numels, self.world, self.mesh.device)
        flag = context().skip_flag  # an update about to be discarded leaves the errors as they were
        commit = flag is None or not bool(flag > 0)
        return compressed_mean(tensors, errors, group=self.group, world=self.world, timeout_s=self.timeout_s,
                               where=WHERE, commit=commit)

    def forward(self, fn, params, args, kwargs, *, next):
        # An evaluation inside the step at stage 3: the units gathered a block at a time, as
        # in the training forward, and every group freed on the way out; the peak is the
        # training forward's, never the whole model (FSDP2's and DeepSpeed's forward under
        # no_grad). Stages 0-2 hold whole parameters: nothing to gather.
        if self.stage != 3 or not (isinstance(params, dict) and params.keys() == self.all_names):
            return next(fn, params, args, kwargs)
        with self.units.step(params) as views:
            return next(fn, with_values(params, views), args, kwargs)

    def value_and_grad(self, fn, params, args, kwargs, *, next, **options):
        if options.get("grad_sink") is not None:
            raise NotImplementedError(f"{WHERE}: another transform already reduces gradients inside this one")
        names = self.all_names
        if not (isinstance(params, dict) and params.keys() == names):
            # argnums beside (or instead of) the parameters: see fzero/transforms/_arguments.py
            single = not isinstance(params, tuple)
            what = Arguments((params,) if single else params, names, WHERE)
            what.check_per_rank(self.group, self.world, self.timeout_s)
            value, grads = self._value_and_grad(what.call(fn, single), what.combined, args, kwargs, next=next, **options)
            grads = what.split(grads)
            return value, (grads[0] if single else grads)
        return self._value_and_grad(fn, params, args, kwargs, next=next, **options)

    def _value_and_grad(self, fn, params, args, kwargs, *, next, **options):
        if self.stage == 3:
            units = self.units
            with units.step(params) as views:  # every group is freed on the way out

                # Saved views of a unit are gathered again in backward; under jit the hooks
                # stay eager (graph breaks), as the units' forward hooks do.
                # The engine calls unpack (a gather) without the torch-function modes of the
                # step (device_check.pretend's): keeping_function_modes restores them.
                unpack = keeping_function_modes(units.unpack)
                pack, unpack = (units.pack, unpack) if context().jit is None else \
                    (torch.compiler.disable(units.pack), torch.compiler.disable(unpack))

                def regathering(p, *a, **kw):
                    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                        return fn(p, *a, **kw)

                views = with_values(params, views)
                if units.unit_groups:
                    sink = self._sink(views, on_complete=units.post_backward)
                    out = next(regathering, views, args, kwargs, grad_sink=sink, **options)
                else:  # the whole model gathered for the step: nothing to gather again in backward
                    out = next(fn, views, args, kwargs, grad_sink=self._sink(views), **options)
        else:
            # Under accumulation stages 0-1 hold whole gradients, as DDP and DeepSpeed do:
            # the micro-batches before the last only add into the reduce buffers and the sum
            # is reduced once, at the last (all-reduced at stage 0, reduce-scattered at 1):
            # one k-th of the traffic (DDP's no_sync; DeepSpeed stages 0-1). Stage 2 reduce-scatters each micro-batch instead, so
            # that its gradient memory stays at the partition.
            mb = context().micro_batch if self.stage < 2 else MicroBatch(0, 1)
            held, self.held = (self.held if mb.index > 0 else {}), {}  # never a past update's sums
            sink = self._sink(params, held=held, hold=None if mb.last else self.held_back(), summed=mb.count > 1)
            out = next(fn, params, args, kwargs, grad_sink=sink, **options)
            if not mb.last:
                self.held = sink.buffers
        return self._mean_value(out, options.get("has_aux", False))

    def _sink(self, params, **options) -> ReduceSink:
        leaf_names = [path[0].entry for path in tree.paths(params)]
        # Local gradients: the sink of a world of one, which reduces nothing.
        self.loss_sums = None
        return ReduceSink(self.layout, leaf_names, group=self.group, world=1 if self.local else self.world,
                          stage=self.stage,
                          reduce_in=self.reduce_in, pool=self.pool, timeout_s=self.timeout_s,
                          overlap=self.overlap_comm, on_value=self._start_loss_sums if self.world > 1 else None,
                          certificate=self._certificate(), to_host=self._gradients_to_host(), **options)

    def _gradients_to_host(self) -> HostGradients | None:
        """Where the reduced pieces go as each group's reduction completes: to the host when
        the optimizer runs there (``offload_optimizer``) and this backward's pieces are the
        update's gradients (one micro-batch, or stages 0-1's last, which reduces the sum;
        at stages 2-3 each micro-batch's pieces are summed on the device first)."""
        here = context()
        if self.stage == 0 or self.local or not here.offload_optimizer or (
                self.stage >= 2 and here.micro_batch.count > 1):
            return None
        if self.host_gradients is None:
            self.host_gradients = HostGradients(self.pin)
        return self.host_gradients

    def _certificate(self):
        """``check_finite``'s holder for the sink to certify the gradients it reduces, where
        that saves a wait: on gloo, where a collective's wait costs more than the look at the
        local gradient (on a GPU the small all-reduce is cheaper than that pass), one update
        per step, and no other axis whose ranks the check must also agree with."""
        cert = context().finite_certificate
        if (cert is None or self.local or not device_check.is_host_device(self.mesh.device)
                or context().micro_batch.count != 1
                or any(self.mesh.size(a) > 1 for a in ("tp", "pp", "sp"))):
            return None
        return cert

    def _start_loss_sums(self, loss: torch.Tensor) -> None:
        """Launch :meth:`_mean_value`'s all-reduce as soon as the loss is known, before
        backward, so that it runs while backward does instead of after it."""
        sums = self._loss_sums(loss)
        self.loss_sums = (loss, sums, comm.start(
            "all_reduce(loss and batch sizes)",
            lambda: comm.all_reduce(sums, group=self.group, async_op=True, what="loss"), where=WHERE))

    def _loss_sums(self, loss: torch.Tensor) -> torch.Tensor:
        n, f64 = self.rows, torch.float64
        # Made from the loss (a fill, not a copy from the host: no synchronisation on a GPU).
        return torch.stack([loss.detach().reshape(()).to(f64), loss.new_full((), n, dtype=f64),
                            loss.new_full((), n * n, dtype=f64)])

    def _mean_value(self, out, has_aux):
        """The loss averaged over ranks, and the check that every rank's local batch has the
        same leading size (or the gradient average is wrong), in one all-reduce: the loss and
        ``n``, ``n²`` of this rank's batch size. The sizes are all equal exactly when
        ``N·Σn² = (Σn)²`` (Cauchy-Schwarz); only then is an all-gather needed, to name them.
        Sums in fp64 (exact for the counts, and no bf16/fp16 rounding of the loss across
        ranks). The all-reduce was launched before backward (:meth:`_start_loss_sums`) when
        the value backward started from is the one returned here (a transform inside this
        one that rescales the value returns another: it is summed now). The verdict stays on
        the device (``sizes_differ``) and is not read here, mid-step: ``apply_gradients``
        runs the update with it in the step context's ``skip_flag`` (a refused update writes
        nothing) and reads it once the update is enqueued (:meth:`check_sizes`), so the
        error is raised on every rank alike with nothing applied."""
        (value, grads) = out
        loss = value[0] if has_aux else value
        if self.world > 1:
            started, self.loss_sums = self.loss_sums, None
            sums = None
            if started is not None:
                begun, sums, pending = started
                pending.wait(self.timeout_s)
                if not _same_values(begun, loss):  # every rank takes the same branch: same code path
                    sums = None
            if sums is None:
                sums = self._loss_sums(loss)
                comm.run("all_reduce(loss and batch sizes)",
                         lambda: comm.all_reduce(sums, group=self.group, async_op=True, what="loss"),
                         timeout_s=self.timeout_s, where=WHERE)
            differ = (sums[1] * sums[1] != self.world * sums[2]).to(torch.float32)  # exact: counts in fp64
            self.sizes_differ = differ if self.sizes_differ is None else self.sizes_differ + differ
            loss = (sums[0] / self.world).to(loss.dtype).reshape(loss.shape)
        return ((loss, value[1]) if has_aux else loss), grads

    def check_sizes(self) -> None:
        """Read the batch-size verdict of the step's ``value_and_grad`` calls, if one is
        pending, and raise naming every rank's size when they differ."""
        differ, self.sizes_differ = self.sizes_differ, None
        if differ is not None and bool(differ > 0):
            self._batch_sizes_differ()

    def _batch_sizes_differ(self) -> None:
        sizes = comm.all_gather_ints("all_gather(batch sizes)", [self.rows], self.group, timeout_s=self.timeout_s,
                                     where=WHERE, device=self.mesh.device)[:, 0]
        per_rank = ", ".join(f"rank {r}: {int(s)}" for r, s in enumerate(sizes))
        raise ValueError(f"{WHERE}: local batches must have the same leading size on every rank, got {per_rank} "
                         f"(the size of {self.rows_leaf}, the batch's first tensor with a dimension)")

    def held_back(self) -> dict:
        """Placeholders for the gradients a micro-batch adds into the held sums, in the
        structure :func:`._reduce.gradients` gives the reduced ones."""
        out = {}
        for g in self.layout.groups:
            for i, name in enumerate(g.names):
                if self.stage == 0:
                    out[name] = Deferred(name, g.shapes[i], g.dtype)
                else:
                    a, b = g.info(i).piece()
                    out[name] = Shard(Deferred(name, (b - a,), g.dtype), g.info(i, self.group))
        return out

    def update(self, state, grads, *, next):
        # Parameter offload with no masters beside the pieces (fp32 training without
        # offload_optimizer): the optimizer state is on the device, so the update runs there
        # on a device copy of the pieces (h2d), and the new pieces are written back on the
        # host (d2h). With masters (mixed_precision's, offload_optimizer's) the transform
        # that keeps them steps them and writes the pieces (write_params).
        if not self.offload_param or state.master is not None:
            return next(state, grads)
        host = trainable_view(state.params)
        device = tree.map(lambda p: comm.copy_(torch.empty(p.shape, dtype=p.dtype, device=self.mesh.device), p,
                                               kind="h2d"), host)
        new = next(state.replace(params=merge_trainable(state.params, device)), grads)
        return new.replace(params=merge_trainable(state.params, write_params(host, trainable_view(new.params))))

    def apply_gradients(self, state, grads, *, next):
        differ = self.sizes_differ
        if differ is None:
            return self._apply_gradients(state, grads, next=next)
        # The batch-size verdict rides in the skip flag: a refused update is discarded on the
        # device, and the host reads the verdict once the update is enqueued, not before.
        outer = context().skip_flag
        with running(skip_flag=differ if outer is None else outer + differ):
            new = self._apply_gradients(state, grads, next=next)
        if not (isinstance(new, NotApplied) and new.reason == "deferred"):  # the update's last micro-batch
            self.check_sizes()
        return new

    def _apply_gradients(self, state, grads, *, next):
        if self.stage in (0, 3):  # stage 3: the optimizer runs on the pieces the state holds
            return next(state, grads)
        train = {k: v for k, v in state.params.items() if k not in self.frozen}
        pieces = with_values(state.params, self.layout.piece_views(train, self.group))
        new = next(state.replace(params=pieces), grads)
        if isinstance(new, NotApplied):  # deferred or skipped further in: the whole parameters stay
            return NotApplied(new.state.replace(params=state.params), new.reason)
        # A donated step's full buffers are its own: the new parameters are gathered into them.
        full = all_gather_params(self.layout, new.params, group=self.group, world=self.world,
                                 timeout_s=self.timeout_s, into=train if context().donate else None)
        return new.replace(params=with_values(new.params, full))



def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``b`` is ``a`` (or ``a`` detached, reshaped): the same elements of the same storage."""
    return (a.dtype == b.dtype and a.numel() == b.numel() == 1 and a.device == b.device
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() == b.storage_offset())


def release_parameters(module: torch.nn.Module) -> None:
    """Swap every parameter of ``module`` for a meta tensor of its shape (ties kept).

    Under a compiled step the module is only code: its parameters come from the state.
    Releasing them lets their memory go once the caller's own references do (at stages
    0-2 the module would otherwise keep a dead copy of the initial weights, 4 bytes per
    parameter beyond the ZeRO formula). ``fzero.load_into`` writes trained weights back.
    """
    memo: dict[int, torch.nn.Parameter] = {}
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is None:
                continue
            if p.device.type == "meta":
                continue
            if id(p) not in memo:
                memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
            m._parameters[name] = memo[id(p)]


# --------------------------------------------------------------------------- the transform


class _LeadingLeaf:
    """The batch leaf :func:`fzero.tree.leading_size` reads, rendered (key path and this
    rank's shape) only when an error names it."""

    __slots__ = ("batch",)

    def __init__(self, batch: Any):
        self.batch = batch

    def __str__(self) -> str:
        paths, leaves, _ = tree.flatten_with_path(self.batch)
        for path, leaf in zip(paths, leaves):
            if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
                return f"batch{tree.keystr(path)}, shape {tuple(leaf.shape)} on this rank"
        return "no batch leaf"


def shard_state(
    step: Callable,
    mesh: Mesh | None = None,
    stage: Literal[0, 1, 2, 3] = 0,
    *,
    bucket_bytes: int | Callable[[], int | None] | None = None,
    units: Callable[[torch.nn.Module], bool] | None = None,
    timeout_s: float | None = None,
    reduce_in: Literal["fp32", "bf16", "fp16"] | torch.dtype | None = None,
    prefetch: bool = True,
    buffer_sync: Literal["broadcast", "mean", "local"] = "broadcast",
    overlap_comm: bool = True,
    offload_param: Literal["none", "cpu"] = "none",
    pin_memory: bool = False,
    max_reuse_distance: int | None = None,
) -> Step:
    """Data parallelism with ZeRO partitioning over the mesh's ``dp`` axis.

    Each rank passes its own local batch; the step computes the same update as the plain
    step on the concatenation of all local batches (gradients are averaged, so a mean loss
    over equal local batches gives the global batch's gradient). The reported loss is the
    mean over ranks.

    Args:
        step: ``train_step(state, batch) -> (state, metrics)``.
        mesh: the :class:`fzero.Mesh` (default ``Mesh(dp=-1)``).
        stage: 0 replicates (DDP); 1 partitions optimizer state; 2 also gradients; 3 also
            parameters.
        bucket_bytes: size of a gradient bucket (a group of parameters reduced together), or
            a function of no arguments giving it at ``init`` (a config's ``"auto"`` bucket,
            which the model's hidden size decides). ``None`` (the default, or what the
            function gives): DDP's 25 MiB, the whole model when smaller; at stage 3 with
            units (blocks gathered one at a time), which cuts only the parameters outside
            them, 1/32 of the trainable parameters' bytes, at most 25 MiB, at least 64 KiB
            (:func:`fzero.transforms._checks.default_bucket_bytes`). With the default, the
            reduce buffers kept between steps at stages 1-2 (and 3 without units) are at most 1/16 of the
            gradient (:func:`fzero.transforms._checks.kept_reduce_bytes`; a larger one goes
            back to the allocator once reduced); with a given bucket, two are kept.
            ``step.handler.bucket`` is the bucket ``init`` chose.
        units: stage 3: predicate choosing the modules that are gathered one at a time
            (default: the elements of every ``nn.ModuleList``, i.e. transformer blocks,
            merged into runs of consecutive blocks within ``max_reuse_distance``, one unit
            per run; none when every block is within it).
        timeout_s: collective timeout (default: the mesh's).
        reduce_in: the dtype gradients are summed in across ranks (halving the bytes
            moved with ``"bf16"``); default fp32 for low-precision gradients, else their own.
            The reduced gradient is kept in the parameters' dtype either way.
        prefetch: stage 3: start gathering the next unit while the current one computes
            (one extra unit resident at a time).
        overlap_comm: reduce each gradient bucket while backward goes on (default); ``False``
            reduces them all after backward (DeepSpeed's ``overlap_comm: false``): the same
            result, later, holding every bucket at once.
        buffer_sync: how ``state.buffers`` (BatchNorm statistics, counters) agree across
            ``dp`` ranks after each step: ``"broadcast"`` dp-rank 0's (DDP's
            ``broadcast_buffers``), ``"mean"`` the average of floating-point buffers, or
            ``"local"`` not synchronised (each rank keeps its own; checkpoints then save
            rank 0's).
        offload_param: stage 3: ``"cpu"`` keeps this rank's pieces of the parameters (the
            low-precision copies under mixed precision) in host memory between uses
            (DeepSpeed's ``offload_param``): each gather copies the rank's slice host→device
            before all-gathering it, a prefetched gather starts its copy early too, and an
            update's new pieces are written on the host. Counted as ``"h2d"``/``"d2h"`` in
            ``fzero.distributed.comm.traffic``.
        pin_memory: with ``offload_param``: page-lock the host pieces (faster, asynchronous
            copies to a GPU; ignored without CUDA).
        max_reuse_distance: stage 3: a unit stays gathered from its forward to its backward,
            instead of being freed and gathered again, when the elements gathered from its
            gather until its backward (itself and the units after it) are at most this many
            (DeepSpeed's ``stage3_max_reuse_distance``): the last units of forward, whose
            backward comes first. The blocks ``shard_state`` finds itself are cut into units
            as runs of consecutive blocks within it (from the last block back;
            ``_checks.unit_runs``): one all-gather each way and one reduce-scatter per run,
            the last run being the window kept. ``0`` makes each block a unit and frees
            every unit after its forward (FSDP2's ``reshard_after_forward=True``). Default:
            25 MiB of parameters' worth of elements
            (``_checks.default_reuse_distance``), a bound on the memory it adds at the peak
            whatever the model's size. When every unit is within it (and ``units`` is not
            given) there are no units: the model is gathered whole for the step, in stage 2's
            buckets, and reduced as stage 2 reduces it.

    Returns:
        A :class:`Step`. ``step.init(state)`` partitions the state (call it once); the step
        consumes its input state at stages 1-3 (use the returned one).

    Raises:
        ValueError: ``stage`` not in 0-3; ``offload_param="cpu"`` at a stage other than 3; at
            ``init``, parameters that differ between ranks (named, with the rank).
    """
    for name, value in [("stage", stage), ("buffer_sync", buffer_sync), ("overlap_comm", overlap_comm),
                        ("offload_param", offload_param), ("pin_memory", pin_memory),
                        ("max_reuse_distance", max_reuse_distance),
                        *([] if callable(bucket_bytes) else [("bucket_bytes", bucket_bytes)])]:
        check_option(WHERE, name, value)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    if not isinstance(reduce_in, torch.dtype):
        check_option(WHERE, "reduce_in", reduce_in)
        reduce_in = dtypes.get(reduce_in)
    if offload_param != "none" and stage != 3:
        raise ValueError(f"{WHERE}: offload_param={offload_param!r} needs stage=3 (parameter offload moves this "
                         f"rank's partition of the parameters, which only stage 3 has; DeepSpeed's offload_param "
                         f"is a stage-3 option); got stage={stage}")
    mesh = mesh if mesh is not None else Mesh(dp=-1)
    inner = as_step(step)
    handler = _ShardHandler(mesh, stage, bucket_bytes, units, timeout_s, reduce_in, prefetch, buffer_sync,
                            overlap_comm, offload_param == "cpu", pin_memory, max_reuse_distance)

    def after(state):  # partitions what every transform inside has built (masters included)
        return handler.init(mesh.place(state))

    def call(state, batch):
        if handler.layout is None:
            raise RuntimeError(f"{WHERE}: call step.init(state) once before the first step")
        rows = tree.leading_size(batch)
        handler.rows = -1 if rows is None else rows  # checked across ranks with the loss: see _mean_value
        handler.rows_leaf = _LeadingLeaf(batch)  # named only if the sizes differ
        rng.fold_in(handler.rank)  # ranks with different rows draw different numbers (fzero/rng.py)
        exchange = exchange_of(state.tx, state.opt_state)
        handler.local = exchange is not None and exchange.local_gradients
        outer = context().data_shard  # a data-parallel axis inside another splits each of its shards again
        # Rows differ along dp only (sequence-parallel peers hold the same rows).
        dp, j = mesh.size("dp"), mesh.coords["dp"]
        shard = DataShard(outer.index * dp + j, outer.count * dp)
        try:
            with installed(handler), running(data_shard=shard,
                                             **({"offload_params": True} if handler.offload_param else {})):
                out = inner(state, batch)
            handler.check_sizes()  # a step that never applied its gradients
        finally:
            handler.rows_leaf = None  # the batch is not kept past its step
            handler.sizes_differ = None  # a step that raised leaves no verdict to the next
        if isinstance(out, tuple) and len(out) == 2:
            sync_buffers(getattr(out[0], "buffers", None), mode=buffer_sync, group=handler.group,
                         world=handler.world, timeout_s=handler.timeout_s)
        return out

    # Stages 1-3 build the optimizer state over their pieces: the transforms inside need not.
    scope = (lambda: running(opt_state_outside=True)) if stage >= 1 else None
    out = Step(call, after=after, name=f"shard_state({inner.__name__}, stage={stage})", inner=inner,
               init_scope=scope)
    out.handler = handler
    return out
