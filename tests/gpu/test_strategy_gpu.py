"""ZeroStrategy on one CUDA device with NCCL: every stage and CPU offload (pinned) against a single-GPU reference.

Runs as `python -m pytest tests/gpu -q` on a machine with a GPU; skipped cleanly elsewhere (see tests/conftest.py).
"""

import os

import pytest
import torch

from tests.lightning_models import RegressionModule, full_state, reference_weights
from tests.ranks import free_port

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize(
    "stage, offload",
    [(0, None), (1, None), (1, "cpu"), (2, None), (2, "cpu"), (3, None), (3, "cpu"), (3, {"offload_optimizer": "cpu"})],
)
def test_single_gpu_fit_matches_reference(stage, offload, monkeypatch, tmp_path):
    from lightning.pytorch import Trainer

    from lightning_zero import ZeroStrategy
    from lightning_zero.distributed.optimizer import get_sharding

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    torch.manual_seed(0)
    module = RegressionModule(batch_size=8)
    strategy = (
        ZeroStrategy(stage=stage, **offload)
        if isinstance(offload, dict)
        else ZeroStrategy(stage=stage, offload=offload)
    )
    trainer = Trainer(
        accelerator="gpu",
        devices=1,
        strategy=strategy,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module)
    assert strategy.process_group_backend == "cpu:gloo,cuda:nccl"  # CPU tensors (offloaded shards) go to gloo
    if offload == "cpu" and stage == 3:  # offload="cpu" at stage 3 is both sections: FSDP2's CPUOffloadPolicy
        assert all(p.device.type == "cpu" for p in module.parameters()), "FSDP2 offload keeps shards on the CPU"
    elif offload:  # stages 1-2: DeepSpeed's ZeRO-Offload, parameters stay on the device, pinned CPU masters step
        assert all(p.device.type == "cuda" for p in module.parameters()), "optimizer offload moved the parameters"
        sharding = get_sharding(getattr(trainer.optimizers[0], "_optimizer", trainer.optimizers[0]))
        masters = [m._local_tensor if hasattr(m, "_local_tensor") else m for m in sharding.masters.values()]
        assert masters and all(m.device.type == "cpu" and m.is_pinned() for m in masters)
    from lightning_zero.distributed.comm_buffers import comm_buffer_pool

    assert comm_buffer_pool(module) is None, "the CPU buffer pool stays off on CUDA (its caching allocator is there)"
    got = {k: v.cpu() for k, v in full_state(module).items()}
    expected = reference_weights(4, 8)
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= 1e-4, worst  # TF32/cuBLAS vs CPU reference
    torch.distributed.destroy_process_group()


def test_offload_pins_cpu_masters_on_cuda():
    from lightning_zero import ZeroConfig
    from lightning_zero.distributed.optimizer import shard_optimizer

    model = torch.nn.Linear(8, 8).cuda()
    opt = torch.optim.Adam(model.parameters())
    sharding = shard_optimizer(opt, ZeroConfig(stage=1, offload="cpu"), device=torch.device("cuda"))
    assert sharding.masters and all(m.is_pinned() and m.device.type == "cpu" for m in sharding.masters.values())
    model(torch.randn(4, 8, device="cuda")).sum().backward()
    before = model.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, model.weight.detach())
    assert model.weight.device.type == "cuda"


@pytest.mark.parametrize(
    "stage, precision",
    [(0, "bf16-mixed"), (1, "16-mixed"), (2, "bf16-true"), (3, "16-mixed"), (3, "bf16-mixed"), (1, "bf16-true")],
)
def test_single_gpu_low_precision_stays_close_to_fp32(stage, precision, monkeypatch, tmp_path):
    """On CUDA, 16-mixed is fp16 (Lightning only rewrites it on CPU): DeepSpeed loss scaling on a real device. Stage 1
    under bf16-true: bf16 replicas on the device, fp32 masters beside the optimizer (distributed/replicas.py)."""
    from lightning.pytorch import Trainer

    from lightning_zero import ZeroStrategy

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    torch.manual_seed(0)
    module = RegressionModule(batch_size=8)
    scaling = dict(initial_scale_power=8) if precision.startswith("16") else {}
    strategy = ZeroStrategy(stage=stage, **scaling)
    trainer = Trainer(
        accelerator="gpu",
        devices=1,
        strategy=strategy,
        max_steps=4,
        logger=False,
        precision=precision,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module)
    assert trainer.precision == precision
    saved = strategy.lightning_module_state_dict()  # what a checkpoint holds (bf16-true at stage 1: the masters)
    assert all(v.dtype == torch.float32 for v in saved.values())
    got = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu() for k, v in saved.items()}
    expected = reference_weights(4, 8)
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= 5e-2, worst  # same tolerance as the CPU precision tests
    if precision.startswith("16"):
        assert strategy.precision_plugin.scaler.skipped_steps == 0
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("stage, offload", [(1, {"offload_optimizer": "nvme"}), (3, {"offload": "nvme"})])
def test_single_gpu_nvme_offload_matches_reference(stage, offload, monkeypatch, tmp_path):
    """NVMe offload computing on CUDA: optimizer states (and at stage 3 the parameter shards) swapped through pinned
    host buffers, against the single-GPU reference; the swap folder is gone after fit."""
    from lightning.pytorch import Trainer

    from lightning_zero import ZeroStrategy

    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    nvme_path = tmp_path / "nvme"
    nvme_path.mkdir()
    torch.manual_seed(0)
    module = RegressionModule(batch_size=8)
    strategy = ZeroStrategy(stage=stage, nvme_path=str(nvme_path), **offload)
    trainer = Trainer(
        accelerator="gpu",
        devices=1,
        strategy=strategy,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(module)
    assert not any(files for _, _, files in os.walk(nvme_path)), "swap files left after fit"
    got = {k: v.cpu() for k, v in full_state(module).items()}
    expected = reference_weights(4, 8)
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= 1e-4, worst  # TF32/cuBLAS vs CPU reference
    torch.distributed.destroy_process_group()
