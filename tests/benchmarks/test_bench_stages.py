"""benchmarks/bench_stages.py: the model matrix, alternated repeats, paired ratios, the chart, and a real quick run."""

import importlib.util
import json
import os
import subprocess
import sys
from importlib.machinery import ModuleSpec

import pytest

from benchmarks import bench_stages as bench

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks", "bench_stages.py")


@pytest.fixture
def deepspeed_listed(monkeypatch):
    """``parse`` refuses the DeepSpeed peer (the default) where deepspeed is not installed; the tests using this
    only parse arguments and fake the runs, so they stand in a spec for it and pass with or without deepspeed."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: real(name, *a) or (ModuleSpec(name, None) if name == "deepspeed" else None),
    )


def test_peers_per_stage(deepspeed_listed):
    peers = ["deepspeed", "ddp", "modelparallel"]
    assert bench.peer_kinds("0", peers) == [("deepspeed", "deepspeed:0"), ("ddp", "ddp")]
    assert bench.peer_kinds("1", peers) == [("deepspeed", "deepspeed:1")]
    assert bench.peer_kinds("2", peers) == [("deepspeed", "deepspeed:2"), ("modelparallel", "modelparallel:2")]
    assert bench.peer_kinds("3", peers) == [("deepspeed", "deepspeed:3"), ("modelparallel", "modelparallel:3")]
    assert bench.peer_kinds("3+cpu", peers) == [("deepspeed", "deepspeed:3+cpu")]
    assert bench.peer_kinds("2", ["floor"]) == [("floor", "floor:2")]  # opt-in, at every stage
    assert bench.peer_kinds("3+cpu", ["sync"]) == [("sync", "sync:3+cpu")]  # opt-in, at every stage
    assert bench.peer_kinds("1", ["minimal"]) == [("minimal", "minimal:1")]  # opt-in, stages 0-2 only
    assert bench.peer_kinds("3", ["minimal"]) == [] and bench.peer_kinds("2+cpu", ["minimal"]) == []
    assert bench.peer_kinds("2", ["engine"]) == [("engine", "engine:2")]  # opt-in, stages 0-2 only
    assert bench.peer_kinds("3", ["engine"]) == [] and bench.peer_kinds("1+cpu", ["engine"]) == []
    assert not {"floor", "sync", "minimal", "engine"} & set(bench.parse([]).peers)


def test_a_peer_with_no_cell_at_the_chosen_stages_is_reported(capsys, deepspeed_listed):
    """A requested peer that compares with none of the requested stages is named on stderr, not dropped silently."""
    bench.parse(["--stages", "3", "3+cpu", "--peers", "deepspeed", "minimal", "ddp"])
    err = capsys.readouterr().err
    assert "--peers minimal: no cell at --stages 3 3+cpu" in err and "--peers ddp: no cell" in err
    assert "--peers deepspeed" not in err
    bench.parse(["--stages", "0", "2", "--peers", "minimal", "ddp", "modelparallel"])
    assert "no cell" not in capsys.readouterr().err


def test_steady_heap_is_what_the_environment_audit_advises():
    """--steady-heap starts the ranks with the glibc settings the library's environment audit names for a CPU run
    (the bench keeps its own copy: a rank of --peers before imports the library only from the old tree)."""
    from benchmarks import _bench_workers as workers
    from lightning_zero.diagnostics.env_audit import STEADY_HEAP

    assert workers.STEADY_HEAP == STEADY_HEAP


@pytest.mark.slow  # one job in freshly spawned ranks of a benchmark peer: ~20 s on 2 cores
def test_compute_floor_runs_without_collectives_and_steps_a_share():
    """The floor peer: each rank steps about 1/world of the elements at stages 1-3 (all of them at stage 0), in a
    plain loop that never initializes a process group (a collective would raise)."""
    from benchmarks import _bench_workers as workers

    sizes = [100, 7, 60, 40, 3, 1]
    owners = workers.floor_owners(sizes, 2)
    loads = [sum(s for s, o in zip(sizes, owners) if o == r) for r in range(2)]
    assert sorted(set(owners)) == [0, 1] and abs(loads[0] - loads[1]) <= max(sizes) and sum(loads) == sum(sizes)
    args = bench.parse(["--quick", "--nproc", "2", "--peers", "floor"])  # no DeepSpeed needed
    # the compute-copy path (stages 2-3 in bf16; fp32 is the same loop without it)
    step, peak = workers.measure({"model": "gpt", "precision": "bf16t", "kind": "floor:2"}, args)
    assert step > 0 and peak >= 0


@pytest.mark.slow  # five jobs in freshly spawned ranks of benchmark peers: ~1 min on 2 busy cores
def test_minimal_and_engine_loops_train_the_same_model():
    """The minimal-loop peer (its flat all-reduce at stage 0, its flat slices with reduce-scatter and all-gather at
    stages 1-2) and the engine peer (torch's DDP, ZeroRedundancyOptimizer and FSDP2 at the root, in a bare loop) do
    the training they stand for: every rank of every one ends with the same weights on the same batches, and not
    the initial ones. The sync peer (the floor plus one collective per step) runs with its process group."""
    from benchmarks import _bench_models as models
    from benchmarks import _bench_workers as workers

    args = bench.parse(["--quick", "--nproc", "2", "--peers", "engine", "--steps", "3"])
    initial = float(sum(p.detach().double().sum() for p in models.build("gpt", args).parameters()))
    sums = {}
    for kind in ("minimal:0", "minimal:2", "engine:0", "engine:1", "engine:2"):
        results = workers.spawn({"model": "gpt", "precision": "fp32", "kind": kind}, args)
        assert all(r["time"] > 0 for r in results)
        sums[kind] = [r["param_sum"] for r in results]
    flat = [value for values in sums.values() for value in values]
    assert max(flat) - min(flat) <= 1e-6 * max(abs(v) for v in flat), sums
    assert abs(flat[0] - initial) > 1e-4, (flat[0], initial)  # AdamW moved every weight by about lr per step
    step, peak = workers.measure({"model": "gpt", "precision": "bf16", "kind": "sync:2"}, args)
    assert step > 0 and peak >= 0


def test_runs_alternate_and_ratios_are_paired(capsys, deepspeed_listed):
    """A B C A B C: each repeat pairs ours with the peer runs next to it; the table shows median and range."""
    args = bench.parse(["--model", "mlp", "--stages", "0", "--repeat", "3", "--peers", "deepspeed", "ddp"])
    order, figures = (
        [],
        iter(
            [
                (1.0, 100),
                (2.0, 200),
                (0.5, 50),  # repeat 1: ours, DeepSpeed, DDP
                (3.0, 100),
                (4.0, 400),
                (1.0, 50),  # repeat 2: a slower machine, same ratios-ish
                (1.0, 100),
                (1.0, 100),
                (1.0, 100),
            ]
        ),
    )

    def fake_measure(job, _args):
        order.append(job["kind"])
        return next(figures)

    cell = bench.run_cell("mlp", "fp32", "0", args, fake_measure)
    assert order == ["zero:0", "deepspeed:0", "ddp"] * 3
    rows = bench.render([cell])
    ds, ddp = rows
    assert ds["peer"] == "deepspeed" and ds["time_ratio"] == (0.75, 0.5, 1.0) and ds["mem_ratio"] == (0.5, 0.25, 1.0)
    assert ddp["time_ratio"] == (2.0, 1.0, 3.0) and ddp["pairs"] == 3
    table = capsys.readouterr().out
    assert "| mlp | fp32 | 0 | DeepSpeed | 0.75 [0.50–1.00] | 0.50 [0.25–1.00] |" in table
    assert "| mlp | fp32 | 0 | Lightning DDP | 2.00 [1.00–3.00] |" in table


def test_failed_deepspeed_run_is_retried_once_then_shown_as_failed(capsys, deepspeed_listed):
    args = bench.parse(["--model", "mlp", "--stages", "1", "--repeat", "1", "--peers", "deepspeed"])
    calls = []

    def fake_measure(job, _args):
        calls.append(job["kind"])
        if job["kind"].startswith("deepspeed"):
            raise RuntimeError("process 1 terminated with signal SIGABRT")
        return (1.0, 1)

    cell = bench.run_cell("mlp", "bf16", "1", args, fake_measure)
    assert calls == ["zero:1", "deepspeed:1", "deepspeed:1"]
    assert cell["runs"]["deepspeed"] == [None]
    bench.render([cell])
    out = capsys.readouterr()
    assert "SIGABRT" in out.err
    assert "| mlp | bf16 | 1 | DeepSpeed | failed | failed |" in out.out


def test_arguments_are_validated(deepspeed_listed):
    with pytest.raises(SystemExit):
        bench.parse(["--repeat", "0"])
    with pytest.raises(SystemExit):
        bench.parse(["--model", "resnet"])
    quick = bench.parse(["--quick"])
    assert (quick.repeat, quick.steps, quick.warmup, quick.model) == (1, 2, 1, ["gpt", "mlp", "llama"])
    full = bench.parse(["--model", "mlp", "mlp", "--no-lightning", "--width", "256"])
    assert (full.repeat, full.model, full.peers, full.width) == (3, ["mlp"], ["deepspeed"], 256)
    # --no-lightning drops Lightning's strategies only, not the yardsticks that run without Lightning
    kept = bench.parse(
        ["--stages", "2", "--no-lightning", "--peers", "modelparallel", "fsdp", "floor", "minimal", "engine"]
    )
    assert kept.peers == ["floor", "minimal", "engine"], kept.peers
    # the bare loops compute bf16-mixed numerics only: with bf16t they are refused, not run as something else
    for peer in ("minimal", "engine"):
        with pytest.raises(SystemExit):
            bench.parse(["--precision", "fp32", "bf16t", "--stages", "0", "--peers", peer])
    assert bench.parse(["--precision", "bf16t", "--stages", "0", "--peers", "floor"]).peers == ["floor"]


def test_models_build_with_the_issue_shapes(deepspeed_listed):
    from benchmarks import _bench_models as models

    args = bench.parse(["--model", "all"])
    assert "25.19M params" in models.describe("mlp", args)  # 24 x Linear(1024, 1024) with bias
    assert models.build("mlp", bench.parse(["--quick", "--width", "8", "--depth", "3"]))[4].in_features == 8
    if importlib.util.find_spec("transformers") is not None:
        llama = models.build("llama", args)
        assert llama.config.tie_word_embeddings and llama.lm_head.weight is llama.model.embed_tokens.weight
    gpt = models.build("gpt", args)
    assert type(gpt).__module__ == "_bench_gpt_example"  # the example's class, imported from examples/gpt.py


def test_llama_is_skipped_with_a_message_without_transformers(monkeypatch):
    from benchmarks import _bench_models as models

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a)
    )
    assert "transformers is not installed" in models.unavailable("llama")
    assert models.unavailable("mlp") is None


def test_plot_without_matplotlib_says_so(monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    row = {
        "model": "mlp",
        "precision": "fp32",
        "stage": "0",
        "peer": "deepspeed",
        "time_ratio": (1.0, 1.0, 1.0),
        "mem_ratio": (1.0, 1.0, 1.0),
    }
    assert bench.plot([row], str(tmp_path / "chart.png")) is False
    assert "needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "chart.png").exists()


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_plot_saves_the_chart(tmp_path):
    row = {
        "model": "mlp",
        "precision": "fp32",
        "stage": "0",
        "peer": "deepspeed",
        "time_ratio": (0.9, 0.8, 1.1),
        "mem_ratio": (1.0, 1.0, 1.0),
    }
    assert bench.plot([row], str(tmp_path / "img" / "chart.png"))
    assert (tmp_path / "img" / "chart.png").stat().st_size > 0


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_quick_run_against_deepspeed_and_lightning_ddp(tmp_path):
    """The real thing, tiny: stage 0 on the MLP, ours vs DeepSpeed vs Lightning's DDP, fresh ranks per run."""
    raw = tmp_path / "raw.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [
            sys.executable,
            BENCH,
            "--quick",
            "--model",
            "mlp",
            "--precision",
            "fp32",
            "--stages",
            "0",
            "--json",
            str(raw),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (cell,) = json.loads(raw.read_text())["cells"]
    assert set(cell["runs"]) == {"ours", "deepspeed", "ddp"}
    for side, runs in cell["runs"].items():
        ((step, peak),) = runs
        assert step > 0 and peak >= 0, side
    assert "| mlp | fp32 | 0 | DeepSpeed | " in done.stdout and "| mlp | fp32 | 0 | Lightning DDP | " in done.stdout
    assert "failed" not in done.stdout
    # --load renders the same table from the saved figures without measuring again
    again = subprocess.run(
        [sys.executable, BENCH, "--load", str(raw)], env=env, capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 0 and done.stdout.split("\n| model")[1] == again.stdout.split("\n| model")[1]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_memory_is_not_charged_for_its_lazy_imports():
    """DeepSpeed's initialize imports torch._dynamo/_inductor, sympy and triton (~150 MB): every worker loads them
    before the memory baseline, so a 20K-parameter model's peak growth stays near its real size on every side."""
    from benchmarks import _bench_workers as workers

    args = bench.parse(["--quick", "--nproc", "1", "--peers", "deepspeed"])
    step, peak = workers.measure({"model": "mlp", "precision": "fp32", "kind": "deepspeed:0"}, args)
    assert step > 0 and peak < 64 * 2**20, f"{peak / 2**20:.0f} MiB"


def test_profile_sums_fsdp_per_unit_ranges(tmp_path, deepspeed_listed):
    """The top-ops file gives shares of self CPU time, FSDP2's per-unit ranges summed into one line."""
    from benchmarks import _bench_workers as workers

    class Event:
        def __init__(self, key, us, count):
            self.key, self.self_cpu_time_total, self.count = key, us, count

    class Prof:
        def stop(self):
            pass

        def key_averages(self):
            return [
                Event("aten::mm", 40.0, 10),
                Event("FSDP::all_gather (net.0)", 20.0, 1),
                Event("FSDP::all_gather (net.2)", 30.0, 1),
                Event("aten::copy_", 10.0, 5),
                Event("idle", 0.0, 3),
            ]

    args = bench.parse(["--profile", str(tmp_path), "--profile-top", "2", "--steps", "1"])
    profiler = workers._StepProfiler(args, 0, {"model": "mlp", "precision": "fp32", "kind": "zero:3"})
    profiler.prof = Prof()
    profiler.finish()
    written = json.loads((tmp_path / "mlp_fp32_zero_3.json").read_text())
    assert written["top"] == [
        {"op": "FSDP::all_gather", "self_share": 0.5, "calls": 2},
        {"op": "aten::mm", "self_share": 0.4, "calls": 10},
    ]


def test_before_peer_needs_a_checkout_and_runs_ours_kind(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.parse(["--model", "gpt", "--stages", "1", "--peers", "before", "--no-deepspeed"])
    (tmp_path / "lightning_zero").mkdir()
    args = bench.parse(
        ["--model", "gpt", "--stages", "1", "--peers", "before", "minimal", "--before-src", str(tmp_path)]
    )
    assert bench.peer_kinds("1", args.peers) == [("before", "zero:1"), ("minimal", "minimal:1")]


def test_count_table_and_empty_table_render(tmp_path):
    import io

    from benchmarks import _bench_counts, _bench_empty

    record = {
        "job": {"model": "gpt", "precision": "fp32", "kind": "zero:1", "src": "/before"},
        "cycles": 3,
        "py_calls": 10.0,
        "areas": {"lightning": 4.0},
        "dtensor_dispatch": 0.0,
        "aten_ops": 7.0,
        "allocations": 2.0,
    }
    (tmp_path / "a.json").write_text(json.dumps(record))
    table = _bench_counts.table(str(tmp_path))
    assert "| gpt | fp32 | zero:1 (before) | 10 | 4 |" in table and table.rstrip().endswith("| 0 | 7 | 2 |")
    assert _bench_counts.area("/x/site-packages/lightning_zero/distributed/optimizer.py") == "lightning_zero"
    assert _bench_counts.area("/x/site-packages/lightning/pytorch/trainer/trainer.py") == "lightning"
    out = io.StringIO()
    _bench_empty.table(
        {
            "empty:bare": [(1e-5, 30)],
            "empty:trainer": [(1e-3, 1700)],
            "empty:bare-dp": [(1e-4, 50), (2e-4, 50)],
            "empty:ddp": [(2e-3, 1900), (3e-3, 1900)],
            "empty:zero1": [(4e-3, 2200), (4e-3, 2200)],
            "empty:deepspeed1": [(3.5e-3, 1200), (2.5e-3, 1200)],
        },
        out,
    )
    text = out.getvalue()
    assert "| Trainer, 1 process | 1000 [1000–1000] | 1700 | 990 [990–990] |  |  |" in text
    # ZeroStrategy's own cost: paired with Lightning's DDP (2000 and 1000 µs over it) and with DeepSpeed's engine at
    # the same stage (500 and 1500 µs over it), repeat by repeat
    assert (
        "| Trainer + ZeroStrategy(1), 2 ranks | 4000 [4000–4000] | 2200 | 3850 [3800–3900] "
        "| 1500 [1000–2000] | 1000 [500–1500] |"
    ) in text
    assert "| Trainer + Lightning's DDPStrategy, 2 ranks | 2500 [2000–3000] | 1900 | 2350 [1900–2800] |  |  |" in text
    assert "| DeepSpeed engine, ZeRO 1, 2 ranks | 3000 [2500–3500] | 1200 | 2850 [2300–3400] |  |  |" in text


def test_gpt2_is_gpt2_small_and_opt_in(deepspeed_listed):
    """``--model gpt2``: GPT-2 small's shape with the head tied to the token embedding (123.85M parameters, built
    on the meta device here so the test allocates nothing), accepted by the CLI and never part of ``all``."""
    import torch

    from benchmarks import _bench_models as models

    args = bench.parse(["--model", "gpt2", "--batch", "1"])
    assert args.model == ["gpt2"] and "gpt2" not in bench.parse(["--model", "all"]).model
    assert models.shape("gpt2", args) == {"n_layer": 12, "n_embd": 768, "n_head": 12, "block_size": 256, "vocab": 50257}
    with torch.device("meta"):
        gpt2 = models.build("gpt2", args)
    assert gpt2.head.weight is gpt2.tok.weight
    assert sum(p.numel() for p in gpt2.parameters()) == 123_849_984  # GPT-2 small (124.4M) with 256 positions
    assert "123.85M params" in models.describe("gpt2", args)
    assert len(models.units("gpt2", gpt2)) == 12
    ((x, y),) = models.batches("gpt2", bench.parse(["--model", "gpt2", "--quick", "--warmup", "0", "--steps", "1"]), 0)
    assert x.shape == y.shape == (2, 16)  # the quick shape: what the CLI's --quick runs


def test_steady_heap_reaches_every_spawned_rank_and_only_with_the_flag(monkeypatch, tmp_path, deepspeed_listed):
    """--steady-heap: glibc reads its MALLOC_* variables when a process starts, so they must be in the environment
    the ranks are spawned with (and gone afterwards, and absent without the flag)."""
    from benchmarks import _bench_workers as workers

    seen = []

    def fake_start(fn, args, nprocs, start_method):
        seen.append({name: os.environ.get(name) for name in workers.STEADY_HEAP})
        out = args[4]
        for rank in range(nprocs):
            with open(f"{out}.{rank}", "w") as f:
                json.dump({"time": 0.1, "peak": 1}, f)

    monkeypatch.setattr(workers.mp, "start_processes", fake_start)
    for name in workers.STEADY_HEAP:
        monkeypatch.delenv(name, raising=False)
    job = {"model": "mlp", "precision": "fp32", "kind": "zero:1"}
    workers.spawn(job, bench.parse(["--model", "mlp", "--steady-heap"]))
    workers.spawn(job, bench.parse(["--model", "mlp"]))
    assert seen == [dict(workers.STEADY_HEAP), dict.fromkeys(workers.STEADY_HEAP)]
    assert all(name not in os.environ for name in workers.STEADY_HEAP)


def test_engine_split_pairs_each_repeat(capsys, deepspeed_listed):
    cell = {
        "model": "gpt",
        "precision": "fp32",
        "stage": "2",
        "runs": {"ours": [(1.2, 1), (2.4, 1)], "minimal": [(1.0, 1), (2.0, 1)], "engine": [(1.1, 1), (1.6, 1)]},
    }
    bench.render([cell])
    out = capsys.readouterr().out
    # ours / engine paired per repeat: 1.2/1.1 and 2.4/1.6; engine / minimal: 1.1 and 0.8
    assert "| gpt | fp32 | 2 | 1.20 | 1.30 [1.09–1.50] | 0.95 [0.80–1.10] |" in out
    bench.render([dict(cell, runs={"ours": cell["runs"]["ours"], "minimal": cell["runs"]["minimal"]})])
    assert "engine / minimal" not in capsys.readouterr().out  # only where both yardsticks ran


def test_a_measured_run_leaves_a_dated_record_that_load_renders(tmp_path, capsys, monkeypatch, deepspeed_listed):
    """A measured run writes ``bench_stages-<date>.md`` (its command and tables) and the ``.json`` beside it, which
    ``--load`` renders again; a second run the same day gets its own files; ``--quick`` runs and ``--no-results``
    leave none in the default folder."""
    import re

    from benchmarks import _bench_workers as workers
    from benchmarks import common

    monkeypatch.setattr(workers, "measure", lambda job, _args: (1.0, 100 << 20))
    monkeypatch.setattr(common, "RESULTS_DIR", str(tmp_path / "default"))
    argv = ["--quick", "--model", "mlp", "--precision", "fp32", "--stages", "0", "--peers", "deepspeed"]
    bench.main([*argv, "--results", str(tmp_path)])
    (md,) = tmp_path.glob("bench_stages-*.md")
    assert re.fullmatch(r"bench_stages-\d{4}-\d{2}-\d{2}\.md", md.name)
    text = md.read_text()
    assert f"`python -m benchmarks.bench_stages {' '.join(argv)} --results {tmp_path}`" in text
    assert "| mlp | fp32 | 0 | DeepSpeed | 1.00 " in text and text.startswith("2 ranks, cpu")
    capsys.readouterr()
    bench.main(["--load", str(md.with_suffix(".json"))])
    assert "| mlp | fp32 | 0 | DeepSpeed | 1.00 " in capsys.readouterr().out
    bench.main([*argv, "--results", str(tmp_path)])
    assert sorted(p.name for p in tmp_path.glob("bench_stages-*")) == sorted(
        [md.name, md.with_suffix(".json").name, md.stem + "-2.md", md.stem + "-2.json"]
    )
    bench.main(argv)
    bench.main([*argv[1:], "--no-results"])
    assert not (tmp_path / "default").exists()
    bench.main(argv[1:])  # a full-size run: its record goes to benchmarks/results by default
    assert len(list((tmp_path / "default").glob("bench_stages-*.md"))) == 1
    with pytest.raises(SystemExit):
        bench.parse(["--results", str(tmp_path), "--no-results"])
