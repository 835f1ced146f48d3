"""The fused path: the chains of ``adam``, ``adamw``, ``lamb``, ``lion`` and ``sgd``
(:func:`~fzero.optim.fused_spec_of`) run by ``fzero_kernels`` instead, one launch per flat
run of leaves. The lowering (:mod:`fzero.optim.lowering`) takes it where :func:`fuses` says.

When is it used (:func:`use_fused`):

* ``"auto"`` (default): where ``fzero_kernels`` runs its compiled Triton kernels: parameters
  on a GPU, unless ``FZERO_KERNELS_BACKEND=reference`` (or ``fzero_kernels.force_backend``)
  asks the kernels for their torch reference -- then the chain runs;
* ``"on"``: always (on a CPU the kernels' torch reference runs, or the Triton kernel under
  ``TRITON_INTERPRET=1`` -- the tests use both);
* ``"off"``: never.

``FZERO_FUSED=auto|on|off``, the old environment name of this choice, is still read (when
set, it decides outside a ``use_fused`` block); ``FZERO_KERNELS_BACKEND`` is the one name now.

One launch per *flat run* (Adam and AdamW: per group of runs, below): leaves whose parameters,
gradients and optimizer-state tensors each lie back to back in one storage (ZeRO's pieces of a flat group at stages 1-3: the
masters or parameters are views of the rank's owned slice, the gradients views of the
reduced slice, and the moments views of one buffer laid out like the parameters, see
``fzero.optim.transform._zeros_like``) are updated by one kernel over the flat span. A leaf
that shares no storage with its neighbours (stage 0: the module's own tensors) is a run of
its own. A leaf whose weight-decay mask differs from its neighbour's starts a new run (the
kernels take one ``weight_decay`` per launch). Adam and AdamW launch once per (decay flag,
grad dtype) group of runs, not per run (``fzero_kernels.adamw_multi_``, a multi-tensor
kernel): at stage 0 a model's leaves take one launch, not one each. LAMB, Lion and SGD still
launch per run.

Each launch does the whole update in one pass: the clip coefficient (from the global sum of
squares, a device tensor: no host read of the norm), the decay, the moments and the
parameter (LAMB: a norms launch, one ``psum`` of the per-tensor sums, an apply launch).
Under a donated step (``fzero.compile``'s default) the kernels write into the state's own
tensors: no clones. Otherwise each run's spans are copied once and updated.

The result equals the unfused chain's within fp32 rounding (the kernels follow
torch.optim's order of operations, the chain optax's; the clip coefficient and
``grad_norm`` are the chain's bit for bit; ``tests/test_fused_step.py``), and the optimizer state keeps the chain's structure, so a
checkpoint does not care which path wrote it. Only the chains
:func:`~fzero.optim.fused_spec_of` recognises are fused, optionally after one
``clip_by_global_norm``; anything else runs unfused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import Any, Literal

import torch

from fzero import tree
from fzero.optim._known import FusedSpec, fused_spec_of
from fzero.optim.base import GradientTransformation
from fzero.optim.transform import ScaleByAdamState, ScaleByLionState, ScaleByScheduleState, TraceState, _resolve_mask

__all__ = ["back_to_back", "fused_update", "span", "use_fused"]

Mode = Literal["auto", "on", "off"]
_forced: list[Mode] = []


@contextlib.contextmanager
def use_fused(mode: Mode) -> Iterator[None]:
    """Choose the fused path for the block: ``"auto"``, ``"on"`` or ``"off"``."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"fzero.optim.use_fused: mode must be 'auto', 'on' or 'off', got {mode!r}")
    _forced.append(mode)
    try:
        yield
    finally:
        _forced.pop()


def _mode() -> Mode:
    if _forced:
        return _forced[-1]
    mode = os.environ.get("FZERO_FUSED", "auto")  # the old name, still honoured when set
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"fzero.optim: FZERO_FUSED={mode!r} must be 'auto', 'on' or 'off'")
    return mode  # type: ignore[return-value]


def _compiled(p: torch.Tensor) -> bool:
    """Whether ``fzero_kernels`` runs its compiled Triton kernels on ``p``: a GPU tensor whose
    kernels are not sent to their torch reference (``FZERO_KERNELS_BACKEND``)."""
    if p.device.type != "cuda":
        return False
    import fzero_kernels

    return fzero_kernels.backend_for(p) == "triton"


