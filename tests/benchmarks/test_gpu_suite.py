"""benchmarks/gpu_suite.py without a GPU: the arithmetic, the capacity search, the time budget, the outcome of a
child run, the arguments, the report, a dry run, and the whole pipeline at a tiny size on CPU (gloo, one process)."""

import importlib.util
import json
import math
import os
import re

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H100 = "NVIDIA H100 80GB HBM3,79.2,125"


@pytest.fixture(scope="module")
def suite():
    from benchmarks import gpu_suite

    return gpu_suite


@pytest.fixture(scope="module")
def parts():
    from benchmarks import _gpu_suite_parts

    return _gpu_suite_parts


class Clock:
    """A fake monotonic clock that tests move by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_parameter_count_matches_the_example_gpt(suite, parts):
    """gpt_params counts what examples/gpt.py builds, for the default ~1.2B shape and a tiny one."""
    from benchmarks import _bench_models as models

    for shape in (suite.FULL, suite.TINY, {**suite.TINY, "n_layer": 5}):
        args = type("A", (), {"quick": False, "gpt": shape})()
        with torch.device("meta"):
            model = models.build("gpt", args)
        counts = parts.gpt_params(shape)
        assert counts["total"] == sum(p.numel() for p in model.parameters())
        assert counts["embedding"] == model.tok.weight.numel() + model.pos.weight.numel()
        assert counts["block"] == sum(p.numel() for p in model.blocks[0].parameters())
    assert 1.0e9 < parts.gpt_params(suite.FULL)["total"] < 1.3e9  # the issue's ~1B model


def test_each_sides_own_cpu_optimizer_is_asked_for_by_name(suite):
    """--ds-cpu-adam: DeepSpeed's config drops torch_adam and forces its CPU optimizer (only with offload); our module
    steps with lightning_zero.ops.CPUAdam; the default stays torch's AdamW on both sides."""
    from benchmarks import _bench_models as models
    from benchmarks import _bench_workers as workers
    from lightning_zero.ops import CPUAdam

    args = type("A", (), {"quick": True, "gpt": None, "batch": 2, "device": "cpu", "optimizer": "cpu_adam"})()
    config = workers.deepspeed_config(args, {"kind": "deepspeed:3+cpu", "precision": "bf16", "ds_cpu_adam": True})
    assert config["optimizer"] == {"type": "AdamW", "params": {"lr": 1e-4}} and config["zero_force_ds_cpu_optimizer"]
    default = workers.deepspeed_config(args, {"kind": "deepspeed:3+cpu", "precision": "bf16"})
    assert default["optimizer"]["params"]["torch_adam"] and not default["zero_force_ds_cpu_optimizer"]
    with pytest.raises(ValueError, match="needs an offloaded configuration"):
        workers.deepspeed_config(args, {"kind": "deepspeed:3", "precision": "bf16", "ds_cpu_adam": True})
    assert isinstance(models.lightning_module("gpt", args)().configure_optimizers(), CPUAdam)
    args.optimizer = "adamw"
    assert type(models.lightning_module("gpt", args)().configure_optimizers()) is torch.optim.AdamW


def test_flops_and_mfu_arithmetic(parts):
    shape = {"n_layer": 2, "n_embd": 4, "n_head": 2, "block_size": 8, "vocab": 10}
    n = 2 * (12 * 16 + 13 * 4) + 2 * 4 + 10 * 4  # blocks, final LayerNorm, head: 536
    assert parts.gpt_params(shape)["matmul"] == n
    assert parts.flops_per_token(shape) == 6 * n + 12 * 2 * 4 * 8
    figures = parts.throughput(0.5, 1000, 2_000_000, 1e10)
    assert figures["tokens_per_s"] == 2000 and figures["tflops"] == pytest.approx(4e9 / 1e12)
    assert figures["mfu"] == pytest.approx(0.4)
    assert parts.throughput(0.5, 1000, 2_000_000, None)["mfu"] is None  # no known peak: no MFU, no guess
    assert parts.throughput(None, 1000, 2_000_000, 1e10) == {"tokens_per_s": None, "tflops": None, "mfu": None}


def _fake_trainer(limit, calls, fail=None):
    """Trains every size up to ``limit``; above it a GPU OOM (or ``fail`` for the sizes in it)."""

    def trains(size, timeout):
        calls.append((size, timeout))
        if fail and size in fail:
            return {"outcome": fail[size], "reason": "x"}
        return {"outcome": "ok" if size <= limit else "gpu-oom", "reason": ""}

    return trains


