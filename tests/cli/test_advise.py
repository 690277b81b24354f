"""``lightning-zero advise``: the ladder, the fit verdicts, the written configurations and ``--measure``."""

from __future__ import annotations

import json
import os

import pytest

from lightning_zero.cli import ladder as ladder_mod
from lightning_zero.cli import main
from lightning_zero.cli.ladder import Machine, Rung, ds_config, ladder, predict, predicted_winner
from lightning_zero.estimate.activations import TransformerShape

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT_ARGS = [
    "--config",
    os.path.join(ROOT, "examples/configs/zero3.yaml"),
    "--model",
    os.path.join(ROOT, "examples/gpt.py") + ":GPTModule",
    "--data",
    os.path.join(ROOT, "examples/train_gpt.py") + ":CharDataModule",
]
SHAPE = TransformerShape(hidden=128, layers=4, heads=4, seq_len=64, micro_batch=16, vocab=65)
GIB = 1024**3


@pytest.fixture
def with_checkpointing(monkeypatch):
    """As if ZeroStrategy accepted activation_checkpointing/cpu_checkpointing."""
    monkeypatch.setattr(ladder_mod, "strategy_supports", lambda *names: True)


def test_ladder_follows_the_documented_order_and_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(ladder_mod, "strategy_supports", lambda *names: "activation_checkpointing" not in names)
    rungs = ladder(4)
    steps = [r.step for r in rungs]
    assert steps[:12] == [
        "data parallel",
        "+ activation checkpointing",
        "ZeRO-2",
        "ZeRO-2 + optimizer offload",
        "ZeRO-3",
        "+ parameter offload",
        "+ optimizer offload",
        "+ parameter and optimizer offload",
        "+ checkpoints in CPU memory",
        "smaller micro-batch",
        "smaller micro-batch",
        "NVMe offload",
    ]
    assert [r.micro_batch for r in rungs[9:11]] == [2, 1]
    assert rungs[11].reason.startswith("not picked, it needs nvme_path") and rungs[11].offload == "nvme"
    assert rungs[1].reason == "needs activation checkpointing support" and rungs[0].reason == ""
    grid = {
        (r.stage, r.offload, r.checkpointing)
        for r in rungs
        if r.micro_batch == 4 and r.step != "+ parameter offload" and not r.optimizer_only
    }
    assert len(grid) == 21  # stage 0-3 x offload (none, cpu; stage 0: none) x checkpointing (none, full, full+cpu)


def test_first_fitting_runnable_rung_wins(with_checkpointing):
    rungs = ladder(16)
    stage0 = predict(rungs[:1], 800_000, SHAPE, Machine(2, GIB, 64 * GIB, "cuda"), "32-true")[0]
    assert stage0.fits
    # A device just too small for data parallelism: checkpointing is the first rung that fits.
    small = int(stage0.estimate.accelerator_peak / 0.9) - 1
    preds = predict(rungs, 800_000, SHAPE, Machine(2, small, 64 * GIB, "cuda"), "32-true", 150_000)
    assert not preds[0].fits and predicted_winner(preds).rung.step == "+ activation checkpointing"
    peaks = [p.estimate.accelerator_peak for p in preds[:8] if p.estimate and not p.rung.reason]
    # Speed order, not memory order (ZeRO-2 + offload holds less on the device than ZeRO-3), but every rung saves
    # on data parallelism and the last one holds the least.
    assert peaks[0] == max(peaks) and peaks[-1] == min(peaks) and len(set(peaks)) == len(peaks)
    tiny = predict(rungs, 800_000, SHAPE, Machine(2, 1, 64 * GIB, "cuda"), "32-true")
    assert predicted_winner(tiny) is None


