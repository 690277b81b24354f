"""Hybrid sharding (HSDP, ``hybrid_shard_size``): parity with an unsharded single-process reference on 4 ranks as
2 x 2, what each rank holds, checkpoints that reshard to and from non-hybrid runs, and the refusals."""

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_zero import ZeroConfig, apply_zero, estimate_model_states_memory, model_state_memory, zero_formula
from lightning_zero.distributed.hybrid import check_hybrid_world, data_parallel_mesh, shard_group
from lightning_zero.distributed.optimizer import get_sharding, shard_optimizer
from tests.distributed.test_zero_parity import LOCAL_BATCH, STEPS, TinyNet, data, make_optimizer, train_reference
from tests.ranks import run_distributed


def _train_hybrid(rank, world_size, stage, offload=None, clip=None):
    config = ZeroConfig(stage=stage, offload=offload, hybrid_shard_size=2)
    mesh = data_parallel_mesh("cpu", world_size, 2)
    torch.manual_seed(0)
    module = TinyNet()
    model = apply_zero(module, mesh, config)
    opt = make_optimizer(module)
    sharding = shard_optimizer(opt, config, group=shard_group(mesh))
    x, y = data(world_size, 1)
    per_step = world_size * LOCAL_BATCH
    for step in range(STEPS):
        xs, ys = x[step * per_step : (step + 1) * per_step], y[step * per_step : (step + 1) * per_step]
        lx, ly = xs[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH], ys[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]
        nn.functional.mse_loss(model(lx), ly).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(sharding.all_model_params(), clip)
        opt.step()
        opt.zero_grad()
    return module, opt, mesh


def _parity_worker(rank, world_size):
    failures = []
    for stage, offload, clip in [
        (1, None, None),
        (1, None, 0.05),
        (2, None, None),
        (2, "cpu", 0.05),
        (3, None, None),
        (3, None, 0.05),
    ]:
        expected = train_reference(world_size, clip=clip)
        module, opt, mesh = _train_hybrid(rank, world_size, stage, offload, clip)
        got = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach() for k, v in module.state_dict().items()
        }
        worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
        if not worst <= 1e-5:
            failures.append(f"stage={stage} offload={offload} clip={clip}: max abs diff {worst:.2e}")
        # What makes it hybrid: the 2 ranks of a shard group together hold all optimizer states (Adam: 8 bytes per
        # parameter, plus the step counters), where 4-way sharding would give them half.
        num_params = sum(v.numel() for v in expected.values())
        states = torch.tensor(float(model_state_memory(module, [opt]).total.optimizer_states))
        dist.all_reduce(states, group=shard_group(mesh))
        per_param = 12 if offload else 8  # optimizer offload: + the fp32 CPU masters (counted as optimizer states)
        assert abs(states.item() - per_param * num_params) <= 0.05 * per_param * num_params, (stage, states.item())
        if stage >= 2:  # what each rank holds is the formula with hybrid_shard_size (sharded over 2, not 4)
            measured = model_state_memory(module, [opt]).total
            formula = zero_formula(num_params, stage, world_size, hybrid_shard_size=2)
            assert abs(measured.params - formula.params) <= 0.1 * formula.params, (measured, formula)
            placements = {str(p.placements) for p in module.parameters()}
            assert placements == {"(Replicate(), Shard(dim=0))"}, placements
        else:
            owners = get_sharding(opt).owners
            assert {o for group in owners for o in group} == {0, 1}, owners  # partitioned over the shard group
    assert not failures, "\n".join(failures)


def test_hybrid_2x2_matches_single_process_reference_at_stages_1_2_3():
    run_distributed(_parity_worker, 4)


def test_hybrid_shard_size_is_validated_before_any_process_group():
    with pytest.raises(ValueError, match="stage 0 shards nothing"):
        ZeroConfig(stage=0, hybrid_shard_size=2)
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match="positive int"):
            ZeroConfig(stage=2, hybrid_shard_size=bad)
    with pytest.raises(ValueError, match="must divide the world size 6"):
        check_hybrid_world(4, 6)
    with pytest.raises(ValueError, match="must divide the world size 2"):
        check_hybrid_world(4, 2)
    with pytest.raises(ValueError, match="pipeline"):
        check_hybrid_world(2, 4, pipeline=True)
    check_hybrid_world(2, 4)
    check_hybrid_world(None, 3)


def _mesh_mismatch_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    with pytest.raises(ValueError, match="needs a 2-D"):
        apply_zero(TinyNet(), init_device_mesh("cpu", (world_size,)), ZeroConfig(stage=2, hybrid_shard_size=2))
    with pytest.raises(ValueError, match="no hybrid_shard_size"):
        apply_zero(TinyNet(), data_parallel_mesh("cpu", world_size, 1), ZeroConfig(stage=2))


def test_apply_zero_refuses_a_mesh_that_does_not_match_hybrid_shard_size():
    run_distributed(_mesh_mismatch_worker, 2)


# ------------------------------------------------------------------ through the Trainer, with checkpoints
def _trainer(strategy_kwargs, world_size, epochs, root):
    from lightning.pytorch import Trainer

    from lightning_zero import ZeroStrategy
    from tests.strategies.test_strategy_checkpoint import STEPS_PER_EPOCH

    return Trainer(
        strategy=ZeroStrategy(**strategy_kwargs),
        accelerator="cpu",
        devices=world_size,
        max_epochs=epochs,
        limit_train_batches=STEPS_PER_EPOCH,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=root,
    )


