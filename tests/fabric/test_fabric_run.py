"""``python -m lightning_zero.fabric run --strategy zero_stage_3 script.py``: Fabric's own CLI, with the ZeRO names
known to its ``--strategy`` choices (plain ``fabric run`` cannot know them: see lightning_zero/fabric/__main__.py)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.distributed.test_zero_parity import train_reference
from tests.ranks import free_port, job_output

ROOT = Path(__file__).resolve().parents[2]


def _run(*args, timeout=300, plain=False, **env_vars):
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "OMP_NUM_THREADS": "1",
        **env_vars,
    }
    command = [shutil.which("fabric")] if plain else [sys.executable, "-m", "lightning_zero.fabric"]
    return subprocess.run([*command, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # two fresh interpreters under torchrun: about a minute on a busy 2-core machine
@pytest.mark.parametrize(
    "route",
    ["python -m lightning_zero.fabric run --strategy zero_stage_3", "LT_STRATEGY=zero_stage_3_offload fabric run"],
)
def test_fabric_run_with_zero_stage_3_trains_with_parity(tmp_path, route):
    out = tmp_path / "weights.pt"
    args = [
        "run",
        "--accelerator",
        "cpu",
        "--devices",
        "2",
        "--main-port",
        str(free_port()),
        "tests/fabric/fabric_run_script.py",
        str(out),
    ]
    if route.startswith("LT_STRATEGY"):  # plain `fabric run`: the script's Fabric() reads the name from the env
        if shutil.which("fabric") is None:
            pytest.skip("the `fabric` command is not on PATH")
        result = _run(*args, plain=True, LT_STRATEGY="zero_stage_3_offload")
        offload = "cpu"
    else:
        result = _run(*args[:5], "--strategy", "zero_stage_3", *args[5:])
        offload = "none"
    assert result.returncode == 0, job_output(result)
    saved = torch.load(out, weights_only=True)
    assert saved["strategy"] == "lightning_zero.fabric.fabric_strategy" and saved["stage"] == 3
    assert saved["offload"] == offload
    expected = train_reference(2)
    for key, value in expected.items():
        torch.testing.assert_close(saved["weights"][key], value, rtol=0, atol=1e-5, msg=key)


def test_fabric_run_help_lists_the_zero_names():
    result = _run("run", "--help", timeout=120)
    assert result.returncode == 0, result.stderr
    for name in ("zero", "zero_stage_1", "zero_stage_2", "zero_stage_3"):
        assert name in result.stdout
