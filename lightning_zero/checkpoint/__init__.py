"""Sharded checkpoints: atomic/async DCP save and load, streaming consolidation, Hugging Face export, DeepSpeed
checkpoint reading."""

from lightning_zero.checkpoint.atomic import CheckpointSaveError
from lightning_zero.checkpoint.consolidate import consolidate_checkpoint, iter_consolidated
from lightning_zero.checkpoint.deepspeed_reader import is_deepspeed_checkpoint
from lightning_zero.checkpoint.directory import is_sharded_checkpoint, read_checkpoint_info, verify_checkpoint
from lightning_zero.checkpoint.errors import CheckpointError
from lightning_zero.checkpoint.hf_export import export_hf
from lightning_zero.checkpoint.hf_save import save_hf_pretrained
from lightning_zero.checkpoint.io import (
    PendingSave,
    load_sharded_checkpoint,
    remove_sharded_checkpoint,
    save_sharded_checkpoint,
    wait_for_pending_saves,
)
from lightning_zero.checkpoint.safe_load import UnsafeCheckpointError, load_meta

__all__ = [
    "CheckpointError",
    "CheckpointSaveError",
    "PendingSave",
    "UnsafeCheckpointError",
    "consolidate_checkpoint",
    "export_hf",
    "is_deepspeed_checkpoint",
    "is_sharded_checkpoint",
    "iter_consolidated",
    "load_meta",
    "load_sharded_checkpoint",
    "read_checkpoint_info",
    "remove_sharded_checkpoint",
    "save_hf_pretrained",
    "save_sharded_checkpoint",
    "verify_checkpoint",
    "wait_for_pending_saves",
]
