"""A short run of the endurance tier (the full tier: ``python -m tests.reliability.endurance``, see
docs/reliability.md#endurance): the same workloads, samples and bounds, with few steps and fits."""

import dataclasses

import pytest

from tests.reliability.endurance import CONFIGS, judge, run_config, table, verdict


def _sample(at, rss=100 * 2**20, **counts):
    base = {
        "at": at,
        "rss": rss,
        "anon": rss // 2,
        "fds": 30,
        "threads": 2,
        "tasks": 9,
        "groups": 2,
        "ckpt_files": 24,
        "ckpt_entries": 4,
        "nvme_files": 0,
        "pyobjs": 1000,
        "time": float(at),
    }
    return {**base, **counts}


def test_the_bounds_catch_a_slow_leak_of_each_kind():
    steady = [_sample(i) for i in range(30)]
    assert verdict(steady, max_entries=4)["failures"] == []
    for key in ("fds", "threads", "tasks", "groups", "ckpt_files", "nvme_files"):
        leaking = [_sample(i, **{key: steady[0][key] + i // 10}) for i in range(30)]  # one more every 10 samples
        assert any(key in failure for failure in verdict(leaking)["failures"]), key
    growing = [_sample(i, rss=int(100 * 2**20 * (1 + 0.002 * i))) for i in range(30)]  # +5 % over the run
    assert any(failure.startswith("RSS") for failure in verdict(growing)["failures"])
    # the kernel dropped file-backed pages: RSS fell while the anonymous memory grew
    hidden = [_sample(i, rss=100 * 2**20 - i * 2**20, anon=int(50 * 2**20 * (1 + 0.002 * i))) for i in range(30)]
    assert [f for f in verdict(hidden)["failures"] if "RSS" in f] == [verdict(hidden)["failures"][0]]
    assert verdict(hidden)["failures"][0].startswith("anonymous RSS drift")
    piling = [_sample(i, ckpt_entries=4 + (i == 20)) for i in range(30)]
    assert any("entries" in failure for failure in verdict(piling, max_entries=4)["failures"])


@pytest.mark.slow  # two short runs on 2 ranks: 13 s + 8 s on the 2-core machine at load 2 (110 s at load 40)
@pytest.mark.parametrize("name, steps, fits", [("s3-async", 300, 0), ("fits-fabric", 0, 6)])
def test_endurance_short_run_stays_within_bounds(tmp_path, name, steps, fits):
    # the Fabric loop at stage 3 only: one stage per cycle, so 6 fits give a warm-up and two windows
    config = dataclasses.replace(CONFIGS[name], stages=(3,))
    result = run_config(config, tmp_path / name, steps=steps, save_every=25, fits=fits)
    figures = judge(config, result, rss_bound=0.02)
    report = table([(name, f"{steps} steps / {fits} fits", result["seconds"], figures)])
    assert all(not f["failures"] for f in figures), report
