"""Two of the randomized preemption trials (the full count: ``python -m tests.reliability.preempt_trials --trials
20``): SIGTERM aimed at an async save's background rename (to rank 1) and at a forward (to both ranks)."""

import pytest

from tests.reliability.preempt_trials import run_trials, table


@pytest.mark.slow  # two signalled jobs and one process with the reference and the four resumes
def test_preemption_at_random_moments_leaves_a_checkpoint_that_resumes_bit_exact(tmp_path):
    results = run_trials(2, seed=1, base=tmp_path, first=4, per_process=2)  # trials 4 and 5: rename, then forward
    assert all(r["ok"] for r in results), table(results)
