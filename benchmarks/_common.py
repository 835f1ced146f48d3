"""What the benchmark scripts share: the machine's description, the AdamW every contestant
uses, model-state bytes, bytes sent, the loss, the timed rounds and the run under torchrun.

Each script puts the repository (and ``examples/``) on ``sys.path`` first, then imports this
module from its own folder (a script's folder is on ``sys.path`` when it runs).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import platform
import resource
import statistics
import sys
import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import fzero
from fzero import optim
from fzero.distributed import comm
from fzero.testing import storage_bytes  # the bytes a rank holds: the same count the tests check

# The AdamW of every contestant of benchmarks/zero.py and benchmarks/precision.py.
LR, BETAS, EPS, WEIGHT_DECAY = 3e-4, (0.9, 0.999), 1e-8, 0.1
MIB = 2**20


# --------------------------------------------------------------------------- the machine


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def torchrun_command(script: str, argv) -> list[str]:
    """The command that runs ``script`` with ``argv`` under torchrun, 2 processes on this host."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            os.path.abspath(script), *argv]


def run_under_torchrun(script: str, argv) -> None:
    """Re-execute ``script`` under torchrun (2 processes) unless this process is a rank
    already: so ``python benchmarks/<name>.py`` works as well as ``torchrun ...``."""
    if "RANK" not in os.environ:
        os.execv(sys.executable, torchrun_command(script, argv))


# --------------------------------------------------------------------------- the contestants


def make_torch_optimizer(params, fused: bool = False):
    """torch.optim.AdamW with the benchmarks' hyperparameters: the multi-tensor (foreach)
    implementation, torch's default, or with ``fused`` its one-pass fused kernel."""
    how = {"fused": True} if fused else {"foreach": True}
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, **how)


def loss_of(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def torch_state_bytes(params: list, opt: torch.optim.Optimizer) -> int:
    """A torch contestant's model state: its parameters, their ``.grad`` and ``optimizer.state``."""
    return storage_bytes(params, [p.grad for p in params if p.grad is not None],
                         [dict(s) for s in opt.state.values()])


# --------------------------------------------------------------------------- bytes sent
#
# A collective's payload is what one rank hands to it, the way fzero.distributed.comm.traffic
# counts: an all-reduce its tensor, a reduce-scatter its whole input, an all-gather its own
# piece. What a rank sends is the payload times the algorithm's factor; the ring's, N ranks
# (Thakur, Rabenseifner & Gropp 2005, "Optimization of collective communication operations
# in MPICH"), with broadcast and reduce pipelined along the ring, whose N - 1 copies of the
# tensor are averaged over the N ranks.
RING = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: n - 1,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
    "reduce": lambda n: (n - 1) / n,
    "send": lambda n: 1,
}
# The c10d ops (the process group's, as DDP's reducer, FSDP2 and torch.distributed issue them)
# and the functional ones (DTensor's), by kind, with the argument that holds the payload.
C10D_OPS = {
    "allreduce_": ("all_reduce", "tensors"), "allreduce_coalesced_": ("all_reduce", "tensors"),
    "all_reduce": ("all_reduce", "input"), "all_reduce_": ("all_reduce", "input"),
    "all_reduce_coalesced": ("all_reduce", "inputs"), "all_reduce_coalesced_": ("all_reduce", "inputs"),
    "reduce_scatter_": ("reduce_scatter", "input_tensors"), "_reduce_scatter_base_": ("reduce_scatter", "input_tensor"),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", "inputs"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"), "reduce_scatter_tensor_out": ("reduce_scatter", "input"),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", "inputs"),
    "allgather_": ("all_gather", "input_tensors"), "_allgather_base_": ("all_gather", "input_tensor"),
    "allgather_coalesced_": ("all_gather", "input_list"), "allgather_into_tensor_coalesced_": ("all_gather", "inputs"),
    "all_gather_into_tensor": ("all_gather", "input"), "all_gather_into_tensor_out": ("all_gather", "input"),
    "all_gather_into_tensor_coalesced": ("all_gather", "inputs"),
    "alltoall_": ("all_to_all", "input_tensors"), "alltoall_base_": ("all_to_all", "input"),
    "all_to_all_single": ("all_to_all", "input"),
    "broadcast_": ("broadcast", "tensors"), "broadcast": ("broadcast", "input"), "reduce_": ("reduce", "tensors"),
    # Point-to-point: what a send hands over is what it sends (fzero's exchanges of a gloo pair).
    "send": ("send", "tensors"),
}
# Ops that carry no payload of the step: waits, autograd wrappers, barriers (a sync), and
# receives (the peer's send counted it).
NOT_SENT = {"wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier_", "check_for_nan",
            "recv_", "recv_any_source_"}


