"""The Fabric ZeroStrategy trains with parity to an unsharded single-process reference (2 gloo ranks).

Same model, optimizer (two param groups), seed and global batch as tests/distributed/test_zero_parity.py; the loop is
Fabric's:
``fabric.init_module``, ``fabric.setup(model, optimizer)`` (the optimizer built before setup), accumulation with
``fabric.no_backward_sync``, ``fabric.backward``, ``fabric.clip_gradients``.
"""

import pytest
import torch
from lightning.fabric import Fabric
from torch import nn

from lightning_zero.fabric import ZeroStrategy
from tests.distributed.test_zero_parity import LOCAL_BATCH, STEPS, TinyNet, data, make_optimizer, train_reference
from tests.ranks import run_distributed

CONFIGS = [(0, None), (1, None), (1, "cpu"), (2, None), (2, "cpu"), (3, None), (3, "cpu")]


def full_weights(module):
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in module.state_dict().items()
    }


def make_fabric(strategy, **kwargs):
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy, **kwargs)
    fabric.launch()  # the ranks already exist (tests.ranks): sets up the process group and mesh
    return fabric


def fabric_train(fabric, rank, world_size, accumulate=1, clip=None, steps=range(STEPS), model=None, optimizer=None):
    if model is None:
        torch.manual_seed(0)
        with fabric.init_module():
            module = TinyNet()
        model, optimizer = fabric.setup(module, make_optimizer(module))
    x, y = data(world_size, accumulate)
    per_step = accumulate * world_size * LOCAL_BATCH
    for step in steps:
        xs, ys = x[step * per_step : (step + 1) * per_step], y[step * per_step : (step + 1) * per_step]
        for i, (mx, my) in enumerate(zip(xs.chunk(accumulate), ys.chunk(accumulate))):
            with fabric.no_backward_sync(model, enabled=i < accumulate - 1):
                lx = mx[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]
                ly = my[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]
                fabric.backward(nn.functional.mse_loss(model(lx), ly) / accumulate)
        if clip:
            fabric.clip_gradients(model, optimizer, max_norm=clip)
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _init_module_worker(rank, world_size):
    from lightning_zero.distributed.deferred_init import has_deferred

    for stage in (0, 2, 3):
        fabric = make_fabric(ZeroStrategy(stage=stage))
        torch.manual_seed(0)
        with fabric.init_module():
            module = TinyNet()
        # stages 2-3 record the build (no rank holds the whole model); setup replays it unit by unit
        assert has_deferred(module) == (stage >= 2), stage
        model = fabric.setup_module(module)
        torch.manual_seed(0)
        plain = TinyNet()
        got = full_weights(model._forward_module.module if stage <= 1 else model._forward_module)
        assert all(torch.equal(got[k], v) for k, v in plain.state_dict().items()), stage


def test_init_module_is_exact_and_recorded_at_sharded_stages():
    run_distributed(_init_module_worker, 2)


def _parity_worker(rank, world_size):
    expected = train_reference(world_size, accumulate=2, clip=0.05)
    plain = train_reference(world_size)
    failures = []
    for stage, offload in CONFIGS:
        for variant, reference in ((dict(accumulate=2, clip=0.05), expected), (dict(), plain)):
            fabric = make_fabric(ZeroStrategy(stage=stage, offload=offload))
            model, _ = fabric_train(fabric, rank, world_size, **variant)
            got = full_weights(model._forward_module.module if stage <= 1 else model._forward_module)
            worst = max((got[k] - reference[k]).abs().max().item() for k in reference)
            if not worst <= 1e-5:
                failures.append(f"stage={stage} offload={offload} {variant}: max abs diff {worst:.2e}")
    assert not failures, "\n".join(failures)


def test_every_stage_and_offload_match_the_single_process_reference():
    run_distributed(_parity_worker, 2)


def _adagrad(module):
    return torch.optim.Adagrad(module.parameters(), lr=0.05, initial_accumulator_value=0.1)


