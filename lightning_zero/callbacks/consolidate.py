"""``ConsolidateCheckpoint``: write a single-file copy of the model after fit (and optionally after each save)."""

from __future__ import annotations

import os
import shutil
from typing import Optional, Union

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_zero.checkpoint.consolidate import consolidate_checkpoint, options_problem
from lightning_zero.checkpoint.io import wait_for_pending_saves
from lightning_zero.checkpoint.tensor_sources import parse_dtype


class ConsolidateCheckpoint(Callback):
    """Write ``output`` (``.safetensors`` or a Lightning checkpoint file) from the model state, streaming.

    Args:
        output: file to write; ``.safetensors`` writes model tensors only, any other name a Lightning checkpoint
            that ``LightningModule.load_from_checkpoint`` reads.
        dtype: ``None`` (keep), ``"fp32"``, ``"bf16"`` or ``"fp16"`` for floating-point tensors.
        every_save: also rewrite ``output`` from each checkpoint a ``ModelCheckpoint`` saves (consolidated on rank 0
            at the next training/validation hook after the save).
        with_optimizer: write a checkpoint that ``Trainer(strategy="ddp")`` (or any strategy) resumes training from:
            optimizer states, LR schedulers, loops and callbacks too (needs a non-``.safetensors`` ``output``, no
            ``dtype``, and ``ZeroStrategy``'s sharded checkpoints; see ``consolidate_checkpoint``).

    After fit, the final state is saved with ``trainer.save_checkpoint`` to a temporary sibling of ``output`` (every
    rank writes only its shards), then rank 0 consolidates it tensor by tensor and deletes the temporary copy. Rank 0
    never holds the whole model.
    """

    def __init__(
        self,
        output: Union[str, os.PathLike],
        dtype: Optional[Union[str, torch.dtype]] = None,
        every_save: bool = False,
        with_optimizer: bool = False,
    ) -> None:
        if not isinstance(output, (str, os.PathLike)) or not os.fspath(output):
            raise ValueError(f"output must be a file path, got {output!r}")
        if not isinstance(every_save, bool):
            raise TypeError(f"every_save must be a bool, got {every_save!r}")
        if not isinstance(with_optimizer, bool):
            raise TypeError(f"with_optimizer must be a bool, got {with_optimizer!r}")
        problem = options_problem(output, dtype, with_optimizer)  # the rules of consolidate_checkpoint
        if problem:
            raise ValueError(f"ConsolidateCheckpoint: {problem}")
        self.with_optimizer = with_optimizer
        self.output = os.fspath(output)
        self.dtype = parse_dtype(dtype)
        self.every_save = every_save
        self._save_pending = False
        self._consolidated_from: Optional[str] = None

    # --- after each ModelCheckpoint save -------------------------------------------------------------------
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        # Called while the checkpoint dict is built, before it is written: remember, consolidate at the next hook.
        if self.every_save:
            self._save_pending = True

    def _latest_saved(self, trainer: Trainer) -> Optional[str]:
        paths = []
        for callback in trainer.checkpoint_callbacks:
            for name in ("_last_checkpoint_saved", "last_model_path", "best_model_path"):
                path = getattr(callback, name, "") or ""
                if path and os.path.exists(path) and os.path.abspath(path) != os.path.abspath(self.output):
                    paths.append(path)
        return max(paths, key=os.path.getmtime) if paths else None

    def _maybe_consolidate_saved(self, trainer: Trainer) -> None:
        if not self._save_pending:
            return
        source = self._latest_saved(trainer)
        if source is None:
            return  # the save has not landed yet (e.g. a ModelCheckpoint later in this hook); try again next hook
        self._save_pending = False
        if trainer.is_global_zero:
            wait_for_pending_saves(barrier=False)
            consolidate_checkpoint(source, self.output, dtype=self.dtype, with_optimizer=self.with_optimizer)
            self._consolidated_from = source

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._maybe_consolidate_saved(trainer)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._maybe_consolidate_saved(trainer)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._maybe_consolidate_saved(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self._maybe_consolidate_saved(trainer)

    # --- after fit -----------------------------------------------------------------------------------------
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        directory, name = os.path.split(os.path.abspath(self.output))
        source = os.path.join(directory, f".{name}.source.ckpt")
        trainer.save_checkpoint(source)  # collective: each rank writes its shards (or rank 0 one file)
        wait_for_pending_saves()
        if trainer.is_global_zero:
            try:
                consolidate_checkpoint(source, self.output, dtype=self.dtype, with_optimizer=self.with_optimizer)
                self._consolidated_from = source
            finally:
                shutil.rmtree(source) if os.path.isdir(source) else os.remove(source)
        trainer.strategy.barrier("ConsolidateCheckpoint")
