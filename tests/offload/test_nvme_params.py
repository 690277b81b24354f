"""Stage-3 parameter swapping to NVMe (offload_params="nvme"): parity with CPU offload at 2 ranks (with the optimizer
states on NVMe too, accumulation and clipping), the swap really happening within max_in_cpu, checkpoints across
NVMe/CPU offload, and no swap file left after teardown or an exception."""

import os

import pytest
import torch
from lightning.pytorch import Callback

from lightning_zero import ZeroStrategy
from lightning_zero.offload.aio import align_up
from lightning_zero.offload.optimizer_swapper import get_swapper
from lightning_zero.offload.param_swapper import get_param_swapper
from tests.lightning_models import RegressionModule, full_state, quiet_trainer, reference_weights
from tests.ranks import run_distributed

BATCH = 4
STEPS = 4
# Net at 2 ranks: each block's padded local shards hold 8x16+8 = 136 elements, the root unit's (inp, out) 90. FSDP2's
# backward prefetch holds two blocks at once (272), so 300 lets no more than that be resident; under the default
# unit_bytes both blocks are one unit (272 elements), which 300 holds but not next to the root's.
MAX_IN_CPU = 300


class _ParamSwapWitness(Callback):
    """During training: every unit's file exists with the bytes its layout says, a unit not resident holds no
    memory, the residency never exceeded max_in_cpu, and bytes really went through the disk."""

    def __init__(self):
        self.checked = 0
        self.folder = None
        self.peak = 0
        self.read = 0
        self.read_ahead = 0
        self.units = []

    def on_train_batch_end(self, trainer, module, *args):
        swapper = get_param_swapper(module)
        assert swapper is not None, "offload_params='nvme' must attach a parameter swapper"
        self.folder = swapper.run_folder
        assert swapper.folder.startswith(swapper.nvme.nvme_path)
        for unit in swapper.units:
            assert os.path.getsize(unit.path) == sum(align_up(c[2]) for c in unit.chunks), unit.name
            if not unit.resident:
                assert all(s.nbytes() == 0 for s in unit.storages()), f"unit {unit.name} still holds memory"
        assert swapper.resident_elements == sum(u.elements for u in swapper.units if u.resident)
        assert swapper.resident_elements <= swapper.nvme.max_in_cpu
        assert 0 < swapper.peak_resident_elements <= swapper.nvme.max_in_cpu
        assert swapper.peak_buffers <= swapper.nvme.buffer_count
        self.peak = swapper.peak_resident_elements
        self.units = [unit.name for unit in swapper.units]
        self.read = swapper.bytes_read
        self.read_ahead = swapper.chunks_read_ahead
        self.checked += 1


def _nvme_kwargs(root, **extra):
    return dict(
        offload="nvme",
        nvme_path=root,
        max_in_cpu=MAX_IN_CPU,
        buffer_size=64,
        buffer_count=3,
        sub_group_size=200,
        **extra,
    )


