"""Sharded ZeroStrategy checkpoints: resume at another stage and world size continues as an uninterrupted run."""

import os

import pytest
import torch
from lightning.pytorch import Trainer
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import wait_for_pending_saves
from tests.lightning_models import RegressionModule, dataset, full_state, make_optimizer_and_scheduler
from tests.ranks import kill_rank_in_the_middle_of_the_next_save, run_distributed

BATCH = 4
STEPS_PER_EPOCH = 2


def _trainer(stage, world_size, epochs, root, async_save=False):
    return Trainer(
        strategy=ZeroStrategy(stage=stage, async_save=async_save),
        accelerator="cpu",
        devices=world_size,
        max_epochs=epochs,
        limit_train_batches=STEPS_PER_EPOCH,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=root,
    )


def _reference(epochs, global_batch):
    """Epoch e visits the first STEPS_PER_EPOCH global batches of DistributedSampler's permutation seeded 0 + e."""
    torch.manual_seed(0)
    module = RegressionModule()
    opt, sched = make_optimizer_and_scheduler(module.named_parameters())
    x_all, y_all = dataset().tensors
    for epoch in range(epochs):
        order = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(epoch))
        for step in range(STEPS_PER_EPOCH):
            idx = order[step * global_batch : (step + 1) * global_batch]
            nn.functional.mse_loss(module(x_all[idx]), y_all[idx]).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _save_worker(rank, world_size, path, stage, async_save=False, then_crash=False):
    torch.manual_seed(0)
    trainer = _trainer(stage, world_size, 1, os.path.dirname(path), async_save=async_save)
    module = RegressionModule(batch_size=BATCH)
    trainer.fit(module)
    trainer.save_checkpoint(path)
    if async_save:
        from lightning_zero.checkpoint import io as ckpt_io

        assert ckpt_io._PENDING, "async_save=True but the save completed synchronously"
        # the save returned before the files landed; weights changed now must not reach the checkpoint
        with torch.no_grad():
            for param in module.parameters():
                param.mul_(-3.0)
        wait_for_pending_saves()
    assert os.path.isdir(path) and os.path.isfile(os.path.join(path, "meta.pt"))
    if then_crash:
        _die_in_the_middle_of_the_next_save(trainer, module, path)


def _die_in_the_middle_of_the_next_save(trainer, module, path):
    with torch.no_grad():
        for param in module.parameters():
            param.mul_(-3.0)
    kill_rank_in_the_middle_of_the_next_save(1)
    trainer.save_checkpoint(path)
    raise AssertionError("the save should not complete when a rank died in the middle of it")


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


# (saved stage, saved world size) -> (resumed stage, resumed world size): every stage is saved at 2 and 4 ranks and
# resumed at another stage and world size; the global batch (BATCH x saved world size) is kept.
RESHARD_CASES = [
    ((0, 2), (3, 1)),
    ((1, 2), (2, 4)),
    ((2, 2), (0, 1)),
    ((3, 2), (1, 2)),
    ((0, 4), (2, 2)),
    ((1, 4), (3, 1)),
    ((2, 4), (1, 2)),
    ((3, 4), (0, 1)),
]


@pytest.mark.parametrize(
    "saved,resumed", RESHARD_CASES, ids=[f"s{a}x{b}-to-s{c}x{d}" for (a, b), (c, d) in RESHARD_CASES]
)
def test_save_and_resume_at_another_stage_and_world_size(tmp_path, saved, resumed):
    (save_stage, save_world), (resume_stage, resume_world) = saved, resumed
    path = str(tmp_path / f"stage{save_stage}.ckpt")
    run_distributed(_save_worker, save_world, path, save_stage)
    run_distributed(_resume_worker, resume_world, path, resume_stage, save_world)


