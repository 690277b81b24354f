"""The LightningCLI example: every YAML under examples/configs trains a few steps on 2 CPU ranks."""

import glob
import importlib.util
import math
import os

import pytest
import torch

from tests.ranks import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "examples", "configs", "*.yaml")))


def _load_example():
    spec = importlib.util.spec_from_file_location("train_gpt", os.path.join(ROOT, "examples", "train_gpt.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cli_worker(rank, world_size, config, root_dir):
    os.chdir(ROOT)  # the ds_config YAML names its JSON relative to the repository root, as the README runs it
    # default_root_dir: LightningCLI saves the run's config.yaml there, not into the repository
    cli = _load_example().main(
        [
            "fit",
            "--config",
            config,
            "--trainer.max_steps",
            "2",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.enable_model_summary",
            "false",
            "--trainer.default_root_dir",
            root_dir,
        ]
    )
    trainer = cli.trainer
    assert trainer.global_step == 2
    assert trainer.world_size == world_size
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    name = os.path.basename(config)
    if name == "ds_config.yaml":
        assert trainer.strategy.stage == 2 and trainer.strategy.zero_config.offload == "cpu"
        assert trainer.accumulate_grad_batches == 2 and trainer.gradient_clip_val == 1.0
    if "bf16" in name:
        assert trainer.precision == "bf16-mixed"
    if "fp16" in name:
        assert trainer.strategy.precision_plugin.scaler.initial_scale_power == 12


def test_every_example_config_is_covered():
    names = {os.path.basename(c)[:-5] for c in CONFIGS}
    assert {
        "zero0",
        "zero1",
        "zero2",
        "zero3",
        "zero2_offload",
        "zero3_offload",
        "zero3_bf16",
        "zero2_fp16",
        "ds_config",
    } <= names


@pytest.mark.parametrize("config", CONFIGS, ids=[os.path.basename(c) for c in CONFIGS])
def test_example_config_trains(config, tmp_path):
    run_distributed(_cli_worker, 2, config, str(tmp_path))
    assert (tmp_path / "config.yaml").is_file()


def _fabric_example_worker(rank, world_size, save):
    spec = importlib.util.spec_from_file_location("fabric_gpt", os.path.join(ROOT, "examples", "fabric_gpt.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    loss = example.main(
        [
            "--max-steps",
            "8",
            "--n-layer",
            "2",
            "--n-embd",
            "32",
            "--block-size",
            "16",
            "--stage",
            "2",
            "--offload",
            "cpu",
            "--accumulate",
            "2",
            "--save",
            save,
        ]
    )
    vocab = len(example.CharDataset(example.corpus(), 16).chars)
    assert math.isfinite(loss) and loss < math.log(vocab) - 0.1, loss  # below an untrained model's (uniform) loss


def test_fabric_gpt_example_trains_and_saves(tmp_path):
    save = str(tmp_path / "fabric_gpt.ckpt")
    run_distributed(_fabric_example_worker, 2, save)
    from lightning_zero.checkpoint.directory import read_checkpoint_info

    assert read_checkpoint_info(save)["stage"] == 2


@pytest.mark.parametrize(
    "override, named",
    [
        ("--trainer.strategy.init_args.stage=4", "Literal[0, 1, 2, 3]"),
        ("--trainer.strategy.init_args.offload=gpu", "Literal['none', 'cpu'"),
    ],
)
def test_print_config_refuses_a_bad_stage_or_offload(override, named, capsys):
    """`python examples/train_gpt.py fit --config ... --print_config` with a bad stage or offload: LightningCLI
    checks ZeroStrategy's stage and offload while it parses the config (their Literal types) and exits naming the
    choices, instead of `fit` failing inside the Trainer."""
    config = os.path.join(ROOT, "examples", "configs", "zero3.yaml")
    with pytest.raises(SystemExit) as exit:
        _load_example().main(["fit", "--config", config, override, "--print_config"])
    assert exit.value.code != 0
    assert named in capsys.readouterr().err
