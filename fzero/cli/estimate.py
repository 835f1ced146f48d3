"""``fzero estimate``: per-rank memory of the model states for each ZeRO stage, on a world
of ``pp × dp × tp`` ranks; with ``--time``, the modelled step time too.

The formulas live in :mod:`fzero.memory` and :mod:`fzero.perf_model` so the library and its
tests use the same ones; ``--calibrate`` measures this machine (:mod:`fzero.perf_calibrate`).
"""

from __future__ import annotations

import argparse
import os
from decimal import Decimal, InvalidOperation

from fzero.transforms._checks import default_bucket_bytes
from fzero.memory import (OPTIMIZER_STATES, PRECISIONS, REDUCE_BUFFERS, coefficients, format_bytes,
                          model_state_bytes, rank_share, reduce_buffer_bytes)

__all__ = ["add_parser", "parse_count", "format_bytes", "render", "render_time", "run", "CPU_HERE"]

# Where --calibrate writes this machine's description by default, and --machine cpu-here reads it.
CPU_HERE = os.path.join(os.path.expanduser("~"), ".cache", "fzero", "cpu-here.json")

_SUFFIX = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}


def parse_count(text: str) -> int:
    """A parameter count such as ``125M``, ``1.3B``, ``7e9`` or ``350000`` as an int.

    Suffixes (any case): K = 10^3, M = 10^6, B or G = 10^9, T = 10^12.

    Raises:
        ValueError: not a number with an optional suffix, not whole, or not positive.

    Example:
        >>> parse_count("1.3B"), parse_count("125m"), parse_count("1_000")
        (1300000000, 125000000, 1000)
    """
    s = text.strip().replace("_", "").replace(",", "")
    suffix = s[-1:].upper() if s[-1:].isalpha() and s[-1:].upper() in _SUFFIX else ""
    number = s[: len(s) - len(suffix)]
    try:
        value = Decimal(number) * _SUFFIX[suffix]
    except InvalidOperation:
        raise ValueError(
            f"{text!r} is not a parameter count (expected a number with an optional "
            f"K, M, B or T suffix, e.g. 350M or 1.3B)"
        ) from None
    if not value.is_finite() or value != value.to_integral_value():
        raise ValueError(f"{text!r} is not a whole number of parameters")
    if value < 1:
        raise ValueError(f"{text!r}: the parameter count must be positive")
    return int(value)


def _count(n: int) -> str:
    for suffix, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.4g}{suffix}"
    return str(n)


def _formula(a: float, b: float, psi: str = "Ψ") -> str:
    terms = ([f"{a:.4g}{psi}"] if a else []) + ([f"{b:.4g}{psi}/N"] if b else [])
    return " + ".join(terms) or "0"


