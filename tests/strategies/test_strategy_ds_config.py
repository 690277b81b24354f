"""ZeroStrategy(config=ds_config) inside a real Trainer: settings, "auto" resolution, optimizer/scheduler, errors."""

import json
import os

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.ds_config import DeepSpeedConfigError
from tests.lightning_models import RegressionModule, dataset, full_state
from tests.ranks import run_distributed

BATCH = 4


class ConfigOptimizedModule(RegressionModule):
    """No configure_optimizers: the ds_config's optimizer is used. ``lr`` is a hyperparameter for "auto"."""

    def __init__(self, batch_size=BATCH, lr=1e-2):
        super().__init__(batch_size=batch_size)
        self.save_hyperparameters()

    configure_optimizers = LightningModule.configure_optimizers  # not overridden: the config's optimizer is used


def _trainer(strategy, world_size, **kwargs):
    defaults = dict(
        accelerator="cpu",
        devices=world_size,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    defaults.update(kwargs)
    return Trainer(strategy=strategy, **defaults)


def _reference(steps, global_batch, accumulate, clip, lr=1e-2):
    """Plain AdamW over all parameters (the config's optimizer), on the same global batches."""
    torch.manual_seed(0)
    module = RegressionModule()
    optimizer = torch.optim.AdamW(module.parameters(), lr=lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
    x_all, y_all = dataset().tensors
    order = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(0))
    micro = global_batch // accumulate
    world = global_batch // accumulate // BATCH
    for step in range(steps):
        for k in range(accumulate):
            # DistributedSampler interleaves ranks; each rank's k-th micro-batch takes BATCH of its own samples
            rows = []
            for r in range(world):
                own = order[r::world]
                rows.append(own[(step * accumulate + k) * BATCH : (step * accumulate + k + 1) * BATCH])
            idx = torch.cat(rows)
            loss = nn.functional.mse_loss(module(x_all[idx]), y_all[idx]) / accumulate
            loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    assert micro == BATCH * world
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


CONFIG = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.05,
    "steps_per_print": 7,
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": 0.0, "torch_adam": True},
    },
}


def _config_drives_everything_worker(rank, world_size, root):
    torch.manual_seed(0)
    module = ConfigOptimizedModule()
    strategy = ZeroStrategy(config=CONFIG)
    assert (strategy.stage, strategy.zero_config.offload) == (3, "cpu")
    trainer = _trainer(strategy, world_size, default_root_dir=root)
    trainer.fit(module)
    assert trainer.accumulate_grad_batches == 2 and trainer.gradient_clip_val == 0.05
    assert trainer.log_every_n_steps == 7
    resolved = strategy.ds_config.translation.effective
    assert resolved["train_batch_size"] == BATCH * 2 * world_size
    assert resolved["train_micro_batch_size_per_gpu"] == BATCH
    assert resolved["optimizer"]["params"]["lr"] == 1e-2  # from the module's hparams
    assert isinstance(trainer.optimizers[0], torch.optim.AdamW)
    expected = _reference(4, BATCH * 2 * world_size, 2, 0.05)
    got = full_state(module)
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= 1e-5, f"config-driven run differs from the reference by {worst:.2e}"
    path = os.path.join(root, "cfg.ckpt")
    trainer.save_checkpoint(path)
    if rank == 0:
        info = json.load(open(os.path.join(path, "zero.json")))
        assert info["ds_config"]["effective"]["zero_optimization"]["stage"] == 3
        assert info["ds_config"]["strategy_kwargs"]["offload"] == "cpu"


def test_config_sets_strategy_trainer_optimizer_and_auto_values(tmp_path):
    run_distributed(_config_drives_everything_worker, 2, str(tmp_path))


