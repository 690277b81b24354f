"""The collectives a GPU run issues on CPU tensors, over the process group the package starts on CUDA.

Each rank starts its group through ``start_process_group`` with a CUDA root device and NCCL emulated
(``tests/emulation/nccl.py``), then runs the package code that communicates CPU tensors in a GPU run with CPU
offload: the gradient norm of clipping over offloaded DTensor shards, fp16's overflow flag over CPU gradients,
FusedLamb's shard sums, and the gather of offloaded shards to full tensors that the spawn/fork launcher sends back.
With an NCCL-only group every one of them raises "No backend type associated with device type cpu".
"""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from lightning_zero.adapters.process_group import barrier, start_process_group
from lightning_zero.ops import FusedLamb, has_overflow
from lightning_zero.strategies.trainer_precision import ZeroPrecision
from lightning_zero.torch_compat import backend_serving
from tests.emulation.nccl import emulated_backend, emulated_nccl
from tests.ranks import run_distributed

SHAPES = [(5, 3), (7,), (2, 4)]  # first dimensions that two ranks split unevenly


def _start_as_on_cuda(rank: int, world_size: int, backend=None, offloads: bool = True) -> str:
    environment = LightningEnvironment()
    environment.set_world_size(world_size)
    environment.set_global_rank(rank)
    with emulated_nccl():
        return start_process_group(
            environment,
            backend,
            torch.device("cuda", 0),
            timeout=timedelta(seconds=60),
            rendezvous_timeout=60.0,
            num_nodes=1,
            node_rank=0,
            global_rank=rank,
            world_size=world_size,
            offloads=offloads,
        )


def _full(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in SHAPES]


def _shard(full: torch.Tensor, mesh, rank: int, world_size: int) -> DTensor:
    """This rank's dim-0 chunk as FSDP2 lays it out (torch.chunk; possibly empty), wrapped without communication."""
    chunks = list(torch.chunk(full, world_size, dim=0))
    chunks += [full.new_empty((0,) + tuple(full.shape[1:]))] * (world_size - len(chunks))
    return DTensor.from_local(
        chunks[rank].clone(), mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride()
    )


def _offloaded_params(mesh, rank, world_size, *, grad_seed=1):
    params = []
    for weight, grad in zip(_full(0), _full(grad_seed)):
        p = torch.nn.Parameter(_shard(weight, mesh, rank, world_size))
        p.grad = _shard(grad, mesh, rank, world_size)
        params.append(p)
    return params


def _gathered(tensors) -> list[torch.Tensor]:
    return [t.full_tensor() for t in tensors]  # what ZeroMultiProcessingLauncher sends back (CPU shards)


def _clipping_worker(rank, world_size):
    _start_as_on_cuda(rank, world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    params = _offloaded_params(mesh, rank, world_size)
    optimizer = torch.optim.SGD(params, lr=0.1)
    ZeroPrecision("32-true").clip_grad_by_norm(optimizer, 0.5)  # the Trainer's clipping of stage 3 + offload
    reference = [torch.nn.Parameter(w) for w in _full(0)]
    for p, g in zip(reference, _full(1)):
        p.grad = g
    torch.nn.utils.clip_grad_norm_(reference, 0.5)
    for got, want in zip(_gathered([p.grad for p in params]), reference):
        torch.testing.assert_close(got, want.grad)


def _overflow_worker(rank, world_size):
    _start_as_on_cuda(rank, world_size)
    grads = [g.to(torch.float16) for g in _full(rank)]
    assert not has_overflow(grads)
    if rank == 1:
        grads[1][0] = float("inf")
    assert has_overflow(grads)  # every rank learns of rank 1's inf
    assert has_overflow([] if rank == 0 else [torch.tensor([math.nan])])  # a rank with an empty shard too


def _lamb_worker(rank, world_size):
    _start_as_on_cuda(rank, world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    params = _offloaded_params(mesh, rank, world_size)
    FusedLamb(params, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0, implementation="torch").step()
    reference = [torch.nn.Parameter(w) for w in _full(0)]
    for p, g in zip(reference, _full(1)):
        p.grad = g
    FusedLamb(reference, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0, implementation="torch").step()
    for got, want in zip(_gathered(params), reference):
        torch.testing.assert_close(got, want.detach())


@pytest.mark.parametrize(
    "worker",
    [_clipping_worker, _overflow_worker, _lamb_worker],
    ids=[
        "clip_grad_norm_over_offloaded_shards",
        "fp16_overflow_flag_of_cpu_gradients",
        "fused_lamb_shard_sums_and_launcher_gather",
    ],
)
def test_cpu_collectives_of_an_offloading_gpu_run_work_over_the_group_started_on_cuda(worker):
    run_distributed(worker, 2, start_group=False)


def _backend_worker(rank, world_size):
    backend = _start_as_on_cuda(rank, world_size)
    assert backend == "cpu:gloo,cuda:nccl"
    world = backend_serving("cpu"), backend_serving("cuda")
    assert world == ("gloo", "gloo"), world  # emulated: cuda's NCCL is gloo bound to CUDA tensors
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))  # HSDP's mesh
    for dim in ("replicate", "shard"):
        assert backend_serving("cpu", mesh.get_group(dim)) == "gloo", dim
    barrier()  # both adapters' barrier: over gloo, no device named
    sub = dist.new_group([0, 1])
    if rank in (0, 1):
        assert backend_serving("cpu", sub) == "gloo"


