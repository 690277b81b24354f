"""BatchNorm buffers at every stage: broadcast from rank 0 before a forward as DDP does (``broadcast_buffers``), and
checkpoints that hold rank 0's copy of every replicated tensor.

The model is a small conv + BatchNorm network written here (torchvision's ResNet-18 would be the natural choice, but
torchvision's wheel for this torch does not import beside its CPU build). Every rank sees different images, so each
rank's running statistics follow its own data unless they are broadcast.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero import ZeroConfig, ZeroStrategy, apply_zero
from lightning_zero.checkpoint.io import load_sharded_checkpoint, save_sharded_checkpoint
from lightning_zero.checkpoint.states import module_state_dict
from lightning_zero.fabric import ZeroStrategy as FabricZeroStrategy
from tests.lightning_models import full_state
from tests.ranks import run_distributed

BATCH = 4
CHANNELS = 8


class ConvBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(CHANNELS)

    def forward(self, x):
        return x + torch.relu(self.bn(self.conv(x)))


class ConvBNNet(nn.Module):
    """A stem (conv + BatchNorm, in the root unit at stages 2-3), two repeated blocks (their own units), a head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, CHANNELS, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(CHANNELS)
        self.blocks = nn.ModuleList(ConvBlock() for _ in range(2))
        self.head = nn.Linear(CHANNELS, 4)

    def forward(self, x):
        x = torch.relu(self.bn(self.stem(x)))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def images(n, seed):
    gen = torch.Generator().manual_seed(seed)
    # a per-sample offset: the batches of different ranks have clearly different statistics
    x = torch.randn(n, 3, 8, 8, generator=gen) + torch.linspace(-2, 2, n).view(n, 1, 1, 1)
    return TensorDataset(x, torch.randint(0, 4, (n,), generator=gen))


class BNModule(LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = ConvBNNet()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)  # self(x): a nested call of the FSDP2 root at stages 2-3

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self):
        return DataLoader(images(64, 1), batch_size=BATCH)  # Lightning adds the DistributedSampler: rank halves

    def val_dataloader(self):
        return DataLoader(images(16, 2), batch_size=BATCH)


