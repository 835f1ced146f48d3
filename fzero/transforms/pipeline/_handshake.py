"""The shape handshake: before the first step on an input signature, each stage runs once
on micro-batch 0's shapes, in stage order, and broadcasts what it gives (or why it failed),
so every rank knows the shapes it receives -- or raises the same error -- before any send.
A ``(shape, dtype)`` travels as a fixed-size int64 vector (:func:`_encode`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fzero import rng, tree
from fzero.distributed import comm
from fzero.core import rehearsal
from fzero.transforms.pipeline._stages import WHERE, StageError

_MAX_DIMS = 8
# Dtypes an activation may have, by code (sent in the shape handshake).
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)


def _encode(shape, dtype) -> list[int]:
    shape = tuple(shape)
    return [_DTYPES.index(dtype), len(shape), *shape, *([0] * (_MAX_DIMS - len(shape)))]


def _decode(v: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    vals = [int(x) for x in v.tolist()]
    return tuple(vals[2: 2 + vals[1]]), _DTYPES[vals[0]]


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


def broadcast(t: torch.Tensor, src_stage: int, name: str, *, group, timeout_s: float,
              what: str = "metadata") -> torch.Tensor:
    """``t`` from the rank running ``src_stage`` to every stage, in place; named, timed and
    counted in ``comm.traffic`` as ``what``."""
    src = dist.get_global_rank(group, src_stage)
    comm.run(name, lambda: comm.broadcast(t, src=src, group=group, async_op=True, what=what),
             timeout_s=timeout_s, where=WHERE)
    return t


class Handshake:
    """Each model stage's output ``(shape, dtype)``, agreed by every rank of the pipeline
    once per input signature, then cached.

    Args:
        stages, loss_fn: the pipeline's (all of its model stages: ``p * v`` under the
            interleaved schedule, stage ``c`` run by rank ``c % p``).
        stage, p: this rank's index on ``pp`` and the number of ranks.
        device: where the messages (and the zeros a stage is tried on) live.
        group, timeout_s: the ``pp`` process group, and how long a broadcast may wait.
    """

    def __init__(self, stages, loss_fn, stage: int, p: int, device: torch.device, group, timeout_s: float):
        self.stages, self.loss_fn = stages, loss_fn
        self.stage, self.p, self.device = stage, p, device
        self.group, self.timeout_s = group, timeout_s
        self._agreed: dict[tuple, dict] = {}

    def _broadcast(self, t: torch.Tensor, src_stage: int, name: str) -> torch.Tensor:
        return broadcast(t, src_stage, name, group=self.group, timeout_s=self.timeout_s)

    def agree(self, params, x0, y0) -> dict[int, tuple]:
        """Run each model stage once on micro-batch 0's shapes, in model order, and tell every
        rank what each gives (or why it failed): every rank then knows the shapes it
        receives, or raises the same error. Cached by the input's signature.

        Returns, for each model stage this rank runs, ``(in_meta, out_meta, calls_before)``:
        the ``(shape, dtype)`` it receives and sends (``None`` at the ends), and how many
        dropout calls the stages before it make per micro-batch (counted in the rehearsal),
        from which it numbers its own (:func:`fzero.rng.calls_before`): the masks of the
        whole model."""
        key = (_signature(x0), _signature(y0), torch.is_autocast_enabled(self.device.type),
               torch.get_autocast_dtype(self.device.type))
        if key in self._agreed:
            return self._agreed[key]
        r, p, n = self.stage, self.p, len(self.stages)
        metas: dict[int, list] = {}
        prev = None  # (shape, dtype) the model stage before gives
        calls_before = 0  # dropout calls the model stages before this one make (fzero.rng)
        for k in range(n):
            owner = k % p
            # [failed, the output's (dtype, ndim, shape...), the stage's dropout calls]
            msg = torch.zeros(4 + _MAX_DIMS, dtype=torch.int64, device=self.device)
            text = ""
            if owner == r:
                metas[k] = [prev, None, calls_before]
                calls = rng.rehearsed_calls()
                text, out = self._try_stage(k, params, x0, y0, prev)
                msg[-1] = rng.rehearsed_calls() - calls
                if text:
                    msg[0] = 1
                elif out is not None:
                    msg[1:-1] = torch.tensor(_encode(*out))
            if p > 1:
                self._broadcast(msg, owner, f"broadcast(output shape of stage {k})")
            if int(msg[0]):
                if p > 1:
                    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=self.device)
                    size = self._broadcast(torch.tensor([data.numel()], device=self.device), owner,
                                           "broadcast(error length)")
                    buf = data if owner == r else torch.empty(int(size), dtype=torch.uint8, device=self.device)
                    text = bytes(self._broadcast(buf, owner, "broadcast(error)").tolist()).decode()
                raise StageError(text)
            prev = _decode(msg[1:-1]) if k < n - 1 else None
            if owner == r:
                metas[k][1] = prev
            calls_before += int(msg[-1])
        self._agreed[key] = {k: tuple(v) for k, v in metas.items()}
        return self._agreed[key]

    def _try_stage(self, s: int, params, x0, y0, in_meta) -> tuple[str, tuple | None]:
        """Run model stage ``s`` (and, on the last, the loss) on zeros of the input's shape;
        return ``(error text, (shape, dtype) of the output)``. No gradients; the RNG is
        restored."""
        st = self.stages[s]
        last = s == len(self.stages) - 1
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
            with torch.no_grad(), torch.random.fork_rng(devices=devices), rehearsal():
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
            with torch.no_grad(), torch.random.fork_rng(devices=devices), rehearsal():
                loss = self.loss_fn(out, y0)
        except Exception as e:  # noqa: BLE001
            return (f"{WHERE}: loss_fn failed on the last stage's output {_fmt(out.shape, out.dtype)}: "
                    f"{type(e).__name__}: {e}"), None
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point()):
            got = _fmt(loss.shape, loss.dtype) if isinstance(loss, torch.Tensor) else type(loss).__name__
            return f"{WHERE}: loss_fn must return a floating-point scalar tensor, got {got}", None
        return "", None
