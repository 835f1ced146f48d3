"""Any ``torch.optim.Optimizer`` as a gradient transformation: :func:`from_torch`.

The optimizer's own ``step()`` does the math, so the result is the optimizer's, bit for bit
on the same tensors. fzero keeps what the optimizer keeps between steps (its ``state``
dict per parameter: ``exp_avg``, ``square_avg``, ``step``, ...) as tensors in
``opt_state``, keyed like the parameters, so it is checkpointed, resharded and exported
with the rest of the state. ``update`` is pure: each call builds a throwaway optimizer
over fresh copies of the parameters, loads the state tensors into ``optimizer.state[p]``,
calls ``step()`` and reads back the new parameters (the update is ``new - old``) and the
new state. Under ``donate=True`` (the step owns its input state) the state tensors are
handed to the optimizer as they are and it writes them in place; a compiled step's update of
an element-wise ``from_torch``, bare or last in a chain, goes further (``step_in_place``,
taken by :mod:`fzero.optim.lowering`): the optimizer steps the parameters themselves, so no
copy of them is made and the new parameters are torch's own bits.

Under ZeRO stages 1-3 the optimizer sees this rank's pieces of each parameter (flat runs of
elements). An element-wise optimizer computes the same there; one whose update reads the
whole tensor does not, so each of its parameters is updated whole by an owner rank
(:mod:`fzero.optim._owners`). Which kind a class is comes from ``elementwise=``, with
torch's own classes known (:data:`ELEMENTWISE`); an undeclared class runs at ZeRO 0 and is
refused at ZeRO >= 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from fzero import tree
from fzero.optim import _known
from fzero.optim._checks import type_name
from fzero.optim._owners import LeafState, assign_owners, is_leaf_state, is_piece, owned_leaf, present, refuse_split, run_whole
from fzero.optim.base import GradientTransformation, _increment, _new_count
from fzero.optim.transform import _need_params, _resolve_mask, _schedule_value

__all__ = ["FromTorchState", "TorchState", "from_torch"]

WHERE = "fzero.optim.from_torch"

#: torch's own optimizers and whether each updates every element from that element alone.
ELEMENTWISE: dict[type, bool] = {
    **{cls: True for cls in (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
                             torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad,
                             torch.optim.Adadelta, torch.optim.ASGD, torch.optim.Rprop)},
    # factored second moments and the parameter's RMS; the orthogonalised momentum matrix
    **{cls: False for cls in (getattr(torch.optim, "Adafactor", None), getattr(torch.optim, "Muon", None)) if cls},
}

_REFUSED = {
    torch.optim.LBFGS: "its step() needs a closure that evaluates the loss again, which a pure update has not",
    torch.optim.SparseAdam: "it takes sparse gradients, and fzero's gradients are dense",
}


#: One parameter's entry of the optimizer's ``state``: tensors by name (``exp_avg``,
#: ``step``, ...), a pytree node (key paths read ``['w']['exp_avg']``).
TorchState = LeafState


class FromTorchState(NamedTuple):
    """The state of :func:`from_torch`: the update count (a 0-dim int64 CPU tensor, which a
    learning-rate schedule reads) and, keyed like the parameters, each parameter's
    :class:`TorchState`. Under ZeRO an element-wise optimizer's per-element tensors are this
    rank's pieces; a whole-tensor optimizer's state of a parameter lives on its owner rank."""

    count: torch.Tensor
    state: Any


def _check_class(cls: Any) -> None:
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TypeError(f"{WHERE}: expected a torch.optim.Optimizer subclass (e.g. torch.optim.RMSprop), "
                        f"got {type_name(cls)} {cls!r}")
    for refused, why in _REFUSED.items():
        if issubclass(cls, refused):
            raise TypeError(f"{WHERE}: {cls.__qualname__} cannot run as a gradient transformation: {why}")


def _check_groups(param_groups: Any) -> list[dict]:
    if isinstance(param_groups, Mapping) or not isinstance(param_groups, Sequence):
        raise TypeError(f"{WHERE}: param_groups must be a list of dicts, each with a 'mask' and the hyperparameters "
                        f"that differ for it, got {type_name(param_groups)}")
    groups = []
    for i, g in enumerate(param_groups):
        if not isinstance(g, Mapping) or "mask" not in g:
            raise TypeError(f"{WHERE}: param_groups[{i}] must be a dict with a 'mask' (a pytree of bools like the "
                            f"params, or a callable params -> such a pytree) and hyperparameters, got {g!r}")
        if "params" in g:
            raise TypeError(f"{WHERE}: param_groups[{i}] chooses its parameters by 'mask', not 'params' (fzero's "
                            f"parameters are pytree leaves, not tensors of a module)")
        groups.append(dict(g))
    return groups


def from_torch(optimizer_cls: type, *, elementwise: bool | None = None, param_groups: Sequence[Mapping] = (),
               **hyperparams: Any) -> GradientTransformation:
    """Run the ``torch.optim.Optimizer`` subclass ``optimizer_cls`` as a gradient transformation.

    ``TrainState.create(..., tx=from_torch(torch.optim.RMSprop, lr=1e-3))`` trains as
    ``torch.optim.RMSprop(model.parameters(), lr=1e-3)`` does, under every transform: ZeRO
    0-3, mixed precision (on the fp32 masters), accumulation, clipping
    (``chain(clip_by_global_norm(1.0), from_torch(...))``), offload, tensor and pipeline
    parallelism.

    Args:
        optimizer_cls: a ``torch.optim.Optimizer`` subclass following torch's protocol
            (``param_groups``, ``state[p]``, ``step()`` without a closure).
        elementwise: whether the optimizer updates each element from that element (and its
            own state) alone. ``True``: under ZeRO >= 1 it runs on this rank's pieces.
            ``False``: each parameter gets an owner rank that updates it whole. ``None``
            (default): known for torch's own classes (:data:`ELEMENTWISE`: SGD, Adam, AdamW,
            Adamax, NAdam, RAdam, RMSprop, Adagrad, Adadelta, ASGD, Rprop element-wise;
            Adafactor, Muon whole-tensor); any other class runs at ZeRO 0 and is refused at
            ZeRO >= 1 until declared.
        param_groups: torch's parameter groups, chosen by mask: a list of dicts, each with a
            ``"mask"`` (a pytree of bools like the params, or a callable ``params -> such a
            pytree``, as :func:`fzero.optim.masked` takes) and the hyperparameters that differ
            for its parameters. A parameter belongs to the first group whose mask says
            ``True``, else to the default group (``hyperparams``). The common case, no weight
            decay for biases and norms::

                from_torch(torch.optim.AdamW, lr=1e-3, weight_decay=0.1,
                           param_groups=[{"mask": lambda p: {k: v.ndim < 2 for k, v in p.items()},
                                          "weight_decay": 0.0}])

        **hyperparams: the optimizer's keyword arguments. ``lr`` may be a float or a
            schedule ``fn(count) -> lr`` (:mod:`fzero.optim.schedules`), set as each group's
            ``lr`` before each step from the 0-based update count.

    Returns:
        A :class:`GradientTransformation` with state :class:`FromTorchState`.

    Raises:
        TypeError: ``optimizer_cls`` is not an optimizer class, or one that needs a closure
            (LBFGS) or sparse gradients (SparseAdam); a malformed ``param_groups``;
            hyperparameters the class refuses (its own message).

    Example:
        >>> import torch
        >>> from fzero import optim
        >>> tx = optim.from_torch(torch.optim.SGD, lr=0.1, momentum=0.9)
        >>> params = {"w": torch.ones(2)}
        >>> updates, state = tx.update({"w": torch.tensor([1.0, -2.0])}, tx.init(params), params)
        >>> updates["w"], sorted(state.state["w"])
        (tensor([-0.1000,  0.2000]), ['momentum_buffer'])
    """
    _check_class(optimizer_cls)
    if elementwise not in (None, True, False):
        raise TypeError(f"{WHERE}: elementwise must be True, False or None, got {elementwise!r}")
    declared = ELEMENTWISE.get(optimizer_cls) if elementwise is None else elementwise
    groups = _check_groups(param_groups)
    trusted = optimizer_cls in ELEMENTWISE  # torch's own never write into the gradients they are given
    group_hps = [dict(hyperparams)] + [{**hyperparams, **{k: v for k, v in g.items() if k != "mask"}} for g in groups]
    masks = [g["mask"] for g in groups]
    whole = declared is False

    def concrete(hp: dict, count: int) -> dict:
        return {k: (_schedule_value(WHERE, v, count) if k == "lr" and callable(v) else v) for k, v in hp.items()}

    # The class checks its hyperparameters now, not at the first step (a 2-D probe: Muon takes matrices only).
    for hp in group_hps:
        try:
            optimizer_cls([torch.zeros(2, 2)], **concrete(hp, 0))
        except (TypeError, ValueError) as e:
            raise type(e)(f"{WHERE}: {optimizer_cls.__qualname__} refuses the hyperparameters {hp}: {e}") from None

    def group_of(params) -> list[int]:
        """The group of each leaf of ``params`` (0: the default group)."""
        n = len(tree.leaves(params))
        out = [0] * n
        for gi in reversed(range(len(masks))):  # the first matching group wins
            for i, f in enumerate(_resolve_mask(WHERE, masks[gi], params)):
                if f:
                    out[i] = gi + 1
        return out

    def step(items: list[tuple[torch.Tensor, torch.Tensor, dict, int]], count: int, *, fresh: bool,
             donate: bool, inplace: bool, on_params: bool = False) -> list[tuple[torch.Tensor | None, dict]]:
        """One ``step()`` of a throwaway optimizer over ``(grad, param, state, group)``;
        ``fresh``: the optimizer starts its state itself (the first update). ``on_params``:
        it steps the parameters themselves, in place, and returns no update."""
        if not items:
            return []
        with torch.no_grad():
            copies = []
            members: dict[int, list[torch.Tensor]] = {}
            for g, p, _, gi in items:
                q = p if on_params else p.detach().clone()
                g = g.detach()
                q.grad = g.to(q.dtype) if (trusted or inplace) else g.to(q.dtype, copy=True)
                copies.append(q)
                members.setdefault(gi, []).append(q)
            opt = optimizer_cls([{"params": qs, **concrete(group_hps[gi], count)} for gi, qs in members.items()],
                                **concrete(group_hps[0], count))
            if not fresh:
                for q, (_, _, st, _) in zip(copies, items):
                    opt.state[q] = {k: (v if donate else v.clone()) for k, v in st.items()}
            try:
                opt.step()
            except Exception as e:
                if on_params:
                    for q in copies:
                        q.grad = None
                # Meta tensors have no values: torch builds a parameter's state before its
                # math, which may read a value (.item()); the state built is what a probe needs.
                if not (copies[0].device.type == "meta" and fresh and all(q in opt.state for q in copies)):
                    raise type(e)(f"{WHERE}: {optimizer_cls.__qualname__}.step() failed: {e}") from e
            out = []
            for q, (_, p, _, _) in zip(copies, items):
                new_state = dict(opt.state.get(q, {}))
                bad = [k for k, v in new_state.items() if not isinstance(v, torch.Tensor)]
                if bad:
                    raise TypeError(f"{WHERE}: {optimizer_cls.__qualname__} keeps non-tensor state {bad} per "
                                    f"parameter; fzero keeps optimizer state as tensors only (checkpoints hold "
                                    f"no pickled objects)")
                if on_params:
                    q.grad = None  # the parameter outlives this step; its gradient must not
                    out.append((None, new_state))
                else:
                    out.append((q.sub_(p), new_state))
            return out

    probes: dict[tuple, dict] = {}

    def probe(shape, dtype, device, gi) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The names, shapes and dtypes of the state the optimizer keeps for a parameter of
        ``shape`` in group ``gi`` (torch builds it lazily, at the first step)."""
        key = (tuple(shape), dtype, str(device), gi)
        if key not in probes:
            z = torch.zeros(shape, dtype=dtype, device=device)
            (_, st), = step([(z, z, {}, gi)], 0, fresh=True, donate=False, inplace=True)
            probes[key] = {k: (tuple(v.shape), v.dtype) for k, v in st.items()}
        return probes[key]

    def init_fn(params):
        if whole:
            refuse_split(WHERE, params)
        all_leaves, spec = tree.flatten(params, is_leaf=is_piece)
        here = present(all_leaves)
        leaves = [all_leaves[i] for i in here]
        gis = group_of(params)
        split = [i for i, x in enumerate(leaves) if is_piece(x)]
        owners = dict(zip(split, assign_owners([x.info.numel for x in (leaves[i] for i in split)],
                                               leaves[split[0]].info.world if split else 1)))
        out = []
        for i, x in enumerate(leaves):
            local = x.local if is_piece(x) else x
            if whole and is_piece(x):
                found = probe(x.info.shape, local.dtype, local.device, gis[i])
                out.append(TorchState({k: owned_leaf(x, None, s, d, owners[i]) for k, (s, d) in found.items()}))
                continue
            found = probe(local.shape, local.dtype, local.device, gis[i])
            st = {k: torch.zeros(s, dtype=d, device=local.device) for k, (s, d) in found.items()}
            out.append(TorchState(_as_pieces(st, x)))
        return FromTorchState(count=_new_count(), state=tree.unflatten(spec, _fill(all_leaves, here, out,
                                                                                        TorchState())))

    def update_fn(updates, state, params=None, *, inplace=False, donate=False):
        return _update(updates, state, params, inplace=inplace, donate=donate, on_params=False)

    def step_in_place(grads, state, params):
        """A donated update that steps the optimizer on ``params`` themselves (this rank's
        pieces under ZeRO): no copy of the parameters, no update tensor, and the new
        parameters are the optimizer's own bits. Returns ``(params, state)``."""
        _, new_state = _update(grads, state, params, inplace=False, donate=True, on_params=True)
        return params, new_state

    def _update(updates, state, params, *, inplace, donate, on_params):
        _need_params(WHERE, params)
        if whole:
            refuse_split(WHERE, params)
        if not isinstance(state, FromTorchState):
            raise TypeError(f"{WHERE}: the state must be the FromTorchState init returned, got {type_name(state)}")
        all_g, all_s, spec, s_spec, here, (p_leaves, g_leaves, s_leaves) = _per_leaf(WHERE, updates, state.state,
                                                                                     params)
        count = int(state.count)
        gis = group_of(params)
        opts = dict(fresh=count == 0, donate=donate, inplace=inplace)
        if on_params:
            opts["on_params"] = True
        if whole:
            def whole_step(idx, wholes):
                return step([(g, p, st, gis[i]) for i, (g, p, st) in zip(idx, wholes)], count, **opts)

            new_u, new_s = run_whole(g_leaves, p_leaves, [dict(s) for s in s_leaves], whole_step)
            new_s = [TorchState(s) for s in new_s]
        else:
            local = [(g.local if is_piece(g) else g, p.local if is_piece(p) else p,
                      {k: (v.local if is_piece(v) else v) for k, v in s.items()}, gi)
                     for g, p, s, gi in zip(g_leaves, p_leaves, s_leaves, gis)]
            results = step(local, count, **opts)
            new_u = [type(g)(u, g.info) if is_piece(g) and u is not None else u for g, (u, _) in zip(g_leaves, results)]
            new_s = [TorchState(_as_pieces(s, p)) for p, (_, s) in zip(p_leaves, results)]
        return tree.unflatten(spec, _fill(all_g, here, new_u)), FromTorchState(
            count=_increment(state.count), state=tree.unflatten(s_spec, _fill(all_s, here, new_s)))

    tx = GradientTransformation(init_fn, update_fn)
    return _known.record(tx, _known.FromTorch(optimizer_cls, declared, None if whole else step_in_place))


