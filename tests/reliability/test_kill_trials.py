"""A few of the randomized kill trials (the full count: ``python -m tests.reliability.kill_trials --trials 20``)."""

import pytest

from tests.reliability.kill_trials import run_trials, table


@pytest.mark.slow  # a calibration run and, per trial, a killed run and two resumes: about 1.5 minutes
def test_random_kills_during_saves_resume_both_ways_without_leftovers(tmp_path):
    results = run_trials(2, seed=1, base=tmp_path, modes=("link", "async"))  # the modes with the most to get wrong
    report = table(results)
    assert all(r["last_resume"]["ok"] and r["path_resume"]["ok"] for r in results), report
