"""Optimizer states in sharded checkpoints go through torch's ``get_optimizer_state_dict``/``set_optimizer_state_dict``
where the optimizer holds the module's own parameters, and through the name-keyed code of ``checkpoint.states``
exactly where torch's API cannot serve the optimizer (fp32 masters, a stage-1 rank owning nothing of a group).

Each case trains a step, saves a sharded checkpoint, resumes it into a model built with other weights and learning
rates, and checks the resumed optimizer holds the saved states and hyper-parameters, on two gloo ranks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import state_dict as torch_state_dict
from torch.distributed.device_mesh import init_device_mesh

from lightning_zero import ZeroConfig
from lightning_zero.checkpoint import CheckpointError, load_meta
from lightning_zero.checkpoint import states as checkpointing
from lightning_zero.distributed import runtime
from tests.ranks import run_distributed

CPU = torch.device("cpu")
# (ZeroConfig arguments, whether torch's API serves the optimizer)
CASES = {
    "stage 0": ({"stage": 0}, True),
    "stage 2": ({"stage": 2, "unit_bytes": 0}, True),
    "stage 3": ({"stage": 3, "unit_bytes": 0}, True),
    "stage 3, offload cpu": ({"stage": 3, "offload": "cpu", "unit_bytes": 0}, True),
    "stage 1": ({"stage": 1}, False),
    "stage 2, offload_optimizer cpu": ({"stage": 2, "offload_optimizer": "cpu", "unit_bytes": 0}, False),
}


def _setup(config: ZeroConfig, mesh, seed: int, lr_scale: float):
    torch.manual_seed(seed)
    with runtime.init_context(config, pipelined=False, local_world_size=dist.get_world_size()):
        module = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    model = runtime.wrap_module(module, mesh, config, device=CPU)
    # the second group holds one parameter: at stage 1 one of the two ranks owns nothing of it
    optimizer = torch.optim.AdamW(
        [
            {"params": [module[0].weight, module[0].bias, module[2].weight], "lr": 0.01 * lr_scale},
            {"params": [module[2].bias], "lr": 0.02 * lr_scale, "weight_decay": 0.0},
        ]
    )
    runtime.shard_optimizer_of(optimizer, module, mesh, config, device=CPU)
    return module, model, optimizer


def _full_states(module, optimizer) -> dict:
    states = checkpointing.optimizer_state_dict(module, optimizer)["state"]
    full = {}
    for name, state in sorted(states.items()):
        for key, value in sorted(state.items()):
            full[f"{name}.{key}"] = value.full_tensor() if hasattr(value, "full_tensor") else value.clone()
    return full


def _gathered(local: dict) -> dict:
    """Every rank's states together (stage 1: each rank holds its partition's)."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return {key: value for part in parts for key, value in part.items()}


def _calls(counter: dict, name: str):
    original = getattr(checkpointing, name)

    def counted(*args, **kwargs):
        counter[name] = counter.get(name, 0) + 1
        return original(*args, **kwargs)

    return counted


def _save(path: str, module, optimizer, stage: int) -> None:
    checkpoint = {
        "state_dict": checkpointing.module_state_dict(module, [optimizer]),
        "optimizer_states": [checkpointing.optimizer_state_dict(module, optimizer)],
    }
    checkpointing.save_states(
        checkpoint,
        path,
        module=module,
        optimizers=[optimizer],
        stage=stage,
        offload=None,
        exclude_frozen_parameters=False,
        ds_config_report=None,
        async_save=False,
    )


