"""The ``lightning-zero`` command line's top level: the subcommands' one-line helps, ``--version`` and the parser
class of every subcommand. Standard library only: the console script's entry module ``lightning_zero_cli`` loads
this file without running the package's ``__init__`` (which imports torch and Lightning), so ``--help`` and
``--version`` answer at once; :func:`lightning_zero.cli.main` builds the full parser on the same top level.
"""

from __future__ import annotations

import argparse

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
