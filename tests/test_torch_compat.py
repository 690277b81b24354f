"""lightning_zero.torch_compat: each guard reads both torch layouts it names (the other one is what CI's torch
lacks, so it is built here by hand), and the real FSDP2 state of the installed torch."""

import types

import torch
from torch import nn

from lightning_zero.torch_compat import fsdp_param_groups
from tests.ranks import run_distributed


def test_fsdp_param_groups_reads_the_list_and_the_single_group_layouts():
    a, b = object(), object()
    assert fsdp_param_groups(types.SimpleNamespace(_fsdp_param_groups=[a, b])) == [a, b]  # torch >= 2.12
    assert fsdp_param_groups(types.SimpleNamespace(_fsdp_param_group=a)) == [a]  # torch 2.11
    assert fsdp_param_groups(types.SimpleNamespace(_fsdp_param_group=None)) == []  # a unit without parameters


def _real_state_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    held = {id(fp.sharded_param) for m in (model, model[0])
            for g in fsdp_param_groups(m._get_fsdp_state()) for fp in g.fsdp_params}
    assert held == {id(p) for p in model.parameters()}, torch.__version__


def test_fsdp_param_groups_finds_every_sharded_parameter_of_this_torch():
    run_distributed(_real_state_worker, 2)