def render(num_params: int, *, world_size: int, stages=(0, 1, 2, 3), precision: str = "fp32",
           optimizer: str = "adam", raw_bytes: bool = False, bucket_bytes: int | None = None,
           tp: int = 1, pp: int = 1, master_weights: str = "fp32", optimizer_states: str = "fp32",
           rounding: str = "nearest", optimizer_bytes: float | None = None, block_params: int | None = None,
           shape_note: str = "") -> str:
    """The table ``fzero estimate`` prints; ``tp``/``pp``, ``master_weights``,
    ``optimizer_states``, ``rounding`` and ``optimizer_bytes`` as in
    :func:`fzero.memory.model_state_bytes`; ``block_params`` (a transformer block's
    parameters, ``shape_note`` saying whence) as in :func:`fzero.memory.reduce_buffer_bytes`."""
    fmt = (lambda n: f"{n:,}") if raw_bytes else format_bytes
    local, dp = rank_share(num_params, world_size=world_size, tp=tp, pp=pp)
    split = tp * pp > 1  # the formulas are then in Ψ' = Ψ/(tp·pp)
    if optimizer_bytes is None:
        n_states = OPTIMIZER_STATES[optimizer]
        opt_line = (f"optimizer: {optimizer} ({n_states} {optimizer_states} state{'s' if n_states != 1 else ''} "
                    "per parameter)")
    else:
        opt_line = f"optimizer: {optimizer_bytes:.4g} bytes of state per parameter (--optimizer-bytes)"
    if precision == "fp32":
        prec = "fp32 (4-byte parameters and gradients)"
    else:
        prec = f"{precision} mixed (2-byte parameters and gradients, {master_weights} master weights)"
    ranks = (f"{world_size} ranks = pp {pp} × dp {dp} × tp {tp}" if split
             else f"N = {world_size} rank{'s' if world_size != 1 else ''}")
    lines = [
        f"fzero estimate: per-rank memory of the model states for Ψ = {_count(num_params)} parameters "
        f"({num_params:,}), {ranks}",
        *([f"a rank holds Ψ' = Ψ/(tp·pp) = {_count(local)} parameters ({local:,}), partitioned by ZeRO "
           f"over N = dp = {dp}"] if split else []),
        f"precision: {prec}; {opt_line}"
        f"{', and a bf16 Kahan compensation per parameter' if rounding == 'kahan' else ''}",
        "",
    ]
    header = ["stage", "params", "grads", "optimizer", "model states", "buffers", "total", "formula"]
    rows = []
    for stage in stages:
        kept = {"master_weights": master_weights, "optimizer_states": optimizer_states, "rounding": rounding}
        b = model_state_bytes(num_params, world_size=world_size, stage=stage, precision=precision,
                              optimizer=optimizer, optimizer_bytes=optimizer_bytes, tp=tp, pp=pp, **kept)
        buf = reduce_buffer_bytes(num_params, world_size=world_size, stage=stage, precision=precision,
                                  bucket_bytes=bucket_bytes, tp=tp, pp=pp, block_params=block_params)
        rows.append([str(stage), fmt(b["params"]), fmt(b["grads"]), fmt(b["optimizer"]), fmt(b["total"]),
                     fmt(buf), fmt(b["total"] + buf),
                     _formula(*coefficients(stage=stage, precision=precision, optimizer=optimizer,
                                            optimizer_bytes=optimizer_bytes, **kept),
                              "Ψ'" if split else "Ψ")])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        lines.append("  ".join(c.rjust(w) if i < len(r) - 1 else c for i, (c, w) in enumerate(zip(r, widths))))
    shown_bucket = bucket_bytes if bucket_bytes is not None else \
        default_bucket_bytes(PRECISIONS[precision] * local)
    default_note = "" if bucket_bytes is not None else ", by default 25 MiB or the whole model"
    runs = ", in runs within 25 MiB)"
    if bucket_bytes is not None:
        unit_note = "a unit at stage 3)"
    elif block_params is not None:
        unit_note = f"at stage 3 a unit: blocks of {_count(block_params)} parameters{shape_note}{runs}"
    else:
        unit_note = f"at stage 3 a unit: blocks of 1/32 of the model, or as --layers and --hidden say{runs}"
    lines += [
        "",
        "model states: the ZeRO paper's formula (column 'formula'). buffers: what fzero holds beside",
        f"them at the step's peak: gradient reduce buffers in fp32 (stages 2-3: up to {REDUCE_BUFFERS} buckets of",
        f"{format_bytes(shown_bucket)} of parameters{default_note};",
        unit_note,
        "and at stage 3 two gathered units (a model within 25 MiB is gathered whole). Not counted:",
        "activations, the CUDA context and allocator fragmentation. Partitioned buffers are padded",
        "to a multiple of N. 1 GiB = 2^30 bytes.",
    ]
    if split:
        lines += [
            "Ψ' assumes tp and pp split the weights evenly: Megatron slices every weight matrix over tp,",
            "a pipeline stage holds 1/pp of the layers; small replicated tensors (LayerNorm) are ignored.",
        ]
    return "\n".join(lines)


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {n}")
    return n


def _bytes_per_param(text: str) -> float:
    try:
        k = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of bytes per parameter") from None
    if not 0 <= k < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return k


