"""Tensor parallelism: fzero.tensor_parallel against PyTorch's own TP, side by side, with the
bytes each sends counted and checked against Megatron's formula.

The model: a token embedding, ``--n-layer`` pre-norm MLP blocks of a transformer
(``x + c_proj(gelu(c_fc(ln(x))))``, nanoGPT's names, hidden = 4 x width), a final LayerNorm
and an untied head; ~4.3M parameters at the defaults (8 blocks, width 256): the MLP half of a
transformer layer, the half that TP splits the same way everywhere. With ``--attention`` each
block first adds causal self-attention with separate ``q_proj``, ``k_proj``, ``v_proj`` and
``o_proj`` (Llama's layout, ``--n-head`` heads), which both contestants split by heads: q, k
and v column-wise, ``o_proj`` row-wise.

Both contestants split the same layers, ``blocks.*.c_fc`` column-wise and ``blocks.*.c_proj``
row-wise, train a copy of one seeded initialisation on the same global batch, fp32, AdamW
(lr 3e-4, betas (0.9, 0.999), eps 1e-8, decoupled weight decay 0.1 on every parameter, no
clipping); every ``tp`` rank of a ``dp`` coordinate sees the same sequences:

* ``torch``  -- ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` over the
  ``tp`` axis of a DeviceMesh (DTensor, on gloo) + ``torch.optim.AdamW(foreach=True)`` in two
  param groups (foreach refuses a mix of DTensor and plain tensors in one group). With
  ``--dp 2``: FSDP2 2-D, ``fully_shard`` over ``dp`` on each block and the root, on top of TP.
* ``fzero``  -- the pure ``train_step`` (``fzero.optim.adamw``) under
  ``fzero.tensor_parallel(step, mesh, plan)`` (what ``fzero.compile(..., tp=plan)`` builds).
  With ``--dp 2``: ``fzero.tensor_parallel(fzero.shard_state(step, mesh, 3), mesh, plan)``.

Timing, as benchmarks/zero.py: contestants built first, then run in rounds, one step of each
per round with the order rotated; each step starts after a barrier and its time is the
slowest rank's. ``×PyTorch paired`` is the median over rounds of fzero's time over PyTorch's
in the same round.

Bytes sent per rank per step, counted (not timed), in warmup round 2 on every rank (the
largest is printed; they agree), as the bytes handed to each collective: all-reduce its
tensor, all-gather this rank's piece, reduce-scatter the whole input (how
``fzero.distributed.comm.traffic`` counts). fzero's: ``comm.traffic.bytes(what="tp")``, and
everything else it sent as the dp column. PyTorch's: a ``TorchDispatchMode``
(``_common.CountCollectives``) active for that one step sees each c10d op -- DTensor's
functional collectives (``_c10d_functional.*``) and FSDP2's ``c10d.*`` ops, forward and
backward -- and files its bytes under ``tp`` when its process group is the mesh's ``tp``
group, else ``dp``. Megatron's formula (Shoeybi et al.
2019, sec. 3): per MLP block, forward one all-reduce of the (tokens x width) activation after
the row-parallel layer (*g*), backward one of the same size for the column-parallel layers'
input gradient (*f*): ``2 * tokens * width * 4`` bytes per block per step in fp32, tokens
being the sequences one ``tp`` group sees; with ``--attention`` twice that (the attention's
*g* after ``o_proj``, and one *f* for q, k and v, which read one input). The script exits
non-zero if fzero's count differs from it: the count is machine-independent.

Model-state bytes per rank: distinct storages of parameters, gradients and optimizer state
after backward, before the update, in round 2 (``fzero.testing.storage_bytes``; a DTensor or a
ZeRO shard counts its local piece). Peak RSS: each contestant alone afterwards in a fresh set
of processes (``--only NAME``), larger rank; ``--rss off`` skips it.

Run (either form; the second re-executes itself under torchrun with 2 x dp processes)::

    .venv/bin/torchrun --nproc_per_node 2 benchmarks/tensor_parallel.py --steps 10 --warmup 2
    .venv/bin/torchrun --nproc_per_node 4 benchmarks/tensor_parallel.py --dp 2 --steps 6 --warmup 2
    .venv/bin/python benchmarks/tensor_parallel.py --steps 10 --warmup 2
    .venv/bin/python benchmarks/tensor_parallel.py --attention --n-layer 2 --steps 3 --rss off
"""

