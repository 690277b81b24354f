"""The one error type for a checkpoint that cannot be used as it is."""

from __future__ import annotations

import os
from typing import Optional, Union


class CheckpointError(RuntimeError):
    """A checkpoint is damaged, incomplete, not a checkpoint at all, or does not match what it is loaded into.

    The message names the file (or key) and what is wrong with it; ``path`` holds the file when there is one.
    A ``RuntimeError`` on purpose: DCP's own ``CheckpointException`` derives from ``BaseException``, which
    ``except Exception`` handlers (Lightning's among them) do not catch, so every DCP failure is translated into this.
    """

    def __init__(self, message: str, path: Optional[Union[str, os.PathLike]] = None) -> None:
        super().__init__(message)
        self.path = os.fspath(path) if path is not None else None
