"""A rank hung anywhere (training step, validation step, checkpoint save, checkpoint load) ends the job within
hang_timeout + 30 s, naming the rank, with every rank's Python stacks: ZeroStrategy's default watchdog."""

import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_zero import ZeroStrategy
from lightning_zero.diagnostics.hang_guard import DEFAULT_HANG_TIMEOUT, HangGuard, parse_hang_timeout
from lightning_zero.diagnostics.watchdog import HANG_EXIT_CODE, HangWatchdog
from tests.reliability.hang_job import HANG_TIMEOUT

REPO = Path(__file__).resolve().parents[2]

# case -> (the phase the watchdog must report for rank 1, a frame the hung rank's stack must show). Every case ends
# with both ranks dumping: in teardown rank 0 waits for rank 1 in the pending-saves agreement (a collective).
CASES = {
    "train": ("training_step 1", "training_step"),
    "validation": ("validation_step 1", "validation_step"),
    "save": ("save", "write_data"),
    "load": ("load", "read_data"),
    "teardown": ("teardown", "hanging_wait"),
}


def _run_hang_jobs(cases, tmp_path):
    """Run one job per case side by side (their ranks mostly sleep); check each ends in time naming rank 1."""
    procs, finished, logs = {}, {}, {}
    for case in cases:
        (tmp_path / case).mkdir()
        logs[case] = tmp_path / case / "stderr.txt"
        with open(logs[case], "w") as log:  # a file, not a pipe: a full pipe would block the job
            procs[case] = subprocess.Popen(
                [sys.executable, "-m", "tests.reliability.hang_job", case, str(tmp_path / case)],
                cwd=REPO,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
    deadline = time.time() + HANG_TIMEOUT + 150
    while len(finished) < len(procs) and time.time() < deadline:
        for case, proc in procs.items():
            if case not in finished and proc.poll() is not None:
                finished[case] = time.time()
        time.sleep(0.2)
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
    for case in cases:
        phase, frame = CASES[case]
        err, proc = logs[case].read_text(), procs[case]
        assert case in finished, f"the job with a rank hung in {case} did not end: {err[-3000:]}"
        assert proc.returncode != 0 and f"exit code {HANG_EXIT_CODE}" in err, (case, err[-3000:])
        verdicts = [line for line in err.splitlines() if "aborting: lightning-zero hang watchdog" in line]
        ranks = 2
        assert len(verdicts) == ranks, (case, err[-4000:])  # every rank still in the run received the verdict
        assert "Ranks that never arrived: [1]" in verdicts[0], verdicts[0]
        assert f"rank 1: {phase}" in verdicts[0], verdicts[0]
        # Every rank dumped its Python stacks; the hung rank's shows where it sleeps.
        assert err.count("Python stacks:") == ranks, (case, err[-4000:])
        assert "_hang_here" in err and frame in err, case
        # From the moment rank 1 hung to the job's end.
        hung_at = float((tmp_path / case / "hang_started").read_text())
        assert finished[case] - hung_at < HANG_TIMEOUT + 30, (case, finished[case] - hung_at)


def test_rank_hung_inside_a_checkpoint_save_is_named_with_stacks(tmp_path):
    """The case the issue found undetected: a rank stuck in DCP's write while the other waits in the save."""
    _run_hang_jobs(["save"], tmp_path)


@pytest.mark.slow
def test_hung_rank_anywhere_is_named_with_stacks_within_timeout(tmp_path):
    _run_hang_jobs(sorted(CASES), tmp_path)


def test_a_rank_that_left_the_run_is_never_named():
    """Rank 0 finished (its watchdog stopped) while rank 1 is stuck in teardown: rank 1 is the one named."""
    store, exits = dist.HashStore(), []
    finished = HangWatchdog(store, 0, 2, timeout=60, poll_interval=0.05)
    finished.arm("training_step 0")
    finished.start()
    time.sleep(0.2)  # published while armed
    finished.disarm("training_step 0: done")
    finished.stop()
    stuck = HangWatchdog(store, 1, 2, timeout=0.3, poll_interval=0.05, grace=0.1, on_exit=exits.append)
    stuck.arm("teardown")
    stuck.start()
    deadline = time.monotonic() + 5
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    stuck.stop()
    assert exits == [HANG_EXIT_CODE]
    assert "Ranks that never arrived: [1]" in stuck.hang_message, stuck.hang_message


def test_hang_timeout_is_validated_in_the_constructor():
    assert ZeroStrategy().hang_guard.timeout == DEFAULT_HANG_TIMEOUT
    assert ZeroStrategy(hang_timeout=timedelta(minutes=2)).hang_guard.timeout == 120.0
    assert ZeroStrategy(hang_timeout=None).hang_guard.timeout is None
    for bad, error in (
        (0, ValueError),
        (-1.0, ValueError),
        (float("inf"), ValueError),
        ("600", TypeError),
        (True, TypeError),
        (timedelta(0), ValueError),
    ):
        with pytest.raises(error, match="hang_timeout"):
            ZeroStrategy(hang_timeout=bad)
    assert parse_hang_timeout(5) == 5.0


def test_guard_off_is_inert():
    guard = HangGuard(None)
    guard.start(0, 1)
    guard.step("training_step")
    guard.beat("backward")
    with guard.phase("save"), guard.teardown():
        pass
    assert guard.watchdog is None


def _one_watchdog_worker(rank, world_size):
    import threading

    from lightning.pytorch import Callback, Trainer

    from lightning_zero.callbacks.diagnostics import NCCLDiagnostics
    from tests.lightning_models import RegressionModule

    diagnostics = NCCLDiagnostics(audit=False, probe=False, hang_timeout=120)
    seen = []

    class Check(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            # one watchdog: its polling thread (the store-silence thread beside it is named "-store-")
            threads = [
                t
                for t in threading.enumerate()
                if t.name.startswith("lightning-zero-watchdog") and "-store-" not in t.name
            ]
            seen.append(
                (
                    diagnostics.watchdog is trainer.strategy.hang_guard.watchdog,
                    len(threads),
                    diagnostics.watchdog.timeout,
                )
            )

    trainer = Trainer(
        strategy=ZeroStrategy(stage=2),
        accelerator="cpu",
        devices=2,
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        callbacks=[diagnostics, Check()],
    )
    trainer.fit(RegressionModule())
    assert seen == [(True, 1, 120.0)] * 2, seen  # the callback drives the strategy's watchdog, with its timeout
    assert diagnostics.watchdog is None and trainer.strategy.hang_guard.watchdog is None  # both stopped


def test_diagnostics_callback_adopts_the_strategy_watchdog():
    from tests.ranks import run_distributed

    run_distributed(_one_watchdog_worker, 2)
