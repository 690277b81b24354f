"""What the one-device GPU tests share: the device they run on, their skip mark, and one process group per test.

Each test trains at world size 1 in the pytest process: the strategy starts the default process group on the device
(NCCL on CUDA; NCCL cannot put two ranks on one GPU, so one GPU means one rank) and the test ends it.

``LZ_GPU_TESTS_DEVICE=cpu`` runs the same bodies on CPU with gloo, so a path is exercised before its first GPU run;
tests/conftest.py skips every test under tests/gpu without CUDA, so such a run also needs ``--noconftest``:

    LZ_GPU_TESTS_DEVICE=cpu python -m pytest --noconftest -q tests/gpu/test_checkpoints_gpu.py
"""

import os

import pytest
import torch
import torch.distributed as dist

from tests.ranks import free_port

DEVICE = os.environ.get("LZ_GPU_TESTS_DEVICE", "cuda")
if DEVICE not in ("cuda", "cpu"):
    raise ValueError(f"LZ_GPU_TESTS_DEVICE must be 'cuda' or 'cpu', got {DEVICE!r}")
TRAINER_ACCELERATOR = "gpu" if DEVICE == "cuda" else "cpu"  # the Trainer's name; Fabric takes DEVICE itself
BACKEND = "nccl" if DEVICE == "cuda" else "gloo"

needs_device = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs CUDA")


def start_one_rank(monkeypatch) -> None:
    """The environment of a one-rank job: the strategy's process group meets on a free local port."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))


def end_process_group() -> None:
    """End the process group a test's Trainer or Fabric started, also when the test failed half-way."""
    if dist.is_initialized():
        dist.destroy_process_group()


def assert_device_backend() -> None:
    """The default group runs the device's backend (it may hold a CPU backend beside it: 'cpu:gloo,cuda:nccl')."""
    assert BACKEND in str(dist.get_backend()), dist.get_backend()


def full_weights(module: torch.nn.Module) -> dict:
    """The module's whole weights on the CPU (DTensor shards gathered), detached copies."""
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone()
        for k, v in module.state_dict().items()
    }


def worst_difference(got: dict, expected: dict) -> float:
    assert set(got) == set(expected), set(got) ^ set(expected)
    return max((got[k].float() - expected[k].float()).abs().max().item() for k in expected)
