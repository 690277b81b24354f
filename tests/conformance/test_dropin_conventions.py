"""Lightning's own tests of DeepSpeedStrategy/DDPStrategy conventions, ported to ZeroStrategy.

Each test names the Lightning test it ports (``tests/tests_pytorch/strategies/...``); the scenario and the
assertions follow it, written for this package (2 CPU ranks on gloo instead of a GPU, a sharded checkpoint
directory instead of DeepSpeed's). Where ZeroStrategy is stricter or reports more, the test says so.
"""

import json
import os

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.demos.boring_classes import BoringModel

import lightning_zero  # noqa: F401  (registers the strategy names)
from lightning_zero import ZeroStrategy
from lightning_zero.ds_config import DeepSpeedConfigError, DeepSpeedConfigWarning
from tests.ranks import run_distributed


@pytest.fixture
def deepspeed_config():
    """Lightning's ``deepspeed_config`` fixture: a config optimizer and scheduler."""
    return {
        "optimizer": {"type": "SGD", "params": {"lr": 3e-5}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"last_batch_iteration": -1, "warmup_min_lr": 0, "warmup_max_lr": 3e-5, "warmup_num_steps": 100},
        },
    }


def _contains(effective, given):
    """Every key of ``given`` is in ``effective`` with the same value (the effective config adds defaults)."""
    if isinstance(given, dict):
        return isinstance(effective, dict) and all(
            k in effective and _contains(effective[k], v) for k, v in given.items()
        )
    return effective == given


