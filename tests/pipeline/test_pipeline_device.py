"""Where ``build_pipeline`` puts the stages when it is not given a device."""

from types import SimpleNamespace

import pytest
import torch

from lightning_zero.pipeline import schedules


@pytest.fixture
def built_on(monkeypatch):
    """Calls build_pipeline on a fake 1-D mesh of a device type, on a machine that claims CUDA device 1 is current,
    and returns the device the runner was given."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(schedules, "PipelineRunner", lambda module, pp, dp, config, device: device)

    def build(device_type):
        return schedules.build_pipeline(torch.nn.Linear(2, 2), SimpleNamespace(ndim=1, device_type=device_type))

    return build


def test_a_cpu_mesh_stays_on_cpu_where_a_gpu_exists(built_on):
    assert built_on("cpu") == torch.device("cpu")


def test_a_cuda_mesh_runs_on_the_current_cuda_device(built_on):
    assert built_on("cuda") == torch.device("cuda", 1)
