"""``HuggingFaceExport``: after fit, the ``transformers`` model as a directory ``from_pretrained`` reads, written by
every rank through DCP's ``HuggingFaceStorageWriter`` (:func:`lightning_zero.checkpoint.hf_save.save_hf_pretrained`).
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_zero.checkpoint.hf_save import save_hf_pretrained
from lightning_zero.checkpoint.io import wait_for_pending_saves
from lightning_zero.checkpoint.tensor_sources import parse_dtype
from lightning_zero.diagnostics.byte_sizes import parse_size


class HuggingFaceExport(Callback):
    """Write the one ``transformers.PreTrainedModel`` inside the LightningModule to ``output_dir`` when fit ends.

    Args:
        output_dir: the directory (``model-0000i-of-0000n.safetensors``, ``model.safetensors.index.json``,
            ``config.json``).
        dtype: ``None`` (as trained; fp32 masters where the optimizer keeps them), ``"fp32"``, ``"bf16"`` or
            ``"fp16"``.
        max_shard_size: bytes or ``"2GB"``: the most one safetensors file holds.

    Each rank writes what it holds; no checkpoint is written first and no rank holds the whole model.
    """

    def __init__(
        self,
        output_dir: Union[str, os.PathLike],
        dtype: Optional[Union[str, torch.dtype]] = None,
        max_shard_size: Optional[Union[int, str]] = None,
    ) -> None:
        if not isinstance(output_dir, (str, os.PathLike)) or not os.fspath(output_dir):
            raise ValueError(f"output_dir must be a directory path, got {output_dir!r}")
        self.output_dir = os.fspath(output_dir)
        self.dtype = parse_dtype(dtype)
        if max_shard_size is not None:
            parse_size(max_shard_size, "max_shard_size")
        self.max_shard_size = max_shard_size

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        wait_for_pending_saves()
        save_hf_pretrained(pl_module, self.output_dir, dtype=self.dtype, max_shard_size=self.max_shard_size)
