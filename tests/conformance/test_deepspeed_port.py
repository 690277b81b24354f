"""The intent of Lightning's ``tests_pytorch/strategies/test_deepspeed.py``, on ZeroStrategy (CPU, 2 gloo ranks).

DeepSpeed stage N is ``ZeroStrategy(stage=N)``. Where DeepSpeed refuses something it cannot do (clipping by value,
skipping backward, a user ``backward``/``configure_gradient_clipping``), ZeroStrategy must honour it instead, so
the port checks the result is right. ``README.md`` maps every Lightning test to its port or the reason it is out.
"""

import os

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn

import lightning_zero  # noqa: F401  (registers the strategy names)
from lightning_zero import ZeroPrecision, ZeroStrategy
from lightning_zero.checkpoint import CheckpointError
from lightning_zero.checkpoint.states import optimizer_state_dict
from tests.conformance.models import RegressionModule, full_state, max_abs_diff, trainer, zero
from tests.lightning_models import reference_weights
from tests.ranks import run_distributed


# ---------------------------------------------------------------------------------------------- no process group
@pytest.mark.parametrize(
    "name,stage,offload",
    [("zero_stage_1", 1, None), ("zero_stage_2", 2, None), ("zero_stage_3_offload", 3, "cpu"), ("zero", 2, None)],
)
def test_strategy_string(tmp_path, name, stage, offload):
    strategy = Trainer(strategy=name, accelerator="cpu", devices=1, logger=False, default_root_dir=tmp_path).strategy
    assert isinstance(strategy, ZeroStrategy)
    assert (strategy.stage, strategy.zero_config.offload) == (stage, offload or "none")


def test_defaults():
    strategy = ZeroStrategy()
    assert strategy.stage == 2 and strategy.zero_config.offload == "none" and strategy.ds_config is None


@pytest.mark.parametrize("precision", ["16-true", "bf16-mixed", "bf16-true", "32-true"])
def test_precision_choice(tmp_path, precision):
    t = Trainer(
        strategy=ZeroStrategy(),
        accelerator="cpu",
        devices=1,
        precision=precision,
        logger=False,
        default_root_dir=tmp_path,
    )
    assert isinstance(t.strategy.precision_plugin, ZeroPrecision)
    assert t.strategy.precision_plugin.precision == precision


def test_invalid_config_path():
    with pytest.raises(Exception, match="invalid_path"):
        ZeroStrategy(config="invalid_path.json")


def test_config_without_offload_does_not_offload():
    strategy = ZeroStrategy(config={"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 1})
    assert strategy.stage == 2 and strategy.zero_config.offload == "none"
    offloaded = ZeroStrategy(
        config={
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
            "train_micro_batch_size_per_gpu": 1,
        }
    )
    assert offloaded.stage == 3 and offloaded.zero_config.offload == "cpu"


def test_load_checkpoint_validate_path(tmp_path):
    """A checkpoint path that does not exist is an error naming it, not a fresh start."""
    run_distributed(_missing_path_worker, 2, str(tmp_path / "missing"))


def _missing_path_worker(rank, world_size, path):
    t = trainer(ZeroStrategy(stage=2), max_steps=1)
    with pytest.raises(Exception, match="missing"):
        t.fit(RegressionModule(), ckpt_path=path)


# ---------------------------------------------------------------------------------------------- fit on 2 ranks
def _fit_and_test_worker(rank, world_size, stage, precision):
    seed_everything(0)
    module = RegressionModule()
    t = trainer(zero(stage), precision=precision, max_steps=3)
    t.fit(module)
    assert t.global_step == 3
    loss = t.test(module, verbose=False)[0]["test_loss"]
    assert torch.isfinite(torch.tensor(loss))
    if precision == "32-true":
        # fp32 everywhere: the result is the single-process reference
        assert max_abs_diff(full_state(module), reference_weights(3, 8)) <= 1e-5
    for p in module.parameters():
        assert p.dtype == torch.float32, "master weights stay fp32 under mixed precision"


@pytest.mark.parametrize(
    "stage,precision",
    [(3, "32-true"), (2, "32-true"), (3, "bf16-mixed")],
    ids=["multigpu_stage_3", "fp32_works", "bfloat16_precision"],
)
def test_multi_rank_fit_then_test(stage, precision):
    run_distributed(_fit_and_test_worker, 2, stage, precision)


class _ConfigOptimizerModule(RegressionModule):
    configure_optimizers = LightningModule.configure_optimizers  # not overridden: the ds_config's are used


def _ds_config_worker(rank, world_size):
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.1, "warmup_num_steps": 10, "warmup_type": "linear"},
        },
    }
    strategy = ZeroStrategy(config=config)
    module = _ConfigOptimizerModule(batch_size=3)
    t = trainer(strategy, max_steps=2)
    t.fit(module)
    assert strategy.stage == 3
    optimizer = t.optimizers[0]
    assert isinstance(getattr(optimizer, "_optimizer", optimizer), torch.optim.SGD)
    assert len(t.lr_scheduler_configs) == 1
    # linear warm-up from 0 to 0.1 over 10 steps after two optimizer steps: DeepSpeed's own WarmupLR is at t = 1
    # then (its first step() call only moves t from -1 to 0), i.e. 0.01
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 1 / 10, rel=1e-6)
    assert strategy.ds_config.translation.train_micro_batch_size_per_gpu == 3, "'auto' read from the DataLoader"