def _trainer(strategy, world_size=2, **kwargs):
    defaults = dict(
        accelerator="cpu",
        devices=world_size,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    defaults.update(kwargs)
    return Trainer(strategy=strategy, **defaults)


# ---------------------------------------------------------------- config from PL_DEEPSPEED_CONFIG_PATH


def test_deepspeed_with_env_path(tmp_path, monkeypatch, deepspeed_config):
    """Ports ``test_deepspeed.py::test_deepspeed_with_env_path``: no ``config=``, the env variable's file is read.
    Lightning compares ``strategy.config == deepspeed_config``; ZeroStrategy's is the effective config (DeepSpeed's
    defaults filled in), so every key of the file must be in it unchanged."""
    config_path = tmp_path / "temp.json"
    config_path.write_text(json.dumps(deepspeed_config))
    monkeypatch.setenv("PL_DEEPSPEED_CONFIG_PATH", str(config_path))
    strategy = ZeroStrategy()
    assert _contains(strategy.config, deepspeed_config)


def test_deepspeed_strategy_env(tmp_path, monkeypatch, deepspeed_config):
    """Ports ``test_deepspeed.py::test_deepspeed_strategy_env``: the strategy chosen by name reads the variable."""
    config_path = tmp_path / "temp.json"
    config_path.write_text(json.dumps({**deepspeed_config, "zero_optimization": {"stage": 3}}))
    monkeypatch.setenv("PL_DEEPSPEED_CONFIG_PATH", str(config_path))
    trainer = Trainer(
        accelerator="cpu", devices=1, fast_dev_run=True, default_root_dir=tmp_path, strategy="zero", logger=False
    )
    strategy = trainer.strategy
    assert isinstance(strategy, ZeroStrategy)
    assert strategy.parallel_devices == [torch.device("cpu")]
    assert _contains(strategy.config, deepspeed_config)
    # "zero", like Lightning's "deepspeed", names no stage: the config's applies (this asserted stage 2 before issue
    # 28 found that the name trained at stage 2 while the startup table printed the config's 3)
    assert strategy.stage == 3 and strategy.config["zero_optimization"]["stage"] == 3


def test_deepspeed_with_invalid_config_path():
    """Ports ``test_deepspeed.py::test_deepspeed_with_invalid_config_path``."""
    with pytest.raises(DeepSpeedConfigError, match="invalid_path.json.*does not exist"):
        ZeroStrategy(config="invalid_path.json")


def test_deepspeed_with_invalid_env_path(monkeypatch):
    """Not in Lightning (which fails later, inside ``open``): a variable naming no file is refused up front."""
    monkeypatch.setenv("PL_DEEPSPEED_CONFIG_PATH", "invalid_path.json")
    with pytest.raises(DeepSpeedConfigError, match="PL_DEEPSPEED_CONFIG_PATH='invalid_path.json' does not name"):
        ZeroStrategy()


def test_deepspeed_defaults(monkeypatch):
    """Ports ``test_deepspeed.py::test_deepspeed_defaults``: without any config, ``strategy.config`` still holds
    the ZeRO section."""
    monkeypatch.delenv("PL_DEEPSPEED_CONFIG_PATH", raising=False)
    strategy = ZeroStrategy()
    assert strategy.config is not None
    assert isinstance(strategy.config["zero_optimization"], dict)


# ---------------------------------------------------------------- find_unused_parameters, config optimizer, frozen


class UnusedParametersModel(BoringModel):
    """Lightning's ``UnusedParametersModel`` (``test_ddp_integration.py``): a layer run under ``no_grad``."""

    def __init__(self):
        super().__init__()
        self.intermediate_layer = torch.nn.Linear(32, 32)

    def training_step(self, batch, batch_idx):
        with torch.no_grad():
            batch = self.intermediate_layer(batch)
        return super().training_step(batch, batch_idx)


class FrozenParamsModel(BoringModel):
    """Lightning's model of ``test_deepspeed_strategy_exclude_frozen_parameters_integration``."""

    def __init__(self):
        super().__init__()
        self.frozen_layer = torch.nn.Linear(32, 32)

    def configure_model(self) -> None:
        super().configure_model()
        for param in self.frozen_layer.parameters():
            param.requires_grad = False

    def forward(self, x):
        return super().forward(self.frozen_layer(x))


class _CheckConfigOptimizer(Callback):
    """``test_deepspeed_config``'s callback: the config's SGD and WarmupLR are what trains, stepped per step."""

    def on_train_start(self, trainer, pl_module):
        from lightning_zero.ops.lr_schedules import WarmupLR

        assert isinstance(trainer.optimizers[0], torch.optim.SGD)
        assert isinstance(trainer.lr_scheduler_configs[0].scheduler, WarmupLR)
        assert trainer.lr_scheduler_configs[0].interval == "step"


def _conventions_worker(rank, world_size, tmp_path, deepspeed_config):
    import warnings

    # test_ddp_integration.py::test_find_unused_parameters_ddp_exception: the error tells how to allow it
    for stage in (0, 1):
        with pytest.raises(RuntimeError, match=rf"ZeroStrategy\(stage={stage}, find_unused_parameters=True\)"):
            _trainer(ZeroStrategy(stage=stage), max_steps=2).fit(UnusedParametersModel())
        # ... and with the option (Lightning's ddp_find_unused_parameters_true) the same model trains
        trainer = _trainer(ZeroStrategy(stage=stage, find_unused_parameters=True), max_steps=2)
        trainer.fit(UnusedParametersModel())
        assert trainer.global_step == 2

    # test_deepspeed.py::test_deepspeed_config: a config with an optimizer and scheduler, and a BoringModel that
    # defines configure_optimizers too: the config's are used (DeepSpeedStrategy does the same; ZeroStrategy warns)
    config = {**deepspeed_config, "zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 1}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", DeepSpeedConfigWarning)
        trainer = _trainer(ZeroStrategy(config=config), max_steps=4, callbacks=[_CheckConfigOptimizer()])
        trainer.fit(BoringModel())
    if rank == 0:
        assert any("BoringModel.configure_optimizers" in str(w.message) for w in caught)

    # test_deepspeed.py::test_deepspeed_strategy_exclude_frozen_parameters_integration, with the checkpoint's
    # contents checked (Lightning only checks that it exists)
    model = FrozenParamsModel()
    trainer = _trainer(
        ZeroStrategy(stage=3, exclude_frozen_parameters=True), fast_dev_run=True, default_root_dir=tmp_path
    )
    trainer.fit(model)
    checkpoint_path = os.path.join(tmp_path, "checkpoint_exclude_frozen.ckpt")
    trainer.save_checkpoint(checkpoint_path)
    assert os.path.exists(checkpoint_path)
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(checkpoint_path).read_metadata().state_dict_metadata
    assert not any("frozen_layer" in key for key in keys) and any("state_dict.layer.weight" in key for key in keys)


def test_dropin_conventions_on_two_ranks(tmp_path, deepspeed_config):
    run_distributed(_conventions_worker, 2, str(tmp_path), deepspeed_config)
