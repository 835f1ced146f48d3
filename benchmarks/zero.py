"""ZeRO on 2 ranks: DDP, FSDP2, fzero stages 0-3 and DeepSpeed stages 0-3, side by side, on a GPT.

Two presets of the example GPT (``examples/gpt.py``, fp32); an option given on the command
line (``--n-layer``, ``--batch-size``, ...) wins over the preset's:

* ``--preset default``: 6 layers of width 384, 6 heads, vocabulary 256 -- 10.80M parameters;
  global batch 16 x 128 tokens (8 sequences per rank).
* ``--preset tiny``: 4 layers of width 128, 4 heads, vocabulary 512 -- 0.88M parameters; global
  batch 2 x 128 tokens (1 sequence per rank): a step whose fixed costs (Python dispatch, the
  optimizer's work per tensor, collective latency) weigh more than its arithmetic, so what a
  framework adds per step shows.

Every contestant trains a copy of one seeded initialisation on the same batches, fp32, AdamW
(lr 3e-4, betas (0.9, 0.999), eps 1e-8, decoupled weight decay 0.1 on every parameter, no
clipping):

* ``ddp``    -- ``DistributedDataParallel(gradient_as_bucket_view=True)`` + ``torch.optim.AdamW(foreach=True)``
* ``ddp-fused`` -- the same DDP + ``torch.optim.AdamW(fused=True)``: torch's one-pass fused
  kernel, the one ``fzero.optim.adamw`` runs on the CPU (its ratio separates that kernel's
  share of fzero's speed from the rest)
* ``fsdp2``  -- ``fully_shard`` on each block, then on the root + ``torch.optim.AdamW(foreach=True)``
* ``zero0``..``zero3`` -- the pure ``train_step`` under ``fzero.compile(train_step, mesh, zero=s)``
  with ``fzero.optim.adamw``
* ``deepspeed0``..``deepspeed3`` -- DeepSpeed's engine at ZeRO stage s around the same
  ``torch.optim.AdamW(foreach=True)``, ``engine.backward(loss)``, ``engine.step()``
  (``benchmarks/_deepspeed.py`` gives its config and what its model state counts). They run
  when ``import deepspeed`` works in the interpreter running this script and are skipped with
  a printed line otherwise; a stage whose engine cannot be built here is listed with the error.

Timing: all contestants are built first, then run in rounds -- one step of each per round,
the order rotated every round -- so drift in a shared machine hits all alike. Each step
starts after a barrier; a step's time is the slowest rank's. The table gives the median over
the timed rounds and its ratio to DDP's median (``×DDP``); under the table, the paired ratio
(median over rounds of this contestant's time / DDP's in the same round), which is less
sensitive to load that drifts during the run. On a shared machine, read both with the load
average printed beside them.

Model-state bytes per rank: the distinct storages (views count once) of parameters,
gradients and optimizer state right after backward, before the update, on the second step
(when every optimizer has its state): DDP's module parameters, their ``.grad`` (views into
DDP's buckets) and ``optimizer.state``; FSDP2's local shards of the same; fzero's
``state.params``, ``state.opt_state`` and the gradients ``fzero.value_and_grad`` returned,
read inside the train step; DeepSpeed's flat buffers, fp32 master partitions, gradient
partitions and AdamW state (``benchmarks/_deepspeed.py``). ``x formula`` divides by the ZeRO
paper's count for fp32 Adam (Psi parameters, N ranks): DDP / stage 0 16Psi, stage 1
8Psi + 8Psi/N, stage 2 4Psi + 12Psi/N, stage 3 and FSDP2 16Psi/N.

Bytes sent per rank per step, counted (not timed) in that same second step, the larger
rank's. fzero's: ``fzero.distributed.comm.traffic.sent()``, the bytes its collectives' algorithms
send, where fzero has it; else ``traffic.bytes()``, the payload it handed to collectives,
printed as ``payload`` and not compared with the formula (an all-reduce of a tensor sends
2(N-1)/N of it). DDP's, FSDP2's and DeepSpeed's: a ``TorchDispatchMode``
(``_common.CountCollectives``) sees every c10d op of the step -- the all-reduces DDP's reducer
issues from C++ included -- and counts what the ring algorithm sends for it: all-reduce
2(N-1)/N of its tensor, reduce-scatter (N-1)/N of its input, all-gather N-1 times this rank's
piece. DDP's count in that step includes its one-time broadcast of the rebuilt bucket order
(a few hundred bytes). The same mode watches fzero's step: a line under the table gives its
count beside ``comm.traffic``'s. ``×sent formula`` divides by the ZeRO paper's volume (Rajbhandari
et al. 2020, sec. 7), in fp32: 2Psi(N-1)/N x 4 B at stages 0-2 (one all-reduce of the
gradients, or a reduce-scatter and an all-gather) and 3Psi(N-1)/N x 4 B at stage 3 and for
FSDP2 (the parameters gathered in forward and again in backward). fzero gathers the
parameters outside every ZeRO-3 unit once per step, and the units within its reuse window
(``max_reuse_distance``, by default 25 MiB of parameters: every block of the tiny preset,
the last three of the default's six, which it gathers as two units of three blocks), so its
stage 3 sends less than 3Psi: 2Psi when every unit is kept.

Under the table, counted or timed in every timed round: each contestant's minor page faults
(fresh memory touched), and its host time before its backward (the forward and the loss),
in autograd's engine and after it (``_common.BackwardMarks``), each rank's median: where a
contestant's step time goes beside DDP's.

Peak RSS: ``ru_maxrss`` is a lifetime maximum, so after the timed run each contestant is
run again alone in a fresh pair of processes (``--only NAME``, a few steps) and its peak
RSS is the larger of the two ranks'. Every process imports ``torch._dynamo`` up front
(DDP and FSDP2 import it when built), and DeepSpeed where it imports, so the baseline --
torch, fzero and the process group before any model exists, printed under the table -- is
the same for all contestants of a run. ``--rss off`` skips this.

Run (under torchrun, or with python, which re-executes the script under torchrun with 2
processes; the interpreter of a scratch environment that has DeepSpeed adds its contestants)::

    .venv/bin/torchrun --nproc_per_node 2 benchmarks/zero.py --steps 20 --warmup 3 --threads 1
    .venv/bin/python benchmarks/zero.py --preset tiny --warmup 3 --threads 1
    PYTHONPATH=$PWD /tmp/dsvenv/bin/python benchmarks/zero.py --steps 20 --warmup 3 --threads 1

Without ``--steps``, the default preset times 20 rounds and the tiny one 60: a tiny step
takes ~24 ms on this machine and spreads from 17 to 38 ms, so 20 rounds left the median
ratios several percent apart from run to run. The targets printed beside the ratios are
docs/performance.md's (stages 0-2 ≤ 1.00 and stage 3 ≤ 1.03 ×DDP on the default GPT,
every stage ≤ 1.10 on the tiny one).

``--jit`` adds a compiled twin beside each contestant: ``zeroN-jit`` is the same fzero step
under ``fzero.compile(jit=...)`` (the model's forward under ``torch.compile``), ``ddp-jit``
is ``torch.compile`` of the DDP module (dynamo's DDP optimizer splits the graph at bucket
boundaries), ``fsdp2-jit`` ``torch.compile`` of the FSDP2 root; inductor, or the backend
named (``--jit aot_eager``). Compiling happens in the warm-up rounds: the table's ``compile
s`` column is the warm-up rounds' time above ``warmup × median`` (each contestant's own).
After the timed rounds every compiled twin takes one step on a batch of half the sequence
length and one of a quarter, and the table counts the graphs dynamo compiled for each
(``torch._dynamo``'s ``unique_graphs`` counter: one new, dynamic-shape graph per compiled
region at the first change, none at the second is torch's automatic-dynamic behaviour). A
``--jit`` run compiles cold: no graphs from inductor's caches, no dynamic dimensions from
dynamo's profile of an earlier run (``cold_compiles``)::

    .venv/bin/python benchmarks/zero.py --preset tiny --only ddp,zero1,zero3 --jit --rss off
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
# Imported up front in every process (not inside the builders) so that every contestant's
# peak RSS includes the same code and the baseline is the same for all of them: building a
# DDP or FSDP2 module imports torch._dynamo (with _inductor and triton), ~100 MiB of RSS.
import torch._dynamo  # noqa: F401
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, ".."))

import fzero  # noqa: E402
import _deepspeed  # noqa: E402
from _common import MIB, add_gpt_options, contestants, counted, cpu_model, fzero_contestant, loadavg, loss_of, \
    make_torch_optimizer, mean_over_ranks, paired_rounds, rank_batches, run_under_torchrun, time_stats, \
    torch_state_bytes, torchrun_command  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402

SCRIPT = "benchmarks/zero.py"
DEEPSPEED = tuple(f"deepspeed{s}" for s in _deepspeed.STAGES)
CONTESTANTS = ("ddp", "ddp-fused", "fsdp2", "zero0", "zero1", "zero2", "zero3") + DEEPSPEED
# With --jit: fzero's contestants again under compile(jit=), each beside its eager one.
JIT = ("ddp-jit", "fsdp2-jit") + tuple(f"zero{s}-jit" for s in range(4))
LABELS = {**{f"zero{s}-jit": f"fzero stage {s}, jit" for s in range(4)}, "ddp-jit": "DDP + torch.compile",
          "fsdp2-jit": "FSDP2 + torch.compile", "ddp": "DDP", "ddp-fused": "DDP, fused AdamW", "fsdp2": "FSDP2 (fully_shard per block)", **{f"zero{s}": f"fzero stage {s}" for s in range(4)},
          **{f"deepspeed{s}": f"DeepSpeed stage {s}" for s in range(4)}}
# The ZeRO stage whose formulas a contestant is held to: DDP's is 0, FSDP2's 3.
STAGE = {**{f"zero{s}-jit": s for s in range(4)}, "ddp-jit": 0, "fsdp2-jit": 3, "ddp": 0, "ddp-fused": 0, "fsdp2": 3, **{f"zero{s}": s for s in range(4)}, **{f"deepspeed{s}": s for s in range(4)}}
# Bytes per parameter after backward, fp32 Adam, N ranks (ZeRO paper, fig. 1), by ZeRO stage
# (DDP's is stage 0's, FSDP2's stage 3's).
FORMULA = {0: lambda n: 16.0, 1: lambda n: 8 + 8 / n, 2: lambda n: 4 + 12 / n, 3: lambda n: 16 / n}
FORMULA_TEXT = {0: "16Ψ", 1: "8Ψ+8Ψ/N", 2: "4Ψ+12Ψ/N", 3: "16Ψ/N"}
# Parameters' worth of elements a rank sends per step, times (N-1)/N (ZeRO paper, sec. 7).
SENT = {0: 2, 1: 2, 2: 2, 3: 3}
# The benchmarked GPTs and their global batches (sequences x tokens); a command-line option wins.
PRESETS = {
    "default": dict(n_layer=6, n_head=6, n_embd=384, vocab_size=256, batch_size=16, block_size=128),  # 10.80M
    "tiny": dict(n_layer=4, n_head=4, n_embd=128, vocab_size=512, batch_size=2, block_size=128),  # 0.88M
}
# The speed targets, ×DDP, by preset (docs/performance.md's summary).
TARGETS = {"default": {"zero0": 1.00, "zero1": 1.00, "zero2": 1.00, "zero3": 1.03},
           "tiny": {f"zero{s}": 1.10 for s in range(4)}}
# Timed rounds when --steps is not given, by preset: a step of the 0.88M GPT takes ~24 ms here
# and its times spread 17-38 ms, so 20 rounds left its median ratios several percent apart
# from run to run; 60 rounds cost 8 s for five contestants.
STEPS = {"default": 20, "tiny": 60}
# torch 2.13 deprecates the *_tensor collectives fzero calls; say it once, not per rank per step.
warnings.filterwarnings("ignore", message=r".*torch.distributed.(all_gather_into_tensor|reduce_scatter_tensor)")


# --------------------------------------------------------------------------- helpers


def rss_mib() -> tuple[float, float]:
    """(current RSS, peak RSS) of this process in MiB."""
    cur = float("nan")
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    cur = int(line.split()[1]) / 1024
    except OSError:
        pass
    return cur, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# --------------------------------------------------------------------------- contestants
#
# Each builder returns ``step(batch, probe) -> loss``: one full training step (forward,
# backward, gradient communication, update). ``probe`` is a dict; when it has key "on"
# set, the step stores the model-state bytes after backward in probe["bytes"] (and fzero's
# step what comm.traffic counted); run() wraps every step in ``_common.counted``, which
# counts the c10d ops of that step.


def torch_step(model, forward, opt):
    """The step of a torch contestant: ``forward`` is ``model`` wrapped (DDP, or FSDP2's root)."""
    params = list(model.parameters())

    def step(batch, probe):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(forward(batch["x"]), batch["y"])
        loss.backward()
        if probe.get("on"):
            probe["bytes"] = torch_state_bytes(params, opt)
        opt.step()
        return loss.detach()

    return step


def jit_keywords(args) -> dict:
    """``torch.compile``'s keywords for ``--jit`` (``True``: torch's default backend)."""
    return {} if args.jit in (None, True) else {"backend": args.jit}


def build_ddp(jit=False, fused=False):
    def build(base, args, mesh):
        model = copy.deepcopy(base)
        ddp = DDP(model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True)
        forward = torch.compile(ddp, **jit_keywords(args)) if jit else ddp
        return torch_step(model, forward, make_torch_optimizer(model.parameters(), fused=fused))

    return build


def build_fsdp2(jit=False):
    def build(base, args, mesh):
        model = copy.deepcopy(base)
        dmesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=dmesh)
        fully_shard(model, mesh=dmesh)
        forward = torch.compile(model, **jit_keywords(args)) if jit else model
        return torch_step(model, forward, make_torch_optimizer(model.parameters()))

    return build