def _round_trip_worker(rank: int, world_size: int, directory: str, case: str) -> None:
    arguments, through_torch = CASES[case]
    config = ZeroConfig(**arguments)
    mesh = init_device_mesh("cpu", (world_size,))
    module, model, optimizer = _setup(config, mesh, seed=0, lr_scale=1.0)
    model(torch.randn(8, 4).chunk(world_size)[rank]).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    saved = _gathered(_full_states(module, optimizer))
    assert saved and all(key.endswith(("exp_avg", "exp_avg_sq", "step")) for key in saved)
    path = os.path.join(directory, "ckpt")
    counter: dict = {}
    checkpointing.get_optimizer_state_dict = _calls(counter, "get_optimizer_state_dict")
    checkpointing.set_optimizer_state_dict = _calls(counter, "set_optimizer_state_dict")
    _save(path, module, optimizer, config.stage)
    resumed, _, resumed_optimizer = _setup(config, mesh, seed=1, lr_scale=9.0)
    checkpointing.load_states(path, load_meta(path), resumed, [resumed_optimizer], strict=True)
    calls = dict(counter)
    loaded = _gathered(_full_states(resumed, resumed_optimizer))
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[key], saved[key]) for key in saved), case
    assert [group["lr"] for group in resumed_optimizer.param_groups] == [0.01, 0.02]
    expected = {"get_optimizer_state_dict": 2, "set_optimizer_state_dict": 1} if through_torch else {}
    assert calls == expected, (case, calls)


@pytest.mark.parametrize("case", sorted(CASES))
def test_optimizer_states_round_trip_through_the_api_that_serves_them(tmp_path, case):
    run_distributed(_round_trip_worker, 2, str(tmp_path), case)


def _torch_api_limits_worker(rank: int, world_size: int) -> None:
    mesh = init_device_mesh("cpu", (world_size,))
    # fp32 masters are no module parameter: torch's API cannot name them
    module, model, optimizer = _setup(ZeroConfig(stage=2, offload_optimizer="cpu", unit_bytes=0), mesh, 0, 1.0)
    model(torch.randn(4, 4)).sum().backward()
    optimizer.step()
    assert not checkpointing.holds_module_parameters(optimizer)
    with pytest.raises(KeyError):
        torch_state_dict.get_optimizer_state_dict(module, optimizer)
    runtime.release([module], [optimizer])
    # stage 1: rank 1 owns nothing of the second group, and torch's load refuses an empty group
    module, model, optimizer = _setup(ZeroConfig(stage=1), mesh, 0, 1.0)
    model(torch.randn(4, 4)).sum().backward()
    optimizer.step()
    assert [len(group["params"]) for group in optimizer.param_groups][1] == (1 if rank == 0 else 0)
    state_dict = checkpointing.optimizer_state_dict(module, optimizer)
    if rank == 1:
        with pytest.raises(ValueError, match="zero parameters"):
            torch_state_dict.set_optimizer_state_dict(
                module, optimizer, state_dict, options=torch_state_dict.StateDictOptions(strict=False)
            )
    runtime.release([module], [optimizer])
    # before the first step torch's get creates the states with a step, which Adam counts: ours reads none
    module, model, optimizer = _setup(ZeroConfig(stage=2, unit_bytes=0), mesh, 0, 1.0)
    assert checkpointing.optimizer_state_dict(module, optimizer)["state"] == {} and not optimizer.state
    torch_state_dict.get_optimizer_state_dict(module, optimizer)
    steps = {state["step"].item() for state in optimizer.state.values()}
    assert steps == {1.0}, steps
    runtime.release([module], [optimizer])


def test_where_torchs_optimizer_state_api_cannot_serve_the_optimizer():
    run_distributed(_torch_api_limits_worker, 2)


def _other_groups_worker(rank: int, world_size: int, directory: str) -> None:
    config = ZeroConfig(stage=2, unit_bytes=0)
    mesh = init_device_mesh("cpu", (world_size,))
    module, model, optimizer = _setup(config, mesh, seed=0, lr_scale=1.0)
    model(torch.randn(4, 4)).sum().backward()
    optimizer.step()
    path = os.path.join(directory, "ckpt")
    _save(path, module, optimizer, config.stage)
    resumed, _, _ = _setup(config, mesh, seed=1, lr_scale=1.0)
    one_group = torch.optim.AdamW(resumed.parameters())
    runtime.shard_optimizer_of(one_group, resumed, mesh, config, device=CPU)
    with pytest.raises(CheckpointError, match="has 2 param group"):
        checkpointing.load_states(path, load_meta(path), resumed, [one_group], strict=True)


