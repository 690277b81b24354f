"""Carrying on a DeepSpeed run under ZeroStrategy: ``fit(ckpt_path=DIR)`` where DIR was written by Lightning's
``DeepSpeedStrategy`` (the real deepspeed package, on CPU with gloo) continues the run as DeepSpeed itself would,
at another stage and world size too, without importing deepspeed to read it.

The reference is DeepSpeed's own: one DeepSpeed run of two epochs saves after each; ZeroStrategy resumes from the
first save and trains the second epoch; its weights must equal the second save's (read by DeepSpeed's
``zero_to_fp32``). Both sides step ``torch.optim.AdamW`` from ``configure_optimizers`` (two param groups, a per-step
LR scheduler), as a Lightning user's DeepSpeed run does.
"""

import contextlib
import os

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_zero import ZeroStrategy
from lightning_zero.checkpoint.errors import CheckpointError
from tests.deepspeed_cpu import deepspeed_on_cpu
from tests.lightning_models import RegressionModule, dataset, full_state, make_optimizer_and_scheduler
from tests.ranks import run_distributed

deepspeed = pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install -e '.[bench]')")

BATCH = 4  # per rank under DeepSpeed
STEPS_PER_EPOCH = 2
DS_WORLD = 2


def _cpu_deepspeed_strategy(stage, **kwargs):
    """Lightning's DeepSpeedStrategy, allowed onto the CPU (it insists on CUDA; deepspeed itself runs on CPU)."""
    import argparse

    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.strategies import DeepSpeedStrategy
    from lightning.pytorch.strategies.ddp import DDPStrategy

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        def setup_environment(self):
            DDPStrategy.setup_environment(self)  # skips the CUDA-only check

        def setup_distributed(self):
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()  # the process group exists: deepspeed adopts it

        def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
            # as Lightning's, with the local rank for device_rank (a CPU device has no index)
            engine, optimizer, _, _ = deepspeed.initialize(
                args=argparse.Namespace(device_rank=self.local_rank),
                config=self.config,
                model=model,
                model_parameters=[p for p in model.parameters() if p.requires_grad],
                optimizer=optimizer,
                lr_scheduler=lr_scheduler,
                dist_init_required=False,
            )
            return engine, optimizer

    return CPUDeepSpeedStrategy(stage=stage, **kwargs)


def _config(**zero):
    return dict(
        config={
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            "train_micro_batch_size_per_gpu": BATCH,
        }
    )


# The DeepSpeed runs: stage 1 reorders each group's parameters in its flat buffer (round_robin_gradients), stage 3
# cuts the groups into several sub-groups (sub_group_size, in elements per rank), "elastic" saves stage 2's optimizer
# states without padding or param-group hyper-parameters (elastic_checkpoint).
DS_RUNS = {
    1: (1, _config(stage=1, round_robin_gradients=True)),
    2: (2, {}),
    3: (3, dict(sub_group_size=100)),
    "elastic": (2, _config(stage=2, elastic_checkpoint=True)),
}


