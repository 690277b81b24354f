"""A training script for ``lightning-zero launch``/torchrun or srun: ``launch_job.py <out.pt> [stage]``.
ZeroStrategy on CPU ranks, as many nodes and processes per node as the launcher started (read from torchrun's or
SLURM's environment); rank 0 writes the full weights, the world layout and the wall time of the fit to ``<out.pt>``."""

import os
import sys
import time

import torch
from lightning.pytorch import Trainer

from lightning_zero import ZeroStrategy
from tests.lightning_models import RegressionModule, full_state


def main(out: str, stage: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if "SLURM_NTASKS" in os.environ:  # srun (or a test standing in for it)
        nproc, nodes = int(os.environ["SLURM_NTASKS_PER_NODE"]), int(os.environ["SLURM_NNODES"])
    else:  # torchrun
        nproc = int(os.environ["LOCAL_WORLD_SIZE"])
        nodes = int(os.environ["WORLD_SIZE"]) // nproc
    trainer = Trainer(
        strategy=ZeroStrategy(stage=stage),
        accelerator="cpu",
        devices=nproc,
        num_nodes=nodes,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    module = RegressionModule()
    start = time.perf_counter()
    trainer.fit(module)
    seconds = time.perf_counter() - start
    state = full_state(module)
    if trainer.global_rank == 0:
        torch.save(
            {"weights": state, "nodes": nodes, "nproc": nproc, "seconds": seconds, "global_step": trainer.global_step},
            out,
        )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3)