from __future__ import annotations

import argparse
import contextlib
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
import torch.nn as nn
import torch.nn.functional as F
# Imported up front in every process, as in benchmarks/zero.py: building an FSDP2 or DTensor
# module imports torch._dynamo (~100 MiB of RSS), so every contestant's baseline is the same.
import torch._dynamo  # noqa: F401
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import parallel as torch_tp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import fzero  # noqa: E402
from fzero import optim  # noqa: E402
from fzero.distributed import comm  # noqa: E402
from fzero.testing import storage_bytes  # noqa: E402
from fzero.transforms.shard_state import release_parameters  # noqa: E402
from _common import BETAS, EPS, LR, MIB, WEIGHT_DECAY, CountCollectives, cpu_model, loadavg, loss_of, \
    make_torch_optimizer, mean_over_ranks, paired_rounds, time_stats, torch_state_bytes  # noqa: E402

CONTESTANTS = ("torch", "fzero")
# torch 2.13 deprecates the *_tensor collectives fzero calls; say it once, not per rank per step.
warnings.filterwarnings("ignore", message=r".*torch.distributed.(all_gather_into_tensor|reduce_scatter_tensor)")
# The same globs for both libraries: parallelize_module matches plan keys with fnmatch too.
COLWISE, ROWWISE = "blocks.*.c_fc", "blocks.*.c_proj"
QKV, OUT = ("blocks.*.attn.q_proj", "blocks.*.attn.k_proj", "blocks.*.attn.v_proj"), "blocks.*.attn.o_proj"


def plans(attention: bool, head_dim: int) -> tuple[dict, dict]:
    """The same layers split by both libraries: (PyTorch's plan, fzero's)."""
    torch_plan = {COLWISE: torch_tp.ColwiseParallel(), ROWWISE: torch_tp.RowwiseParallel()}
    fzero_plan = {COLWISE: fzero.ColwiseParallel(), ROWWISE: fzero.RowwiseParallel()}
    if attention:
        torch_plan.update({**{g: torch_tp.ColwiseParallel() for g in QKV}, OUT: torch_tp.RowwiseParallel()})
        fzero_plan.update({**{g: fzero.ColwiseParallel(unit=head_dim) for g in QKV},
                           OUT: fzero.RowwiseParallel(unit=head_dim)})
    return torch_plan, fzero_plan


def labels(dp: int) -> dict[str, str]:
    if dp == 1:
        return {"torch": "PyTorch TP (`parallelize_module`)", "fzero": "fzero `tensor_parallel`"}
    return {"torch": "PyTorch TP + FSDP2 over dp (2-D)", "fzero": "fzero `tensor_parallel(shard_state(stage 3))`"}


# --------------------------------------------------------------------------- the model


class Attention(nn.Module):
    """Causal self-attention with separate q, k, v projections (Llama's names). The head
    count is read from the tensors' shapes, so it runs unchanged on a rank's heads."""

    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.head_dim = d // n_head
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        def heads(t):
            return t.view(*x.shape[:-1], -1, self.head_dim).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)),
                                           is_causal=True)
        return self.o_proj(y.transpose(1, 2).flatten(2))


class Block(nn.Module):
    """The MLP half of a pre-norm transformer layer (nanoGPT's names); with ``n_head``,
    attention in front of it."""

    def __init__(self, d: int, n_head: int | None = None):
        super().__init__()
        if n_head:
            self.ln_1, self.attn = nn.LayerNorm(d), Attention(d, n_head)
        self.ln = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        if hasattr(self, "attn"):
            x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln(x))))


