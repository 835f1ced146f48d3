"""ZeRO-3's units: parameters gathered a unit at a time.

A *unit* is one or more consecutive modules (transformer blocks: ``shard_state`` merges the
blocks it finds into runs within ``max_reuse_distance``) whose parameters form one flat
group of the layout. Its lifecycle in a step, as FSDP2's ``FSDPParamGroup`` (``unshard``,
``wait_for_unshard``, ``reshard``, ``pre_forward``, ``post_backward``), here for fzero's
flat groups: gathered just before its forward (:meth:`Units.pre_forward`), freed right after
(:meth:`Units.post_forward`), gathered again when backward first unpacks a tensor autograd
saved from it (:meth:`Units.pre_backward`), freed once its gradients are complete
(:meth:`Units.post_backward`). Meanwhile the next unit's all-gather is already in flight
(:meth:`Units.prefetch`). Groups outside every unit are gathered for the whole step.

"Freed" is the storage of the group's full flat buffer resized to 0: the parameters'
views (the autograd leaves) keep their shape, and a gather resizes it back in place.

With parameter offload (``host=True``, DeepSpeed's ``offload_param``) this rank's pieces
live in host memory: a gather first copies the rank's owned slice host→device (one copy of
the slice the pieces view, counted ``"h2d"`` in ``comm.traffic``), then all-gathers it on
the device as before. A prefetched gather starts its copy early too: on CUDA on a side
stream, with the all-gather launched behind it there, so neither waits for the compute on
the current stream; the current stream waits for both only when the unit is needed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from fzero.core import context, running
from fzero.distributed import comm
from fzero.transforms.shard_state._collectives import start_all_gather
from fzero.transforms.shard_state._layout import Group, Layout
from fzero.transforms.shard_state._shard import Shard

__all__ = ["Units", "find_units"]


class Units:
    """The full buffers of a layout's groups at ZeRO-3, and the lifecycle of each.

    Args:
        layout: the flat groups of the trainable parameters.
        modules: ``(module, group index)`` of each unit's modules, in forward order; a unit of
            several modules is gathered by the first one's forward and freed after the last one's.
        group, world: the ``dp`` process group and its size.
        timeout_s: of every all-gather.
        prefetch: start gathering the next unit while the current one computes.
        host: this rank's pieces live on the host (parameter offload): each gather copies
            them to the device first.
        pin_memory: with ``host``, pack pieces that are not laid out as one slice into
            page-locked buffers (copied without holding the host; ignored without CUDA).
        keep: the units (group indices) that stay gathered from their forward until their
            gradients are complete, instead of being freed after forward and gathered again
            in backward (``shard_state``'s ``max_reuse_distance``).

    Attributes:
        peak_gathered_bytes: the most parameter bytes gathered at once (all-gathers in
            flight included), over every step so far.

    Example (a world of one, where a gather is a copy; the hooks call these in a step):
        >>> from fzero.transforms.shard_state._layout import build_layout
        >>> params = {"w": torch.ones(2, 2)}
        >>> layout = build_layout(params, world=1, rank=0, units=[["w"]])
        >>> units = Units(layout, [(torch.nn.Linear(2, 2), 0)], group=None, world=1, timeout_s=1.0)
        >>> with units.step(layout.shard_params(params)) as views:
        ...     units.pre_forward(0); print(units.gathered, views["w"].sum().item())
        ...     units.post_forward(0); print(units.gathered)
        {0} 4.0
        set()
        >>> units.peak_gathered_bytes
        16
    """

    def __init__(self, layout: Layout, modules: list[tuple[torch.nn.Module, int]], *, group, world: int,
                 timeout_s: float, prefetch: bool = True, host: bool = False, pin_memory: bool = False,
                 keep: set[int] | frozenset[int] = frozenset()):
        self.groups: list[Group] = layout.groups
        self.host, self.pin = host, pin_memory and torch.cuda.is_available()
        self.ready: dict[int, tuple[torch.cuda.Event, torch.device]] = {}  # side-stream work's end, by group
        self._side: torch.cuda.Stream | None = None
        self.modules = modules
        self.group, self.world, self.timeout_s, self.prefetching = group, world, timeout_s, prefetch
        self.full = [_empty_full(g) for g in self.groups]  # storage of size 0 while not gathered
        self.unit_groups = {gi for _, gi in modules}
        self.keep = frozenset(keep)  # units not freed after their forward: their backward needs them soon
        # Prefetch (``prefetch=True``): once a unit is gathered, the all-gather of the next
        # unit in the direction of travel (forward order in forward, reverse in backward)
        # starts asynchronously, so it overlaps this unit's compute. Every rank runs the
        # same hooks in the same order, so the collectives match.
        self.order = list(dict.fromkeys(gi for _, gi in modules))
        self.last = {gi: m for m, gi in modules}  # a unit of several modules is freed after its last
        self.at = {gi: i for i, gi in enumerate(self.order)}
        self.gathered: set[int] = set()
        self.inflight: dict[int, tuple[comm.Pending, torch.Tensor]] = {}
        self.pieces: dict[str, Shard] = {}  # this step's pieces, which a gather packs from
        self.peak_gathered_bytes = 0

    # ------------------------------------------------------------ one group

    def gather(self, gi: int, *, prefetch: bool = False) -> None:
        """Start the all-gather of group ``gi`` into its full buffer; :meth:`wait` completes it."""
        g, full = self.groups[gi], self.full[gi]
        full.untyped_storage().resize_(g.padded * full.element_size())
        if not self.host:
            own = g.pack_own(self.pieces)  # kept alive with the work until it completes
            work = start_all_gather(g, own, full, group=self.group, world=self.world, prefetch=prefetch)
            self.inflight[gi] = (work, own)
        elif prefetch and full.is_cuda:  # copy and all-gather behind it on a side stream
            side = self._side = self._side or torch.cuda.Stream(device=full.device)
            side.wait_stream(torch.cuda.current_stream(full.device))  # full's pages were taken on it
            with torch.cuda.stream(side):
                own, host = self._copy_own(g, full)
                work = start_all_gather(g, own, full, group=self.group, world=self.world, prefetch=prefetch)
                done = torch.cuda.Event()
                done.record(side)
                self.ready[gi] = (done, full.device)
            full.record_stream(side)
            own.record_stream(side)
            self.inflight[gi] = (work, (own, host))
        else:
            own, host = self._copy_own(g, full)
            work = start_all_gather(g, own, full, group=self.group, world=self.world, prefetch=prefetch)
            self.inflight[gi] = (work, (own, host))
        self._note_peak()

    def _copy_own(self, g: Group, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Group ``g``'s owned slice copied host→device: ``(device slice, host slice)``. In a
        world of one the device slice is ``full`` itself (the gather is this copy)."""
        host = _own_on_host(g, self.pieces, self.pin)
        own = full if self.world == 1 else torch.empty(g.chunk, dtype=g.dtype, device=full.device)
        comm.copy_(own, host, kind="h2d", non_blocking=host.is_pinned())
        return own, host

    def wait(self, gi: int) -> None:
        """Complete group ``gi``'s all-gather: its parameters are resident."""
        work, _ = self.inflight.pop(gi)
        work.wait(self.timeout_s)
        ready = self.ready.pop(gi, None)
        if ready is not None:  # a prefetch's copy (and gather) ran on the side stream
            done, device = ready
            torch.cuda.current_stream(device).wait_event(done)
        self.gathered.add(gi)
        self._note_peak()

    def free(self, gi: int) -> None:
        if gi in self.gathered:
            self.full[gi].untyped_storage().resize_(0)
            self.gathered.discard(gi)

    def prefetch(self, gi: int, direction: int) -> None:
        """Start gathering the unit after unit ``gi`` in the direction of travel (``1`` in
        forward, ``-1`` in backward), unless it is gathered or on its way already."""
        if not self.prefetching or gi not in self.at or not 0 <= self.at[gi] + direction < len(self.order):
            return
        nxt = self.order[self.at[gi] + direction]
        if nxt in self.gathered or nxt in self.inflight or self.world == 1:
            return
        self.gather(nxt, prefetch=True)

    def _resident(self, gi: int) -> None:
        if gi not in self.gathered:
            if gi not in self.inflight:  # not prefetched
                self.gather(gi)
            self.wait(gi)

    def _note_peak(self) -> None:
        now = sum(self.groups[i].padded * self.full[i].element_size() for i in self.gathered | set(self.inflight))
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, now)

    # ------------------------------------------------------------ hooks

    def pre_forward(self, gi: int) -> None:
        self._resident(gi)
        self.prefetch(gi, 1)

    def post_forward(self, gi: int, module: torch.nn.Module | None = None) -> None:
        if module is not None and module is not self.last[gi]:
            return  # a unit of several blocks stays gathered until its last has run
        # A forward run again inside backward (remat, torch.utils.checkpoint) is saving
        # the unit's parameters for the backward about to run: the unit stays gathered
        # until its gradients are complete (post_backward frees it then).
        if torch._C._current_graph_task_id() == -1 and gi not in self.keep:
            self.free(gi)

    def pre_backward(self, gi: int) -> None:
        self._resident(gi)
        self.prefetch(gi, -1)

    def post_backward(self, gi: int) -> None:
        """Group ``gi``'s gradients are complete (the reduce sink says so): free a unit."""
        if gi in self.unit_groups:
            self.free(gi)

    def pack(self, t):
        """``saved_tensors_hooks``' pack: a saved view of a gathered unit becomes a handle."""
        if self.full and isinstance(t, torch.Tensor) and t.device == self.full[0].device:
            ptr = t.untyped_storage().data_ptr()
            for gi in list(self.gathered):
                if gi in self.unit_groups and ptr == self.full[gi].untyped_storage().data_ptr() and ptr != 0:
                    return (_Handle, gi, tuple(t.shape), t.stride(), t.storage_offset())
        return t

    def unpack(self, x):
        """``saved_tensors_hooks``' unpack: a handle is gathered again (backward's first use)."""
        if isinstance(x, tuple) and len(x) == 5 and x[0] is _Handle:
            _, gi, shape, stride, offset = x
            self.pre_backward(gi)
            return self.full[gi].as_strided(shape, stride, offset)
        return x

    # ------------------------------------------------------------ one step

    @contextlib.contextmanager
    def step(self, pieces: dict[str, Shard]) -> Iterator[dict[str, torch.Tensor]]:
        """One ``value_and_grad`` over this rank's ``pieces``: the units' forward hooks are
        installed and the groups outside every unit gathered; yields every parameter as a
        view of its group's full buffer. On exit every group is freed."""
        self.pieces = pieces
        hooks = []
        # Under compile(jit=) the hooks stay eager (graph breaks): a gather is a collective on
        # an async handle and a resize of storage, neither of which a graph holds.
        # Each unit's forward is then compiled on its own, between its hooks, and the code
        # around the units runs eagerly (the step context's jit is off inside): compiled
        # whole, a model whose units are called in a loop (every GPT) falls back to eager
        # whole, since dynamo skips a frame that breaks inside a loop, the units' frames too.
        jit = context().jit
        eager = torch.compiler.disable if jit is not None else (lambda f: f)  # dynamo only under jit
        for m, gi in self.modules:
            hooks.append(m.register_forward_pre_hook(eager(lambda mod, inp, gi=gi: self.pre_forward(gi))))
            hooks.append(m.register_forward_hook(eager(lambda mod, inp, out, gi=gi: self.post_forward(gi, mod))))
            if jit is not None:
                hooks.append(jit.compiled_forward(m))
        try:
            # Parameters outside every unit stay gathered for the step: their all-gathers all
            # start, then each is waited for.
            loose = [gi for gi in range(len(self.groups)) if gi not in self.unit_groups]
            for gi in loose:
                if gi not in self.gathered and gi not in self.inflight:
                    self.gather(gi)
            for gi in loose:
                self._resident(gi)
            # The autograd leaves are the parameters as views of their unit's buffer (made
            # while the buffer has its size: views are checked against it, no page is touched),
            # so each gradient arrives on its own and is copied into its group's reduce buffer.
            views = {}
            for g, flat in zip(self.groups, self.full):
                freed = g.index not in self.gathered
                if freed:
                    flat.untyped_storage().resize_(g.padded * flat.element_size())
                views.update(zip(g.names, g.views(flat)))
                if freed:
                    flat.untyped_storage().resize_(0)
            # Without units nothing is gathered inside the forward: it compiles whole, as at stage 2.
            with running(jit=None) if jit is not None and self.unit_groups else contextlib.nullcontext():
                yield views
        finally:
            for h in hooks:
                h.remove()
            for gi in list(self.inflight):  # prefetched, never used
                self.wait(gi)
            for gi in list(self.gathered):
                self.free(gi)
            self.pieces = {}


