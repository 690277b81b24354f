"""Launched by ``python -m lightning_zero.fabric run --strategy zero_stage_3`` and by plain ``fabric run`` with
``LT_STRATEGY`` in test_fabric_run.py."""

import sys

import torch
from lightning.fabric import Fabric

import lightning_zero  # noqa: F401  (registers the strategy names in this process)
from tests.fabric.test_fabric_parity import fabric_train, full_weights

if __name__ == "__main__":
    fabric = Fabric()  # accelerator, devices and strategy come from the command line, which also launched it
    model, _ = fabric_train(fabric, fabric.global_rank, fabric.world_size)
    weights = full_weights(model._forward_module)
    if fabric.global_rank == 0:
        torch.save(
            {
                "strategy": type(fabric.strategy).__module__,
                "stage": fabric.strategy.stage,
                "offload": fabric.strategy.zero_config.offload,
                "weights": weights,
            },
            sys.argv[1],
        )