def build_fzero(stage, jit=False):
    def build(base, args, mesh):
        module = copy.deepcopy(base)

        def held(state, grads):  # the module too: every byte the process holds for the model
            return state.params, state.opt_state, grads, list(module.parameters()), list(module.buffers())

        bucket = None if args.fzero_default_bucket else int(args.bucket_mb * MIB)
        reuse = ({"max_reuse_distance": args.max_reuse_distance}
                 if stage == 3 and args.max_reuse_distance is not None else {})
        step = fzero_contestant(module, mesh, held, zero=stage, bucket_bytes=bucket, **reuse,
                                **({"jit": args.jit or True} if jit else {}))
        return lambda batch, probe: step(batch, probe)["loss"]  # already the mean over ranks

    return build


BUILDERS = {"ddp": build_ddp(), "ddp-fused": build_ddp(fused=True), "fsdp2": build_fsdp2(), "ddp-jit": build_ddp(jit=True),
            "fsdp2-jit": build_fsdp2(jit=True), **{f"zero{s}": build_fzero(s) for s in range(4)},
            **{f"zero{s}-jit": build_fzero(s, jit=True) for s in range(4)},
            **{f"deepspeed{s}": _deepspeed.build(s) for s in _deepspeed.STAGES}}


# --------------------------------------------------------------------------- the run


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=tuple(PRESETS), default="default",
                   help="the GPT and batch: default 10.80M parameters, 16x128; tiny 0.88M, 2x128")
    p.add_argument("--steps", type=int, default=None,
                   help="timed rounds, one step of each contestant per round (default 20; 60 for --preset tiny)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed rounds first (at least 2: round 2 is the memory and bytes probe)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--batch-size", type=int, default=None,
                   help="global batch (sequences), split over the ranks (default: the preset's)")
    p.add_argument("--block-size", type=int, default=None, help="tokens per sequence (default: the preset's)")
    add_gpt_options(p, n_layer=None, n_head=None, n_embd=None, vocab_size=None)
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="gradient bucket size of DDP, fzero and DeepSpeed (MiB)")
    p.add_argument("--fzero-default-bucket", action="store_true",
                   help="run fzero at its own default bucket (no bucket_bytes given), the others at --bucket-mb")
    p.add_argument("--max-reuse-distance", type=float, default=None, metavar="ELEMENTS",
                   help="fzero stage 3's max_reuse_distance, in parameters (default: fzero's, 25 MiB of them; "
                        "0 gathers every block again in backward, as FSDP2; 1e9 is DeepSpeed's default)")
    p.add_argument("--only", default=None,
                   help="comma-separated contestants to run (default: all of " + ", ".join(CONTESTANTS)
                        + "; DeepSpeed's where it imports; with --jit, each one's compiled twin beside it)")
    p.add_argument("--rss", choices=("isolated", "off"), default="isolated",
                   help="isolated: measure each contestant's peak RSS in a fresh process pair afterwards")
    p.add_argument("--rss-steps", type=int, default=3, help="steps of each isolated peak-RSS run")
    p.add_argument("--jit", nargs="?", const=True, default=None, metavar="BACKEND",
                   help="also run each contestant's compiled twin: fzero under compile(jit=) (zeroN-jit), DDP and "
                        "FSDP2 under torch.compile (ddp-jit, fsdp2-jit); a backend name (aot_eager, eager) "
                        "instead of torch's default, inductor")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    for k, v in PRESETS[args.preset].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.steps is None:
        args.steps = STEPS[args.preset]
    return args


