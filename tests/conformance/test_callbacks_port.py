"""The intent of Lightning's checkpointing, callback and tuner tests that run under a (distributed) strategy, on
ZeroStrategy (CPU, 2 gloo ranks). ``README.md`` maps every Lightning test to its port or the reason it is out.
"""

import os

import pytest
import torch
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import (
    BackboneFinetuning,
    EarlyStopping,
    ModelCheckpoint,
    StochasticWeightAveraging,
)
from lightning.pytorch.tuner import Tuner

from tests.conformance.models import RegressionModule, full_state, max_abs_diff, trainer, zero
from tests.ranks import run_distributed


def _saved(root):
    return sorted(name for name in os.listdir(root) if name.endswith(".ckpt"))


# ---------------------------------------------------------------------------------------------- ModelCheckpoint
def _top_k_worker(rank, world_size, root, k):
    callback = ModelCheckpoint(dirpath=root, monitor="val_loss", save_top_k=k, filename="{epoch}")
    t = trainer(
        zero(2),
        max_steps=-1,
        max_epochs=3,
        limit_train_batches=1,
        limit_val_batches=1,
        callbacks=[callback],
        enable_checkpointing=True,
    )
    t.fit(RegressionModule())
    t.strategy.barrier()
    assert len(_saved(root)) == k, _saved(root)  # the checkpoints beyond top-k were removed, by one rank
    assert all(os.path.isdir(os.path.join(root, name)) for name in _saved(root))


@pytest.mark.parametrize("k", [1, 2])
def test_top_k(tmp_path, k):
    run_distributed(_top_k_worker, 2, str(tmp_path), k)


def _monitor_none_worker(rank, world_size, root):
    callback = ModelCheckpoint(dirpath=root, monitor=None, filename="{epoch}")
    t = trainer(
        zero(3), max_steps=-1, max_epochs=2, limit_train_batches=1, callbacks=[callback], enable_checkpointing=True
    )
    t.fit(RegressionModule())
    t.strategy.barrier()
    assert _saved(root) == ["epoch=1.ckpt"], "monitor=None keeps the latest checkpoint only"


def test_model_checkpoint_monitor_none(tmp_path):
    run_distributed(_monitor_none_worker, 2, str(tmp_path))


def _invocations_worker(rank, world_size, root):
    calls = []
    t = trainer(
        zero(2),
        max_steps=-1,
        max_epochs=3,
        limit_train_batches=1,
        callbacks=[ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=-1)],
        enable_checkpointing=True,
    )
    real = t.strategy.save_checkpoint
    t.strategy.save_checkpoint = lambda *a, **kw: (calls.append(1), real(*a, **kw))
    t.fit(RegressionModule())
    assert len(calls) == 3, "one save per epoch, no extra invocations"


def test_model_checkpoint_no_extraneous_invocations(tmp_path):
    run_distributed(_invocations_worker, 2, str(tmp_path))


# ---------------------------------------------------------------------------------------------- EarlyStopping
class _PlateauModule(RegressionModule):
    def validation_step(self, batch, batch_idx):
        # a loss that never improves, different on each rank: the stop decision must still be global
        self.log("val_metric", torch.tensor(1.0 + self.global_rank), sync_dist=True)
        self.log("val_other", torch.tensor(2.0 - self.global_rank), sync_dist=True)


def _early_stopping_worker(rank, world_size):
    t = trainer(
        zero(3),
        max_steps=-1,
        max_epochs=10,
        limit_train_batches=1,
        limit_val_batches=1,
        callbacks=[EarlyStopping(monitor="val_metric", patience=1), EarlyStopping(monitor="val_other", patience=2)],
    )
    t.fit(_PlateauModule())
    epochs = torch.tensor(t.current_epoch)
    gathered = [torch.zeros_like(epochs) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, epochs)
    assert t.should_stop and gathered[0] == gathered[1] and t.current_epoch < 10


def test_multiple_early_stopping_callbacks():
    run_distributed(_early_stopping_worker, 2)


# ---------------------------------------------------------------------------------------------- finetuning
class _BackboneModule(RegressionModule):
    def __init__(self):
        super().__init__()
        self.backbone = self.net.inp

    def configure_optimizers(self):
        return torch.optim.SGD(
            [p for n, p in self.named_parameters() if not n.startswith("backbone") and not n.startswith("net.inp")],
            lr=0.1,
        )