class _Handle:
    """Marks a saved tensor that is a view of a ZeRO-3 unit, to be gathered again."""


def _own_on_host(g: Group, pieces: dict[str, Shard], pin: bool) -> torch.Tensor:
    """This rank's owned slice of group ``g`` from its host ``pieces``: the one buffer they
    view when they are laid out so (as ``shard_state`` lays them out at ``init`` and an update
    in place keeps them), else a new one packed from them (padding zero, page-locked when
    ``pin``), as :meth:`Group.pack_own` packs on the device."""
    base = g.owned_buffer(pieces)
    if base is not None:
        return base
    own = torch.zeros(g.chunk, dtype=g.dtype, device="cpu", pin_memory=pin)
    for name, at in zip(g.names, g._placed(None)[1]):
        own[at] = pieces[name].local.reshape(-1)
    return own


def _empty_full(g: Group) -> torch.Tensor:
    t = torch.empty(g.padded, dtype=g.dtype, device=g.device)
    t.untyped_storage().resize_(0)
    return t


def find_units(module: torch.nn.Module, params: dict,
               predicate: Callable[[torch.nn.Module], bool] | None = None) -> list[tuple[torch.nn.Module, list[str]]]:
    """ZeRO-3 units of ``module``: ``(module, parameter names)`` of each element of a
    ModuleList (a transformer's blocks), or of each module ``predicate`` chooses; parameters
    outside every unit stay gathered for the step.

    A parameter that is also reachable from outside a unit (tied to an embedding outside
    it, or shared between two units) stays outside every unit: it is used where its unit
    is not gathered.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ModuleList([torch.nn.Linear(2, 2)]))
        >>> [names for _, names in find_units(model, dict(model.named_parameters()))]
        [['1.0.weight', '1.0.bias']]
    """
    aliases: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    prefixes: dict[int, list[str]] = {}
    for name, m in module.named_modules(remove_duplicate=False):
        prefixes.setdefault(id(m), []).append(name + "." if name else "")
    by_tensor = {id_: names[0] for id_, names in aliases.items()}
    if predicate is None:
        mods = [block for m in module.modules() if isinstance(m, torch.nn.ModuleList) for block in m]
    else:
        mods = [m for m in module.modules() if predicate(m)]
    units, seen = [], set()
    for m in mods:
        inside = tuple(prefixes.get(id(m), ()))
        names = [by_tensor[id(p)] for p in m.parameters() if by_tensor.get(id(p)) in params
                 and by_tensor[id(p)] not in seen
                 and all(a.startswith(inside) for a in aliases[id(p)])]
        if names:
            seen.update(names)
            units.append((m, names))
    return units
