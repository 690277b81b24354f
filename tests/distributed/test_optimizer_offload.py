"""DeepSpeed's ZeRO-Offload (``offload_optimizer="cpu"`` alone): parameters and gradients stay on the compute device,
the optimizer steps fp32 CPU masters of this rank's shards and copies the result back; ``offload_params="cpu"``
(stage 3) moves the parameters too (FSDP2's ``CPUOffloadPolicy``).

On a CPU-only machine "device" and "CPU" are the same memory, so the tests check the placement logic itself: the
module's parameters and the optimizer's masters are distinct storages, the optimizer states exist only for the
masters, FSDP2 runs without its offload policy, and the numbers equal the run without offload exactly.
"""

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from torch import nn

from lightning_zero import ZeroConfig, ZeroStrategy, apply_zero
from lightning_zero.distributed.apply_zero import set_gradient_sync
from lightning_zero.distributed.optimizer import shard_optimizer
from lightning_zero.estimate.model_states import estimate_model_states_memory
from lightning_zero.ops import CPUAdam
from tests.distributed.test_zero_parity import LOCAL_BATCH, STEPS, TinyNet, data, make_optimizer, train_reference
from tests.ranks import run_distributed

VARIANTS = [dict(), dict(accumulate=2), dict(clip=0.05)]


def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _train(rank, world_size, config, accumulate=1, clip=None, bf16=False, inspect=None, cpu_adam=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    module = TinyNet()
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 and config.stage >= 2 else None
    model = apply_zero(module, mesh, config, mp_policy=mp_policy)
    opt = make_optimizer(module)
    if cpu_adam:  # our CPU Adam over the same groups and hyper-parameters, built on the module's parameters
        opt = CPUAdam(
            [{k: v for k, v in g.items() if k in ("params", "lr", "weight_decay")} for g in opt.param_groups],
            lr=1e-2,
            betas=opt.defaults["betas"],
            eps=opt.defaults["eps"],
        )
    sharding = shard_optimizer(opt, config, group=mesh.get_group())
    x, y = data(world_size, accumulate)
    per_step = accumulate * world_size * LOCAL_BATCH
    for step in range(STEPS):
        xs, ys = x[step * per_step : (step + 1) * per_step], y[step * per_step : (step + 1) * per_step]
        for i, (mx, my) in enumerate(zip(xs.chunk(accumulate), ys.chunk(accumulate))):
            set_gradient_sync(model, i == accumulate - 1)
            lx = mx[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]
            ly = my[rank * LOCAL_BATCH : (rank + 1) * LOCAL_BATCH]
            autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16 and config.stage < 2)
            with autocast:
                loss = nn.functional.mse_loss(model(lx).float(), ly)
            (loss / accumulate).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(sharding.all_model_params(), clip)
        opt.step()
        if inspect is not None:
            inspect(module, opt, sharding)
        opt.zero_grad()
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in module.state_dict().items()
    }


def _check_placement(module, opt, sharding):
    """The optimizer holds masters only; they and their states are separate from the module's parameters, which
    stay where compute runs (plain FSDP2 shards at stages 2-3, without the CPU offload policy)."""
    params = sharding.owned_model_params()
    module_storages = {_local(p).untyped_storage().data_ptr() for p in module.parameters()}
    held = [p for g in opt.param_groups for p in g["params"]]
    assert len(held) == len(params) and {id(p) for p in held} == {id(sharding.masters[id(p)]) for p in params}
    assert not {id(p) for p in held} & {id(p) for p in module.parameters()}
    for param in params:
        master = sharding.masters[id(param)]
        assert hasattr(master, "placements") == hasattr(param, "placements"), "a stage-2/3 master is a DTensor"
        if hasattr(param, "placements"):
            assert master.placements == param.placements and master.shape == param.shape
        assert _local(master).device.type == "cpu" and _local(master).dtype == torch.float32
        assert _local(master).untyped_storage().data_ptr() not in module_storages
        torch.testing.assert_close(_local(master), _local(param.detach()), rtol=0, atol=0)
    assert opt.state and all(any(s is h for h in held) for s in opt.state), "states of masters only"
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                assert _local(value).untyped_storage().data_ptr() not in module_storages
    for param in module.parameters():  # the module's gradients are dropped once copied and stepped
        assert param.grad is None
    fsdp_params = [
        fp
        for m in module.modules()
        if hasattr(m, "_get_fsdp_state")
        for fp in (m._get_fsdp_state()._fsdp_param_group.fsdp_params if m._get_fsdp_state()._fsdp_param_group else [])
    ]
    assert all(not fp.offload_to_cpu for fp in fsdp_params), "optimizer offload must not move the parameters"


