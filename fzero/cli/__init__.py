"""fzero's console command: ``fzero launch``, ``fzero estimate``, ``fzero autotune``, ``fzero checkpoint``.

Each subcommand lives in its own module with an ``add_parser(subparsers)`` and a
``run(args, parser) -> exit code``; :mod:`fzero.cli.main` wires them together.
"""

from fzero.cli.main import main

__all__ = ["main"]
