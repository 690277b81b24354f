"""Multi-node Fabric: ``python -m lightning_zero.fabric run --num-nodes 2 --node-rank K
--main-address A`` and plain ``fabric run`` with ``LT_STRATEGY``, one process on each of two simulated hosts (network
namespaces where possible, loopback otherwise), train to bitwise the weights of one node with the same world size."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_zero.diagnostics.network import free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPT = "tests/fabric/fabric_run_script.py"


def _fabric_run(hosts, node, num_nodes, devices, port, out, plain=False, strategy="zero_stage_3"):
    """One node's ``fabric run`` (``plain``: Fabric's own command, the strategy from ``LT_STRATEGY``)."""
    if plain:
        command, extra_env = [shutil.which("fabric")], {"LT_STRATEGY": strategy}
        strategy_args = []
    else:
        command, extra_env = [sys.executable, "-m", "lightning_zero.fabric"], {}
        strategy_args = ["--strategy", strategy]
    command = (
        hosts.prefix(node)
        + command
        + [
            "run",
            "--accelerator",
            "cpu",
            "--devices",
            str(devices),
            "--num-nodes",
            str(num_nodes),
            "--node-rank",
            str(node),
            "--main-address",
            hosts.addresses[0],
            "--main-port",
            str(port),
            *strategy_args,
            SCRIPT,
            str(out),
        ]
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **hosts.env(node), **extra_env}
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def _finish(proc, timeout=300):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{proc.args} did not finish within {timeout} s:\n{out[-3000:]}")
    return proc.returncode, out


def _one_and_two_nodes(hosts, tmp_path, plain):
    one = _fabric_run(hosts, 0, 1, 2, free_port(), tmp_path / "one.pt", plain=plain)
    code, log = _finish(one)
    assert code == 0, log[-3000:]
    port = free_port()
    procs = [_fabric_run(hosts, node, 2, 1, port, tmp_path / "two.pt", plain=plain) for node in (0, 1)]
    for code, log in [_finish(p) for p in procs]:
        assert code == 0, log[-3000:]
    one_node, two_nodes = (torch.load(tmp_path / f"{n}.pt", weights_only=True) for n in ("one", "two"))
    assert one_node["stage"] == two_nodes["stage"] == 3
    assert two_nodes["strategy"] == "lightning_zero.fabric.fabric_strategy"
    for key, value in one_node["weights"].items():
        assert torch.equal(two_nodes["weights"][key], value), key


@pytest.mark.slow  # four fresh interpreters under torchrun
def test_two_node_fabric_run_equals_one_node(hosts, tmp_path):
    _one_and_two_nodes(hosts, tmp_path, plain=False)


@pytest.mark.slow
def test_two_node_plain_fabric_run_with_lt_strategy_equals_one_node(hosts, tmp_path):
    if shutil.which("fabric") is None:
        pytest.skip("the `fabric` command is not on PATH")
    _one_and_two_nodes(hosts, tmp_path, plain=True)