def command_line(argv) -> str:
    """The command that reruns this one, with the interpreter that ran it (it decides whether
    DeepSpeed runs): relative to the repository when the interpreter is inside it."""
    python = sys.executable
    repo = os.path.dirname(HERE)
    if python.startswith(repo + os.sep):
        python = os.path.relpath(python, repo)
    return f"{python} -m torch.distributed.run --nproc_per_node 2 {SCRIPT} " + " ".join(argv)


def chosen(only: str | None, deepspeed: tuple[bool, str], jit: bool = False) -> tuple[str, ...]:
    """The contestants to run: ``--only``'s, or all of them, DeepSpeed's where it imports
    and, with ``--jit``, each contestant's compiled twin after it."""
    ok, why = deepspeed
    if only is None:
        names = CONTESTANTS if ok else tuple(n for n in CONTESTANTS if n not in DEEPSPEED)
    else:
        asked = [n for n in only.split(",") if n in DEEPSPEED]
        if asked and not ok:
            raise SystemExit(f"{SCRIPT}: --only {only}: {asked[0]} needs DeepSpeed, and import deepspeed failed "
                             f"({why})")
        names = contestants(only, CONTESTANTS + JIT, SCRIPT)
    twins = [m for n in names for m in ((n, f"{n}-jit") if jit and f"{n}-jit" in JIT else (n,))]
    return tuple(dict.fromkeys(twins))


