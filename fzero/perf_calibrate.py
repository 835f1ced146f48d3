"""``fzero estimate --calibrate PATH``: measure this machine's :class:`fzero.perf_model.Machine`.

What it times, each a median of a few repeats (the compute rates of samples of back-to-back calls), one torch thread per rank (as fzero's ranks
on a CPU host run, one core each):

* **matmul FLOP/s** by precision: ``a @ b`` at (1024 × 256) @ (256 × 1024) in fp32 and
  (256 × 256) @ (256 × 256) in bf16 / fp16 (slow on a CPU without 16-bit arithmetic), run
  back to back as a step's matmuls run (a single call timed alone reads 30-50% slower here):
  the peak (MFU's denominator). What a step achieves is less: its backward's matmuls are of
  other shapes and its elementwise ops evict the operands from cache. So the achieved rate is
  read from a step's own mix, a forward and backward of two MLP blocks (below) on one rank
  alone: its matmul FLOPs (counted by ``torch.utils.flop_counter``) over its time less its
  elementwise bytes at the elementwise bandwidth (:func:`mix_matmul_flops`); every precision's
  achieved rate is its peak times that share (at most 1).
* **attention FLOP/s**: a causal ``scaled_dot_product_attention`` forward and backward on 8
  sequences of 128 tokens, 4 heads of 64, its FLOPs counted as the model counts attention's;
  its share of the lone matmul's rate is every precision's attention rate (at most the
  achieved dense rate). Attention's per-head products are small: here they run at about half
  the block pass's rate, which the model would otherwise give them.
* **elementwise bandwidth**: GELU forward and backward, LayerNorm forward and an add on
  (4096 × 512) fp32 tensors, bytes counted as inputs + outputs of each op (the count
  :data:`fzero.perf_model.ELEMENTWISE` uses).
* **host and optimizer**: ``fzero.compile``'d AdamW steps in a world of one on a model of
  tiny leaves (2 and 64 of them: the per-step and per-leaf overheads) and one of 2 leaves of
  2M elements (what the step takes beyond the small one is the optimizer's pass:
  :data:`fzero.perf_model.OPTIMIZER_BYTES` per parameter; the gradient's own passes ride in it).
* **free cores**: a forward and backward of two MLP blocks (a step's mix of matmuls,
  GELU and LayerNorm) on one rank alone, and on 2 ranks at once; the cores the ranks get is
  2 × (alone / at once): 2 on a quiet 2-core host whose cores share nothing, less when other
  jobs share it or the ranks contend for memory. (A 256³ matmul, which stays in cache, is
  measured the same way and kept in the JSON.)
* **collectives** between 2 local gloo ranks, each kind (all-reduce, reduce-scatter,
  all-gather) alone: 16 of 4 KiB in flight at once, as fzero issues its buckets (latency per
  ring step), and one of 8 MiB (bandwidth, in the ring's bytes sent); 16 all-reduces of 4 KiB
  one after another, each waited for (the latency tensor parallelism pays); and the overlap:
  an all-reduce launched asynchronously and waited for after a matmul loop of about its
  length, against the two alone.
* **a data-parallel step**: the host-and-optimizer step above (2 leaves of 2M elements) on
  both ranks, its 16 MiB gradient all-reduced; what it takes beyond the one-rank step and
  the all-reduce at the pair's cost is the reduction's cost per gradient byte
  (:func:`reduce_overhead`).
* **a tensor-parallel step**: the MLP blocks on both ranks, each block's first linear split by
  columns and its second by rows (4 all-reduces of 1024 × 256 activations a step); what it
  takes beyond a rank's share of the work and those all-reduces, as the model counts them,
  is the cost per tensor-parallel all-reduce (:func:`tp_overhead`).

The result is written as JSON with the raw measurements beside it (``measured``), and read by
``fzero estimate --time --machine PATH``.
"""

from __future__ import annotations

import os
import socket
import statistics
import time

import torch