class MLPStack(nn.Module):
    def __init__(self, vocab_size: int, d: int, n_layer: int, n_head: int | None = None):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab_size, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def megatron_bytes(tokens: int, d: int, n_layer: int, itemsize: int = 4, attention: bool = False) -> int:
    """Bytes a rank hands to tp all-reduces per step: per MLP block, one (tokens x d) activation
    forward (after the row-parallel layer) and one backward (the column-parallel layer's
    input gradient) -- Megatron-LM (Shoeybi et al. 2019), sec. 3; an attention adds the same
    again (after ``o_proj``; q, k and v's one input)."""
    return n_layer * (4 if attention else 2) * tokens * d * itemsize


# --------------------------------------------------------------------------- contestants
#
# Each builder returns ``step(batch, probe) -> loss``. When ``probe`` has key "on" set, the
# step stores the model-state bytes after backward in probe["bytes"] and the bytes it sent
# in probe["tp"] and probe["dp"].


def build_torch(base, dmesh, dp, plan):
    model = copy.deepcopy(base)
    torch_tp.parallelize_module(model, dmesh["tp"], plan)
    if dp > 1:
        for block in model.blocks:
            fully_shard(block, mesh=dmesh["dp"])
        fully_shard(model, mesh=dmesh["dp"])
    params = list(model.parameters())
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    opt = make_torch_optimizer([{"params": g} for g in groups if g])
    tp_name = dmesh["tp"].get_group().group_name

    def step(batch, probe):
        counter = CountCollectives("benchmarks/tensor_parallel.py") if probe.get("on") else None
        with counter or contextlib.nullcontext():
            opt.zero_grad(set_to_none=True)
            loss = loss_of(model(batch["x"]), batch["y"])
            loss.backward()
            if probe.get("on"):
                probe["bytes"] = torch_state_bytes(params, opt)
            opt.step()
        if counter is not None:
            tp = counter.bytes(group=tp_name)
            probe.update(tp=tp, dp=counter.bytes() - tp)
        return loss.detach()

    return step


def build_fzero(base, mesh, dp, plan):
    module = copy.deepcopy(base)
    apply, params = fzero.functionalize(module)
    tx = optim.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)
    probe_box = {}

    def train_step(state, batch):
        loss, grads = fzero.value_and_grad(lambda p: loss_of(state.apply_fn(p, batch["x"]), batch["y"]))(state.params)
        if probe_box.get("on"):
            probe_box["bytes"] = storage_bytes(state.params, state.opt_state, grads, list(module.parameters()))
        return state.apply_gradients(grads), {"loss": loss}

    inner = fzero.shard_state(train_step, mesh, 3) if dp > 1 else train_step
    compiled = fzero.tensor_parallel(inner, mesh, plan)
    box = {"state": compiled.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=tx))}
    # What fzero.compile does after init (shard_state does it too): the module is only code
    # now, so its whole-size weights go.
    release_parameters(module)
    del params

    def step(batch, probe):
        probe_box.clear()
        probe_box.update(probe)
        comm.traffic.reset()
        box["state"], metrics = compiled(box["state"], batch)
        if probe.get("on"):
            tp = comm.traffic.bytes(what="tp")
            probe.update(bytes=probe_box["bytes"], tp=tp, dp=comm.traffic.bytes() - tp)
        return metrics["loss"]  # already the mean over dp

    return step