@pytest.mark.parametrize("limit", [20, 21, 37, 92, 93])
def test_bisection_finds_the_largest_size(parts, limit):
    calls = []
    search = parts.find_largest(
        20, 93, _fake_trainer(limit, calls), parts.Deadline(1e6), known_good=True, max_probes=10
    )
    assert search.good == limit and calls[0][0] == 93
    assert search.bad == (None if limit == 93 else limit + 1)
    assert len(calls) <= 1 + math.ceil(math.log2(93 - 20 + 1))  # the ceiling, then halving
    assert 20 not in [c[0] for c in calls]  # a known-good lower bound is never probed again


def test_bisection_starts_at_the_estimate_and_stops_at_its_limits(parts):
    calls = []
    search = parts.find_largest(
        20, 93, _fake_trainer(60, calls), parts.Deadline(1e6), first=58, known_good=True, max_probes=2
    )
    assert [c[0] for c in calls] == [58, 76] and search.good == 58 and search.bad == 76
    assert search.stopped == "probe limit (2) reached"
    calls = []
    search = parts.find_largest(20, 93, _fake_trainer(93, calls), parts.Deadline(1e6), known_good=True)
    assert [c[0] for c in calls] == [93] and search.stopped == "the search's ceiling (93) trains"
    # nothing known to train: the lower bound is probed too, and "none trains" is an answer
    calls = []
    search = parts.find_largest(3, 6, _fake_trainer(0, calls), parts.Deadline(1e6), max_probes=10)
    assert search.good == 2 and search.bad == 3 and search.stopped == "bracket closed"


def test_bisection_stops_on_timeouts_errors_and_the_deadline(parts):
    calls = []
    search = parts.find_largest(
        20, 93, _fake_trainer(50, calls, fail={56: "timeout"}), parts.Deadline(1e6), known_good=True, max_probes=10
    )
    assert [c[0] for c in calls] == [93, 56] and search.good == 20 and search.bad == 93
    assert search.stopped == "probe at 56 ended in timeout: search stopped"  # cut by the deadline: not "too big"
    calls = []  # a probe that outlasts its own time limit is too big to train in time: the search goes on below it
    search = parts.find_largest(
        20, 93, _fake_trainer(50, calls, fail={56: "too-slow"}), parts.Deadline(1e6), known_good=True, max_probes=10
    )
    assert search.good == 50 and search.bad == 51 and [c[0] for c in calls][:3] == [93, 56, 38]
    clock = Clock()
    deadline = parts.Deadline(100, clock)

    def slow(size, timeout):
        clock.now += 60
        return {"outcome": "host-oom", "reason": ""}

    search = parts.find_largest(20, 93, slow, deadline, known_good=True, min_probe_s=50)
    assert len(search.probes) == 1 and search.bad == 93 and search.stopped.startswith("time budget spent")


def test_phases_share_one_deadline_and_skip_what_it_cannot_hold(parts):
    clock, ran, saved = Clock(), [], []

    def phase(name, cost, fail=False):
        def run(deadline):
            ran.append((name, round(deadline.left())))
            clock.now += cost
            if fail:
                raise RuntimeError("boom")
            return {"status": "ok"}

        return run

    phases = [
        parts.Phase("a", 100, 10, phase("a", 50)),
        parts.Phase("b", 500, 10, phase("b", 10, fail=True)),
        parts.Phase("off", 10, 1, phase("off", 0), enabled=False, disabled_reason="opt-in"),
        parts.Phase("c", 500, 10, phase("c", 1000)),
        parts.Phase("d", 10, 10, phase("d", 0)),
    ]
    sections, skipped = parts.run_phases(
        phases, parts.Deadline(300, clock), reserve=5, after=lambda s, k: saved.append(sorted(s))
    )
    # a gets its own budget; b and c what is left of the deadline, less the report's reserve
    assert ran == [("a", 100), ("b", 245), ("c", 235)]
    assert sections["b"]["status"] == "error" and "RuntimeError: boom" in sections["b"]["error"]
    assert sections["a"]["duration_s"] == 50
    assert skipped[0] == {"phase": "off", "reason": "opt-in"}
    assert skipped[1]["phase"] == "d" and "needs at least 10 s" in skipped[1]["reason"]
    assert saved[0] == ["a"] and saved[-1] == ["a", "b", "c"]  # the report is rewritten after every phase