def cold_compiles() -> None:
    """Every run compiles as a user's first run does: no graphs or kernels from this machine's
    caches (inductor's FX-graph and AOTAutograd caches), and no dimensions already known to be
    dynamic from an earlier run (dynamo's local profile, which would make the shape-change
    count read 0)."""
    import torch._functorch.config
    import torch._inductor.config

    torch._dynamo.config.automatic_dynamic_local_pgo = False
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False


def shape_changes(steps: dict, vocab_size: int, block_size: int, per_rank: int) -> dict[str, list[int]]:
    """Each compiled contestant's graphs compiled (dynamo's ``unique_graphs`` counter) by one
    step on sequences of half, then a quarter, of ``block_size`` tokens."""
    from torch._dynamo.utils import counters

    out = {}
    for n, step in steps.items():
        if not n.endswith("-jit"):
            continue
        out[n] = []
        for length in (block_size // 2, block_size // 4):
            batch = rank_batches(vocab_size, length, per_rank, 1)[0]
            before = counters["stats"]["unique_graphs"]
            step(batch, {}).item()
            out[n].append(counters["stats"]["unique_graphs"] - before)
    return out


def build_all(names, base, args, mesh) -> tuple[dict, dict]:
    """Every contestant's step (wrapped to count its collectives in the probed round), and the
    DeepSpeed stages whose engine could not be built here, with why (on any rank)."""
    steps, failed = {}, {}
    for n in names:
        try:
            step = BUILDERS[n](base, args, mesh)
            # Not DDP's or FSDP2's compiled twin: dynamo stops compiling a function it once met
            # under a dispatch mode (the counter), and the twin would run eagerly from then on
            # (fzero's jit runs the model eagerly while a mode is active, fzero._jit).
            steps[n] = step if n in ("ddp-jit", "fsdp2-jit") else counted(step, SCRIPT)
        except Exception as e:  # only DeepSpeed's: ours and torch's must build, or the run stops
            if n not in DEEPSPEED:
                raise
            failed[n] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, failed)
    failed = {n: why for f in every for n, why in f.items()}
    return {n: s for n, s in steps.items() if n not in failed}, failed


