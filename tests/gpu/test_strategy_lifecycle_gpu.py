"""CUDA side of tests/strategies/test_strategy_lifecycle.py: sync_batchnorm really converts (SyncBatchNorm runs only
on GPU), and teardown leaves a sharded module on the GPU so a later test/fit still computes there."""

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback

from lightning_zero import ZeroStrategy
from tests.lightning_models import RegressionModule
from tests.ranks import free_port
from tests.strategies.test_strategy_lifecycle import WithBatchNorm

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_trainer(stage, tmp_path, **kwargs):
    return Trainer(
        accelerator="gpu",
        devices=1,
        strategy=ZeroStrategy(stage=stage),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **kwargs,
    )


class RecordNorm(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen = type(pl_module.norm)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_sync_batchnorm_converts_and_trains_on_gpu(stage, monkeypatch, tmp_path):
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    recorder = RecordNorm()
    module = WithBatchNorm()
    make_trainer(stage, tmp_path, sync_batchnorm=True, callbacks=[recorder]).fit(module)
    assert recorder.seen is torch.nn.SyncBatchNorm
    assert module.norm.num_batches_tracked.item() == 2  # buffers stay whole under FSDP2; the layer really ran
    torch.distributed.destroy_process_group()


def test_sharded_module_stays_on_gpu_after_fit_and_evaluation(monkeypatch, tmp_path):
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    module = RegressionModule()
    trainer = make_trainer(3, tmp_path, limit_val_batches=2)
    trainer.fit(module)
    assert all(p.device.type == "cuda" for p in module.parameters()), "teardown moved the shards off the GPU"
    with torch.inference_mode():
        trainer.validate(module, verbose=False)
    trainer.test(module, verbose=False)
    assert all(p.device.type == "cuda" for p in module.parameters())
    make_trainer(3, tmp_path).fit(module)
    assert all(p.device.type == "cuda" for p in module.parameters())
    torch.distributed.destroy_process_group()