def _trainer(strategy, world_size, root, **kwargs):
    settings = dict(
        accelerator="cpu",
        devices=world_size,
        max_epochs=2,
        limit_train_batches=STEPS_PER_EPOCH,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    return Trainer(strategy=strategy, **{**settings, **kwargs})


def _deepspeed_worker(rank, world_size, root, run):
    """Two epochs under DeepSpeed, saved after each: epoch0.ckpt is resumed from, epoch1.ckpt is the reference."""
    deepspeed_on_cpu()
    torch.manual_seed(0)
    every_epoch = ModelCheckpoint(
        dirpath=root, filename="epoch{epoch}", auto_insert_metric_name=False, save_top_k=-1, every_n_epochs=1
    )
    stage, settings = DS_RUNS[run]
    trainer = _trainer(_cpu_deepspeed_strategy(stage, **settings), world_size, root, callbacks=[every_epoch])
    trainer.fit(RegressionModule(batch_size=BATCH))


@pytest.fixture(scope="module")
def deepspeed_runs(tmp_path_factory):
    """``run(key of DS_RUNS)``: ``(DIR of epoch 0, DeepSpeed's weights after epoch 0, after epoch 1)``; each
    DeepSpeed run made when first asked for, the weights read by DeepSpeed's own zero_to_fp32."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root, runs = tmp_path_factory.mktemp("deepspeed"), {}

    def run(key):
        if key not in runs:
            where = str(root / f"run-{key}")
            run_distributed(_deepspeed_worker, DS_WORLD, where, key)
            weights = []
            for epoch in (0, 1):
                weights.append(os.path.join(where, f"weights{epoch}.pt"))
                state = get_fp32_state_dict_from_zero_checkpoint(os.path.join(where, f"epoch{epoch}.ckpt"))
                torch.save(state, weights[-1])
            runs[key] = (os.path.join(where, "epoch0.ckpt"), *weights)
        return runs[key]

    return run


def _worst(module, expected_path):
    expected = torch.load(expected_path, weights_only=True)
    got = full_state(module)
    assert set(got) == set(expected)
    return max((got[k] - expected[k]).abs().max().item() for k in expected)


def _resume_worker(rank, world_size, path, stage, expected_path):
    torch.manual_seed(123)  # another initialisation: every weight must come from the checkpoint
    module = RegressionModule(batch_size=BATCH * DS_WORLD // world_size)  # DeepSpeed's global batch
    trainer = _trainer(ZeroStrategy(stage=stage), world_size, os.path.dirname(path), enable_checkpointing=False)
    trainer.fit(module, ckpt_path=path)
    assert trainer.global_step == 2 * STEPS_PER_EPOCH and trainer.current_epoch == 2
    worst = _worst(module, expected_path)
    # the same fp32 arithmetic: measured 0.0 on 2 ranks, 3e-8 on 1 (the batch mean summed in another order)
    assert worst <= 1e-6, f"resumed at stage {stage} x {world_size} ranks: max abs diff {worst:.2e} from DeepSpeed"
    lrs = [group["lr"] for group in trainer.optimizers[0].param_groups]
    assert lrs == pytest.approx([1e-2 * 0.5 ** (2 * STEPS_PER_EPOCH), 0.5e-2 * 0.5 ** (2 * STEPS_PER_EPOCH)])


def test_resume_a_deepspeed_stage_2_run_at_stage_3(deepspeed_runs):
    path, _, expected = deepspeed_runs(2)
    run_distributed(_resume_worker, 2, path, 3, expected)


# (DeepSpeed's stage, on 2 ranks) -> (ZeroStrategy's stage, world size)
SWEEP = [(1, (1, 2)), (1, (2, 1)), (2, (0, 1)), (2, (1, 2)), (3, (3, 2)), (3, (2, 1)), (3, (1, 1))]


@pytest.mark.slow
@pytest.mark.parametrize("ds_stage,resumed", SWEEP, ids=[f"ds{a}x2-to-s{b}x{c}" for a, (b, c) in SWEEP])
def test_resume_a_deepspeed_run_at_any_stage_and_world_size(deepspeed_runs, ds_stage, resumed):
    path, _, expected = deepspeed_runs(ds_stage)
    run_distributed(_resume_worker, resumed[1], path, resumed[0], expected)


def _two_groups(module):
    """The groups of tests.lightning_models.make_optimizer_and_scheduler: matrices, then the rest."""
    named = list(module.named_parameters())
    return [{"params": [p for _, p in named if p.ndim == 2]}, {"params": [p for _, p in named if p.ndim != 2]}]


class AdamModule(RegressionModule):
    """torch.optim.Adam where the DeepSpeed run stepped AdamW: the same state keys, another update."""

    def configure_optimizers(self):
        return torch.optim.Adam(_two_groups(self), lr=1e-2)


class OneGroupModule(RegressionModule):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class SGDModule(RegressionModule):
    def configure_optimizers(self):
        return torch.optim.SGD(_two_groups(self), lr=1e-2, momentum=0.9)


class SwappedGroupsModule(RegressionModule):
    def configure_optimizers(self):
        weights = [p for n, p in self.named_parameters() if n != "net.out.weight" and p.ndim == 2]
        others = [p for n, p in self.named_parameters() if n == "net.out.weight" or p.ndim != 2]
        return torch.optim.AdamW([{"params": weights}, {"params": others}], lr=1e-2)


REFUSALS = [
    (AdamModule, "decoupled_weight_decay=True .*AdamW.*Adam"),
    (OneGroupModule, "2 param group\\(s\\), the optimizer being resumed has 1"),
    (SGDModule, "another optimizer type's"),
    (SwappedGroupsModule, "param group 0 differs from DeepSpeed's: only in the checkpoint: \\['net.out.weight'\\]"),
]


def _refusal_and_validate_worker(rank, world_size, path, weights0):
    for module_class, message in REFUSALS:
        trainer = _trainer(ZeroStrategy(stage=2), world_size, os.path.dirname(path), enable_checkpointing=False)
        with pytest.raises(CheckpointError, match=message):
            trainer.fit(module_class(batch_size=BATCH), ckpt_path=path)
    # validate loads the weights only (no optimizer to match)
    torch.manual_seed(123)
    module = AdamModule(batch_size=BATCH)
    trainer = _trainer(
        ZeroStrategy(stage=3), world_size, os.path.dirname(path), enable_checkpointing=False, limit_val_batches=1
    )
    trainer.validate(module, ckpt_path=path, verbose=False)
    assert _worst(module, weights0) == 0.0


def test_an_optimizer_unlike_deepspeeds_is_refused_by_name_and_validate_loads_the_weights(deepspeed_runs):
    path, weights0, _ = deepspeed_runs(2)
    run_distributed(_refusal_and_validate_worker, 1, path, weights0)


def _elastic_worker(rank, world_size, path, weights0):
    torch.manual_seed(123)
    module = RegressionModule(batch_size=BATCH * DS_WORLD)
    trainer = _trainer(
        ZeroStrategy(stage=2), world_size, os.path.dirname(path), enable_checkpointing=False, max_epochs=1
    )  # the checkpoint ends epoch 0: restored, nothing trained
    with pytest.warns(UserWarning, match="elastic DeepSpeed checkpoint .* holds no param-group hyper-parameters"):
        trainer.fit(module, ckpt_path=path)
    assert _worst(module, weights0) == 0.0
    optimizer = trainer.optimizers[0]
    for param in module.parameters():
        state = optimizer.state[param]
        assert state["step"].item() == STEPS_PER_EPOCH and state["exp_avg"].abs().sum() > 0


@pytest.mark.slow
def test_an_elastic_deepspeed_checkpoint_loads_with_a_warning_about_its_missing_hyperparameters(deepspeed_runs):
    path, weights0, _ = deepspeed_runs("elastic")
    run_distributed(_elastic_worker, 1, path, weights0)


class NoSchedulerModule(RegressionModule):
    def configure_optimizers(self):
        return make_optimizer_and_scheduler(self.named_parameters())[0]


def _engine_worker(rank, world_size, root):
    """DeepSpeedEngine.save_checkpoint outside Lightning (no client state), after the two batches Lightning's first
    epoch starts with; then those two again, as a resumed run with fresh loops sees them: the reference."""
    from torch.utils.data import DataLoader, DistributedSampler

    deepspeed_on_cpu()
    torch.manual_seed(0)
    module = NoSchedulerModule()
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }  # unset, ZeRO clips at 1.0
    engine, *_ = deepspeed.initialize(model=module, optimizer=module.configure_optimizers(), config=config)
    sampler = DistributedSampler(dataset(), num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    batches = list(DataLoader(dataset(), batch_size=BATCH, sampler=sampler))[:STEPS_PER_EPOCH]
    for step, (x, y) in enumerate(batches + batches):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
        if step == STEPS_PER_EPOCH - 1:
            engine.save_checkpoint(os.path.join(root, "engine"), tag="mid")
    engine.save_checkpoint(os.path.join(root, "engine-end"), tag="end")


def _engine_resume_worker(rank, world_size, root, expected_path):
    torch.manual_seed(123)
    module = NoSchedulerModule(batch_size=BATCH)
    trainer = _trainer(ZeroStrategy(stage=3), world_size, root, enable_checkpointing=False, max_epochs=1)
    warned = pytest.warns(UserWarning, match="holds no Lightning training state .* start fresh")
    with warned if rank == 0 else contextlib.nullcontext():  # Lightning warns on rank 0
        trainer.fit(module, ckpt_path=os.path.join(root, "engine"))
    assert trainer.global_step == STEPS_PER_EPOCH  # the loops started fresh
    worst = _worst(module, expected_path)
    assert worst <= 1e-6, f"max abs diff {worst:.2e} from DeepSpeed"


def test_a_checkpoint_of_a_deepspeed_engine_outside_lightning_resumes_with_fresh_loops(tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    root = str(tmp_path)
    run_distributed(_engine_worker, DS_WORLD, root)
    expected = os.path.join(root, "expected.pt")
    torch.save(get_fp32_state_dict_from_zero_checkpoint(os.path.join(root, "engine-end")), expected)
    run_distributed(_engine_resume_worker, DS_WORLD, root, expected)


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"mp_world_size": 2}, "model \\(tensor\\) parallelism, mp_world_size=2"),
        ({"checkpoint_parallel_dimensions": {"pp_degree": 2}}, "pipeline parallelism \\(pp_degree=2\\)"),
    ],
    ids=["tensor-parallel", "pipeline-parallel"],
)
def test_a_deepspeed_checkpoint_of_another_parallelism_is_refused_by_name(deepspeed_runs, monkeypatch, edit, message):
    from lightning_zero.checkpoint import deepspeed_reader

    path = deepspeed_runs(2)[0]
    load = deepspeed_reader._load

    def edited(where):
        loaded = load(where)
        return {**loaded, **edit} if where.endswith("mp_rank_00_model_states.pt") else loaded

    monkeypatch.setattr(deepspeed_reader, "_load", edited)
    with pytest.raises(ValueError, match=message):
        deepspeed_reader.DeepSpeedFiles(path)


def test_the_fp16_loss_scaler_state_is_carried_over(deepspeed_runs, monkeypatch):
    """DeepSpeed trains fp16 on GPUs only: its dynamic loss scaler is put into a real stage-2 checkpoint's reading
    as the file would hold it (DeepSpeed's class, unpickled to the reader's inert stand-in)."""
    from lightning_zero.checkpoint import deepspeed_reader
    from lightning_zero.checkpoint.deepspeed_resume import LOSS_SCALER_KEY, DeepSpeedCheckpoint
    from lightning_zero.ops.loss_scaler import DynamicLossScaler

    checkpoint = DeepSpeedCheckpoint(deepspeed_runs(2)[0])
    assert checkpoint.loss_scaler_state() is None and LOSS_SCALER_KEY not in checkpoint.rest()  # an fp32 run
    stand_in = dict(deepspeed_reader._STANDINS)  # {stand-in class: DeepSpeed's name}
    scaler_class = next(cls for cls, name in stand_in.items() if name.endswith(".DynamicLossScaler"))
    scaler = scaler_class.__new__(scaler_class)
    scaler.__setstate__(
        {
            "cur_scale": 1024.0,
            "cur_iter": 7,
            "last_overflow_iter": 4,
            "scale_factor": 2.0,
            "scale_window": 1000,
            "min_scale": 1,
            "delayed_shift": 2,
            "cur_hysteresis": 1,
            "consecutive_hysteresis": False,
            "raise_error_at_min_scale": True,
            "dynamic": True,
            "dtype": torch.float16,
        }
    )
    checkpoint.files.optimizer[0]["loss_scaler"] = scaler
    checkpoint.files.model_states[0]["ds_config"] = {"fp16": {"enabled": True}}
    checkpoint.files.model_states[0]["skipped_steps"] = 3
    ours = DynamicLossScaler()
    ours.load_state_dict(checkpoint.rest()[LOSS_SCALER_KEY])
    assert (ours.scale, ours.cur_iter, ours.last_overflow_iter, ours.cur_hysteresis, ours.skipped_steps) == (
        1024.0,
        7,
        4,
        1,
        3,
    )
    checkpoint.close()


def test_reading_a_deepspeed_checkpoint_to_resume_does_not_import_deepspeed(deepspeed_runs):
    import subprocess
    import sys

    path = deepspeed_runs(2)[0]
    code = (
        "import sys; from lightning_zero.checkpoint.deepspeed_resume import DeepSpeedCheckpoint; "
        f"c = DeepSpeedCheckpoint({path!r}); "
        "s = c.optimizer_states[0]['state']['net.out.weight']; s['exp_avg'].rect((0, 0), (3, 16)); "
        "c.read('net.out.weight', (1, 0), (2, 16)); "
        "assert 'deepspeed' not in sys.modules, 'the reader imported deepspeed'"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def _cpu_fabric_deepspeed_strategy(stage):
    """Fabric's DeepSpeedStrategy, allowed onto the CPU as the Trainer's above."""
    import argparse

    from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy
    from lightning.fabric.utilities.seed import reset_seed

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        def setup_environment(self):
            DDPStrategy.setup_environment(self)

        def _setup_distributed(self):
            reset_seed()
            self._set_world_ranks()
            self._init_deepspeed_distributed()
            self._format_config()
            self._config_initialized = True

        def _initialize_engine(self, model, optimizer=None, scheduler=None):
            engine, optimizer, _, scheduler = deepspeed.initialize(
                args=argparse.Namespace(device_rank=self.local_rank),
                config=self.config,
                model=model,
                model_parameters=[p for p in model.parameters() if p.requires_grad],
                optimizer=optimizer,
                lr_scheduler=scheduler,
                dist_init_required=False,
            )
            return engine, optimizer, scheduler

    return CPUDeepSpeedStrategy(stage=stage)


def _fabric_deepspeed_worker(rank, world_size, path, stage):
    from tests.fabric.test_fabric_parity import fabric_train, make_fabric

    deepspeed_on_cpu()
    fabric = make_fabric(_cpu_fabric_deepspeed_strategy(stage))
    model, optimizer = fabric_train(fabric, rank, world_size, steps=range(1))
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1})


def _fabric_resume_worker(rank, world_size, path, stage, weights_path):
    from lightning_zero.checkpoint.deepspeed_resume import DeepSpeedCheckpoint
    from lightning_zero.fabric import ZeroStrategy as FabricZeroStrategy
    from tests.distributed.test_zero_parity import STEPS, TinyNet, make_optimizer
    from tests.fabric.test_fabric_parity import fabric_train, full_weights, make_fabric

    fabric = make_fabric(FabricZeroStrategy(stage=stage))
    torch.manual_seed(123)
    with fabric.init_module():
        module = TinyNet()
    model, optimizer = fabric.setup(module, make_optimizer(module))
    with pytest.raises(KeyError, match="'epoch' is not in the checkpoint"):
        fabric.load(path, {"model": model, "optimizer": optimizer, "epoch": 0})
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(path, state)
    assert state["step"] == 1
    expected = torch.load(weights_path, weights_only=True)
    inner = model._forward_module
    got = full_weights(inner)
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in expected)
    saved = DeepSpeedCheckpoint(path).optimizer_states[0]["state"]  # the reader the Trainer tests check
    for name, param in inner.named_parameters():
        ours = optimizer.state[param]
        assert ours["step"].item() == 1
        for key in ("exp_avg", "exp_avg_sq"):
            mine = ours[key].full_tensor() if hasattr(ours[key], "full_tensor") else ours[key]
            whole = saved[name][key]
            assert torch.equal(mine, whole.rect((0,) * whole.dim(), whole.shape)), (name, key)
    fabric_train(fabric, rank, world_size, steps=range(1, STEPS), model=model, optimizer=optimizer)


def test_fabric_load_carries_on_a_fabric_deepspeed_run(tmp_path):
    """Fabric's DeepSpeedStrategy steps the ZeRO optimizer itself, not the engine (its checkpoint's global_steps
    stays 0), which on CPU does not reproduce torch's arithmetic: the load is checked state by state instead."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    path = str(tmp_path / "step1")
    run_distributed(_fabric_deepspeed_worker, 2, path, 2)
    weights = str(tmp_path / "weights.pt")
    torch.save(get_fp32_state_dict_from_zero_checkpoint(path), weights)
    run_distributed(_fabric_resume_worker, 2, path, 3, weights)