class CountCollectives(TorchDispatchMode):
    """The collectives this rank issues while active: payload bytes by kind and process group.

    A dispatch mode sees every c10d op dispatched from this thread: the ones DDP's reducer
    issues from C++ during backward, FSDP2's, those of ``torch.distributed``'s functions
    (which DeepSpeed's ``deepspeed.comm`` calls) and DTensor's functional collectives. A mode
    runs before tensor subclasses; returning ``NotImplemented`` for a DTensor op lets DTensor
    desugar it first (as torch's ``CommDebugMode`` does), so the mode sees the plain
    collectives it issues. An op it does not know stops the run: a count is never a guess.
    """

    def __init__(self, script: str):
        super().__init__()
        self.script = script
        self.payload: collections.Counter = collections.Counter()  # (kind, group name, group size) -> bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        name = func._schema.name.split("::")[-1]
        if func.namespace in ("_c10d_functional", "c10d") and name not in NOT_SENT:
            if name not in C10D_OPS:
                raise SystemExit(f"{self.script}: cannot count {func._schema}: add it to _common.C10D_OPS")
            kind, arg = C10D_OPS[name]
            named = {a.name: v for a, v in zip(func._schema.arguments, args)} | kwargs
            group = named.get("group_name", named.get("process_group"))
            if isinstance(group, str):
                size = dist.distributed_c10d._resolve_process_group(group).size()
            else:
                pg = torch._C._distributed_c10d.ProcessGroup.unbox(group)
                group, size = pg.group_name, pg.size()
            self.payload[(kind, group, size)] += sum(t.numel() * t.element_size() for t in _tensors(named[arg]))
        return func(*args, **kwargs)

    def bytes(self, group: str | None = None) -> int:
        """Payload bytes handed to collectives (of the process group named ``group``: any if None)."""
        return sum(b for (_, g, _), b in self.payload.items() if group in (None, g))

    def kinds(self) -> dict[str, int]:
        """Payload bytes by kind of collective (``all_reduce``, ``all_gather``, ...)."""
        out = collections.Counter()
        for (kind, _, _), b in self.payload.items():
            out[kind] += b
        return dict(out)

    def sent(self) -> float:
        """Bytes this rank sends under the ring algorithm (:data:`RING`)."""
        return sum(b * RING[kind](n) for (kind, _, n), b in self.payload.items())


def _tensors(x) -> list[torch.Tensor]:
    """The tensors of a c10d argument: a tensor, a list of them, or a list of lists."""
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for item in x for t in _tensors(item)]


def counted(step: Callable, script: str) -> Callable:
    """``step(batch, probe)`` whose probed round (``probe["on"]`` set) runs under
    :class:`CountCollectives`, storing the ring bytes it sent in probe["c10d_sent"], the
    payload in probe["c10d_payload"] and the payload by kind of collective in
    probe["c10d_kinds"]."""

    def run(batch, probe):
        if not probe.get("on"):
            return step(batch, probe)
        with CountCollectives(script) as counter:
            out = step(batch, probe)
        probe.update(c10d_sent=counter.sent(), c10d_payload=counter.bytes(), c10d_kinds=counter.kinds())
        return out

    return run