def test_outcomes_of_child_runs(parts):
    assert parts.classify(0, False, "done")["outcome"] == "ok"
    assert parts.classify(-9, True, "")["outcome"] == "timeout"
    oom = parts.classify(1, False, "x\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\nTrace")
    assert oom["outcome"] == "gpu-oom" and "Tried to allocate" in oom["reason"]
    assert parts.classify(-9, False, "loading")["outcome"] == "host-oom"  # the kernel's OOM killer
    assert parts.classify(1, False, "RuntimeError: DefaultCPUAllocator: can't allocate memory")["outcome"] == "host-oom"
    error = parts.classify(1, False, "Traceback\nValueError: bad shape\n")
    assert error == {"outcome": "error", "reason": "ValueError: bad shape"}


def test_pytest_summary_counts(parts):
    assert parts.pytest_counts("..F\n2 passed, 1 failed, 3 warnings in 4.2s") == {
        "passed": 2,
        "failed": 1,
        "warnings": 3,
    }
    assert parts.pytest_counts("== 15 skipped in 1.0s ==") == {"skipped": 15}
    assert parts.pytest_counts("1 error in 0.3s") == {"errors": 1}
    assert parts.pytest_counts("collected nothing") == {}
    # killed before the summary: -q's progress characters so far
    assert parts.pytest_counts("..s.F   [ 40%]\n..E\n") == {
        "passed": 5,
        "skipped": 1,
        "failed": 1,
        "errors": 1,
        "partial": 1,
    }


def test_arguments(suite):
    args = suite.parse(["--device", "cpu", "--out", "/tmp/x"])
    assert (args.batch, args.steps, args.warmup, args.offload_steps) == (8, 5, 3, 2)
    assert suite.model_shape(args) == suite.FULL and args.phases == ["tests", "throughput", "capacity"]
    tiny = suite.parse(["--device", "cpu", "--tiny", "--out", "/tmp/x", "--batch", "3"])
    assert suite.model_shape(tiny) == suite.TINY and tiny.batch == 3 and tiny.capacity_max_layers == 4
    planned = suite.parse(["--dry-run", "--assume", H100, "--out", "/tmp/x"])
    assert planned.device == "cuda" and planned.assume["memory_bytes"] == int(79.2 * 2**30)
    for bad in (
        ["--n-embd", "100", "--n-head", "16"],
        ["--assume", H100],
        ["--assume", "H100"],
        ["--ram-fraction", "1.5"],
        ["--steps", "0"],
    ):
        with pytest.raises(SystemExit):
            suite.parse(["--device", "cpu", "--out", "/tmp/x", *bad])


def test_default_budgets_fit_the_default_deadline(suite, parts):
    """The phases' default budgets, the start-up and the last report fit the default deadline, which fits the device
    call's limit: a default run is never cut by its own deadline before the capacity phase has had its budget."""
    args = suite.parse(["--device", "cpu", "--out", "/tmp/x"])
    budgets = args.budget_tests + args.budget_throughput + args.budget_capacity
    assert budgets + suite.STARTUP_S + parts.REPORT_RESERVE_S <= args.deadline <= 420
    assert args.phases[0] == "tests"


def test_capacity_bounds_follow_host_and_device_memory(suite):
    args = suite.parse(["--dry-run", "--assume", H100, "--out", "/tmp/x"])
    device = suite.device_info(args)
    assert device["peak_tflops_bf16"] == 989.4 and device["ram_gib"] == 125
    bounds = suite.capacity_bounds(args, device)
    assert 60 < bounds["ceiling"] < 120 and bounds["guess"] <= bounds["ceiling"]
    small = suite.parse(["--dry-run", "--assume", "NVIDIA H100 80GB HBM3,20,125", "--out", "/tmp/x"])
    assert suite.capacity_bounds(small, suite.device_info(small))["guess"] < bounds["guess"]  # the GPU binds
    capped = suite.parse(["--dry-run", "--assume", H100, "--out", "/tmp/x", "--capacity-max-layers", "30"])
    assert suite.capacity_bounds(capped, device)["ceiling"] == 30


OFFLOAD_ROW = {"config": "3+cpu", "side": "ours", "status": "ok", "wall_s": 30.0}


def test_capacity_probes_are_kept_to_what_the_phase_time_allows(suite, parts):
    """The first probe, and every later one, is a depth whose probe is estimated (the throughput phase's 3 + CPU
    offload wall time, scaled by the parameter count) to end within PROBE_TIME_SHARE of the time it may take; the
    memory estimate's 93 layers on an H100 would not."""
    args = suite.parse(["--dry-run", "--assume", H100, "--out", "/tmp/x"])
    device = suite.device_info(args)
    timed = {"n_layer": 20, "wall_s": 30.0}
    bounds = suite.capacity_bounds(args, device, timed, seconds=110.0)
    allowed = suite.PROBE_TIME_SHARE * min(args.probe_timeout, 110.0)

    def seconds(depth):
        return 30.0 * parts.gpt_params(suite.model_shape(args, depth))["total"] / parts.gpt_params(suite.FULL)["total"]

    assert seconds(bounds["in_time"]) <= allowed < seconds(bounds["in_time"] + 1)
    assert 20 < bounds["first"] == bounds["top"] == bounds["in_time"] < bounds["guess"] == 93
    assert suite.capacity_bounds(args, device)["first"] == 93  # the plan, before any time is known
    untimed = suite.capacity_bounds(args, device, None, seconds=110.0)
    assert untimed["first"] == untimed["top"] == 20  # nothing measured: only the depth the throughput phase runs


