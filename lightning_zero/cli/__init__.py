"""The ``lightning-zero`` command line.

Each subcommand lives in its own module of this package and exposes ``add_parser(subparsers)``, which registers
its arguments and sets ``func`` (called with the parsed namespace, returning an exit code). The console script
enters through the top-level module ``lightning_zero_cli``, which answers ``--help`` and ``--version`` from
:mod:`lightning_zero.cli.toplevel` without importing this package (and so torch), and hands each subcommand to
:func:`main`.
"""

from __future__ import annotations

import importlib
import sys
from typing import Optional, Sequence

from lightning_zero.cli.toplevel import SUBCOMMANDS, top_parser


def build_parser():
    """The full parser: the top level of :mod:`lightning_zero.cli.toplevel`, with every subcommand's arguments."""
    parser, subparsers = top_parser()
    for name in SUBCOMMANDS:
        module = importlib.import_module(f"lightning_zero.cli.{name}")
        module.add_parser(subparsers)
        # an error in the subcommand's arguments is reported with the subcommand's usage, not the top level's
        subparsers.choices[name].set_defaults(subcommand_parser=subparsers.choices[name])
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    if unknown:  # argparse's parse_args would report them with the top-level usage
        args.subcommand_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