def fzero_sent() -> tuple[float, str]:
    """Bytes this rank sent since ``comm.traffic``'s last reset, and how they were counted:
    ``"ring"`` from ``traffic.sent()`` where fzero counts the bytes its algorithms send, else
    ``traffic.bytes()``, the payload handed to collectives, labelled ``"payload"``."""
    sent = getattr(comm.traffic, "sent", None)
    if callable(sent):
        return float(sent()), "ring"
    return float(comm.traffic.bytes()), "payload"


def fzero_contestant(module: torch.nn.Module, mesh, held: Callable, **compile_options) -> Callable:
    """fzero's contestant: the pure ``train_step`` (``fzero.optim.adamw``) under
    ``fzero.compile(train_step, mesh, **compile_options)``, started from ``module``'s weights.

    Returns ``step(batch, probe) -> metrics``. When ``probe`` has key "on" set, the step
    stores ``storage_bytes(*held(state, grads))`` in probe["bytes"], read inside the train
    step, after backward and before the update; what the step sent in probe["sent"] and how
    it was counted in probe["sent_as"] (:func:`fzero_sent`); the payload ``comm.traffic``
    counted in probe["payload"].
    """
    apply, params = fzero.functionalize(module)
    tx = optim.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)
    probe_box = {}

    def train_step(state, batch):
        def loss_fn(p):
            return loss_of(state.apply_fn(p, batch["x"]), batch["y"])

        loss, grads = fzero.value_and_grad(loss_fn)(state.params)
        if probe_box.get("on"):
            probe_box["bytes"] = storage_bytes(*held(state, grads))
        return state.apply_gradients(grads), {"loss": loss}

    compiled = fzero.compile(train_step, mesh, **compile_options)
    box = {"state": compiled.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=tx))}
    del params

    def step(batch, probe):
        probe_box.clear()
        probe_box.update(probe)
        if probe.get("on"):
            comm.traffic.reset()
        box["state"], metrics = compiled(box["state"], batch)
        probe.update(probe_box)
        if probe.get("on"):
            probe["sent"], probe["sent_as"] = fzero_sent()
            probe["payload"] = comm.traffic.bytes()
        return metrics

    return step


# --------------------------------------------------------------------------- the run


def add_gpt_options(p: argparse.ArgumentParser, *, n_layer: int | None, n_head: int | None, n_embd: int | None,
                    vocab_size: int | None = 256) -> None:
    """The options of the benchmarked GPT's shape (``examples/gpt.py``); a default of None
    leaves the value to the script (a preset)."""
    p.add_argument("--n-layer", type=int, default=n_layer)
    p.add_argument("--n-head", type=int, default=n_head)
    p.add_argument("--n-embd", type=int, default=n_embd)
    p.add_argument("--vocab-size", type=int, default=vocab_size)


def contestants(only: str | None, known: tuple[str, ...], script: str) -> tuple[str, ...]:
    """The contestants ``--only`` names (comma-separated), or all of ``known``."""
    names = known if only is None else tuple(only.split(","))
    for n in names:
        if n not in known:
            raise SystemExit(f"{script}: unknown contestant {n!r}; choose from {', '.join(known)}")
    return names


def rank_batches(vocab_size: int, block_size: int, per_rank: int, rounds: int) -> list[dict]:
    """One batch per round of ``per_rank`` random sequences: this rank's slice of a global
    batch drawn from one seeded generator, so every contestant sees the same data."""
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(rounds):
        x = torch.randint(vocab_size, (per_rank * world, block_size + 1), generator=g)
        x = x[rank * per_rank:(rank + 1) * per_rank]
        batches.append({"x": x[:, :-1].contiguous(), "y": x[:, 1:].contiguous()})
    return batches


def interleaved(names: tuple[str, ...], batches: list) -> Iterator[tuple[int, str, dict]]:
    """``(round, contestant, batch)``: one step of each contestant per round, the order
    rotated every round, so drift in a shared machine hits all alike."""
    for i, batch in enumerate(batches):
        k = i % len(names)
        for n in names[k:] + names[:k]:
            yield i, n, batch


def timed(fn: Callable, *args) -> tuple[float, object]:
    """Seconds of ``fn(*args)``, started after a barrier, and its result."""
    dist.barrier()
    t = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t, out