def _parity_worker(rank, world_size):
    failures = []
    for stage in (1, 2, 3):
        offloaded = ZeroConfig(stage=stage, offload_optimizer="cpu")
        plain = ZeroConfig(stage=stage)
        assert offloaded.offloads_optimizer_only and not offloaded.offloads_params
        for variant in VARIANTS:
            expected = train_reference(world_size, **variant)
            got = _train(rank, world_size, offloaded, inspect=_check_placement, **variant)
            without = _train(rank, world_size, plain, **variant)
            exact = max((got[k] - without[k]).abs().max().item() for k in got)
            worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
            if not (exact <= 1e-6 and worst <= 1e-5):
                failures.append(f"stage={stage} {variant}: vs no offload {exact:.2e}, vs reference {worst:.2e}")
        if stage == 2:
            got = _train(rank, world_size, offloaded, clip=0.05, cpu_adam=True)
            worst = max((got[k] - train_reference(world_size, clip=0.05)[k]).abs().max().item() for k in got)
            if not worst <= 1e-5:
                failures.append(f"stage={stage} CPUAdam: vs reference {worst:.2e}")
        # bf16: autocast at stage 1, FSDP2's MixedPrecisionPolicy at stages 2-3; same numbers as without offload
        got = _train(rank, world_size, offloaded, accumulate=2, clip=0.05, bf16=True)
        without = _train(rank, world_size, plain, accumulate=2, clip=0.05, bf16=True)
        exact = max((got[k] - without[k]).abs().max().item() for k in got)
        if not exact <= 1e-6:
            failures.append(f"stage={stage} bf16: vs no offload {exact:.2e}")
    assert not failures, "\n".join(failures)


def test_optimizer_offload_keeps_parameters_on_device_and_matches_no_offload_at_every_stage():
    run_distributed(_parity_worker, 2)


def _params_offload_worker(rank, world_size):
    """Stage 3 with both sections: FSDP2's CPU offload policy, the optimizer steps the sharded parameters."""
    from torch.distributed.device_mesh import init_device_mesh

    config = ZeroConfig(stage=3, offload="cpu")
    assert (config.offload_optimizer, config.offload_params) == ("cpu", "cpu")
    module = TinyNet()
    apply_zero(module, init_device_mesh("cpu", (world_size,)), config)
    opt = make_optimizer(module)
    sharding = shard_optimizer(opt, config)
    held = [id(p) for g in opt.param_groups for p in g["params"]]
    assert not sharding.masters and sorted(held) == sorted(id(p) for p in module.parameters())
    state = module._get_fsdp_state()._fsdp_param_group.fsdp_params
    assert state and all(fp.offload_to_cpu for fp in state)


def test_stage3_offload_shorthand_moves_parameters_with_the_optimizer():
    run_distributed(_params_offload_worker, 2)


def test_cpu_adam_accepts_device_parameters_until_it_steps_them():
    param = torch.zeros(3, device="meta", requires_grad=True)  # stands for a parameter on the accelerator
    opt = CPUAdam([param])  # configure_optimizers builds it before offload swaps in the CPU masters
    param.grad = torch.zeros(3, device="meta")
    with pytest.raises(ValueError, match="offload_optimizer='cpu'"):
        opt.step()


# ------------------------------------------------------------------ configuration
@pytest.mark.parametrize("stage", [1, 2])
def test_offload_params_below_stage3_is_refused_naming_it(stage):
    with pytest.raises(ValueError, match="offload_params='cpu' needs stage 3"):
        ZeroStrategy(stage=stage, offload_optimizer="cpu", offload_params="cpu")


def test_offload_params_without_the_optimizer_is_refused_naming_both():
    with pytest.raises(ValueError, match="offload_params='cpu' without offload_optimizer"):
        ZeroStrategy(stage=3, offload_params="cpu")


@pytest.mark.parametrize(
    "kwargs,expected",
    [
        (dict(stage=1, offload="cpu"), ("cpu", "none")),
        (dict(stage=2, offload="cpu"), ("cpu", "none")),  # DeepSpeed's zero_stage_2_offload: optimizer only
        (dict(stage=3, offload="cpu"), ("cpu", "cpu")),  # zero_stage_3_offload: both
        (dict(stage=3, offload_optimizer="cpu"), ("cpu", "none")),
        (dict(stage=3, offload_optimizer="cpu", offload_params="cpu"), ("cpu", "cpu")),
    ],
)
def test_the_shorthand_and_the_precise_pair_mean_what_deepspeed_means(kwargs, expected):
    config = ZeroConfig(**kwargs)
    assert (config.offload_optimizer, config.offload_params) == expected


