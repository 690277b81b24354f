"""Fabric code as people write it: a full state dict loaded into the set-up model (LitGPT's fine-tuning),
``fabric.load_raw`` of one file, ``fabric.save`` keys the checkpoint uses itself, and CheckpointIO plugins.

The fine-tune runs are compared with the same script under Lightning's own ``DDPStrategy`` (same ranks, same data):
build, ``fabric.setup_module``, ``fabric.setup_optimizers``, load the base weights, train a few steps.
"""

import os
from types import SimpleNamespace

import pytest
import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.fabric.strategies import DDPStrategy
from safetensors.torch import save_file
from torch import nn

from lightning_zero.checkpoint.errors import CheckpointError
from lightning_zero.checkpoint.full_save import FULL_FILE_MARKER
from lightning_zero.checkpoint.safe_load import load_meta
from lightning_zero.fabric import ZeroStrategy, fabric_checkpoints
from tests.distributed.test_zero_parity import LOCAL_BATCH, STEPS, TinyNet, data, make_optimizer
from tests.fabric.test_fabric_parity import fabric_train, full_weights, make_fabric
from tests.ranks import run_distributed

QUICK = [(1, "cpu"), (2, "cpu"), (3, None)]  # stale offloaded masters; DTensor parameters; both
SWEEP = [(0, None), (1, None), (1, "cpu"), (2, None), (2, "cpu"), (3, None), (3, "cpu")]
# offload_optimizer="nvme": the masters are swapped to disk between steps and must follow the load too
NVME = [
    dict(stage=1, offload_optimizer="nvme", sub_group_size=64),
    dict(stage=2, offload_optimizer="nvme", sub_group_size=64),
    dict(stage=3, offload_optimizer="nvme", offload_params="nvme", sub_group_size=64),
]


def _write_base(directory) -> dict:
    """The "pretrained" weights (another init than the model's own), as a torch file and as safetensors."""
    torch.manual_seed(5)
    weights = TinyNet().state_dict()
    paths = {"pth": os.path.join(directory, "base.pth"), "safetensors": os.path.join(directory, "base.safetensors")}
    torch.save(weights, paths["pth"])
    save_file(weights, paths["safetensors"])
    return paths


def _unwrapped(model):
    inner = model._forward_module
    return getattr(inner, "module", inner)


def _finetune(fabric, rank, world_size, load):
    """LitGPT's fine-tuning shape: build, set up the module then the optimizer, load the base weights, train."""
    torch.manual_seed(0)
    with fabric.init_module():
        module = TinyNet()
    model = fabric.setup_module(module)
    optimizer = fabric.setup_optimizers(make_optimizer(model))
    load(fabric, model)
    fabric_train(fabric, rank, world_size, model=model, optimizer=optimizer)
    return full_weights(_unwrapped(model))


def _loaders(paths):
    return {
        "load_state_dict": lambda fabric, model: model.load_state_dict(torch.load(paths["pth"], weights_only=True)),
        "load_raw .pth": lambda fabric, model: fabric.load_raw(paths["pth"], model),
        "load_raw .safetensors": lambda fabric, model: fabric.load_raw(paths["safetensors"], model),
    }


def _finetune_worker(rank, world_size, paths, configs, loads):
    loaders = _loaders(paths)
    expected = _finetune(make_fabric(DDPStrategy()), rank, world_size, loaders["load_state_dict"])
    torch.manual_seed(5)
    assert not torch.equal(expected["out.weight"], TinyNet().state_dict()["out.weight"])  # it trained
    failures = []
    for number, config in enumerate(configs):
        kwargs = dict(stage=config[0], offload=config[1]) if isinstance(config, tuple) else dict(config)
        for name in loads:
            if "offload_optimizer" in kwargs:  # one swap folder per run
                kwargs["nvme_path"] = os.path.join(os.path.dirname(paths["pth"]), f"nvme-{number}-{name}")
                os.makedirs(kwargs["nvme_path"], exist_ok=True)
            got = _finetune(make_fabric(ZeroStrategy(**kwargs)), rank, world_size, loaders[name])
            worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
            if not worst <= 1e-5:
                failures.append(f"{kwargs} {name}: max abs diff {worst:.2e}")
    assert not failures, "\n".join(failures)


def test_finetune_loading_base_weights_after_setup_equals_ddp(tmp_path):
    run_distributed(_finetune_worker, 2, _write_base(tmp_path), QUICK, ["load_state_dict"])


@pytest.mark.slow
def test_finetune_loading_base_weights_after_setup_equals_ddp_at_every_stage(tmp_path):
    run_distributed(
        _finetune_worker,
        2,
        _write_base(tmp_path),
        SWEEP + NVME,
        ["load_state_dict", "load_raw .pth", "load_raw .safetensors"],
    )


def _torch_report(call):
    """What ``call`` raised, without its first line (which names the module's class: FSDPTinyNet, TinyNet)."""
    with pytest.raises(RuntimeError) as raised:
        call()
    return str(raised.value).split("\n", 1)[1]


