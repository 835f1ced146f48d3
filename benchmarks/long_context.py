"""Long context on 2 ranks: activation memory per rank and step time of the example GPT at
growing sequence lengths, for data parallelism, tensor parallelism, tensor + Megatron sequence
parallelism, PyTorch's own DTensor sequence parallelism, and DeepSpeed-Ulysses (``fzero.Mesh(sp=2)``)
where this fzero has it.

The model: ``examples/gpt.py``'s GPT (``--n-layer`` blocks, width ``--n-embd``, ``--n-head``
heads, byte vocabulary, dropout ``--dropout`` on the embeddings, attention and both residual
branches: 0 by default, as Ulysses refuses dropout under ``sp``), fp32, AdamW (``_common``'s), the same global batch of ``--batch-size`` sequences
for every contestant, at each ``--seqs`` length:

* ``dp``      -- ``fzero.compile(step, Mesh(dp=2))``: each rank holds the whole model and half the
  sequences.
* ``tp``      -- ``fzero.compile(step, Mesh(tp=2), tp=tp_plans.gpt(model))``: every rank the whole
  batch, its heads and half of each MLP; the norms, dropouts and residual stream whole.
* ``tp+sp``   -- the same with ``sequence_parallel=True`` (``tp_plans.gpt(model,
  sequence_parallel=True)``): between the split pairs, this rank's half of the sequence.
* ``torch-sp`` -- ``torch.distributed.tensor.parallel.parallelize_module`` with PyTorch's
  sequence-parallel plan (``SequenceParallel`` norms, ``ColwiseParallel(input_layouts=Shard(1))``,
  ``RowwiseParallel(output_layouts=Shard(1))``, ``PrepareModuleInput`` at the first block and
  the head) + ``torch.optim.AdamW``, on gloo. Its column split of the fused q/k/v projection
  cuts the rows in two halves, not each of q, k and v by heads as fzero's plan does, so its
  attention computes another function of the weights at the same cost; its losses are not
  compared.
* ``ulysses`` -- ``fzero.compile(step, Mesh(sp=2))`` when ``fzero.Mesh`` takes an ``sp`` axis;
  otherwise a row that says it is not available.

Measured per rank, the larger of the two ranks printed:

* **activations** -- the bytes autograd saves for backward in one step's forward: distinct
  storages packed by ``torch.autograd.graph.saved_tensors_hooks`` (a DTensor's local tensor),
  the parameters' own storages left out. Deterministic: what the step holds at the end of its
  forward for its backward, the activation memory the Megatron paper counts (Korthikanti et al.
  2022, sec. 4: per layer ``sbh(34 + 5as/h)`` on one device, ``sbh(10 + 24/t + 5as/(ht))``
  under tensor parallelism, ``sbh(34 + 5as/h)/t`` with sequence parallelism).
* **step** -- median seconds of ``--steps`` steps after ``--warmup``, each started after a
  barrier, the slower rank's.
* **tp/sp bytes** -- what fzero's step sent over the ``tp`` and ``sp`` axes
  (``metrics["comm_bytes_by_axis"]``): tensor parallelism's activations; Ulysses' all-to-alls
  and, since ZeRO's group is ``dp × sp`` and dp is 1 here, the gradients' all-reduce too.

Run (the script re-executes itself under torchrun with 2 processes)::

    .venv/bin/python benchmarks/long_context.py                      # seq 512, 1024, 2048
    .venv/bin/python benchmarks/long_context.py --seqs 32,64 --n-layer 1 --n-embd 32 --steps 1 --warmup 0
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import fzero  # noqa: E402
from fzero import optim  # noqa: E402
from fzero.transforms import tp_plans  # noqa: E402
from gpt import GPT, GPTConfig  # noqa: E402
from _common import BETAS, EPS, LR, MIB, WEIGHT_DECAY, cpu_model, loadavg, loss_of, run_under_torchrun  # noqa: E402

CONTESTANTS = ("dp", "tp", "tp+sp", "torch-sp", "ulysses")
warnings.filterwarnings("ignore", message=r".*torch.distributed.(all_gather_into_tensor|reduce_scatter_tensor)")


class SavedBytes:
    """Distinct storages autograd saves while the block is active, parameters left out."""

    def __init__(self, exclude: list[torch.Tensor]):
        self.exclude = {_local(p).untyped_storage().data_ptr() for p in exclude}
        self.storages: dict[int, int] = {}

    def pack(self, t):
        s = _local(t).untyped_storage()
        if s.data_ptr() not in self.exclude:
            self.storages[s.data_ptr()] = s.nbytes()
        return t

    def __enter__(self):
        self.storages.clear()
        self.ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self.ctx.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


# --------------------------------------------------------------------------- the contestants


def build_fzero(base: GPT, mesh_kwargs: dict, **options):
    """A compiled fzero step; ``step(batch, probe)`` fills ``probe`` with the saved bytes."""
    module = copy.deepcopy(base)
    apply, params = fzero.functionalize(module)
    tx = optim.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)
    box: dict = {}

    def train_step(state, batch):
        def loss_fn(p):
            with SavedBytes(list(p.values())) as saved:
                loss = loss_of(state.apply_fn(p, batch["x"]), batch["y"])
            box["saved"] = saved.total
            return loss
        loss, grads = fzero.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads), {"loss": loss}

    mesh = fzero.Mesh(**mesh_kwargs)
    step = fzero.compile(train_step, mesh, comm_bytes=True, **options)
    holder = {"state": step.init(fzero.TrainState.create(apply_fn=apply, params=params, tx=tx))}
    dp = mesh.size("dp")

    def run(batch, probe):
        rows = batch["x"].shape[0] // dp
        r = mesh.coords["dp"]
        local = {k: v[r * rows:(r + 1) * rows] for k, v in batch.items()}
        holder["state"], metrics = step(holder["state"], local)
        probe.update(saved=box["saved"], tp_bytes=float(sum(metrics["comm_bytes_by_axis"].get(a, 0) for a in ("tp", "sp"))))
        return metrics["loss"]

    return run


def build_torch_sp(base: GPT, dmesh):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel as tp

    model = copy.deepcopy(base)
    plan = {
        "blocks.0": tp.PrepareModuleInput(input_layouts=Replicate(), desired_input_layouts=Shard(1)),
        "blocks.*.ln_1": tp.SequenceParallel(),
        "blocks.*.ln_2": tp.SequenceParallel(),
        "blocks.*.attn.c_attn": tp.ColwiseParallel(input_layouts=Shard(1)),
        "blocks.*.attn.c_proj": tp.RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "blocks.*.mlp.c_fc": tp.ColwiseParallel(input_layouts=Shard(1)),
        "blocks.*.mlp.c_proj": tp.RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "ln_f": tp.SequenceParallel(),
        "lm_head": tp.PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                         use_local_output=True),
    }
    tp.parallelize_module(model, dmesh, plan)
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    opt = torch.optim.AdamW([{"params": g} for g in groups if g], lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WEIGHT_DECAY)

    def run(batch, probe):
        opt.zero_grad(set_to_none=True)
        with SavedBytes(params) as saved:
            loss = loss_of(model(batch["x"]), batch["y"])
        loss.backward()
        opt.step()
        probe.update(saved=saved.total, tp_bytes=None)
        return loss.detach()

    return run


def ulysses_available() -> str | None:
    """Why ``fzero.Mesh(sp=2)`` cannot run here, or None."""
    if "sp" not in inspect.signature(fzero.Mesh).parameters:
        return "fzero.Mesh takes no sp axis in this build"
    return None


# --------------------------------------------------------------------------- the run


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="512,1024,2048", help="comma-separated sequence lengths")
    p.add_argument("--batch-size", type=int, default=2, help="global batch (sequences), the same for everyone")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0,
                   help="dropout rate (Ulysses refuses dropout under sp, so its row needs 0, the default)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per contestant and length")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--only", default=None, help=f"comma-separated contestants (default: {','.join(CONTESTANTS)})")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p.parse_args(argv)


def measure(run, batches, warmup: int) -> dict:
    probe: dict = {}
    times = []
    for i, b in enumerate(batches):
        dist.barrier()
        t = time.perf_counter()
        float(run(b, probe))
        dt = torch.tensor([time.perf_counter() - t, float(probe["saved"])], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slower rank's time, the larger rank's bytes
        if i >= warmup:
            times.append(float(dt[0]))
        saved = int(dt[1])
    return {"saved_bytes": saved, "step_s": statistics.median(times), "tp_bytes": probe.get("tp_bytes")}


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    names = tuple(args.only.split(",")) if args.only else CONTESTANTS
    unknown = [n for n in names if n not in CONTESTANTS]
    if unknown:
        raise SystemExit(f"benchmarks/long_context.py: --only: unknown {unknown}; choose from {CONTESTANTS}")
    from torch.distributed.device_mesh import init_device_mesh

    fzero.Mesh(dp=-1)  # joins the process group torchrun describes
    dmesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    rows: list[dict] = []
    for seq in (int(s) for s in args.seqs.split(",")):
        torch.manual_seed(0)
        cfg = GPTConfig(block_size=seq, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                        dropout=args.dropout)
        base = GPT(cfg)
        g = torch.Generator().manual_seed(1)
        batches = []
        for _ in range(args.warmup + args.steps):
            x = torch.randint(cfg.vocab_size, (args.batch_size, seq + 1), generator=g)
            batches.append({"x": x[:, :-1].contiguous(), "y": x[:, 1:].contiguous()})
        builders = {
            "dp": lambda: build_fzero(base, {"dp": 2}),
            "tp": lambda: build_fzero(base, {"dp": 1, "tp": 2}, tp=tp_plans.gpt(base)),
            "tp+sp": lambda: build_fzero(base, {"dp": 1, "tp": 2},
                                         tp=tp_plans.gpt(base, sequence_parallel=True), sequence_parallel=True),
            "torch-sp": lambda: build_torch_sp(base, dmesh),
            "ulysses": lambda: build_fzero(base, {"sp": 2}),
        }
        for name in names:
            row = {"seq": seq, "contestant": name}
            why = ulysses_available() if name == "ulysses" else None
            if why is None:
                try:
                    row.update(measure(builders[name](), batches, args.warmup))
                except Exception as e:  # noqa: BLE001  (a contestant that cannot run here says why, in its row)
                    why = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
            if why is not None:
                row["not_available"] = why
            rows.append(row)
    return {"rows": rows, "args": vars(args), "cpu": cpu_model(), "loadavg": loadavg()}


def report(result: dict) -> None:
    a = result["args"]
    print(f"\nexamples/gpt.py GPT: {a['n_layer']} layers, width {a['n_embd']}, {a['n_head']} heads, dropout "
          f"{a['dropout']}; global batch {a['batch_size']} sequences; 2 ranks; {result['cpu']}; "
          f"load {result['loadavg']}")
    print(f"{'seq':>6} | {'contestant':<9} | {'activations / rank (MiB)':>24} | {'x tp+sp':>7} | {'step (s)':>8} | "
          f"{'tp/sp bytes / rank':>18}")
    print("-" * 88)
    sp = {r["seq"]: r.get("saved_bytes") for r in result["rows"] if r["contestant"] == "tp+sp"}
    for r in result["rows"]:
        if "not_available" in r:
            print(f"{r['seq']:>6} | {r['contestant']:<9} | not available: {r['not_available']}")
            continue
        ratio = f"{r['saved_bytes'] / sp[r['seq']]:.2f}" if sp.get(r["seq"]) else "-"
        tp_bytes = "-" if r["tp_bytes"] is None else f"{r['tp_bytes']:.0f}"
        print(f"{r['seq']:>6} | {r['contestant']:<9} | {r['saved_bytes'] / MIB:>24.2f} | {ratio:>7} | "
              f"{r['step_s']:>8.3f} | {tp_bytes:>18}")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    run_under_torchrun(__file__, argv)
    result = run(args)
    if dist.get_rank() == 0:
        report(result)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