# --------------------------------------------------------------------------- the state


# The state node each kind's kernel updates, and the fields of it that are per-leaf tensors.
_NODE = {"adam": (ScaleByAdamState, ("mu", "nu")), "adamw": (ScaleByAdamState, ("mu", "nu")),
         "lamb": (ScaleByAdamState, ("mu", "nu")), "lion": (ScaleByLionState, ("mu",)),
         "sgd": (TraceState, ("trace",))}


def _find(state: Any, kind: type) -> tuple[Any, ...] | None:
    """The index path of the (first) ``kind`` node inside a chain's nested tuples."""
    if isinstance(state, kind):
        return ()
    if isinstance(state, tuple):
        for i, s in enumerate(state):
            sub = _find(s, kind)
            if sub is not None:
                return (i, *sub)
    return None


def _node(state: Any, path: tuple) -> Any:
    for i in path:
        state = state[i]
    return state


def _rebuild(state: Any, path: tuple | None, node: Any) -> Any:
    """``state`` with the node at ``path`` replaced (``None``: none) and every other count advanced."""
    if path is not None and not path:
        return node
    if not isinstance(state, tuple):
        return state
    if hasattr(state, "_fields") and "count" in state._fields:
        return state._replace(count=state.count + 1)
    out = [_rebuild(s, path[1:] if path is not None and i == path[0] else None, node)
           if path is not None and i == path[0] else _rebuild(s, None, node) for i, s in enumerate(state)]
    return type(state)(*out) if hasattr(state, "_fields") else tuple(out)


def _count(state: Any) -> int:
    """The 0-based index of this update: the count of any counter in the state (they move
    together), read from a CPU tensor (no device sync); 0 where the chain keeps none."""
    for kind in (ScaleByAdamState, ScaleByLionState, ScaleByScheduleState):
        path = _find(state, kind)
        if path is not None:
            return int(_node(state, path).count)
    return 0


# --------------------------------------------------------------------------- flat runs


def _follows(t: torch.Tensor, prev: torch.Tensor) -> bool:
    """``t`` starts where ``prev`` ends, in the same storage, both dense and of one dtype."""
    return (t.dtype == prev.dtype and t.device == prev.device and t.is_contiguous()
            and t.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
            and t.storage_offset() == prev.storage_offset() + prev.numel())


def back_to_back(operands: list[list[torch.Tensor]], keys: list[Any]) -> list[list[int]]:
    """Leaf indices cut into runs: consecutive in memory for every operand (each operand's
    tensors back to back in one storage) and of one ``keys`` value (the decay flag). Empty
    leaves are left out (nothing to update); a non-contiguous leaf is a run of its own."""
    first = operands[0]
    # (storage, offset, index) of the first operand's live leaves, in memory order: a leaf
    # that does not start where the previous one ends there opens a run without a look at
    # the other operands (at stage 0, where each parameter is its own tensor, every leaf).
    at = sorted((t.untyped_storage().data_ptr(), t.storage_offset(), i) for i, t in enumerate(first) if t.numel())
    runs: list[list[int]] = []
    end = None  # (storage, offset) where the last run's first-operand leaf ends
    for ptr, off, i in at:
        if end == (ptr, off):
            j = runs[-1][-1]
            if keys[i] == keys[j] and all(op[j].is_contiguous() and _follows(op[i], op[j]) for op in operands):
                runs[-1].append(i)
                end = (ptr, off + first[i].numel())
                continue
        runs.append([i])
        end = (ptr, off + first[i].numel())
    return runs


def span(ts: list[torch.Tensor]) -> torch.Tensor:
    """The 1-D view of the storage ``ts`` (back to back, see :func:`back_to_back`) cover; a
    row-major copy when a single leaf is not contiguous."""
    t = ts[0].detach()
    if len(ts) == 1:
        return _flat1(t, True)
    return t.as_strided((sum(x.numel() for x in ts),), (1,), t.storage_offset())


@dataclasses.dataclass
class _Run:
    """One launch's operands: flat ``param``, ``grad`` and state spans over ``leaves``."""

    leaves: list[int]
    sizes: list[int]
    param: torch.Tensor
    grad: torch.Tensor
    states: list[torch.Tensor]
    decay: bool


