"""ZeroStrategy inside a real Trainer, on gloo ranks started by the test harness (as torchrun would start them)."""

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback

import lightning_zero  # noqa: F401  (registers the strategy names)
from lightning_zero import ZeroStrategy
from lightning_zero.distributed.comm_buffers import comm_buffer_pool
from tests.lightning_models import (
    ManualModule,
    RegressionModule,
    full_state,
    reference_weights,
)
from tests.ranks import run_distributed

BATCH = 4
STEPS = 4


def make_trainer(strategy, world_size, tmp_path=None, **kwargs):
    defaults = dict(
        accelerator="cpu",
        devices=world_size,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    defaults.update(kwargs)
    return Trainer(strategy=strategy, **defaults)


def assert_close_to_reference(module, expected, label):
    got = full_state(module)
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= 1e-5, f"{label}: max abs diff {worst:.2e} from the single-process reference"


def _fit_parity_worker(rank, world_size):
    cases = [(0, None), (1, None), (1, "cpu"), (2, None), (2, "cpu"), (3, None), (3, "cpu")]
    for stage, offload in cases:
        for accumulate, clip in ((1, None), (2, 0.05)):
            torch.manual_seed(0)
            module = RegressionModule(batch_size=BATCH)
            trainer = make_trainer(
                ZeroStrategy(stage=stage, offload=offload),
                world_size,
                accumulate_grad_batches=accumulate,
                gradient_clip_val=clip,
            )
            trainer.fit(module)
            expected = reference_weights(STEPS, BATCH * world_size * accumulate, accumulate, clip)
            assert_close_to_reference(module, expected, f"stage={stage} offload={offload} acc={accumulate} clip={clip}")
            pool = comm_buffer_pool(module)
            assert (pool is not None) == (stage >= 2), "stages 2-3 on CPU pool FSDP2's communication buffers"
            assert pool is None or pool.nbytes == 0, "teardown must let the pooled buffers go"
            # The scheduler stepped the optimizer the strategy steps (StepLR halves every step).
            lrs = [g["lr"] for g in trainer.optimizers[0].param_groups]
            assert lrs == pytest.approx([1e-2 * 0.5**STEPS, 5e-3 * 0.5**STEPS])


def test_fit_matches_reference_every_stage_and_offload():
    run_distributed(_fit_parity_worker, 2)


def _manual_and_eval_worker(rank, world_size):
    for stage in (1, 3):
        torch.manual_seed(0)
        module = ManualModule(batch_size=BATCH)
        trainer = make_trainer(ZeroStrategy(stage=stage), world_size, limit_val_batches=1.0)
        trainer.fit(module)
        assert_close_to_reference(module, reference_weights(STEPS, BATCH * world_size), f"manual stage={stage}")

        # validate / test / predict after fit, with sync_dist logging averaged over ranks
        val = trainer.validate(module, verbose=False)[0]["val_loss"]
        test = trainer.test(module, verbose=False)[0]["test_loss"]
        assert val == pytest.approx(test)
        preds = trainer.predict(module)
        assert sum(p.shape[0] for p in preds) == 16 // world_size
        # the logged value equals the full-dataset loss computed on one process with the same weights
        from tests.lightning_models import dataset

        x, y = dataset(16, seed=8).tensors
        plain = RegressionModule()
        plain.load_state_dict(full_state(module))
        expected = torch.nn.functional.mse_loss(plain(x), y).item()
        assert val == pytest.approx(expected, rel=1e-5)


def test_manual_optimization_and_evaluation():
    run_distributed(_manual_and_eval_worker, 2)


class _RecordBatches(Callback):
    def __init__(self):
        self.first_inputs = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.first_inputs.append(batch[0][0].clone())


def _sampler_and_metrics_worker(rank, world_size):
    import torch.distributed as dist
    import torchmetrics

    strategy = ZeroStrategy(stage=2)
    recorder = _RecordBatches()
    trainer = make_trainer(strategy, world_size, max_steps=2, callbacks=[recorder])
    trainer.fit(RegressionModule(batch_size=BATCH))
    assert strategy.is_distributed
    assert strategy.distributed_sampler_kwargs == {"num_replicas": world_size, "rank": rank}
    gathered = [torch.zeros(6) for _ in range(world_size)]
    dist.all_gather(gathered, recorder.first_inputs[0])
    assert not torch.equal(gathered[0], gathered[1]), "both ranks saw the same sample: no distributed sampler"

    metric = torchmetrics.MeanMetric()
    metric.update(torch.tensor(float(rank)))
    assert metric.compute().item() == pytest.approx((world_size - 1) / 2)  # synced across ranks
    reduced = strategy.reduce(torch.tensor(float(rank)), reduce_op="mean")
    assert reduced.item() == pytest.approx((world_size - 1) / 2)


def test_sampler_sync_dist_and_torchmetrics():
    run_distributed(_sampler_and_metrics_worker, 2)


def _meta_init_worker(rank, world_size):
    from torch.distributed.tensor import DTensor

    module = RegressionModule(build_in_configure_model=True)
    trainer = make_trainer(ZeroStrategy(stage=3), world_size, max_steps=2)
    trainer.fit(module)
    for name, param in module.named_parameters():
        assert isinstance(param, DTensor), name
        assert not param.is_meta, name
        local, full = param.to_local(), param.full_tensor()
        assert local.numel() <= -(-full.shape[0] // world_size) * max(1, full[0].numel()), name
        assert torch.isfinite(full).all()
    # Each rank drew its own shard: no weight is N copies of one block.
    weight = module.net.inp.weight.full_tensor()
    half = weight.shape[0] // 2
    assert not torch.equal(weight[:half], weight[half:])


def test_configure_model_builds_on_meta_and_materialises_sharded():
    run_distributed(_meta_init_worker, 2)


def test_registered_names_resolve_to_configured_strategies():
    expected = {
        "zero": (2, "none"),
        "zero_stage_1": (1, "none"),
        "zero_stage_2": (2, "none"),
        "zero_stage_2_offload": (2, "cpu"),
        "zero_stage_3": (3, "none"),
        "zero_stage_3_offload": (3, "cpu"),
    }
    for name, (stage, offload) in expected.items():
        trainer = Trainer(
            strategy=name,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
        )
        assert isinstance(trainer.strategy, ZeroStrategy), name
        assert (trainer.strategy.stage, trainer.strategy.zero_config.offload) == (stage, offload), name


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(stage=4), "stage must be one of"),
        (dict(stage=0, offload="cpu"), "needs a ZeRO stage of 1, 2 or 3"),
        (dict(offload="tape"), "offload must be one of"),
        (dict(offload="nvme"), "needs nvme_path"),
        (dict(stage=3, offload="nvme"), "offload_optimizer='nvme' and offload_params='nvme' .*needs nvme_path"),
        (dict(stage=1, sharded_module_classes={"Block"}), "only applies to stages 2 and 3"),
        (dict(stage=2, reshard_after_forward=True), "only applies to stage 3"),
        (dict(start_method="thread"), "start_method must be"),
    ],
)
def test_invalid_arguments_fail_in_the_constructor(kwargs, message):
    with pytest.raises((ValueError, NotImplementedError, TypeError), match=message):
        ZeroStrategy(**kwargs)


