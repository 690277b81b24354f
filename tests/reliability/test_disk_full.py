"""A full disk, met through the Trainer, Fabric and NVMe offload on a real 2 MiB tmpfs: the error
names the path that filled up and the space needed and free, says the previous checkpoint is intact, and that
checkpoint then loads. Skipped where mounting a tmpfs is not permitted (needs root)."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_zero.checkpoint import CheckpointSaveError, atomic, wait_for_pending_saves
from tests.lightning_models import Net, RegressionModule, full_state, quiet_trainer
from tests.ranks import run_distributed

SMALL_DISK_SIZE = "2m"  # the tmpfs the ``small_disk`` fixture (tests/reliability/conftest.py) mounts


def fill(directory: str, leave: int) -> None:
    """Another job fills the disk: leave about ``leave`` bytes free."""
    stats = os.statvfs(directory)
    with open(os.path.join(directory, "filler"), "ab") as file:
        file.write(b"\0" * max(stats.f_bavail * stats.f_frsize - leave, 0))


def _fill_while_writing(directory: str):
    def hook(step: str) -> None:  # after the space check passed, before the shards are written
        if step == "before_shards" and dist.get_rank() == 0:
            fill(directory, 0)

    return hook


def check_message(message: str, path: str, during_write: bool) -> None:
    assert path in message, message
    assert ".lz-staging" not in message, message  # state_dict_type="full": the user's file, not its staging directory
    if during_write:
        assert re.search(r"no space left .* needs about \d+ bytes, \d+ bytes free on ", message), message
    else:
        assert re.search(r"needs about \d+ bytes and .* has \d+ bytes free \(free at least \d+ more bytes", message), (
            message
        )
    assert f"the previous checkpoint at {path} is intact" in message, message


def _save_twice(save, disk: str, path: str) -> None:
    """``save()`` fails twice: refused up front on a full disk, then failing as the disk fills under the write."""
    dist.barrier()
    if dist.get_rank() == 0:
        fill(disk, 0)  # a full disk: not even a probe file fits
    dist.barrier()
    with pytest.raises(CheckpointSaveError) as refused:
        save()
    check_message(str(refused.value), path, during_write=False)
    if dist.get_rank() == 0:
        os.remove(os.path.join(disk, "filler"))
    dist.barrier()
    atomic.FAULT_HOOK = _fill_while_writing(disk)
    try:
        with pytest.raises(CheckpointSaveError) as failed:
            save()
            wait_for_pending_saves()
    finally:
        atomic.FAULT_HOOK = None
    check_message(str(failed.value), path, during_write=True)
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(os.path.join(disk, "filler"))
    dist.barrier()
    assert sorted(os.listdir(disk)) == ["last.ckpt"], "a failed save left files behind"


def _fill_after_shards(directory: str):
    def hook(step: str) -> None:  # the shards are staged; the one file has yet to be written
        if step == "after_info" and dist.get_rank() == 0:
            fill(directory, 0)

    return hook


def _full_file_worker(rank, world_size, disk):
    """``state_dict_type="full"``: the shards go to a hidden staging directory first, then rank 0 writes the file.
    Every failure must name the user's file, not the staging directory, and say the previous file is intact."""
    from lightning_zero import ZeroStrategy

    path = os.path.join(disk, "last.ckpt")
    torch.manual_seed(0)
    module = RegressionModule()
    trainer = quiet_trainer(ZeroStrategy(stage=2, state_dict_type="full"), world_size, max_steps=1)
    trainer.fit(module)
    trainer.save_checkpoint(path)
    saved = full_state(module)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(1.0)
    _save_twice(lambda: trainer.save_checkpoint(path), disk, path)
    # the disk fills between the staged shards and the file
    message = _save_with_hook(lambda: trainer.save_checkpoint(path), _fill_after_shards(disk), disk)
    check_message(message, path, during_write=True)
    assert sorted(os.listdir(disk)) == ["last.ckpt"], "a failed save left files behind"
    assert torch.load(path, weights_only=True)["global_step"] == 1
    torch.manual_seed(123)
    resumed = RegressionModule()
    trainer = quiet_trainer(ZeroStrategy(stage=2), world_size, max_steps=1)
    trainer.fit(resumed, ckpt_path=path)
    got = full_state(resumed)
    assert all(torch.equal(got[key], saved[key]) for key in saved), "the previous file did not load as saved"


def _save_with_hook(save, hook, disk: str) -> str:
    """The message of the error ``save()`` raises with ``hook`` as the fault hook; the filler is removed after."""
    dist.barrier()
    atomic.FAULT_HOOK = hook
    try:
        with pytest.raises(CheckpointSaveError) as failed:
            save()
    finally:
        atomic.FAULT_HOOK = None
    dist.barrier()
    if dist.get_rank() == 0:
        os.remove(os.path.join(disk, "filler"))
    dist.barrier()
    return str(failed.value)


