"""The decisions the CUDA-only branches make, run on CPU with ``torch.cuda`` monkeypatched.

Each branch here only chooses (a device, a backend, a process count, a pin flag, a peak FLOP/s) or records; the work
it hands to torch runs on the GPU in ``tests/gpu``. What is faked is named in each test.
"""

import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lightning_zero.cli import build_parser
from lightning_zero.cli import main as cli_main


@pytest.fixture
def cuda_here(monkeypatch):
    """A machine that reports four CUDA devices, the third one current (nothing runs on them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)


@pytest.fixture
def no_cuda_here(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_launch_starts_one_process_per_cuda_device(cuda_here, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli_main(["launch", "--dry_run", "train.py"]) == 0
    assert "--nproc-per-node=4" in capsys.readouterr().out.split()


def test_launch_without_cuda_asks_for_the_process_count(no_cuda_here, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli_main(["launch", "--dry_run", "train.py"]) == 1
    assert "no CUDA device here" in capsys.readouterr().err


def test_diagnose_picks_nccl_with_cuda_and_refuses_it_without(monkeypatch):
    from lightning_zero.cli.diagnose import _options

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _options(build_parser().parse_args(["diagnose"]))["backend"] == "nccl"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _options(build_parser().parse_args(["diagnose"]))["backend"] == "gloo"
    with pytest.raises(SystemExit, match="--backend nccl needs CUDA"):
        _options(build_parser().parse_args(["diagnose", "--backend", "nccl"]))


def test_probes_run_on_the_current_cuda_device_under_nccl(cuda_here, monkeypatch):
    from lightning_zero.diagnostics import probes

    # NCCL alone, and beside gloo in the group the strategy starts on CUDA: the probe measures NCCL either way
    for config in ("cuda:nccl", "cpu:gloo,cuda:nccl"):
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None, config=config: config)
        assert probes._probe_device(None) == torch.device("cuda", 2), config
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:gloo")
    assert probes._probe_device(None) == torch.device("cpu")


def test_apply_zero_default_device_follows_the_mesh(cuda_here):
    from lightning_zero.distributed.apply_zero import _mesh_device

    assert _mesh_device(SimpleNamespace(device_type="cuda")) == torch.device("cuda", 2)
    assert _mesh_device(SimpleNamespace(device_type="cpu")) == torch.device("cpu")


def test_parameter_offload_pins_only_on_cuda():
    from lightning_zero.distributed.apply_zero import _fsdp_kwargs
    from lightning_zero.distributed.config import ZeroConfig

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert _fsdp_kwargs(None, ZeroConfig(stage=3, offload="cpu"), cuda)["offload_policy"].pin_memory is True
    assert _fsdp_kwargs(None, ZeroConfig(stage=3, offload="cpu"), cpu)["offload_policy"].pin_memory is False
    unpinned = _fsdp_kwargs(None, ZeroConfig(stage=3, offload="cpu", pin_memory=False), cuda)
    assert unpinned["offload_policy"].pin_memory is False
    with pytest.raises(ValueError, match="pin_memory=True needs a CUDA device"):
        _fsdp_kwargs(None, ZeroConfig(stage=3, offload="cpu", pin_memory=True), cpu)


class _FakeEvent:
    """Stands in for ``torch.cuda.Event``: a recorded instant on a fake clock (milliseconds, as CUDA's)."""

    clock_ms = 0.0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.at = None

    def record(self, stream=None):
        self.at = _FakeEvent.clock_ms

    def synchronize(self):
        assert self.at is not None, "waited on an event that was never recorded"

    def elapsed_time(self, end):
        return end.at - self.at


def test_collective_timer_times_cuda_collectives_with_events(monkeypatch):
    from lightning_zero.diagnostics.timing import CollectiveTimer, _uses_cuda_events, total_seconds

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    assert _uses_cuda_events("cuda:0") and not _uses_cuda_events("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert _uses_cuda_events(None)  # CUDA in use in this process: events on its current stream
    timer = CollectiveTimer()
    timer.enable()
    with timer.record("all_reduce", device=torch.device("cuda", 0)):
        _FakeEvent.clock_ms += 250.0
    (record,) = timer.take()
    assert record.start_event is not None and record.seconds is None  # resolved only when read
    assert total_seconds([record]) == pytest.approx(0.25)


def test_throughput_peak_flops_come_from_the_gpu_name(monkeypatch):
    from lightning_zero.callbacks.throughput import ThroughputLogger
    from lightning_zero.estimate.flops import peak_flops_for

    trainer = SimpleNamespace(
        strategy=SimpleNamespace(root_device=torch.device("cuda", 0)), precision="bf16-mixed", is_global_zero=True
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    callback = ThroughputLogger()
    callback.setup(trainer, None, "fit")
    assert callback._peak == peak_flops_for("NVIDIA H100 80GB HBM3", "bf16") > 0
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    with pytest.warns(UserWarning, match="no peak FLOP/s known for 'Some Future GPU'"):
        ThroughputLogger().setup(trainer, None, "fit")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        given = ThroughputLogger(peak_flops=1e12)
        given.setup(trainer, None, "fit")  # the argument wins: no lookup, no warning
    assert given._peak == 1e12


def test_audit_warns_about_gloo_where_cuda_is_available(monkeypatch):
    from lightning_zero.diagnostics.env_audit import audit_environment

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # no device to name or query for peer access
    audit = audit_environment(environ={}, backend="gloo")
    assert any("backend is gloo although CUDA is available" in w for w in audit.warnings)
    assert not any("glibc" in w for w in audit.warnings)  # the CPU-heap advice is for runs that compute on CPU


def test_this_machine_reads_the_smallest_cuda_device(cuda_here, monkeypatch):
    from lightning_zero.cli.ladder import this_machine

    memory = {0: 80 << 30, 1: 40 << 30, 2: 80 << 30, 3: 80 << 30}
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=memory[i]))
    machine = this_machine()
    assert (machine.devices, machine.device_memory, machine.accelerator) == (4, 40 << 30, "cuda")
    assert this_machine(devices=2).devices == 2


def test_advise_for_cuda_without_a_gpu_asks_for_its_memory(no_cuda_here, tmp_path):
    with pytest.raises(SystemExit, match="no CUDA device here to read its memory from: pass --device-memory"):
        cli_main(
            ["advise", "--model", "tests.advise_models:TinyGPT", "--accelerator", "cuda", "--output-dir", str(tmp_path)]
        )


def test_nccl_diagnostics_warns_when_the_nccl_group_already_exists(monkeypatch):
    import os

    from lightning_zero.callbacks import diagnostics

    monkeypatch.setattr(os, "environ", dict(os.environ))  # the flight-recorder variables it sets are dropped after
    monkeypatch.setattr(diagnostics.dist, "is_initialized", lambda: True)
    for config in ("cuda:nccl", "cpu:gloo,cuda:nccl"):
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None, config=config: config)
        with pytest.warns(UserWarning, match="the NCCL process group already exists"):
            diagnostics.NCCLDiagnostics(flight_recorder=True)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:gloo,cuda:gloo")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        diagnostics.NCCLDiagnostics(flight_recorder=True)