def test_stage_3_with_the_optimizer_alone_offloaded_wins_where_it_is_enough(with_checkpointing):
    """Between ZeRO-3 and offloading everything: the optimizer alone in CPU memory, parameters on the device
    (DeepSpeed's offload_optimizer without offload_param). It is the winner where ZeRO-3 does not fit and it does,
    and its configuration keeps the parameters on the device in every form advise writes."""
    from lightning_zero import ZeroStrategy

    rungs = ladder(16)
    opt_only = next(r for r in rungs if r.optimizer_only)
    assert opt_only.step == "+ optimizer offload"
    assert rungs.index(opt_only) == [r.step for r in rungs].index("ZeRO-3") + 2
    assert opt_only.strategy_kwargs() == {"stage": 3, "offload_optimizer": "cpu", "activation_checkpointing": True}
    assert ds_config(opt_only, "32-true")["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu"}}
    config = ZeroStrategy(**opt_only.strategy_kwargs()).zero_config
    assert (config.offload_optimizer, config.offload_params) == ("cpu", "none")
    # A device between the two rungs' predicted peaks: ZeRO-3 does not fit, optimizer offload does.
    machine = lambda memory: Machine(8, memory, 64 * GIB, "cuda")  # noqa: E731  (8 ranks: ZeRO-3 holds less than ZeRO-2 + offload)
    unit = 500_000  # 16 units: ZeRO-3 gathers one at a time
    (zero3,) = predict([next(r for r in rungs if r.step == "ZeRO-3")], 8_000_000, SHAPE, machine(GIB), "32-true", unit)
    (offloaded,) = predict([opt_only], 8_000_000, SHAPE, machine(GIB), "32-true", unit)
    assert offloaded.estimate.accelerator_peak < zero3.estimate.accelerator_peak
    between = int((offloaded.estimate.accelerator_peak + zero3.estimate.accelerator_peak) / 2 / 0.9)
    winner = predicted_winner(predict(rungs, 8_000_000, SHAPE, machine(between), "32-true", unit))
    assert winner is not None and winner.rung == opt_only, winner and winner.rung.label


def test_ds_config_refuses_a_precision_it_cannot_express():
    with pytest.raises(ValueError, match="bf16-true"):
        ds_config(Rung("x", 2, None, "none", 4), "bf16-true")
    assert ds_config(Rung("x", 3, "cpu", "full", 4), "bf16-mixed")["zero_optimization"] == {
        "stage": 3,
        "offload_optimizer": {"device": "cpu"},
        "offload_param": {"device": "cpu"},
    }


def _predicted(args, tmp_path):
    """CPU memory that holds stage 0 on 2 ranks only without headroom: data parallelism does not fit."""
    from lightning_zero.cli.advise_model import infer_shape, instantiate, read_config

    spec = read_config(args[1], args[3], args[5])
    module = instantiate(spec)
    kwargs, params, unit = infer_shape(module, spec, {})
    return kwargs, params, unit