def _trainer_worker(rank, world_size, disk, async_save):
    from lightning_zero import ZeroStrategy

    path = os.path.join(disk, "last.ckpt")
    torch.manual_seed(0)
    module = RegressionModule()
    trainer = quiet_trainer(ZeroStrategy(stage=2, async_save=async_save), world_size, max_steps=1)
    trainer.fit(module)
    trainer.save_checkpoint(path)
    wait_for_pending_saves()
    saved = full_state(module)
    with torch.no_grad():  # what a successful second save would have written
        for param in module.parameters():
            param.add_(1.0)
    _save_twice(lambda: trainer.save_checkpoint(path), disk, path)

    torch.manual_seed(123)  # another init: every weight must come from the checkpoint
    resumed = RegressionModule()
    trainer = quiet_trainer(ZeroStrategy(stage=2), world_size, max_steps=1)
    trainer.fit(resumed, ckpt_path=path)  # the checkpoint is at step 1: loading is all this fit does
    assert trainer.global_step == 1
    got = full_state(resumed)
    assert all(torch.equal(got[key], saved[key]) for key in saved), "the previous checkpoint did not load as saved"


@pytest.mark.slow  # two ranks, two Trainer fits: ~10 s
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_trainer_on_a_full_disk_names_path_and_space_and_the_previous_checkpoint_loads(small_disk, async_save):
    run_distributed(_trainer_worker, 2, str(small_disk), async_save)


def _fabric_worker(rank, world_size, disk):
    from lightning.fabric import Fabric

    from lightning_zero.fabric import ZeroStrategy

    path = os.path.join(disk, "last.ckpt")
    fabric = Fabric(strategy=ZeroStrategy(stage=3), accelerator="cpu", devices=world_size)
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module():
        module = Net()
    model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    fabric.backward(model(torch.randn(2, 6)).square().mean())
    optimizer.step()
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    saved = {key: value.full_tensor().clone() for key, value in model.state_dict().items()}
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    _save_twice(lambda: fabric.save(path, {"model": model, "optimizer": optimizer, "step": 2}), disk, path)
    remainder = fabric.load(path, {"model": model, "optimizer": optimizer})
    assert remainder == {"step": 1}
    loaded = {key: value.full_tensor() for key, value in model.state_dict().items()}
    assert all(torch.equal(loaded[key], saved[key]) for key in saved), "the previous checkpoint did not load as saved"


@pytest.mark.slow  # two ranks, two Trainer fits and five saves: ~15 s
def test_full_file_on_a_full_disk_names_the_file_and_space_and_the_previous_file_loads(small_disk):
    run_distributed(_full_file_worker, 2, str(small_disk))


@pytest.mark.slow  # two ranks, one Fabric: ~5 s
def test_fabric_on_a_full_disk_names_path_and_space_and_the_previous_checkpoint_loads(small_disk):
    run_distributed(_fabric_worker, 2, str(small_disk))


def test_nvme_swap_on_a_full_disk_names_nvme_path_and_the_bytes(small_disk):
    from lightning_zero.offload.aio import SwapIOError
    from lightning_zero.offload.nvme_config import NvmeConfig
    from lightning_zero.offload.optimizer_swapper import attach_swapper, detach_swapper

    model = nn.Linear(128, 128)
    optimizer = torch.optim.Adam(model.parameters())
    swapper = attach_swapper(optimizer, NvmeConfig(str(small_disk)))
    check = swapper.check_free_space
    try:
        # full before the first step: refused by the space check, naming nvme_path, the bytes free and needed
        fill(str(small_disk), 0)
        model(torch.randn(2, 128)).sum().backward()
        with pytest.raises(SwapIOError, match=rf"nvme_path='{small_disk}' has \d+ bytes free but .* need about \d+ "):
            optimizer.step()
        os.remove(small_disk / "filler")

        def check_then_fill(*args, **kwargs):  # the check passes, then another job fills the disk
            check(*args, **kwargs)
            fill(str(small_disk), 0)

        swapper.check_free_space = check_then_fill
        with pytest.raises(SwapIOError) as full:
            optimizer.step()
        message = str(full.value)
        assert f"nvme_path ('{swapper.folder}') is full" in message, message
        assert re.search(r"\(\d+ more bytes were being written, \d+ bytes free\)", message), message
    finally:
        swapper.check_free_space = check
        if (small_disk / "filler").exists():
            os.remove(small_disk / "filler")
        detach_swapper(optimizer)
    assert os.listdir(small_disk) == [], "the swap files must be removed"