def _count_arg(text: str) -> int:
    try:
        return parse_count(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "estimate",
        help="per-rank memory of parameters, gradients and optimizer state per ZeRO stage",
        description="Per-rank bytes of parameters, gradients and optimizer state for a parameter "
                    "count, world size, ZeRO stage and precision, by the ZeRO paper's formula. "
                    "Activations are not counted.",
        epilog="examples: fzero estimate --params 1.3B --world-size 8 --stage 2 --precision bf16; "
               "fzero estimate --params 13B --world-size 64 --tp 4 --pp 2 --precision bf16",
    )
    p.add_argument("--params", type=_count_arg, metavar="COUNT",
                   help="number of parameters, e.g. 350M, 1.3B, 7e9 (required but with --calibrate)")
    p.add_argument("--world-size", "-N", type=_positive_int, default=1, metavar="N",
                   help="ranks in all, pp × dp × tp; with --tp and --pp 1, the data-parallel ranks the "
                        "states are partitioned over (default 1)")
    p.add_argument("--tp", type=_positive_int, default=1, metavar="T",
                   help="tensor-parallel degree: a rank holds 1/T of every weight matrix (default 1)")
    p.add_argument("--pp", type=_positive_int, default=1, metavar="P",
                   help="pipeline-parallel degree: a rank holds 1/P of the layers (default 1); "
                        "ZeRO partitions over dp = N/(T·P)")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=None,
                   help="ZeRO stage (default: show all four)")
    p.add_argument("--precision", choices=tuple(PRECISIONS), default="fp32",
                   help="fp32, or bf16/fp16 mixed precision with fp32 master weights (default fp32)")
    p.add_argument("--master-weights", choices=("fp32", "bf16"), default="fp32",
                   help="with --precision bf16: keep the master weights in bf16 (DeepSpeed's "
                        "bf16_master_weights_and_grads; default fp32)")
    p.add_argument("--optimizer-states", choices=("fp32", "bf16"), default="fp32",
                   help="with --master-weights bf16: keep the optimizer state in bf16 (DeepSpeed's "
                        "bf16_optimizer_states; default fp32)")
    p.add_argument("--rounding", choices=("nearest", "stochastic", "kahan"), default="nearest",
                   help="with --master-weights bf16: how updates round into the bf16 masters; kahan keeps a "
                        "2-byte compensation per parameter (default nearest)")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZER_STATES), default="adam",
                   help="decides the fp32 states per parameter: adam/adamw/lamb/adadelta/rprop 2, "
                        "lion/sgd-momentum/muon/adagrad/rmsprop 1, sgd 0 (default adam)")
    p.add_argument("--optimizer-bytes", type=_bytes_per_param, default=None, metavar="K",
                   help="instead of --optimizer: the optimizer's bytes of state per parameter, as "
                        "fzero.memory.optimizer_state_bytes(tx, params) / params measures it for any optimizer"),
    p.add_argument("--bucket-bytes", type=_positive_int, default=None, metavar="BYTES",
                   help="shard_state's bucket_bytes (default shard_state's: 25 MiB or the whole model; "
                        "at stage 3 its units, runs of blocks within 25 MiB): sizes the reduce buffers "
                        "of stages 2-3 and stage 3's gathered units")
    p.add_argument("--bytes", action="store_true", dest="raw_bytes", help="print exact bytes instead of GiB")
    t = p.add_argument_group("step time (--time): fzero.perf_model, a GPT of the given shape")
    t.add_argument("--time", action="store_true",
                   help="also model the step time: compute, exposed communication, optimizer, host; tokens/s, MFU")
    t.add_argument("--machine", default="h100", metavar="NAME|PATH",
                   help="h100 or h200 (datasheet figures), cpu-here (what --calibrate measured), or a machine "
                        "JSON (default h100)")
    t.add_argument("--layers", type=_positive_int, metavar="L",
                   help="transformer blocks (default: the GPT-3 shape nearest --params); with --hidden it "
                        "also sizes stage 3's units in the memory table")
    t.add_argument("--hidden", type=_positive_int, metavar="D", help="model width (default: as --layers)")
    t.add_argument("--vocab", type=_positive_int, default=50257, metavar="V", help="vocabulary (default 50257)")
    t.add_argument("--seq", type=_positive_int, default=2048, metavar="S", help="tokens per sequence (default 2048)")
    t.add_argument("--batch", type=_positive_int, metavar="B",
                   help="global batch in sequences per update (default: one per dp rank per micro-batch)")
    t.add_argument("--tokens-per-rank", type=_positive_int, metavar="N",
                   help="instead of --batch: tokens each dp rank sees per update")
    t.add_argument("--micro-batches", type=_positive_int, default=1, metavar="K",
                   help="micro-batches per update: gradient accumulation, a pipeline's micro-batches (default 1)")
    t.add_argument("--calibrate", nargs="?", const=CPU_HERE, metavar="PATH",
                   help=f"measure this machine (matmuls, elementwise ops, fzero steps, gloo between 2 ranks) and "
                        f"write it to PATH (default {CPU_HERE}, what --machine cpu-here reads); then exit")
    p.set_defaults(func=run)
    return p