def test_the_capacity_phase_probes_no_deeper_than_its_time_allows(suite, monkeypatch):
    args = suite.parse(["--dry-run", "--assume", H100, "--out", "/tmp/x"])
    device, probed = suite.device_info(args), []

    def fake_run(job, job_args, timeout, out_dir):
        probed.append(job_args["gpt"]["n_layer"])
        return {"outcome": "ok", "reason": "", "wall_s": 1.0}

    monkeypatch.setattr(suite, "run_job", fake_run)
    section = suite.capacity_phase(args, suite.parts.Deadline(110.0), device, {"rows": [OFFLOAD_ROW]})
    top = suite.capacity_bounds(args, device, {"n_layer": 20, "wall_s": 30.0}, 110.0)["top"]
    assert probed == [top] and section["good"] == top and "ceiling" in section["stopped"]
    assert f"The search goes up to {top} layers" in section["description"][0]
    probed.clear()  # a throughput run as slow as the whole phase: no deeper probe is started
    slow = suite.capacity_phase(args, suite.parts.Deadline(110.0), device, {"rows": [{**OFFLOAD_ROW, "wall_s": 100}]})
    assert probed == [] and slow["good"] == 20 and "no depth above 20 layers" in slow["stopped"]


def test_the_report_is_written_before_the_first_phase_and_after_each(suite, monkeypatch, tmp_path):
    seen = []

    def fake_tests(args, deadline):
        seen.append(json.load(open(tmp_path / "gpu_report.json"))["phases"])
        return {"status": "passed", "counts": {"passed": 1}, "command": "pytest", "tail": ""}

    monkeypatch.setattr(suite, "tests_phase", fake_tests)
    suite.main(["--device", "cpu", "--phases", "tests", "--out", str(tmp_path)])
    assert seen == [{}]  # the plan was on disk when the first phase began
    assert json.load(open(tmp_path / "gpu_report.json"))["phases"]["tests"]["status"] == "passed"


def _result():
    row = {
        "side": "ours",
        "label": "ZeroStrategy",
        "config": "3",
        "status": "ok",
        "reason": "",
        "step_s": 0.25,
        "tokens_per_s": 32768.0,
        "tflops": 234.5,
        "mfu": 0.237,
        "peak_allocated": 30 * 2**30,
        "peak_reserved": 32 * 2**30,
        "host_peak": 6 * 2**30,
        "estimate": 31 * 2**30,
    }
    ds = {
        **row,
        "side": "deepspeed",
        "label": "DeepSpeed",
        "tokens_per_s": 30000.0,
        "peak_allocated": 25 * 2**30,
        "estimate": None,
    }
    missing = {
        "side": "deepspeed",
        "label": "DeepSpeed",
        "config": "3+cpu",
        "status": "not run",
        "reason": "phase budget spent (3 s left)",
    }
    return {
        "started": "2026-11-28 00:00 UTC",
        "deadline_s": 420,
        "wall_s": 400.2,
        "device": {"name": "NVIDIA H100"},
        "versions": {"torch": "2.11.0"},
        "plan": ["a plan line"],
        "phases": {
            "tests": {
                "status": "passed",
                "counts": {"passed": 15},
                "command": "python -m pytest tests/gpu",
                "tail": "15 passed",
                "duration_s": 80,
            },
            "throughput": {
                "rows": [row, ds, missing],
                "ratios": [{"config": "3", "tokens": 1.09, "memory": 1.2}],
                "description": ["Model: x"],
                "notes": ["a note"],
            },
            "capacity": {
                "probes": [
                    {"size": 93, "params_b": 4.79, "outcome": "gpu-oom", "wall_s": 70, "reason": "CUDA out of memory"}
                ],
                "result": "60 layers train",
                "description": ["Width 2048"],
            },
        },
        "skipped": [{"phase": "ds_cpu_adam", "reason": "opt-in"}],
    }


