"""1-bit compressed averaging with error feedback over the ``dp`` ranks: the exchange of the
1-bit optimizers (DeepSpeed's ``compressed_allreduce``; Tang et al., 2021,
<https://arxiv.org/abs/2102.02888>, and Seide et al., 2014, for error feedback).

For each tensor ``x`` (``n`` elements) of a rank, with ``N`` ranks and ``L = lcm(N, 8)``:

1. **worker**: pad ``x`` with zeros to ``P = ceil(n / (N L)) N L`` elements, ``b = x + e_w``
   (the rank's worker error), ``scale = ||b|| / sqrt(P)``, ``s = +1 where b >= 0 else -1``,
   ``e_w = b - scale * s``. The signs are cut into ``N`` chunks of ``P / N`` (a multiple of 8)
   and packed 8 to a byte; chunk ``r`` goes to rank ``r``, its *server*;
2. **server** (this rank's chunk ``r``): ``c = sum_j s_j * (scale_j / N) + e_s`` (the server
   error, ``P / N`` elements), ``scale' = ||c|| / sqrt(P / N)``, ``s' = sign(c)``,
   ``e_s = c - scale' * s'``;
3. every rank all-gathers the servers' packed signs and scales: the result is chunk ``j`` =
   ``scale'_j * s'_j``, cut back to ``n`` elements.

Every tensor's step 1 and 3 ride in one collective each: one all-to-all of the packed signs of
every tensor, one all-gather of the worker scales (one fp32 per tensor), one all-gather of the
servers' packed signs and one of their scales. Per rank and step, with ``B = sum_i P_i / (8 N)``
bytes of packed chunk and ``T`` tensors, the bytes sent (``fzero.distributed.comm.sent_bytes``)
are ``(N - 1) (2 B + 8 T)``; see ``docs/optim.md``.
"""

from __future__ import annotations

import math

import torch

from fzero.distributed import comm

__all__ = ["ErrorFeedback", "compressed_mean", "pack_signs", "padded_numel", "unpack_signs"]

_BITS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)  # numpy's packbits order


