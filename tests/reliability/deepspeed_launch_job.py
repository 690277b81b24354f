"""A training script for DeepSpeed's launcher with ``--no_local_rank`` (``python -m deepspeed.launcher.launch
--world_info=<2 nodes x 2> --node_rank=<n> --no_local_rank -m tests.reliability.deepspeed_launch_job <out>``, what
``deepspeed`` runs on each node): 2 nodes x 2 processes, HSDP with a shard group per node. Every rank writes the
ranks it used and the final full weights to ``<out>/rank<RANK>.pt``."""

import os
import sys

import torch
from lightning.pytorch import Trainer

from lightning_zero import ZeroStrategy
from tests.lightning_models import RegressionModule, full_state


def main(out: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    trainer = Trainer(
        strategy=ZeroStrategy(stage=2, hybrid_shard_size=2, timeout=120),
        accelerator="cpu",
        devices=2,
        num_nodes=2,
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=out,
    )
    module = RegressionModule(batch_size=4)
    trainer.fit(module)
    torch.save(
        {
            "global_rank": trainer.global_rank,
            "node_rank": trainer.node_rank,
            "world_size": trainer.world_size,
            "mesh": tuple(trainer.strategy.device_mesh.shape),
            "weights": full_state(module),
        },
        os.path.join(out, f"rank{os.environ['RANK']}.pt"),
    )


if __name__ == "__main__":
    main(sys.argv[1])
