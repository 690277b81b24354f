"""The exit trials count what they claim to (the full count: ``python -m tests.reliability.exit_trials --jobs 200``).

A count of "0 non-zero exits after finishing" is only worth something if a job that finished and then aborted at
interpreter teardown is counted: these tests make jobs do exactly that and check the table says so.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reliability.exit_trials import describe_exit, parse_output, table

ROOT = Path(__file__).resolve().parents[2]

# torchrun's failure summary for a job whose rank 1 aborted after printing its completed line (torch 2.13)
TORCHRUN_SUMMARY = """rank 0: training and final save completed
rank 1: training and final save completed
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
tests.reliability.exit_job FAILED
------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-28_04:51:04
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -6 (pid: 28442)  (SIGABRT)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 28442
======================================================
"""


def test_torchrun_summary_gives_the_finished_ranks_and_each_failed_ranks_signal():
    completed, failures = parse_output(TORCHRUN_SUMMARY)
    assert completed == [0, 1] and failures == {1: -6}
    assert describe_exit(-6) == "SIGABRT" and describe_exit(1) == "exit 1"
    results = [
        {"kind": "trainer", "stage": 2, "finished": True, "exit": 1, "ranks_failed": failures},
        {"kind": "trainer", "stage": 2, "finished": True, "exit": 0, "ranks_failed": {}},
    ]
    assert "| trainer | 2 | 2 | 2 | 1 | 1: SIGABRT | 0 |" in table(results)


@pytest.mark.slow  # one process importing Lightning, two tiny two-rank jobs: ~15 s
def test_a_job_that_aborts_at_teardown_after_finishing_is_counted(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "LZ_EXIT_JOB_ABORT_KIND": "fabric"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.reliability.exit_trials",
            "--jobs",
            "2",
            "--launcher",
            "fork",
            "--root",
            str(tmp_path / "jobs"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    report = result.stdout + result.stderr[-3000:]
    assert result.returncode == 1, report
    # the Trainer job exits 0; the Fabric job finished and then aborted on both ranks
    assert "| trainer | 0 | 1 | 1 | 0 | - | 0 |" in result.stdout, report
    assert "| fabric | 0 | 1 | 1 | 1 | 0: SIGABRT, 1: SIGABRT | 0 |" in result.stdout, report