def test_default_group_on_cuda_serves_cpu_tensors_and_so_do_the_groups_made_from_it():
    run_distributed(_backend_worker, 4, start_group=False)


def _user_nccl_group_worker(rank, world_size):
    with emulated_nccl():
        dist.init_process_group("nccl", rank=rank, world_size=world_size)  # the script's own, before the strategy
    with pytest.raises(RuntimeError, match=r"serves no CPU tensors.*cpu:gloo,cuda:nccl"):
        _start_as_on_cuda(rank, world_size, offloads=True)
    _start_as_on_cuda(rank, world_size, offloads=False)  # nothing CPU-side is communicated without offload
    dist.destroy_process_group()  # the runner's closing barrier would be a CPU collective


def test_a_group_started_before_the_strategy_without_a_cpu_backend_is_refused_with_offload():
    run_distributed(_user_nccl_group_worker, 2, start_group=False)


def _one_gpu_lamb_worker(rank, world_size):
    with emulated_nccl():
        dist.init_process_group("nccl", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (1,))
    params = _offloaded_params(mesh, 0, 1)
    FusedLamb(params, lr=1e-2, implementation="torch").step()  # one rank: nothing to sum, no collective
    assert all(torch.isfinite(p.full_tensor()).all() for p in params)
    dist.destroy_process_group()  # the runner's closing barrier would be a CPU collective


def test_fused_lamb_on_one_rank_issues_no_collective():
    run_distributed(_one_gpu_lamb_worker, 1, start_group=False)


@pytest.mark.parametrize("backend", ["nccl", "cuda:nccl"])
def test_a_named_backend_without_cpu_is_refused_with_offload_before_the_group_starts(backend):
    from lightning_zero.adapters.launch_checks import check_backend_serves_offload
    from lightning_zero.distributed.config import ZeroConfig
    from lightning_zero.offload.nvme_config import NvmeConfig

    with pytest.raises(ValueError, match=r"serves no CPU tensors.*cpu:gloo,cuda:nccl"):
        check_backend_serves_offload(backend, ZeroConfig(stage=3, offload="cpu"))
    with pytest.raises(ValueError, match="serves no CPU tensors"):
        check_backend_serves_offload(
            backend, ZeroConfig(stage=2, offload_optimizer="nvme", nvme=NvmeConfig(nvme_path="/tmp"))
        )
    check_backend_serves_offload(backend, ZeroConfig(stage=3))
    check_backend_serves_offload("cpu:gloo,cuda:nccl", ZeroConfig(stage=3, offload="cpu"))
    check_backend_serves_offload("gloo", ZeroConfig(stage=3, offload="cpu"))


def test_zero_strategy_refuses_a_cuda_only_backend_with_offload_at_construction():
    from lightning_zero import ZeroStrategy

    with pytest.raises(ValueError, match="serves no CPU tensors"):
        ZeroStrategy(stage=3, offload="cpu", process_group_backend="cuda:gloo")
    ZeroStrategy(stage=3, process_group_backend="cuda:gloo")


@pytest.mark.parametrize(
    "asked, started",
    [
        ("nccl", "cuda:gloo"),
        ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:gloo"),
        (None, "cpu:gloo,cuda:gloo"),
        ("gloo", "cpu:gloo,cuda:gloo"),
    ],
)
def test_the_emulation_binds_gloo_to_the_devices_nccl_serves(asked, started):
    assert emulated_backend(asked) == started


@pytest.mark.slow
@pytest.mark.parametrize("adapter", ["trainer", "fabric"])
def test_stage3_cpu_offload_with_clipping_fp16_and_lamb_trains_over_the_group_started_on_cuda(adapter, tmp_path):
    """The whole first run of a GPU user (``day_one_script.py``), started as on a GPU, trains to the weights of the
    same run over plain gloo."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    weights = {}
    for mode in ("plain", "as_on_cuda"):
        out = tmp_path / f"{mode}.pt"
        command = [sys.executable, "-m", "tests.emulation.day_one_script", adapter, str(out)]
        result = subprocess.run(
            command + (["--as-on-cuda"] if mode == "as_on_cuda" else []),
            cwd=root,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"},
        )
        assert result.returncode == 0 and "finished" in result.stdout, result.stderr[-4000:]
        weights[mode] = torch.load(out, weights_only=True)
    assert weights["plain"].keys() == weights["as_on_cuda"].keys()
    for name, value in weights["plain"].items():
        assert torch.isfinite(value).all(), name
        torch.testing.assert_close(weights["as_on_cuda"][name], value, rtol=0, atol=0)
