"""``deepspeed --no_local_rank`` launches: the node rank comes from the launcher's ``CROSS_RANK``/``CROSS_SIZE``."""

import base64
import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_zero.adapters.launch_checks import adopt_deepspeed_launcher_node_rank, check_deepspeed_launcher_nodes
from tests.ranks import free_port

REPO = Path(__file__).resolve().parents[2]


def test_cross_rank_becomes_the_node_rank_when_none_is_set(monkeypatch):
    # The function writes os.environ itself: give it a copy, so NODE_RANK cannot leak into later tests.
    names = ("NODE_RANK", "GROUP_RANK", "CROSS_RANK", "CROSS_SIZE")
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in names})
    adopt_deepspeed_launcher_node_rank()
    assert "NODE_RANK" not in os.environ  # not a deepspeed launch: nothing set
    monkeypatch.setenv("CROSS_RANK", "1")
    adopt_deepspeed_launcher_node_rank()
    assert os.environ["NODE_RANK"] == "1"
    adopt_deepspeed_launcher_node_rank()  # agreeing values are fine
    monkeypatch.setenv("NODE_RANK", "0")
    with pytest.raises(ValueError, match="NODE_RANK=0 and CROSS_RANK=1"):
        adopt_deepspeed_launcher_node_rank()
    monkeypatch.setenv("CROSS_SIZE", "2")
    check_deepspeed_launcher_nodes(2)
    with pytest.raises(ValueError, match=r"CROSS_SIZE=2.*num_nodes=1"):
        check_deepspeed_launcher_nodes(1)


def _start_as_node_one_of_a_deepspeed_launch(monkeypatch, start):
    """Start a strategy as the only rank of node 1 of a 2-node ``deepspeed --no_local_rank`` launch (node 0 never
    comes, so the start fails at the rendezvous); return the node rank and global rank it took."""
    from lightning_zero.diagnostics.network import NetworkError

    names = ("NODE_RANK", "GROUP_RANK", "CROSS_RANK", "CROSS_SIZE")
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in names})  # no leak
    for key, value in dict(
        CROSS_RANK="1",
        CROSS_SIZE="2",
        RANK="1",
        LOCAL_RANK="0",
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    ).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(NetworkError) as failure:
        start()
    return failure, os.environ.get("NODE_RANK")


def test_fabric_and_trainer_take_the_deepspeed_launchers_node_rank_alike(monkeypatch, tmp_path):
    # One code path before the process group (validation.check_before_process_group): Fabric adopted no CROSS_RANK
    # before, so its rank of node 1 called itself node 0 (global rank 0) and hosted the rendezvous itself.
    from lightning.fabric import Fabric
    from lightning.pytorch import Trainer

    from lightning_zero import ZeroStrategy
    from lightning_zero.fabric import ZeroStrategy as FabricZeroStrategy
    from tests.lightning_models import RegressionModule

    def fabric():
        Fabric(
            strategy=FabricZeroStrategy(stage=2, rendezvous_timeout=1), accelerator="cpu", devices=1, num_nodes=2
        ).launch()

    def trainer():
        Trainer(
            strategy=ZeroStrategy(stage=2, rendezvous_timeout=1),
            accelerator="cpu",
            devices=1,
            num_nodes=2,
            max_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp_path,
        ).fit(RegressionModule())

    for start in (trainer, fabric):
        failure, node_rank = _start_as_node_one_of_a_deepspeed_launch(monkeypatch, start)
        assert node_rank == "1", start.__name__
        # node 1's rank waits for node 0's master, rather than hosting the rendezvous as global rank 0
        assert failure.match(r"node rank 1 \(rank 1, .*cannot reach MASTER_ADDR"), start.__name__


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="runs DeepSpeed's launcher: deepspeed is not installed (pip install -e '.[test]')",
)
def test_two_node_deepspeed_launch_with_no_local_rank_trains_hsdp_like_one_process(tmp_path):
    """Both "nodes" of a 2 x 2 launch run here, each through DeepSpeed's per-node launcher, as ``deepspeed`` runs
    it over pdsh. Before CROSS_RANK was read, node 1's ranks took node 0's global ranks and the job hung."""
    from tests.strategies.test_strategy_checkpoint import _reference

    world_info = base64.urlsafe_b64encode(json.dumps({"nodeA": [0, 1], "nodeB": [0, 1]}).encode()).decode()
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("NODE_RANK", None)
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "deepspeed.launcher.launch",
                f"--world_info={world_info}",
                f"--node_rank={node}",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                "--no_local_rank",
                "--module",
                "tests.reliability.deepspeed_launch_job",
                str(tmp_path),
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for node in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=300)[0] for node in nodes]
    finally:
        for node in nodes:  # the launcher and the ranks it started (a hang must not outlive the test)
            try:
                os.killpg(node.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert all(node.returncode == 0 for node in nodes), "\n".join(out[-3000:] for out in outputs)
    expected = _reference(1, 4 * 4)  # 4 ranks x batch 4, like one process on the whole batch
    for rank in range(4):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert (result["global_rank"], result["node_rank"], result["world_size"]) == (rank, rank // 2, 4)
        assert result["mesh"] == (2, 2)
        for key, value in expected.items():
            assert (result["weights"][key] - value).abs().max().item() <= 1e-5, (rank, key)
