"""A training job whose nodes are lost and added while it runs: ``fzero launch --nproc-min``.

Run by ``tests/test_elastic.py`` and ``benchmarks/faults.py``::

    fzero launch --nproc 4 --nproc-min 2 tests/harness/elastic_job.py OUT --zero 3 --steps 8 \\
        --shrink-at 2 --grow-at 5

``--zero`` is the ZeRO stage, or one stage per world size (``4:3,2:2,3:3``): a checkpoint
saved at one stage is then loaded at the other as well as onto another world size.

A tiny language model (an embedding, dropout, two linear layers) trains with a token-mean
loss (``fzero.global_mean`` over targets that are not -100) on a fixed dataset through
``fzero.data.DataLoader`` (global batch 12: 4, 3 and 2 ranks each take an equal slice),
saves an asynchronous checkpoint after every step with the loader's position in its
metadata, and on start resumes from ``fzero.checkpoint.latest`` onto whatever world it has.

* ``--shrink-at S``: at step ``S``, on a world of ``--full`` ranks (default 4), the last
  ``--lose`` ranks (default 2) each SIGKILL their torchrun agent and then themselves: their
  nodes are lost for good. The survivors' next collective fails, their agents restart them,
  and they rendezvous again without the lost nodes. (Reached on a smaller world, because a
  node had not arrived yet, the ranks wait for the agents to restart them at the full size.)
* ``--grow-at G``: at step ``G`` on the shrunken world, rank 0 adds one node with the command
  ``fzero launch`` puts in ``$FZERO_ELASTIC_JOIN``, and the ranks wait; the agents see the
  node waiting and restart the group at the larger size.

Rank 0 appends JSON lines to ``OUT/log.jsonl``: ``{"start": step, "world": W, "zero": stage, "t": time}`` when
a worker group starts and ``{"step", "loss" (float.hex), "world"}`` after each step. A rank
that kills its node first writes the time to ``OUT/fault_time``; rank 0 writes the time it
adds a node to ``OUT/grown``.

:func:`reference` is the uninterrupted run in one process, for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time

GLOBAL_BATCH = 12
SAMPLES = 36  # three global batches per epoch
T = 4
VOCAB = 13
WAIT_S = 120  # how long ranks wait for their agents to restart them at another size


def dataset():
    """The fixed dataset: ``SAMPLES`` rows of ``T`` token ids, targets padded with -100 at random."""
    import torch

    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (SAMPLES, T), generator=g)
    y = torch.roll(ids, -1, 1)
    valid = torch.randint(0, T + 1, (SAMPLES, 1), generator=g)
    y[torch.arange(T).expand(SAMPLES, T) >= valid] = -100
    return torch.utils.data.TensorDataset(ids, y)


def model():
    import torch.nn as nn

    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, 8)
            self.drop = nn.Dropout(0.2)
            self.fc = nn.Linear(8, 16)
            self.head = nn.Linear(16, VOCAB)

        def forward(self, ids):
            return self.head(self.fc(self.drop(self.emb(ids))).tanh())

    return TinyLM()


def initial_state():
    """The job's first state (SGD with momentum, dropout seed 0)."""
    import torch

    import fzero
    from fzero import optim

    torch.manual_seed(0)
    apply, params = fzero.functionalize(model())
    return fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.sgd(0.2, momentum=0.9), seed=0)


def train_step(state, batch):
    import torch.nn.functional as F

    import fzero

    ids, y = batch
    def loss_fn(p):
        logits = state.apply_fn(p, ids).flatten(0, 1)
        ce = F.cross_entropy(logits, y.flatten().clamp(min=0), reduction="none")
        return fzero.global_mean(ce, where=y.flatten() != -100)

    loss, grads = fzero.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads), {"loss": loss}


