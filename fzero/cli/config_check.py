"""``fzero config check FILE``: what fzero will do with each key of a DeepSpeed config.

Every key gets one line: used (and for what), no effect in fzero (and why), off, not read
(a key DeepSpeed does not read either), or ``"auto"`` (filled from what, or when). Then
every problem, each by its path, all at once. Exit 0 when ``fzero.compile`` would take
the file, 1 when it would not, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

__all__ = ["add_parser", "run"]


def _value(text: str):
    """A command-line ``--auto`` value: JSON when it parses (``3e-4``, ``true``, ``[0.9,
    0.95]``), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _auto_arg(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. max_steps=1000), got {text!r}")
    return key, _value(value)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser, out=None) -> int:
    from fzero.config import Config, _load
    from fzero.config._values import WHERE

    out = out or sys.stdout
    try:
        d, source = _load.read(args.file)
    except (FileNotFoundError, ValueError, TypeError) as e:
        print(f"fzero config check: {e}", file=sys.stderr)
        return 1
    options = {"accumulate": args.accumulate} if args.accumulate else {}
    known = _load.Known(auto=dict(args.auto or ()), options=options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        verdicts, problems = _load.check(Config, d, args.world_size, source, known)
    width = max((len(path) for path, _, _ in verdicts), default=0)
    print(f"{source}: {len(verdicts)} keys, world size {args.world_size}", file=out)
    for path, verdict, detail in verdicts:
        print(f"  {path:<{width}}  {verdict:<9}  {detail}", file=out)
    if problems:
        print(f"{len(problems)} problem{'s' if len(problems) > 1 else ''}: fzero.compile would refuse this "
              "file", file=out)
        for _, message in problems:
            print(f"  {message}", file=out)
        return 1
    print(f"ok: {WHERE}.load and fzero.compile take this file", file=out)
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "config",
        help="check a DeepSpeed config: what fzero does with each key",
        description="fzero config check FILE: print what fzero does with each key of a DeepSpeed "
                    "JSON config (used, no effect, not read, \"auto\" filled from what) and every "
                    "problem at once. Exit 0 when fzero would take the file, 1 when not.",
        epilog="example: fzero config check ds_config.json --world-size 8 --auto max_steps=1000",
    )
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = sub.add_parser("check", help="what fzero does with each key of FILE",
                           description="Print what fzero does with each key of FILE and every problem.")
    check.add_argument("file", metavar="FILE", help="a DeepSpeed JSON config")
    check.add_argument("--world-size", "-N", type=int, default=1, metavar="N",
                       help="data-parallel ranks the batch sizes are resolved for (default 1)")
    check.add_argument("--accumulate", type=int, default=None, metavar="K",
                       help="fzero.compile's accumulate=, which fills an \"auto\" gradient_accumulation_steps")
    check.add_argument("--auto", type=_auto_arg, action="append", metavar="KEY=VALUE",
                       help="a value for \"auto\": a dotted config path or a Hugging Face argument name "
                            "(learning_rate, max_steps, per_device_train_batch_size, hidden_size, ...); "
                            "repeatable")
    p.set_defaults(func=run)
    return p
