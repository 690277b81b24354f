"""Precision under the Fabric ZeroStrategy: bf16 compute on fp32 masters close to the fp32 reference, DeepSpeed's
fp16 loss scaling (an overflow on one rank skips the step everywhere; clipping sees unscaled gradients; the scaler
travels in fabric.save), and unsupported precisions refused."""

import math

import pytest
import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from torch import nn

from lightning_zero import LossScaleConfig
from lightning_zero.fabric import FabricZeroPrecision, ZeroStrategy
from lightning_zero.torch_compat import local_tensor as _local
from tests.distributed.test_zero_parity import LOCAL_BATCH, TinyNet, data, make_optimizer, train_reference
from tests.fabric.test_fabric_parity import fabric_train, full_weights, make_fabric
from tests.ranks import run_distributed


def _saved_weights(fabric, module):
    """The whole weights ``fabric.save`` writes, on every rank."""
    mine = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in fabric.strategy.get_module_state_dict(module).items()
    }
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: v for part in every for k, v in part.items()}


def _bf16_worker(rank, world_size):
    expected = train_reference(world_size)
    for precision, stage in (("bf16-mixed", 1), ("bf16-mixed", 3), ("bf16-true", 0), ("bf16-true", 2)):
        fabric = make_fabric(ZeroStrategy(stage=stage), precision=precision)
        assert fabric.strategy.precision.precision == precision
        dtypes = set()
        torch.manual_seed(0)
        module = TinyNet()
        module.blocks[0].fc.register_forward_hook(lambda m, i, out: dtypes.add(out.dtype))
        model, optimizer = fabric.setup(module, make_optimizer(module))
        fabric_train(fabric, rank, world_size, model=model, optimizer=optimizer)
        got = _saved_weights(fabric, module)  # bf16-true at stage 0: the fp32 masters beside bf16 replicas
        assert dtypes == {torch.bfloat16}, f"stage {stage}: computed in {dtypes}"
        assert all(v.dtype == torch.float32 for v in got.values()), f"stage {stage}: masters are not fp32"
        worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
        assert worst <= 5e-2, f"stage {stage}: max abs diff {worst:.2e} from the fp32 reference"


def test_bf16_mixed_and_true_compute_in_bf16_on_fp32_masters():
    run_distributed(_bf16_worker, 2)


def _reference_grad_norm(world_size):
    torch.manual_seed(0)
    module = TinyNet()
    x, y = data(world_size, 1)
    n = world_size * LOCAL_BATCH
    nn.functional.mse_loss(module(x[:n]), y[:n]).backward()
    return math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in module.parameters()))


def _fp16_worker(rank, world_size, path, expected_norm):
    for stage in (1, 2):
        scaling = LossScaleConfig(initial_scale_power=12, hysteresis=1)
        fabric = make_fabric(
            ZeroStrategy(stage=stage), plugins=FabricZeroPrecision("16-mixed", loss_scale_config=scaling)
        )
        scaler = fabric.strategy.precision.scaler
        torch.manual_seed(0)
        module = TinyNet()
        model, optimizer = fabric.setup(module, make_optimizer(module))
        x, y = data(world_size, 1)
        lx, ly = x[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH], y[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]
        before = full_weights(module)
        # Step 1: an inf in one gradient of rank 1 only: every rank skips the step, the scale halves.
        fabric.backward(nn.functional.mse_loss(model(lx), ly))
        if rank == 1:
            grad = next(p.grad for p in module.parameters() if p.grad is not None)
            _local(grad).view(-1)[0] = float("inf")
        fabric.clip_gradients(model, optimizer, max_norm=1e9)
        optimizer.step()
        optimizer.zero_grad()
        assert all(torch.equal(before[k], v) for k, v in full_weights(module).items()), f"stage {stage}: stepped"
        assert (scaler.scale, scaler.skipped_steps) == (2.0**11, 1), f"stage {stage}"
        # Step 2: clean; clipping reads the unscaled global norm (a 2**11 factor would be obvious).
        fabric.backward(nn.functional.mse_loss(model(lx), ly))
        norm = fabric.clip_gradients(model, optimizer, max_norm=1e9)
        assert float(norm) == pytest.approx(expected_norm, rel=1e-2), f"stage {stage}"
        optimizer.step()
        assert any(not torch.equal(before[k], v) for k, v in full_weights(module).items()), f"stage {stage}"
        fabric.save(path, {"model": model, "optimizer": optimizer})
        scaler.update(True)  # another overflow after the save: the load must undo it
        assert scaler.scale == 2.0**10
        fabric.load(path, {"model": model, "optimizer": optimizer})
        assert scaler.scale == 2.0**11 and scaler.skipped_steps == 1, f"stage {stage}: scaler not restored"
        # An overflowing clip without a step, then a clean backward: the stale overflow must not skip that step.
        fabric.backward(nn.functional.mse_loss(model(lx), ly))
        if rank == 1:
            grad = next(p.grad for p in module.parameters() if p.grad is not None)
            _local(grad).view(-1)[0] = float("inf")
        fabric.clip_gradients(model, optimizer, max_norm=1e9)
        optimizer.zero_grad()
        before = full_weights(module)
        fabric.backward(nn.functional.mse_loss(model(lx), ly))
        optimizer.step()
        assert any(not torch.equal(before[k], v) for k, v in full_weights(module).items()), f"stage {stage}"


def test_fp16_overflow_skips_everywhere_clipping_is_unscaled_and_scaler_is_saved(tmp_path):
    run_distributed(_fp16_worker, 2, str(tmp_path / "fp16.ckpt"), _reference_grad_norm(2))


def test_unsupported_precision_is_refused():
    with pytest.raises(NotImplementedError, match="ZeroStrategy supports precision in .* DoublePrecision"):
        Fabric(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=2), precision="64-true")


def _config_precision_worker(rank, world_size):
    fabric = make_fabric(ZeroStrategy(config={"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}))
    precision = fabric.strategy.precision
    assert isinstance(precision, FabricZeroPrecision) and precision.precision == "bf16-mixed"
    dtypes = set()
    torch.manual_seed(0)
    module = TinyNet()
    module.blocks[0].fc.register_forward_hook(lambda m, i, out: dtypes.add(out.dtype))
    model = fabric.setup(module)
    model(torch.randn(2, 8))
    assert dtypes == {torch.bfloat16}


def test_ds_config_precision_is_adopted_when_fabric_keeps_its_default():
    run_distributed(_config_precision_worker, 2)
