"""One of the randomized preemption trials (the full count: ``python -m tests.reliability.preempt_trials --trials
20``): SIGTERM to both ranks aimed at a forward, while rank 0's async save may still be renaming. One trial keeps
the suite within its time budget; the campaign's table is in docs/reliability.md."""

import pytest

from tests.reliability.preempt_trials import run_trials, table


@pytest.mark.slow  # one signalled job and one process with the reference and the two resumes
def test_preemption_at_random_moments_leaves_a_checkpoint_that_resumes_bit_exact(tmp_path):
    results = run_trials(1, seed=1, base=tmp_path, first=5, per_process=1)  # trial 5: both ranks, a forward
    assert all(r["ok"] for r in results), table(results)