def _save_worker(rank, world_size, path, strategy_kwargs):
    from tests.lightning_models import RegressionModule
    from tests.strategies.test_strategy_checkpoint import BATCH

    torch.manual_seed(0)
    trainer = _trainer(strategy_kwargs, world_size, 1, os.path.dirname(path))
    module = RegressionModule(batch_size=BATCH)
    trainer.fit(module)
    if strategy_kwargs.get("hybrid_shard_size"):
        assert trainer.strategy.device_mesh.mesh_dim_names == ("replicate", "shard")
    trainer.save_checkpoint(path)


def _resume_worker(rank, world_size, path, strategy_kwargs, saved_world_size):
    from tests.lightning_models import RegressionModule, full_state
    from tests.strategies.test_strategy_checkpoint import BATCH, STEPS_PER_EPOCH, _reference

    torch.manual_seed(123)  # different init: every weight must come from the checkpoint
    module = RegressionModule(batch_size=BATCH * saved_world_size // world_size)
    trainer = _trainer(strategy_kwargs, world_size, 2, os.path.dirname(path))
    trainer.fit(module, ckpt_path=path)
    assert trainer.global_step == 2 * STEPS_PER_EPOCH
    hybrid = strategy_kwargs.get("hybrid_shard_size")
    assert trainer.strategy.device_mesh.ndim == (2 if hybrid else 1)
    expected = _reference(2, BATCH * saved_world_size)
    got = full_state(module)
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= 1e-5, f"resumed with {strategy_kwargs} x {world_size} ranks: max abs diff {worst:.2e}"


# An HSDP checkpoint loads into a run without HSDP (and another stage, world size), and the reverse; both halves
# train through the Trainer and end equal to the unsharded reference.
HSDP_CHECKPOINT_CASES = [
    (({"stage": 3, "hybrid_shard_size": 2}, 4), ({"stage": 2}, 2)),
    (({"stage": 1}, 2), ({"stage": 1, "hybrid_shard_size": 2}, 4)),
    (({"stage": 1, "hybrid_shard_size": 2}, 4), ({"stage": 3}, 1)),
]


@pytest.mark.parametrize(
    "saved,resumed", HSDP_CHECKPOINT_CASES, ids=["hsdp-s3x4-to-s2x2", "s1x2-to-hsdp-s1x4", "hsdp-s1x4-to-s3x1"]
)
def test_hybrid_checkpoint_reshards_to_and_from_runs_without_it(tmp_path, saved, resumed):
    (save_kwargs, save_world), (resume_kwargs, resume_world) = saved, resumed
    path = str(tmp_path / "hsdp.ckpt")
    run_distributed(_save_worker, save_world, path, save_kwargs)
    run_distributed(_resume_worker, resume_world, path, resume_kwargs, save_world)


def test_trainer_refuses_hybrid_shard_size_that_does_not_divide_the_world(monkeypatch):
    from lightning.pytorch import Trainer

    from lightning_zero import ZeroStrategy
    from tests.lightning_models import RegressionModule

    # Each forked rank fails in setup_environment's checks, before init_process_group (a hang otherwise: the
    # 2-D mesh cannot be built).
    trainer = Trainer(
        strategy=ZeroStrategy(stage=2, hybrid_shard_size=3, start_method="fork"),
        accelerator="cpu",
        devices=4,
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    with pytest.raises(
        Exception,
        match=r"ValueError: hybrid_shard_size=3 must divide the world size 4 "
        r"\(devices=4 x num_nodes=1\)",
    ):
        trainer.fit(RegressionModule())


def test_ds_config_mics_shard_size_maps_to_hybrid_shard_size_and_hpz_does_not():
    from lightning_zero import ZeroStrategy

    strategy = ZeroStrategy(config={"zero_optimization": {"stage": 3, "mics_shard_size": 2}})
    assert strategy.zero_config.hybrid_shard_size == 2
    assert (
        ZeroStrategy(
            hybrid_shard_size=4, config={"zero_optimization": {"stage": 3, "mics_shard_size": 2}}
        ).zero_config.hybrid_shard_size
        == 4
    )  # the explicit argument wins
    hpz = ZeroStrategy(config={"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}).zero_config
    assert hpz.hybrid_shard_size is None and hpz.reshard_after_forward == 2  # hpZ is a secondary partition, not HSDP
    with pytest.raises(ValueError, match="stage 0 shards nothing"):
        ZeroStrategy(config={"zero_optimization": {"stage": 0, "mics_shard_size": 2}})


def test_estimator_and_cli_shard_over_the_hybrid_group(capsys):
    from lightning_zero.cli import main

    p = 1_000_000
    assert zero_formula(p, 3, 8, hybrid_shard_size=2) == zero_formula(p, 3, 2)
    assert zero_formula(p, 1, 8, hybrid_shard_size=4).optimizer_states == p * 8 // 4
    est = estimate_model_states_memory(p, 3, 8, offload="cpu", hybrid_shard_size=4)  # parameters offloaded too
    assert est.cpu.optimizer_states == p * 8 // 4 and est.accelerator.total == 0
    with pytest.raises(ValueError, match="must divide the world size 8"):
        zero_formula(p, 2, 8, hybrid_shard_size=3)
    with pytest.raises(ValueError, match="stage 0 shards nothing"):
        estimate_model_states_memory(p, 0, 8, hybrid_shard_size=2)
    assert (
        main(
            [
                "estimate",
                "--params",
                "1e9",
                "--world-size",
                "16",
                "--hybrid-shard-size",
                "8",
                "--stage",
                "3",
                "--precision",
                "32-true",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "hybrid shard" in out and f"{16e9 / 8 / 1024**3:.2f} GiB" in out  # 16 bytes/param over 8
    with pytest.raises(SystemExit, match="must divide --world-size"):
        main(["estimate", "--params", "1e9", "--world-size", "16", "--hybrid-shard-size", "3"])
