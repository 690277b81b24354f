"""Precision under ZeroStrategy: bf16/fp16 at every stage, DeepSpeed loss scaling, skipped steps, clipping, resume."""

import math

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback

from lightning_zero import LossScaleConfig, ZeroPrecision, ZeroStrategy
from lightning_zero.ops import DynamicLossScaler, LossScaleAtMinimumError
from tests.lightning_models import RegressionModule, dataset, full_state, reference_weights, trained_weights
from tests.ranks import run_distributed

BATCH = 4
STEPS = 4
# bf16/fp16 compute against the fp32 reference after 4 AdamW steps at lr 1e-2: Adam normalises each update, so a
# gradient component near zero whose sign flips in low precision moves by up to 2 x lr per step.
LOW_PRECISION_TOLERANCE = 5e-2


class DtypeProbe(RegressionModule):
    """Records the dtype the first block computes in and injects inf into one gradient on chosen steps/ranks."""

    def __init__(self, batch_size=BATCH, poison_steps=(), poison_rank=1):
        super().__init__(batch_size=batch_size)
        self.poison_steps, self.poison_rank = set(poison_steps), poison_rank
        self.compute_dtypes = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.compute_dtypes.append(self.net.inp(x).dtype)
        return super().training_step(batch, batch_idx)

    def on_after_backward(self):
        if self.global_step in self.poison_steps and self.global_rank == self.poison_rank:
            grad = self.net.out.weight.grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            if local.numel():
                local.view(-1)[0] = float("inf")  # this rank's shard only: the overflow check must be collective


def _trainer(strategy, world_size, precision, **kwargs):
    plugins = []
    if precision == "16-mixed":  # Lightning turns 16-mixed into bf16-mixed on CPU; the plugin keeps fp16
        plugins, precision = [ZeroPrecision("16-mixed", loss_scale_config=kwargs.pop("loss_scale_config", None))], None
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
    )
    defaults.update(kwargs)
    return Trainer(strategy=strategy, precision=precision, plugins=plugins, **defaults)


LOW = {"bf16-mixed": torch.bfloat16, "bf16-true": torch.bfloat16, "16-true": torch.float16, "16-mixed": torch.float16}


def _every_stage_worker(rank, world_size):
    cases = [(0, None), (1, None), (1, "cpu"), (2, None), (3, None), (3, "cpu")]
    for precision, dtype in LOW.items():
        for stage, offload in cases:
            torch.manual_seed(0)
            module = DtypeProbe()
            scaling = dict(initial_scale_power=8) if dtype is torch.float16 else {}
            if precision == "16-mixed":
                strategy = ZeroStrategy(stage=stage, offload=offload)
                trainer = _trainer(
                    strategy, world_size, precision, loss_scale_config=LossScaleConfig(initial_scale_power=8)
                )
            else:
                strategy = ZeroStrategy(stage=stage, offload=offload, **scaling)
                trainer = _trainer(strategy, world_size, precision)
            trainer.fit(module)
            label = f"{precision} stage={stage} offload={offload}"
            assert set(module.compute_dtypes) == {dtype}, f"{label}: computed in {module.compute_dtypes}"
            got = trained_weights(trainer)
            assert all(v.dtype == torch.float32 for v in got.values()), f"{label}: masters are not fp32"
            expected = reference_weights(STEPS, BATCH * world_size)
            worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
            assert worst <= LOW_PRECISION_TOLERANCE, f"{label}: max abs diff {worst:.2e} from the fp32 reference"
            if dtype is torch.float16:
                assert trainer.strategy.precision_plugin.scaler.skipped_steps == 0, label


def test_bf16_and_fp16_at_every_stage_stay_close_to_the_fp32_reference():
    run_distributed(_every_stage_worker, 2)