def machine_named(name: str):
    """A :class:`fzero.perf_model.Machine`: a preset's name, ``cpu-here`` or a JSON path.

    Raises:
        ValueError: neither a preset nor a readable machine file.
    """
    from fzero.perf_model import PRESETS, load_machine

    if name in PRESETS:
        return PRESETS[name]
    path = CPU_HERE if name == "cpu-here" else name
    if not os.path.exists(path):
        hint = " (run fzero estimate --calibrate first)" if name == "cpu-here" else ""
        raise ValueError(f"--machine {name}: no such preset ({', '.join(PRESETS)}, cpu-here) nor file {path}{hint}")
    return load_machine(path)


def nearest_gpt3(num_params: int) -> tuple[str, dict]:
    """The GPT-3 shape (Brown et al. 2020, table 2.1) whose size is nearest ``num_params``.

    Example:
        >>> nearest_gpt3(1_300_000_000)
        ('1.3B', {'layers': 24, 'hidden': 2048, 'heads': 16})
    """
    from fzero.perf_model import GPT3

    name = min(GPT3, key=lambda k: abs(parse_count(k) - num_params) / parse_count(k))
    return name, GPT3[name]


def render_time(num_params: int, *, world_size: int, stages, precision: str, machine, layers: int, hidden: int,
                seq: int, vocab: int, global_batch: int, micro_batches: int = 1, tp: int = 1, pp: int = 1,
                bucket_bytes: int | None = None, shape_note: str = "") -> str:
    """The step-time table ``fzero estimate --time`` prints (:func:`fzero.perf_model.step_time`)."""
    from fzero.perf_model import Layout, gpt_workload, step_time

    w = gpt_workload(layers=layers, hidden=hidden, seq=seq, vocab=vocab, params=num_params)
    dp = world_size // (tp * pp)
    lines = [
        "",
        f"step time on {machine.name} ({machine.source})",
        f"a GPT of {layers} layers × {hidden} wide{shape_note}, Ψ = {_count(num_params)}, seq {seq}, "
        f"vocabulary {vocab}; global batch {global_batch} sequences = {global_batch * seq:,} tokens per update, "
        f"{micro_batches} micro-batch{'es' if micro_batches != 1 else ''}; "
        f"{w.matmul_flops_per_token / 1e9:.3g} GFLOP per token (6Ψ + 12·L·s·d)",
        "",
    ]
    header = ["stage", "compute s", "bubble s", "comm s", "exposed s", "optimizer s", "host s", "step s",
              "tokens/s", "MFU", "dp sent/rank"]
    rows = []
    for stage in stages:
        t = step_time(w, Layout(world_size=world_size, stage=stage, tp=tp, pp=pp, micro_batches=micro_batches,
                                precision=precision, bucket_bytes=bucket_bytes), machine, global_batch=global_batch)
        rows.append([str(stage), *(f"{v:.4g}" for v in (t.compute, t.bubble, t.comm, t.exposed_comm, t.optimizer,
                                                         t.host, t.total)),
                     f"{t.tokens_per_s:,.0f}", f"{100 * t.mfu:.1f}%", format_bytes(int(t.sent_bytes["dp"]))])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        lines.append("  ".join(c.rjust(w_) for c, w_ in zip(r, widths)))
    lines += [
        "",
        f"compute: matmul FLOPs / achieved FLOP/s + elementwise bytes / bandwidth, per rank (dp {dp}, tp {tp}, pp {pp});",
        "bubble: pipeline's (p-1)/m of it; comm: every collective's ring time; exposed: what backward (and",
        "stage 3's prefetch) does not hide, tp's and pp's all of theirs; MFU against the machine's peak.",
        "A model, not a measurement: docs/performance.md gives its error against measured steps.",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.calibrate is not None:
        from fzero.perf_calibrate import calibrate

        os.makedirs(os.path.dirname(os.path.abspath(args.calibrate)), exist_ok=True)
        m = calibrate(args.calibrate)
        print(f"fzero estimate --calibrate: wrote {args.calibrate}")
        print(f"matmul fp32 {m.matmul_flops['fp32'] / 1e9:.1f} GFLOP/s, bf16 {m.matmul_flops['bf16'] / 1e9:.2f}; "
              f"elementwise {m.elementwise_bandwidth / 1e9:.2f} GB/s; optimizer {m.optimizer_bandwidth / 1e9:.2f} GB/s; "
              f"gloo {m.intra.bandwidth / 1e9:.2f} GB/s, {m.intra.latency * 1e6:.0f} µs per ring step; "
              f"overlap {m.overlap:.2f}; host {m.step_overhead * 1e3:.2f} ms/step + "
              f"{m.leaf_overhead * 1e6:.1f} µs/leaf; {m.cores:.2f} cores free for 2 ranks")
        return 0
    if args.params is None:
        parser.error("the following arguments are required: --params (unless --calibrate)")
    world, tp, pp = args.world_size, args.tp, args.pp
    if world % (tp * pp):  # a world smaller than tp·pp too: dp would be 0
        what = "smaller than" if world < tp * pp else "not a multiple of"
        parser.error(f"--world-size {world} is {what} --tp {tp} × --pp {pp} = {tp * pp}: the world is "
                     f"pp × dp × tp ranks, so dp = world/(tp·pp) must be a whole number, at least 1")
    if args.master_weights == "bf16" and args.precision != "bf16":
        parser.error(f"--master-weights bf16 needs --precision bf16, got --precision {args.precision}")
    if args.optimizer_states == "bf16" and args.master_weights != "bf16":
        parser.error("--optimizer-states bf16 needs --master-weights bf16 (as DeepSpeed's bf16_optimizer_states "
                     "needs bf16_master_weights_and_grads)")
    if args.rounding != "nearest" and args.master_weights != "bf16":
        parser.error(f"--rounding {args.rounding} needs --master-weights bf16")
    stages = (0, 1, 2, 3) if args.stage is None else (args.stage,)
    note, block = "", None
    layers, hidden = args.layers, args.hidden
    if args.time or layers is not None or hidden is not None:  # a GPT's shape: it sizes stage 3's units
        if layers is None or hidden is None:
            name, shape = nearest_gpt3(args.params)
            layers, hidden = layers or shape["layers"], hidden or shape["hidden"]
            note = f" (GPT-3 {name}'s shape)"
        from fzero.perf_model import gpt_workload

        block = gpt_workload(layers=layers, hidden=hidden, seq=args.seq, vocab=args.vocab).unit_params // layers
    print(render(args.params, world_size=world, stages=stages, precision=args.precision,
                 optimizer=args.optimizer, raw_bytes=args.raw_bytes, bucket_bytes=args.bucket_bytes,
                 tp=tp, pp=pp, master_weights=args.master_weights, optimizer_states=args.optimizer_states,
                 rounding=args.rounding, optimizer_bytes=args.optimizer_bytes, block_params=block,
                 shape_note=note))
    if not args.time:
        return 0
    try:
        machine = machine_named(args.machine)
    except ValueError as e:
        parser.error(str(e))
    dp, k = world // (tp * pp), args.micro_batches
    if args.batch is not None and args.tokens_per_rank is not None:
        parser.error("--batch and --tokens-per-rank: give one of them")
    if args.tokens_per_rank is not None:
        if args.tokens_per_rank % args.seq:
            parser.error(f"--tokens-per-rank {args.tokens_per_rank} is not a multiple of --seq {args.seq}")
        batch = args.tokens_per_rank // args.seq * dp
    else:
        batch = args.batch if args.batch is not None else dp * k
    if batch % (dp * k):
        parser.error(f"the global batch of {batch} sequences does not split into dp {dp} × --micro-batches {k}")
    print(render_time(args.params, world_size=world, stages=stages, precision=args.precision, machine=machine,
                      layers=layers, hidden=hidden, seq=args.seq, vocab=args.vocab, global_batch=batch,
                      micro_batches=k, tp=tp, pp=pp, bucket_bytes=args.bucket_bytes, shape_note=note))
    return 0
