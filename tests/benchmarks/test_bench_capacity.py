"""benchmarks/bench_capacity.py without launching a rank: the depth search, the tables, the targets and the chart."""

import os

import pytest

from benchmarks import bench_capacity as bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _probe(largest, base=100, slope=10, noise=0):
    """A rung where depth ``largest`` is the deepest that fits: memory linear in depth, the cap just above it."""
    asked = []

    def probe(depth):
        asked.append(depth)
        if depth <= largest:
            return {"outcome": "ok", "peak": base + slope * depth + (noise if depth % 2 else 0)}
        return {"outcome": "oom"}

    return probe, asked, base + slope * largest + slope // 2


@pytest.mark.parametrize("largest", [1, 2, 7, 16, 17, 29, 63, 100, 191])
def test_search_finds_the_boundary_in_few_tries(largest):
    probe, asked, cap = _probe(largest)
    found = bench.search_depth(probe, start=16, limit=192, cap=cap)
    assert found["depth"] == largest and found["fail"] == largest + 1
    assert len(asked) == len(set(asked)), asked  # never the same depth twice
    assert len(asked) <= 9, asked
    assert [d for d, _ in found["tries"]] == asked


def test_search_tolerates_a_poor_memory_guess():
    # the peaks wander (heap retention, buffers): the guided probe misses, the midpoint fallback still converges
    probe, asked, cap = _probe(40, noise=300)
    found = bench.search_depth(probe, start=16, limit=192, cap=cap)
    assert (found["depth"], found["fail"]) == (40, 41) and len(asked) <= 12, asked


def test_search_at_the_limit_and_below_one():
    probe, asked, cap = _probe(500)
    found = bench.search_depth(probe, start=16, limit=64, cap=cap)
    assert found == {"depth": 64, "fail": None, "tries": found["tries"]} and asked[-1] == 64
    probe, asked, cap = _probe(0)
    found = bench.search_depth(probe, start=16, limit=64, cap=cap)
    assert (found["depth"], found["fail"]) == (0, 1) and asked == [16, 8, 4, 2, 1]


def test_deepspeed_configs_default_and_tuned():
    default = bench.deepspeed_config("3+cpu", "deepspeed", 2, "/x")["zero_optimization"]
    assert default == {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": False},
        "offload_param": {"device": "cpu", "pin_memory": False},
    }
    tuned = bench.deepspeed_config("2", "deepspeed-tuned", 2, "/x")["zero_optimization"]
    assert tuned["reduce_bucket_size"] < 5e8 and tuned["allgather_bucket_size"] < 5e8
    assert not any(key.startswith("stage3_") for key in tuned) and "sub_group_size" not in tuned
    nvme = bench.deepspeed_config("3+nvme", "deepspeed-tuned", 2, "/x")["zero_optimization"]
    assert nvme["offload_param"]["nvme_path"] == "/x" and nvme["offload_param"]["buffer_size"] < 1e8
    assert nvme["stage3_max_live_parameters"] < 1e9 and nvme["sub_group_size"] < 1e9


def _rows():
    def row(rung, peer, depth, params):
        return {
            "rung": rung,
            "peer": peer,
            "depth": depth,
            "fail": depth + 1,
            "fail_outcome": "oom",
            "fail_detail": "",
            "params": params,
            "peak_rss": 600 << 20,
            "cgroup_peak": 500 << 20,
            "step_time": 1.5,
            "tries": 5,
            "cap": "cgroup v1",
        }

    return [
        row("0", "ours", 20, 20e6),
        row("0", "deepspeed", 18, 18e6),
        row("0", "deepspeed-tuned", 21, 21e6),
        row("3+nvme", "ours", 90, 90e6),
        {"rung": "3+nvme", "peer": "deepspeed", "depth": None, "reason": "no async_io"},
        {"rung": "3+nvme", "peer": "deepspeed-tuned", "depth": None, "reason": "no async_io"},
        row("3+cpu", "ours", 30, 30e6),
        row("3+cpu", "deepspeed", 28, 28e6),
        row("3+cpu", "deepspeed-tuned", 0, 0),
    ]