class BackwardMarks:
    """While entered: when autograd's engine first starts and last returns (``start``,
    ``end``, ``time.perf_counter()``; ``None`` until it runs) since :meth:`reset` -- torch's
    ``backward`` and ``grad`` (DDP's, FSDP2's and plain steps' ``loss.backward()``) and
    fzero's own calls of the engine -- so that a step's time splits into what runs before
    its backward (the forward and the loss), the backward, and what runs after it."""

    def __init__(self):
        self.start = self.end = None
        self._saved = None

    def reset(self) -> None:
        self.start = self.end = None

    def __enter__(self):
        import torch.autograd.graph as autograd_graph
        from fzero import core

        engine = torch.autograd._engine_run_backward

        def marked(*a, **kw):
            if self.start is None:
                self.start = time.perf_counter()
            try:
                return engine(*a, **kw)
            finally:
                self.end = time.perf_counter()

        self._saved = (engine, getattr(core, "_engine_run_backward", None))
        torch.autograd._engine_run_backward = autograd_graph._engine_run_backward = marked
        if self._saved[1] is not None:
            core._engine_run_backward = marked
        return self

    def __exit__(self, *exc):
        import torch.autograd.graph as autograd_graph
        from fzero import core

        engine, fzero_engine = self._saved
        torch.autograd._engine_run_backward = autograd_graph._engine_run_backward = engine
        if fzero_engine is not None:
            core._engine_run_backward = fzero_engine
        return False


def paired_rounds(steps: dict, batches: list, warmup: int, every_time: dict | None = None,
                  faults: dict | None = None, phases: dict | None = None) -> tuple[dict, dict, dict]:
    """Every contestant's ``step(batch, probe) -> loss`` once per round, interleaved
    (:func:`interleaved`), each timed (:func:`timed`, the loss read inside the timing).

    Returns ``(times, losses, probes)``: the step times of the rounds from ``warmup`` on, every
    round's loss, and what each contestant's step put in its ``probe`` in round 1 (the memory
    probe: the step sees ``probe["on"]`` set there). ``every_time``, if given, receives every
    round's time, warm-up included (a compiling contestant's compile time is there).
    ``faults``, if given, receives each timed round's minor page faults in this process (fresh
    memory touched: counted, not timed), by contestant. ``phases``, if given, receives each
    timed round's seconds before its backward, in it and after it (:class:`BackwardMarks`),
    by contestant.
    """
    names = tuple(steps)
    times = {n: [] for n in names}
    losses = {n: [] for n in names}
    probes = {}
    marks = BackwardMarks()
    with marks if phases is not None else contextlib.nullcontext():
        for i, n, batch in interleaved(names, batches):
            probe = {"on": True} if i == 1 else {}
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            marks.reset()
            dt, loss = timed(lambda: steps[n](batch, probe).item())
            done = time.perf_counter()
            if faults is not None and i >= warmup:
                faults.setdefault(n, []).append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            if phases is not None and i >= warmup and marks.start is not None:
                begun = done - dt
                phases.setdefault(n, []).append((marks.start - begun, marks.end - marks.start, done - marks.end))
            losses[n].append(loss)
            if every_time is not None:
                every_time[n].append(dt)
            if i >= warmup:
                times[n].append(dt)
            if i == 1:
                probes[n] = {k: v for k, v in probe.items() if k != "on"}
    return times, losses, probes


def mean_over_ranks(losses: dict[str, list[float]], names) -> torch.Tensor:
    """``[contestant, step]`` float64 losses averaged over the ranks (fzero's are already
    global means: unchanged)."""
    loss_t = torch.tensor([losses[n] for n in names], dtype=torch.float64)
    dist.all_reduce(loss_t)
    return loss_t / dist.get_world_size()


def time_stats(t: list[float]) -> dict:
    """Median, min, max and all of a contestant's step times (the slowest rank's)."""
    return {
        "median_s": statistics.median(t) if t else float("nan"),
        "min_s": min(t) if t else float("nan"),
        "max_s": max(t) if t else float("nan"),
        "times_s": t,
    }
