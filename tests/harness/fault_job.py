"""A small training job that resumes from its latest checkpoint and can be made to fail.

Run under ``fzero launch`` (or torchrun) by ``tests/test_faults.py`` and
``benchmarks/faults.py``::

    fzero launch --nproc 2 --max-restarts 1 tests/harness/fault_job.py OUT --zero 2 --steps 8 \\
        --fault kill:rank=1:at=backward:step=3

Every rank trains a tiny MLP on its own deterministic batches, saves an asynchronous
checkpoint under ``OUT/ckpt/step_N`` every ``--every`` steps, and on start resumes from
``fzero.checkpoint.latest``. Rank 0 appends one JSON line per step to ``OUT/losses.jsonl``
(the attempt, the step, the loss as ``float.hex``), so a test can check that a resumed run
gives the uninterrupted run's losses bit for bit.

``--fault KIND:rank=R:at=WHERE[:step=S][:attempt=A]`` makes rank ``R`` fail in attempt ``A``
(``TORCHELASTIC_RESTART_COUNT``, default 0): ``KIND`` is ``kill`` (SIGKILL), ``stop``
(SIGSTOP: a hung rank), ``exit`` (``sys.exit(3)``), ``term`` (a SIGTERM: to the rank itself,
or with ``:to=launcher`` to ``fzero launch``, its grandparent, after which the rank waits
until the launcher's copy reached it; with ``:again=1`` the rank
sends a second one, more than ``preemption.REPEAT_S`` later, while it writes the
preemption's checkpoint) or ``full`` (the rank's file size limit,
``RLIMIT_FSIZE``, drops to 1 KiB just before the save of step ``S``: its writes fail as into
a full disk, and the job goes on until the next save reports it); ``WHERE`` is ``init``
(before the process group), ``backward`` (inside the backward pass of step ``S``), ``save``
(while the asynchronous save of step ``S`` runs) or ``exit`` (after training, as the
interpreter exits). Before failing, the rank writes the time (``time.time()``) to
``OUT/fault_time``.

``--damage flip|truncate`` damages the newest checkpoint when a restarted attempt begins
(rank 0 flips a byte inside a tensor of its shard, or cuts the shard's last 8 bytes), and
``--verify-latest`` resumes from ``latest(root, verify=True)``, the newest intact one, and
saves with ``overwrite=True`` (the resumed run saves the damaged one's step again).

Every step ends with ``fzero.preempted()``: when it answers ``True`` the job saves
``OUT/ckpt/step_N`` at once (waiting ``--slow-preempt-save`` seconds first: a save that
outlasts the grace period) and exits 0.

``--tree-differs`` gives rank 1 one more parameter, ``--stage-differs`` rank 1 another ZeRO
stage, ``--path-differs`` rank 1 another checkpoint path: inputs the job must refuse.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time


def _parse_fault(text: str | None) -> dict | None:
    if not text:
        return None
    kind, *fields = text.split(":")
    spec = dict(f.split("=", 1) for f in fields)
    return {"kind": kind, "rank": int(spec.get("rank", 1)), "at": spec.get("at", "backward"),
            "step": int(spec.get("step", 0)), "attempt": int(spec.get("attempt", 0)), "to": spec.get("to", "self"),
            "again": spec.get("again") == "1"}


def _launcher_pid() -> int:
    """``fzero launch``'s process: the parent of torchrun, this rank's parent."""
    with open(f"/proc/{os.getppid()}/stat", "rb") as f:
        stat = f.read()
    return int(stat[stat.rindex(b")") + 2:].split()[1])


def _arrive_together(attempt: int, timeout_s: float = 120.0) -> None:
    """Wait, in the launcher's store, until every rank of this attempt is here: past the
    imports, which on loaded cores can put one rank more than the jobs' 4 s timeout behind
    its peer, and that timeout also bounds the process group's creation (a suite saw an
    attempt fail there, before its fault, and the restart it used up). The faults under test
    come after this point, or at ``init``, before it."""
    import datetime

    from torch.distributed import TCPStore

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     timeout=datetime.timedelta(seconds=timeout_s))
    key, world = f"fault_job/arrived/{attempt}", int(os.environ["WORLD_SIZE"])
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while store.add(key, 0) < world:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fault_job: not every rank arrived within {timeout_s} s")
        time.sleep(0.02)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--zero", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--fault", default=None)
    p.add_argument("--tree-differs", action="store_true")
    p.add_argument("--stage-differs", action="store_true")
    p.add_argument("--path-differs", action="store_true")
    p.add_argument("--damage", choices=("flip", "truncate"), default=None)
    p.add_argument("--verify-latest", action="store_true")
    p.add_argument("--slow-preempt-save", type=float, default=0.0, metavar="S")
    args = p.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    fault = _parse_fault(args.fault)
    if fault and (fault["rank"] != rank or fault["attempt"] != attempt):
        fault = None

    def fail():
        with open(os.path.join(args.out, "fault_time"), "w") as f:
            f.write(repr(time.time()))
        print(f"fault_job: rank {rank}: {fault['kind']} at {fault['at']} (attempt {attempt})", file=sys.stderr,
              flush=True)
        if fault["kind"] == "full":
            import resource

            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG), no signal
            resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        elif fault["kind"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault["kind"] == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fault["kind"] == "term":
            os.kill(os.getpid() if fault["to"] == "self" else _launcher_pid(), signal.SIGTERM)
            if fault["to"] != "self" and fault["at"] != "init":
                # The launcher passes it on to every rank a moment later; this rank waits
                # (at most 10 s) until its own copy arrived, so that the step the fault is
                # in is the one the ranks agree to stop after, however fast the step's rest.
                from fzero.distributed import preemption

                deadline = time.monotonic() + 10.0
                while preemption._STATE["first"] is None and time.monotonic() < deadline:
                    time.sleep(0.01)
        else:
            os._exit(3)

    if fault and fault["at"] == "init":
        fail()

    import torch
    import torch.nn.functional as F

    import fzero
    from fzero import optim

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)]
    if args.tree_differs and rank == 1:
        layers += [torch.nn.Linear(4, 4)]
    model = torch.nn.Sequential(*layers)
    apply, params = fzero.functionalize(model)
    state = fzero.TrainState.create(apply_fn=apply, params=params, tx=optim.adamw(1e-2))

    def train_step(state, batch):
        def loss_fn(p):
            out = state.apply_fn(p, batch["x"])
            if fault and fault["at"] == "backward" and int(state.step) == fault["step"]:
                out.register_hook(lambda g: fail())  # runs inside the backward pass
            return F.mse_loss(out, batch["y"])
        loss, grads = fzero.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads), {"loss": loss}

    _arrive_together(attempt)
    mesh = fzero.Mesh(dp=-1)
    stage = (args.zero + 1) % 4 if args.stage_differs and rank == 1 else args.zero
    step = fzero.compile(train_step, mesh, zero=stage)
    state = step.init(state)
    root = os.path.join(args.out, "ckpt" if not (args.path_differs and rank == 1) else "ckpt-rank1")
    if args.damage and attempt > 0:
        newest = fzero.checkpoint.latest(root)
        if mesh.rank == 0 and newest is not None:
            _damage(os.path.join(newest, "rank00000.safetensors"), args.damage)
        torch.distributed.barrier()
    resume = fzero.checkpoint.latest(root, verify=args.verify_latest)
    if resume is not None and mesh.rank == 0:
        print(f"fault_job: resuming from {os.path.basename(resume)} (attempt {attempt})", file=sys.stderr, flush=True)
    if resume is not None:
        state = fzero.checkpoint.load(resume, like=state)
    losses = open(os.path.join(args.out, "losses.jsonl"), "a") if mesh.rank == 0 else None
    while int(state.step) < args.steps:
        i = int(state.step)
        if fault and fault["at"] == "backward" and i == fault["step"]:
            # The kill comes mid-step, after the last checkpoint has committed: on a loaded
            # machine an asynchronous save can still be running one step later, and the
            # restart would then (rightly) begin at step 0, not show a resume.
            from fzero.checkpoint._pending import wait_pending

            wait_pending()
        g = torch.Generator().manual_seed(1000 * i + mesh.rank)
        batch = {"x": torch.randn(4, 8, generator=g), "y": torch.randn(4, 4, generator=g)}
        state, metrics = step(state, batch)
        if losses is not None:
            losses.write(json.dumps({"attempt": attempt, "step": i, "loss": float(metrics["loss"]).hex()}) + "\n")
            losses.flush()
        saved = None
        if int(state.step) % args.every == 0:
            if fault and fault["kind"] == "full" and i + 1 == fault["step"]:
                # The limit is the process's: a save of an earlier step still writing in the
                # background would fail under it too (a full suite on loaded cores saw step 2's
                # do so). The fault is a disk that fills from this save on.
                from fzero.checkpoint._pending import wait_pending

                wait_pending()
                fail()
            # Resumed past a damaged checkpoint, the run saves that step again: replace it.
            saved = fzero.checkpoint.save(os.path.join(root, f"step_{int(state.step):04d}"), state, async_=True,
                                          overwrite=args.verify_latest)
            if fault and fault["kind"] != "full" and fault["at"] == "save" and i + 1 == fault["step"]:
                fail()  # the save's thread is writing or agreeing with the other ranks now
        if fzero.preempted():
            time.sleep(args.slow_preempt_save)
            if fault and fault["kind"] == "term" and fault["again"]:
                _signal_again_while_writing(fault, time.time())
            # This step's checkpoint, unless the schedule just started it (then it is waited for).
            path = saved.wait() if saved is not None else fzero.checkpoint.save(
                os.path.join(root, f"step_{int(state.step):04d}"), state, overwrite=args.verify_latest).path
            print(f"fault_job: rank {rank}: preempted, saved {os.path.basename(path)} (attempt {attempt})",
                  file=sys.stderr, flush=True)
            sys.exit(0)
    if fault and fault["at"] == "exit":
        import atexit

        atexit.register(fail)
    print(f"fault_job: rank {rank}: done (attempt {attempt})", file=sys.stderr, flush=True)


def _signal_again_while_writing(fault: dict, first: float) -> None:
    """Send the second SIGTERM from inside the checkpoint's write of this rank's file: after
    the write, more than ``REPEAT_S`` after the first signal; then wait there for it to act."""
    from fzero.checkpoint import _format
    from fzero.distributed.preemption import REPEAT_S

    write_file = _format.write_file

    def writing(*a, **k):
        out = write_file(*a, **k)
        time.sleep(max(first + REPEAT_S + 0.5 - time.time(), 0.0))
        print(f"fault_job: second SIGTERM to {fault['to']} while saving", file=sys.stderr, flush=True)
        os.kill(os.getpid() if fault["to"] == "self" else _launcher_pid(), signal.SIGTERM)
        time.sleep(30)  # the signal ends this process before the save goes on
        return out

    _format.write_file = writing


def _damage(path: str, how: str) -> None:
    """Damage a committed shard on disk: flip a bit of its last byte (inside a tensor), or
    cut its last 8 bytes."""
    with open(path, "r+b") as f:
        size = os.fstat(f.fileno()).st_size
        if how == "truncate":
            f.truncate(size - 8)
        else:
            f.seek(size - 1)
            byte = f.read(1)[0]
            f.seek(size - 1)
            f.write(bytes([byte ^ 0x01]))


if __name__ == "__main__":
    main()
