"""The job the randomized kill trials run and kill: ``python -m tests.reliability.kill_job ROOT MODE [CKPT]``.

Two CPU ranks train ``RegressionModule`` at stage 2 for ``STEPS`` steps and save after every step (top-2 by step,
plus ``last.ckpt``). ``MODE``: ``sync``, ``async`` (``async_save=True``) or ``link`` (``save_last="link"``). ``CKPT``
(``last`` or a path) resumes. Rank 0 writes ``ROOT/started.json`` (the step the fit starts from) and, at the end,
``ROOT/final.json`` (the step it ended at).
"""

import json
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroStrategy
from tests.lightning_models import RegressionModule

STEPS = 12


class _Report(Callback):
    def __init__(self, root: Path):
        self.root = root

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank == 0:
            (self.root / "started.json").write_text(json.dumps({"step": trainer.global_step}))


def main(root: str, mode: str, ckpt_path=None) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    root_path = Path(root)
    every_step = ModelCheckpoint(
        dirpath=root_path / "checkpoints",
        filename="{step}",
        every_n_train_steps=1,
        save_top_k=2,
        monitor="step",
        mode="max",
        save_last="link" if mode == "link" else True,
    )
    trainer = Trainer(
        strategy=ZeroStrategy(stage=2, async_save=mode == "async", auto_resume=False),
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[every_step, _Report(root_path)],
        default_root_dir=root,
    )
    trainer.fit(RegressionModule(), ckpt_path=ckpt_path)
    if trainer.global_rank == 0:
        (root_path / "final.json").write_text(json.dumps({"step": trainer.global_step}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