def _flat1(t: torch.Tensor, flat: bool) -> torch.Tensor:
    """One leaf as a run's operand: itself (``flat``: its 1-D view) when dense, else a
    row-major copy."""
    if not t.is_contiguous():
        t = t.clone(memory_format=torch.contiguous_format)
    return t.view(-1) if flat else t


def _prepare(runs: list[list[int]], p: list, g: list, states: list[list], decay: list[bool],
             donate: bool, flat: bool = True) -> list[_Run]:
    """The operands of each run. Donated, the parameter and state operands are the state's
    own memory (the kernel writes the new state where it is); otherwise one copy each.
    ``flat``: 1-D spans, as the Triton kernels take them; otherwise a run of one leaf keeps
    the leaf's shape (torch's kernels take any dense shape), which saves its views."""
    out = []
    for idx in runs:
        if len(idx) == 1:  # the usual case at stage 0: no span to form
            i = idx[0]
            param, grad = _flat1(p[i], flat), _flat1(g[i], flat)  # under no_grad: no detach
            st = [_flat1(s[i], flat) for s in states]
            if not donate:
                param = param.clone() if param.data_ptr() == p[i].data_ptr() else param
                st = [x.clone() if x.data_ptr() == s[i].data_ptr() else x for x, s in zip(st, states)]
            out.append(_Run(idx, [p[i].numel()], param, grad, st, decay[i]))
            continue
        param = span([p[i] for i in idx])
        st = [span([s[i] for i in idx]) for s in states]
        if not donate:
            param = param.clone() if param.data_ptr() == p[idx[0]].data_ptr() else param
            st = [x.clone() if x.data_ptr() == s[idx[0]].data_ptr() else x for x, s in zip(st, states)]
        out.append(_Run(idx, [p[i].numel() for i in idx], param, span([g[i] for i in idx]), st, decay[idx[0]]))
    return out


