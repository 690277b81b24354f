"""The NVMe-swapped optimizer step at stages 2-3 runs the user's optimizer on the local shards
(lightning_zero.distributed.local_step inside the swappers' sub-group steps): no DTensor dispatch in the step, and
bitwise the same weights and states as torch's DTensor path under the same swapping, and within 1e-6 of CPU offload; for
the default AdamW and for AdamW(fused=True) (torch's one-pass CPU kernel, run per sub-group and unit)."""

import torch

from lightning_zero.distributed import cpu_tuning
from lightning_zero.distributed.apply_zero import apply_zero
from lightning_zero.distributed.config import ZeroConfig
from lightning_zero.distributed.local_step import is_local_step
from lightning_zero.distributed.optimizer import shard_optimizer
from lightning_zero.offload.nvme_config import NvmeConfig
from lightning_zero.offload.optimizer_swapper import get_swapper
from tests.distributed.test_local_step import Net, _same, train_counting_dispatches
from tests.ranks import run_distributed

# stage 2: optimizer states and fp32 masters swapped; stage 3: parameters and optimizer states swapped
CASES = [(2, dict(offload_optimizer="nvme")), (3, dict(offload_optimizer="nvme", offload_params="nvme"))]
OPTIMIZERS = [
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, fused=True)),
]


def _train(rank, root, stage, offload, cls, kwargs, local, steps=3, accumulate=2, clip=0.05):
    from torch.distributed.device_mesh import init_device_mesh

    # small sub-groups, units and budget: several sub-groups per step, units evicted and read back
    param_knobs = dict(buffer_size=64, max_in_cpu=150) if stage == 3 else {}
    nvme = NvmeConfig(root, sub_group_size=60, buffer_count=3, **param_knobs) if "nvme" in offload.values() else None
    config = ZeroConfig(stage=stage, nvme=nvme, unit_bytes=0, **offload)
    torch.manual_seed(0)
    module = apply_zero(Net(), init_device_mesh("cpu", (2,)), config)
    optimizer = cls(module.parameters(), **kwargs)
    if local:
        sharding = shard_optimizer(optimizer, config)
    else:  # the reference: torch's DTensor path under the same swapping
        original = cpu_tuning.use_local_step
        cpu_tuning.use_local_step = lambda opt: False
        try:
            sharding = shard_optimizer(optimizer, config)
        finally:
            cpu_tuning.use_local_step = original
    assert is_local_step(optimizer) == local
    swapper = get_swapper(optimizer)
    assert swapper is None or len(swapper.subgroups) > 1
    dispatches = train_counting_dispatches(rank, module, optimizer, sharding, steps, accumulate, clip)
    state = {key: value.full_tensor() for key, value in module.state_dict().items()}
    if swapper is not None:
        swapper.make_resident()
    moments = [
        optimizer.state[p][key].full_tensor()
        for group in optimizer.param_groups
        for p in group["params"]
        for key in ("exp_avg", "exp_avg_sq")
    ]
    sharding.remove()
    assert not is_local_step(optimizer) and type(optimizer) is cls, "remove() must give the user's class back"
    return state, moments, dispatches


def _worker(rank, world_size, root):
    for cls, kwargs in OPTIMIZERS:
        for stage, offload in CASES:
            name = f"stage {stage} {offload} {kwargs}"
            ref_state, ref_moments, ref_dispatches = _train(rank, root, stage, offload, cls, kwargs, local=False)
            state, moments, dispatches = _train(rank, root, stage, offload, cls, kwargs, local=True)
            assert ref_dispatches > 0, f"{name}: the DTensor path dispatched nothing: the count would be vacuous"
            assert dispatches == 0, f"{name}: {dispatches} DTensor dispatches in the swapped local step"
            for key in ref_state:
                assert _same(state[key], ref_state[key]), f"{name}: {key} differs from the DTensor path"
            assert all(_same(a, b) for a, b in zip(moments, ref_moments)), f"{name}: Adam's moments differ"
            # and the same optimizer (fused too: torch's CPU kernel per sub-group and unit) under CPU offload
            cpu_offload = dict(offload_optimizer="cpu") if stage == 2 else dict(offload="cpu")
            cpu_state, cpu_moments, _ = _train(rank, root, stage, cpu_offload, cls, kwargs, local=True)
            worst = max((state[key] - cpu_state[key]).abs().max().item() for key in cpu_state)
            assert worst <= 1e-6, f"{name}: NVMe offload differs from CPU offload by {worst:.2e}"


def test_swapped_step_at_stages_2_3_steps_local_shards_bitwise_like_the_dtensor_path(tmp_path):
    run_distributed(_worker, 2, str(tmp_path))