from fzero.perf_model import OPTIMIZER_BYTES, Link, Machine, ring_seconds, save_machine

__all__ = ["block_pass_work", "calibrate", "mix_matmul_flops", "reduce_overhead", "tp_overhead", "tp_work"]


def _median_time(fn, reps: int = 7, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _timed_at_once(fn) -> float:
    """Seconds of one ``fn()`` on this rank, started when every rank is at the barrier."""
    import torch.distributed as dist

    dist.barrier()
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _sustained_seconds(fn, *, sample_s: float = 0.05, samples: int = 7) -> float:
    """Seconds one call of ``fn`` takes when it runs back to back: each sample repeats it for
    at least ``sample_s`` (a step's matmuls run back to back, not one at a time between
    timer reads), the median of ``samples`` samples."""
    for _ in range(2):
        fn()
    per_call = []
    for _ in range(samples):
        n, t = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t) < sample_s or n == 0:
            fn()
            n += 1
        per_call.append(elapsed / n)
    return statistics.median(per_call)


def _matmul_flops() -> dict:
    out = {}
    for prec, dtype, (m, k, n) in (("fp32", torch.float32, (1024, 256, 1024)),
                                   ("bf16", torch.bfloat16, (256, 256, 256)),
                                   ("fp16", torch.float16, (256, 256, 256))):
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        out[prec] = 2 * m * k * n / _sustained_seconds(lambda: a @ b)
    return out


# Attention's shape in the calibration: a batch of 8 sequences of 128 tokens, 4 heads of 64.
_ATT_B, _ATT_H, _ATT_T, _ATT_D = 8, 4, 128, 64


def _attention_flops() -> float:
    """FLOP/s of a causal ``scaled_dot_product_attention``'s forward and backward at
    :data:`_ATT_B` × :data:`_ATT_H` × :data:`_ATT_T` × :data:`_ATT_D`, counted as the model counts
    attention (``12·T·d`` per token, d = heads × head size: the scores and values, forward and
    twice that backward, over the whole T × T, as Kaplan et al.)."""
    q, k, v = (torch.randn(_ATT_B, _ATT_H, _ATT_T, _ATT_D, requires_grad=True) for _ in range(3))

    def run():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        q.grad = k.grad = v.grad = None

    flops = 12 * _ATT_B * _ATT_T * _ATT_T * _ATT_H * _ATT_D
    return flops / _median_time(run, reps=9)


def _elementwise_bandwidth() -> float:
    x = torch.randn(4096, 512)
    g = torch.randn_like(x)
    w, b = torch.ones(512), torch.zeros(512)
    nbytes = x.numel() * 4
    ops = [  # (op, bytes of its inputs + outputs)
        (lambda: torch.nn.functional.gelu(x), 2 * nbytes),
        (lambda: torch.ops.aten.gelu_backward(g, x), 3 * nbytes),
        (lambda: torch.nn.functional.layer_norm(x, (512,), w, b), 2 * nbytes),
        (lambda: x + g, 3 * nbytes),
    ]
    return sum(n for _, n in ops) / sum(_sustained_seconds(f) for f, _ in ops)


def _fzero_step_seconds(leaves: int, elems: int, steps: int = 7, *, at_once: bool = False) -> float:
    """Seconds of a ``fzero.compile``'d AdamW step (ZeRO stage 0) on a model of ``leaves``
    leaves of ``elems`` elements, over the process group's ranks (one rank when there is
    none); ``at_once``: each step started when every rank is at a barrier."""
    import fzero
    from fzero import optim

    class Leaves(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ps = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(elems)) for _ in range(leaves))

        def forward(self, x):
            return sum((p * x).sum() for p in self.ps)

    torch.manual_seed(0)  # every rank the same parameters
    apply, params = fzero.functionalize(Leaves())

    def train_step(state, batch):
        loss, grads = fzero.value_and_grad(lambda p: state.apply_fn(p, batch["x"]))(state.params)
        return state.apply_gradients(grads), {"loss": loss}

    step = fzero.compile(train_step, fzero.Mesh(dp=-1))
    box = {"s": step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-4)))}
    batch = {"x": torch.tensor(0.5)}

    def one():
        box["s"], m = step(box["s"], batch)
        m["loss"].item()

    if at_once:
        for _ in range(2):
            one()
        return statistics.median(_timed_at_once(one) for _ in range(steps))
    return _median_time(one, reps=steps)