def _clones(leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """A copy of each leaf (strides kept): one multi-tensor call where torch has it."""
    clone = getattr(torch, "_foreach_clone", None)  # torch 2.13 has it, 2.11 not
    return clone(leaves) if clone is not None and leaves else [t.clone() for t in leaves]


def _dense(operands: list[list[torch.Tensor]]) -> bool:
    """Every leaf of every operand is contiguous."""
    return all(t.is_contiguous() for op in operands for t in op)


def _write_back(leaves: list[torch.Tensor], flat: torch.Tensor, run: _Run, donate: bool) -> None:
    """The run's new leaves into ``leaves`` (in place): views of ``flat``, or, for a donated
    non-contiguous leaf, the leaf itself with the row-major result copied into it."""
    if len(run.leaves) == 1:
        i = run.leaves[0]
        old = leaves[i]
        if not donate:
            leaves[i] = flat.view(old.shape)
        elif flat.data_ptr() != old.data_ptr():  # donated, updated on a row-major copy
            old.copy_(flat.view(old.shape))
        return
    if donate:  # the spans are views of the leaves: written in place
        return
    off = 0
    for i, n in zip(run.leaves, run.sizes):
        leaves[i] = flat[off:off + n].view(leaves[i].shape)
        off += n


# --------------------------------------------------------------------------- the launches


def _launch(spec: FusedSpec, run: _Run, *, lr: float, step: int, clip: dict, found_inf, grad_scale) -> None:
    import fzero_kernels

    wd = spec.weight_decay if run.decay else 0.0
    common = dict(grad_scale=grad_scale, found_inf=found_inf, **clip)
    if spec.kind in ("adam", "adamw"):
        kernel = fzero_kernels.adamw_ if spec.kind == "adamw" else fzero_kernels.adam_
        kernel(run.param, run.grad, *run.states, lr=lr, beta1=spec.b1, beta2=spec.b2, eps=spec.eps,
               weight_decay=wd, step=step, **common)
    elif spec.kind == "lion":
        fzero_kernels.lion_(run.param, run.grad, *run.states, lr=lr, beta1=spec.b1, beta2=spec.b2,
                            weight_decay=wd, **common)
    else:  # sgd. The trace starts at zeros, so "buf = momentum * buf + g" from the first
        # update on is the chain's arithmetic (step > 1: the kernel never copies g in).
        fzero_kernels.sgd_(run.param, run.grad, run.states[0] if run.states else None, lr=lr,
                           momentum=spec.momentum or 0.0, nesterov=spec.nesterov, weight_decay=wd,
                           step=2 if spec.momentum else None, **common)


def _adam_groups(spec: FusedSpec, runs: list[_Run], *, lr: float, step: int, clip: dict, found_inf,
                 grad_scale) -> None:
    """Adam/AdamW over several runs: one multi-tensor launch per (decay flag, grad dtype)
    group of runs -- the kernel takes one ``weight_decay`` and is specialised on the grad
    dtype -- and the per-run launch for a group of one."""
    import fzero_kernels

    groups: dict[tuple[bool, torch.dtype], list[_Run]] = {}
    for run in runs:
        groups.setdefault((run.decay, run.grad.dtype), []).append(run)
    multi = fzero_kernels.adamw_multi_ if spec.kind == "adamw" else fzero_kernels.adam_multi_
    for (decay, _), group in groups.items():
        if len(group) == 1:
            _launch(spec, group[0], lr=lr, step=step, clip=clip, found_inf=found_inf, grad_scale=grad_scale)
            continue
        multi([r.param for r in group], [r.grad for r in group], [r.states[0] for r in group],
              [r.states[1] for r in group], lr=lr, beta1=spec.b1, beta2=spec.b2, eps=spec.eps,
              weight_decay=spec.weight_decay if decay else 0.0, step=step, grad_scale=grad_scale,
              found_inf=found_inf, **clip)


def _torch_adam(spec: FusedSpec, params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, decays: list[bool],
                *, lr: float, step: int, clip: dict, found_inf, grad_scale) -> None:
    """Adam/AdamW over the operands (runs' spans, or leaves) by torch's fused CPU kernel
    (``torch._fused_adamw_``), one call per decay flag: one pass over each instead of the
    chain's ten, written in place. The gradients it reads are the kernels'
    (:func:`_torch_grads`); ``found_inf`` skips the update, as the kernels do."""
    found = None if found_inf is None else (found_inf.reshape(()) > 0).to(torch.float32)
    grads, bad = _torch_grads(grads, grad_scale, clip)
    if bad is not None:  # a non-finite sum of squares: the kernels skip the update
        found = bad if found is None else torch.maximum(found, bad)
    fn = torch._fused_adamw_ if spec.kind == "adamw" else torch._fused_adam_
    steps = [torch.tensor(float(step))] * len(params)  # read, never written, by the kernel
    for decay in (True, False):
        idx = [i for i, d in enumerate(decays) if d == decay]
        if not idx:  # (a rank that owns no piece of any parameter has nothing to update)
            continue
        if len(idx) == len(params):  # every operand: the lists as they are
            ops = (params, grads, exp_avgs, exp_avg_sqs)
        else:
            ops = tuple([x[i] for i in idx] for x in (params, grads, exp_avgs, exp_avg_sqs))
        fn(*ops, [], steps[:len(idx)], lr=lr, beta1=spec.b1, beta2=spec.b2,
           weight_decay=spec.weight_decay if decay else 0.0, eps=spec.eps, amsgrad=False, maximize=False,
           grad_scale=None, found_inf=found)


def _torch_grads(grads: list[torch.Tensor], grad_scale, clip: dict) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """The fp32 gradients the update reads, as the kernels form them: divided by
    ``grad_scale``, times the clip coefficient ``min(1, max_norm / (norm + 1e-6))`` -- new
    tensors then (torch's kernel would write its own unscaling back into the gradients it is
    given); and 1.0 where the clip's sum of squares is not finite (else ``None``)."""
    scaled = isinstance(grad_scale, torch.Tensor) or grad_scale != 1.0
    if not scaled and not clip:
        return [g if g.dtype == torch.float32 else g.to(torch.float32) for g in grads], None
    if not clip:
        return [torch.div(g.to(torch.float32), grad_scale) for g in grads], None
    sumsq = clip["grad_sumsq"]
    coef = torch.clamp(clip["max_norm"] / (sumsq.sqrt().to(torch.float32) + 1e-6), max=1.0)
    if scaled:
        out = [torch.div(g.to(torch.float32), grad_scale) for g in grads]
        torch._foreach_mul_(out, coef)
    else:  # one pass: the same bits as dividing by 1 first
        out = torch._foreach_mul([g if g.dtype == torch.float32 else g.to(torch.float32) for g in grads], coef)
    return out, torch.logical_not(torch.isfinite(sumsq)).to(torch.float32)


def _lamb(spec: FusedSpec, runs: list[_Run], params: Any, n_leaves: int, device, *, lr: float, step: int,
          clip: dict, found_inf, grad_scale) -> None:
    """LAMB: per run the per-tensor sums of squares (launch 1), one ``psum`` of them all
    (exact on ZeRO's pieces and tp's slices), then per run the update (launch 2)."""
    import fzero_kernels

    from fzero.core import LeafSums, psum

    param_sq = torch.zeros(n_leaves, dtype=torch.float64, device=device)
    update_sq = torch.zeros(n_leaves, dtype=torch.float64, device=device)
    tables = []
    for run in runs:
        offsets = [0]
        for n in run.sizes:
            offsets.append(offsets[-1] + n)
        kw = dict(segments=tuple(offsets), tensor_ids=tuple(run.leaves), num_tensors=n_leaves, beta1=spec.b1,
                  beta2=spec.b2, eps=spec.eps, eps_root=spec.eps_root or 0.0,
                  weight_decay=spec.weight_decay if run.decay else 0.0, step=step, grad_scale=grad_scale, **clip)
        norms = fzero_kernels.lamb_partial_norms(run.param, run.grad, *run.states, **kw)
        param_sq += norms.param_sq
        update_sq += norms.update_sq
        tables.append(kw)
    sums = psum(LeafSums.of([params, params], torch.cat([param_sq, update_sq])))
    param_sq, update_sq = sums[:n_leaves], sums[n_leaves:]
    for run, kw in zip(runs, tables):
        fzero_kernels.lamb_apply_(run.param, run.grad, *run.states, param_sq=param_sq, update_sq=update_sq, lr=lr,
                                  found_inf=found_inf, **kw)


# --------------------------------------------------------------------------- the update


def fuses(tx: GradientTransformation, params: Any) -> bool:
    """Whether :func:`fused_update` runs ``tx`` on ``params`` (fp32 leaves) in this mode.

    Raises:
        ValueError: ``FZERO_FUSED`` is not ``auto``, ``on`` or ``off``.
    """
    mode, spec = _mode(), fused_spec_of(tx)
    return _fuses(mode, spec, tree.leaves(params)) if spec is not None else False


def _fuses(mode: str, spec: FusedSpec, p_leaves: list) -> bool:
    """:func:`fuses`, given the mode, the optimizer's spec and the parameters' leaves."""
    if mode == "off":
        return False
    if not p_leaves or not all(isinstance(p, torch.Tensor) and p.dtype == torch.float32 for p in p_leaves):
        return False
    return mode == "on" or _compiled(p_leaves[0]) or _torch_cpu(spec, p_leaves[0])


def _torch_cpu(spec: FusedSpec, p: torch.Tensor) -> bool:
    """Whether ``"auto"`` runs ``spec`` on ``p`` with torch's own fused CPU kernel (the one
    ``torch.optim.AdamW(fused=True)`` runs): Adam and AdamW without ``eps_root``, on the CPU."""
    return (p.device.type == "cpu" and spec.kind in ("adam", "adamw") and not spec.eps_root
            and hasattr(torch, "_fused_adamw_"))


def fused_update(tx: GradientTransformation, grads: Any, opt_state: Any, params: Any, *, donate: bool = False,
                 found_inf: torch.Tensor | None = None, grad_scale: float | torch.Tensor = 1.0):
    """``(new_params, new_opt_state)`` by the fused kernels, or ``None`` to run unfused.

    Args:
        tx: the optimizer (:func:`~fzero.optim.fused_spec_of` says whether and how).
        grads, opt_state, params: as ``tx.update``'s; leaves may be ZeRO's pieces.
        donate: the caller gives ``params`` and ``opt_state`` up: the kernels write into
            them (no copies). Otherwise nothing passed in is written to.
        found_inf: optional 1-element device tensor; nonzero: every kernel leaves the
            parameters and moments as they are (the counts still advance: the caller that
            passes it decides about the step, see docs/kernels.md).
        grad_scale: ``grads`` are divided by it first, in the same pass (a loss scale).

    Returns:
        ``None`` when the fused path does not apply (mode, optimizer, dtypes, device), else
        the new parameters and optimizer state, with the structures of the ones given.

    Raises:
        ValueError: ``FZERO_FUSED`` is not ``auto``, ``on`` or ``off``; the kernels' own
            errors (``fzero_kernels.*``) for a hyperparameter they refuse.
    """
    mode, spec = _mode(), fused_spec_of(tx)
    if spec is None:
        return None
    p_leaves, p_spec = tree.flatten(params)
    if not _fuses(mode, spec, p_leaves):  # checked on the leaves flattened here: one walk of the tree
        return None
    g_leaves = tree.leaves(grads)
    if len(g_leaves) != len(p_leaves) or not all(isinstance(g, torch.Tensor) and g.dtype in (
            torch.float32, torch.bfloat16, torch.float16) for g in g_leaves):
        return None
    node_type, fields = _NODE[spec.kind]
    path = _find(opt_state, node_type)
    if spec.kind == "sgd" and not spec.momentum:
        path, fields = None, ()
    elif path is None:
        return None
    node = _node(opt_state, path) if path is not None else None
    s_trees = [getattr(node, f) for f in fields]
    s_flat = [tree.flatten(t) for t in s_trees]
    s_leaves = [leaves for leaves, _ in s_flat]

    from fzero.optim.clipping import global_sumsq
    from fzero.core import emit_metric

    with torch.no_grad():
        count = _count(opt_state)
        lr = float(spec.learning_rate(count)) if callable(spec.learning_rate) else spec.learning_rate
        decay = [True] * len(p_leaves) if spec.mask is None else list(
            _resolve_mask(f"fzero.optim.{spec.kind}", spec.mask, params, p_spec))
        device = p_leaves[0].device
        clip = {}
        if spec.clip_norm is not None:
            # clip_by_global_norm's sum of squares (the same function, so the same bits, or
            # the non-finite check's when it took it), left on the device: the kernels form
            # the coefficient from it.
            sq = global_sumsq(grads, device)
            emit_metric("grad_norm", sq.sqrt())
            clip = dict(grad_sumsq=sq.to(torch.float64), max_norm=float(spec.clip_norm))
        on_torch = mode == "auto" and _torch_cpu(spec, p_leaves[0])
        kw = dict(lr=lr, step=count + 1, clip=clip, found_inf=found_inf, grad_scale=grad_scale)
        leafwise = on_torch and _dense([p_leaves, g_leaves, *s_leaves])
        if leafwise and not donate:  # the new state: a copy of each leaf, updated in place below
            p_leaves, s_leaves = _clones(p_leaves), [_clones(x) for x in s_leaves]
        runs = [] if leafwise else _prepare(back_to_back([p_leaves, g_leaves, *s_leaves], decay), p_leaves,
                                            g_leaves, s_leaves, decay, donate, flat=not on_torch)
        if leafwise:
            # torch's kernel takes the leaves as they are (the state's own, donated; else
            # their copies), in place: no runs to find, no spans to form, nothing to write
            # back (the same elementwise pass, bit for bit)
            live = [i for i, t in enumerate(p_leaves) if t.numel()]
            pick = (lambda x: x) if len(live) == len(p_leaves) else (lambda x: [x[i] for i in live])
            _torch_adam(spec, pick(p_leaves), pick(g_leaves), *(pick(x) for x in s_leaves), pick(decay), **kw)
        elif on_torch:
            _torch_adam(spec, [r.param for r in runs], [r.grad for r in runs], [r.states[0] for r in runs],
                        [r.states[1] for r in runs], [r.decay for r in runs], **kw)
        elif spec.kind == "lamb":
            _lamb(spec, runs, params, len(p_leaves), device, **kw)
        elif spec.kind in ("adam", "adamw") and len(runs) > 1:
            _adam_groups(spec, runs, **kw)
        else:
            for run in runs:
                _launch(spec, run, **kw)
        new_p, new_s = list(p_leaves), [list(s) for s in s_leaves]
        if not donate:  # an empty leaf (a piece another rank owns) is in no run: a fresh one, not a
            # view that would keep the old state's storage alive
            for leaves in (new_p, *new_s):
                for i, t in enumerate(leaves):
                    if not t.numel():
                        leaves[i] = torch.empty_like(t)
        for run in runs:
            _write_back(new_p, run.param, run, donate)
            for leaves, flat in zip(new_s, run.states):
                _write_back(leaves, flat, run, donate)
    if node is not None:
        node = node._replace(**{f: tree.unflatten(spec_, s) for f, (_, spec_), s in zip(fields, s_flat, new_s)})
        if "count" in node._fields:
            node = node._replace(count=node.count + 1)
    return tree.unflatten(p_spec, new_p), _rebuild(opt_state, path, node)