def padded_numel(n: int, world: int) -> int:
    """``n`` rounded up to a multiple of ``world * lcm(world, 8)``: each of the ``world`` chunks
    then holds a whole number of bytes of signs (DeepSpeed pads the same way).

    Example:
        >>> padded_numel(10, 2), padded_numel(10, 3), padded_numel(0, 4)
        (16, 72, 0)
    """
    unit = world * math.lcm(world, 8)
    return -(-n // unit) * unit


def pack_signs(nonneg: torch.Tensor) -> torch.Tensor:
    """A bool tensor (``True`` for a sign of +1), its length a multiple of 8, as uint8, 8 signs
    to a byte, the first in the highest bit.

    Example:
        >>> pack_signs(torch.tensor([True] + [False] * 6 + [True]))
        tensor([129], dtype=torch.uint8)
    """
    bits = nonneg.reshape(-1, 8).to(torch.uint8)
    return (bits * _BITS.to(bits.device)).sum(1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """Undo :func:`pack_signs`: +1.0 / -1.0 (fp32), 8 per byte."""
    bits = (packed.unsqueeze(-1) & _BITS.to(packed.device)) != 0
    return bits.reshape(*packed.shape[:-1], -1).to(torch.float32).mul_(2.0).sub_(1.0)


def _signs(x: torch.Tensor) -> torch.Tensor:
    return (x >= 0).to(x.dtype).mul_(2.0).sub_(1.0)


class ErrorFeedback:
    """The worker and server errors of one caller's tensors on this rank (fp32, zero at first):
    what compression left out at each stage, added back before the next compression."""

    def __init__(self, numels: list[int], world: int, device: torch.device):
        self.numels = list(numels)
        self.padded = [padded_numel(n, world) for n in self.numels]
        self.worker = [torch.zeros(p, dtype=torch.float32, device=device) for p in self.padded]
        self.server = [torch.zeros(p // world, dtype=torch.float32, device=device) for p in self.padded]


def compressed_mean(tensors: list[torch.Tensor], errors: ErrorFeedback, *, group, world: int, timeout_s: float,
                    where: str = "fzero", commit: bool = True) -> list[torch.Tensor]:
    """The mean over the ``world`` ranks of ``group`` of each rank's ``tensors``, 1-bit
    compressed with error feedback (the module's steps 1-3); ``errors`` are updated in place
    unless ``commit`` is false (an update about to be discarded). Returns new fp32 tensors of
    the inputs' shapes, the same on every rank."""
    live = [i for i, p in enumerate(errors.padded) if p]
    if not live:
        return [t.clone() for t in tensors]
    device = tensors[live[0]].device
    # 1. worker: compensate, scale, signs; chunk r of every tensor goes to rank r.
    worker_scales, worker_errors, sends = [], [], []
    for i in live:
        b = torch.zeros(errors.padded[i], dtype=torch.float32, device=device)
        b[: errors.numels[i]] = tensors[i].reshape(-1)
        b.add_(errors.worker[i])
        scale = torch.linalg.vector_norm(b) / math.sqrt(b.numel())
        worker_errors.append(b - scale * _signs(b))
        worker_scales.append(scale)
        sends.append(pack_signs(b >= 0).reshape(world, -1))
    send = torch.cat(sends, dim=1).contiguous()  # (world, B): row r is for rank r
    recv = torch.empty_like(send)
    scales = torch.stack(worker_scales)
    all_scales = torch.empty(world * scales.numel(), dtype=scales.dtype, device=device)
    comm.run("all_to_all(1-bit signs)", lambda: comm.all_to_all_flat(recv, send, group=group, async_op=True,
                                                                         what="compressed"),
             timeout_s=timeout_s, where=where)
    comm.run("all_gather(1-bit worker scales)", lambda: comm.all_gather_flat(all_scales, scales, group=group,
                                                                                 async_op=True, what="compressed"),
             timeout_s=timeout_s, where=where)
    all_scales = all_scales.reshape(world, -1)  # [rank j, tensor]
    # 2. server: this rank's chunk of each tensor, averaged over the ranks, compensated, compressed.
    server_scales, server_errors, outs, offset = [], [], [], 0
    for k, i in enumerate(live):
        width = errors.padded[i] // (8 * world)
        signs = unpack_signs(recv[:, offset: offset + width])  # (world, chunk)
        offset += width
        c = (signs * (all_scales[:, k: k + 1] * (1.0 / world))).sum(0)
        c.add_(errors.server[i])
        scale = torch.linalg.vector_norm(c) / math.sqrt(c.numel())
        server_errors.append(c - scale * _signs(c))
        server_scales.append(scale)
        outs.append(pack_signs(c >= 0))
    mine = torch.cat(outs)
    gathered = torch.empty(world * mine.numel(), dtype=torch.uint8, device=device)
    sscales = torch.stack(server_scales)
    all_sscales = torch.empty(world * sscales.numel(), dtype=sscales.dtype, device=device)
    comm.run("all_gather(1-bit server signs)", lambda: comm.all_gather_flat(gathered, mine, group=group,
                                                                                async_op=True, what="compressed"),
             timeout_s=timeout_s, where=where)
    comm.run("all_gather(1-bit server scales)", lambda: comm.all_gather_flat(all_sscales, sscales, group=group,
                                                                                 async_op=True, what="compressed"),
             timeout_s=timeout_s, where=where)
    gathered, all_sscales = gathered.reshape(world, -1), all_sscales.reshape(world, -1)
    # 3. every server's chunk, decompressed, in rank order.
    result = [t.to(torch.float32, copy=True) for t in tensors]
    offset = 0
    for k, i in enumerate(live):
        width = errors.padded[i] // (8 * world)
        full = (unpack_signs(gathered[:, offset: offset + width]) * all_sscales[:, k: k + 1]).reshape(-1)
        offset += width
        result[i] = full[: errors.numels[i]].reshape(tensors[i].shape)
    if commit:
        for k, i in enumerate(live):
            errors.worker[i].copy_(worker_errors[k])
            errors.server[i].copy_(server_errors[k])
    return result
