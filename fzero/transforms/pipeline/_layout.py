"""``PipelineLayout``: the record a pipelined state keeps of which stage holds which parameters.

``pipe.transform(step).init`` keeps this stage's parameters only, and records the split in
``state.pipeline``, so ``fzero.gather(state)`` and ``fzero.load_into(module, state)``
can put every stage's parameters on every rank from the state alone.
"""

from __future__ import annotations

from typing import Any

import torch

from fzero import tree
from fzero._params import Params
from fzero.distributed import comm
from fzero.transforms.pipeline._handshake import _MAX_DIMS, _decode, _encode, broadcast

__all__ = ["PipelineLayout"]

WHERE = "fzero.gather"

# One header row per (dict, name) a stage sends: [kind, frozen, dtype, ndim, dims...].
_ABSENT, _NONE, _TENSOR = 0, 1, 2


@tree.dataclass
class PipelineLayout:
    """Which stage holds which parameters; every field static, so the record has no leaves.

    Attributes:
        size: the number of stages (the ``pp`` degree).
        stage: this rank's stage.
        keys: each stage's parameter names, in stage order (a tied weight in each stage
            that uses it).
        buffer_keys: each stage's buffer names (``Stage.buffers``), in stage order: a
            pipelined state's ``buffers`` hold its stage's.
        group: the ``pp`` process group (not compared, not pickled).
        timeout_s: the timeout of the gathers over it.
    """

    size: int = tree.field(static=True)
    stage: int = tree.field(static=True)
    keys: tuple[tuple[str, ...], ...] = tree.field(static=True)
    group: Any = tree.field(static=True, default=None, compare=False, repr=False)
    timeout_s: float = tree.field(static=True, default=300.0, compare=False, repr=False)
    buffer_keys: tuple[tuple[str, ...], ...] = tree.field(static=True, default=())

    #: The mesh axis ``fzero.gather`` puts this record's stages back together over.
    __fzero_axis__ = "pp"

    def __reduce__(self):
        return (PipelineLayout, (self.size, self.stage, self.keys, None, 300.0, self.buffer_keys))

    def whole_tree(self, state: Any) -> Any:
        """``state`` (whole over ``dp`` and ``tp`` already) with every dict keyed by this
        stage's parameter names -- parameters, fp32 masters, optimizer moments -- holding
        every stage's entries, in stage order (a weight tied across stages from the first
        stage holding it). A collective over ``pp``: every rank calls it.

        Raises:
            ValueError: the stages' states differ in how many such dicts they hold.
            RuntimeError: the record has no process group (it was sent from another process).
        """
        if self.size == 1:
            return state
        if self.group is None:
            raise RuntimeError(f"{WHERE}: the pipeline layout has no process group (it was pickled in another "
                               "process); gather on the ranks that trained it")
        mine = frozenset(self.keys[self.stage])

        def keyed(x):
            return isinstance(x, dict) and bool(x) and x.keys() <= mine

        leaves, spec = tree.flatten(state, is_leaf=keyed)
        where = [i for i, x in enumerate(leaves) if keyed(x)]
        device = next((v.device for i in where for v in leaves[i].values() if isinstance(v, torch.Tensor)),
                      torch.device("cpu"))
        counts = comm.all_gather_ints("all_gather(pipeline: dicts of parameters per stage)", [len(where)],
                                      self.group, timeout_s=self.timeout_s, where=WHERE, device=device)
        if len(set(counts[:, 0].tolist())) > 1:
            raise ValueError(f"{WHERE}: the stages hold different numbers of dicts keyed by parameter name "
                             f"({', '.join(f'stage {s}: {n}' for s, n in enumerate(counts[:, 0].tolist()))}): "
                             "each stage's state must have the same structure")
        merged: list[dict[str, Any]] = [{} for _ in where]
        frozen: list[set[str]] = [set() for _ in where]
        for k, names in enumerate(self.keys):
            rows = len(where) * len(names)
            hdr = torch.zeros(max(rows, 1), 4 + _MAX_DIMS, dtype=torch.int64, device=device)
            if k == self.stage:
                for j, i in enumerate(where):
                    d = leaves[i]
                    for n, name in enumerate(names):
                        v = d.get(name, _ABSENT)
                        row = hdr[j * len(names) + n]
                        row[1] = int(isinstance(d, Params) and name in d.frozen)
                        if isinstance(v, torch.Tensor):
                            row[0] = _TENSOR
                            row[2:] = torch.tensor(_encode(v.shape, v.dtype))
                        else:
                            row[0] = _ABSENT if v is _ABSENT else _NONE
            broadcast(hdr, k, f"broadcast(parameter shapes of stage {k})", group=self.group,
                      timeout_s=self.timeout_s, what="metadata")
            table = hdr.cpu()
            for j, i in enumerate(where):
                for n, name in enumerate(names):
                    kind, is_frozen = int(table[j * len(names) + n, 0]), bool(table[j * len(names) + n, 1])
                    if kind == _ABSENT:
                        continue
                    value = None
                    if kind == _TENSOR:
                        shape, dtype = _decode(table[j * len(names) + n, 2:])
                        value = (leaves[i][name].detach().contiguous() if k == self.stage
                                 else torch.empty(shape, dtype=dtype, device=device))
                        broadcast(value, k, f"broadcast(parameter {name!r} of stage {k})", group=self.group,
                                  timeout_s=self.timeout_s, what="gather")
                    if name not in merged[j]:  # a tied weight: from the first stage holding it
                        merged[j][name] = value
                        if is_frozen:
                            frozen[j].add(name)
        for j, i in enumerate(where):
            like = leaves[i]
            leaves[i] = Params(merged[j], frozen=frozen[j]) if isinstance(like, Params) else merged[j]
        state = tree.unflatten(spec, leaves)
        if self.buffer_keys and isinstance(getattr(state, "buffers", None), dict) and hasattr(state, "replace"):
            state = state.replace(buffers=self._whole_buffers(state.buffers, device))
        return state

    def _whole_buffers(self, buffers: dict, device: torch.device) -> dict:
        """Every stage's buffers (``buffer_keys``), each broadcast from the stage holding it
        (a collective over ``pp``)."""
        out: dict[str, torch.Tensor] = {}
        for k, names in enumerate(self.buffer_keys):
            hdr = torch.zeros(max(len(names), 1), 2 + _MAX_DIMS, dtype=torch.int64, device=device)
            if k == self.stage:
                for n, name in enumerate(names):
                    if isinstance(buffers.get(name), torch.Tensor):
                        hdr[n] = torch.tensor(_encode(buffers[name].shape, buffers[name].dtype))
            broadcast(hdr, k, f"broadcast(buffer shapes of stage {k})", group=self.group, timeout_s=self.timeout_s,
                      what="metadata")
            table = hdr.cpu()
            for n, name in enumerate(names):
                shape, dtype = _decode(table[n])
                value = (buffers[name].detach().contiguous() if k == self.stage
                         else torch.empty(shape, dtype=dtype, device=device))
                broadcast(value, k, f"broadcast(buffer {name!r} of stage {k})", group=self.group,
                          timeout_s=self.timeout_s, what="gather")
                out.setdefault(name, value)
        return out

