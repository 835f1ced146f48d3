"""A module evaluated with a partitioned state's weights, outside any step.

``fzero.load_into`` writes the whole trained model into the module: at ZeRO-3 every rank then
holds all of it. :func:`evaluating` runs the module's own forwards instead (a Hugging Face
``Trainer``'s evaluation loop, a sampling loop) with the state's weights bound for each call
and the ZeRO-3 units gathered one at a time, as FSDP's forward and DeepSpeed's ZeRO-3 engine
in ``eval()`` do: the parameters outside every unit for the whole block, each unit's just
before its forward and dropped right after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from fzero.distributed.gather import gather
from fzero.functional import _Bound, _slots

__all__ = ["evaluating", "units_of"]

WHERE = "fzero.transforms.shard_state.evaluating"


def units_of(step) -> list[tuple[torch.nn.Module, list[str]]] | None:
    """``(submodule, parameter names)`` of each ZeRO-3 unit of the ``shard_state`` inside
    ``step`` (a compiled step: its transforms nest by ``inner``), as :func:`evaluating` takes
    them; an empty list when the model is gathered whole for a step (within
    ``max_reuse_distance``), ``None`` when there is no ``shard_state`` at stage 3 (or its
    ``init`` has not run)."""
    while step is not None:
        handler = getattr(step, "handler", None)
        if getattr(handler, "stage", None) == 3 and getattr(handler, "units", None) is not None:
            return [(m, list(handler.layout.groups[gi].names)) for m, gi in handler.units.modules]
        step = getattr(step, "inner", None)
    return None


@contextlib.contextmanager
def evaluating(module: torch.nn.Module, state, units: Sequence[tuple[torch.nn.Module, Sequence[str]]] = ()
               ) -> Iterator[torch.nn.Module]:
    """Within the block, ``module``'s forwards compute with ``state``'s weights: its fp32
    masters where it has them (the weights ``fzero.load_into`` would write), else its
    parameters, and its buffers.

    Each call of a module of ``units`` (``(submodule, parameter names)``, the ZeRO-3 units:
    :func:`units_of` the compiled step, or :func:`fzero.transforms.shard_state._units.find_units`'s) gathers
    that unit's weights just before it and drops them right after; the other weights are
    gathered once for the block. Gathering is a collective over the state's mesh: every rank
    must run the same forwards (an evaluation loop whose ranks get as many batches each, as
    Hugging Face's does). On exit the module has its own tensors back (``meta`` ones, after
    ``step.init`` released them).

    Example (a world of one):
        >>> import torch, fzero
        >>> from fzero import optim
        >>> from fzero.transforms.shard_state._units import find_units
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.ModuleList([torch.nn.Linear(4, 4)]))
        >>> x = torch.ones(1, 2)
        >>> expected = model[1][0](model[0](x))
        >>> apply, params = fzero.functionalize(model)
        >>> state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.1))
        >>> state = fzero.compile(lambda s, b: (s, {}), fzero.Mesh(dp=1), zero=3).init(state)
        >>> model[0].weight.device.type                     # released: the state holds the weights
        'meta'
        >>> with evaluating(model, state, find_units(model, dict(params))):
        ...     out = model[1][0](model[0](x))
        >>> torch.equal(out, expected), model[1][0].weight.device.type
        (True, 'meta')
    """
    if getattr(state, "tensor_parallel", None) is not None or getattr(state, "pipeline", None) is not None:
        raise NotImplementedError(f"{WHERE}: a state split over tp or pp; write the whole weights into the module "
                                  "with fzero.load_into, or evaluate inside a step")
    slots = _slots(module)
    if slots is None:
        raise TypeError(f"{WHERE}: {type(module).__name__} has parametrized submodules; write the weights "
                        "with fzero.load_into instead")
    weights = dict(state.params)
    master = getattr(state, "master", None)
    if master is not None:
        weights.update({k: v for k, v in master.items() if v is not None})
    buffers = dict(getattr(state, "buffers", None) or {})
    unknown = sorted(set(weights) - set(slots))
    if unknown:
        raise KeyError(f"{WHERE}: the state's weights {unknown[:8]} are not {type(module).__name__}'s "
                       f"(evaluate the module the state was made from)")
    in_units = {n for _, names in units for n in names}
    loose = [n for n in weights if n not in in_units]
    hooks = []

    def bound(names):
        full = gather({n: weights[n] for n in names}) if names else {}
        return _Bound({n: slots[n] for n in names}, full)

    def pre(names):
        def hook(mod, args):
            binding = bound(names)
            binding.__enter__()
            live.setdefault(id(mod), []).append(binding)
        return hook

    def post(mod, args, out):
        live[id(mod)].pop().__exit__(None, None, None)

    live: dict[int, list[_Bound]] = {}
    try:
        for m, names in units:
            hooks.append(m.register_forward_pre_hook(pre(list(names))))
            hooks.append(m.register_forward_hook(post))
        with bound(loose), _Bound({k: slots[k] for k in buffers if k in slots}, buffers):
            yield module
    finally:
        for h in hooks:
            h.remove()
        for stack in live.values():  # a forward that raised inside a unit
            while stack:
                stack.pop().__exit__(None, None, None)
