import json
import os
import platform
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero.callbacks.diagnostics import DiagnosticsSettings, NCCLDiagnostics
from lightning_zero.cli import main as cli_main
from lightning_zero.diagnostics.byte_sizes import parse_size
from lightning_zero.diagnostics.env_audit import (
    STEADY_HEAP,
    audit_environment,
    audit_text,
    cpu_heap_warnings,
    infiniband_devices,
    nccl_warnings,
)
from lightning_zero.diagnostics.probes import (
    COLLECTIVES,
    ProbeResult,
    algorithm_bandwidth,
    all_gather_json,
    bus_bandwidth,
    bus_bandwidth_factor,
    probe_collectives,
    slow_outliers,
)
from lightning_zero.diagnostics.watchdog import HANG_EXIT_CODE, HangWatchdog, enable_flight_recorder
from tests.ranks import run_distributed

REPO = Path(__file__).resolve().parents[2]


def test_bus_bandwidth_matches_nccl_tests_definitions():
    # 1 GB in 0.1 s: algbw 10 GB/s; busbw = algbw * 2(n-1)/n for all_reduce, (n-1)/n for gathers/scatters.
    assert algorithm_bandwidth(10**9, 0.1) == pytest.approx(1e10)
    assert bus_bandwidth("all_reduce", 10**9, 0.1, 8) == pytest.approx(1e10 * 14 / 8)
    assert bus_bandwidth("all_gather", 10**9, 0.1, 4) == pytest.approx(1e10 * 3 / 4)
    assert bus_bandwidth("reduce_scatter", 10**9, 0.1, 4) == pytest.approx(7.5e9)
    assert bus_bandwidth("all_to_all", 10**9, 0.1, 2) == pytest.approx(5e9)
    assert bus_bandwidth("broadcast", 10**9, 0.1, 16) == pytest.approx(1e10)
    assert bus_bandwidth_factor("all_reduce", 1) == 0.0  # nothing crosses a link with one rank
    with pytest.raises(ValueError, match="collective must be one of"):
        bus_bandwidth_factor("gather", 2)
    with pytest.raises(ValueError, match="seconds must be positive"):
        algorithm_bandwidth(1, 0)


def test_parse_size():
    assert parse_size("1K") == 1024 and parse_size("16M") == 16 << 20 and parse_size("2GiB") == 2 << 30
    assert parse_size("100") == 100 and parse_size(4096) == 4096 and parse_size("1.5k") == 1536
    # KB/MB/GB are decimal, as Hugging Face's max_shard_size; the one-letter suffixes binary, as nccl-tests
    assert parse_size("500MB") == 500 * 10**6 and parse_size("2 GB") == 2 * 10**9 and parse_size("64KiB") == 64 << 10
    for bad in ("abc", "0", "-4K", "MB", 0, True, 1.5, None):
        with pytest.raises(ValueError, match="size must be"):
            parse_size(bad)
    with pytest.raises(ValueError, match="max_shard_size must be"):
        parse_size("lots", "max_shard_size")


def test_slow_outliers_names_rank_and_host():
    fast = ProbeResult(
        "all_reduce", 1024, 3, time_s=1.0, rank_times_s=[1.0, 1.0, 1.0], slowest_rank=0, slowest_host="a"
    )
    slow = ProbeResult(
        "all_gather", 1 << 20, 3, time_s=3.0, rank_times_s=[1.0, 3.0, 1.1], slowest_rank=1, slowest_host="node7"
    )
    skipped = ProbeResult("all_to_all", 1024, 3, error="unsupported on this backend")
    flags = slow_outliers([fast, slow, skipped], tolerance=0.5)
    assert len(flags) == 1 and "rank 1 on host node7" in flags[0] and "all_gather 1M" in flags[0]