def _finetuning_worker(rank, world_size, stage):
    seed_everything(0)
    module = _BackboneModule()
    before = module.net.inp.weight.detach().clone()
    callback = BackboneFinetuning(unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.0)
    try:
        trainer(zero(stage), max_steps=-1, max_epochs=2, limit_train_batches=1, callbacks=[callback]).fit(module)
    except Exception as err:  # refusing is fine when it says so
        assert "finetun" in str(err).lower() or "param" in str(err).lower(), err
        return
    after = full_state(module)["net.inp.weight"]
    assert not torch.equal(after, before), "the unfrozen backbone was not trained"


@pytest.mark.parametrize("stage", [1, 3])
def test_backbone_finetuning(stage):
    run_distributed(_finetuning_worker, 2, stage)


# ---------------------------------------------------------------------------------------------- SWA
def _swa_worker(rank, world_size, stage):
    module = RegressionModule()
    callback = StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1)
    fit = trainer(zero(stage), max_steps=-1, max_epochs=2, limit_train_batches=2, callbacks=[callback]).fit
    if stage >= 2:  # averaging whole parameter copies of a sharded model is refused, naming the callback
        with pytest.raises(ValueError, match=f"StochasticWeightAveraging callback is not supported.*stage={stage}"):
            fit(module)
        assert not torch.distributed.is_initialized() or callback._average_model is None
        return
    fit(module)
    assert callback._average_model is not None and callback.n_averaged is not None and callback.n_averaged > 0


@pytest.mark.parametrize(
    "stage",
    [
        0,
        1,
        3,
    ],
)
def test_swa_callback(stage):
    run_distributed(_swa_worker, 2, stage)


# ---------------------------------------------------------------------------------------------- tuner
def _lr_find_worker(rank, world_size, root):
    module = RegressionModule()
    module.lr = 1e-3
    t = trainer(zero(2), root=root, max_steps=-1, max_epochs=1)
    result = Tuner(t).lr_find(module, num_training=5, min_lr=1e-4, max_lr=1e-1, update_attr=False)
    suggestion = torch.tensor(float(result.suggestion() or 0.0))
    gathered = [torch.zeros_like(suggestion) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, suggestion)
    assert gathered[0] == gathered[1], "ranks disagree on the learning rate"


def test_lr_finder(tmp_path):
    run_distributed(_lr_find_worker, 2, str(tmp_path))


def _batch_size_worker(rank, world_size):
    with pytest.raises(Exception, match="(?i)not.*supported.*distributed|distributed.*not.*supported"):
        Tuner(trainer(zero(2))).scale_batch_size(RegressionModule())


def test_batch_size_finder_refused():
    run_distributed(_batch_size_worker, 2)


# ---------------------------------------------------------------------------------------------- torch.save
def _torch_save_worker(rank, world_size, root, stage):
    """A user's own torch.save of the trained module's state dict (sharded DTensors at stage 3) reads back."""
    seed_everything(0)
    module = RegressionModule()
    trainer(zero(stage), max_steps=1).fit(module)
    path = os.path.join(root, f"model{rank}.pt")
    torch.save(module.state_dict(), path)
    loaded = torch.load(path, weights_only=True)
    local = {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in module.state_dict().items()}
    for key, value in local.items():
        got = loaded[key]
        assert torch.equal(got.to_local() if hasattr(got, "to_local") else got, value), key


@pytest.mark.parametrize("stage", [0, 3])
def test_model_torch_save(tmp_path, stage):
    run_distributed(_torch_save_worker, 2, str(tmp_path), stage)


# ---------------------------------------------------------------------------------------------- EMA
def _ema_worker(rank, world_size, stage, in_configure_model):
    from lightning.pytorch.callbacks import EMAWeightAveraging

    seed_everything(0)
    module = RegressionModule(build_in_configure_model=in_configure_model)
    callback = EMAWeightAveraging(decay=0.5)
    if stage >= 2:  # refused before training, naming the callback (see test_swa_callback)
        with pytest.raises(ValueError, match=f"EMAWeightAveraging callback is not supported.*stage={stage}"):
            trainer(zero(stage), max_steps=3, callbacks=[callback]).fit(module)
        return
    trainer(zero(stage), max_steps=3, callbacks=[callback]).fit(module)
    averaged = {
        k.removeprefix("module."): v for k, v in callback._average_model.state_dict().items() if k.startswith("module.")
    }
    # fit ends by copying the averaged weights into the module
    assert max_abs_diff(full_state(module), averaged) == 0.0


