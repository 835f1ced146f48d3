"""What the benchmark scripts share: the machine's description, the AdamW every contestant
uses, model-state bytes, the loss, the timed rounds and the run under torchrun.

Each script puts the repository (and ``examples/``) on ``sys.path`` first, then imports this
module from its own folder (a script's folder is on ``sys.path`` when it runs).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fzero
from fzero import optim
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


def make_torch_optimizer(params):
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, foreach=True)


def loss_of(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def torch_state_bytes(params: list, opt: torch.optim.Optimizer) -> int:
    """A torch contestant's model state: its parameters, their ``.grad`` and ``optimizer.state``."""
    return storage_bytes(params, [p.grad for p in params if p.grad is not None],
                         [dict(s) for s in opt.state.values()])


def fzero_contestant(module: torch.nn.Module, mesh, held: Callable, **compile_options) -> Callable:
    """fzero's contestant: the pure ``train_step`` (``fzero.optim.adamw``) under
    ``fzero.compile(train_step, mesh, **compile_options)``, started from ``module``'s weights.

    Returns ``step(batch, probe) -> metrics``. When ``probe`` has key "on" set, the step
    stores ``storage_bytes(*held(state, grads))`` in probe["bytes"], read inside the train
    step, after backward and before the update.
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
        box["state"], metrics = compiled(box["state"], batch)
        probe.update(probe_box)
        return metrics

    return step


# --------------------------------------------------------------------------- the run


def add_gpt_options(p: argparse.ArgumentParser, *, n_layer: int, n_head: int, n_embd: int) -> None:
    """The options of the benchmarked GPT's shape (``examples/gpt.py``)."""
    p.add_argument("--n-layer", type=int, default=n_layer)
    p.add_argument("--n-head", type=int, default=n_head)
    p.add_argument("--n-embd", type=int, default=n_embd)
    p.add_argument("--vocab-size", type=int, default=256)


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


def paired_rounds(steps: dict, batches: list, warmup: int) -> tuple[dict, dict, dict]:
    """Every contestant's ``step(batch, probe) -> loss`` once per round, interleaved
    (:func:`interleaved`), each timed (:func:`timed`, the loss read inside the timing).

    Returns ``(times, losses, probes)``: the step times of the rounds from ``warmup`` on, every
    round's loss, and what each contestant's step put in its ``probe`` in round 1 (the memory
    probe: the step sees ``probe["on"]`` set there).
    """
    names = tuple(steps)
    times = {n: [] for n in names}
    losses = {n: [] for n in names}
    probes = {}
    for i, n, batch in interleaved(names, batches):
        probe = {"on": True} if i == 1 else {}
        dt, loss = timed(lambda: steps[n](batch, probe).item())
        losses[n].append(loss)
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