def _strict_worker(rank, world_size, paths):
    torch.manual_seed(5)
    base = TinyNet().state_dict()
    partial = {k: v for k, v in base.items() if k != "out.bias"}
    partial["head.weight"] = torch.zeros(3)
    wrong_shape = {**base, "out.weight": torch.zeros(5, 32)}
    for stage in (0, 2, 3):
        fabric = make_fabric(ZeroStrategy(stage=stage))
        torch.manual_seed(0)
        model = fabric.setup_module(TinyNet())
        before = full_weights(_unwrapped(model))["out.bias"]
        plain = TinyNet()
        # strict=False: torch's own report of missing and unexpected keys, and the keys present are loaded
        assert model.load_state_dict(partial, strict=False) == plain.load_state_dict(partial, strict=False), stage
        got = full_weights(_unwrapped(model))
        assert all(torch.equal(got[k], v) for k, v in partial.items() if k in got) and torch.equal(
            got["out.bias"], before
        ), stage
        # strict=True, and a shape mismatch (refused either way): torch's own errors
        for state, strict in ((partial, True), (wrong_shape, False)):
            assert _torch_report(lambda: model.load_state_dict(state, strict=strict)) == _torch_report(
                lambda: plain.load_state_dict(state, strict=strict)
            ), (stage, strict)
        # fabric.load_raw: the same keys decide, named in the error
        torch.save(partial, paths["partial"])
        with pytest.raises(CheckpointError, match="missing keys .*out.bias.*unexpected keys .*head.weight"):
            fabric.load_raw(paths["partial"], model)
        fabric.load_raw(paths["partial"], model, strict=False)
        # after a forward without backward the units stay gathered (stage 2; stage 3's root): the load still
        # reaches the shards the next forward gathers from
        x = torch.randn(LOCAL_BATCH, 8, generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            model(x)
            model.load_state_dict(base)
            plain.load_state_dict(base)
            torch.testing.assert_close(model(x), plain(x), msg=f"stage {stage}")
        assert all(torch.equal(full_weights(_unwrapped(model))[k], v) for k, v in base.items()), stage


def test_strict_and_non_strict_loads_report_as_torch_does(tmp_path):
    paths = {**_write_base(tmp_path), "partial": str(tmp_path / "partial.pth")}
    run_distributed(_strict_worker, 2, paths)


def _partial_load_masters_worker(rank, world_size):
    from lightning_zero.distributed.optimizer import get_sharding
    from lightning_zero.torch_compat import local_tensor

    for stage in (1, 2):
        fabric = make_fabric(ZeroStrategy(stage=stage, offload="cpu"))
        torch.manual_seed(0)
        model = fabric.setup_module(TinyNet())
        optimizer = fabric.setup_optimizers(make_optimizer(model))
        sharding = get_sharding(optimizer.optimizer)
        module = _unwrapped(model)
        params = dict(module.named_parameters())
        with torch.no_grad():
            for master in sharding.masters.values():  # masters unlike their parameters (fp32 ones under bf16-true)
                local_tensor(master).add_(1.0)
        model.load_state_dict({"out.bias": torch.full((4,), 7.0)}, strict=False)
        for name, param in params.items():
            master = sharding.masters.get(id(param))
            if master is None:
                continue  # stage 1: another rank steps it
            expected = local_tensor(param.detach()) + (0.0 if name == "out.bias" else 1.0)
            assert torch.equal(local_tensor(master), expected), (stage, name)
        assert torch.equal(full_weights(module)["out.bias"], torch.full((4,), 7.0)), stage


def test_a_partial_load_syncs_only_the_loaded_parameters_masters():
    run_distributed(_partial_load_masters_worker, 2)


def _reference_resume(world_size, directory):
    """Unsharded: one step, save the weights and the optimizer state (torch.save), then the remaining steps."""
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = make_optimizer(model)
    x, y = data(world_size, 1)
    per_step = world_size * LOCAL_BATCH
    for step in range(STEPS):
        if step == 1:
            torch.save(model.state_dict(), os.path.join(directory, "model.pth"))
            torch.save(optimizer.state_dict(), os.path.join(directory, "optimizer.pth"))
        xs, ys = x[step * per_step : (step + 1) * per_step], y[step * per_step : (step + 1) * per_step]
        nn.functional.mse_loss(model(xs), ys).backward()
        optimizer.step()
        optimizer.zero_grad()
    return full_weights(model)


def _load_raw_worker(rank, world_size, directory, configs):
    expected = _reference_resume(world_size, directory)
    for stage, offload in configs:
        fabric = Fabric(accelerator="cpu", devices=world_size, strategy=ZeroStrategy(stage=stage, offload=offload))
        fabric.launch()
        torch.manual_seed(7)
        with fabric.init_module():
            module = TinyNet()
        model, optimizer = fabric.setup(module, make_optimizer(module))
        fabric.load_raw(os.path.join(directory, "model.pth"), model)
        fabric.load_raw(os.path.join(directory, "optimizer.pth"), optimizer)
        fabric_train(fabric, rank, world_size, steps=range(1, STEPS), model=model, optimizer=optimizer)
        got = full_weights(_unwrapped(model))
        worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
        assert worst <= 1e-5, f"stage={stage} offload={offload}: max abs diff {worst:.2e}"


@pytest.mark.parametrize("world_size", [1, 2])
def test_load_raw_model_and_optimizer_resume_as_unsharded(tmp_path, world_size):
    configs = [(2, "cpu"), (3, None)] if world_size == 2 else [(2, None), (3, "cpu")]
    run_distributed(_load_raw_worker, world_size, str(tmp_path), configs)


@pytest.mark.slow
def test_load_raw_model_and_optimizer_resume_as_unsharded_at_every_stage(tmp_path):
    run_distributed(_load_raw_worker, 2, str(tmp_path), SWEEP)


class _Pickled:
    pass


def _refusals_worker(rank, world_size, directory):
    fabric = make_fabric(ZeroStrategy(stage=3))
    module = TinyNet()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    with pytest.raises(CheckpointError, match="directory: load a sharded checkpoint with fabric.load"):
        fabric.load_raw(directory, model)
    with pytest.raises(FileNotFoundError):
        fabric.load_raw(os.path.join(directory, "missing.pth"), model)
    untrusted = os.path.join(directory, "untrusted.pth")
    torch.save({"inp.weight": torch.zeros(32, 8), "payload": _Pickled()}, untrusted)
    with pytest.raises(CheckpointError, match="_Pickled, which torch.load.weights_only=True. does not allow"):
        fabric.load_raw(untrusted, model)  # never unpickled
    with pytest.raises(CheckpointError, match="a .safetensors file holds no optimizer state"):
        fabric.load_raw(os.path.join(directory, "base.safetensors"), optimizer)
    with pytest.raises(CheckpointError, match="not an optimizer state dict"):
        fabric.load_raw(os.path.join(directory, "base.pth"), optimizer)
    with pytest.raises(ValueError, match="holds no parameter of a module set up"):
        fabric.load_raw(os.path.join(directory, "base.pth"), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=1))