def run(args, argv) -> dict | None:
    torch.set_num_threads(args.threads)
    if args.jit:
        cold_compiles()
    deepspeed = _deepspeed.available()  # imported before the baseline, in every process alike
    mesh = fzero.Mesh(dp=-1)
    world, rank = dist.get_world_size(), dist.get_rank()
    names = chosen(args.only, deepspeed, bool(args.jit))
    if args.batch_size % world:
        raise SystemExit(f"{SCRIPT}: --batch-size {args.batch_size} does not split over {world} ranks")
    baseline_rss = rss_mib()[0]
    t_start = time.perf_counter()

    cfg = GPTConfig(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd)
    torch.manual_seed(0)
    base = GPT(cfg)
    psi = sum(p.numel() for p in base.parameters())  # tied head counted once
    steps, failed = build_all(names, base, args, mesh)
    chosen_names, names = names, tuple(steps)
    del base
    gc.collect()

    warmup = max(args.warmup, 2)
    batches = rank_batches(cfg.vocab_size, cfg.block_size, args.batch_size // world, warmup + args.steps)

    every_time = {n: [] for n in names}
    faults, phases = {}, {}
    times, losses, probes = paired_rounds(steps, batches, warmup, every_time, faults, phases)
    new_graphs = shape_changes(steps, cfg.vocab_size, cfg.block_size, args.batch_size // world)

    # The slowest rank's time per step; model state and bytes of the larger rank; global mean losses.
    all_times = [None] * world
    dist.all_gather_object(all_times, times)
    all_probes = [None] * world
    dist.all_gather_object(all_probes, probes)
    all_faults = [None] * world
    dist.all_gather_object(all_faults, {n: statistics.median(v) if v else None for n, v in faults.items()})
    all_phases = [None] * world  # each rank's median seconds before, in and after backward
    dist.all_gather_object(all_phases, {n: [statistics.median(r[k] for r in v) for k in range(3)]
                                        for n, v in phases.items() if v})
    loss_t = mean_over_ranks(losses, names)
    peak_rss = torch.tensor([rss_mib()[1]], dtype=torch.float64)
    dist.all_reduce(peak_rss, op=dist.ReduceOp.MAX)
    del steps
    gc.collect()
    dist.barrier()
    if rank != 0:
        return None

    res = {}
    slowest = {n: [max(r[n][k] for r in all_times) for k in range(len(times[n]))] for n in names}
    for j, n in enumerate(names):
        t, stage = slowest[n], STAGE[n]
        largest = {k: max(p[n][k] for p in all_probes) for k in all_probes[0][n] if k not in ("sent_as", "c10d_kinds")}
        # Paired: this contestant's time over DDP's in the same round, median over rounds.
        paired = [a / b for a, b in zip(t, slowest["ddp"])] if "ddp" in slowest and t else []
        paired_fused = [a / b for a, b in zip(t, slowest["ddp-fused"])] if "ddp-fused" in slowest and t else []
        # A compiled twin against DDP + torch.compile in the same round (--jit's first target).
        paired_jit = ([a / b for a, b in zip(t, slowest["ddp-jit"])] if n.endswith("-jit") and "ddp-jit" in slowest
                      and t else [])
        formula = FORMULA[stage](world) * psi
        sent_formula = SENT[stage] * psi * (world - 1) / world * 4
        # fzero's step reads its own count from comm.traffic; every step has the c10d count.
        # DDP's and FSDP2's compiled twins' c10d ops are not counted (see build_all): "–".
        sent, sent_as = ((largest["sent"], probes[n]["sent_as"]) if "sent" in largest
                         else (largest.get("c10d_sent"), "ring"))
        res[n] = {
            **time_stats(t),
            "x_ddp_paired": statistics.median(paired) if paired else None,
            "x_ddp_fused_paired": statistics.median(paired_fused) if paired_fused else None,
            "x_ddp_jit_paired": statistics.median(paired_jit) if paired_jit else None,
            "state_bytes": largest["bytes"],
            "formula_bytes": formula,
            "x_formula": largest["bytes"] / formula,
            "sent_bytes": sent,
            "sent_as": sent_as,
            "sent_formula_bytes": sent_formula,
            "x_sent_formula": sent / sent_formula if sent_as == "ring" and sent is not None else None,
            "c10d_sent_bytes": largest.get("c10d_sent"),
            "c10d_payload_bytes": largest.get("c10d_payload"),
            "c10d_payload_by_kind_rank0": probes[n].get("c10d_kinds"),
            "traffic_payload_bytes": largest.get("payload"),
            "compile_s": sum(every_time[n][:warmup]) - warmup * statistics.median(t) if t else None,
            "first_step_s": every_time[n][0],
            "minor_faults_per_step": [f.get(n) for f in all_faults],  # each rank's median
            "phases_s": [f.get(n) for f in all_phases],  # each rank's: before backward, backward, after
            "graphs_on_new_shapes": new_graphs.get(n),
            "final_loss": float(loss_t[j, -1]),
            "losses": [float(v) for v in loss_t[j]],
        }
    res |= {n: {"failed": why} for n, why in failed.items()}
    res = {n: res[n] for n in chosen_names}  # the table's order, failures in their place
    return {
        "command": command_line(argv),
        "preset": args.preset,
        "world": world,
        "psi": psi,
        "gpt": {k: getattr(args, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size")},
        "threads": args.threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "deepspeed": {"available": deepspeed[0], ("version" if deepspeed[0] else "why"): deepspeed[1]},
        "batch": [args.batch_size, args.block_size],
        "steps": args.steps,
        "warmup": warmup,
        "max_reuse_distance": args.max_reuse_distance,
        "targets": TARGETS[args.preset],
        "baseline_rss_mib": baseline_rss,
        "peak_rss_all_contestants_mib": float(peak_rss),
        "loadavg_start": None,
        "timing_wall_s": time.perf_counter() - t_start,
        "results": res,
    }


def isolated_rss(args, names) -> dict[str, float]:
    """Each contestant alone in a fresh pair of processes: its peak RSS (max over ranks)."""
    out = {}
    for n in names:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "r.json")
            cmd = torchrun_command(__file__, [
                "--only", n, "--rss", "off", "--steps", str(max(args.rss_steps - 2, 0)), "--warmup", "2",
                "--preset", args.preset, "--threads", str(args.threads), "--batch-size", str(args.batch_size),
                "--block-size", str(args.block_size), "--n-layer", str(args.n_layer), "--n-head", str(args.n_head),
                "--n-embd", str(args.n_embd), "--vocab-size", str(args.vocab_size), "--bucket-mb", str(args.bucket_mb),
                "--json", path, "--quiet", *(["--fzero-default-bucket"] if args.fzero_default_bucket else []),
                *(["--max-reuse-distance", str(args.max_reuse_distance)]
                  if args.max_reuse_distance is not None else [])])
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                print(f"isolated RSS run of {n} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}", file=sys.stderr)
                out[n] = float("nan")
                continue
            with open(path) as f:
                r = json.load(f)
            out[n] = r["peak_rss_all_contestants_mib"]
            out[n + ":baseline"] = r["baseline_rss_mib"]
    return out


def report(result: dict, rss: dict) -> None:
    res, world, psi = result["results"], result["world"], result["psi"]
    ran = {n: r for n, r in res.items() if "failed" not in r}
    ddp = ran.get("ddp", {}).get("median_s")
    ref = ran["ddp"]["losses"] if "ddp" in ran else None
    g, (b, s) = result["gpt"], result["batch"]
    print(f"`{result['command']}`\n")
    print(f"machine: {result['cpu']}, {world} ranks (gloo) x {result['threads']} torch thread(s), "
          f"torch {result['torch']}, Python {result['python']}; preset {result['preset']}: GPT {g['n_layer']} layers "
          f"of width {g['n_embd']}, {g['n_head']} heads, vocabulary {g['vocab_size']}, {psi / 1e6:.2f}M params "
          f"(Ψ = {psi}), fp32, global batch {b}x{s} ({b // world} per rank); "
          f"{result['steps']} timed rounds after {result['warmup']} warmup, contestants interleaved; "
          f"load average at start {result['loadavg_start']}, at end {result['loadavg_end']}\n")
    print("| contestant | median step s | ×DDP | model-state MiB/rank | ×formula | MiB sent/rank/step "
          "| ×sent formula | peak RSS MiB | final loss | loss vs DDP |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, r in res.items():
        if "failed" in r:
            print(f"| {LABELS[n]} | did not run: {r['failed']} | | | | | | | | |")
            continue
        stage = STAGE[n]
        x = f"{r['median_s'] / ddp:.3f}" if ddp else "–"
        target = f" (≤ {result['targets'][n]:.2f})" if n in result["targets"] else ""
        peak = rss.get(n)
        peak_s = f"{peak:.0f}" if peak is not None and peak == peak else "–"
        sent_f = f"{SENT[stage]}Ψ(N-1)/N"
        sent = ("–" if r["sent_bytes"] is None else
                f"{r['sent_bytes'] / MIB:.2f}" + (" payload" if r["sent_as"] == "payload" else ""))
        x_sent = f"{r['x_sent_formula']:.3f} ({sent_f})" if r["x_sent_formula"] is not None else f"– ({sent_f})"
        parity = f"{max(abs(a - c) / abs(c) for a, c in zip(r['losses'], ref)):.1e}" if ref else "–"
        print(f"| {LABELS[n]} | {r['median_s']:.3f} | {x}{target} | {r['state_bytes'] / MIB:.1f} | "
              f"{r['x_formula']:.3f} ({FORMULA_TEXT[stage]}) | {sent} | {x_sent} | {peak_s} | "
              f"{r['final_loss']:.5f} | {parity} |")
    base = [v for k, v in rss.items() if k.endswith(":baseline")]
    print()
    if base:
        print(f"peak RSS: each contestant alone in a fresh process pair ({result['rss_steps']} steps), larger rank; "
              f"baseline before the model (torch + fzero + gloo"
              f"{' + DeepSpeed' if result['deepspeed']['available'] else ''}) ≈ {statistics.median(base):.0f} MiB")
    if ref:
        worst = max(abs(a - c) / abs(c) for r in ran.values() for a, c in zip(r["losses"], ref))
        print(f"loss parity: max relative difference from DDP over all {len(ref)} steps of every contestant: "
              f"{worst:.1e}")
        print("×DDP paired (median over rounds of the contestant's step time / DDP's in the same round): "
              + ", ".join(f"{n} {r['x_ddp_paired']:.3f}" for n, r in ran.items() if r["x_ddp_paired"] is not None))
    if any(r.get("x_ddp_fused_paired") is not None for r in ran.values()):
        print("×DDP-fused paired (the same, against DDP with torch.optim.AdamW(fused=True)): "
              + ", ".join(f"{n} {r['x_ddp_fused_paired']:.3f}" for n, r in ran.items()
                          if r.get("x_ddp_fused_paired") is not None))
    if any(r.get("x_ddp_jit_paired") is not None for r in ran.values()):
        print("÷DDP+compile paired (a compiled twin's step time / DDP + torch.compile's in the same round, median): "
              + ", ".join(f"{n} {r['x_ddp_jit_paired']:.3f}" for n, r in ran.items()
                          if r.get("x_ddp_jit_paired") is not None))
    print(f"bytes sent, ZeRO formula in fp32: 2Ψ(N-1)/N × 4 B = {2 * psi * (world - 1) / world * 4 / MIB:.2f} MiB "
          f"(stages 0-2), 3Ψ(N-1)/N × 4 B = {3 * psi * (world - 1) / world * 4 / MIB:.2f} MiB (stage 3, FSDP2); "
          "DDP, FSDP2 and DeepSpeed: what the ring algorithm sends for the c10d ops of one step")
    fz = {n: r for n, r in ran.items() if n.startswith("zero")}
    if fz:
        print("fzero's bytes: " + ("comm.traffic.sent()" if all(r["sent_as"] == "ring" for r in fz.values()) else
                                   "comm.traffic.bytes(), the payload handed to collectives (this fzero has no "
                                   "traffic.sent())") + "; the c10d ops of the same step:")
        for n, r in fz.items():
            if r["c10d_payload_bytes"] is None:
                continue  # a compiled twin: not counted at the c10d level (see build_all)
            same = "=" if r["c10d_payload_bytes"] == r["traffic_payload_bytes"] else "≠"
            print(f"- {n}: payload {r['c10d_payload_bytes']} B ({same} comm.traffic.bytes() "
                  f"{r['traffic_payload_bytes']} B), "
                  f"by the ring {r['c10d_sent_bytes'] / MIB:.2f} MiB = "
                  f"{r['c10d_sent_bytes'] / r['sent_formula_bytes']:.3f} × {SENT[STAGE[n]]}Ψ(N-1)/N × 4 B"
                  + (f" ({'=' if round(r['sent_bytes']) == round(r['c10d_sent_bytes']) else '≠'} "
                     f"comm.traffic.sent() {r['sent_bytes'] / MIB:.2f} MiB)" if r["sent_as"] == "ring" else ""))
        if "zero3" in fz:
            reuse = result.get("max_reuse_distance")
            window = f"{reuse:g} parameters" if reuse is not None else "25 MiB of parameters by default"
            print("fzero's stage 3 gathers the parameters outside every ZeRO-3 unit, and the units within "
                  f"max_reuse_distance ({window}), once per step, not twice: it sends less "
                  "than 3Ψ(N-1)/N (2Ψ(N-1)/N when every unit is kept)")
    ds = result["deepspeed"]
    if not ds["available"]:
        print(f"DeepSpeed: skipped, import deepspeed failed in this interpreter ({ds['why']})")
    else:
        ran_ds = [n for n in DEEPSPEED if n in ran]
        print(f"DeepSpeed {ds['version']}: ran at stages {', '.join(n[-1] for n in ran_ds) or 'none'}"
              + "".join(f"; stage {n[-1]} did not run ({r['failed']})" for n, r in res.items() if "failed" in r))
    jitted = {n: r for n, r in ran.items() if r.get("graphs_on_new_shapes") is not None}
    if jitted:
        print("compile: warm-up rounds' time above warm-up × median step (s), first step (s), and graphs dynamo "
              "compiled at a batch of half / a quarter of the sequence length: "
              + "; ".join(f"{n} {r['compile_s']:.1f} s, first {r['first_step_s']:.1f} s, "
                          f"{'/'.join(map(str, r['graphs_on_new_shapes']))} new graphs" for n, r in jitted.items()))
    print("min / max step s: " + ", ".join(f"{n} {r['min_s']:.3f}/{r['max_s']:.3f}" for n, r in ran.items()))
    print("minor page faults per step, each rank's median (fresh memory touched: counted, not timed): "
          + ", ".join(f"{n} " + "/".join("–" if f is None else f"{f:.0f}" for f in r["minor_faults_per_step"])
                      for n, r in ran.items()))
    print("host time by phase, ms, each rank's median (before backward: the forward and the loss; backward: "
          "autograd's engine; after: the update and what waits): "
          + "; ".join(f"{n} " + ", ".join("–" if f is None else "/".join(f"{x * 1e3:.0f}" for x in f)
                                         for f in r["phases_s"])
                      for n, r in ran.items()))
    print(f"wall: timed run {result['timing_wall_s']:.0f} s, isolated RSS runs {result['rss_wall_s']:.0f} s")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    quiet = "--quiet" in argv
    argv = [a for a in argv if a != "--quiet"]
    args = parse(argv)
    run_under_torchrun(__file__, argv)
    start_load = loadavg()
    result = run(args, argv)
    if result is None:
        dist.destroy_process_group()
        return
    result["loadavg_start"], result["rss_steps"] = start_load, max(args.rss_steps, 2)
    dist.destroy_process_group()
    t_rss = time.perf_counter()
    ran = [n for n, r in result["results"].items() if "failed" not in r]
    rss = isolated_rss(args, ran) if args.rss == "isolated" else {}
    result["rss_wall_s"] = time.perf_counter() - t_rss
    result["loadavg_end"] = loadavg()
    for n in ran:
        result["results"][n]["peak_rss_mib"] = rss.get(n)
    result["isolated_baseline_rss_mib"] = {k.split(":")[0]: v for k, v in rss.items() if k.endswith(":baseline")}
    if not quiet:
        report(result, rss)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
