"""The intent of Lightning's ``test_fsdp.py``, ``test_model_parallel.py`` and ``test_model_parallel_integration.py``
on ZeroStrategy (CPU, 2 gloo ranks). FSDP ``FULL_SHARD`` is stage 3, ``SHARD_GRAD_OP`` stage 2; Lightning's
``ModelParallelStrategy`` (FSDP2) is stages 2-3. ``README.md`` maps every Lightning test to its port or reason.
"""

import os
from datetime import timedelta
from unittest import mock

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint import CheckpointError, CheckpointSaveError, consolidate_checkpoint
from tests.conformance.models import RegressionModule, full_state, max_abs_diff, trainer, zero
from tests.ranks import run_distributed


# ---------------------------------------------------------------------------------------------- no process group
def test_forbidden_precision_raises(tmp_path):
    with pytest.raises(Exception, match="64"):
        Trainer(strategy=ZeroStrategy(), accelerator="cpu", devices=1, precision="64-true", default_root_dir=tmp_path)


def test_cpu_offload_configuration():
    assert ZeroStrategy(stage=3, offload="cpu").zero_config.offload == "cpu"
    with pytest.raises(ValueError, match="nvme.*needs nvme_path"):  # NVMe offload needs a directory
        ZeroStrategy(stage=3, offload="nvme")
    with pytest.raises(ValueError):
        ZeroStrategy(stage=3, offload="gpu")


def test_save_checkpoint_storage_options_refused(tmp_path):
    with pytest.raises(TypeError, match="storage_options"):
        ZeroStrategy().save_checkpoint({}, tmp_path / "x", storage_options={"a": 1})


def test_device_mesh_before_setup_raises():
    with pytest.raises(RuntimeError, match="device mesh"):
        _ = ZeroStrategy().device_mesh


# ---------------------------------------------------------------------------------------------- 2 ranks
def _mesh_and_timeout_worker(rank, world_size):
    import lightning_zero.adapters.process_group as zero_module

    seen = {}
    real = zero_module._init_dist_connection

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    strategy = ZeroStrategy(stage=3, timeout=timedelta(seconds=1234))
    module = RegressionModule()
    with mock.patch.object(zero_module, "_init_dist_connection", spy):
        trainer(strategy, max_steps=1).fit(module)
    assert seen["timeout"] == timedelta(seconds=1234), "the timeout did not reach the process group"
    assert module.device_mesh is strategy.device_mesh and strategy.device_mesh.size() == world_size


def test_device_mesh_access_and_timeout():
    run_distributed(_mesh_and_timeout_worker, 2)


class _BatchNormModule(RegressionModule):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x):
        return self.net(self.bn(x))


def _sync_bn_worker(rank, world_size, stage):
    module = _BatchNormModule()
    # torch runs SyncBatchNorm on GPU-like devices only: on CPU the strategy refuses before training instead of
    # ignoring the flag (tests/gpu checks the conversion and the synced statistics on CUDA)
    with pytest.raises(ValueError, match=r"sync_batchnorm=True.*'cpu'"):
        trainer(zero(stage), sync_batchnorm=True, max_steps=1).fit(module)


@pytest.mark.parametrize("stage", [0, 3])
def test_sync_batchnorm(stage):
    run_distributed(_sync_bn_worker, 2, stage)


class _NoParamChildModule(RegressionModule):
    """Children without parameters (activation, buffer-only) next to the ones that have some."""

    def __init__(self, build_in_configure_model=False):
        super().__init__(build_in_configure_model=build_in_configure_model)
        self.act = nn.Identity()
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x):
        return self.act(self.net(x)) * self.scale


def _no_params_worker(rank, world_size, stage):
    seed_everything(0)
    module = _NoParamChildModule()
    t = trainer(zero(stage), max_steps=2)
    t.fit(module)
    assert torch.equal(module.scale, torch.ones(3))
    assert torch.isfinite(torch.tensor(t.test(module, verbose=False)[0]["test_loss"]))


@pytest.mark.parametrize("stage", [2, 3])
def test_modules_without_parameters(stage):
    run_distributed(_no_params_worker, 2, stage)


