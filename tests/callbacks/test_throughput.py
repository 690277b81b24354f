import csv
import os
import time
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero.callbacks.throughput import (
    RankInterval,
    ThroughputLogger,
    ThroughputSettings,
    default_batch_size,
    default_token_count,
    peak_memory_bytes,
    report_table,
    summarize,
)
from lightning_zero.diagnostics.timing import CollectiveTimer, collective_timer
from lightning_zero.estimate.flops import compute_dtype_for_precision, measure_flops, mfu, peak_flops_for
from tests.ranks import run_distributed

D_IN, HIDDEN, D_OUT = 8, 16, 4


def mlp_train_flops(batch):
    """Hand count for Linear(D_IN,HIDDEN)-ReLU-Linear(HIDDEN,D_OUT), input without grad.

    forward: 2*B*(D_IN*H + H*D_OUT); backward: layer 2 grad_input and grad_weight (2 * 2*B*H*D_OUT), layer 1 only
    grad_weight (2*B*D_IN*H) since the input needs no gradient.
    """
    return 2 * batch * (D_IN * HIDDEN + HIDDEN * D_OUT) + 4 * batch * HIDDEN * D_OUT + 2 * batch * D_IN * HIDDEN


def test_measure_flops_matches_hand_count_for_mlp():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, D_OUT))
    x = torch.randn(5, D_IN)
    assert measure_flops(lambda: net(x).sum().backward()) == mlp_train_flops(5)