def test_ds_config_optimizer_scheduler_and_auto_batch_size():
    run_distributed(_ds_config_worker, 2)


class _CountingSchedulerModule(RegressionModule):
    def __init__(self, interval):
        super().__init__()
        self.interval = interval

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return {
            "optimizer": opt,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1), "interval": self.interval},
        }


def _scheduler_worker(rank, world_size, interval, stage):
    module = _CountingSchedulerModule(interval)
    t = trainer(zero(stage), max_steps=-1, max_epochs=2, limit_train_batches=2)
    t.fit(module)
    scheduler = t.lr_scheduler_configs[0].scheduler
    assert scheduler.last_epoch == (4 if interval == "step" else 2)


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_scheduler_step_count(interval):
    run_distributed(_scheduler_worker, 2, interval, 3)


class _NoSchedulerModule(RegressionModule):
    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _no_scheduler_worker(rank, world_size):
    t = trainer(zero(3), max_steps=2)
    t.fit(_NoSchedulerModule())
    assert t.lr_scheduler_configs == [] and len(t.optimizers) == 1


def test_no_schedulers():
    run_distributed(_no_scheduler_worker, 2)


def _accumulate_worker(rank, world_size, offload):
    seed_everything(0)
    module = RegressionModule()
    t = trainer(zero(2, offload), accumulate_grad_batches=2, max_steps=2)
    t.fit(module)
    assert t.global_step == 2
    assert max_abs_diff(full_state(module), reference_weights(2, 16, accumulate=2)) <= 1e-5


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_stage_2_accumulated_grad_batches(offload):
    run_distributed(_accumulate_worker, 2, offload)


class _ValueClipModule(RegressionModule):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _clip_value_worker(rank, world_size, stage):
    seed_everything(0)
    module = _ValueClipModule()
    t = trainer(zero(stage), gradient_clip_val=1e-3, gradient_clip_algorithm="value", max_steps=1)
    t.fit(module)
    # reference: one SGD step on the global batch with clipped-by-value gradients
    seed_everything(0)
    ref = RegressionModule()
    x, y = _first_global_batch(8)
    nn.functional.mse_loss(ref(x), y).backward()
    torch.nn.utils.clip_grad_value_(ref.parameters(), 1e-3)
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    assert max_abs_diff(full_state(module), full_state(ref)) <= 1e-6


def _first_global_batch(global_batch):
    from tests.lightning_models import dataset

    x, y = dataset().tensors
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))[:global_batch]
    return x[order], y[order]


@pytest.mark.parametrize("stage", [1, 3])
def test_gradient_clip_by_value_is_honoured(stage):
    run_distributed(_clip_value_worker, 2, stage)


CALLS = []  # a module-level record: FSDP2 swaps the module's class, so class attributes would not be shared


class _CustomClipModule(_ValueClipModule):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        CALLS.append("clip")
        self.clip_gradients(optimizer, gradient_clip_val=1e-3, gradient_clip_algorithm="norm")


def _custom_clip_worker(rank, world_size):
    seed_everything(0)
    module = _CustomClipModule()
    trainer(zero(3), max_steps=1).fit(module)
    assert CALLS == ["clip"], "the LightningModule's configure_gradient_clipping was not used"
    seed_everything(0)
    ref = RegressionModule()
    x, y = _first_global_batch(8)
    nn.functional.mse_loss(ref(x), y).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    assert max_abs_diff(full_state(module), full_state(ref)) <= 1e-6


def test_configure_gradient_clipping_override_is_honoured():
    run_distributed(_custom_clip_worker, 2)