def _trainer(strategy, world_size, *, accumulate=1, epochs=1, **kwargs):
    defaults = dict(
        accelerator="cpu",
        devices=world_size,
        max_epochs=epochs,
        limit_train_batches=3 * accumulate,
        accumulate_grad_batches=accumulate,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return Trainer(strategy=strategy, **{**defaults, **kwargs})


def _buffers(module: nn.Module) -> dict:
    return {name: buffer.detach().clone() for name, buffer in module.named_buffers()}


def _buffers_of_state(state: dict) -> dict:
    return {key: value for key, value in state.items() if "running" in key}


def _gathered(value) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _differ(first: dict, second: dict) -> bool:
    return any(not torch.equal(first[name], second[name]) for name in first if name.endswith("running_mean"))


# ---------------------------------------------------------------------------------------------- checkpoints


def _checkpoint_worker(rank, world_size, path, stage, async_save):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    module = ConvBNNet()
    apply_zero(module, init_device_mesh("cpu", (world_size,)), ZeroConfig(stage=stage, broadcast_buffers=False))
    module(images(8, 10 + rank).tensors[0]).sum().backward()  # each rank's running statistics: its own images
    own = _buffers(module)
    ranks = _gathered(own)
    assert _differ(ranks[0], ranks[1]), "the ranks' statistics should differ without broadcast_buffers"
    pending = save_sharded_checkpoint(path, {"state_dict": module_state_dict(module)}, {}, async_save=async_save)
    if pending is not None:
        pending.wait()
    # every rank reads the one copy the checkpoint holds
    stored = {name: torch.full_like(buffer, -1) for name, buffer in own.items()}
    load_sharded_checkpoint(path, {"state_dict": stored}, strict=False)
    for name, value in stored.items():
        torch.testing.assert_close(
            value,
            ranks[0][name],
            atol=0,
            rtol=0,
            msg=lambda m, name=name: f"stage {stage}: {name} is not rank 0's: {m}",
        )


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_holds_rank_zeros_buffers(tmp_path, stage, async_save):
    run_distributed(_checkpoint_worker, 2, str(tmp_path / f"s{stage}.ckpt"), stage, async_save)


# ---------------------------------------------------------------------------------------------- broadcast


class _RecordBuffers(Callback):
    """This rank's buffers after every training batch (micro-batch under accumulation): between two broadcasts
    rank 1's follow its own data, and a broadcast too many or too few shows here."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(_buffers(pl_module))


def _fit(strategy, world_size, accumulate):
    module, record = BNModule(), _RecordBuffers()
    trainer = _trainer(strategy, world_size, accumulate=accumulate, callbacks=[record])
    trainer.fit(module)
    return full_state(module), record.seen, trainer.callback_metrics["val_loss"].item()


def _parity_worker(rank, world_size, accumulate):
    from lightning.pytorch.strategies import DDPStrategy

    ddp_state, ddp_seen, ddp_loss = _fit(DDPStrategy(), world_size, accumulate)
    for stage in (2, 3):
        state, seen, loss = _fit(ZeroStrategy(stage=stage), world_size, accumulate)
        for batch, (got, expected) in enumerate(zip(seen, ddp_seen, strict=True)):
            for key, value in expected.items():
                torch.testing.assert_close(
                    got[key],
                    value,
                    atol=1e-5,
                    rtol=1e-5,
                    msg=lambda m, key=key, batch=batch: f"stage {stage} vs DDP, rank {rank}, batch {batch}: {key}: {m}",
                )
        for key, value in ddp_state.items():  # weights and buffers, this rank's
            torch.testing.assert_close(
                state[key],
                value,
                atol=1e-5,
                rtol=1e-5,
                msg=lambda m, key=key: f"stage {stage} vs DDP on rank {rank}: {key}: {m}",
            )
        assert abs(loss - ddp_loss) <= 1e-5, f"stage {stage}: synced val_loss {loss} vs DDP's {ddp_loss}"
        ranks = _gathered(_buffers_of_state(state))
        assert not _differ(*ranks), f"stage {stage}: the ranks' buffers differ after validation's broadcast"

    # broadcast_buffers=False: each rank's statistics are its own
    state, _, _ = _fit(ZeroStrategy(stage=3, broadcast_buffers=False), world_size, accumulate)
    assert _differ(*_gathered(_buffers_of_state(state))), "broadcast_buffers=False should leave each rank its own"


@pytest.mark.parametrize("accumulate", [1, 2])
def test_stages_2_3_broadcast_buffers_as_ddp(accumulate):
    """DDP broadcasts before every synchronised forward: with accumulation once per optimizer step, not per
    micro-batch; stages 2-3 must follow the same schedule to give the same statistics."""
    run_distributed(_parity_worker, 2, accumulate)


class _RecordDDP(Callback):
    def on_train_start(self, trainer, pl_module):
        self.broadcast = trainer.strategy.model.broadcast_buffers


def _ddp_option_worker(rank, world_size):
    for stage in (0, 1):
        for given in (None, False):
            record = _RecordDDP()
            module = BNModule()
            strategy = (
                ZeroStrategy(stage=stage) if given is None else ZeroStrategy(stage=stage, broadcast_buffers=given)
            )
            _trainer(strategy, world_size, callbacks=[record]).fit(module)  # validation broadcasts first
            assert record.broadcast is (given is not False), f"stage {stage}, broadcast_buffers={given}"
            assert _differ(*_gathered(_buffers(module))) is (given is False), f"stage {stage}, {given}"
    # apply_zero's own DDP arguments may not say otherwise than the config
    from torch.distributed.device_mesh import init_device_mesh

    with pytest.raises(ValueError, match="contradict ZeroConfig"):
        apply_zero(
            ConvBNNet(),
            init_device_mesh("cpu", (world_size,)),
            ZeroConfig(stage=0),
            ddp_kwargs={"broadcast_buffers": False},
        )


def test_stages_0_1_pass_broadcast_buffers_to_ddp():
    run_distributed(_ddp_option_worker, 2)


def _fabric_buffers(stage, rank, world_size):
    """This rank's buffers after every micro-step of two optimizer steps of two micro-steps each, under Fabric."""
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=FabricZeroStrategy(stage=stage))
    fabric.launch()  # the ranks already exist (tests.ranks)
    torch.manual_seed(0)
    model = ConvBNNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    seen = []
    for step in range(2):
        for micro in range(2):
            x, y = images(BATCH, 100 + 10 * step + 2 * micro + rank).tensors
            with fabric.no_backward_sync(model, enabled=micro == 0):
                fabric.backward(nn.functional.cross_entropy(model(x), y))
            seen.append(_buffers(model.module))
        optimizer.step()
        optimizer.zero_grad()
    return seen


