"""``fzero``: the console entry point (``[project.scripts] fzero = "fzero.cli.main:main"``).

Subcommands::

    fzero launch --nproc 4 train.py [script args]     # torchrun underneath
    fzero estimate --params 1.3B --world-size 8       # per-rank memory per ZeRO stage
    fzero autotune --nproc 2 train.py --config ds.json # the fastest config that fits
    fzero checkpoint inspect|verify|export PATH [OUT] # over saved checkpoints
    fzero config check ds_config.json                  # what fzero does with each key
"""

from __future__ import annotations

import argparse
import sys

from fzero.cli import autotune, config_check, estimate, launch

__all__ = ["build_parser", "main"]


def _checkpoint(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from fzero.checkpoint.cli import run

    return run(args, parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fzero",
        description="fzero: JAX-style functional training on torch.func.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (launch, estimate, autotune, config_check):
        p = module.add_parser(sub)
        p.set_defaults(_parser=p)  # so errors are reported under "fzero SUBCOMMAND"
    from fzero.checkpoint.cli import add_arguments

    ck = sub.add_parser("checkpoint", help="inspect, verify or export a saved checkpoint",
                        description="Inspect, verify or export a saved checkpoint. verify exits 0 only "
                                    "on an intact checkpoint.")
    add_arguments(ck)
    ck.set_defaults(func=_checkpoint, _parser=ck)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``fzero`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code.

    Usage errors exit with code 2 and a message ``fzero SUBCOMMAND: error: ...``.
    """
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return args.func(args, args._parser)


if __name__ == "__main__":
    sys.exit(main())