class _UserBackwardModule(RegressionModule):
    def backward(self, loss, *args, **kwargs):
        CALLS.append("backward")
        loss.backward()


def _user_backward_worker(rank, world_size):
    seed_everything(0)
    module = _UserBackwardModule()
    trainer(zero(3), max_steps=2).fit(module)
    assert CALLS == ["backward"] * 2, "the LightningModule's own backward was not used"
    assert max_abs_diff(full_state(module), reference_weights(2, 8)) <= 1e-5


def test_user_backward_is_honoured():
    run_distributed(_user_backward_worker, 2)


class _SkipModule(RegressionModule):
    def training_step(self, batch, batch_idx):
        return None  # Lightning skips backward and the optimizer step


def _skip_worker(rank, world_size, stage):
    # DeepSpeed refuses this; so does Lightning itself for every distributed strategy (ranks would desynchronise),
    # and the refusal must reach the user rather than a hang or a silently skipped step on one rank only.
    with pytest.raises(RuntimeError, match="returning None in distributed training is not supported"):
        trainer(zero(stage), max_steps=2).fit(_SkipModule())


@pytest.mark.parametrize("stage", [1, 3])
def test_training_step_returning_none_is_refused(stage):
    run_distributed(_skip_worker, 2, stage)


class _UnusedParameterModule(RegressionModule):
    """A parameter that never takes part in forward (DeepSpeed's partial partition case)."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Linear(3, 3)


def _partial_worker(rank, world_size):
    seed_everything(0)
    module = _UnusedParameterModule()
    unused_before = module.unused.weight.detach().clone()
    t = trainer(zero(3), max_steps=2)
    t.fit(module)
    state = full_state(module)
    assert torch.equal(state["unused.weight"], unused_before), "a parameter without gradient was changed"
    t.test(module, verbose=False)


def test_partial_partition_parameters():
    run_distributed(_partial_worker, 2)


class _RNNModule(RegressionModule):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(6, 6, batch_first=True)

    def forward(self, x):
        out, _ = self.rnn(x.unsqueeze(1))
        return self.net(out.squeeze(1))


def _rnn_worker(rank, world_size):
    module = _RNNModule()
    t = trainer(zero(3), max_steps=2)
    t.fit(module)
    assert torch.isfinite(torch.tensor(t.test(module, verbose=False)[0]["test_loss"]))


def test_rnn():
    run_distributed(_rnn_worker, 2)


def _optimizer_device_worker(rank, world_size, stage, offload):
    from torch.distributed.tensor import DTensor

    module = RegressionModule()
    t = trainer(zero(stage, offload), max_steps=1)
    t.fit(module)
    optimizer = t.optimizers[0]
    optimizer = getattr(optimizer, "_optimizer", optimizer)
    states = [s for s in optimizer.state.values() if s]
    assert states, "no optimizer state after a step"
    for state in states:
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.ndim:
                assert value.device.type == "cpu"
                assert isinstance(value, DTensor) == (stage >= 2), "stages 2-3 keep sharded states"


@pytest.mark.parametrize("stage,offload", [(1, None), (3, None), (3, "cpu")])
def test_optimizer_states_on_the_strategy_device(stage, offload):
    run_distributed(_optimizer_device_worker, 2, stage, offload)


# ---------------------------------------------------------------------------------------------- checkpoints
def _checkpoint_worker(rank, world_size, root, automatic, accumulate):
    from tests.lightning_models import ManualModule

    seed_everything(0)
    module = RegressionModule() if automatic else ManualModule()
    checkpoint = ModelCheckpoint(dirpath=root, save_top_k=1, monitor="val_loss", save_last=True)
    t = trainer(
        zero(3),
        max_steps=-1,
        max_epochs=2,
        limit_train_batches=2,
        limit_val_batches=2,
        accumulate_grad_batches=accumulate,
        callbacks=[checkpoint],
        enable_checkpointing=True,
    )
    t.fit(module)
    best = t.strategy.broadcast(checkpoint.best_model_path)
    assert os.path.isdir(best), "a stage-3 checkpoint is a sharded directory"
    # the last checkpoint was written twice at the same path (once per epoch)
    assert os.path.isdir(os.path.join(root, "last.ckpt"))
    trained = full_state(module)
    seed_everything(1)
    fresh = RegressionModule() if automatic else ManualModule()
    t2 = trainer(zero(3))
    result = t2.test(fresh, ckpt_path=os.path.join(root, "last.ckpt"), verbose=False)[0]
    assert max_abs_diff(full_state(fresh), trained) == 0.0
    assert torch.isfinite(torch.tensor(result["test_loss"]))


@pytest.mark.parametrize("automatic,accumulate", [(False, 1), (True, 2)], ids=["manual", "automatic-acc2"])
def test_stage_3_checkpointing_and_multi_save_same_path(tmp_path, automatic, accumulate):
    run_distributed(_checkpoint_worker, 2, str(tmp_path), automatic, accumulate)


class _CheckResumed(Callback):
    def __init__(self, saved_optimizer, saved_scheduler, saved_step):
        self.saved = saved_optimizer, saved_scheduler, saved_step

    def on_train_start(self, trainer, pl_module):
        optimizer_state, scheduler_state, step = self.saved
        assert trainer.global_step == step
        assert trainer.lr_scheduler_configs[0].scheduler.state_dict() == scheduler_state
        now = _full_optimizer_state(pl_module, trainer.optimizers[0])
        assert now.keys() == optimizer_state.keys()
        for name in now:
            for key in now[name]:
                assert torch.equal(now[name][key], optimizer_state[name][key]), (name, key)


def _full_optimizer_state(module, optimizer):
    state = optimizer_state_dict(module, getattr(optimizer, "_optimizer", optimizer))["state"]
    return {
        name: {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in s.items()}
        for name, s in state.items()
    }


def _resume_worker(rank, world_size, root):
    seed_everything(0)
    module = RegressionModule()
    t = trainer(zero(3), max_steps=2)
    t.fit(module)
    path = os.path.join(root, "step2.ckpt")
    t.save_checkpoint(path)
    saved = (_full_optimizer_state(module, t.optimizers[0]), t.lr_scheduler_configs[0].scheduler.state_dict(), 2)
    seed_everything(5)
    resumed = RegressionModule()
    t2 = trainer(zero(3), max_steps=4, callbacks=[_CheckResumed(*saved)])
    t2.fit(resumed, ckpt_path=path)
    assert t2.global_step == 4


def test_stage_3_resume_training(tmp_path):
    run_distributed(_resume_worker, 2, str(tmp_path))


def _single_file_worker(rank, world_size, root, load_full_weights):
    """A regular single-file Lightning checkpoint (as DDP writes it) given to ZeroStrategy stage 3 is loaded, with or
    without ``load_full_weights`` (DeepSpeed needs the flag; a file is recognised without it here)."""
    seed_everything(0)
    module = RegressionModule()
    path = os.path.join(root, "plain.ckpt")
    if rank == 0:
        torch.save({"state_dict": module.state_dict(), "pytorch-lightning_version": "2.6.0"}, path)
    torch.distributed.barrier()
    seed_everything(1)
    fresh = RegressionModule()
    assert max_abs_diff(full_state(fresh), full_state(module)) > 0
    trainer(zero(3, load_full_weights=load_full_weights)).test(fresh, ckpt_path=path, verbose=False)
    assert max_abs_diff(full_state(fresh), full_state(module)) == 0.0, "a single-file checkpoint loaded wrongly"


@pytest.mark.parametrize("load_full_weights", [False, True], ids=["detected", "load_full_weights"])
def test_single_file_checkpoint_is_loaded(tmp_path, load_full_weights):
    run_distributed(_single_file_worker, 2, str(tmp_path), load_full_weights)


def _resume_from_single_file_worker(rank, world_size, root):
    """DeepSpeed's ``load_full_weights=True`` resume warns that optimizer states cannot be restored. Here a file
    that holds them (a DDP .ckpt) restores them; one that does not (``save_weights_only``) starts them fresh only
    with ``load_full_weights=True``, with that warning, and is refused without the flag."""
    import warnings

    from lightning.pytorch.strategies import DDPStrategy

    full, weights = os.path.join(root, "full.ckpt"), os.path.join(root, "weights.ckpt")
    seed_everything(0)
    ddp = trainer(DDPStrategy(), max_steps=2)
    ddp.fit(RegressionModule())
    ddp.save_checkpoint(full)
    ddp.save_checkpoint(weights, weights_only=True)
    saved = (
        _full_optimizer_state(ddp.lightning_module, ddp.optimizers[0]),
        ddp.lr_scheduler_configs[0].scheduler.state_dict(),
        2,
    )
    seed_everything(5)
    resumed = trainer(zero(3, load_full_weights=True), max_steps=3, callbacks=[_CheckResumed(*saved)])
    resumed.fit(RegressionModule(), ckpt_path=full)
    assert resumed.global_step == 3
    with pytest.raises(CheckpointError, match="holds no optimizer states.*load_full_weights=True"):
        trainer(zero(3), max_steps=3).fit(RegressionModule(), ckpt_path=weights)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh = trainer(zero(3, load_full_weights=True), max_steps=3)
        fresh.fit(RegressionModule(), ckpt_path=weights)
    assert fresh.global_step == 3  # the loops come from the file (step 2), the optimizer starts fresh
    if rank == 0:
        assert any("holds no optimizer states: with load_full_weights=True" in str(w.message) for w in caught)


def test_stage_3_resume_training_from_a_single_file(tmp_path):
    run_distributed(_resume_from_single_file_worker, 2, str(tmp_path))


# ---------------------------------------------------------------------------------------------- init_module
def _init_module_worker(rank, world_size, stage, empty_init):
    # ZeroStrategy keeps fp32 master weights at every precision (docs/precision.md), so unlike DeepSpeed the module
    # is not cast to bf16 here; what matters is that the weights are real and trainable.
    t = trainer(zero(stage))
    with t.init_module(empty_init=empty_init):
        module = RegressionModule()
    if empty_init:  # Lightning's meaning: the build skipped the layers' init, the script initialises (or loads)
        for layer in module.modules():
            if isinstance(layer, nn.Linear):
                layer.reset_parameters()
    seed_everything(0)
    t.fit(module)
    for name, p in module.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        assert torch.isfinite(full).all() and full.abs().sum() > 0, name


@pytest.mark.parametrize(
    "stage,empty_init",
    [
        pytest.param(1, None, id="stage1"),
        pytest.param(2, None, id="stage2"),
        pytest.param(3, None, id="stage3"),
        pytest.param(3, True, id="stage3-empty_init"),
    ],
)
def test_init_module(stage, empty_init):
    run_distributed(_init_module_worker, 2, stage, empty_init)


class _ManualSubmoduleModule(RegressionModule):
    """Manual optimization over a model whose parameters the root unit owns (one Linear, as Lightning's
    BoringModel), with training_step calling the submodule directly."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.net = nn.Linear(6, 3)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _manual_submodule_worker(rank, world_size, stage):
    seed_everything(0)
    module = _ManualSubmoduleModule()
    seed_everything(0)
    reference = _ManualSubmoduleModule().net
    trainer(zero(stage), max_steps=1).fit(module)
    x, y = _first_global_batch(8)
    nn.functional.mse_loss(reference(x), y).backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.1 * p.grad
    expected = {f"net.{k}": v for k, v in reference.state_dict().items()}
    assert max_abs_diff(full_state(module), expected) <= 1e-6, "manual optimization did not train the model"