def test_tables_and_targets(capsys):
    text = bench.render(_rows(), "header")
    assert text == capsys.readouterr().out.rstrip("\n")
    assert "| 0 | ZeroStrategy | 20 | 20.0M | 600 | 500 | 1.50 | 21: oom | 5 |" in text
    assert "| 3+nvme | DeepSpeed (default) | n/a | | | | | no async_io | 0 |" in text
    by_rung = {t[0]: t for t in bench.targets(_rows())}
    assert by_rung["0"][1:] == (pytest.approx(20 / 18), pytest.approx(20 / 21), "≥ 1.0 default, ≥ 0.9 tuned", "yes")
    assert by_rung["3+nvme"][1:3] == (None, None) and by_rung["3+nvme"][4] == "n/a"
    assert by_rung["3+cpu"][4] == "no"  # 30/28 is below the 1.2 asked at 3+cpu
    assert by_rung["3+cpu"][2] == float("inf")  # the tuned peer trained nothing


def test_ours_memory_tuned_runs_one_unit_per_block_and_is_not_judged(monkeypatch, tmp_path):
    """``ours-tuned`` is ZeroStrategy with ``unit_bytes=0`` (its memory knob), shown beside the others; the targets
    still compare ZeroStrategy's defaults, so a tuned row never turns a missed rung into a met one."""
    from benchmarks import _capacity_rank

    launched = []
    monkeypatch.setattr(_capacity_rank, "launch", lambda job, args: launched.append(job) or {"outcome": "ok"})
    args = bench.parse(["--json", str(tmp_path / "c.json")])
    for peer in ("ours", "ours-tuned"):
        bench.make_probe(peer, "2", args, {}, lambda: None)(12)
    assert "options" not in launched[0] and launched[1]["options"] == {"unit_bytes": 0}
    assert bench.try_key(launched[0], args) != bench.try_key(launched[1], args)
    rows = [dict(r) for r in _rows()] + [dict(_rows()[0], peer="ours-tuned", params=99e6)]
    assert bench.targets(rows) == bench.targets(_rows())
    assert "| 0 | ZeroStrategy (memory-tuned) | 20 |" in bench.render(rows, "header")
    # ZeroStrategy refuses unit_bytes at stages 0-1, where there are no units: those rungs are not tried
    assert bench.unavailable("ours-tuned", "1") and bench.unavailable("ours-tuned", "0")
    assert bench.unavailable("ours-tuned", "3+ac") is None and bench.unavailable("ours", "0") is None


