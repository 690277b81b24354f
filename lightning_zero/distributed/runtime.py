"""Gradient accumulation's "no gradient communication in this backward", shared by both adapters (the Trainer's
``block_backward_sync`` and Fabric's ``no_backward_sync``)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Generator, Optional

from torch import nn

from lightning_zero.distributed.apply_zero import set_gradient_sync


@contextmanager
def blocked(module: nn.Module, runner: Optional[Any] = None) -> Generator[None, None, None]:
    """Inside: the backward passes of ``module`` (DDP, or FSDP at stages 2-3) reduce no gradients, and a pipeline
    ``runner`` (which reduces after its schedule when ``sync_grads`` is set) skips its data-parallel and tied-weight
    reductions. Both are switched back on when the block exits, also through an exception."""
    set_gradient_sync(module, False)
    if runner is not None:
        runner.sync_grads = False
    try:
        yield
    finally:
        set_gradient_sync(module, True)
        if runner is not None:
            runner.sync_grads = True
