"""What ZeroStrategy does around training: layer sync (``sync_batchnorm``), refused callbacks, and teardown that
neither deletes what the user owns nor moves a sharded module (see ``lightning_zero/strategies/lifecycle.py``)."""

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging
from lightning.pytorch.plugins.layer_sync import LayerSync
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.distributed.optimizer import get_sharding
from tests.lightning_models import RegressionModule, full_state
from tests.ranks import run_distributed

WORLD = 2


def make_trainer(stage, devices=WORLD, **kwargs):
    defaults = dict(
        accelerator="cpu",
        devices=devices,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return Trainer(strategy=ZeroStrategy(stage=stage), **{**defaults, **kwargs})


def test_sync_batchnorm_off_gpu_is_refused_before_any_process_group():
    trainer = make_trainer(2, devices=1, sync_batchnorm=True)
    with pytest.raises(ValueError, match=r"sync_batchnorm=True.*computes on 'cpu'"):
        trainer.fit(RegressionModule())
    assert not dist.is_initialized()


@pytest.mark.parametrize("stage", [2, 3])
def test_stochastic_weight_averaging_at_sharded_stages_is_refused_before_training(stage):
    trainer = make_trainer(stage, devices=1, callbacks=[StochasticWeightAveraging(swa_lrs=1e-2)])
    module = RegressionModule()
    before = full_state(module)
    with pytest.raises(ValueError, match=rf"StochasticWeightAveraging.*stage={stage}"):
        trainer.fit(module)
    assert not dist.is_initialized()
    assert all(torch.equal(before[k], v) for k, v in full_state(module).items())


class MarkedBatchNorm(nn.BatchNorm1d):
    """What the recording layer sync swaps in (a CPU stand-in for SyncBatchNorm, which torch runs only on GPU)."""


class RecordingSync(LayerSync):
    def apply(self, model):
        for name, child in list(model.named_children()):
            if type(child) is nn.BatchNorm1d:
                marked = MarkedBatchNorm(child.num_features)
                marked.load_state_dict(child.state_dict())
                setattr(model, name, marked)
        return model

    def revert(self, model):
        for name, child in list(model.named_children()):
            if isinstance(child, MarkedBatchNorm):
                plain = nn.BatchNorm1d(child.num_features)
                plain.load_state_dict(child.state_dict())
                setattr(model, name, plain)
        return model


class WithBatchNorm(RegressionModule):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(6)

    def forward(self, x):
        return self.net(self.norm(x))


class RecordNormType(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen = type(pl_module.norm)


def _layer_sync_worker(rank, world_size):
    for stage in (0, 3):
        module, recorder = WithBatchNorm(), RecordNormType()
        make_trainer(stage, plugins=[RecordingSync()], callbacks=[recorder]).fit(module)
        assert recorder.seen is MarkedBatchNorm, f"stage {stage}: the Trainer's layer sync was not applied"
        # stages 0-1 revert like DDPStrategy; at 2-3 the layer owns FSDP2 shards and stays (see revert_layer_sync)
        assert type(module.norm) is (nn.BatchNorm1d if stage == 0 else MarkedBatchNorm), stage


def test_trainer_layer_sync_is_applied_while_fitting():
    run_distributed(_layer_sync_worker, WORLD)


class OwnOptimizer(RegressionModule):
    """A user-set per-instance configure_optimizers (no ds_config): the strategy must not delete it."""

    def __init__(self):
        super().__init__()
        self.configure_optimizers = lambda: torch.optim.SGD(self.parameters(), lr=0.05)


def _teardown_worker(rank, world_size):
    from torch.distributed.tensor import DTensor

    # stages 2-3 keep units gathered after an evaluation forward (every unit at stage 2)
    for stage in (0, 2, 3):
        module = OwnOptimizer()
        trainer = make_trainer(stage, limit_val_batches=2)
        trainer.fit(module)
        assert "configure_optimizers" in module.__dict__, f"stage {stage}: teardown deleted the user's method"
        assert isinstance(trainer.optimizers[0], torch.optim.SGD)
        # Lightning's evaluation loops run under inference_mode; teardown then must not swap sharded parameters
        with torch.inference_mode():
            val = trainer.validate(module, verbose=False)[0]["val_loss"]
        test = trainer.test(module, verbose=False)[0]["test_loss"]
        assert val == pytest.approx(test)
        assert all(isinstance(p, DTensor) for p in module.parameters()) == (stage >= 2)
        before = full_state(module)
        make_trainer(stage).fit(module)  # and it trains again afterwards
        after = full_state(module)
        assert any(not torch.equal(before[k], after[k]) for k in before), f"stage {stage}: second fit did nothing"


def test_teardown_keeps_user_methods_and_sharded_module_in_place_for_later_runs():
    run_distributed(_teardown_worker, WORLD)


def test_uninstall_removes_only_the_config_optimizer_hook():
    from lightning.pytorch import LightningModule

    from lightning_zero.ds_config.binding import DeepSpeedConfigBinding
    from lightning_zero.strategies.ds_config_fit import install_config_optimizers, uninstall_config_optimizers

    binding = DeepSpeedConfigBinding(
        {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    )
    installed = LightningModule()
    install_config_optimizers(installed, binding)
    assert "configure_optimizers" in installed.__dict__
    uninstall_config_optimizers(installed)
    assert "configure_optimizers" not in installed.__dict__

    users = LightningModule()
    users.configure_optimizers = lambda: None
    uninstall_config_optimizers(users)
    assert "configure_optimizers" in users.__dict__


def test_sync_batchnorm_conversion_and_evaluation_on_cpu(monkeypatch):
    """The conversion itself (torch's SyncBatchNorm cannot run a training forward on CPU), and that evaluation, where
    no statistics are synchronised, is not refused."""
    from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm

    from lightning_zero.strategies.lifecycle import apply_layer_sync

    module = WithBatchNorm()
    model = apply_layer_sync(TorchSyncBatchNorm(), module, fitting=True)
    assert type(model.norm) is nn.SyncBatchNorm
    model = apply_layer_sync(TorchSyncBatchNorm(), model, fitting=False)  # evaluation: nothing to do (nor twice)
    assert type(model.norm) is nn.SyncBatchNorm

    from tests.ranks import free_port

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    trainer = make_trainer(2, devices=1, sync_batchnorm=True)
    result = trainer.validate(WithBatchNorm(), verbose=False)
    assert "val_loss" in result[0]
    dist.destroy_process_group()


class _WithLearningRate(RegressionModule):
    def __init__(self):
        super().__init__()
        self.lr = 0.1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _lr_find_then_fit_worker(rank, world_size):
    from lightning.pytorch.tuner import Tuner

    module = _WithLearningRate()
    trainer = make_trainer(2, devices=world_size, max_steps=3)
    Tuner(trainer).lr_find(module, num_training=5)
    trainer.fit(module)
    assert trainer.global_step == 3
    assert "register_signal_handlers" not in trainer._signal_connector.__dict__  # the class's method again


def test_lr_find_then_fit_on_the_same_trainer():
    # lr_find's run stops before Lightning registers its signal handlers, leaving the preemption hook's one-call
    # replacement in place; the fit that follows installs it again and must not stack the two (AttributeError).
    run_distributed(_lr_find_then_fit_worker, WORLD)


class _NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 4))


class _LeftOnMeta(RegressionModule):
    def configure_model(self):
        with torch.device("meta"):  # a meta model gets its values from reset_parameters(); this module has none
            self.extra = _NoReset()


def _meta_refusal_worker(rank, world_size):
    for stage in (0, 2, 3):
        with pytest.raises(
            ValueError,
            match=r"meta device in modules without a reset_parameters\(\) method: "
            r"extra \(_NoReset\)",
        ):
            make_trainer(stage, devices=world_size).fit(_LeftOnMeta())


def test_a_model_left_on_meta_is_refused_by_name_and_teardown_does_not_bury_it():
    # teardown's .cpu() raised NotImplementedError ("Cannot copy out of meta tensor") over the refusal
    run_distributed(_meta_refusal_worker, WORLD)


def _test_under_inference_mode_worker(rank, world_size, path):
    for stage in (2, 3):
        module = RegressionModule()
        trainer = make_trainer(stage, devices=world_size)
        trainer.fit(module)
        trainer.save_checkpoint(path + f"-{stage}")
        expected = trainer.test(module, verbose=False)[0]["test_loss"]
        # Lightning's own multi-stage test loads the checkpoint for test inside inference_mode
        with torch.inference_mode():
            got = trainer.test(module, ckpt_path=path + f"-{stage}", verbose=False)[0]["test_loss"]
        assert got == pytest.approx(expected), stage


def test_test_with_ckpt_path_inside_inference_mode_at_sharded_stages(tmp_path):
    run_distributed(_test_under_inference_mode_worker, WORLD, str(tmp_path / "model.ckpt"))


class _OneOptimizerForEveryFit(RegressionModule):
    """configure_optimizers hands out the same optimizer object at every fit."""

    def configure_optimizers(self):
        if not hasattr(self, "_optimizer"):
            self._optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return self._optimizer


def _reused_optimizer_worker(rank, world_size):
    for stage, refused in ((1, True), (0, False)):
        module = _OneOptimizerForEveryFit()
        make_trainer(stage, max_steps=2).fit(module)
        # the fit's end let go of stage 1's broadcast buckets (on a GPU, Lightning's teardown moves the module to
        # the CPU: a plan kept would hold the old device copy of every parameter)
        assert get_sharding(module._optimizer).broadcast_plan is None
        # The first fit partitioned it in place (stage 1: each rank's param_groups hold its own partition) and its
        # teardown removed the step hooks: stepped again as is, each rank would update its half and broadcast
        # nothing, and the ranks would drift apart without an error.
        if refused:
            with pytest.raises(RuntimeError, match="sharded by an earlier fit"):
                make_trainer(stage, max_steps=4).fit(module)
        else:  # stage 0 left the groups whole: a second fit trains on, every rank alike
            make_trainer(stage, max_steps=4).fit(module)
            mine = full_state(module)
            theirs = [None] * world_size
            dist.all_gather_object(theirs, mine)
            assert all(torch.equal(mine[k], theirs[0][k]) for k in mine)


def test_an_optimizer_sharded_by_an_earlier_fit_is_refused_where_its_groups_were_narrowed():
    run_distributed(_reused_optimizer_worker, WORLD)
