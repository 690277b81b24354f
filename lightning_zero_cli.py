"""The ``lightning-zero`` console script's entry point, kept outside the ``lightning_zero`` package on purpose.

Importing anything under ``lightning_zero`` first runs the package's ``__init__``, which imports torch and Lightning
to register the strategy names with the Trainer and Fabric: seconds, where ``lightning-zero``, ``--help`` and
``--version`` need none of it. This module answers those from the table below and hands every subcommand to
:func:`lightning_zero.cli.main`, which builds the full parser (the same top level, and each subcommand's own).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

__version__ = "0.1.0"  # lightning_zero.__version__ and pyproject.toml's version say the same (a test checks)

#: Each subcommand and its one-line help, in the order ``--help`` lists them (the modules of ``lightning_zero.cli``
#: register the same lines; a test compares the two help texts).
SUBCOMMANDS = {
    "estimate": "estimate per-rank model-state memory for ZeRO stages 0-3",
    "advise": "predict (and optionally measure) which ZeRO configuration fits best",
    "consolidate": "merge a sharded lightning-zero or DeepSpeed ZeRO checkpoint into one file (streaming)",
    "verify": "check a sharded checkpoint's files against the sizes and CRC-32s recorded in its zero.json",
    "diagnose": "audit the distributed environment and measure collective bandwidth",
    "launch": "start a training script with torchrun on one or many nodes",
}


class EitherSpellingParser(argparse.ArgumentParser):
    """A subcommand's parser: every ``--long-option`` is also taken as ``--long_option`` and the other way round, as
    DeepSpeed's launcher and scripts spell them with underscores and torchrun with dashes."""

    def add_argument(self, *names, **kwargs):
        spellings = list(names)
        for name in names:
            if name.startswith("--"):
                for other in ("--" + name[2:].replace("-", "_"), "--" + name[2:].replace("_", "-")):
                    if other not in spellings:
                        spellings.append(other)
        return super().add_argument(*spellings, **kwargs)


def top_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The top-level parser and its (empty) subcommand registry."""
    parser = argparse.ArgumentParser(prog="lightning-zero", description="lightning-zero tools")
    parser.add_argument("--version", action="version", version=f"lightning-zero {__version__}")
    return parser, parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=EitherSpellingParser)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        from lightning_zero.cli import main as run_subcommand

        return run_subcommand(argv)
    parser, subparsers = top_parser()
    for name, help_line in SUBCOMMANDS.items():
        subparsers.add_parser(name, help=help_line)
    parser.parse_args(argv)  # --help, --version and an unknown COMMAND exit here
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
