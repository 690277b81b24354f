"""Trainer level: a rank killed while ``ModelCheckpoint`` saves, then ``fit(ckpt_path="last")`` resumes from the newest
complete checkpoint instead of silently starting from step 0 (``save_last=True`` and ``save_last="link"``)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import atomic
from tests.lightning_models import RegressionModule
from tests.ranks import run_distributed

KILLED_AT_SAVE = 3  # the third checkpoint save (global step 3) is the one rank 0 dies in


def _trainer(root, save_last, async_save=False):
    callback = ModelCheckpoint(
        dirpath=root,
        save_last=save_last,
        save_top_k=-1 if save_last == "link" else 0,
        every_n_train_steps=1,
        filename="step{step}",
    )
    return Trainer(
        strategy=ZeroStrategy(stage=2, async_save=async_save),
        accelerator="cpu",
        devices=2,
        max_steps=5,
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=root,
    )


def _killed_run(rank, world_size, root, save_last, async_save, kill_step, _):
    saves = []

    def hook(step):
        if step == "after_info":
            saves.append(step)
        if step == kill_step and len(saves) == KILLED_AT_SAVE and dist.get_rank() == 0:
            os._exit(17)

    atomic.FAULT_HOOK = hook
    torch.manual_seed(0)
    _trainer(root, save_last, async_save).fit(RegressionModule())
    raise AssertionError("rank 0 should have died in the middle of a save")


class _StartStep(Callback):
    def on_train_start(self, trainer, pl_module):
        self.step = trainer.global_step


def _resume(rank, world_size, root, save_last, async_save, kill_step, resumed_step):
    start = _StartStep()
    trainer = _trainer(root, save_last)
    trainer.callbacks.append(start)
    torch.manual_seed(1)
    trainer.fit(RegressionModule(), ckpt_path="last")
    # never from scratch: from step 3 when the kill came after the swap, else from step 2
    assert start.step == resumed_step, f"resumed at step {start.step}"
    assert trainer.global_step == 5


# (save_last, async_save, the step rank 0 dies at in the third save, the step fit(ckpt_path="last") resumes from).
# save_last=True re-saves last.ckpt in place (the swap is what is tested); "link" saves step=N.ckpt and links to it.
CASES = [(True, False, "mid_swap", 3), (True, True, "mid_swap", 3), ("link", False, "after_info", 2)]


@pytest.mark.parametrize(
    "save_last,async_save,kill_step,resumed_step",
    CASES,
    ids=["last-sync-mid_swap", "last-async-mid_swap", "link-sync-after_info"],
)
def test_ckpt_path_last_resumes_from_the_newest_complete_checkpoint_after_a_kill(
    tmp_path, save_last, async_save, kill_step, resumed_step
):
    root = str(tmp_path / "ckpts")
    args = (root, save_last, async_save, kill_step, resumed_step)
    with pytest.raises(Exception, match="exit code 17"):
        run_distributed(_killed_run, 2, *args)
    run_distributed(_resume, 2, *args)


def _refused_worker(rank, world_size, root):
    with pytest.raises(ValueError, match='save_last="link"'):
        Trainer(
            strategy=ZeroStrategy(stage=0, async_save=True),
            accelerator="cpu",
            devices=1,
            max_steps=1,
            callbacks=[ModelCheckpoint(dirpath=root, save_last="link")],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(RegressionModule())


def test_async_save_with_a_last_link_is_refused(tmp_path):
    # in a child process: the failed fit's process group must not be inherited by later forked tests
    run_distributed(_refused_worker, 1, str(tmp_path))
