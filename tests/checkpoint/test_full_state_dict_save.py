"""``ZeroStrategy(state_dict_type="full")``: a Trainer checkpoint as one torch file, streamed out
of the shards, readable by ``torch.load(weights_only=True)`` and resumed at another stage and world size."""

import os

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import CheckpointSaveError
from lightning_zero.checkpoint.full_save import FULL_FILE_MARKER, staging_directory
from tests.lightning_models import RegressionModule, full_state, quiet_trainer
from tests.ranks import run_distributed


def _fit(strategy, world_size, steps, **kwargs):
    torch.manual_seed(0)
    model = RegressionModule()
    quiet_trainer(strategy, world_size, max_steps=steps, **kwargs).fit(model)
    return model


def _full_save_worker(rank, world_size, root):
    every_step = ModelCheckpoint(
        dirpath=root, filename="{step}", every_n_train_steps=1, save_top_k=2, monitor="step", mode="max"
    )
    torch.manual_seed(0)
    model = RegressionModule()
    trainer = quiet_trainer(
        ZeroStrategy(stage=3, state_dict_type="full"),
        world_size,
        max_steps=4,
        enable_checkpointing=True,
        callbacks=[every_step],
    )
    trainer.fit(model)
    trained = full_state(model)
    if rank == 0:
        names = sorted(os.listdir(root))
        assert names == ["step=3.ckpt", "step=4.ckpt"], names  # top-k rotation deleted the older files
        newest = os.path.join(root, "step=4.ckpt")
        assert os.path.isfile(newest) and not os.path.exists(staging_directory(newest))
        checkpoint = torch.load(newest, map_location="cpu", weights_only=True)
        assert checkpoint[FULL_FILE_MARKER] is True and checkpoint["global_step"] == 4
        assert len(checkpoint["optimizer_states"]) == 1 and checkpoint["optimizer_states"][0]["state"]
        for key, value in trained.items():
            assert torch.equal(checkpoint["state_dict"][key], value), key
    # resumed at another stage (and below, another world size), it continues as a resume from the sharded checkpoint
    # of the same run does (Lightning restarts a mid-epoch loader from its first batch either way)
    sharded_root = os.path.join(root, "sharded")
    keep = ModelCheckpoint(dirpath=sharded_root, filename="{step}", every_n_train_steps=4, save_top_k=-1)
    _fit(ZeroStrategy(stage=3), world_size, 4, enable_checkpointing=True, callbacks=[keep])
    continued = {}
    for name, source in (
        ("full", os.path.join(root, "step=4.ckpt")),
        ("sharded", os.path.join(sharded_root, "step=4.ckpt")),
    ):
        torch.manual_seed(0)
        resumed = RegressionModule()
        quiet_trainer(ZeroStrategy(stage=1), world_size, max_steps=6).fit(resumed, ckpt_path=source)
        continued[name] = full_state(resumed)
    for key, value in continued["sharded"].items():
        assert not torch.equal(value, trained[key]), key
        torch.testing.assert_close(continued["full"][key], value, rtol=0, atol=0, msg=key)


def test_full_state_dict_type_saves_one_file_rotates_and_resumes_elsewhere(tmp_path):
    run_distributed(_full_save_worker, 2, str(tmp_path))
    run_distributed(_validate_at_world_size_one, 1, str(tmp_path / "step=4.ckpt"))


def _validate_at_world_size_one(rank, world_size, path):
    # the same file at world size 1 and stage 2: the weights the 2-rank run ended with after 4 steps
    torch.manual_seed(0)
    model = RegressionModule()
    quiet_trainer(ZeroStrategy(stage=2), world_size, max_steps=4, limit_val_batches=2).validate(
        model, ckpt_path=path, verbose=False
    )
    saved = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    for key, value in full_state(model).items():
        assert torch.equal(value, saved[key]), key


def _foreign_file_worker(rank, world_size, path):
    trainer = quiet_trainer(ZeroStrategy(stage=2, state_dict_type="full"), world_size, max_steps=1)
    torch.manual_seed(0)
    trainer.fit(RegressionModule())
    with pytest.raises(CheckpointSaveError, match="not a lightning-zero full checkpoint file"):
        trainer.save_checkpoint(path)
    assert open(path).read() == "mine"


def test_a_file_that_is_not_ours_is_not_replaced(tmp_path):
    path = tmp_path / "notes.ckpt"
    path.write_text("mine")
    run_distributed(_foreign_file_worker, 2, str(path))


def test_full_and_async_save_are_refused_together_and_bad_values_named():
    with pytest.raises(ValueError, match="state_dict_type='full'.*async_save"):
        ZeroStrategy(state_dict_type="full", async_save=True)
    with pytest.raises(ValueError, match="state_dict_type must be 'sharded' or 'full'"):
        ZeroStrategy(state_dict_type="FULL")


def test_a_checkpoint_io_plugin_given_to_the_trainer_is_refused_by_name():
    # it was accepted and never called: ZeroStrategy saves with torch.distributed.checkpoint itself
    from lightning.pytorch import Trainer
    from lightning.pytorch.plugins import TorchCheckpointIO

    class MyCheckpointIO(TorchCheckpointIO):
        pass

    with pytest.raises(NotImplementedError, match="CheckpointIO plugin .MyCheckpointIO."):
        Trainer(strategy=ZeroStrategy(), plugins=[MyCheckpointIO()], accelerator="cpu", devices=1, logger=False)