def reference(steps: int):
    """Losses and final parameters of the uninterrupted run, in this process.

    The global batches come from the rule docs/data.md states (epoch ``e``'s order is
    ``torch.randperm`` under a generator seeded with ``seed + e``; batch ``b`` is its rows
    ``[bB, (b+1)B)``), not through ``fzero.data``; the step runs in a world of one
    (``fzero.Step``: no transform, the whole global batch), with fzero's dropout.
    """
    import torch

    import fzero

    data = dataset()
    per_epoch = len(data) // GLOBAL_BATCH
    state, step, losses = initial_state(), fzero.Step(train_step), []
    for i in range(steps):
        epoch, b = divmod(i, per_epoch)
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0 + epoch))
        rows = order[b * GLOBAL_BATCH:(b + 1) * GLOBAL_BATCH]
        state, m = step(state, [t[rows] for t in data.tensors])
        losses.append(float(m["loss"]))
    return losses, dict(state.params)


def _wait_for_restart(rank: int, why: str) -> None:
    print(f"elastic_job: rank {rank}: {why}; waiting for the agents to restart the group", file=sys.stderr,
          flush=True)
    time.sleep(WAIT_S)  # the agent's restart ends this process (SIGTERM)
    raise RuntimeError(f"elastic_job: rank {rank}: {why}, and no restart came within {WAIT_S} s")


def _lose_node(out: str, rank: int) -> None:
    with open(os.path.join(out, "fault_time"), "w") as f:
        f.write(repr(time.time()))
    open(os.path.join(out, "shrunk"), "w").close()
    print(f"elastic_job: rank {rank}: SIGKILL of its agent (pid {os.getppid()}) and itself", file=sys.stderr,
          flush=True)
    os.kill(os.getppid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _add_node(out: str) -> None:
    with open(os.path.join(out, "grown"), "w") as f:
        f.write(repr(time.time()))
    # The new agent gets this machine's environment, not this rank's.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TORCHELASTIC_") and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                           "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME",
                                                           "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    subprocess.Popen(shlex.split(os.environ["FZERO_ELASTIC_JOIN"]), env=env, start_new_session=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--zero", default="3", help="the ZeRO stage, or one per world size: 4:3,2:2,3:3")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--full", type=int, default=4)
    p.add_argument("--lose", type=int, default=2)
    p.add_argument("--shrink-at", type=int, default=None)
    p.add_argument("--grow-at", type=int, default=None)
    args = p.parse_args(argv)

    import torch

    import fzero
    from fzero.data import DataLoader

    torch.set_num_threads(1)
    mesh = fzero.Mesh(dp=-1)
    rank, world = mesh.rank, mesh.world_size
    stages = dict(map(int, kv.split(":")) for kv in args.zero.split(",")) if ":" in args.zero else None
    stage = stages[world] if stages else int(args.zero)
    step = fzero.compile(train_step, mesh, zero=stage)
    state = step.init(initial_state())
    loader = DataLoader(dataset(), batch_size=GLOBAL_BATCH, mesh=mesh, seed=0)
    root = os.path.join(args.out, "ckpt")
    resume = fzero.checkpoint.latest(root)
    if resume is not None:
        state = fzero.checkpoint.load(resume, like=state)
        loader.load_state_dict(fzero.checkpoint.metadata(resume)["loader"])
    log = open(os.path.join(args.out, "log.jsonl"), "a") if rank == 0 else None

    def record(**rec):
        if log is not None:
            log.write(json.dumps(rec) + "\n")
            log.flush()

    record(start=int(state.step), world=world, zero=stage, t=time.time())
    marker = lambda name: os.path.exists(os.path.join(args.out, name))  # noqa: E731
    while int(state.step) < args.steps:
        for batch in loader:
            i = int(state.step)
            if i == args.shrink_at and world == args.full and rank >= world - args.lose:
                _lose_node(args.out, rank)
            if i == args.shrink_at and world < args.full and not marker("shrunk"):
                _wait_for_restart(rank, f"step {i} on {world} ranks, before the other nodes arrived")
            if i == args.grow_at and world <= args.full - args.lose:
                if rank == 0 and not marker("grown"):
                    _add_node(args.out)
                _wait_for_restart(rank, f"step {i} on {world} ranks, a node added")
            state, metrics = step(state, batch)
            record(step=i, loss=float(metrics["loss"]).hex(), world=world)
            fzero.checkpoint.save(os.path.join(root, f"step_{int(state.step):04d}"), state, async_=True,
                                  metadata={"loader": loader.state_dict()})
            if int(state.step) >= args.steps:
                break
    print(f"elastic_job: rank {rank}: done on {world} ranks", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
