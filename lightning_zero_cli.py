"""The ``lightning-zero`` console script's entry point, kept outside the ``lightning_zero`` package on purpose.

Importing anything under ``lightning_zero`` first runs the package's ``__init__``, which imports torch and Lightning
to register the strategy names with the Trainer and Fabric: seconds, where ``lightning-zero``, ``--help`` and
``--version`` need none of it. This module answers those from ``lightning_zero/cli/toplevel.py`` (standard library
only, loaded from its file, so the package's ``__init__`` does not run) and hands every subcommand to
:func:`lightning_zero.cli.main`, which builds the full parser on the same top level.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Optional, Sequence


def _toplevel():
    """``lightning_zero/cli/toplevel.py``, executed on its own: ``find_spec`` locates a top-level package without
    importing it."""
    package = importlib.util.find_spec("lightning_zero")
    path = os.path.join(package.submodule_search_locations[0], "cli", "toplevel.py")
    spec = importlib.util.spec_from_file_location("_lightning_zero_cli_toplevel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    toplevel = _toplevel()
    if argv and argv[0] in toplevel.SUBCOMMANDS:
        from lightning_zero.cli import main as run_subcommand

        return run_subcommand(argv)
    parser, subparsers = toplevel.top_parser()
    for name, help_line in toplevel.SUBCOMMANDS.items():
        subparsers.add_parser(name, help=help_line)
    parser.parse_args(argv)  # --help, --version and an unknown COMMAND exit here
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