def _per_leaf(where: str, updates: Any, state_tree: Any, params: Any) -> tuple:
    """The leaves of a per-parameter optimizer's ``update``, ZeRO pieces whole:
    ``(update leaves, state leaves, params' spec, the state's spec, here, (params, updates,
    states at here))``, ``here`` the indices of the parameters present on this rank; the
    three trees must have the parameters' structure."""
    all_p, spec = tree.flatten(params, is_leaf=is_piece)
    all_g, g_spec = tree.flatten(updates, is_leaf=is_piece)
    if g_spec != spec:
        tree.assert_same_structure(params, updates, what=where, names=("params", "updates"))
    all_s, s_spec = tree.flatten(state_tree, is_leaf=is_leaf_state)
    if len(all_s) != len(all_p) or not all(map(is_leaf_state, all_s)):
        tree.assert_same_structure(params, state_tree, what=where, names=("params", "the optimizer state"))
    here = present(all_p)
    return all_g, all_s, spec, s_spec, here, tuple([xs[i] for i in here] for xs in (all_p, all_g, all_s))


def _fill(leaves: list, here: list[int], values: list, absent: Any = None) -> list:
    """``leaves`` with ``values`` at the indices ``here``; elsewhere ``absent`` (``None``: as they were)."""
    out = list(leaves) if absent is None else [absent] * len(leaves)
    for i, v in zip(here, values):
        out[i] = v
    return out


def _as_pieces(st: dict, x: Any) -> dict:
    """A state entry of an element-wise optimizer on ``x``: the tensors shaped like ``x``'s
    piece become pieces of the same leaf (so checkpoints reshard them); scalars (``step``)
    stay plain, the same on every rank."""
    if not is_piece(x):
        return st
    shape = x.local.shape
    return {k: (type(x)(v, x.info) if v.dim() > 0 and v.shape == shape else v) for k, v in st.items()}