def _constructor_states_worker(rank, world_size):
    torch.manual_seed(0)
    reference = TinyNet()
    optimizer = _adagrad(reference)
    x, y = data(world_size, 1)
    per_step = world_size * LOCAL_BATCH
    for step in range(STEPS):
        batch = slice(step * per_step, (step + 1) * per_step)
        nn.functional.mse_loss(reference(x[batch]), y[batch]).backward()
        optimizer.step()
        optimizer.zero_grad()
    expected = reference.state_dict()
    failures = []
    for stage in (0, 1, 2, 3):
        fabric = make_fabric(ZeroStrategy(stage=stage))
        torch.manual_seed(0)
        module = TinyNet()
        try:  # Adagrad's constructor made its states: the optimizer is built before fabric.setup, as Fabric's docs do
            model, optimizer = fabric.setup(module, _adagrad(module))
        except RuntimeError as error:
            failures.append(f"stage={stage}: {error}")
            continue
        fabric_train(fabric, rank, world_size, model=model, optimizer=optimizer)
        got = full_weights(model._forward_module.module if stage <= 1 else model._forward_module)
        worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
        if not worst <= 1e-5:
            failures.append(f"stage={stage}: max abs diff {worst:.2e}")
        stepped = TinyNet()  # an optimizer that has stepped is still refused: its states are the old tensors'
        used = _adagrad(stepped)
        stepped(x[:2]).sum().backward()
        used.step()
        with pytest.raises(RuntimeError, match="stepped already|needs a fresh optimizer"):
            make_fabric(ZeroStrategy(stage=stage)).setup(stepped, used)
    assert not failures, "\n".join(failures)


def test_an_optimizer_whose_constructor_made_states_is_set_up_with_the_model():
    run_distributed(_constructor_states_worker, 2)


def _by_name_worker(rank, world_size):
    fabric = make_fabric("zero_stage_3")
    assert isinstance(fabric.strategy, ZeroStrategy) and fabric.strategy.stage == 3
    model, _ = fabric_train(fabric, rank, world_size)
    got = full_weights(model._forward_module)
    expected = train_reference(world_size)
    assert max((got[k] - expected[k]).abs().max().item() for k in expected) <= 1e-5
    # fabric.setup_module, then the optimizer from the sharded parameters, then fabric.setup_optimizers
    fabric = make_fabric("zero_stage_3")
    torch.manual_seed(0)
    model = fabric.setup_module(TinyNet())
    optimizer = fabric.setup_optimizers(make_optimizer(model))
    fabric_train(fabric, rank, world_size, model=model, optimizer=optimizer)
    got = full_weights(model._forward_module)
    assert max((got[k] - expected[k]).abs().max().item() for k in expected) <= 1e-5
    offload = make_fabric("zero_stage_2_offload").strategy
    assert (offload.stage, offload.zero_config.offload) == (2, "cpu")


def test_strategy_by_registry_name():
    run_distributed(_by_name_worker, 2)


def _no_sync_worker(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    calls = []
    # FSDP2's, per torch version; on CPU the pooled reduce-scatter (distributed/comm_buffers.py) is isend/irecv pairs
    names = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "isend")
    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

    def counting(name):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return originals[name](*args, **kwargs)

        return wrapper

    for stage in (0, 1, 2, 3):
        fabric = make_fabric(ZeroStrategy(stage=stage))
        torch.manual_seed(0)
        model = fabric.setup(TinyNet())
        if stage <= 1:  # DDP reduces in C++: count its buckets with a comm hook

            def hook(state, bucket):
                calls.append("ddp bucket")
                return allreduce_hook(state, bucket)

            model._forward_module.register_comm_hook(None, hook)
        x = torch.randn(LOCAL_BATCH, 8) + rank
        for name in originals:
            setattr(dist, name, counting(name))
        try:
            with fabric.no_backward_sync(model, enabled=True):
                fabric.backward(model(x).sum())
            silent = len(calls)
            with fabric.no_backward_sync(model, enabled=False):
                fabric.backward(model(x).sum())
            loud = len(calls)
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
        calls.clear()
        assert silent == 0, f"stage {stage}: {silent} collectives on a no-sync micro-step"
        assert loud > 0, f"stage {stage}: the boundary micro-step did not reduce gradients"


def test_no_backward_sync_skips_gradient_communication():
    run_distributed(_no_sync_worker, 2)


