"""``stage3_gather_16bit_weights_on_model_save: true`` writes the consolidated weights with each checkpoint, as
DeepSpeed's ``save_16bit_model`` writes them: ``pytorch_model.bin`` inside the checkpoint directory, in the run's
16-bit dtype (fp32 for an fp32 run), loadable with ``torch.load(weights_only=True)`` into the unsharded module,
streamed one tensor at a time, and part of the atomic save."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import (
    CheckpointSaveError,
    save_sharded_checkpoint,
    verify_checkpoint,
    wait_for_pending_saves,
)
from lightning_zero.checkpoint import consolidate as consolidate_module
from lightning_zero.checkpoint.consolidate import WEIGHTS_16BIT_FILE, weights_16bit_dtype, write_16bit_weights
from lightning_zero.checkpoint.directory import read_checkpoint_info
from lightning_zero.checkpoint.tensor_sources import DCPTensorSource
from lightning_zero.ds_config import translate_ds_config
from lightning_zero.fabric import ZeroStrategy as FabricZeroStrategy
from tests.fabric.test_fabric_parity import fabric_train, full_weights, make_fabric
from tests.lightning_models import RegressionModule, full_state
from tests.ranks import run_distributed

BATCH = 4


def _config(stage: int, gather=True) -> dict:
    return {"zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": gather}}


def _trainer_worker(rank, world_size, root, stage, precision, gather, async_save=False):
    torch.manual_seed(0)
    checkpoints = ModelCheckpoint(
        dirpath=root, save_top_k=1, monitor="train_loss", every_n_train_steps=1, filename="step{step}"
    )
    trainer = Trainer(
        strategy=ZeroStrategy(config=_config(stage, gather), async_save=async_save),
        accelerator="cpu",
        devices=world_size,
        max_steps=3,
        precision=precision,
        callbacks=[checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=root,
    )
    module = RegressionModule(batch_size=BATCH)
    trainer.fit(module)
    path = os.path.join(root, "final.ckpt")
    trainer.save_checkpoint(path)
    wait_for_pending_saves()  # with async_save the file is written in the background, with the shards
    trained = full_state(module)  # collective (full_tensor), on every rank
    if rank == 0:
        torch.save(trained, os.path.join(root, "trained.pt"))


def _check_weights_file(path, trained, dtype):
    """The checkpoint at ``path`` holds ``pytorch_model.bin``: ``trained`` cast to ``dtype``, loadable with
    ``weights_only=True`` into the unsharded LightningModule, recorded (and so verified) with the checkpoint."""
    weights = torch.load(os.path.join(path, WEIGHTS_16BIT_FILE), weights_only=True)
    assert set(weights) == set(trained)
    for key, value in trained.items():
        expected = value.to(dtype) if value.is_floating_point() else value
        assert weights[key].dtype == expected.dtype and torch.equal(weights[key], expected), key
    RegressionModule().to(dtype).load_state_dict(weights)  # strict: no missing or unexpected key
    info = read_checkpoint_info(path)
    assert WEIGHTS_16BIT_FILE in info["files"] and info["weights_16bit"]["file"] == WEIGHTS_16BIT_FILE
    assert verify_checkpoint(path) == []


@pytest.mark.parametrize(
    "stage,precision,dtype,async_save",
    [
        (3, "bf16-mixed", torch.bfloat16, False),
        (1, "32-true", torch.float32, False),
        (2, "bf16-mixed", torch.bfloat16, True),
    ],
)
def test_trainer_checkpoints_hold_the_consolidated_16bit_weights(tmp_path, stage, precision, dtype, async_save):
    # bf16 at stage 3 (sharded DTensors); an fp32 run writes fp32, as DeepSpeed's save_16bit_model writes the module's
    # dtype; stage 1 (DDP, replicated tensors) writes it too: the flag asks for the file at every stage.
    root = str(tmp_path)
    run_distributed(_trainer_worker, 2, root, stage, precision, True, async_save)
    trained = torch.load(os.path.join(root, "trained.pt"), weights_only=True)
    _check_weights_file(os.path.join(root, "final.ckpt"), trained, dtype)
    kept = sorted(name for name in os.listdir(root) if name.startswith("step"))
    assert len(kept) == 1, kept  # top-1 rotation removed the others, their weights files with them
    assert os.path.isfile(os.path.join(root, kept[0], WEIGHTS_16BIT_FILE))
    assert not [name for name in os.listdir(root) if WEIGHTS_16BIT_FILE in name]  # nothing outside a checkpoint


def test_no_weights_file_without_the_flag(tmp_path):
    root = str(tmp_path)
    run_distributed(_trainer_worker, 2, root, 3, "32-true", False)
    assert not os.path.exists(os.path.join(root, "final.ckpt", WEIGHTS_16BIT_FILE))
    assert "weights_16bit" not in read_checkpoint_info(os.path.join(root, "final.ckpt"))


def _fabric_worker(rank, world_size, path):
    fabric = make_fabric(FabricZeroStrategy(config=_config(3)), precision="bf16-mixed")
    model, optimizer = fabric_train(fabric, rank, world_size, steps=range(1))
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    trained = full_weights(model._forward_module)
    if rank == 0:
        torch.save(trained, path + ".trained.pt")


def test_fabric_save_holds_the_consolidated_16bit_weights(tmp_path):
    path = str(tmp_path / "fabric.ckpt")
    run_distributed(_fabric_worker, 2, path)
    trained = torch.load(path + ".trained.pt", weights_only=True)
    weights = torch.load(os.path.join(path, WEIGHTS_16BIT_FILE), weights_only=True)
    assert set(weights) == set(trained)
    assert all(weights[k].dtype == torch.bfloat16 and torch.equal(weights[k], trained[k].bfloat16()) for k in trained)
    assert verify_checkpoint(path) == []


def test_dtype_follows_the_precision_as_deepspeed():
    assert weights_16bit_dtype("bf16-mixed") is torch.bfloat16 and weights_16bit_dtype("bf16-true") is torch.bfloat16
    assert weights_16bit_dtype("16-mixed") is torch.float16 and weights_16bit_dtype("16-true") is torch.float16
    assert weights_16bit_dtype("32-true") is torch.float32


def _model_state(blocks: int = 12, width: int = 64) -> dict:
    torch.manual_seed(0)
    state = {f"blocks.{i}.weight": torch.randn(width, width) for i in range(blocks)}
    state.update({f"blocks.{i}.bias": torch.randn(width) for i in range(blocks)})
    state["steps"] = torch.tensor(3)  # an integer buffer keeps its dtype
    return state


def test_weights_are_streamed_one_tensor_at_a_time(tmp_path, monkeypatch):
    # The writer is fed one tensor at a time: when the next tensor is read from the shards, none of those handed
    # out before is still alive, so the extra memory is one tensor (and its cast copy), never the model.
    state = _model_state()
    path = str(tmp_path / "model.ckpt")
    largest = max(t.numel() * t.element_size() for t in state.values())
    assert sum(t.numel() * t.element_size() for t in state.values()) >= 10 * largest  # the bound says something
    alive: list = []
    most_alive = [0]
    load = DCPTensorSource.load

    def counting_load(self, entry):
        gc.collect()
        most_alive[0] = max(most_alive[0], sum(ref() is not None for ref in alive))
        tensor = load(self, entry)
        alive.append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(DCPTensorSource, "load", counting_load)
    save_sharded_checkpoint(
        path, {"state_dict": state}, {}, extra_files=lambda directory: write_16bit_weights(directory, torch.float16)
    )
    assert len(alive) == len(state) and most_alive[0] == 0
    written = torch.load(os.path.join(path, WEIGHTS_16BIT_FILE), weights_only=True)
    assert list(written) == list(state)  # the module's own order
    for key, value in state.items():
        assert torch.equal(written[key], value.half() if value.is_floating_point() else value), key


def test_a_failed_weights_file_fails_the_save_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "model.ckpt")
    save_sharded_checkpoint(
        path, {"state_dict": _model_state()}, {"step": 1}, extra_files=lambda d: write_16bit_weights(d, torch.bfloat16)
    )
    before = read_checkpoint_info(path)

    def full_disk(output, obj, load):
        load(next(iter(obj.values())).entry)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(consolidate_module, "write_torch_checkpoint", full_disk)
    with pytest.raises(CheckpointSaveError, match="no space left"):
        save_sharded_checkpoint(
            path,
            {"state_dict": _model_state(blocks=2)},
            {"step": 2},
            extra_files=lambda d: write_16bit_weights(d, torch.bfloat16),
        )
    assert read_checkpoint_info(path) == before and verify_checkpoint(path) == []  # the previous one, intact
    assert sorted(os.listdir(tmp_path)) == ["model.ckpt"]  # no partial directory left behind


def test_the_startup_table_says_what_is_done():
    notes = dict(translate_ds_config(_config(3)).notes)
    note = notes["zero_optimization.stage3_gather_16bit_weights_on_model_save"]
    assert WEIGHTS_16BIT_FILE in note and "every checkpoint" in note
