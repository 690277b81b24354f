"""One of the randomized kill trials (the full count: ``python -m tests.reliability.kill_trials --trials 20``)."""

import pytest

from tests.reliability.kill_trials import run_trials, table


@pytest.mark.slow  # a calibration run, a killed run and two resumes
def test_random_kills_during_saves_resume_both_ways_without_leftovers(tmp_path):
    results = run_trials(1, seed=1, base=tmp_path, modes=("link",))  # the mode with the most to get wrong
    report = table(results)
    assert all(r["last_resume"]["ok"] and r["path_resume"]["ok"] for r in results), report