@pytest.mark.parametrize("stage", [1, 3])
def test_stage_3_manual_optimization_calling_a_submodule(stage):
    run_distributed(_manual_submodule_worker, 2, stage)


# ---------------------------------------------------------------------------------------------- precision knobs
def test_custom_precision_params_reach_the_scaler(tmp_path):
    strategy = ZeroStrategy(initial_scale_power=11, loss_scale_window=12, hysteresis=13, min_loss_scale=14)
    Trainer(
        strategy=strategy, accelerator="cpu", devices=1, precision="16-true", logger=False, default_root_dir=tmp_path
    )
    config = strategy.settings.fp16_loss_scale_config
    assert (config.initial_scale_power, config.loss_scale_window, config.hysteresis, config.min_loss_scale) == (
        11,
        12,
        13,
        14,
    )
    assert strategy.precision_plugin.loss_scale == 2.0**11
    with pytest.raises(Exception, match="fp16|16"):  # fp16 knobs with fp32 training are refused, not ignored
        Trainer(
            strategy=ZeroStrategy(loss_scale=10),
            accelerator="cpu",
            devices=1,
            precision="32-true",
            logger=False,
            default_root_dir=tmp_path,
        )


def _inference_precision_worker(rank, world_size):
    outputs = []

    class _Record(RegressionModule):
        def validation_step(self, batch, batch_idx):
            outputs.append(self(batch[0]).dtype)

    trainer(
        ZeroStrategy(
            config={"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 4}
        ),
        limit_val_batches=1,
    ).validate(_Record(), verbose=False)
    assert outputs == [torch.bfloat16], "the config's bf16 was not used for inference"


def test_config_precision_used_during_inference():
    run_distributed(_inference_precision_worker, 2)