def test_nccl_warnings_known_bad_settings():
    assert nccl_warnings({}) == []
    assert nccl_warnings({"NCCL_P2P_DISABLE": "0", "NCCL_DEBUG": "WARN"}) == []
    found = nccl_warnings({"NCCL_P2P_DISABLE": "1"})
    assert len(found) == 1 and "NCCL_P2P_DISABLE=1" in found[0]
    assert any("NCCL_SHM_DISABLE" in w for w in nccl_warnings({"NCCL_SHM_DISABLE": "1"}))
    ib = nccl_warnings({"NCCL_IB_DISABLE": "1"}, has_infiniband=True)
    assert "although InfiniBand devices are present" in ib[0]
    assert any("NCCL_DEBUG=INFO" in w for w in nccl_warnings({"NCCL_DEBUG": "info"}))
    assert any("TORCH_NCCL_BLOCKING_WAIT" in w for w in nccl_warnings({"NCCL_BLOCKING_WAIT": "1"}))
    assert any("P2P_LEVEL" in w for w in nccl_warnings({"NCCL_P2P_LEVEL": "LOC"}))


def test_cpu_heap_warning_only_where_glibc_adjusts_the_heap_of_a_cpu_run():
    """A CPU run under glibc with no heap setting of its own is told the thresholds to fix (docs/stages.md); a GPU
    run, another C library, any glibc thresholds variable or a preloaded allocator is left alone."""
    found = cpu_heap_warnings({}, computes_on_cpu=True, libc="glibc")
    assert len(found) == 1 and "MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=134217728" in found[0]
    assert cpu_heap_warnings({}, computes_on_cpu=False, libc="glibc") == []
    assert cpu_heap_warnings({}, computes_on_cpu=True, libc="") == []  # musl, macOS: platform.libc_ver() says ''
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_"):
        assert cpu_heap_warnings({name: "1048576"}, computes_on_cpu=True, libc="glibc") == []
    assert cpu_heap_warnings(dict(STEADY_HEAP), computes_on_cpu=True, libc="glibc") == []
    # a trim threshold alone pins the mmap threshold at 128 KiB: worse than the default, so it is named
    alone = cpu_heap_warnings({"MALLOC_TRIM_THRESHOLD_": "134217728"}, computes_on_cpu=True, libc="glibc")
    assert len(alone) == 1 and "without MALLOC_MMAP_THRESHOLD_" in alone[0] and "=33554432" in alone[0]
    preload = {"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}
    assert cpu_heap_warnings(preload, computes_on_cpu=True, libc="glibc") == []


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or torch.cuda.is_available(), reason="a CPU host with glibc")
def test_audit_of_a_gloo_run_on_cpu_names_the_heap_settings(tmp_path):
    audit = audit_environment(environ={"WORLD_SIZE": "2"}, backend="gloo", infiniband_root=tmp_path)
    assert any("glibc's default heap" in w for w in audit.warnings)
    assert "WARNING: training on CPU under glibc's default heap" in audit_text(audit)
    steady = audit_environment(environ=dict(STEADY_HEAP), backend="gloo", infiniband_root=tmp_path)
    assert not any("glibc" in w for w in steady.warnings)
    assert steady.variables == STEADY_HEAP  # shown with the run's other variables
    assert not any("glibc" in w for w in audit_environment(environ={}, backend="nccl").warnings)


def test_audit_environment_reports_variables_and_infiniband(tmp_path):
    port = tmp_path / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
    (port / "link_layer").write_text("InfiniBand\n")
    env = {
        "NCCL_P2P_DISABLE": "1",
        "NCCL_IB_DISABLE": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "HOME": "/root",
        "WORLD_SIZE": "16",
        "LOCAL_WORLD_SIZE": "8",
    }
    audit = audit_environment(environ=env, backend="nccl", infiniband_root=tmp_path)
    assert audit.world_size == 16 and audit.local_world_size == 8
    assert set(audit.variables) == {"NCCL_P2P_DISABLE", "NCCL_IB_DISABLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING"}
    assert audit.infiniband == [
        {
            "device": "mlx5_0",
            "ports": [{"port": "1", "state": "4: ACTIVE", "rate": "400 Gb/sec (4X NDR)", "link_layer": "InfiniBand"}],
        }
    ]
    assert any("NCCL_P2P_DISABLE=1" in w for w in audit.warnings)
    assert any("although InfiniBand devices are present" in w for w in audit.warnings)
    text = audit_text(audit)
    assert "WARNING: NCCL_P2P_DISABLE=1" in text and "mlx5_0" in text and "torch=" in text
    assert infiniband_devices(tmp_path / "missing") == []
    json.dumps(audit.to_dict())  # the CLI writes it as JSON