# --------------------------------------------------------------------------- the run


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", type=int, default=1, help="data-parallel degree; the world is 2 x dp ranks (tp=2)")
    p.add_argument("--steps", type=int, default=10, help="timed rounds (one step of each contestant per round)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed rounds first (at least 2: round 2 is the memory and bytes probe)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--batch-size", type=int, default=8, help="global batch (sequences), split over dp")
    p.add_argument("--block-size", type=int, default=128, help="tokens per sequence")
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=256, help="width d (the hidden layer is 4 d)")
    p.add_argument("--attention", action="store_true",
                   help="each block adds causal self-attention with separate q/k/v projections, split by heads")
    p.add_argument("--n-head", type=int, default=8, help="attention heads (with --attention)")
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--only", default=None, help="comma-separated contestants (default: torch,fzero)")
    p.add_argument("--rss", choices=("isolated", "off"), default="isolated",
                   help="isolated: each contestant's peak RSS in a fresh set of processes afterwards")
    p.add_argument("--rss-steps", type=int, default=3, help="steps of each isolated peak-RSS run")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p.parse_args(argv)


def torchrun_command(argv, dp: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(2 * dp),
            os.path.abspath(__file__), *argv]


def command_line(argv, dp: int) -> str:
    return f".venv/bin/torchrun --nproc_per_node {2 * dp} benchmarks/tensor_parallel.py " + " ".join(argv)