_BLOCK_ROWS, _BLOCK_D, _BLOCK_H, _BLOCKS = 1024, 256, 1024, 2
_BIG_ELEMS = 2 * 2**20  # elements per leaf of the 2-leaf step that measures the optimizer


def _blocks() -> torch.nn.Module:
    """Two MLP blocks (LayerNorm, 256 → 1024 → 256 with GELU), the calibration's step mix."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.LayerNorm(_BLOCK_D), torch.nn.Linear(_BLOCK_D, _BLOCK_H),
                                                     torch.nn.GELU(), torch.nn.Linear(_BLOCK_H, _BLOCK_D))
                                 for _ in range(_BLOCKS)])


def _block_pass():
    """A forward and backward of :func:`_blocks` on 1024 rows: the mix a transformer step
    runs, as one function of no arguments."""
    blocks = _blocks()
    x = torch.randn(_BLOCK_ROWS, _BLOCK_D)

    def run():
        blocks(x).square().mean().backward()
        blocks.zero_grad(set_to_none=True)

    return run


def _tp_step_seconds(steps: int = 15) -> float:
    """Seconds of a ``fzero.compile``'d tensor-parallel AdamW step of :func:`_blocks` on 1024
    rows over the process group's ranks (``Mesh(dp=1, tp=-1)``: each block's first linear split by
    columns, its second by rows, Megatron's MLP), each step started at a barrier."""
    import fzero
    from fzero import optim

    apply, params = fzero.functionalize(_blocks())
    x = torch.randn(_BLOCK_ROWS, _BLOCK_D)

    def train_step(state, batch):
        loss, grads = fzero.value_and_grad(lambda p: state.apply_fn(p, batch["x"]).square().mean())(state.params)
        return state.apply_gradients(grads), {"loss": loss}

    plan = {f"{i}.1": fzero.ColwiseParallel() for i in range(_BLOCKS)}
    plan |= {f"{i}.3": fzero.RowwiseParallel() for i in range(_BLOCKS)}
    step = fzero.compile(train_step, fzero.Mesh(dp=1, tp=-1), tp=plan)
    box = {"s": step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-4)))}

    def one():
        box["s"], m = step(box["s"], {"x": x})
        m["loss"].item()

    for _ in range(2):
        one()
    return statistics.median(_timed_at_once(one) for _ in range(steps))


def tp_work() -> tuple[float, float, float]:
    """``(matmul FLOPs, elementwise bytes split, elementwise bytes replicated)`` of one rank's
    forward and backward in :func:`_tp_step_seconds` at tp = 2: half the block pass's FLOPs
    and its GELU's bytes (the hidden 1024 is split), its LayerNorms' whole."""
    flops, _ = block_pass_work()
    return flops / 2, 4.0 * _BLOCKS * _BLOCK_ROWS * 5 * _BLOCK_H / 2, 4.0 * _BLOCKS * _BLOCK_ROWS * 5 * _BLOCK_D


def block_pass_work() -> tuple[float, float]:
    """``(matmul FLOPs, elementwise bytes)`` of one :func:`_block_pass`: the FLOPs counted by
    ``torch.utils.flop_counter`` over a pass, the bytes as :data:`fzero.perf_model.ELEMENTWISE`
    counts them (inputs + outputs of each op): per block LayerNorm forward 2 and backward 3
    tensors of the rows × 256, GELU forward 2 and backward 3 of the rows × 1024, in fp32."""
    from torch.utils.flop_counter import FlopCounterMode

    run = _block_pass()
    with FlopCounterMode(display=False) as counter:
        run()
    elems = _BLOCKS * _BLOCK_ROWS * (5 * _BLOCK_D + 5 * _BLOCK_H)
    return float(counter.get_total_flops()), 4.0 * elems