def _checkpointing_worker(rank, world_size):
    from tests.distributed.test_zero_parity import Block

    expected = train_reference(world_size, accumulate=2, clip=0.05)
    calls = []
    for stage in (0, 3):
        fabric = make_fabric(ZeroStrategy(stage=stage, activation_checkpointing=True, cpu_checkpointing=True))
        original = Block.forward  # counted in the block's own forward: a recomputation does not go through __call__

        def counted(self, *args, **kwargs):
            calls.append(1)
            return original(self, *args, **kwargs)

        Block.forward = counted
        try:
            model, _ = fabric_train(fabric, rank, world_size, accumulate=2, clip=0.05)
        finally:
            Block.forward = original
        got = full_weights(model._forward_module.module if stage <= 1 else model._forward_module)
        assert max((got[k] - expected[k]).abs().max().item() for k in expected) <= 1e-5, stage
        # 3 blocks, 2 micro-batches per step: 6 forwards per step without checkpointing, 12 with recomputation
        assert len(calls) == 12 * STEPS, (stage, len(calls))
        calls.clear()


def test_activation_checkpointing_recomputes_and_keeps_parity():
    """The Trainer strategy's activation checkpointing applies under Fabric too (one shared apply_zero)."""
    run_distributed(_checkpointing_worker, 2)


def _hybrid_worker(rank, world_size):
    expected = train_reference(world_size, accumulate=2, clip=0.05)
    for stage in (1, 3):
        fabric = Fabric(accelerator="cpu", devices=world_size, strategy=ZeroStrategy(stage=stage, hybrid_shard_size=2))
        fabric.launch()
        model, optimizer = fabric_train(fabric, rank, world_size, accumulate=2, clip=0.05)
        mesh = fabric.strategy.device_mesh
        assert mesh.mesh_dim_names == ("replicate", "shard") and mesh.shape == (2, 2)
        got = full_weights(model._forward_module.module if stage <= 1 else model._forward_module)
        assert max((got[k] - expected[k]).abs().max().item() for k in expected) <= 1e-5, stage


def test_hybrid_sharding_2x2_matches_the_reference():
    """hybrid_shard_size goes through the shared settings and mesh: 4 ranks as 2 replicas x 2 shards."""
    run_distributed(_hybrid_worker, 4)


def _nvme_worker(rank, world_size, root):
    import os

    expected = train_reference(world_size, accumulate=2, clip=0.05)
    for stage in (1, 2):
        path = os.path.join(root, f"stage{stage}")
        os.makedirs(path, exist_ok=True)
        fabric = make_fabric(ZeroStrategy(stage=stage, offload_optimizer="nvme", nvme_path=path, sub_group_size=64))
        model, _ = fabric_train(fabric, rank, world_size, accumulate=2, clip=0.05)
        swap = [name for name in os.listdir(path) if name.startswith("lz-swap-")]
        assert swap, "the optimizer states were not swapped to nvme_path"
        got = full_weights(model._forward_module.module if stage <= 1 else model._forward_module)
        assert max((got[k] - expected[k]).abs().max().item() for k in expected) <= 1e-5, stage
        fabric.strategy.teardown()
        torch.distributed.barrier()  # the run's swap folder holds every rank's files: wait for both teardowns
        assert not [name for name in os.listdir(path) if name.startswith("lz-swap-")], "swap files left behind"


def test_nvme_optimizer_offload_trains_and_cleans_up(tmp_path):
    """offload_optimizer="nvme" goes through the shared settings: states swap to disk, parity, files gone at
    teardown."""
    run_distributed(_nvme_worker, 2, str(tmp_path))


def _gathered_after_eval_worker(rank, world_size):
    from torch.distributed.tensor import DTensor

    for stage in (2, 3):
        fabric = make_fabric(ZeroStrategy(stage=stage))
        model, _ = fabric_train(fabric, rank, world_size, steps=range(1))
        with torch.inference_mode():  # an evaluation forward: no backward reshards the units kept gathered
            model(torch.randn(LOCAL_BATCH, 8))  # TinyNet's input width
        kept = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
        assert kept, f"stage {stage}: no unit stayed gathered after the forward (the test would prove nothing)"
        fabric.strategy.teardown()
        assert all(isinstance(p, DTensor) for p in model.parameters()), f"stage {stage}: {kept} left gathered"


def test_teardown_reshards_units_left_gathered_by_an_evaluation_forward():
    """Units that keep their parameters after forward (stage 2, the root and last unit at stage 3) are resharded at
    teardown: their gathered copies are freed and the module holds its shards again."""
    run_distributed(_gathered_after_eval_worker, 2)