def test_load_raw_refusals_name_the_file(tmp_path):
    _write_base(tmp_path)
    run_distributed(_refusals_worker, 2, str(tmp_path))


def _save(path, state, precision=None, exclude_frozen_parameters=False):
    fabric_checkpoints.save(
        str(path),
        state,
        None,
        precision=precision or SimpleNamespace(scaler=None),
        zero_config=SimpleNamespace(stage=0, offload=None),
        exclude_frozen_parameters=exclude_frozen_parameters,
        ds_config_report=None,
        async_save=False,
    )


@pytest.mark.parametrize("key", sorted(fabric_checkpoints.RESERVED))
def test_a_state_key_the_checkpoint_uses_itself_is_refused_by_name(tmp_path, key):
    module = TinyNet()
    state = {"model": module, "optimizer": make_optimizer(module), key: {"mine": 1}}
    with pytest.raises(ValueError, match=f"fabric.save with a ZeroStrategy: the state key.s. \\['{key}'\\]"):
        _save(tmp_path / "ckpt", state)
    assert not os.path.exists(tmp_path / "ckpt")
    _save(tmp_path / "ckpt", {"model": module})
    with pytest.raises(ValueError, match=f"fabric.load with a ZeroStrategy: the state key.s. \\['{key}'\\]"):
        fabric_checkpoints.load(
            str(tmp_path / "ckpt"),
            {"model": module, key: None},
            True,
            precision=SimpleNamespace(scaler=None),
            async_save=False,
            exclude_frozen_parameters=False,
        )
    # a module or an optimizer may take the name: they are stored by kind, not under their key
    _save(
        tmp_path / "other", {key: module} if key != "optimizer_states" else {"m": module, key: make_optimizer(module)}
    )


def test_the_reserved_keys_are_every_key_a_save_writes_itself(tmp_path):
    module = TinyNet()
    next(module.parameters()).requires_grad_(False)
    user = {"step": 3, "note": "x"}
    _save(
        tmp_path / "ckpt",
        {"model": module, "optimizer": make_optimizer(module), **user},
        precision=SimpleNamespace(scaler=object(), state_dict=lambda: {"scale": 1.0}),
        exclude_frozen_parameters=True,
    )
    written = set(load_meta(str(tmp_path / "ckpt"))) | {"state_dict", "optimizer_states"}  # the last two: DCP
    written.add(FULL_FILE_MARKER)  # what a state_dict_type="full" save adds to these (test_fabric_checkpoint.py)
    assert written == set(fabric_checkpoints.RESERVED) | set(user)


class _MyCheckpointIO(TorchCheckpointIO):
    pass


@pytest.mark.parametrize("strategy", [lambda: ZeroStrategy(stage=2), lambda: "zero_stage_3"])
def test_a_checkpoint_io_plugin_is_refused_by_name(strategy):
    with pytest.raises(NotImplementedError, match="ZeroStrategy does not use a CheckpointIO plugin .*_MyCheckpointIO"):
        Fabric(accelerator="cpu", devices=1, strategy=strategy(), plugins=[_MyCheckpointIO()])
    assert isinstance(
        Fabric(accelerator="cpu", devices=1, strategy=strategy()).strategy.checkpoint_io, TorchCheckpointIO
    )  # Lightning's default, for its teardown
