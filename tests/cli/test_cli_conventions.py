"""What a new user meets first on the ``lightning-zero`` command line: a fast ``--help`` that imports no torch,
``--version``, errors shown with the subcommand's usage, both spellings of every long option, the defaults said
aloud, and ``advise`` reading a Hugging Face ``config.json`` while refusing a ds_config by name."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_zero_cli
from lightning_zero.cli import build_parser, toplevel
from lightning_zero.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]


def test_help_and_version_import_neither_torch_nor_the_package():
    code = (
        "import sys, lightning_zero_cli\n"
        "for argv in (['--help'], ['--version'], []):\n"
        "    try:\n"
        "        lightning_zero_cli.main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = sorted(m for m in ('torch', 'lightning', 'lightning_zero') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "usage: lightning-zero" in done.stdout and f"lightning-zero {toplevel.__version__}" in done.stdout


def test_the_console_script_enters_through_the_light_module():
    pyproject = (ROOT / "pyproject.toml").read_text()  # no tomllib: Python 3.10 is supported
    assert re.search(r'^lightning-zero = "lightning_zero_cli:main"$', pyproject, re.M)
    import lightning_zero

    version = re.search(r'^version = "(.*)"$', pyproject, re.M).group(1)
    assert toplevel.__version__ == lightning_zero.__version__ == version


def test_the_light_help_is_the_full_parsers_help(capsys):
    with pytest.raises(SystemExit):
        lightning_zero_cli.main(["--help"])
    light = capsys.readouterr().out
    assert light == build_parser().format_help()


def test_a_subcommand_error_shows_the_subcommands_usage(capsys):
    with pytest.raises(SystemExit) as exit:
        cli_main(["diagnose", "--no-such-flag"])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: lightning-zero diagnose") and "unrecognized arguments: --no-such-flag" in err


@pytest.mark.parametrize("flag", ["--nproc_per_node", "--nproc-per-node"])
def test_long_options_take_both_spellings(flag):
    parser = build_parser()
    assert parser.parse_args(["diagnose", flag, "3"]).nproc_per_node == 3
    assert parser.parse_args(["estimate", "--params", "1e6", "--world_size", "2"]).world_size == 2
    assert parser.parse_args(["launch", "--nproc_per_node", "2", "train.py"]).num_gpus == 2


def test_estimate_defaults_to_the_trainers_precision(capsys):
    assert cli_main(["estimate", "--params", "1e6", "--world-size", "2", "--stage", "0"]) == 0
    assert "32-true" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["estimate", "--help"])
    assert "default: 32-true" in " ".join(capsys.readouterr().out.split())


def test_network_only_without_master_addr_says_what_it_did_not_check(monkeypatch, capsys):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert cli_main(["diagnose", "--network-only"]) == 0
    out = capsys.readouterr().out
    assert "None" not in out and "no MASTER_ADDR set" in out


def test_advise_refuses_a_ds_config_by_name(tmp_path):
    config = tmp_path / "ds_config.json"
    config.write_text((ROOT / "examples" / "configs" / "ds_config.json").read_text())
    with pytest.raises(SystemExit, match="is a DeepSpeed ds_config, which holds no model"):
        cli_main(["advise", "--config", str(config), "--model", f"{ROOT}/examples/gpt.py:GPTModule"])


def test_advise_reads_a_hugging_face_config_json(tmp_path, capsys):
    pytest.importorskip("transformers")
    shape = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 500,
        "max_position_embeddings": 128,
    }
    model_dir = tmp_path / "llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(shape))
    argv = [
        "advise",
        "--config",
        str(model_dir),
        "--devices",
        "2",
        "--accelerator",
        "cpu",
        "--device-memory",
        "1",
        "--cpu-memory",
        "4",
        "--output-dir",
        str(tmp_path / "out"),
    ]
    assert cli_main(argv) == 0
    from transformers import AutoConfig, AutoModelForCausalLM

    params = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.for_model(**shape)).parameters())
    out = capsys.readouterr().out
    assert f"{params / 1e6:.1f}M parameters" in out and "seq 128, hidden 64, 3 layers" in out
    assert (tmp_path / "out" / "advise.yaml").exists()
