"""The ``lightning-zero`` command line.

Each subcommand lives in its own module of this package and exposes ``add_parser(subparsers)``, which registers
its arguments and sets ``func`` (called with the parsed namespace, returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

# Subcommand modules, imported lazily so that `lightning-zero --help` stays fast.
SUBCOMMANDS = ("estimate", "advise", "consolidate", "verify", "diagnose", "launch")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-zero", description="lightning-zero tools")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = importlib.import_module(f"lightning_zero.cli.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"lightning_zero.cli.{name}":
                raise
            continue  # that subcommand has not landed yet
        module.add_parser(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