def test_peak_table_and_precision_mapping():
    assert peak_flops_for("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4e12)
    assert peak_flops_for("NVIDIA H100 PCIe", "bf16") == pytest.approx(756.5e12)
    assert peak_flops_for("NVIDIA H200", "tf32") == pytest.approx(494.7e12)
    assert peak_flops_for("NVIDIA A100-SXM4-80GB", "fp32") == pytest.approx(19.5e12)
    assert peak_flops_for("NVIDIA A10G", "bf16") is None  # not in the table: not confused with A10 or A100
    assert peak_flops_for("Tesla V100-SXM2-32GB", "bf16") is None
    assert peak_flops_for("cpu", "fp32") is None
    with pytest.raises(ValueError, match="compute_dtype must be one of"):
        peak_flops_for("NVIDIA H100", "fp8")
    assert compute_dtype_for_precision("bf16-mixed") == "bf16"
    assert compute_dtype_for_precision("16-mixed") == "fp16"
    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert compute_dtype_for_precision("32-true") == "tf32"
        torch.set_float32_matmul_precision("highest")
        assert compute_dtype_for_precision("32-true") == "fp32"
    finally:
        torch.set_float32_matmul_precision(previous)
    assert mfu(50e12, 100e12) == 0.5


def test_settings_validation_names_allowed_values():
    with pytest.raises(ValueError, match="log_every_n_steps must be >= 1"):
        ThroughputSettings(log_every_n_steps=0)
    with pytest.raises(ValueError, match="positive multiple of log_every_n_steps"):
        ThroughputSettings(log_every_n_steps=4, table_every_n_steps=6)
    with pytest.raises(ValueError, match="peak_flops must be positive"):
        ThroughputLogger(peak_flops=0)
    with pytest.raises(ValueError, match="flops_per_batch must be a positive number"):
        ThroughputLogger(flops_per_batch=-1)


def test_batch_helpers_and_memory():
    assert default_batch_size((torch.zeros(3, 2), torch.zeros(3))) == 3
    assert default_batch_size({"ids": torch.zeros(7, 5, dtype=torch.long)}) == 7
    assert default_token_count({"ids": torch.zeros(7, 5, dtype=torch.long)}) == 35
    assert default_token_count((torch.zeros(7, 5),)) is None  # float features are not tokens
    with pytest.raises(ValueError, match="batch_size_fn"):
        default_batch_size(["no tensors"])
    assert peak_memory_bytes(torch.device("cpu")) > 10 * 2**20


def _interval(rank, seconds, forward, samples=8.0, local_collective=0.0, backward=0.0):
    return RankInterval(
        rank=rank,
        samples=samples,
        tokens=0,
        has_tokens=0,
        steps=2,
        seconds=seconds,
        data=0.0,
        forward=forward,
        backward=backward,
        optimizer=0.0,
        collective=local_collective,
        local_collective=local_collective,
        peak_memory_bytes=1e9,
        flops=4e9,
    )


def test_summarize_sums_rates_and_names_straggler():
    # Equal step times (DDP syncs them) but rank 2 spends its time in forward while the others wait in backward.
    ranks = [
        _interval(0, 1.0, 0.1, backward=0.9),
        _interval(1, 1.0, 0.12, backward=0.88),
        _interval(2, 1.0, 0.9, backward=0.1),
    ]
    report = summarize(ranks, peak_flops=1e10)
    assert report.samples_per_sec == pytest.approx(24.0)
    assert report.step_time_median == pytest.approx(0.5)
    assert report.stragglers == [2] and "rank 2" in report.straggler_message
    assert report.flops_per_sec_per_device == pytest.approx(4e9)
    assert report.mfu == pytest.approx(0.4)
    # A wait the strategy reported inside forward is not compute: no straggler then.
    ranks[2] = _interval(2, 1.0, 0.9, local_collective=0.78, backward=0.1)
    assert summarize(ranks, peak_flops=None).stragglers == []
    assert summarize(ranks, peak_flops=None).mfu is None


def test_collective_timer_records_only_when_enabled():
    timer = CollectiveTimer()
    with timer.record("all_reduce"):
        pass
    timer.add("x", 1.0)
    assert timer.take() == []
    timer.enable()
    with timer.record("all_reduce"):
        time.sleep(0.01)
    timer.add("reduce_scatter", 0.5)
    records = timer.take()
    assert [r.name for r in records] == ["all_reduce", "reduce_scatter"]
    assert records[0].resolve() >= 0.01 and records[1].resolve() == 0.5
    assert timer.take() == []
    with pytest.raises(ValueError, match="seconds must be >= 0"):
        timer.add("x", -1)
    timer.disable()
    assert not timer.enabled


class SleepyMLP(LightningModule):
    """Tiny MLP whose training_step sleeps (rank 1 longer) and reports one collective wait."""

    def __init__(self, base_sleep=0.01, slow_rank=1, slow_sleep=0.08):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, D_OUT))
        self.base_sleep, self.slow_rank, self.slow_sleep = base_sleep, slow_rank, slow_sleep

    def training_step(self, batch, batch_idx):
        x, y = batch
        time.sleep(self.base_sleep + (self.slow_sleep if self.global_rank == self.slow_rank else 0.0))
        with collective_timer().record("probe_all_reduce"):
            dist.all_reduce(torch.zeros(1))
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _throughput_worker(rank, world_size, tmp_dir):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(36, D_IN), torch.randn(36, D_OUT))  # 18 per rank: batches 4,4,4,4,2
    callback = ThroughputLogger(
        log_every_n_steps=1, table_every_n_steps=2, peak_flops=1e9, length_fn=lambda batch: 3 * batch[0].shape[0]
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_epochs=1,
        accumulate_grad_batches=2,
        logger=CSVLogger(tmp_dir, name="run"),
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(SleepyMLP(), DataLoader(data, batch_size=4))

    reports = callback.reports
    assert len(reports) == 3  # optimizer steps after batches 2, 4 and the leftover 5th
    # Gradient accumulation and the short last batch: every sample of every rank is counted once.
    for r in range(world_size):
        assert [rep.ranks[r].samples for rep in reports] == [8, 8, 2]
        assert sum(rep.ranks[r].tokens for rep in reports) == 3 * 18
    for rep in reports:
        rates = [x.samples / x.seconds for x in rep.ranks]
        assert rep.samples_per_sec == pytest.approx(sum(rates))
        assert rep.tokens_per_sec == pytest.approx(3 * rep.samples_per_sec)
        # FLOPs measured once by FlopCounterMode on the real DDP model, then scaled by batch size.
        for x in rep.ranks:
            assert x.flops == pytest.approx(mlp_train_flops(x.samples))
        assert rep.mfu == pytest.approx(rep.flops_per_sec_per_device / 1e9)
        # Phases add up to the step and contain the sleeps; the reported collective wait is attributed.
        assert rep.step_time_min > 0.01
        assert rep.phase_time["forward"] >= 0.01
        assert rep.phase_time["collective"] > 0
        assert 1 in rep.stragglers and 0 not in rep.stragglers
    # Straggler rank named in a warning on rank 0.
    if rank == 0:
        messages = [str(w.message) for w in caught if "straggler" in str(w.message)]
        assert messages and "rank 1" in messages[0]
        rows = list(csv.DictReader(open(f"{tmp_dir}/run/version_0/metrics.csv")))
        logged = [row for row in rows if row.get("throughput/samples_per_sec")]
        assert len(logged) == 3
        for row, rep in zip(logged, reports):
            assert float(row["throughput/samples_per_sec"]) == pytest.approx(rep.samples_per_sec)
            tflops = float(row["throughput/tflops_per_device"])
            assert float(row["throughput/mfu"]) == pytest.approx(tflops * 1e12 / 1e9)
            assert float(row["throughput/straggler_rank"]) == 1
            for key in (
                "tokens_per_sec",
                "step_time_median",
                "forward_time",
                "backward_time",
                "optimizer_time",
                "collective_time",
                "peak_memory_gb_max",
                "step_time_max",
            ):
                assert float(row[f"throughput/{key}"]) > 0, key


def test_throughput_logger_two_rank_ddp(tmp_path):
    run_distributed(_throughput_worker, 2, str(tmp_path))


def _zero_strategy_worker(rank, world_size, stage=1):
    from lightning_zero import ZeroStrategy
    from tests.lightning_models import RegressionModule

    callback = ThroughputLogger(log_every_n_steps=1, peak_flops=1e9)
    trainer = Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=ZeroStrategy(stage=stage),
        max_steps=3,
        logger=False,
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    trainer.fit(RegressionModule(batch_size=4))
    assert len(callback.reports) == 3
    for report in callback.reports:
        assert report.samples_per_sec > 0 and report.flops_per_sec_per_device > 0
        if stage == 1:  # ZeroStrategy reports the stage-1 parameter broadcast it issues after each optimizer step
            assert report.phase_time["collective"] > 0
        else:  # FSDP2's all-gathers and reduce-scatters are not timed: no figure rather than a near-zero one
            assert "collective" not in report.phase_time
            assert "throughput/collective_time" not in report.metrics()
            assert "throughput/forward_time" in report.metrics()
            assert "n/m" in _rendered(report_table(report, 3))


def _rendered(table):
    from rich.console import Console

    console = Console(width=200, record=True, file=open(os.devnull, "w"))
    console.print(table)
    return console.export_text()


@pytest.mark.parametrize("stage", [1, 2])
def test_throughput_logger_reads_zero_strategy_collectives(stage):
    run_distributed(_zero_strategy_worker, 2, stage)


class _FakeCudaMemory:
    """Stands in for the CUDA allocator's counters: what is allocated now and the peak since the last reset."""

    def __init__(self):
        self.allocated = self.peak = 0

    def allocate(self, nbytes):
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    def max_memory_allocated(self, device=None):
        return self.peak

    def reset_peak_memory_stats(self, device=None):
        self.peak = self.allocated


def test_each_interval_reports_its_own_cuda_peak(monkeypatch):
    memory = _FakeCudaMemory()
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", memory.max_memory_allocated)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", memory.reset_peak_memory_stats)
    memory.allocate(5000)  # before training: not part of any interval's peak...
    memory.allocate(-4000)  # ...once freed (1000 stay allocated)
    callback = ThroughputLogger(peak_flops=1e12)
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 0)), precision="32-true")
    callback.setup(trainer, None, "fit")
    callback.on_train_start(trainer, None)
    try:
        memory.allocate(3000)
        memory.allocate(-3000)
        assert callback._local_interval(0).peak_memory_bytes == 4000
        callback._reset_interval()  # what each flush does after combining the interval
        memory.allocate(500)
        assert callback._local_interval(0).peak_memory_bytes == 1500  # not 4000: the first interval's peak is gone
    finally:
        callback.on_train_end(trainer, None)


class _OneBigStepMLP(LightningModule):
    """Touches BIG_BYTES of memory in its first training step only."""

    BIG_BYTES = 256 * 2**20

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(D_IN, D_OUT)

    def training_step(self, batch, batch_idx):
        if batch_idx == 0:
            big = torch.ones(self.BIG_BYTES // 4)  # written, so resident; freed at the end of the step
            assert big.sum() > 0
        return F.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc peak-RSS reset")
def test_each_interval_reports_its_own_cpu_peak():
    data = TensorDataset(torch.randn(16, D_IN), torch.randn(16, D_OUT))
    callback = ThroughputLogger(log_every_n_steps=2, table_every_n_steps=None, peak_flops=1e9)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=4,
        logger=False,
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(_OneBigStepMLP(), DataLoader(data, batch_size=4))
    first, second = (report.peak_memory_bytes_max for report in callback.reports)
    assert first - second > _OneBigStepMLP.BIG_BYTES // 2, (first, second)