def test_flight_recorder_variables_keep_user_values(monkeypatch, tmp_path):
    for name in (
        "TORCH_FR_BUFFER_SIZE",
        "TORCH_NCCL_TRACE_BUFFER_SIZE",
        "TORCH_NCCL_DUMP_ON_TIMEOUT",
        "TORCH_FR_DUMP_TEMP_FILE",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    set_now = enable_flight_recorder(1234, str(tmp_path / "fr"))
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in set_now and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    buffer_var = set_now[0]
    assert buffer_var in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
    assert os.environ[buffer_var] == "1234"
    assert os.environ[set_now[1]].startswith(str(tmp_path / "fr"))


def test_settings_validation():
    with pytest.raises(ValueError, match="unknown"):
        DiagnosticsSettings(probe_collectives=("gather",))
    with pytest.raises(ValueError, match="hang_timeout must be positive"):
        DiagnosticsSettings(hang_timeout=0)
    with pytest.raises(ValueError, match="probe_sizes"):
        DiagnosticsSettings(probe_sizes=())


def test_watchdog_names_the_rank_behind_without_processes():
    store = dist.HashStore()
    exits = []
    dog = HangWatchdog(store, rank=0, world_size=3, timeout=0.3, poll_interval=0.05, grace=0.2, on_exit=exits.append)
    store.set("hb/1", "1|train batch 1: forward")  # rank 1 stuck in forward; rank 2 never reported
    dog.arm("train batch 1: forward")
    dog.beat("train batch 1: backward")
    dog.beat("train batch 1: after backward")
    dog.start()
    deadline = time.monotonic() + 5
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    dog.stop()
    assert exits == [HANG_EXIT_CODE]
    assert "never arrived: [1, 2]" in dog.hang_message and "rank 1: train batch 1: forward" in dog.hang_message
    # Disarmed time (validation, checkpointing) is never limited.
    calm = HangWatchdog(dist.HashStore(), 0, 1, timeout=0.1, poll_interval=0.02, on_exit=exits.append)
    calm.arm("batch 0")
    calm.disarm("batch 0 done")
    calm.start()
    time.sleep(0.3)
    calm.stop()
    assert calm.hang_message is None and len(exits) == 1


class TinyModule(LightningModule):
    def __init__(self, hang_rank=None):
        super().__init__()
        self.net = nn.Linear(4, 2)
        self.hang_rank = hang_rank

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.hang_rank and batch_idx == 1:
            time.sleep(3600)  # the injected hang
        return F.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(world_size, callbacks, **kwargs):
    return Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=DDPStrategy(process_group_backend="gloo"),
        logger=False,
        callbacks=callbacks,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def _data():
    return DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 2)), batch_size=2)