def dp_batches(args, dp_rank: int, rounds: int) -> list[dict]:
    """One batch per round: this dp coordinate's slice of a global batch drawn from one
    seeded generator (the same on every tp rank of the coordinate, for both contestants)."""
    per = args.batch_size // args.dp
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(rounds):
        x = torch.randint(args.vocab_size, (args.batch_size, args.block_size + 1), generator=g)
        x = x[dp_rank * per:(dp_rank + 1) * per]
        out.append({"x": x[:, :-1].contiguous(), "y": x[:, 1:].contiguous()})
    return out


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run(args, argv) -> dict | None:
    torch.set_num_threads(args.threads)
    names = tuple(args.only.split(",")) if args.only else CONTESTANTS
    if any(n not in CONTESTANTS for n in names):
        raise SystemExit(f"benchmarks/tensor_parallel.py: --only {args.only!r}: choose from {', '.join(CONTESTANTS)}")
    mesh = fzero.Mesh(dp=args.dp, tp=2)
    if args.batch_size % args.dp:
        raise SystemExit(f"benchmarks/tensor_parallel.py: --batch-size {args.batch_size} does not split over "
                         f"dp={args.dp}")
    dmesh = init_device_mesh("cpu", (args.dp, 2), mesh_dim_names=("dp", "tp"))
    world, rank = dist.get_world_size(), dist.get_rank()
    baseline_rss = peak_rss_mib()
    t_start = time.perf_counter()

    torch.manual_seed(0)
    base = MLPStack(args.vocab_size, args.n_embd, args.n_layer, args.n_head if args.attention else None)
    psi = sum(p.numel() for p in base.parameters())
    split = sum(p.numel() for n, p in base.named_parameters()
                if ".c_fc." in n or ".c_proj.weight" in n or any(f".{q}." in n for q in ("q_proj", "k_proj", "v_proj"))
                or ".o_proj.weight" in n)
    torch_plan, fzero_plan = plans(args.attention, args.n_embd // args.n_head)
    builders = {"torch": lambda: build_torch(base, dmesh, args.dp, torch_plan),
                "fzero": lambda: build_fzero(base, mesh, args.dp, fzero_plan)}
    steps = {n: builders[n]() for n in names}
    del base
    gc.collect()

    warmup = max(args.warmup, 2)
    batches = dp_batches(args, mesh.coords["dp"], warmup + args.steps)
    times, losses, probes = paired_rounds(steps, batches, warmup)

    every = [None] * world
    dist.all_gather_object(every, {"times": times, "probes": probes})
    loss_t = mean_over_ranks(losses, names)
    peak = torch.tensor([peak_rss_mib()], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    del steps
    gc.collect()
    dist.barrier()
    if rank != 0:
        return None

    tokens = args.batch_size // args.dp * args.block_size
    res = {}
    for j, n in enumerate(names):
        t = [max(r["times"][n][k] for r in every) for k in range(len(times[n]))]
        res[n] = {**time_stats(t), **{k: max(r["probes"][n][k] for r in every) for k in ("bytes", "tp", "dp")},
                  "tp_min": min(r["probes"][n]["tp"] for r in every),
                  "final_loss": float(loss_t[j, -1]), "losses": [float(v) for v in loss_t[j]]}
    if "torch" in res:
        for r in res.values():
            paired = [a / b for a, b in zip(r["times_s"], res["torch"]["times_s"])]
            r["x_torch_paired"] = statistics.median(paired) if paired else None
    return {
        "command": command_line(argv, args.dp), "world": world, "dp": args.dp, "tp": 2, "psi": psi, "psi_split": split,
        "threads": args.threads, "torch": torch.__version__, "python": platform.python_version(), "cpu": cpu_model(),
        "batch": [args.batch_size, args.block_size], "tokens_per_tp_group": tokens,
        "megatron_bytes": megatron_bytes(tokens, args.n_embd, args.n_layer, attention=args.attention),
        "attention": args.attention, "n_layer": args.n_layer,
        "n_embd": args.n_embd, "steps": args.steps, "warmup": warmup, "baseline_rss_mib": baseline_rss,
        "peak_rss_all_contestants_mib": float(peak), "timing_wall_s": time.perf_counter() - t_start, "results": res,
    }


def isolated_rss(args, names) -> dict[str, float]:
    """Each contestant alone in a fresh set of processes: its peak RSS (max over ranks)."""
    out = {}
    for n in names:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "r.json")
            cmd = torchrun_command([
                "--only", n, "--rss", "off", "--steps", str(max(args.rss_steps - 2, 0)), "--warmup", "2",
                "--dp", str(args.dp), "--threads", str(args.threads), "--batch-size", str(args.batch_size),
                "--block-size", str(args.block_size), "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd),
                *(["--attention", "--n-head", str(args.n_head)] if args.attention else []),
                "--vocab-size", str(args.vocab_size), "--json", path, "--quiet"], args.dp)
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                print(f"isolated RSS run of {n} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}", file=sys.stderr)
                continue
            with open(path) as f:
                r = json.load(f)
            out[n], out[n + ":baseline"] = r["peak_rss_all_contestants_mib"], r["baseline_rss_mib"]
    return out


def report(result: dict, rss: dict) -> None:
    res, lab, formula = result["results"], labels(result["dp"]), result["megatron_bytes"]
    b, s = result["batch"]
    print(f"`{result['command']}`\n")
    print(f"machine: {result['cpu']}, {result['world']} ranks (gloo; tp=2 × dp={result['dp']}) x "
          f"{result['threads']} torch thread(s), torch {result['torch']}, Python {result['python']}; "
          f"{result['n_layer']} {'attention + MLP' if result['attention'] else 'MLP'} blocks of width "
          f"{result['n_embd']} ({result['psi'] / 1e6:.2f}M params, "
          f"{result['psi_split'] / 1e6:.2f}M of them split over tp), fp32, AdamW, global batch {b}x{s} "
          f"({result['tokens_per_tp_group']} tokens per tp group); {result['steps']} timed rounds after "
          f"{result['warmup']} warmup, contestants interleaved; load average at start {result['loadavg_start']}, "
          f"at end {result['loadavg_end']}\n")
    dp_col = result["dp"] > 1
    print("| contestant | median step s | ×PyTorch paired | model-state MiB/rank | peak RSS MiB | "
          "tp MiB sent/rank/step (counted) | Megatron formula MiB | ×formula |"
          + (" dp MiB sent/rank/step (counted) |" if dp_col else "") + " final loss |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if dp_col else "") + " ---: |")
    for n, r in res.items():
        x = f"{r['x_torch_paired']:.3f}" if r.get("x_torch_paired") is not None else "–"
        peak = rss.get(n)
        print(f"| {lab[n]} | {r['median_s']:.3f} | {x} | {r['bytes'] / MIB:.2f} | "
              f"{f'{peak:.0f}' if peak is not None else '–'} | {r['tp'] / MIB:.3f} | {formula / MIB:.3f} | "
              f"{r['tp'] / formula:.4f} |" + (f" {r['dp'] / MIB:.3f} |" if dp_col else "")
              + f" {r['final_loss']:.5f} |")
    print()
    per = 4 if result["attention"] else 2
    print(f"Megatron's formula: {per} × tokens × d × 4 B × blocks = {per} × {result['tokens_per_tp_group']} × "
          f"{result['n_embd']} × 4 × {result['n_layer']} = {formula} B per rank per step; counted, in bytes: "
          + ", ".join(f"{n} {r['tp']}" for n, r in res.items()))
    share = (result["psi_split"] / result["tp"] + result["psi"] - result["psi_split"]) / result["dp"]
    print(f"model state, fp32 AdamW: 16 B × (Ψ_split/tp + Ψ_rest)/dp = {16 * share / MIB:.2f} MiB per rank "
          "(parameters, gradients, two moments; /dp when ZeRO-3 or FSDP2 partitions them over dp)")
    if "torch" in res and "fzero" in res:
        ref = res["torch"]["losses"]
        worst = max(abs(a - b) / abs(b) for a, b in zip(res["fzero"]["losses"], ref))
        print(f"loss parity: max relative difference fzero vs PyTorch over all {len(ref)} steps: {worst:.1e}")
    base = [v for k, v in rss.items() if k.endswith(":baseline")]
    if base:
        print(f"peak RSS: each contestant alone in fresh processes ({result['rss_steps']} steps), larger rank; "
              f"baseline before the model (torch + fzero + gloo) ≈ {statistics.median(base):.0f} MiB")
    print("min / max step s: " + ", ".join(f"{n} {r['min_s']:.3f}/{r['max_s']:.3f}" for n, r in res.items()))
    print(f"wall: timed run {result['timing_wall_s']:.0f} s, isolated RSS runs {result['rss_wall_s']:.0f} s")


def check_formula(result: dict) -> None:
    """fzero's counted tp bytes must be Megatron's, on every rank: exit non-zero if not."""
    r = result["results"].get("fzero")
    if r is not None and not (r["tp"] == r["tp_min"] == result["megatron_bytes"]):
        raise SystemExit(f"benchmarks/tensor_parallel.py: fzero handed {r['tp_min']}..{r['tp']} bytes per rank "
                         f"to tp collectives in one step; Megatron's formula says {result['megatron_bytes']}")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    quiet = "--quiet" in argv
    argv = [a for a in argv if a != "--quiet"]
    args = parse(argv)
    if "RANK" not in os.environ:
        os.execv(sys.executable, torchrun_command(argv, args.dp))
    if int(os.environ["WORLD_SIZE"]) != 2 * args.dp:
        raise SystemExit(f"benchmarks/tensor_parallel.py: tp=2 × dp={args.dp} needs {2 * args.dp} ranks, "
                         f"torchrun started {os.environ['WORLD_SIZE']}")
    start_load = loadavg()
    result = run(args, argv)
    dist.destroy_process_group()
    if result is None:
        return
    result["loadavg_start"], result["rss_steps"] = start_load, max(args.rss_steps, 2)
    t_rss = time.perf_counter()
    rss = isolated_rss(args, list(result["results"])) if args.rss == "isolated" else {}
    result["rss_wall_s"] = time.perf_counter() - t_rss
    result["loadavg_end"] = loadavg()
    for n, r in result["results"].items():
        r["peak_rss_mib"] = rss.get(n)
    if not quiet:
        report(result, rss)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    check_formula(result)


if __name__ == "__main__":
    main()
