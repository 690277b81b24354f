"""GPU paths of ThroughputLogger / NCCLDiagnostics / diagnose: CUDA events, allocator stats, peak table, NCCL."""

import json
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero.callbacks.diagnostics import NCCLDiagnostics
from lightning_zero.callbacks.throughput import ThroughputLogger
from lightning_zero.cli import main as cli_main
from lightning_zero.diagnostics.env_audit import audit_environment
from lightning_zero.diagnostics.probes import COLLECTIVES, probe_collectives
from lightning_zero.diagnostics.timing import CollectiveTimer
from lightning_zero.estimate.flops import peak_flops_for


class GpuMLP(LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def test_throughput_logger_on_gpu_uses_events_allocator_and_peak_table(capsys):
    data = TensorDataset(torch.randn(512, 1024), torch.randn(512, 1024))
    throughput = ThroughputLogger(log_every_n_steps=4, table_every_n_steps=8)
    diagnostics = NCCLDiagnostics(probe=False, hang_timeout=120)
    trainer = Trainer(
        accelerator="gpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=8,
        logger=False,
        callbacks=[throughput, diagnostics],
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(GpuMLP(), DataLoader(data, batch_size=64))
    report = throughput.last_report
    name = torch.cuda.get_device_name()
    if peak_flops_for(name, "bf16") is not None:
        assert 0 < report.mfu < 1, (name, report.mfu)
    assert report.flops_per_sec_per_device > 1e9
    assert report.peak_memory_bytes_max >= torch.cuda.max_memory_allocated() * 0.5 > 0
    assert report.phase_time["forward"] > 0 and report.phase_time["backward"] > 0
    out = capsys.readouterr().out
    assert "samples/s" in out  # the rich table
    print(out)


def test_collective_timer_uses_cuda_events():
    timer = CollectiveTimer()
    timer.enable()
    with timer.record("fake_wait", device="cuda"):
        torch.cuda._sleep(10_000_000)
    (record,) = timer.take()
    assert record.start_event is not None and record.resolve() > 0


def test_nccl_probe_single_process():
    store = dist.HashStore()
    dist.init_process_group(
        "nccl", store=store, rank=0, world_size=1, timeout=timedelta(seconds=60), device_id=torch.device("cuda", 0)
    )
    try:
        results = probe_collectives(COLLECTIVES, [1 << 20, 64 << 20], iters=5)
        for r in results:
            assert r.error is None, r.error
            assert r.algbw > 0
        print(json.dumps([r.to_dict() for r in results], indent=1))
    finally:
        dist.destroy_process_group()


def test_audit_sees_gpus():
    audit = audit_environment(backend="nccl")
    count = torch.cuda.device_count()
    assert len(audit.topology["gpus"]) == count and len(audit.topology["peer_access"]) == count
    assert audit.versions["nccl"] is not None


def test_cli_diagnose_nccl(tmp_path):
    out = tmp_path / "diag.json"
    begin = time.monotonic()
    nproc = torch.cuda.device_count()
    assert (
        cli_main(
            [
                "diagnose",
                "--nproc-per-node",
                str(nproc),
                "--backend",
                "nccl",
                "--sizes",
                "1M",
                "64M",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["backend"] == "nccl" and report["world_size"] == nproc
    assert time.monotonic() - begin < 300
