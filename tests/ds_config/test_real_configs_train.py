"""Every ds_config shown in ../shared/seeds, brought unchanged to ZeroStrategy(config=...): it trains on 2 CPU ranks, or
fails naming exactly what is not supported. One test per seed config."""

import os
import warnings

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer

from lightning_zero import ZeroStrategy
from tests.ds_config.test_ds_config import SEEDS
from tests.lightning_models import RegressionModule, full_state
from tests.ranks import run_distributed

# name -> None (trains), or the regex of the error that names what is unsupported
OUTCOMES = {
    "zero3_fp16_adamw": None,
    "zero3_offload_optimizer": None,
    "zero3_offload_all": None,
    "zero3_nvme": None,
    "dschat_train": None,
    "getting_started": None,
    "zero3_cpu_full": None,
    "stage2_buckets": None,
    "nvme_knobs": None,
    "fp16_all_keys": None,
    "hf_auto": None,
}
STEPS = 2
# fp16 configs start at DeepSpeed's scale 2**16, and the first steps may overflow and be skipped, as in DeepSpeed
FP16_STEPS = 6


class SeedModule(RegressionModule):
    """Hyper-parameters for the configs' "auto" values; the optimizer comes from the config when it has one."""

    def __init__(self):
        super().__init__(batch_size=4)
        self.save_hyperparameters(dict(lr=1e-3, eps=1e-8, weight_decay=0.0, warmup_steps=1, hidden_size=16))


class ConfigOptimizedSeedModule(SeedModule):
    configure_optimizers = LightningModule.configure_optimizers  # not overridden: the config's optimizer is used


def _on_this_machine(config, nvme_root):
    """The config with every ``nvme_path`` pointing at a directory of this machine (the seeds name /nvme_data and
    /dev/shm); nothing else changes."""
    if isinstance(config, dict):
        return {k: (nvme_root if k == "nvme_path" else _on_this_machine(v, nvme_root)) for k, v in config.items()}
    return config


def _train_worker(rank, world_size, name, nvme_root):
    config = _on_this_machine(SEEDS[name][0], nvme_root)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no-effect notes are warned; their content is tested in test_ds_config
        strategy = ZeroStrategy(config=config)
    module = ConfigOptimizedSeedModule() if "optimizer" in config else SeedModule()
    before = full_state(module)
    fp16 = SEEDS[name][2] == "16-mixed"
    steps = FP16_STEPS if fp16 else STEPS
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world_size,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(module)
    assert trainer.global_step == steps
    if fp16:
        scaler = trainer.strategy.precision_plugin.scaler
        assert scaler.skipped_steps < steps, f"{name}: every fp16 step overflowed"
    after = full_state(module)
    assert all(torch.isfinite(v).all() for v in after.values()), name
    assert any(not torch.equal(before[k], after[k]) for k in before), f"{name}: no weight changed"
    expected_precision = SEEDS[name][2] or "32-true"
    assert trainer.precision == expected_precision, (name, trainer.precision)


@pytest.mark.parametrize("name", sorted(SEEDS))
def test_seed_config_trains_or_names_what_is_unsupported(name, tmp_path):
    assert set(OUTCOMES) == set(SEEDS), "every seed config needs a stated outcome"
    failure = OUTCOMES[name]
    if failure is None:
        run_distributed(_train_worker, 2, name, str(tmp_path))
        assert os.listdir(tmp_path) == [], "NVMe swap files must be gone after the run"
    else:
        with pytest.raises(NotImplementedError, match=failure):
            ZeroStrategy(config=SEEDS[name][0])