def _checkpoint_roundtrip_worker(rank, world_size, root, stage, precision):
    seed_everything(0)
    module = RegressionModule()
    callback = ModelCheckpoint(dirpath=root, monitor="val_loss", save_top_k=1)
    t = trainer(
        zero(stage),
        precision=precision,
        max_steps=-1,
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=1,
        callbacks=[callback],
        enable_checkpointing=True,
    )
    t.fit(module)
    trained = full_state(module)
    # "best" resolves to the sharded directory and restores the exact weights into a fresh model
    seed_everything(3)
    fresh = RegressionModule()
    t2 = trainer(zero(stage), precision=precision)
    t2.test(fresh, ckpt_path=t.strategy.broadcast(callback.best_model_path), verbose=False)
    assert max_abs_diff(full_state(fresh), trained) == 0.0
    # the strategy's state dict holds every key of the plain module, with the trained values
    state = t.strategy.lightning_module_state_dict()
    assert set(state) == set(RegressionModule().state_dict())
    # a consolidated single file loads into the plain, unsharded module (rank 0 writes it)
    if rank == 0:
        out = os.path.join(root, "full.ckpt")
        consolidate_checkpoint(callback.best_model_path, out)
        plain = RegressionModule.load_from_checkpoint(out, weights_only=True)
        assert max_abs_diff(plain.state_dict(), trained) == 0.0


@pytest.mark.parametrize("stage,precision", [(2, "32-true"), (3, "32-true"), (3, "bf16-mixed")])
def test_strategy_checkpoint_roundtrip_and_consolidate(tmp_path, stage, precision):
    run_distributed(_checkpoint_roundtrip_worker, 2, str(tmp_path), stage, precision)


class _EarlyOptimizerModule(RegressionModule):
    """The optimizer is built before the strategy wraps the model, so it holds the pre-sharding tensors."""

    def __init__(self):
        super().__init__()
        self.early = torch.optim.SGD(self.parameters(), lr=0.1)

    def configure_optimizers(self):
        return self.early


def _invalid_params_worker(rank, world_size, stage):
    seed_everything(0)
    module = _EarlyOptimizerModule()
    before = full_state(module)
    try:
        trainer(zero(stage), max_steps=1).fit(module)
    except ValueError as err:  # stages 2-3 replace the parameters when sharding: refusing is right, saying why
        assert stage >= 2 and "not parameters of the sharded model" in str(err), err
        return
    assert max_abs_diff(full_state(module), before) > 0, "the optimizer stepped tensors the model no longer uses"


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_invalid_parameters_in_optimizer(stage):
    run_distributed(_invalid_params_worker, 2, stage)


class _TwoOptimizerModule(RegressionModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        for opt in self.optimizers():
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in self.optimizers():
            opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.inp.parameters(), lr=0.1), torch.optim.SGD(self.net.out.parameters(), lr=0.1)


def _optimizer_count_worker(rank, world_size, root):
    path = os.path.join(root, "one_optimizer.ckpt")
    t = trainer(zero(2), max_steps=1)
    t.fit(RegressionModule())
    t.save_checkpoint(path)
    with pytest.raises(Exception, match="optimizer"):
        trainer(zero(2), max_steps=2).fit(_TwoOptimizerModule(), ckpt_path=path)


def test_load_optimizer_states_with_a_different_number_of_optimizers(tmp_path):
    run_distributed(_optimizer_count_worker, 2, str(tmp_path))


def _path_exists_worker(rank, world_size, root, what):
    t = trainer(zero(2), max_steps=1)
    module = RegressionModule()
    t.fit(module)
    path = os.path.join(root, "target")
    if rank == 0:
        if what == "file":
            with open(path, "w") as f:
                f.write("old")
        elif what == "directory":
            os.makedirs(os.path.join(path, "user"))
            with open(os.path.join(path, "user", "data.txt"), "w") as f:
                f.write("mine")
    torch.distributed.barrier()
    if what == "checkpoint":
        t.save_checkpoint(path)  # a previous checkpoint at the path
    if what in ("file", "directory"):
        # Lightning's FSDP deletes a stale file there; a file or directory the user owns is no checkpoint, so
        # lightning-zero refuses (on every rank) rather than delete it
        with pytest.raises(CheckpointSaveError, match="target.*not a lightning-zero checkpoint"):
            t.save_checkpoint(path)
        kept = os.path.join(path, "user", "data.txt") if what == "directory" else path
        assert os.path.isfile(kept), "the user's file was deleted"
        return
    t.save_checkpoint(path)  # over a previous checkpoint
    seed_everything(4)
    fresh = RegressionModule()
    trainer(zero(2)).test(fresh, ckpt_path=path, verbose=False)
    assert max_abs_diff(full_state(fresh), full_state(module)) == 0.0


@pytest.mark.parametrize(
    "what",
    [
        "file",
        "checkpoint",
        "directory",
    ],
)
def test_save_checkpoint_path_exists(tmp_path, what):
    run_distributed(_path_exists_worker, 2, str(tmp_path), what)


