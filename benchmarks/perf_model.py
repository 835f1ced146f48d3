"""The performance model against measured fzero steps: 1, 2 and 4 ranks, ZeRO stages 0-3, tp=2.

``fzero.perf_model.step_time`` predicts; this script measures and prints both. Each world
size is launched under torchrun (gloo, one thread per rank), ``--rounds`` times with the
world sizes' order rotated, so that load that drifts hits all alike, and the machine is
calibrated (``fzero estimate --calibrate``, :mod:`fzero.perf_calibrate`: matmuls, attention,
elementwise ops, a tiny fzero step, gloo between 2 ranks) just before each launch, whose
steps are predicted on that calibration. A launch builds every case of its
world size and runs them in paired rounds (benchmarks/_common.py: one step of each per round,
the order rotated, each after a barrier, a step's time the slowest rank's):

* ``zeroS``: ``fzero.compile(train_step, Mesh(dp=-1), zero=S)``, S = 0..3;
* ``tp2`` (2 and 4 ranks): ``fzero.compile(..., Mesh(dp=-1, tp=2), tp=tp_plans.gpt(model))``,
  ZeRO stage 0 over the dp that is left.

The model is examples/gpt.py's GPT, fp32, AdamW, fixed global batch (``--batch`` sequences of
``--seq`` tokens, split over dp). The prediction uses ``fzero.perf_model.gpt_workload`` of the
model's shape with its counted parameters and leaves, the calibrated machine, and the same
layout; nothing measured in the launches goes into it. Measured: the median over every timed
round of every launch. Ratio: measured / predicted; the target is every case in 0.85-1.15.

Why a calibration per launch: on these shared cores the machine's speed moves by more than the
model's error from one minute to the next (the same block pass took 52.9-59.8 ms in three
calibrations back to back, so the achieved matmul rate read 114-128 GFLOP/s; three runs
calibrated once read 13, 14 and 5 of 14 cases within 15% as that rate came out 137, 124 and
147). A case's prediction is the median of its launches' predictions, as its measurement is
the median of their rounds; ``--machine PATH`` predicts every launch on one machine instead.

Run::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/perf_model.py --rounds 2 --steps 6

``--project`` prints instead the model's projections for GPT-3's 1.3B, 6.7B and 13B shapes at 8
to 1024 GPUs on the ``h100`` preset (:data:`PROJECTED`): no measurement.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, ".."))

SCRIPT = "benchmarks/perf_model.py"
WORLDS = (1, 2, 4)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="launches per world size (order rotated)")
    p.add_argument("--steps", type=int, default=6, help="timed rounds per launch")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds per launch")
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--worlds", default="1,2,4", help="world sizes to run")
    p.add_argument("--machine", metavar="PATH",
                   help="a calibrated machine JSON for every launch (default: a calibration before each launch)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--project", action="store_true",
                   help="print the projections for GPT-3 1.3B/6.7B/13B on the h100 preset instead (no measuring)")
    p.add_argument("--rank-out", help=argparse.SUPPRESS)  # set by the driver for a launch
    return p.parse_args(argv)


def cases(world: int) -> list[str]:
    return [f"zero{s}" for s in range(4)] + (["tp2"] if world % 2 == 0 else [])


# --------------------------------------------------------------------------- one launch (a rank)


def launch_main(args) -> None:
    import torch
    import torch.distributed as dist

    import fzero
    from _common import fzero_contestant, loadavg, paired_rounds
    from fzero.transforms.tensor_parallel import plans
    from gpt import GPT, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # also in a world of one: the rounds' barriers need a group
    world, rank = dist.get_world_size(), dist.get_rank()
    load_start = loadavg()
    cfg = GPTConfig(vocab_size=args.vocab_size, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                    n_embd=args.n_embd)
    torch.manual_seed(0)
    base = GPT(cfg)
    meshes = {"dp": fzero.Mesh(dp=-1)}
    steps, slices = {}, {}
    for name in cases(world):
        module = copy.deepcopy(base)
        if name == "tp2":
            mesh = meshes.setdefault("tp", fzero.Mesh(dp=-1, tp=2))
            step = fzero_contestant(module, mesh, lambda s, g: (), zero=0, tp=plans.gpt(module))
        else:
            mesh = meshes["dp"]
            step = fzero_contestant(module, mesh, lambda s, g: (), zero=int(name[-1]))
        steps[name] = (lambda st: lambda batch, probe: st(batch[id(st)], probe)["loss"])(step)
        slices[id(step)] = (mesh.size("dp"), mesh.coords["dp"])
    # One batch per round: the global batch drawn from one seed, each case's dp slice of it.
    g = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(args.warmup + args.steps):
        x = torch.randint(args.vocab_size, (args.batch, args.seq + 1), generator=g)
        per_case = {}
        for key, (dp, coord) in slices.items():
            n = args.batch // dp
            xs = x[coord * n:(coord + 1) * n]
            per_case[key] = {"x": xs[:, :-1].contiguous(), "y": xs[:, 1:].contiguous()}
        batches.append(per_case)
    times, _, _ = paired_rounds(steps, batches, args.warmup)
    every = [None] * world
    dist.all_gather_object(every, times)
    if rank == 0:
        slowest = {n: [max(r[n][i] for r in every) for i in range(len(times[n]))] for n in times}
        psi = sum(p.numel() for p in base.parameters())
        leaves = len(list(base.parameters()))
        with open(args.rank_out, "w") as f:
            json.dump({"world": world, "times": slowest, "psi": psi, "leaves": leaves, "load_start": load_start,
                       "load_end": loadavg()}, f)
    dist.barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- the driver


def layout_of(name: str, world: int):
    from fzero.perf_model import Layout

    if name == "tp2":
        return Layout(world_size=world, stage=0, tp=2)
    return Layout(world_size=world, stage=int(name[-1]))


def predict(name: str, world: int, args, psi: int, leaves: int, machine):
    from fzero.perf_model import Workload, gpt_workload, step_time

    w = gpt_workload(layers=args.n_layer, hidden=args.n_embd, seq=args.seq, vocab=args.vocab_size, params=psi)
    w = Workload(**{**w.__dict__, "leaves": leaves})
    return step_time(w, layout_of(name, world), machine, global_batch=args.batch)


# --------------------------------------------------------------------------- projections

# GPT-3 shapes (fzero.perf_model.GPT3), 2048 tokens, a global batch of 1024 sequences (2M
# tokens, GPT-3's batch for 6.7B-13B), micro-batches of 4 sequences per dp rank (8 under tp = 8).
PROJECTED = [("1.3B", 1, (1, 2, 3)), ("6.7B", 1, (1, 2, 3)), ("13B", 1, (2, 3)), ("13B", 8, (1, 2, 3))]


def project(machine_name: str = "h100") -> None:
    from fzero.memory import model_state_bytes
    from fzero.perf_model import GPT3, PRESETS, Layout, gpt_workload, step_time

    machine, batch, seq = PRESETS[machine_name], 1024, 2048
    print(f"| model | tp | GPUs | stage | micro-batches | step s | exposed comm s | tokens/s | MFU | model states GiB/rank |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, tp, stages in PROJECTED:
        shape = GPT3[name]
        w = gpt_workload(layers=shape["layers"], hidden=shape["hidden"], seq=seq)
        for n in (8, 64, 256, 1024):
            dp = n // tp
            k = max(1, batch // (dp * (8 if tp > 1 else 4)))
            for stage in stages:
                t = step_time(w, Layout(world_size=n, stage=stage, tp=tp, micro_batches=k, precision="bf16"),
                              machine, global_batch=batch)
                states = model_state_bytes(w.params, world_size=n, stage=stage, precision="bf16", tp=tp)["total"]
                print(f"| {name} ({w.params / 1e9:.2f}B) | {tp} | {n} | {stage} | {k} | {t.total:.3f} | "
                      f"{t.exposed_comm:.3f} | {t.tokens_per_s:,.0f} | {100 * t.mfu:.1f}% | {states / 2**30:.1f} |")


def median_machine(machines: list):
    """One :class:`fzero.perf_model.Machine` whose every number is the median of ``machines``'
    (nested: per precision, per collective kind, per link), its text fields the first's with
    the count said in ``source``."""
    from fzero.perf_model import Link

    def med(values):
        first = values[0]
        if isinstance(first, bool) or not isinstance(first, (int, float, dict, Link)):
            return first
        if isinstance(first, dict):
            return {k: med([v[k] for v in values]) for k in first}
        if isinstance(first, Link):
            return Link(**{k: med([getattr(v, k) for v in values]) for k in vars(first)})
        return statistics.median(values)

    fields = {k: med([vars(m)[k] for m in machines]) for k in vars(machines[0])}
    if len(machines) > 1:
        fields["source"] = f"the median of {len(machines)} calibrations, the first {machines[0].source}"
    return type(machines[0])(**fields)


def main(argv=None) -> None:
    args = parse(argv)
    if args.rank_out:
        return launch_main(args)
    if args.project:
        return project()
    from _common import cpu_model, loadavg
    from fzero.perf_model import load_machine

    worlds = tuple(int(w) for w in args.worlds.split(","))
    load0 = loadavg()
    launches = [w for r in range(args.rounds) for w in worlds[r % len(worlds):] + worlds[:r % len(worlds)]]
    fixed = load_machine(args.machine) if args.machine else None
    machines = []  # each launch's calibration

    measured, predicted = {}, {}
    meta = {}
    loads = []
    for world in launches:
        with tempfile.TemporaryDirectory() as d:  # the launch's calibration and its ranks' results
            if fixed is None:
                from fzero.perf_calibrate import calibrate

                machines.append(calibrate(os.path.join(d, "cpu-here.json")))
            machine = fixed or machines[-1]
            out = os.path.join(d, "r.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
                   os.path.abspath(__file__), "--rank-out", out, *(argv if argv is not None else sys.argv[1:])]
            subprocess.run(cmd, check=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
            with open(out) as f:
                res = json.load(f)
        loads.append((res["load_start"], res["load_end"]))
        meta = res
        for name, t in res["times"].items():
            measured.setdefault((world, name), []).extend(t)
            pred = predict(name, world, args, res["psi"], res["leaves"], machine)
            predicted.setdefault((world, name), []).append(pred)
    machine = fixed or median_machine(machines)  # printed: the run's typical machine
    rows = []
    for (world, name), t in sorted(measured.items()):
        preds = predicted[(world, name)]
        part = {k: statistics.median(getattr(p, k) for p in preds)
                for k in ("total", "compute", "exposed_comm", "comm", "optimizer", "host")}
        med = statistics.median(t)
        rows.append(dict(world=world, case=name, measured_s=med, predicted_s=part["total"], ratio=med / part["total"],
                         compute_s=part["compute"], exposed_comm_s=part["exposed_comm"], comm_s=part["comm"],
                         optimizer_s=part["optimizer"], host_s=part["host"],
                         predicted_by_launch_s=[p.total for p in preds], times_s=t))
    print(f"\n{SCRIPT}: GPT {args.n_layer} layers × {args.n_embd}, vocab {args.vocab_size}, Ψ = {meta['psi']:,}, "
          f"{meta['leaves']} leaves; global batch {args.batch} × {args.seq}, fp32 AdamW; {cpu_model()}; "
          f"load average {load0} at start, launches {loads}")
    if len(machines) > 1:
        print("calibrations, one before each launch (achieved fp32 matmul GFLOP/s, attention GFLOP/s, "
              "elementwise GB/s): "
              + ", ".join(f"{m.matmul_flops['fp32'] / 1e9:.1f} / {m.attention_flops.get('fp32', 0) / 1e9:.1f} / "
                          f"{m.elementwise_bandwidth / 1e9:.2f}" for m in machines)
              + "; each launch is predicted on its own, the machine line below is their median")
    attention = machine.attention_flops.get("fp32")
    print(f"machine: {machine.source}: matmul {machine.matmul_flops['fp32'] / 1e9:.1f} GFLOP/s, "
          + (f"attention {attention / 1e9:.1f} GFLOP/s, " if attention else "") + "elementwise "
          f"{machine.elementwise_bandwidth / 1e9:.2f} GB/s, optimizer {machine.optimizer_bandwidth / 1e9:.2f} GB/s, "
          f"gloo {machine.intra.bandwidth / 1e9:.2f} GB/s + {machine.intra.latency * 1e6:.0f} µs/step, overlap "
          f"{machine.overlap:.2f}, host {machine.step_overhead * 1e3:.2f} ms + {machine.leaf_overhead * 1e6:.0f} "
          f"µs/leaf, a dp step's reduction {machine.reduce_byte_overhead * 1e9:.3f} ns per gradient byte and tp "
          f"{machine.tp_overhead * 1e3:.2f} ms per all-reduce beyond their collectives\n")
    print("| ranks | case | predicted s (compute / exposed comm / optimizer / host) | measured s (median) | measured/predicted |")
    print("| ---: | --- | --- | ---: | ---: |")
    for r in rows:
        ok = "" if 0.85 <= r["ratio"] <= 1.15 else " **outside 15%**"
        print(f"| {r['world']} | {r['case']} | {r['predicted_s']:.3f} ({r['compute_s']:.3f} / {r['exposed_comm_s']:.3f} / "
              f"{r['optimizer_s']:.3f} / {r['host_s']:.3f}) | {r['measured_s']:.3f} | {r['ratio']:.3f}{ok} |")
    within = sum(0.85 <= r["ratio"] <= 1.15 for r in rows)
    print(f"\n{within} of {len(rows)} cases within 15%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "loads": loads, "machine": machine.__dict__ | {
                "intra": machine.intra.__dict__, "inter": machine.inter.__dict__}}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