@pytest.mark.parametrize("stage,in_configure_model", [(1, False), (1, True), (3, False)])
def test_ema_weight_averaging(stage, in_configure_model):
    run_distributed(_ema_worker, 2, stage, in_configure_model)


# ---------------------------------------------------------------------------------------------- pruning
def _pruning_worker(rank, world_size, stage):
    from lightning.pytorch.callbacks import ModelPruning

    module = RegressionModule()
    callback = ModelPruning(
        "l1_unstructured",
        amount=0.5,
        parameters_to_prune=[(module.net.out, "weight")],
        make_pruning_permanent=True,
        verbose=0,
    )
    try:
        trainer(zero(stage), max_steps=-1, max_epochs=1, limit_train_batches=2, callbacks=[callback]).fit(module)
    except ValueError as err:  # stages 2-3 refuse before training, naming the callback and the stage
        assert stage >= 2 and f"ModelPruning callback is not supported with ZeroStrategy(stage={stage})" in str(err)
        return
    assert stage < 2, "ModelPruning ran on sharded parameters"
    weight = full_state(module)["net.out.weight"]
    assert (weight == 0).float().mean().item() == pytest.approx(0.5, abs=0.1), "pruning was not applied"


@pytest.mark.parametrize("stage", [0, 3])
def test_pruning_callback(stage):
    run_distributed(_pruning_worker, 2, stage)


def _ema_resume_worker(rank, world_size, root, strategy_factory=None):
    """Resume from a checkpoint written mid-run; the averaged weights end as in the uninterrupted run."""
    from lightning.pytorch.callbacks import EMAWeightAveraging

    make_strategy = strategy_factory or (lambda: zero(1))

    def run(ckpt_path=None):
        seed_everything(0)
        module = RegressionModule()
        callbacks = [EMAWeightAveraging(decay=0.5), ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=-1)]
        t = trainer(
            make_strategy(),
            max_steps=-1,
            max_epochs=2,
            limit_train_batches=2,
            callbacks=callbacks,
            enable_checkpointing=True,
        )
        t.fit(module, ckpt_path=ckpt_path)
        return module

    uninterrupted = run()
    resumed = run(ckpt_path=os.path.join(root, "epoch=0.ckpt"))  # written by the first run
    assert max_abs_diff(full_state(resumed), full_state(uninterrupted)) <= 1e-6


def test_ema_resume(tmp_path):
    run_distributed(_ema_resume_worker, 2, str(tmp_path))


# ---------------------------------------------------------------------------------------------- spike detection
class _SpikeModule(RegressionModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 1 and batch_idx == 4:
            loss = loss * float("inf")  # a spike on one rank only
        return loss


def _spike_worker(rank, world_size, root, stage):
    from lightning.fabric.utilities.spike import TrainingSpikeException
    from lightning.pytorch.callbacks.spike import SpikeDetection

    detection = SpikeDetection(finite_only=True, warmup=2, exclude_batches_path=os.path.join(root, "skip_batches.json"))
    t = trainer(zero(stage), root=root, max_steps=8, callbacks=[detection])
    with pytest.raises(TrainingSpikeException):  # on every rank, the spike seen on rank 1 stops the run
        t.fit(_SpikeModule())
    assert t.global_step <= 5


@pytest.mark.parametrize("stage", [1, 3])
def test_spike_detection(tmp_path, stage):
    run_distributed(_spike_worker, 2, str(tmp_path), stage)


def _swa_resume_worker(rank, world_size, root, strategy_factory=None):
    """Resume from a checkpoint written in the middle of an SWA run; the end result is the uninterrupted run's."""
    make_strategy = strategy_factory or (lambda: zero(1))

    def run(ckpt_path=None):
        seed_everything(0)
        module = RegressionModule()
        callbacks = [
            StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1, annealing_epochs=1),
            ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=-1),
        ]
        t = trainer(
            make_strategy(),
            max_steps=-1,
            max_epochs=3,
            limit_train_batches=2,
            callbacks=callbacks,
            enable_checkpointing=True,
        )
        t.fit(module, ckpt_path=ckpt_path)
        return module

    uninterrupted = run()
    resumed = run(ckpt_path=os.path.join(root, "epoch=1.ckpt"))  # written by the first run, mid-SWA
    assert max_abs_diff(full_state(resumed), full_state(uninterrupted)) <= 1e-6


def test_swa_resume_training_from_checkpoint(tmp_path):
    run_distributed(_swa_resume_worker, 2, str(tmp_path))
