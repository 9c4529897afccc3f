"""The ``headwise`` command line: it only formats what the library computes.

Each subcommand lives in its own module exposing ``add_parser(subparsers)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

__all__ = ["main", "CliError"]

# Subcommand modules, in the order `headwise --help` lists them.
SUBCOMMANDS = ["tour"]
SUBCOMMANDS += ["explain", "compare", "heads"]
SUBCOMMANDS += ["check"]


class CliError(Exception):
    """A user error: printed as one line on stderr, exit code 2, no traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="headwise", description="Multi-head attention, one head at a time.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in SUBCOMMANDS:
        importlib.import_module(f".{name}", __name__).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 1 a check failed, 2 bad input)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad input, 0 on --help
        return int(exc.code or 0)
    try:
        return int(args.run(args) or 0)
    except (CliError, ValueError, TypeError, KeyError, IndexError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"headwise {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