def _unknown_checkpoint_worker(rank, world_size, root):
    path = os.path.join(root, "not_a_checkpoint")
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    with pytest.raises(CheckpointError, match="not a complete lightning-zero checkpoint"):
        trainer(zero(3)).test(RegressionModule(), ckpt_path=path, verbose=False)


def test_load_unknown_checkpoint_type(tmp_path):
    run_distributed(_unknown_checkpoint_worker, 2, str(tmp_path))


class _Opaque:
    """Anything that is not a tensor/container: loading it requires unpickling arbitrary classes."""


def _weights_only_worker(rank, world_size, root):
    path = os.path.join(root, "ckpt")
    t = trainer(zero(3), max_steps=1)
    t.fit(RegressionModule())
    t.save_checkpoint(path)
    if rank == 0:
        torch.save({"evil": _Opaque()}, os.path.join(path, "meta.pt"))
    torch.distributed.barrier()
    with pytest.raises(Exception, match="(?i)weights_only|unsafe|unsupported global"):
        trainer(zero(3)).test(RegressionModule(), ckpt_path=path, verbose=False)


def test_sharded_checkpoint_metadata_is_loaded_weights_only(tmp_path):
    run_distributed(_weights_only_worker, 2, str(tmp_path))


def _remote_path_worker(rank, world_size, root):
    t = trainer(zero(2), max_steps=1)
    module = RegressionModule()
    t.fit(module)
    url = "memory://conformance/remote.ckpt"
    local_shadow = os.path.join(os.getcwd(), "memory:")
    try:
        t.save_checkpoint(url)
    except Exception as err:  # refusing a URL it cannot write is fine, if it names it
        assert "memory://" in str(err), err
        return
    finally:
        assert not os.path.exists(local_shadow), "a URL was written as a local directory named 'memory:'"
    fresh = RegressionModule()
    trainer(zero(2)).test(fresh, ckpt_path=url, verbose=False)
    assert max_abs_diff(full_state(fresh), full_state(module)) == 0.0


def test_save_checkpoint_to_a_remote_url(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_distributed(_remote_path_worker, 2, str(tmp_path))


def _meta_init_parity_worker(rank, world_size):
    weights = {}
    for stage in (0, 3):
        seed_everything(0)
        module = RegressionModule(build_in_configure_model=True)
        t = trainer(zero(stage), max_steps=1)
        t.validate(module, verbose=False)  # sets up without training
        weights[stage] = full_state(module)
    assert max_abs_diff(weights[3], weights[0]) == 0.0, "configure_model initialises differently at stage 3"


def test_meta_device_materialization_matches_a_real_device_build():
    run_distributed(_meta_init_parity_worker, 2)


def _standard_checkpoint_worker(rank, world_size, root, stage):
    """A DDP run's regular .ckpt resumed under ZeroStrategy continues exactly as resuming under DDP does."""
    from lightning.pytorch.strategies import DDPStrategy

    path, weights = os.path.join(root, "ddp.ckpt"), os.path.join(root, "weights.ckpt")
    seed_everything(0)
    first = trainer(DDPStrategy(), max_steps=2)
    first.fit(RegressionModule())
    first.save_checkpoint(path)
    first.save_checkpoint(weights, weights_only=True)
    saved = full_state(first.lightning_module)
    results = {}
    for name, strategy in (("ddp", DDPStrategy()), ("zero", zero(stage))):
        seed_everything(5)  # other initial weights: everything must come from the file
        resumed = trainer(strategy, max_steps=4, limit_val_batches=1)
        resumed.fit(RegressionModule(), ckpt_path=path)
        assert resumed.global_step == 4, name
        scheduler = resumed.lr_scheduler_configs[0].scheduler
        assert scheduler.last_epoch == 4, (name, scheduler.last_epoch)  # restored at 2, stepped twice more
        results[name] = full_state(resumed.lightning_module)
    assert max_abs_diff(results["zero"], results["ddp"]) <= 1e-6, max_abs_diff(results["zero"], results["ddp"])
    assert max_abs_diff(results["ddp"], saved) > 1e-4, "no training after the resume: the comparison proves nothing"
    # validate after that fit, from a weights-only file: only the weights are wanted (no optimizer states asked for)
    resumed.validate(ckpt_path=weights, verbose=False)
    assert max_abs_diff(full_state(resumed.lightning_module), saved) == 0.0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_load_standard_checkpoint_into_distributed_model(tmp_path, stage):
    run_distributed(_standard_checkpoint_worker, 2, str(tmp_path), stage)
