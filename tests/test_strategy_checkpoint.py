"""Sharded ZeroStrategy checkpoints: resume at another stage and world size continues as an uninterrupted run."""

import os

import torch
from lightning.pytorch import Trainer
from torch import nn

from lightning_zero import ZeroStrategy
from tests.distributed import run_distributed
from tests.lightning_models import RegressionModule, dataset, full_state, make_optimizer_and_scheduler

BATCH = 4
STEPS_PER_EPOCH = 2


def _trainer(stage, world_size, epochs, root):
    return Trainer(strategy=ZeroStrategy(stage=stage), accelerator="cpu", devices=world_size, max_epochs=epochs,
                   limit_train_batches=STEPS_PER_EPOCH, limit_val_batches=0, logger=False, enable_progress_bar=False,
                   enable_model_summary=False, enable_checkpointing=False, default_root_dir=root)


def _reference(epochs, global_batch):
    """Epoch e visits the first STEPS_PER_EPOCH global batches of DistributedSampler's permutation seeded 0 + e."""
    torch.manual_seed(0)
    module = RegressionModule()
    opt, sched = make_optimizer_and_scheduler(module.named_parameters())
    x_all, y_all = dataset().tensors
    for epoch in range(epochs):
        order = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(epoch))
        for step in range(STEPS_PER_EPOCH):
            idx = order[step * global_batch:(step + 1) * global_batch]
            nn.functional.mse_loss(module(x_all[idx]), y_all[idx]).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _save_worker(rank, world_size, path, stage):
    torch.manual_seed(0)
    trainer = _trainer(stage, world_size, 1, os.path.dirname(path))
    trainer.fit(RegressionModule(batch_size=BATCH))
    trainer.save_checkpoint(path)
    assert os.path.isdir(path) and os.path.isfile(os.path.join(path, "meta.pt"))


def _resume_worker(rank, world_size, path, stage, saved_world_size):
    torch.manual_seed(123)  # different init: every weight must come from the checkpoint
    module = RegressionModule(batch_size=BATCH * saved_world_size // world_size)
    trainer = _trainer(stage, world_size, 2, os.path.dirname(path))
    trainer.fit(module, ckpt_path=path)
    assert trainer.global_step == 2 * STEPS_PER_EPOCH
    expected = _reference(2, BATCH * saved_world_size)
    got = full_state(module)
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= 1e-5, f"resumed at stage {stage} x {world_size} ranks: max abs diff {worst:.2e}"
    lrs = [g["lr"] for g in trainer.optimizers[0].param_groups]
    assert abs(lrs[0] - 1e-2 * 0.5 ** (2 * STEPS_PER_EPOCH)) < 1e-12, "the LR scheduler state was not restored"


def test_save_at_stage3_resume_at_other_stages_and_world_sizes(tmp_path):
    path = str(tmp_path / "stage3.ckpt")
    run_distributed(_save_worker, 2, path, 3)
    run_distributed(_resume_worker, 2, path, 1, 2)  # stage 3 -> stage 1, same global batch
    run_distributed(_resume_worker, 1, path, 0, 2)  # 2 ranks -> 1 rank at stage 0, global batch kept