class Snapshots(Callback):
    """Weights, optimizer state and LR before and after every training batch, plus what the strategy logged."""

    def __init__(self):
        self.before, self.after, self.logged = [], [], []

    def _snap(self, trainer, module):
        optimizer = trainer.optimizers[0]
        states = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()} for s in optimizer.state.values()]
        return (full_state(module), states, [g["lr"] for g in optimizer.param_groups])

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.before.append(self._snap(trainer, module))

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.after.append(self._snap(trainer, module))
        metrics = trainer.callback_metrics
        self.logged.append((float(metrics["loss_scale"]), float(metrics["skipped_steps"])))


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def _states_equal(a, b):
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        for key in x:
            if torch.is_tensor(x[key]) and not torch.equal(x[key], y[key]):
                return False
    return True


def _overflow_worker(rank, world_size):
    for stage in (1, 3):
        torch.manual_seed(0)
        module = DtypeProbe(poison_steps={2})
        snaps = Snapshots()
        strategy = ZeroStrategy(stage=stage, initial_scale_power=8, hysteresis=1, loss_scale_window=2)
        trainer = _trainer(strategy, world_size, "16-true", max_steps=5, callbacks=[snaps])
        trainer.fit(module)
        for step, (before, after) in enumerate(zip(snaps.before, snaps.after)):
            weights_same = _same(before[0], after[0])
            if step == 2:
                assert weights_same, f"stage {stage}: an overflowing step changed the weights"
                assert _states_equal(before[1], after[1]), f"stage {stage}: optimizer state changed on a skipped step"
                assert before[2] == after[2], f"stage {stage}: the LR scheduler stepped on a skipped step"
            else:
                assert not weights_same, f"stage {stage}: clean step {step} did not update the weights"
                assert after[2] != before[2]
        # The logged loss scale follows DeepSpeed's rules on the same overflow sequence.
        reference = DynamicLossScaler(initial_scale_power=8, hysteresis=1, loss_scale_window=2)
        expected = []
        for step in range(5):
            reference.update(step == 2)
            expected.append((reference.scale, float(reference.skipped_steps)))
        assert snaps.logged == expected, f"stage {stage}: {snaps.logged} != {expected}"
        assert trainer.global_step == 5
        # 4 optimizer steps happened, so StepLR halved the LR 4 times (not 5)
        assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**4)


def test_injected_overflow_on_one_rank_skips_the_step_everywhere():
    run_distributed(_overflow_worker, 2)


def _min_scale_worker(rank, world_size):
    module = DtypeProbe(poison_steps={0, 1})
    strategy = ZeroStrategy(stage=2, initial_scale_power=0, min_loss_scale=1, hysteresis=1)
    trainer = _trainer(strategy, world_size, "16-true")
    with pytest.raises(LossScaleAtMinimumError, match="already at its minimum"):
        trainer.fit(module)


def test_overflow_at_the_minimum_scale_fails_clearly():
    run_distributed(_min_scale_worker, 2)


def _scaler_resume_worker(rank, world_size, path):
    torch.manual_seed(0)
    strategy = ZeroStrategy(stage=3, initial_scale_power=8, hysteresis=1, loss_scale_window=100)
    trainer = _trainer(strategy, world_size, "16-true", max_steps=3)
    trainer.fit(DtypeProbe(poison_steps={1}))
    saved = trainer.strategy.precision_plugin.scaler.state_dict()
    assert saved["cur_scale"] == 128.0 and saved["skipped_steps"] == 1
    trainer.save_checkpoint(path)

    strategy = ZeroStrategy(stage=1, initial_scale_power=8, hysteresis=1, loss_scale_window=100)
    resumed = _trainer(strategy, world_size, "16-true", max_steps=3)
    resumed.fit(DtypeProbe(), ckpt_path=path)  # max_steps already reached: restores, runs no step
    assert resumed.strategy.precision_plugin.scaler.state_dict() == saved


def test_scaler_state_survives_a_checkpoint_round_trip(tmp_path):
    run_distributed(_scaler_resume_worker, 2, str(tmp_path / "fp16.ckpt"))


class NormProbe(DtypeProbe):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.norms_before = getattr(self, "norms_before", []) + [_global_grad_norm(self)]
        self.clip_gradients(
            optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm
        )
        self.norms_after = getattr(self, "norms_after", []) + [_global_grad_norm(self)]


def _global_grad_norm(module):
    total = 0.0
    for p in module.parameters():
        if p.grad is not None:
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            total += grad.double().pow(2).sum().item()
    return math.sqrt(total)