def mix_matmul_flops(block_s: float, elementwise: float, peak: float, work: tuple[float, float]) -> float:
    """The matmul FLOP/s a step's mix achieves: the block pass's FLOPs over its time
    ``block_s`` less its elementwise bytes at ``elementwise`` bytes/s (``work`` is
    :func:`block_pass_work`), at most ``peak``.

    Example (6.4 GFLOP and 50 MB in 45 ms at 25 GB/s: 6.4e9 / 0.043 s):
        >>> round(mix_matmul_flops(0.045, 25e9, 2e11, (6.4e9, 5e7)) / 1e9, 1)
        148.8
    """
    flops, nbytes = work
    return min(peak, flops / max(block_s - nbytes / elementwise, 1e-9))


def reduce_overhead(step_2_ranks_s: float, step_alone_s: float, grad_bytes: float, pair_all_reduce: Link,
                    free: float) -> float:
    """Seconds per gradient byte a data-parallel step pays beyond what the model counts
    (:attr:`fzero.perf_model.Machine.reduce_byte_overhead`): the same fzero step on 2 ranks
    at once (``step_2_ranks_s``) less the model's parts of it -- the one-rank step
    (``step_alone_s``: host, optimizer) and the all-reduce of its ``grad_bytes`` at the
    pair's measured cost, every rate at the share of a core a rank gets (``free`` cores for
    2 ranks) -- per byte, at a whole core's rate (the model divides by the share again).

    Example (a 16 MB gradient: 0.10 s on 2 ranks, 0.08 s alone, the all-reduce 10 ms at 1.6 GB/s):
        >>> round(reduce_overhead(0.10, 0.08, 16e6, Link(bandwidth=1.6e9, latency=0.0), 2.0) * 1e9, 3)
        0.625
    """
    share = min(1.0, free / 2)
    modelled = step_alone_s / share + ring_seconds("all_reduce", grad_bytes, 2, Link(
        bandwidth=pair_all_reduce.bandwidth * share, latency=pair_all_reduce.latency))
    return max(0.0, step_2_ranks_s - modelled) * share / grad_bytes