def _fabric_worker(rank, world_size):
    expected = _fabric_buffers(0, rank, world_size)  # DDP
    for stage in (2, 3):
        for micro, (got, want) in enumerate(zip(_fabric_buffers(stage, rank, world_size), expected, strict=True)):
            for key, value in want.items():
                torch.testing.assert_close(
                    got[key],
                    value,
                    atol=1e-5,
                    rtol=1e-5,
                    msg=lambda m, key=key, micro=micro: f"stage {stage}, rank {rank}, micro-step {micro}: {key}: {m}",
                )


def test_fabric_broadcasts_buffers_as_ddp():
    run_distributed(_fabric_worker, 2)


# ---------------------------------------------------------------------------------------------- resume


def _resume_worker(rank, world_size, root, stage):
    whole = BNModule()
    _trainer(ZeroStrategy(stage=stage), world_size, epochs=2, limit_val_batches=0).fit(whole)
    first = BNModule()
    trainer = _trainer(ZeroStrategy(stage=stage), world_size, limit_val_batches=0)
    trainer.fit(first)
    path = os.path.join(root, "epoch1.ckpt")
    trainer.save_checkpoint(path)
    resumed = BNModule()
    _trainer(ZeroStrategy(stage=stage), world_size, epochs=2, limit_val_batches=0).fit(resumed, ckpt_path=path)
    expected, got = full_state(whole), full_state(resumed)
    for key, value in expected.items():
        torch.testing.assert_close(
            got[key], value, atol=1e-5, rtol=1e-5, msg=lambda m, key=key: f"stage {stage}, rank {rank}: {key}: {m}"
        )


@pytest.mark.parametrize("stage", [2, 3])
def test_a_resume_continues_the_statistics_of_an_uninterrupted_run(tmp_path, stage):
    run_distributed(_resume_worker, 2, str(tmp_path), stage)


# ---------------------------------------------------------------------------------------------- arguments


@pytest.mark.parametrize("strategy", [ZeroStrategy, FabricZeroStrategy])
def test_broadcast_buffers_is_validated(strategy):
    assert strategy(stage=3).zero_config.broadcast_buffers is True
    assert strategy(stage=2, broadcast_buffers=False).zero_config.broadcast_buffers is False
    with pytest.raises(TypeError, match="broadcast_buffers must be True or False"):
        strategy(stage=2, broadcast_buffers="false")
    with pytest.raises(TypeError, match="broadcast_buffers must be True or False"):
        ZeroConfig(stage=0, broadcast_buffers=1)
    assert strategy(stage=1, pipeline_parallel_size=2).zero_config.broadcast_buffers is False
    with pytest.raises(ValueError, match="broadcast_buffers=True: a pipeline"):
        strategy(stage=1, pipeline_parallel_size=2, broadcast_buffers=True)
