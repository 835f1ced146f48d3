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
import importlib
import sys

__all__ = ["build_parser", "main"]

# The subcommands' modules, imported when their parser is built: ``fzero launch`` builds only
# its own, so the launcher never imports torch (``fzero/__init__.py`` is lazy).
SUBCOMMANDS = {"launch": "fzero.cli.launch", "estimate": "fzero.cli.estimate", "autotune": "fzero.cli.autotune",
               "config": "fzero.cli.config_check"}


def _checkpoint(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from fzero.checkpoint.cli import run

    return run(args, parser)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or of ``command``'s alone (``main`` asks for the one
    named first on the command line, so that running it imports only its module)."""
    parser = argparse.ArgumentParser(
        prog="fzero",
        description="fzero: JAX-style functional training on torch.func.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        if command in (None, name):
            p = importlib.import_module(module).add_parser(sub)
            p.set_defaults(_parser=p)  # so errors are reported under "fzero SUBCOMMAND"
    if command not in (None, "checkpoint"):
        return parser
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
    argv = sys.argv[1:] if argv is None else argv
    first = argv[0] if argv else None
    parser = build_parser(first if first in SUBCOMMANDS or first == "checkpoint" else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    return args.func(args, args._parser)


if __name__ == "__main__":
    sys.exit(main())
