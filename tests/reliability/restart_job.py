"""A training script for torchrun: ``torchrun --standalone --nproc-per-node 2 --max-restarts 1 -m
tests.reliability.restart_job <root> [die_at_step]``. Rank 1 kills itself (``os._exit``) once, at ``die_at_step``,
leaving a marker so the restarted attempt runs through. Rank 0 writes the final full weights to
``<root>/final.pt``. ``die_at_step=0`` is the uninterrupted reference run."""

import os
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroStrategy
from tests.lightning_models import RegressionModule, full_state

EPOCHS = 4
STEPS_PER_EPOCH = 2  # checkpoints at epoch ends: resuming mid-epoch is not exact with a plain DataLoader


class DieOnce(Callback):
    def __init__(self, marker: Path, step: int):
        self.marker, self.step = marker, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.step and trainer.global_step == self.step and trainer.global_rank == 1 and not self.marker.exists():
            self.marker.write_text("died")
            os._exit(9)


def main(root: str, die_at_step: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    root_path = Path(root)
    checkpoints = ModelCheckpoint(dirpath=root_path / "checkpoints", save_top_k=-1)  # every epoch
    trainer = Trainer(
        strategy=ZeroStrategy(stage=2),
        accelerator="cpu",
        devices=2,
        max_epochs=EPOCHS,
        limit_train_batches=STEPS_PER_EPOCH,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[checkpoints, DieOnce(root_path / "died", die_at_step)],
        default_root_dir=root,
    )
    module = RegressionModule()
    trainer.fit(module)
    state = full_state(module)
    if trainer.global_rank == 0:
        torch.save(
            {
                "weights": state,
                "global_step": trainer.global_step,
                "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            },
            root_path / "final.pt",
        )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0)