def test_unsupported_precision_is_refused_not_ignored():
    with pytest.raises(NotImplementedError, match="'64-true' is not implemented"):
        Trainer(strategy=ZeroStrategy(stage=2), accelerator="cpu", devices=1, precision="64-true")


def test_single_process_fit_and_lightning_cli_yaml(tmp_path, monkeypatch):
    from lightning.pytorch.cli import LightningCLI

    config = tmp_path / "config.yaml"
    config.write_text(f"""
trainer:
  accelerator: cpu
  devices: 1
  max_steps: 2
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  default_root_dir: {tmp_path}
  strategy:
    class_path: lightning_zero.ZeroStrategy
    init_args:
      stage: 3
      offload: cpu
      sharded_module_classes: [Block]
model:
  batch_size: 8
""")
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MASTER_PORT", str(__import__("tests.ranks", fromlist=["x"]).free_port()))
    cli = LightningCLI(RegressionModule, args=["fit", "--config", str(config)], save_config_kwargs={"overwrite": True})
    strategy = cli.trainer.strategy
    assert isinstance(strategy, ZeroStrategy)
    assert strategy.stage == 3 and strategy.zero_config.offload == "cpu"
    assert strategy.zero_config.sharded_module_classes == frozenset({"Block"})
    assert cli.trainer.global_step == 2
    torch.distributed.destroy_process_group()