def _probe_and_callback_worker(rank, world_size):
    # Framework-free probe: every collective gloo offers, bandwidths by the nccl-tests formulas.
    results = probe_collectives(COLLECTIVES, [1024, 4096], iters=2, warmup=1)
    assert [(r.collective, r.size_bytes) for r in results] == [(c, s) for c in COLLECTIVES for s in (1024, 4096)]
    for r in results:
        if r.error is not None:
            assert r.error.startswith("unsupported on this backend")
            continue
        assert len(r.rank_times_s) == world_size and r.time_s == max(r.rank_times_s) > 0
        assert r.algbw == pytest.approx(r.size_bytes / r.time_s)
        assert r.busbw == pytest.approx(r.algbw * bus_bandwidth_factor(r.collective, world_size))
    assert all_gather_json({"rank": rank, "text": "é" * rank}) == [{"rank": r, "text": "é" * r} for r in range(2)]

    # The callback in a DDP fit: audit warns for NCCL_P2P_DISABLE, probe results on every rank, watchdog armed.
    os.environ["NCCL_P2P_DISABLE"] = "1"
    callback = NCCLDiagnostics(
        probe_collectives=("all_reduce", "broadcast"), probe_sizes=(1024,), probe_iters=1, hang_timeout=60
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(world_size, [callback], max_steps=2).fit(TinyModule(), _data())
    assert [r.collective for r in callback.probe_results] == ["all_reduce", "broadcast"]
    assert all(r.busbw > 0 for r in callback.probe_results)
    assert callback.watchdog is None  # stopped at train end
    if rank == 0:
        assert callback.audit.backend == "gloo" and callback.audit.world_size == 2
        assert any("NCCL_P2P_DISABLE=1" in str(w.message) for w in caught)


def test_probe_and_callback_two_ranks():
    run_distributed(_probe_and_callback_worker, 2)


def _hang_worker(rank, world_size, dump_dir):
    callback = NCCLDiagnostics(
        audit=False, probe=False, hang_timeout=3, watchdog_poll_interval=0.25, watchdog_grace=5, dump_dir=dump_dir
    )
    _trainer(world_size, [callback], max_steps=4).fit(TinyModule(hang_rank=1), _data())


def run_hang_job(dump_dir):
    """Entry point of the subprocess in the hang test (rank 1 sleeps forever in its second step)."""
    run_distributed(_hang_worker, 2, dump_dir)


def test_watchdog_turns_injected_hang_into_failure_naming_the_rank(tmp_path):
    dump_dir = tmp_path / "dumps"
    begin = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from tests.diagnostics.test_diagnostics import run_hang_job; run_hang_job({str(dump_dir)!r})",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - begin
    assert proc.returncode != 0
    assert "Ranks that never arrived: [1]" in proc.stderr, proc.stderr[-3000:]
    assert "rank 1: epoch 0 train batch 1: forward" in proc.stderr
    # Every rank dumped its Python stacks; the hung rank's shows where it sleeps.
    for rank in (0, 1):
        assert "Python stacks" in (dump_dir / f"hang_rank{rank}.txt").read_text()
    assert "training_step" in (dump_dir / "hang_rank1.txt").read_text()
    # Start-up (~10 s on a loaded 2-core machine) + 3 s timeout + grace, instead of hanging for an hour.
    assert elapsed < 60


def test_cli_diagnose_spawns_two_ranks_and_writes_json(tmp_path, capsys):
    out = tmp_path / "diag.json"
    code = cli_main(["diagnose", "--nproc-per-node", "2", "--sizes", "1K", "8K", "--iters", "2", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["world_size"] == 2 and report["backend"] == "gloo"
    assert [(p["collective"], p["size_bytes"]) for p in report["probe"]] == [
        (c, s) for c in COLLECTIVES for s in (1024, 8192)
    ]
    assert all(p["busbw"] > 0 for p in report["probe"] if p["error"] is None)
    assert len(report["audits"]) == 1 and report["audits"][0]["versions"]["torch"] == torch.__version__


def test_cli_diagnose_refuses_nproc_under_launcher(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="launcher's job"):
        cli_main(["diagnose", "--nproc-per-node", "2"])


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
def test_cli_diagnose_under_torchrun_no_python(tmp_path):
    out = tmp_path / "diag.json"
    proc = subprocess.run(
        [
            "torchrun",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--no-python",
            "lightning-zero",
            "diagnose",
            "--sizes",
            "1K",
            "--collectives",
            "all_reduce",
            "all_gather",
            "--iters",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "busbw" in proc.stdout
    report = json.loads(out.read_text())
    assert report["world_size"] == 2 and [p["collective"] for p in report["probe"]] == ["all_reduce", "all_gather"]


def test_adopted_watchdog_takes_every_watchdog_setting_of_the_callback():
    """NCCLDiagnostics adopting the strategy's running watchdog applies its poll interval and grace too, not only
    the timeout (a setting the user gave is never dropped)."""
    from lightning_zero.callbacks import NCCLDiagnostics
    from lightning_zero.diagnostics.hang_guard import HangGuard

    guard = HangGuard(600)
    guard.start(0, 1)
    try:
        callback = NCCLDiagnostics(
            audit=False, probe=False, hang_timeout=40, watchdog_poll_interval=0.25, watchdog_grace=2.0
        )
        callback.on_train_start(None, None)
        assert callback.watchdog is guard.watchdog
        assert (guard.watchdog.timeout, guard.watchdog.poll_interval, guard.watchdog.grace) == (40, 0.25, 2.0)
        NCCLDiagnostics(audit=False, probe=False, hang_timeout=8).on_train_start(None, None)
        assert (guard.watchdog.timeout, guard.watchdog.poll_interval, guard.watchdog.grace) == (8, 1.0, 5.0)
    finally:
        guard.stop()
