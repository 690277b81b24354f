"""Offloaded training on one CUDA device against the single-process CPU references: gradient clipping at stage 3 +
CPU offload (the Trainer's ``gradient_clip_val`` and ``fabric.clip_gradients``), fp16 (``16-mixed``) with the
parameters offloaded, and FusedLamb offloaded at stages 2 and 3 (its torch path steps the CPU masters; without
offload its Triton kernel steps the CUDA shards).

Runs as `python -m pytest tests/gpu -q` on a machine with a GPU; skipped cleanly elsewhere.
"""

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import Trainer
from torch import nn

from lightning_zero import ZeroStrategy
from lightning_zero.fabric import ZeroStrategy as FabricZeroStrategy
from lightning_zero.ops import FusedLamb
from lightning_zero.ops.fused_lamb import triton_available
from tests.distributed.test_zero_parity import LOCAL_BATCH, STEPS, TinyNet, data, make_optimizer, train_reference
from tests.gpu.single_device import (
    DEVICE,
    TRAINER_ACCELERATOR,
    assert_device_backend,
    end_process_group,
    full_weights,
    needs_device,
    start_one_rank,
    worst_difference,
)
from tests.lightning_models import Net, RegressionModule, dataset, reference_weights

pytestmark = needs_device

BATCH, TRAINER_STEPS, CLIP = 8, 4, 0.05
TOLERANCE = 1e-4  # fp32 on the device against the CPU reference, as tests/gpu/test_strategy_gpu.py


@pytest.fixture(autouse=True)
def one_rank(monkeypatch):
    start_one_rank(monkeypatch)
    yield
    end_process_group()


def _fit(module, strategy, **kwargs):
    trainer = Trainer(
        accelerator=TRAINER_ACCELERATOR,
        devices=1,
        strategy=strategy,
        max_steps=TRAINER_STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        **kwargs,
    )
    trainer.fit(module)
    assert_device_backend()
    return trainer


def test_trainer_gradient_clipping_at_stage_3_with_cpu_offload():
    expected = reference_weights(TRAINER_STEPS, BATCH, clip=CLIP)
    assert worst_difference(expected, reference_weights(TRAINER_STEPS, BATCH)) > 5 * TOLERANCE, "the clip does not bite"
    torch.manual_seed(0)
    module = RegressionModule(batch_size=BATCH)
    _fit(module, ZeroStrategy(stage=3, offload="cpu"), gradient_clip_val=CLIP)
    assert all(p.device.type == "cpu" for p in module.parameters())
    assert worst_difference(full_weights(module), expected) <= TOLERANCE


def test_fabric_clip_gradients_at_stage_3_with_cpu_offload():
    expected = train_reference(1, clip=CLIP)
    assert worst_difference(expected, train_reference(1)) > 5 * TOLERANCE, "the clip does not bite"
    fabric = Fabric(accelerator=DEVICE, devices=1, strategy=FabricZeroStrategy(stage=3, offload="cpu"))
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module():
        module = TinyNet()
    model, optimizer = fabric.setup(module, make_optimizer(module))
    x, y = data(1, 1)
    for step in range(STEPS):
        rows = slice(step * LOCAL_BATCH, (step + 1) * LOCAL_BATCH)
        fabric.backward(nn.functional.mse_loss(model(fabric.to_device(x[rows])), fabric.to_device(y[rows])))
        norm = fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        assert norm.item() > CLIP  # the norm before clipping, over the whole model
        optimizer.step()
        optimizer.zero_grad()
    assert_device_backend()
    assert all(p.device.type == "cpu" for p in module.parameters())
    assert worst_difference(full_weights(module), expected) <= TOLERANCE


def test_fp16_with_offloaded_parameters_stays_close_to_fp32():
    """On CUDA ``16-mixed`` is fp16 with DeepSpeed's loss scaling; the fp32 parameter shards live on the CPU."""
    torch.manual_seed(0)
    module = RegressionModule(batch_size=BATCH)
    scaling = dict(initial_scale_power=8) if DEVICE == "cuda" else {}  # bf16 on CPU refuses loss-scale settings
    strategy = ZeroStrategy(stage=3, offload_optimizer="cpu", offload_params="cpu", **scaling)
    trainer = _fit(module, strategy, precision="16-mixed")
    assert all(p.device.type == "cpu" for p in module.parameters())
    saved = strategy.lightning_module_state_dict()
    assert all(v.dtype == torch.float32 for v in saved.values())
    got = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu() for k, v in saved.items()}
    # the bound of tests/strategies/test_precision.py
    assert worst_difference(got, reference_weights(TRAINER_STEPS, BATCH)) <= 5e-2
    if DEVICE == "cuda":  # Lightning turns 16-mixed into bf16-mixed on CPU: no scaler there
        assert trainer.precision == "16-mixed" and strategy.precision_plugin.scaler.skipped_steps == 0


LAMB = dict(lr=1e-2, weight_decay=0.01, max_coeff=2.0, min_coeff=0.5)


class LambModule(RegressionModule):
    def configure_optimizers(self):
        return FusedLamb(self.parameters(), **LAMB)


def _lamb_reference(steps, batch):
    """Net stepped by FusedLamb's torch path on one CPU process, on the batches the Trainer's one rank sees
    (DistributedSampler's epoch-0 permutation, as tests/lightning_models.py's reference_weights)."""
    torch.manual_seed(0)
    net = Net()
    optimizer = FusedLamb(net.parameters(), implementation="torch", **LAMB)
    x_all, y_all = dataset().tensors
    order = torch.randperm(len(x_all), generator=torch.Generator().manual_seed(0))
    for step in range(steps):
        rows = order[step * batch : (step + 1) * batch]
        nn.functional.mse_loss(net(x_all[rows]), y_all[rows]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {f"net.{k}": v.detach().clone() for k, v in net.state_dict().items()}


@pytest.mark.parametrize("stage, offload", [(2, "cpu"), (3, "cpu"), (3, None)])
def test_fused_lamb_with_and_without_offload(stage, offload):
    torch.manual_seed(0)
    module = LambModule(batch_size=BATCH)
    trainer = _fit(module, ZeroStrategy(stage=stage, offload=offload))
    optimizer = getattr(trainer.optimizers[0], "_optimizer", trainer.optimizers[0])
    # "auto": Triton for CUDA tensors; the offloaded step runs on the CPU masters, on torch's path
    on_cuda = DEVICE == "cuda" and offload is None
    assert optimizer.last_implementation == ("triton" if on_cuda and triton_available() else "torch")
    assert worst_difference(full_weights(module), _lamb_reference(TRAINER_STEPS, BATCH)) <= TOLERANCE
