"""How subcommands report a failure: one line on stderr, exit code 1; the traceback only with ``--debug``."""

from __future__ import annotations

import sys


def one_line(err: BaseException) -> str:
    """``err`` on one line; its type is named unless it is one of the errors whose message says it all."""
    from lightning_zero.checkpoint.errors import CheckpointError

    text = " ".join(str(err).split())
    if isinstance(err, (CheckpointError, FileNotFoundError, ValueError)):
        return text
    return f"{type(err).__name__}: {text}"


def report(command: str, err: BaseException) -> int:
    print(f"lightning-zero {command}: error: {one_line(err)}", file=sys.stderr)
    return 1


def add_debug_flag(parser) -> None:
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error")
