"""``fzero estimate``: per-rank memory of the model states for each ZeRO stage, on a world
of ``pp × dp × tp`` ranks.

The formula lives in :mod:`fzero.memory` so the library and its tests use the same one.
"""

from __future__ import annotations

import argparse
from decimal import Decimal, InvalidOperation

from fzero.transforms._checks import default_bucket_bytes
from fzero.memory import (OPTIMIZER_STATES, PRECISIONS, REDUCE_BUFFERS, coefficients, format_bytes,
                          model_state_bytes, rank_share, reduce_buffer_bytes)

__all__ = ["add_parser", "parse_count", "format_bytes", "render", "run"]

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


def _formula(a: int, b: int, psi: str = "Ψ") -> str:
    terms = ([f"{a}{psi}"] if a else []) + ([f"{b}{psi}/N"] if b else [])
    return " + ".join(terms) or "0"


def render(num_params: int, *, world_size: int, stages=(0, 1, 2, 3), precision: str = "fp32",
           optimizer: str = "adam", raw_bytes: bool = False, bucket_bytes: int | None = None,
           tp: int = 1, pp: int = 1) -> str:
    """The table ``fzero estimate`` prints; ``tp``/``pp`` as in :func:`fzero.memory.model_state_bytes`."""
    fmt = (lambda n: f"{n:,}") if raw_bytes else format_bytes
    local, dp = rank_share(num_params, world_size=world_size, tp=tp, pp=pp)
    split = tp * pp > 1  # the formulas are then in Ψ' = Ψ/(tp·pp)
    n_states = OPTIMIZER_STATES[optimizer]
    if precision == "fp32":
        prec = "fp32 (4-byte parameters and gradients)"
    else:
        prec = f"{precision} mixed (2-byte parameters and gradients, fp32 master weights)"
    ranks = (f"{world_size} ranks = pp {pp} × dp {dp} × tp {tp}" if split
             else f"N = {world_size} rank{'s' if world_size != 1 else ''}")
    lines = [
        f"fzero estimate: per-rank memory of the model states for Ψ = {_count(num_params)} parameters "
        f"({num_params:,}), {ranks}",
        *([f"a rank holds Ψ' = Ψ/(tp·pp) = {_count(local)} parameters ({local:,}), partitioned by ZeRO "
           f"over N = dp = {dp}"] if split else []),
        f"precision: {prec}; optimizer: {optimizer} "
        f"({n_states} fp32 state{'s' if n_states != 1 else ''} per parameter)",
        "",
    ]
    header = ["stage", "params", "grads", "optimizer", "model states", "buffers", "total", "formula"]
    rows = []
    for stage in stages:
        b = model_state_bytes(num_params, world_size=world_size, stage=stage, precision=precision,
                              optimizer=optimizer, tp=tp, pp=pp)
        buf = reduce_buffer_bytes(num_params, world_size=world_size, stage=stage, precision=precision,
                                  bucket_bytes=bucket_bytes, tp=tp, pp=pp)
        rows.append([str(stage), fmt(b["params"]), fmt(b["grads"]), fmt(b["optimizer"]), fmt(b["total"]),
                     fmt(buf), fmt(b["total"] + buf),
                     _formula(*coefficients(stage=stage, precision=precision, optimizer=optimizer),
                              "Ψ'" if split else "Ψ")])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        lines.append("  ".join(c.rjust(w) if i < len(r) - 1 else c for i, (c, w) in enumerate(zip(r, widths))))
    shown_bucket = bucket_bytes if bucket_bytes is not None else \
        default_bucket_bytes(PRECISIONS[precision] * local)
    default_note = "" if bucket_bytes is not None else ", by default 1/32 of them (at most 25 MiB, at least 64 KiB)"
    lines += [
        "",
        "model states: the ZeRO paper's formula (column 'formula'). buffers: what fzero holds beside",
        f"them at the step's peak: gradient reduce buffers in fp32 (stages 2-3: up to {REDUCE_BUFFERS} buckets of",
        f"{format_bytes(shown_bucket)} of parameters{default_note}; a unit at stage 3) and at",
        "stage 3 two gathered units. Not counted: activations, the CUDA context and allocator",
        "fragmentation. Partitioned buffers are padded to a multiple of N. 1 GiB = 2^30 bytes.",
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
    p.add_argument("--params", required=True, type=_count_arg, metavar="COUNT",
                   help="number of parameters, e.g. 350M, 1.3B, 7e9")
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
    p.add_argument("--optimizer", choices=tuple(OPTIMIZER_STATES), default="adam",
                   help="decides the fp32 states per parameter: adam/adamw/lamb 2, lion/sgd-momentum 1, "
                        "sgd 0 (default adam)")
    p.add_argument("--bucket-bytes", type=_positive_int, default=None, metavar="BYTES",
                   help="shard_state's bucket_bytes (default shard_state's: 1/32 of the parameters' bytes, "
                        "at most 25 MiB): sizes the reduce buffers of stages 2-3")
    p.add_argument("--bytes", action="store_true", dest="raw_bytes", help="print exact bytes instead of GiB")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    world, tp, pp = args.world_size, args.tp, args.pp
    if world % (tp * pp):  # a world smaller than tp·pp too: dp would be 0
        what = "smaller than" if world < tp * pp else "not a multiple of"
        parser.error(f"--world-size {world} is {what} --tp {tp} × --pp {pp} = {tp * pp}: the world is "
                     f"pp × dp × tp ranks, so dp = world/(tp·pp) must be a whole number, at least 1")
    stages = (0, 1, 2, 3) if args.stage is None else (args.stage,)
    print(render(args.params, world_size=world, stages=stages, precision=args.precision,
                 optimizer=args.optimizer, raw_bytes=args.raw_bytes, bucket_bytes=args.bucket_bytes,
                 tp=tp, pp=pp))
    return 0