def _scheduler_and_precision_worker(rank, world_size):
    # A config scheduler over the module's own optimizer; bf16 from the config replaces the Trainer's default fp32.
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.5, "warmup_num_steps": 4, "warmup_type": "linear"},
        },
    }

    class OwnOptimizer(RegressionModule):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    trainer = _trainer(ZeroStrategy(config=config), world_size, max_steps=2)
    trainer.fit(OwnOptimizer(batch_size=BATCH))
    assert trainer.precision == "bf16-mixed"
    assert trainer.strategy.precision_plugin.low_dtype is torch.bfloat16
    # DeepSpeed's linear warm-up after 2 scheduler steps (last_batch_iteration = 1): max_lr * 1 / warmup_num_steps
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.5 * 1 / 4)

    # fp16 in the config with loss-scale knobs: the scaler starts at 2**initial_scale_power
    fp16 = {
        "train_micro_batch_size_per_gpu": BATCH,
        "fp16": {"enabled": True, "initial_scale_power": 9, "hysteresis": 3},
    }
    trainer = _trainer(ZeroStrategy(config=fp16, stage=1), world_size, max_steps=1, precision="16-true")
    trainer.fit(RegressionModule(batch_size=BATCH))
    scaler = trainer.strategy.precision_plugin.scaler
    assert scaler.initial_scale_power == 9 and scaler.hysteresis == 3

    # batch sizes that contradict the DataLoader fail with DeepSpeed's arithmetic spelled out
    bad = {"train_batch_size": 999, "train_micro_batch_size_per_gpu": BATCH}
    with pytest.raises(DeepSpeedConfigError, match="batch sizes do not add up"):
        _trainer(ZeroStrategy(config=bad), world_size, max_steps=1).fit(RegressionModule(batch_size=BATCH))

    # a config optimizer and configure_optimizers both: the config's wins (tests/strategies/test_dropin.py)

    # fp16 in the config, bf16 in the Trainer: no silent choice
    with pytest.raises(DeepSpeedConfigError, match="make them agree"):
        _trainer(ZeroStrategy(config={"fp16": {"enabled": True}}), world_size, max_steps=1, precision="bf16-mixed").fit(
            RegressionModule(batch_size=BATCH)
        )

    # an "auto" with no source names the key and where it looked
    no_lr = {"optimizer": {"type": "SGD", "params": {"lr": "auto"}}}
    with pytest.raises(DeepSpeedConfigError, match=r"optimizer\.params\.lr.*looked at"):
        _trainer(ZeroStrategy(config=no_lr), world_size, max_steps=1).fit(_NoHparams(batch_size=BATCH))


class _NoHparams(RegressionModule):
    configure_optimizers = LightningModule.configure_optimizers


def test_config_scheduler_precision_adoption_and_setup_errors():
    run_distributed(_scheduler_and_precision_worker, 2)


def test_explicit_arguments_override_the_config(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_param": {"device": "cpu"},
                    "offload_optimizer": {"device": "cpu"},
                },
                "communication_data_type": "bf16",
            }
        )
    )
    strategy = ZeroStrategy(config=str(path))
    settings = strategy.settings
    assert (strategy.stage, strategy.zero_config.offload, settings.communication_data_type) == (3, "cpu", "bf16")
    with pytest.warns(UserWarning, match="offload_param has no effect at stage 2"):  # as DeepSpeed ignores it
        strategy = ZeroStrategy(config=str(path), stage=2, communication_data_type="fp32")
    settings = strategy.settings
    assert (strategy.stage, strategy.zero_config.offload, settings.communication_data_type) == (2, "cpu", "fp32")
    assert strategy.zero_config.offload_params == "none"


@pytest.mark.parametrize(
    "config,message",
    [
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "nvme_path is missing"),
        ({"zero_optimizatoin": {"stage": 2}}, "zero_optimization"),
        ({"sparse_attention": {"mode": "fixed"}}, "sparse_attention"),
    ],
)
def test_config_errors_happen_in_the_constructor(config, message):
    with pytest.raises((DeepSpeedConfigError, NotImplementedError), match=message):
        ZeroStrategy(config=config)


def test_pipeline_section_sets_the_pipeline():
    strategy = ZeroStrategy(
        config={"pipeline": {"stages": 2}, "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 1}}
    )
    settings = strategy.settings.pipeline
    assert (settings.pipeline_parallel_size, settings.micro_batches, strategy.stage) == (2, 4, 1)
    assert ZeroStrategy(config={"pipeline": {"stages": 1}}).settings.pipeline.enabled is False


def test_non_strict_config_warns_instead():
    from lightning_zero.ds_config import DeepSpeedConfigWarning

    with pytest.warns(DeepSpeedConfigWarning, match="zero_optimizatoin"):
        strategy = ZeroStrategy(config={"zero_optimizatoin": {"stage": 3}}, strict=False)
    assert strategy.stage == 0  # the misspelt section is ignored, so DeepSpeed's default (no ZeRO) applies


def _wall_clock_worker(rank, world_size):
    from lightning_zero.ds_config import DeepSpeedConfigWarning

    config = {"train_micro_batch_size_per_gpu": BATCH, "wall_clock_breakdown": True}
    with pytest.warns(DeepSpeedConfigWarning, match="ThroughputLogger"):
        _trainer(ZeroStrategy(config=config), world_size, max_steps=1).fit(RegressionModule(batch_size=BATCH))


def test_wall_clock_breakdown_points_at_the_throughput_logger():
    run_distributed(_wall_clock_worker, 2)
