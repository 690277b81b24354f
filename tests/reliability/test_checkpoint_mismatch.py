"""Loading a checkpoint into a model or optimizers that differ from the saved ones: a clear CheckpointError listing
missing, unexpected and shape-mismatched keys, or naming the optimizer types or counts; ``strict=False`` /
``LightningModule.strict_loading = False`` relaxes only missing and unexpected keys."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import CheckpointError, load_sharded_checkpoint, save_sharded_checkpoint
from tests.lightning_models import full_state


def stack(blocks: int, width: int = 4, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(blocks)])


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "three.ckpt"
    model = stack(3)
    save_sharded_checkpoint(path, {"state_dict": model.state_dict()}, {"epoch": 0})
    return path, {k: v.clone() for k, v in model.state_dict().items()}


def test_fewer_blocks_than_the_checkpoint_is_an_error_listing_the_unexpected_keys(saved):
    path, stored = saved
    model = stack(2, seed=1)
    with pytest.raises(
        CheckpointError,
        match=r"2 unexpected keys \(in the checkpoint, not in the target\): "
        r"state_dict\.2\.weight, state_dict\.2\.bias\.",
    ) as raised:
        load_sharded_checkpoint(path, {"state_dict": model.state_dict()})
    assert "missing" not in str(raised.value).split("strict=False")[0]
    load_sharded_checkpoint(path, {"state_dict": model.state_dict()}, strict=False)  # the kept blocks load
    assert all(torch.equal(v, stored[k]) for k, v in model.state_dict().items())


def test_more_blocks_than_the_checkpoint_is_an_error_listing_the_missing_keys(saved):
    path, stored = saved
    model = stack(4, seed=1)
    new_block = {k: v.clone() for k, v in model[3].state_dict().items()}
    with pytest.raises(
        CheckpointError,
        match=r"2 missing keys \(in the target, not in the checkpoint\): "
        r"state_dict\.3\.weight, state_dict\.3\.bias",
    ):
        load_sharded_checkpoint(path, {"state_dict": model.state_dict()})
    load_sharded_checkpoint(path, {"state_dict": model.state_dict()}, strict=False)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in stored.items())
    assert all(torch.equal(model[3].state_dict()[k], v) for k, v in new_block.items())  # kept its own values


def test_shape_mismatch_is_an_error_even_when_not_strict(saved):
    path, _ = saved
    model = stack(3, width=5)
    for strict in (True, False):
        with pytest.raises(
            CheckpointError,
            match=r"6 shape mismatches: state_dict\.0\.weight \(checkpoint: \[4, 4\], "
            r"target: \[5, 5\]\)",
        ):
            load_sharded_checkpoint(path, {"state_dict": model.state_dict()}, strict=strict)


def test_long_listings_name_the_first_keys_and_count_the_rest(tmp_path):
    path = tmp_path / "deep.ckpt"
    save_sharded_checkpoint(path, {"state_dict": stack(12).state_dict()}, {"epoch": 0})
    with pytest.raises(CheckpointError, match=r"22 unexpected keys .*state_dict\.3\.weight, \.\.\. \(17 more\)"):
        load_sharded_checkpoint(path, {"state_dict": stack(1).state_dict()})


# ------------------------------------------------------------------ through the Trainer
class Blocks(LightningModule):
    def __init__(
        self, blocks: int = 2, optimizer: str = "adamw", optimizers: int = 1, width: int = 4, strict: bool = True
    ) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Linear(width, width) for _ in range(blocks)])
        self.kind, self.count, self.strict_loading = optimizer, optimizers, strict
        self.automatic_optimization = optimizers == 1

    def training_step(self, batch, batch_idx):
        loss = self.blocks(batch[0]).pow(2).mean()
        if self.automatic_optimization:
            return loss
        optimizers = self.optimizers()
        self.manual_backward(loss)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self):
        if self.count == 2:
            return [torch.optim.AdamW(self.blocks[0].parameters()), torch.optim.AdamW(self.blocks[1:].parameters())]
        return {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[self.kind](self.parameters(), lr=0.1)

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(8, self.blocks[0].in_features)), batch_size=4)


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_left_behind():
    # A one-device Trainer in this process initialises the default process group and, like Lightning's DDP, leaves
    # it: later tests that fork ranks (tests.ranks) would inherit it.
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _fit(module: LightningModule, root, ckpt_path=None) -> Trainer:
    # max_steps equals the saved step count: a resume restores and stops, so the weights are the loaded ones
    trainer = Trainer(
        strategy=ZeroStrategy(stage=2),
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=root,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("trained")
    torch.manual_seed(0)
    module = Blocks()
    _fit(module, root).save_checkpoint(root / "two.ckpt")
    return root / "two.ckpt", full_state(module)


def test_strict_loading_false_is_honoured_for_missing_and_unexpected_keys(trained, tmp_path):
    path, stored = trained
    with pytest.raises(CheckpointError, match=r"missing keys .*state_dict\.blocks\.2\.weight"):
        _fit(Blocks(blocks=3), tmp_path, path)
    torch.manual_seed(1)
    more = Blocks(blocks=3, strict=False)
    new_block = {f"blocks.2.{k}": v.clone() for k, v in more.blocks[2].state_dict().items()}
    trainer = _fit(more, tmp_path, path)
    # the new block has no stored optimizer state: it starts fresh, not with the zero placeholder of a taken step
    assert len(trainer.optimizers[0].state) == 4
    loaded = full_state(more)
    assert all(torch.equal(loaded[k], v) for k, v in {**stored, **new_block}.items())
    with pytest.raises(CheckpointError, match=r"unexpected keys .*state_dict\.blocks\.1\.weight"):
        _fit(Blocks(blocks=1), tmp_path, path)
    fewer = Blocks(blocks=1, strict=False)
    _fit(fewer, tmp_path, path)
    assert torch.equal(full_state(fewer)["blocks.0.weight"], stored["blocks.0.weight"])
    with pytest.raises(CheckpointError, match=r"shape mismatches: state_dict\.blocks\.0\.weight"):
        _fit(Blocks(width=5, strict=False), tmp_path, path)


def test_another_optimizer_type_is_refused(trained, tmp_path):
    path, _ = trained
    with pytest.raises(
        CheckpointError,
        match=r"optimizer type mismatch \(#0: checkpoint torch\.optim\.adamw\.AdamW, "
        r"now torch\.optim\.sgd\.SGD\)",
    ):
        _fit(Blocks(optimizer="sgd"), tmp_path, path)


def test_another_number_of_optimizers_is_refused(trained, tmp_path):
    path, _ = trained
    with pytest.raises(
        RuntimeError,
        match=r"the checkpoint holds the states of 1 optimizer\(s\), the model being "
        r"resumed has 2",
    ):
        _fit(Blocks(optimizers=2), tmp_path, path)
