"""The measuring tools on one CUDA device: ``ThroughputLogger``'s figures under ZeroStrategy (a peak memory for
every logging interval, from the CUDA allocator) and ``lightning-zero advise --measure`` on a tiny GPT.

Runs as `python -m pytest tests/gpu -q` on a machine with a GPU; skipped cleanly elsewhere.
"""

import pytest
import torch
from lightning.pytorch import Trainer

from lightning_zero import ZeroStrategy
from lightning_zero.callbacks.throughput import ThroughputLogger
from lightning_zero.cli import main as cli_main
from tests.gpu.single_device import (
    DEVICE,
    TRAINER_ACCELERATOR,
    assert_device_backend,
    end_process_group,
    needs_device,
    start_one_rank,
)
from tests.lightning_models import RegressionModule

pytestmark = needs_device


@pytest.fixture(autouse=True)
def one_rank(monkeypatch):
    start_one_rank(monkeypatch)
    yield
    end_process_group()


def test_throughput_logger_reports_every_interval_with_its_peak_memory():
    if DEVICE == "cuda":  # the peaks below are this fit's, not an earlier test's in this process
        torch.cuda.reset_peak_memory_stats()
    throughput = ThroughputLogger(log_every_n_steps=2, table_every_n_steps=None)
    trainer = Trainer(
        accelerator=TRAINER_ACCELERATOR,
        devices=1,
        strategy=ZeroStrategy(stage=3),
        max_steps=6,
        logger=False,
        callbacks=[throughput],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(RegressionModule(batch_size=8))
    assert_device_backend()
    assert len(throughput.reports) == 3  # steps 2, 4 and 6
    for report in throughput.reports:
        assert [r.rank for r in report.ranks] == [0]
        assert report.ranks[0].peak_memory_bytes > 0 and report.peak_memory_bytes_max > 0
        assert report.samples_per_sec > 0 and report.step_time_median > 0
    if DEVICE == "cuda":  # the allocator's peak, which the logger never resets: it can only grow, up to now's
        peaks = [report.peak_memory_bytes_max for report in throughput.reports]
        assert peaks == sorted(peaks) and peaks[-1] <= torch.cuda.max_memory_allocated()


def test_advise_measure_runs_a_tiny_gpt(tmp_path, capsys):
    code = cli_main(
        [
            "advise",
            "--model",
            "tests.advise_models:TinyGPT",
            "--devices",
            "1",
            "--accelerator",
            DEVICE,
            "--micro-batch",
            "2",
            "--measure",
            "--max-candidates",
            "1",
            "--steps",
            "2",
            "--output-dir",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    # a winner is named only among rungs that trained (a failed rung's row says "error: ..." or "does not fit")
    assert code == 0 and "winner (fastest measured)" in out, out
    assert (tmp_path / "advise.yaml").is_file()