def tp_overhead(step_s: float, *, mix: float, elementwise: float, optimizer: float, step: float, leaf: float,
                pair_all_reduce: Link, serial_latency: float, free: float) -> float:
    """Seconds per tensor-parallel all-reduce a step pays beyond what the model counts
    (:attr:`fzero.perf_model.Machine.tp_overhead`): the 2-rank tensor-parallel step of the
    MLP blocks (``step_s``, :func:`_tp_step_seconds`) less its parts as the model counts them
    -- a rank's matmuls at the achieved ``mix`` rate, its elementwise bytes at
    ``elementwise``, its AdamW pass at ``optimizer``, the host's ``step`` and ``leaf``
    overheads, and 4 serial all-reduces of the 1024 × 256 fp32 activations at the pair's cost
    -- over those 4 all-reduces, at a whole core's rate (``free`` cores for 2 ranks)."""
    share = min(1.0, free / 2)
    flops, split, replicated = tp_work()
    params = _BLOCKS * (2 * _BLOCK_D + (_BLOCK_D * _BLOCK_H + _BLOCK_H) // 2 + _BLOCK_H * _BLOCK_D // 2 + _BLOCK_D)
    leaves = _BLOCKS * 6
    n = 2 * _BLOCKS  # each block: the row-parallel output forward, the column-parallel input gradient backward
    link = Link(bandwidth=pair_all_reduce.bandwidth * share, latency=max(pair_all_reduce.latency, serial_latency))
    parts = ((flops / mix + (split + replicated) / elementwise + params * OPTIMIZER_BYTES["fp32"] / optimizer
              + step + leaf * leaves) / share + n * ring_seconds("all_reduce", 4.0 * _BLOCK_ROWS * _BLOCK_D, 2, link))
    return max(0.0, step_s - parts) * share / n


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _collective_rank(rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist

    from fzero.distributed import comm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        small, big = torch.zeros(1024), torch.zeros(2 * 2**20)  # 4 KiB, 8 MiB

        def ar(t):
            return lambda: (dist.barrier(), dist.all_reduce(t))

        t_barrier = _median_time(dist.barrier, reps=11)
        half_small, half_big = torch.zeros(512), torch.zeros(2**20)

        def launch(kind: str, x: torch.Tensor, half: torch.Tensor):
            if kind == "all_reduce":
                return comm.all_reduce(x, async_op=True)
            if kind == "reduce_scatter":
                return comm.reduce_scatter_flat(half, x, async_op=True)
            return comm.all_gather_flat(x, half, async_op=True)

        # Each kind as fzero pays it, through fzero's own helpers: its buckets are issued
        # asynchronously, back to back, and waited for later, so 16 small ones in flight at
        # once (latency), and one of 8 MiB (bandwidth). Gloo's algorithms are not all rings:
        # its reduce-scatter costs what its all-reduce does, which the ring's formula would
        # halve. A pair of ranks exchanges instead (fzero/distributed/_pair.py), measured apart.
        out = {}
        # Both ways a group pays them: gloo's own collectives (groups of more than two ranks)
        # and a pair's exchanges (fzero's on two ranks), keys prefixed "pair_".
        before = os.environ.get("FZERO_GLOO_PAIR")
        for prefix, pair in (("", "0"), ("pair_", "1")):
            os.environ["FZERO_GLOO_PAIR"] = pair
            for kind in ("all_reduce", "reduce_scatter", "all_gather"):
                def in_flight(kind=kind):
                    dist.barrier()
                    for w in [launch(kind, small, half_small) for _ in range(16)]:
                        w.wait()

                out[f"{prefix}{kind}_4KiB_s"] = (_median_time(in_flight, reps=7) - t_barrier) / 16
                out[f"{prefix}{kind}_8MiB_s"] = _median_time(
                    lambda kind=kind: (dist.barrier(), launch(kind, big, half_big).wait()), reps=7) - t_barrier
        if before is None:
            os.environ.pop("FZERO_GLOO_PAIR")
        else:  # the process's own setting again, for the serial all-reduces below
            os.environ["FZERO_GLOO_PAIR"] = before

        # Tensor parallelism's all-reduces: one at a time, each waited for before the next,
        # each after a stretch of compute on both ranks (about a block's half: matmuls of
        # 512 rows), so that the wait includes how far apart the ranks drift in between -- on
        # shared cores several times the all-reduce alone. In pairs (with, then without the
        # all-reduces), the median of the differences.
        sa, sb = torch.randn(512, 256), torch.randn(256, 1024)

        def rounds(reduce: bool) -> None:
            for _ in range(16):
                for _ in range(4):
                    sa @ sb
                if reduce:
                    comm.all_reduce(small)

        def serial(reduce: bool) -> float:
            return _timed_at_once(lambda: rounds(reduce))

        serial(True), serial(False)
        out["all_reduce_4KiB_serial_s"] = statistics.median(
            (serial(True) - serial(False)) / 16 for _ in range(7))
        t_big = out["all_reduce_8MiB_s"]
        # Overlap: an all-reduce behind a matmul loop of about its length.
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        t_mm1 = _median_time(lambda: a @ b, reps=5)
        loops = max(1, round(t_big / t_mm1))

        def mm():
            for _ in range(loops):
                a @ b

        def both():
            dist.barrier()
            work = dist.all_reduce(big, async_op=True)
            mm()
            work.wait()

        t_mm = _median_time(lambda: (dist.barrier(), mm()), reps=5) - t_barrier
        # Both ranks at once: what a rank's compute gets while the other computes too.
        flops_together = 2 * 256 ** 3 * loops / t_mm
        t_both = _median_time(both, reps=5) - t_barrier
        # A training step's own mix (matmuls, GELU, LayerNorm, their backward), on rank 0
        # alone and on both ranks at once: the cores a step gets, memory traffic included.
        # In pairs (alone, then at once), so that the machine's drift meets both alike: the
        # share is the median of the pairs' ratios.
        block = _block_pass()
        for _ in range(2):
            block()
        pairs = [(_timed_at_once(lambda: block() if rank == 0 else None), _timed_at_once(block))
                 for _ in range(7)]
        # A data-parallel step as fzero runs it: the one-rank step of 2 leaves of 2M
        # elements (its optimizer term) on both ranks, its 16 MiB gradient all-reduced.
        out["fzero_step_2x2M_2_ranks_s"] = _fzero_step_seconds(2, _BIG_ELEMS, steps=7, at_once=True)
        # A tensor-parallel step: the MLP blocks split over both ranks (tp_overhead).
        out["fzero_tp_step_s"] = _tp_step_seconds()
        if rank == 0:
            queue.put(dict(barrier_s=t_barrier, **out, matmul_loop_s=t_mm, all_reduce_behind_matmul_s=t_both,
                           matmul_flops_2_ranks_at_once=flops_together,
                           block_pass_alone_s=statistics.median(a for a, _ in pairs),
                           block_pass_2_ranks_at_once_s=statistics.median(b for _, b in pairs),
                           block_pass_alone_over_at_once=statistics.median(a / b for a, b in pairs)))
    finally:
        dist.destroy_process_group()


def _collectives(world: int = 2) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_collective_rank, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"fzero estimate --calibrate: a collective rank failed (exit codes "
                           f"{[p.exitcode for p in procs]})")
    return queue.get()


def free_cores(coll: dict, flops_alone: float, cores: int) -> float:
    """The cores our ranks get: 2 ranks running a step's mix of work at once (a forward and
    backward of MLP blocks), each at a share of one alone -- a quiet 2-core host whose cores
    share nothing gives 2, a loaded one, or one whose two ranks contend for memory bandwidth
    or a core's siblings, less. (A small matmul at once, which stays in cache, read 1.97 here
    where real steps got about 1.25.) The share is the median ratio of pairs of passes (one
    alone, then both at once), so that a drift in the machine meets both sides of a pair;
    a machine file from before the pairs gives the ratio of the two medians. Without that
    measurement, the matmuls'. The model's rates scale by ``min(1, this / ranks)``."""
    if coll.get("block_pass_alone_over_at_once"):
        share = coll["block_pass_alone_over_at_once"]
    elif coll.get("block_pass_2_ranks_at_once_s"):
        share = coll["block_pass_alone_s"] / coll["block_pass_2_ranks_at_once_s"]
    else:
        share = coll["matmul_flops_2_ranks_at_once"] / flops_alone
    return min(float(cores), max(0.25, 2 * share))


def calibrate(path: str, *, name: str = "cpu-here") -> Machine:
    """Measure this machine, write its :class:`~fzero.perf_model.Machine` to ``path`` as
    JSON, and return it. Takes about half a minute on 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        mm = _matmul_flops()
        elementwise = _elementwise_bandwidth()
        attention_fp32 = _attention_flops()
        t2, t64 = _fzero_step_seconds(2, 16), _fzero_step_seconds(64, 16)
        big_elems = _BIG_ELEMS
        t_big = _fzero_step_seconds(2, big_elems, steps=5)
        a, b = torch.randn(256, 256), torch.randn(256, 256)
        flops_alone = 2 * 256 ** 3 / _sustained_seconds(lambda: a @ b)  # as the 2 ranks' loop runs them
        coll = _collectives(2)
    finally:
        torch.set_num_threads(threads)
    leaf = max(0.0, (t64 - t2) / 62)
    step = max(0.0, t2 - 2 * leaf)
    optimizer_bw = OPTIMIZER_BYTES["fp32"] * 2 * big_elems / max(t_big - t2, 1e-9)
    # At N = 2 a ring all-reduce takes 2 steps and sends its whole tensor; a reduce-scatter
    # and an all-gather 1 step, sending half the 8 MiB input (a 4 MiB piece of the output).
    steps, sent = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1}, {"all_reduce": 1.0}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    free = free_cores(coll, flops_alone, cores)
    work = block_pass_work()
    achieved = mix_matmul_flops(coll["block_pass_alone_s"], elementwise, mm["fp32"], work)
    efficiency = achieved / mm["fp32"]  # of the lone matmul's rate, reached in a step's mix
    slowed = min(1.0, free / 2)  # bandwidths measured on 2 ranks sharing the free cores: scaled back
    kinds, pair_kinds = {}, {}
    for prefix, into in (("", kinds), ("pair_", pair_kinds)):
        for kind, n in steps.items():
            lat = max(coll[f"{prefix}{kind}_4KiB_s"] / n, 1e-7)
            bw = sent.get(kind, 0.5) * 8 * 2**20 / max(coll[f"{prefix}{kind}_8MiB_s"] - n * lat, 1e-9)
            into[kind] = {"bandwidth": bw / slowed, "latency": lat}
    latency, bandwidth = kinds["all_reduce"]["latency"], kinds["all_reduce"]["bandwidth"]
    serial_latency = max(coll["all_reduce_4KiB_serial_s"] / 2, 1e-7)
    tp_over = tp_overhead(coll["fzero_tp_step_s"], mix=achieved, elementwise=elementwise, optimizer=optimizer_bw,
                          step=step, leaf=leaf, pair_all_reduce=Link(**pair_kinds["all_reduce"]),
                          serial_latency=serial_latency, free=free)
    reduce_byte_overhead = reduce_overhead(coll["fzero_step_2x2M_2_ranks_s"], t_big, 4.0 * 2 * big_elems,
                                           Link(**pair_kinds["all_reduce"]), free)
    t_mm, t_ar, t_both = coll["matmul_loop_s"], coll["all_reduce_8MiB_s"], coll["all_reduce_behind_matmul_s"]
    hidden = t_mm + t_ar - t_both  # what ran at once; overlap is its share of the compute window
    overlap = min(1.0, max(0.0, hidden / t_mm))
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    machine = Machine(
        name=name,
        source=f"measured by fzero estimate --calibrate on {cores} cores ({free:.2f} free for 2 ranks), 1 thread "
               f"per rank, gloo; "
               f"load average {load:.2f}; {time.strftime('%Y-%m-%d')}",
        matmul_flops={prec: rate * efficiency for prec, rate in mm.items()}, peak_flops=dict(mm),
        elementwise_bandwidth=elementwise, optimizer_bandwidth=optimizer_bw,
        intra=Link(bandwidth=bandwidth, latency=latency), inter=Link(bandwidth=bandwidth, latency=latency),
        ranks_per_node=1024, cores=free, overlap=overlap, step_overhead=step, leaf_overhead=leaf,
        collective_overhead=0.0, tp_overhead=tp_over, reduce_byte_overhead=reduce_byte_overhead, host_async=False,
        collectives=kinds, pair_collectives=pair_kinds, serial_latency=serial_latency,
        # Attention's share of the lone fp32 matmul's rate, measured in fp32, carried to every
        # precision as the block pass's share is (at most the achieved dense rate).
        attention_flops={prec: min(rate * efficiency, rate * attention_fp32 / mm["fp32"])
                         for prec, rate in mm.items()})
    save_machine(machine, path, attention_flops_fp32=attention_fp32, fzero_step_2_leaves_s=t2,
                 fzero_step_64_leaves_s=t64,
                 fzero_step_2x2M_s=t_big, loadavg=load, matmul_flops_alone=flops_alone,
                 block_pass_flops=work[0], block_pass_elementwise_bytes=work[1], mix_matmul_share=efficiency, **coll)
    return machine