def _reference_first_grad_norm(world_size):
    torch.manual_seed(0)
    module = RegressionModule()
    x, y = dataset().tensors
    sampler = torch.utils.data.DistributedSampler
    indices = []
    for r in range(world_size):
        indices += list(sampler(range(len(x)), num_replicas=world_size, rank=r, shuffle=True, seed=0))[:BATCH]
    torch.nn.functional.mse_loss(module(x[indices]), y[indices]).backward()
    return math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in module.parameters()))


def _clipping_worker(rank, world_size, expected_norm):
    for stage in (0, 2):
        torch.manual_seed(0)
        module = NormProbe()
        strategy = ZeroStrategy(stage=stage, initial_scale_power=12)
        trainer = _trainer(strategy, world_size, "16-true", max_steps=1, gradient_clip_val=0.01)
        trainer.fit(module)
        # unscaled (a 2**12 factor would be obvious) and global over shards/ranks
        assert module.norms_before[0] == pytest.approx(expected_norm, rel=1e-2), f"stage {stage}"
        assert module.norms_after[0] == pytest.approx(0.01, rel=1e-3), f"stage {stage}"


def test_clipping_by_norm_uses_the_unscaled_global_norm():
    run_distributed(_clipping_worker, 2, _reference_first_grad_norm(2))


def _communication_dtype_worker(rank, world_size):
    for stage in (0, 2):
        torch.manual_seed(0)
        module = DtypeProbe()
        trainer = _trainer(ZeroStrategy(stage=stage, communication_data_type="bf16"), world_size, "bf16-mixed")
        trainer.fit(module)
        expected = reference_weights(STEPS, BATCH * world_size)
        got = full_state(module)
        assert max((got[k] - expected[k]).abs().max().item() for k in expected) <= LOW_PRECISION_TOLERANCE
        if stage == 0:
            assert trainer.strategy.model is module  # DDP unwrapped at teardown; the hook ran during fit
        else:
            assert trainer.strategy.precision_plugin.fsdp_mp_policy().reduce_dtype is torch.bfloat16


def test_communication_data_type_reduces_in_bf16():
    run_distributed(_communication_dtype_worker, 2)


def test_low_precision_allreduce_hook_averages_in_the_given_dtype():
    run_distributed(_hook_worker, 2)


def _hook_worker(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel

    from lightning_zero.distributed.ddp import low_precision_allreduce_hook

    layer = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    ddp = DistributedDataParallel(layer)
    ddp.register_comm_hook(None, low_precision_allreduce_hook(torch.bfloat16))
    x = torch.full((1, 3), 1.0 + 1e-3 * (rank + 1))  # the difference is below bf16's resolution at 1.0
    ddp(x).sum().backward()
    assert layer.weight.grad.dtype == torch.float32
    assert torch.all(layer.weight.grad == torch.tensor(1.0, dtype=torch.bfloat16).float())
    dist.barrier()


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(loss_scale=-1), ValueError, "loss_scale must be 0"),
        (dict(hysteresis=0), ValueError, "hysteresis"),
        (dict(loss_scale_window=0), ValueError, "loss_scale_window"),
        (dict(min_loss_scale=0), ValueError, "min_loss_scale"),
        (dict(initial_scale_power=-1), ValueError, "initial_scale_power"),
        (dict(communication_data_type="int8"), ValueError, "communication_data_type"),
    ],
)
def test_invalid_precision_arguments_fail_in_the_constructor(kwargs, error, message):
    with pytest.raises(error, match=message):
        ZeroStrategy(stage=2, **kwargs)


def test_loss_scale_arguments_without_fp16_are_an_error_not_ignored():
    with pytest.raises(ValueError, match="loss scaling applies to fp16 training only"):
        Trainer(strategy=ZeroStrategy(stage=2, loss_scale=128), accelerator="cpu", devices=1, precision="bf16-mixed")
    with pytest.raises(ValueError, match="loss scaling applies to fp16 training only"):
        Trainer(strategy=ZeroStrategy(stage=2, hysteresis=4), accelerator="cpu", devices=1)