@pytest.mark.parametrize(
    "name,expected", [("zero_stage_2_offload", ("cpu", "none")), ("zero_stage_3_offload", ("cpu", "cpu"))]
)
def test_registry_names_mean_deepspeeds(name, expected):
    trainer = Trainer(
        strategy=name,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    config = trainer.strategy.zero_config
    assert (config.offload_optimizer, config.offload_params) == expected


@pytest.mark.parametrize(
    "zero,expected",
    [
        ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, ("cpu", "none")),
        ({"stage": 3, "offload_optimizer": {"device": "cpu"}}, ("cpu", "none")),
        ({"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}, ("cpu", "cpu")),
    ],
)
def test_ds_config_offload_sections_translate_separately(zero, expected):
    strategy = ZeroStrategy(config={"zero_optimization": zero})
    assert (strategy.zero_config.offload_optimizer, strategy.zero_config.offload_params) == expected


# ------------------------------------------------------------------ estimator
def test_estimator_places_each_combination():
    p, n = 10**6, 4
    s2 = estimate_model_states_memory(p, 2, n, offload="cpu")
    assert (s2.accelerator.params, s2.accelerator.grads, s2.accelerator.optimizer_states) == (p, p, 0)
    assert (s2.cpu.params, s2.cpu.grads, s2.cpu.optimizer_states) == (0, p, 3 * p)  # master 4 + Adam 8
    s3 = estimate_model_states_memory(p, 3, n, offload_optimizer="cpu")
    assert (s3.accelerator.params, s3.accelerator.grads, s3.accelerator.optimizer_states) == (p, p, 0)
    assert s3.cpu == s2.cpu
    both = estimate_model_states_memory(p, 3, n, offload="cpu")
    assert both.accelerator.total == 0
    assert (both.cpu.params, both.cpu.grads, both.cpu.optimizer_states) == (p, p, 2 * p)  # params are the masters
    assert both == estimate_model_states_memory(p, 3, n, offload_optimizer="cpu", offload_params="cpu")
    mixed = estimate_model_states_memory(p, 3, n, offload="cpu", precision="bf16-mixed")
    assert (mixed.cpu.params, mixed.cpu.grads, mixed.cpu.optimizer_states) == (p, p, 2 * p)
    with pytest.raises(ValueError, match="without offload_optimizer"):
        estimate_model_states_memory(p, 3, n, offload_params="cpu")


# ------------------------------------------------------------------ checkpoints across offload
def _ckpt_trainer(stage, offload, world_size, epochs, root):
    from tests.strategies.test_strategy_checkpoint import STEPS_PER_EPOCH

    return Trainer(
        strategy=ZeroStrategy(stage=stage, offload_optimizer=offload),
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


def _ckpt_save_worker(rank, world_size, path, stage, offload):
    from tests.lightning_models import RegressionModule
    from tests.strategies.test_strategy_checkpoint import BATCH

    torch.manual_seed(0)
    trainer = _ckpt_trainer(stage, offload, world_size, 1, str(path.parent))
    trainer.fit(RegressionModule(batch_size=BATCH))
    trainer.save_checkpoint(str(path))


def _ckpt_resume_worker(rank, world_size, path, stage, offload):
    from tests.lightning_models import RegressionModule
    from tests.strategies.test_strategy_checkpoint import BATCH, STEPS_PER_EPOCH, _reference

    torch.manual_seed(123)  # every weight and state must come from the checkpoint
    module = RegressionModule(batch_size=BATCH)
    trainer = _ckpt_trainer(stage, offload, world_size, 2, str(path.parent))
    trainer.fit(module, ckpt_path=str(path))
    assert trainer.global_step == 2 * STEPS_PER_EPOCH
    expected = _reference(2, BATCH * world_size)
    got = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in module.state_dict().items()}
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= 1e-5, f"resumed at stage {stage} offload_optimizer={offload}: max abs diff {worst:.2e}"


@pytest.mark.parametrize(
    "saved,resumed",
    [((2, "cpu"), (3, None)), ((3, None), (3, "cpu"))],
    ids=["offload-s2-to-plain-s3", "plain-s3-to-offload-s3"],
)
def test_checkpoint_moves_between_optimizer_offload_and_none(tmp_path, saved, resumed):
    path = tmp_path / "run.ckpt"
    run_distributed(_ckpt_save_worker, 2, path, *saved)
    run_distributed(_ckpt_resume_worker, 2, path, *resumed)


# ------------------------------------------------------------------ two optimizers (toggle_optimizer)
def _gan_worker(rank, world_size, stage):
    from tests.lightning_models import full_state
    from tests.strategies.test_strategy_manual_optimization import GAN, assert_same, reference_gan

    torch.manual_seed(0)
    module = GAN(False)
    Trainer(
        strategy=ZeroStrategy(stage=stage, offload_optimizer="cpu"),
        accelerator="cpu",
        devices=world_size,
        max_steps=2 * 3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(module)
    assert_same(full_state(module), reference_gan(3, False), f"GAN stage={stage} with optimizer offload")


def test_toggle_optimizer_freezes_the_module_parameters_behind_offloaded_masters():
    """Lightning's toggle_optimizer freezes what param_groups hold: the CPU masters would leave the module's
    parameters of the other optimizer trainable (their gradients then reach its next step)."""
    run_distributed(_gan_worker, 2, 2)


# ------------------------------------------------------------------ NVMe optimizer states behind device parameters
def _nvme_worker(rank, world_size, root):
    import os

    from lightning_zero.offload.nvme_config import NvmeConfig
    from lightning_zero.offload.optimizer_swapper import get_swapper

    seen = []

    def inspect(module, opt, sharding):
        assert get_swapper(opt) is not None and sharding.masters, "states swapped behind CPU masters"
        seen.append(sharding)

    nvme = NvmeConfig(root, sub_group_size=64, buffer_count=3)
    swapped = _train(
        rank,
        world_size,
        ZeroConfig(stage=3, offload_optimizer="nvme", nvme=nvme),
        accumulate=2,
        clip=0.05,
        inspect=inspect,
    )
    in_memory = _train(rank, world_size, ZeroConfig(stage=3, offload_optimizer="cpu"), accumulate=2, clip=0.05)
    worst = max((swapped[k] - in_memory[k]).abs().max().item() for k in swapped)
    assert worst <= 1e-6, f"stage-3 NVMe optimizer offload differs from CPU optimizer offload by {worst:.2e}"
    seen[-1].remove()  # the run's swap folder goes with it
    dist.barrier()
    assert not [name for name in os.listdir(root) if name.startswith("lz-swap-")]


def test_stage3_nvme_optimizer_offload_with_parameters_on_device_matches_cpu(tmp_path):
    run_distributed(_nvme_worker, 2, str(tmp_path))


# ------------------------------------------------------------------ fp16 loss scaling through the Trainer
def _fp16_worker(rank, world_size):
    from lightning_zero import LossScaleConfig
    from tests.lightning_models import full_state
    from tests.strategies.test_precision import DtypeProbe, _trainer

    finals = {}
    for stage, kwargs in ((2, {}), (2, dict(offload_optimizer="cpu")), (3, {}), (3, dict(offload_optimizer="cpu"))):
        torch.manual_seed(0)
        module = DtypeProbe()
        # 2**18 overflows in fp16 first: the skipped steps must leave masters and states untouched too
        start = full_state(module)
        trainer = _trainer(
            ZeroStrategy(stage=stage, **kwargs),
            world_size,
            "16-mixed",
            gradient_clip_val=0.05,
            max_steps=6,
            loss_scale_config=LossScaleConfig(initial_scale_power=18, hysteresis=1),
        )
        trainer.fit(module)
        assert set(module.compute_dtypes) == {torch.float16}
        skipped = trainer.precision_plugin.scaler.skipped_steps
        assert 0 < skipped < 6, f"the run must both skip (overflow) and step, skipped {skipped} of 6"
        assert all(not torch.equal(v, start[k]) for k, v in full_state(module).items()), "weights did not train"
        finals[(stage, bool(kwargs))] = full_state(module)
    for stage in (2, 3):
        got, without = finals[(stage, True)], finals[(stage, False)]
        worst = max((got[k] - without[k]).abs().max().item() for k in got)
        assert worst <= 1e-6, f"16-mixed stage {stage}: optimizer offload differs from none by {worst:.2e}"


def test_fp16_loss_scaling_with_optimizer_offload_equals_no_offload():
    run_distributed(_fp16_worker, 2)