def test_chart(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "img" / "capacity.png"
    assert bench.plot(_rows(), str(path), "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _cached(bench, args, rung, results):
    return {
        bench.try_key({"side": "ours", "rung": rung, "depth": depth}, args): {
            "outcome": outcome,
            "depth": depth,
            "peer": "ours",
            "rung": rung,
            "cgroup_peak": 1 << 20,
            "peak_rss": 1 << 20,
            "step_time": 0.5 if outcome == "ok" else None,
        }
        for depth, outcome in results
    }


def test_load_reads_the_bracket_from_the_cache(tmp_path):
    # --load redraws from the cached tries, whichever order of searches made them; other shapes are not mixed in
    args = bench.parse(["--rungs", "1", "--peers", "ours", "--json", str(tmp_path / "c.json"), "--load"])
    cache = _cached(bench, args, "1", [(16, "oom"), (8, "oom"), (4, "ok"), (6, "oom"), (5, "ok")])
    other = bench.parse(["--width", "512", "--heads", "8"])
    cache.update(_cached(bench, other, "1", [(7, "ok")]))
    found = bench.bracket("ours", "1", cache, args)
    assert (found["depth"], found["fail"], found["incomplete"], len(found["tries"])) == (5, 6, False, 5)


def test_ladder_starts_each_search_from_the_previous_answer(monkeypatch, tmp_path):
    monkeypatch.setattr(
        bench, "unavailable", lambda peer, rung: "no aio" if rung == "3+nvme" and not peer.startswith("ours") else None
    )
    monkeypatch.setattr(bench, "count_params", lambda width, heads, seq, vocab, depth: depth * 1000)
    largest = {"0": 20, "3": 45, "3+nvme": 90}
    asked = {}

    def make(peer, rung, args, cache):
        probe, seen, _ = _probe(largest[rung] - (peer != "ours"))
        asked[(rung, peer)] = seen
        return probe

    args = bench.parse(["--rungs", "0", "3", "3+nvme", "--cap-gib", "1e-6", "--json", str(tmp_path / "c.json")])
    rows = bench.ladder(args, {}, make)
    assert [(r["rung"], r["peer"], r["depth"]) for r in rows] == [
        ("0", "ours", 20),
        ("0", "ours-tuned", 19),
        ("0", "deepspeed", 19),
        ("0", "deepspeed-tuned", 19),
        ("3", "ours", 45),
        ("3", "ours-tuned", 44),
        ("3", "deepspeed", 44),
        ("3", "deepspeed-tuned", 44),
        ("3+nvme", "ours", 90),
        ("3+nvme", "ours-tuned", 89),
        ("3+nvme", "deepspeed", None),
        ("3+nvme", "deepspeed-tuned", None),
    ]
    assert asked[("0", "ours-tuned")][0] == 20 and asked[("0", "deepspeed")][0] == 19
    assert asked[("3", "ours")][0] == 19
    assert rows[0]["params"] == 20000 and rows[-1]["reason"] == "no aio"


def test_search_stops_at_the_resolution():
    probe, asked, cap = _probe(100, noise=300)
    found = bench.search_depth(probe, start=16, limit=192, cap=cap, resolution=0.05)
    assert found["depth"] <= 100 < found["fail"] and found["fail"] - found["depth"] <= 5


def test_load_of_a_run_cut_short(tmp_path, capsys):
    args = bench.parse(["--rungs", "0", "1", "--peers", "ours", "--json", str(tmp_path / "c.json"), "--load"])
    cache = _cached(bench, args, "0", [(16, "ok"), (32, "oom")])
    rows = bench.ladder(args, cache, None)
    assert (rows[0]["depth"], rows[0]["fail"], rows[0]["incomplete"]) == (16, 32, True)
    assert rows[1]["depth"] is None and "cut short" in rows[1]["reason"]
    text = bench.render(rows, "h")
    assert "32: oom (search cut short)" in text and "| 1 | ZeroStrategy | n/a |" in text


def test_a_line_through_flat_peaks_does_not_waste_tries():
    # offload rungs: the peak barely grows with depth until it jumps; a guess past the failure bisects instead
    asked = []

    def probe(depth):
        asked.append(depth)
        return {"outcome": "ok", "peak": 300 + depth // 10} if depth <= 30 else {"outcome": "oom"}

    found = bench.search_depth(probe, start=15, limit=128, cap=384, grow=1.25)
    assert (found["depth"], found["fail"]) == (30, 31) and len(asked) <= 10, asked


def test_a_run_that_launched_tries_leaves_a_dated_record(tmp_path, monkeypatch, capsys):
    """After the tries, the tables go to ``bench_capacity-<date>.md`` with the command, the rows to the ``.json``
    beside it; ``--load`` (nothing launched) and ``--no-results`` write none."""
    import json

    monkeypatch.setattr(bench, "ladder", lambda args, cache, make: _rows())
    cache = str(tmp_path / "c.json")
    bench.main(["--json", cache, "--results", str(tmp_path / "r")])
    (md,) = (tmp_path / "r").glob("bench_capacity-*.md")
    text = md.read_text()
    assert "| 0 | ZeroStrategy | 20 | 20.0M |" in text and f"--json {cache} --results {tmp_path / 'r'}`" in text
    assert json.loads(md.with_suffix(".json").read_text())["rows"] == _rows()
    from benchmarks import common

    monkeypatch.setattr(common, "RESULTS_DIR", str(tmp_path / "default"))
    bench.main(["--json", cache, "--results", str(tmp_path / "r"), "--load"])
    bench.main(["--json", cache, "--no-results"])
    assert len(list((tmp_path / "r").iterdir())) == 2 and not (tmp_path / "default").exists()
    bench.main(["--json", cache])
    assert len(list((tmp_path / "default").glob("bench_capacity-*.md"))) == 1
    with pytest.raises(SystemExit):
        bench.parse(["--results", str(tmp_path), "--no-results"])