def _parity_worker(rank, world_size, root, unit_bytes):
    finals = {}
    for label, kwargs in (
        ("nvme", _nvme_kwargs(root)),
        # activation checkpointing: the backward recomputes each block between its re-gather
        # and its reduce-scatter, with the unit already released
        (
            "params-only",
            dict(
                offload_optimizer="cpu",
                offload_params="nvme",
                nvme_path=root,
                max_in_cpu=MAX_IN_CPU,
                activation_checkpointing=True,
            ),
        ),
        ("cpu", dict(offload="cpu")),
    ):
        torch.manual_seed(0)
        module = RegressionModule(batch_size=BATCH)
        witness = _ParamSwapWitness()
        strategy = ZeroStrategy(stage=3, unit_bytes=unit_bytes, **kwargs)
        trainer = quiet_trainer(
            strategy,
            world_size,
            max_steps=STEPS,
            accumulate_grad_batches=2,
            gradient_clip_val=0.05,
            callbacks=[witness] if label != "cpu" else [],
        )
        trainer.fit(module)
        finals[label] = full_state(module)
        if label != "cpu":
            assert witness.checked == 2 * STEPS, label
            assert witness.read > 0
            assert witness.read_ahead > 0, "the next unit in the learned order must be read ahead"
            assert not os.path.exists(witness.folder), "teardown must remove the run's swap folder"
            # one swap unit per fully_shard call: the two blocks grouped into one (default unit_bytes) or one each
            blocks = ["net.blocks.0+net.blocks.1"] if unit_bytes is None else ["net.blocks.0", "net.blocks.1"]
            expected_units = ["<root>", *blocks]
            assert witness.units == expected_units, label
            assert get_param_swapper(module) is None
            if label == "nvme":
                assert get_swapper(trainer.optimizers[0]) is None
    for label in ("nvme", "params-only"):
        worst = max((finals[label][k] - finals["cpu"][k]).abs().max().item() for k in finals["cpu"])
        assert worst <= 1e-6, f"{label}: NVMe parameter swapping differs from CPU offload by {worst:.2e}"
    expected = reference_weights(STEPS, BATCH * world_size * 2, 2, 0.05)
    worst = max((finals["nvme"][k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= 1e-5, f"NVMe offload differs from the single-process reference by {worst:.2e}"
    torch.distributed.barrier()  # both ranks' teardowns are over
    assert not [name for name in os.listdir(root) if name.startswith("lz-swap-")]


@pytest.mark.parametrize("unit_bytes", [None, 0], ids=["grouped-units", "unit-per-block"])
def test_stage3_nvme_params_and_optimizer_match_cpu_offload(tmp_path, unit_bytes):
    run_distributed(_parity_worker, 2, str(tmp_path), unit_bytes)


# ------------------------------------------------------------------ checkpoints: NVMe -> CPU offload and back
class _SaveWhileSwapping(Callback):
    """Saves at the end of each epoch, while the shards live on disk (teardown would bring them back)."""

    def __init__(self, path):
        self.path = path

    def on_train_epoch_end(self, trainer, module):
        swapper = get_param_swapper(module)
        assert swapper is None or any(not u.resident for u in swapper.units), "some shards should be on disk"
        trainer.save_checkpoint(self.path)


def _ckpt_trainer(kind, world_size, epochs, root):
    from lightning.pytorch import Trainer

    from tests.strategies.test_strategy_checkpoint import STEPS_PER_EPOCH

    kwargs = _nvme_kwargs(root) if kind == "nvme" else dict(offload="cpu")
    return Trainer(
        strategy=ZeroStrategy(stage=3, **kwargs),
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


def _ckpt_save_worker(rank, world_size, path, kind, root):
    torch.manual_seed(0)
    trainer = _ckpt_trainer(kind, world_size, 1, root)
    trainer.callbacks.append(_SaveWhileSwapping(path))
    trainer.fit(RegressionModule(batch_size=BATCH))


def _ckpt_resume_worker(rank, world_size, path, kind, root, saved_world_size):
    from tests.strategies.test_strategy_checkpoint import STEPS_PER_EPOCH, _reference

    torch.manual_seed(123)  # every weight and state must come from the checkpoint
    module = RegressionModule(batch_size=BATCH * saved_world_size // world_size)
    trainer = _ckpt_trainer(kind, world_size, 2, root)
    witness = _ParamSwapWitness()
    if kind == "nvme":
        trainer.callbacks.append(witness)
    trainer.fit(module, ckpt_path=path)
    assert trainer.global_step == 2 * STEPS_PER_EPOCH
    if kind == "nvme":
        assert witness.checked == STEPS_PER_EPOCH, "the resumed epoch must swap (written back after the load)"
    expected = _reference(2, BATCH * saved_world_size)
    got = full_state(module)
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= 1e-5, f"resumed under {kind} offload: max abs diff {worst:.2e}"


# (saved offload, world size) -> (resumed offload, world size), all at stage 3
CKPT_CASES = [(("nvme", 2), ("cpu", 1)), (("cpu", 2), ("nvme", 2))]


@pytest.mark.parametrize("saved,resumed", CKPT_CASES, ids=["nvme-x2-to-cpu-x1", "cpu-x2-to-nvme-x2"])
def test_checkpoint_moves_between_nvme_and_cpu_parameter_offload(tmp_path, saved, resumed):
    root = str(tmp_path)
    path = str(tmp_path / "run.ckpt")
    run_distributed(_ckpt_save_worker, saved[1], path, saved[0], root)
    run_distributed(_ckpt_resume_worker, resumed[1], path, resumed[0], root, saved[1])
    assert not [name for name in os.listdir(root) if name.startswith("lz-swap-")]


# ------------------------------------------------------------------ cleanup after an exception mid-step
class _BoomInStep(Callback):
    """Raises inside the optimizer step (after the first units were stepped and written back)."""

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if trainer.global_step == 2:
            swapper = get_param_swapper(module)
            base = swapper.step

            def failing_step(opt, base_step):
                calls = []

                def step_then_fail(o):
                    calls.append(1)
                    if len(calls) == 2:
                        raise RuntimeError("boom mid-step")
                    return base_step(o)

                return base(opt, step_then_fail)

            swapper.step = failing_step


def _exception_worker(rank, world_size, root):
    witness = _ParamSwapWitness()
    trainer = quiet_trainer(
        ZeroStrategy(stage=3, **_nvme_kwargs(root)), world_size, max_steps=STEPS, callbacks=[witness, _BoomInStep()]
    )
    module = RegressionModule(batch_size=BATCH)
    with pytest.raises(RuntimeError, match="boom mid-step"):
        trainer.fit(module)
    assert witness.checked == 2 and witness.folder is not None, "the swap must have happened before the exception"
    assert not os.path.exists(witness.folder), "an exception must not leave this rank's swap files behind"
    assert get_param_swapper(module) is None
    assert all(torch.isfinite(v).all() for v in full_state(module).values()), "teardown brings the shards back"


def test_param_swap_files_are_removed_after_an_exception_mid_step(tmp_path):
    run_distributed(_exception_worker, 2, str(tmp_path))
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ the same module again: validate, then fit again
def _reuse_worker(rank, world_size, root):
    torch.manual_seed(0)
    module = RegressionModule(batch_size=BATCH)
    strategy_kwargs = dict(stage=3, **_nvme_kwargs(root))
    quiet_trainer(ZeroStrategy(**strategy_kwargs), world_size, max_steps=2).fit(module)
    after_first = full_state(module)
    swapped = []

    class _Seen(Callback):
        def on_validation_batch_end(self, trainer, module, *args):
            swapped.append(get_param_swapper(module) is not None and get_param_swapper(module).bytes_read > 0)

    quiet_trainer(
        ZeroStrategy(**strategy_kwargs), world_size, max_steps=2, limit_val_batches=2, callbacks=[_Seen()]
    ).validate(module)
    assert swapped == [True, True], "validation on the reused module must swap again"
    assert all(torch.equal(after_first[k], v) for k, v in full_state(module).items()), "validation changed weights"
    witness = _ParamSwapWitness()
    quiet_trainer(ZeroStrategy(**strategy_kwargs), world_size, max_steps=2, callbacks=[witness]).fit(module)
    assert witness.checked == 2 and not os.path.exists(witness.folder)
    assert any(not torch.equal(after_first[k], v) for k, v in full_state(module).items())


def test_a_reused_module_swaps_again_in_validate_and_a_second_fit(tmp_path):
    run_distributed(_reuse_worker, 2, str(tmp_path))
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ the core alone: apply_zero + shard_optimizer
class _WideBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(48, 48)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class _Wide(torch.nn.Module):
    """Blocks whose shards are larger than a staging buffer, so every unit streams in several pieces."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_WideBlock() for _ in range(3))
        self.head = torch.nn.Linear(48, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def cpu_and_nvme_models(mesh, nvme, unit_bytes=0):
    """The same ``_Wide`` (seed 0) at stage 3, one unit per block (``unit_bytes=0``), with CPU offload and with NVMe
    parameter swapping; AdamW over each. Returns ``({"cpu": model, "nvme": model}, {"cpu": optimizer, "nvme":
    optimizer})``."""
    from lightning_zero.distributed.apply_zero import apply_zero
    from lightning_zero.distributed.config import ZeroConfig
    from lightning_zero.distributed.optimizer import shard_optimizer

    models, optimizers = {}, {}
    for label, config in (
        ("cpu", ZeroConfig(stage=3, offload="cpu", unit_bytes=unit_bytes)),
        ("nvme", ZeroConfig(stage=3, offload_optimizer="cpu", offload_params="nvme", nvme=nvme, unit_bytes=unit_bytes)),
    ):
        torch.manual_seed(0)
        models[label] = apply_zero(_Wide(), mesh, config)
        optimizers[label] = torch.optim.AdamW(models[label].parameters(), lr=1e-2, weight_decay=0.1)
        shard_optimizer(optimizers[label], config)
    return models, optimizers


def step_both(models, optimizers, x):
    """One training step of each model of :func:`cpu_and_nvme_models` on ``x``, gradients clipped to 0.01."""
    for label in ("cpu", "nvme"):
        models[label](x).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(models[label].parameters(), 0.01)
        optimizers[label].step()
        optimizers[label].zero_grad()


def _core_worker(rank, world_size, root):
    import shutil

    from torch.distributed.device_mesh import init_device_mesh

    from lightning_zero.distributed.apply_zero import apply_zero
    from lightning_zero.distributed.config import ZeroConfig
    from lightning_zero.offload.aio import SwapIOError
    from lightning_zero.offload.nvme_config import NvmeConfig
    from lightning_zero.offload.param_swapper import detach_param_swapper

    mesh = init_device_mesh("cpu", (world_size,))
    # 48x48+48 elements per block, 1176 per rank at 2 ranks: buffer_size=256 (1 KiB, aligned to 4 KiB pieces) -> 2
    # pieces per block. One unit per block (unit_bytes=0): max_in_cpu holds two blocks but not all three.
    nvme = NvmeConfig(root, max_in_cpu=2600, buffer_size=512, buffer_count=3)
    models, optimizers = cpu_and_nvme_models(mesh, nvme)
    swapper = get_param_swapper(models["nvme"])
    assert all(len(u.chunks) > 1 for u in swapper.units if u.name.startswith("blocks")), "units must be chunked"
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(8, 48, generator=gen)
        step_both(models, optimizers, x)
        assert swapper.resident_elements <= 2600 and swapper.peak_resident_elements <= 2600
    assert swapper.chunks_read_ahead > 0
    # state_dict() makes the shards readable (a save); load_state_dict() writes through to the files (a load)
    states = {label: {k: v.full_tensor() for k, v in models[label].state_dict().items()} for label in models}
    assert all(torch.equal(states["cpu"][k], states["nvme"][k]) for k in states["cpu"]), "swapped step not exact"
    torch.manual_seed(1)
    fresh = {k: v.clone() for k, v in _Wide().state_dict().items()}
    from torch.distributed.tensor import distribute_tensor

    for label in models:
        own = models[label].state_dict()
        models[label].load_state_dict({k: distribute_tensor(fresh[k], mesh, own[k].placements) for k in own})
    x = torch.randn(4, 48, generator=gen)
    assert torch.equal(models["cpu"](x), models["nvme"](x)), "the loaded weights must reach the swapped shards"
    # the forward after a load trims the residency to max_in_cpu again, writing back what it evicts (the reads at
    # teardown below and the comparison after it prove the files got the loaded weights)
    assert swapper.resident_elements <= 2600 and any(not u.resident for u in swapper.units)
    folder = swapper.run_folder
    detach_param_swapper(models["nvme"])
    assert not os.path.exists(folder) and get_param_swapper(models["nvme"]) is None
    assert torch.equal(models["cpu"](x), models["nvme"](x)), "after teardown the shards are in memory again"
    # the refusal naming nvme_path: a disk smaller than the shards (a unit larger than max_in_cpu is no refusal:
    # see test_units_larger_than_max_in_cpu_stream_through_and_nothing_stays)
    real = shutil.disk_usage
    shutil.disk_usage = lambda path: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000)
    try:
        with pytest.raises(SwapIOError, match=rf"nvme_path='{root}' has 1000 bytes free .* need about \d+ bytes"):
            apply_zero(_Wide(), mesh, ZeroConfig(stage=3, offload="nvme", nvme=NvmeConfig(root)))
    finally:
        shutil.disk_usage = real
    torch.distributed.barrier()  # both ranks' refused setups are over
    assert not [n for n in os.listdir(root) if n.startswith("lz-swap-")], "a refused setup leaves no folder"


def test_core_swaps_chunked_units_exactly_loads_through_and_refuses_what_cannot_fit(tmp_path):
    run_distributed(_core_worker, 2, str(tmp_path))


def _stream_worker(rank, world_size, root, unit_bytes, max_in_cpu):
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_zero.offload.nvme_config import NvmeConfig

    # max_in_cpu bounds what stays resident between uses, as DeepSpeed's does (its ZeRO-Infinity example sets 1):
    # a unit larger than it (a 1176-element block, or the 3528-element unit of the three grouped blocks under the
    # default unit_bytes) is read for each use and the step ends within the budget. It used to be refused at setup.
    nvme = NvmeConfig(root, max_in_cpu=max_in_cpu, buffer_size=512, buffer_count=3)
    models, optimizers = cpu_and_nvme_models(init_device_mesh("cpu", (world_size,)), nvme, unit_bytes)
    swapper = get_param_swapper(models["nvme"])
    assert max(u.elements for u in swapper.units) > max_in_cpu
    gen = torch.Generator().manual_seed(rank)
    for step in range(3):
        step_both(models, optimizers, torch.randn(8, 48, generator=gen))
        # after each step: within the budget, and a unit not kept holds no memory
        assert swapper.resident_elements <= max_in_cpu, (step, swapper.resident_elements)
        assert all(s.nbytes() == 0 for u in swapper.units if not u.resident for s in u.storages())
    assert swapper.peak_resident_elements > max_in_cpu  # the units in use were read all the same
    # every use of a unit that does not fit reads it: at least its forward and its step, each step
    assert all(u.reads >= 2 * 3 for u in swapper.units if u.elements > max_in_cpu)
    states = {label: {k: v.full_tensor() for k, v in models[label].state_dict().items()} for label in models}
    assert all(torch.equal(states["cpu"][k], states["nvme"][k]) for k in states["cpu"]), "swapped step not exact"


@pytest.mark.parametrize("unit_bytes,max_in_cpu", [(0, 1), (None, 2600)], ids=["per-block-1", "grouped-2600"])
def test_units_larger_than_max_in_cpu_stream_through_and_nothing_stays(tmp_path, unit_bytes, max_in_cpu):
    run_distributed(_stream_worker, 2, str(tmp_path), unit_bytes, max_in_cpu)


# ------------------------------------------------------------------ Fabric: parity, fabric.save/load, teardown
def _fabric_worker(rank, world_size, root):
    from lightning_zero.fabric import ZeroStrategy as FabricZeroStrategy
    from tests.distributed.test_zero_parity import STEPS, train_reference
    from tests.fabric.test_fabric_parity import fabric_train, full_weights, make_fabric

    expected = train_reference(world_size, accumulate=2, clip=0.05)
    # TinyNet at 2 ranks: its three blocks are one unit under the default unit_bytes (1680 local elements), the
    # root's 210: max_in_cpu=2000 keeps the grouped unit resident between uses, not next to the root's
    fabric = make_fabric(
        FabricZeroStrategy(stage=3, offload="nvme", nvme_path=root, max_in_cpu=2000, sub_group_size=64)
    )
    model, optimizer = fabric_train(fabric, rank, world_size, accumulate=2, clip=0.05, steps=range(STEPS - 1))
    swapper = get_param_swapper(model._forward_module)
    assert swapper is not None and swapper.bytes_read > 0 and swapper.resident_elements <= 2000
    path = os.path.join(root, "ckpt")
    fabric.save(path, {"model": model, "optimizer": optimizer})
    torch.manual_seed(5)
    with torch.no_grad():  # scribble over the (resident, after the save) shards: the load must win
        for param in model.parameters():
            param.normal_()
    fabric.load(path, {"model": model, "optimizer": optimizer})
    fabric_train(
        fabric,
        rank,
        world_size,
        accumulate=2,
        clip=0.05,
        steps=range(STEPS - 1, STEPS),
        model=model,
        optimizer=optimizer,
    )
    got = full_weights(model._forward_module)
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert worst <= 1e-5, f"Fabric stage 3 offload='nvme' after save/load differs by {worst:.2e}"
    folder = swapper.run_folder
    fabric.strategy.teardown()
    assert not os.path.exists(folder) and get_param_swapper(model._forward_module) is None


def test_fabric_stage3_nvme_trains_saves_and_loads(tmp_path):
    run_distributed(_fabric_worker, 2, str(tmp_path))
    assert [n for n in os.listdir(tmp_path) if n.startswith("lz-swap-")] == []


# ------------------------------------------------------------------ configuration (no process group)
def test_nvme_parameter_configuration_is_honoured_or_refused(tmp_path):
    from lightning_zero.adapters.settings import STRATEGY_NAMES

    root = str(tmp_path)
    named = {k: v for k, v in STRATEGY_NAMES["zero_stage_3_offload_nvme"].items() if k != "description"}
    config = ZeroStrategy(**named, nvme_path=root).zero_config
    assert (config.offload_optimizer, config.offload_params) == ("nvme", "nvme"), "ZeRO-Infinity, as DeepSpeed"
    config = ZeroStrategy(stage=3, offload="nvme", nvme_path=root, max_in_cpu=1000, buffer_size=10).zero_config
    assert config.swaps_parameters and (config.nvme.max_in_cpu, config.nvme.buffer_size) == (1000, 10)
    # DeepSpeed takes max_in_cpu >= 0: 0 keeps nothing resident between uses (the units in use are read anyway)
    infinity = {
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": root},
            "offload_param": {"device": "nvme", "nvme_path": root, "max_in_cpu": 0},
        }
    }
    assert ZeroStrategy(config=infinity).zero_config.nvme.max_in_cpu == 0
    with pytest.raises(ValueError, match="max_in_cpu must be an int >= 0, got -1"):
        ZeroStrategy(stage=3, offload="nvme", nvme_path=root, max_in_cpu=-1)
    # a ds_config with only the parameter section on NVMe is refused like offload_params alone (DeepSpeed would keep
    # the optimizer on the accelerator; here the sharded parameters are its masters: see config._resolve_offload)
    only_params = {
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": root, "max_in_cpu": 4096}}
    }
    with pytest.raises(ValueError, match="offload_params='nvme' without offload_optimizer is not supported"):
        ZeroStrategy(config=only_params)
    with pytest.raises(ValueError, match="offload_optimizer='nvme' and offload_params='nvme' .* needs nvme_path"):
        ZeroStrategy(stage=3, offload_optimizer="nvme", offload_params="nvme")
    with pytest.raises(ValueError, match="needs stage 3"):
        ZeroStrategy(stage=2, offload_optimizer="nvme", offload_params="nvme", nvme_path=root)
    with pytest.raises(ValueError, match="max_in_cpu=5 only drives parameter swapping"):
        ZeroStrategy(stage=3, offload_optimizer="nvme", offload_params="cpu", nvme_path=root, max_in_cpu=5)


def _disk_full_worker(rank, world_size, root):
    import errno

    from torch.distributed.device_mesh import init_device_mesh

    from lightning_zero.distributed.apply_zero import apply_zero
    from lightning_zero.distributed.config import ZeroConfig
    from lightning_zero.distributed.optimizer import shard_optimizer
    from lightning_zero.offload import aio as aio_module
    from lightning_zero.offload.aio import SwapIOError
    from lightning_zero.offload.nvme_config import NvmeConfig
    from lightning_zero.offload.param_swapper import detach_param_swapper

    # max_in_cpu holds two of the three blocks: the step evicts (writes back) a unit it stepped
    config = ZeroConfig(
        stage=3, offload_optimizer="cpu", offload_params="nvme", nvme=NvmeConfig(root, max_in_cpu=2600), unit_bytes=0
    )
    model = apply_zero(_Wide(), init_device_mesh("cpu", (world_size,)), config)
    optimizer = torch.optim.Adam(model.parameters())
    shard_optimizer(optimizer, config)
    swapper = get_param_swapper(model)
    model(torch.randn(4, 48)).sum().backward()

    def full(fd, buffers, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    real = aio_module.os.pwritev
    aio_module.os.pwritev = full
    try:
        with pytest.raises(SwapIOError, match=r"nvme_path \(.*\) is full"):
            optimizer.step()  # the write-back after the step finds the disk full
    finally:
        aio_module.os.pwritev = real
    # the unit whose write-back failed lost its memory and its file is stale: reading it back must fail, not return
    # the weights before the step (other units' failed writes may surface first)
    errors = []
    for _ in range(len(swapper.units) + 1):
        try:
            swapper.make_resident()
            break
        except SwapIOError as error:
            errors.append(str(error))
    assert any("were lost" in error for error in errors), errors
    folder = swapper.run_folder
    with pytest.warns(RuntimeWarning, match="could not be read back"):
        detach_param_swapper(model)
    assert not os.path.exists(folder), "a failed run must not leave its swap files behind"


def test_a_full_disk_during_the_step_names_nvme_path_and_teardown_removes_the_files(tmp_path):
    run_distributed(_disk_full_worker, 2, str(tmp_path))


def _async_save_worker(rank, world_size, root):
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_zero.checkpoint.io import load_sharded_checkpoint, save_sharded_checkpoint, wait_for_pending_saves
    from lightning_zero.offload.nvme_config import NvmeConfig

    mesh = init_device_mesh("cpu", (world_size,))
    models, optimizers = cpu_and_nvme_models(
        mesh, NvmeConfig(os.path.join(root, "swap"), max_in_cpu=2600, buffer_size=512, buffer_count=3)
    )
    step_both(models, optimizers, torch.randn(8, 48, generator=torch.Generator().manual_seed(rank)))
    state = models["nvme"].state_dict()
    # the condition DCP's async stager tripped over: swapped-in shards live in aligned slices of larger buffers
    assert any(v.data_ptr() != 0 for v in state.values()), "no shard at a storage offset: the test proves nothing"
    save_sharded_checkpoint(os.path.join(root, "sync.ckpt"), {"state_dict": state}, {"step": 1})
    save_sharded_checkpoint(
        os.path.join(root, "async.ckpt"), {"state_dict": models["nvme"].state_dict()}, {"step": 1}, async_save=True
    )
    wait_for_pending_saves()
    loaded = {}
    for name in ("sync", "async"):
        target = {"state_dict": {k: torch.zeros_like(v) for k, v in state.items()}}
        load_sharded_checkpoint(os.path.join(root, f"{name}.ckpt"), target)
        loaded[name] = {k: v.full_tensor() for k, v in target["state_dict"].items()}
    expected = {k: v.full_tensor() for k, v in models["nvme"].state_dict().items()}
    for k in expected:
        assert torch.equal(loaded["sync"][k], expected[k]) and torch.equal(loaded["async"][k], expected[k]), k


def test_async_save_of_swapped_parameters_reloads_as_a_sync_save(tmp_path):
    """async_save=True with offload_params="nvme" (DCP's stager deep-copies each DTensor; see io._stageable)."""
    os.makedirs(tmp_path / "swap")
    run_distributed(_async_save_worker, 2, str(tmp_path))