def _model_checkpoint_worker(rank, world_size, root):
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    callback = ModelCheckpoint(
        dirpath=root,
        monitor="train_loss",
        mode="min",
        save_top_k=2,
        save_last=True,
        every_n_train_steps=1,
        filename="step{step}",
    )
    trainer = Trainer(
        strategy=ZeroStrategy(stage=3),
        accelerator="cpu",
        devices=world_size,
        max_steps=4,
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=root,
    )
    trainer.fit(RegressionModule(batch_size=BATCH))
    trainer.strategy.barrier()
    saved = sorted(name for name in os.listdir(root) if name.endswith(".ckpt"))
    # top-2 by train_loss plus last: the other step checkpoints were removed through the strategy
    assert len(saved) == 3 and "last.ckpt" in saved, saved
    for name in saved:
        assert os.path.isdir(os.path.join(root, name)), f"{name} is not a sharded checkpoint directory"
    assert os.path.basename(callback.best_model_path) in saved
    assert callback.best_model_score is not None


def _resume_from_last_worker(rank, world_size, root):
    torch.manual_seed(123)
    module = RegressionModule(batch_size=BATCH)
    trainer = Trainer(
        strategy=ZeroStrategy(stage=2),
        accelerator="cpu",
        devices=world_size,
        max_steps=6,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        enable_checkpointing=False,
        default_root_dir=root,
    )
    trainer.fit(module, ckpt_path=os.path.join(root, "last.ckpt"))
    assert trainer.global_step == 6
    lrs = [g["lr"] for g in trainer.optimizers[0].param_groups]
    assert abs(lrs[0] - 1e-2 * 0.5**6) < 1e-12


def test_model_checkpoint_top_k_last_and_resume(tmp_path):
    root = str(tmp_path / "ckpts")
    run_distributed(_model_checkpoint_worker, 2, root)
    run_distributed(_resume_from_last_worker, 2, root)


def test_async_save_through_the_trainer_resumes_exactly(tmp_path):
    path = str(tmp_path / "async.ckpt")
    run_distributed(_save_worker, 2, path, 3, True)
    run_distributed(_resume_worker, 2, path, 2, 2)


def test_rank_killed_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    path = str(tmp_path / "crash.ckpt")
    with pytest.raises(Exception):  # noqa: B017  (the killed rank's failure, whichever way it surfaces)
        run_distributed(_save_worker, 2, path, 2, False, True)
    assert not os.path.exists(os.path.join(path, "zero.json.tmp"))
    run_distributed(_resume_worker, 2, path, 3, 2)  # the epoch-1 checkpoint, untouched by the failed save


def test_consolidated_strategy_checkpoint_loads_into_the_plain_module(tmp_path):
    from lightning_zero.cli import main as cli_main

    path = str(tmp_path / "s3.ckpt")
    run_distributed(_save_worker, 2, path, 3)
    expected = {}
    torch.manual_seed(0)
    reference = RegressionModule()
    opt, sched = make_optimizer_and_scheduler(reference.named_parameters())
    x_all, y_all = dataset().tensors
    order = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(0))
    for step in range(STEPS_PER_EPOCH):
        idx = order[step * BATCH * 2 : (step + 1) * BATCH * 2]
        nn.functional.mse_loss(reference(x_all[idx]), y_all[idx]).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    expected = reference.state_dict()
    out = str(tmp_path / "model.ckpt")
    assert cli_main(["consolidate", path, out]) in (0, None)
    loaded = RegressionModule.load_from_checkpoint(out)
    for key, value in expected.items():
        torch.testing.assert_close(loaded.state_dict()[key], value, atol=1e-6, rtol=0)
    plain = torch.load(out, weights_only=True)
    assert set(plain["state_dict"]) == set(expected)
    out16 = str(tmp_path / "model.safetensors")
    assert cli_main(["consolidate", path, out16, "--dtype", "bf16"]) in (0, None)
    from safetensors.torch import load_file

    half = load_file(out16)
    assert all(t.dtype == torch.bfloat16 for t in half.values())
    torch.testing.assert_close(half["net.out.weight"].float(), expected["net.out.weight"], atol=1e-2, rtol=1e-2)