def test_a_resume_with_other_param_groups_is_refused(tmp_path):
    run_distributed(_other_groups_worker, 2, str(tmp_path))


class CompiledBody(nn.Module):
    """A ``torch.compile``d submodule: its weights are named ``body._orig_mod.*``, which torch's optimizer state-dict
    API shortens to ``body.*``. Never called, so nothing is compiled."""

    def __init__(self):
        super().__init__()
        self.body = torch.compile(nn.Linear(4, 6))
        self.head = nn.Linear(6, 3)


def _wrapper_prefix_worker(rank: int, world_size: int, directory: str) -> None:
    config = ZeroConfig(stage=0)
    mesh = init_device_mesh("cpu", (world_size,))

    def build(seed: int, lr_scale: float):
        torch.manual_seed(seed)
        module = CompiledBody()
        runtime.wrap_module(module, mesh, config, device=CPU)
        groups = [
            {"params": list(module.body.parameters()), "lr": 0.01 * lr_scale},
            {"params": module.head.parameters()},
        ]
        optimizer = torch.optim.AdamW(groups, lr=0.02 * lr_scale)
        runtime.shard_optimizer_of(optimizer, module, mesh, config, device=CPU)
        return module, optimizer

    module, optimizer = build(0, 1.0)
    for param in module.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    saved = _full_states(module, optimizer)
    # the states are keyed like the weights of the same checkpoint
    assert {key.rsplit(".", 1)[0] for key in saved} == set(module.state_dict())
    path = os.path.join(directory, "ckpt")
    _save(path, module, optimizer, 0)
    resumed, resumed_optimizer = build(1, 9.0)
    checkpointing.load_states(path, load_meta(path), resumed, [resumed_optimizer], strict=True)
    loaded = _full_states(resumed, resumed_optimizer)
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[key], saved[key]) for key in saved)
    assert [group["lr"] for group in resumed_optimizer.param_groups] == [0.01, 0.02]
    for param in resumed.parameters():
        param.grad = torch.ones_like(param)
    resumed_optimizer.step()  # every group kept its hyper-parameters (betas, eps, ...)


def test_a_wrapped_submodule_keeps_the_names_of_its_weights(tmp_path):
    run_distributed(_wrapper_prefix_worker, 2, str(tmp_path))


def _frozen_worker(rank: int, world_size: int, directory: str) -> None:
    config = ZeroConfig(stage=2, unit_bytes=0)
    mesh = init_device_mesh("cpu", (world_size,))
    module, model, optimizer = _setup(config, mesh, seed=0, lr_scale=1.0)
    model(torch.randn(4, 4)).sum().backward()
    optimizer.step()
    module[2].bias.requires_grad_(False)  # frozen after it has states, as a schedule that freezes layers does
    saved = _gathered(_full_states(module, optimizer))
    assert any(key.startswith("2.bias.") for key in saved)
    path = os.path.join(directory, "ckpt")
    _save(path, module, optimizer, config.stage)
    resumed, _, resumed_optimizer = _setup(config, mesh, seed=1, lr_scale=9.0)
    resumed[2].bias.requires_grad_(False)
    checkpointing.load_states(path, load_meta(path), resumed, [resumed_optimizer], strict=True)
    loaded = _gathered(_full_states(resumed, resumed_optimizer))
    assert loaded.keys() == saved.keys() and all(torch.equal(loaded[key], saved[key]) for key in saved)


def test_a_frozen_parameter_keeps_its_states_across_a_resume(tmp_path):
    run_distributed(_frozen_worker, 2, str(tmp_path))