def test_advise_on_the_gpt_config_writes_loadable_configurations(tmp_path, capsys):
    from lightning_zero import ZeroStrategy

    kwargs, params, unit = _predicted(GPT_ARGS, tmp_path)
    assert (kwargs["hidden"], kwargs["layers"], kwargs["heads"], kwargs["seq_len"], kwargs["vocab"]) == (
        128,
        4,
        4,
        64,
        len(__import__("train_gpt").CharDataModule().dataset.chars),
    )
    shape = TransformerShape(micro_batch=16, **kwargs)
    rungs = ladder(16)
    stage0 = predict(rungs[:1], params, shape, Machine(2, GIB, GIB, "cpu"), "32-true", unit)[0].estimate
    cpu_gib = 2 * (stage0.accelerator_peak + stage0.cpu_peak) / 0.9 / GIB * 0.98  # stage 0 just does not fit
    code = main(["advise", *GPT_ARGS, "--cpu-memory", f"{cpu_gib:.6f}", "--output-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "winner" in out and "NVMe offload" in out
    snippet = (tmp_path / "advise.yaml").read_text()
    # Plain data parallelism does not fit: the winner is a later rung (stage 0 with activation checkpointing
    # is the next one on the ladder).
    assert "class_path: lightning_zero.ZeroStrategy" in snippet
    assert "stage: 0" not in snippet or "activation_checkpointing: true" in snippet
    # The snippet loads through the example's LightningCLI, on top of the config it was derived from.
    from train_gpt import GPTCLI, CharDataModule, GPTModule

    cli = GPTCLI(
        GPTModule, CharDataModule, run=False, args=["--config", GPT_ARGS[1], "--config", str(tmp_path / "advise.yaml")]
    )
    strategy = cli.trainer.strategy
    chosen = json.loads((tmp_path / "advise_ds_config.json").read_text())
    assert isinstance(strategy, ZeroStrategy)
    assert strategy.zero_config.stage == chosen["zero_optimization"]["stage"]
    assert strategy.zero_config.stage > 0 or strategy.activation_checkpoint_config is not None
    assert (strategy.activation_checkpoint_config is not None) == ("activation_checkpointing" in chosen)
    assert cli.datamodule.batch_size == chosen["train_micro_batch_size_per_gpu"]
    assert ZeroStrategy(config=str(tmp_path / "advise_ds_config.json")).zero_config == strategy.zero_config
    # The files are the user's now: a second run does not replace them unasked.
    with pytest.raises(SystemExit, match="already exist"):
        main(["advise", *GPT_ARGS, "--output-dir", str(tmp_path)])


def test_advise_names_the_size_it_cannot_infer(tmp_path):
    with pytest.raises(SystemExit, match="--heads"):
        main(
            [
                "advise",
                "--model",
                "torch.nn:Transformer",
                "--init-args",
                "d_model=16",
                "nhead=2",
                "--output-dir",
                str(tmp_path),
            ]
        )


def test_measure_reports_out_of_memory_as_does_not_fit():
    from lightning_zero.cli.advise_measure import measure_rung

    spec = {
        "model_class": "tests.advise_models:OutOfMemoryGPT",
        "init_args": {},
        "strategy": {"stage": 0},
        "precision": "32-true",
        "accelerator": "cpu",
        "devices": 1,
        "micro_batch": 2,
        "seq_len": 16,
        "vocab": 17,
        "steps": 1,
        "warmup": 0,
    }
    result = measure_rung(spec)
    assert result["status"] == "oom" and "MemoryError" in result["message"], result


@pytest.mark.slow  # two 2-rank training runs in fresh processes: ~40 s on 2 cores
def test_measure_runs_candidates_and_ranks_them_by_throughput(tmp_path, capsys):
    code = main(
        [
            "advise",
            "--model",
            "tests.advise_models:TinyGPT",
            "--devices",
            "2",
            "--accelerator",
            "cpu",
            "--micro-batch",
            "2",
            "--measure",
            "--max-candidates",
            "2",
            "--steps",
            "2",
            "--output-dir",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "fastest measured" in out
    assert out.count(" fits ") + out.count("│ fits") >= 2, out  # both candidates ran
    assert "not measured" in out


def test_the_installed_strategy_builds_every_checkpointing_rung():
    """With ``ZeroStrategy(activation_checkpointing, cpu_checkpointing)`` merged, no rung waits for it any more, the
    grid has stages 0-3 x offload x checkpointing, and each rung's arguments construct the strategy as labelled."""
    from lightning_zero import ZeroStrategy

    rungs = ladder(4)
    assert not [r.label for r in rungs if r.reason.startswith("needs")]
    runnable = {(r.stage, r.offload, r.checkpointing) for r in rungs if not r.reason and r.micro_batch == 4}
    assert runnable == {
        (s, o, c)
        for s in (0, 1, 2, 3)
        for o in ((None,) if s == 0 else (None, "cpu"))
        for c in ("none", "full", "full+cpu")
    }
    for rung in rungs:
        if rung.reason or rung.checkpointing == "none":
            continue
        config = ZeroStrategy(**rung.strategy_kwargs()).activation_checkpoint_config
        assert config is not None and config.cpu_checkpointing == (rung.checkpointing == "full+cpu"), rung.label


def test_available_cpu_memory_is_what_the_cgroup_leaves(monkeypatch):
    # One reading of host memory (distributed/init.available_host_memory): a cgroup's limit minus its usage, not the
    # limit alone (the advise ladder used to count memory the job's cgroup already uses as free).
    import builtins
    import io

    gib = 1 << 30
    files = {
        "/proc/meminfo": f"MemTotal: {128 * gib // 1024} kB\nMemAvailable: {64 * gib // 1024} kB\n",
        "/sys/fs/cgroup/memory.max": f"{16 * gib}\n",
        "/sys/fs/cgroup/memory.current": f"{10 * gib}\n",
    }
    real_open = builtins.open
    monkeypatch.setattr(
        builtins, "open", lambda path, *a, **k: io.StringIO(files[path]) if path in files else real_open(path, *a, **k)
    )
    assert ladder_mod.available_cpu_memory() == 6 * gib