def test_report_writer(parts, tmp_path):
    md_path, json_path = parts.write_report(_result(), str(tmp_path / "out"))
    md = open(md_path).read()
    assert md.startswith("# GPU suite report") and "| device | NVIDIA H100 |" in md and "- a plan line" in md
    assert "**passed** (15 passed; 80 s)" in md
    assert "| ZeroStrategy | 3 | ok | 0.250 | 32,768 | 234.5 | 23.7% | 30.0 | 32.0 | 31.0 | 6.0 |" in md
    assert "| DeepSpeed | 3+cpu | not run: phase budget spent (3 s left) | – |" in md
    assert "| 3 | 1.09 | 1.20 |" in md and "- a note" in md
    assert "| 93 | 4.79 | gpu-oom | 70 |" in md and "**Result**: 60 layers train" in md
    assert "## Skipped\n\n- ds_cpu_adam: opt-in" in md
    assert json.load(open(json_path))["phases"]["capacity"]["result"] == "60 layers train"
    error = parts.render_report({"phases": {"throughput": {"status": "error", "error": "ValueError: x"}}})
    assert "Error: ValueError: x" in error and "## Skipped\n\nNothing." in error


def test_dry_run_plans_without_running(suite, tmp_path):
    result = suite.main(["--dry-run", "--assume", H100, "--out", str(tmp_path)])
    assert result["phases"] == {} and {s["phase"] for s in result["skipped"]} == {
        "tests",
        "throughput",
        "capacity",
        "ds_cpu_adam",
    }
    md = open(tmp_path / "gpu_report.md").read()
    assert "dry run: nothing was measured" in md and "1.215B parameters" in md and "MFU against 989.4" in md
    assert re.search(r"ZeRO 3\+cpu: estimated accelerator peak \d+\.\d GiB", md)
    assert sorted(os.listdir(tmp_path)) == ["gpu_report.json", "gpu_report.md"]


def test_the_device_command_is_one_line_and_the_same_everywhere():
    """docs/gpu.md and gpu_wheels.sh give the same one-line command, which fits the device tool's 2,000 characters
    and installs the wheels before it runs the suite into $OUT."""
    script = open(os.path.join(ROOT, "benchmarks", "gpu_wheels.sh")).read()
    command = re.search(r"^DEVICE_COMMAND='(.*)'$", script, re.M).group(1)
    assert f"# {command}\n" in script and len(command) < 2000
    assert command.startswith("python3 -m pip install") and "gpu_suite.py --out $OUT" in command
    assert command in open(os.path.join(ROOT, "docs", "gpu.md")).read()


@pytest.mark.slow  # three training runs and pytest in fresh processes: ~40 s on 2 busy cores
def test_tiny_pipeline_on_cpu(suite, tmp_path, monkeypatch):
    """The whole pipeline at a tiny size on CPU, DeepSpeed included where it is installed: pytest's counts, both
    sides' throughput at stage 3 + CPU offload, one capacity probe above the throughput run's depth. The suite runs
    in this process (its own start-up is the dry run's), every run in a fresh child as on the GPU."""
    tests = tmp_path / "test_probe.py"
    tests.write_text(
        "import pytest\n\ndef test_ok():\n    pass\n\n@pytest.mark.skip(reason='x')\ndef test_no():\n    pass\n"
    )
    out = tmp_path / "out"
    monkeypatch.setenv("PYTHONPATH", ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = suite.main(
        [
            "--device",
            "cpu",
            "--tiny",
            "--configs",
            "3+cpu",
            "--capacity-max-layers",
            "3",
            "--tests",
            str(tests),
            "--out",
            str(out),
            "--deadline",
            "170",
        ]
    )
    assert result["phases"]["tests"]["counts"] == {"passed": 1, "skipped": 1}, result["phases"]["tests"]
    rows = {r["side"]: r for r in result["phases"]["throughput"]["rows"]}
    assert rows["ours"]["status"] == "ok" and rows["ours"]["tokens_per_s"] > 0 and rows["ours"]["host_peak"] > 0
    if importlib.util.find_spec("deepspeed") is not None:
        assert rows["deepspeed"]["status"] == "ok", rows["deepspeed"]
        assert result["phases"]["throughput"]["ratios"][0]["config"] == "3+cpu"
    capacity = result["phases"]["capacity"]
    assert [p["size"] for p in capacity["probes"]] == [3] and capacity["good"] == 3, capacity
    assert {"gpu_report.md", "gpu_report.json", "gpu_tests.log", "gpu_suite_runs.log"} <= set(os.listdir(out))
    assert json.load(open(out / "gpu_report.json"))["phases"]["capacity"]["good"] == 3
