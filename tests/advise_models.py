"""Models for ``tests/cli/test_advise.py``'s measured runs (imported by the measuring subprocess by name)."""

from __future__ import annotations

import os
import sys

from lightning.pytorch import LightningModule

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from gpt import GPTModule  # noqa: E402


class TinyGPT(GPTModule):
    """The example's GPT at a size that measures in seconds."""

    def __init__(
        self,
        vocab_size: int = 17,
        block_size: int = 16,
        n_layer: int = 2,
        n_head: int = 2,
        n_embd: int = 16,
        lr: float = 1e-3,
        batch_size: int = 2,
    ):
        super().__init__(vocab_size, block_size, n_layer, n_head, n_embd, lr, batch_size)


class OutOfMemoryGPT(TinyGPT):
    """Raises what an allocator raises when memory runs out, in the first training step."""

    def training_step(self, batch, batch_idx):
        raise MemoryError("simulated: the allocator could not find 64 GiB")


assert issubclass(TinyGPT, LightningModule)
