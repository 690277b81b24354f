"""A training script for torchrun: ``torchrun --standalone --nproc-per-node 2 --max-restarts 1 -m
tests.reliability.preempt_job <root> preempt|reference``.

``preempt``: on the first attempt rank 1 receives SIGTERM at the start of step 2 (as a scheduler's preemption
notice would arrive); the strategy checkpoints at the end of that step on both ranks and the job exits as failed,
so torchrun restarts it and ``auto_resume`` continues from the preemption checkpoint. ``reference``: an ordinary
save at the same step and a second fit resumed from it, never interrupted. Rank 0 writes ``<root>/final.pt``."""

import os
import signal
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroStrategy
from tests.lightning_models import RegressionModule, full_state

EPOCHS, STEPS_PER_EPOCH, SIGNAL_STEP = 3, 2, 2


class PreemptOnce(Callback):
    def __init__(self, marker: Path):
        self.marker = marker

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == SIGNAL_STEP and trainer.global_rank == 1 and not self.marker.exists():
            self.marker.write_text("signalled")
            os.kill(os.getpid(), signal.SIGTERM)


class SaveAt(Callback):
    def __init__(self, path: str):
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == SIGNAL_STEP + 1:
            trainer.save_checkpoint(self.path)


def fit(root: Path, callbacks, ckpt_path=None):
    torch.manual_seed(0)
    trainer = Trainer(
        strategy=ZeroStrategy(stage=3),
        accelerator="cpu",
        devices=2,
        max_epochs=EPOCHS,
        limit_train_batches=STEPS_PER_EPOCH,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=str(root),
        callbacks=[ModelCheckpoint(dirpath=root / "checkpoints", save_top_k=-1), *callbacks],
    )
    module = RegressionModule()
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, full_state(module)


def main(root: str, mode: str) -> None:
    torch.set_num_threads(1)
    root_path = Path(root)
    if mode == "preempt":
        trainer, state = fit(root_path, [PreemptOnce(root_path / "signalled")])
    else:
        path = str(root_path / "at_step.ckpt")
        fit(root_path / "first", [SaveAt(path)])
        trainer, state = fit(root_path / "second", [], ckpt_path=path)
    if trainer.global_rank == 0:
        torch.save(
            {
                "weights": state,
                "global_step": trainer.global_step,
                "ckpt_path": str(trainer.ckpt_path),
                "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            },
            root_path / "final.pt",
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
